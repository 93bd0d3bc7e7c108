"""eyas.train.target_weights: the target's embedding and LM head read without loading the model."""

from __future__ import annotations

import torch


def test_embedding_and_head_without_loading_the_model(smollm2_dir, smol_model, tiny_target):
    from transformers import AutoModelForCausalLM

    from eyas.config.target import TargetConfig
    from eyas.train.target_weights import load_embed_and_head

    emb, head = load_embed_and_head(TargetConfig(model=str(smollm2_dir)))  # tied
    assert head is emb
    torch.testing.assert_close(emb.float(), smol_model.get_input_embeddings().weight)
    emb, head = load_embed_and_head(TargetConfig(model=str(tiny_target)))  # untied
    ref = AutoModelForCausalLM.from_pretrained(str(tiny_target), dtype=torch.float32)
    assert torch.equal(emb, ref.model.embed_tokens.weight) and torch.equal(head, ref.lm_head.weight)
