"""The train tests' inputs, built once per session: a prepare output of 16 real ShareGPT chats (SmolLM2
tokenizer, W = 512), the real SmolLM2 in fp32, and a tiny random Llama target saved as an HF directory."""

from __future__ import annotations

import pytest
import torch

from tests.data import run_prepare, write_sharegpt_chats
from tests.models import save_tiny


@pytest.fixture(scope="session")
def smol_prep(tmp_path_factory, smollm2_dir):
    tmp = tmp_path_factory.mktemp("train_prep")
    return run_prepare(tmp / "run", write_sharegpt_chats(tmp / "chats.jsonl", 16), max_length=128, draft_vocab=512)


@pytest.fixture(scope="session")
def smol_model(smollm2_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory, smollm2_dir, smol_prep):
    """A tiny random Llama whose LM-head rows outside the draft vocabulary are zero, so its top-1
    usually lies inside the vocabulary and every position trains (random heads pick any of 49k)."""
    from transformers import AutoModelForCausalLM

    from eyas.prepared import Prepared

    out = save_tiny("llama", tmp_path_factory.mktemp("tiny") / "tiny", smollm2_dir, layers=6,
                    max_positions=2048)
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    with torch.no_grad():
        model.lm_head.weight[~Prepared(smol_prep).t2d] = 0
    model.save_pretrained(str(out))
    return out
