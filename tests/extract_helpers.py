"""Tiny random-weight HF targets for the extract/capture tests (real transformers classes, no mocks).

Each model is saved with `save_pretrained` next to the real SmolLM2 tokenizer (vocab 49152), so
`eyas prepare` and `eyas extract` can run on it like on any local model directory.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

VOCAB = 49152
ARCHS = ("llama", "qwen2", "qwen3", "mistral", "gemma", "gemma2", "deepseek_v3")


def tiny_config(arch: str, num_layers: int = 8, hidden: int = 64):
    import transformers as tf

    common = dict(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    if arch == "llama":
        return tf.LlamaConfig(**common)
    if arch == "qwen2":
        return tf.Qwen2Config(**common)
    if arch == "qwen3":
        return tf.Qwen3Config(head_dim=16, **common)
    if arch == "mistral":
        return tf.MistralConfig(sliding_window=32, **common)
    if arch == "gemma":
        return tf.GemmaConfig(head_dim=16, **common)
    if arch == "gemma2":
        return tf.Gemma2Config(head_dim=16, sliding_window=32, query_pre_attn_scalar=16, **common)
    if arch == "deepseek_v3":  # MLA (low-rank q/kv, split rope/nope heads) + MoE after the first dense layer
        common.update(num_key_value_heads=4)
        return tf.DeepseekV3Config(
            moe_intermediate_size=32,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_shared_experts=1,
            n_group=1,
            topk_group=1,
            first_k_dense_replace=1,
            q_lora_rank=32,
            kv_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=8,
            **common,
        )
    raise ValueError(arch)


def tiny_model(arch: str, seed: int = 0, **kw):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, **kw), dtype=torch.float32)
    # Random init at std 0.02 leaves the residual stream tiny; larger weights make the layers matter.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2 and "embed" not in name:
                p.normal_(0, 0.08)
    return model.eval()


def save_tiny(arch: str, out: str | Path, tokenizer_dir: str | Path, **kw) -> Path:
    """A tiny `arch` model + the SmolLM2 tokenizer and chat template in `out` (an HF model dir)."""
    from transformers import AutoTokenizer

    out = Path(out)
    model = tiny_model(arch, **kw)
    model.save_pretrained(str(out), safe_serialization=True)
    AutoTokenizer.from_pretrained(str(tokenizer_dir)).save_pretrained(str(out))
    return out


def write_chats(path: str | Path, n: int, seed: int = 0, max_words: int = 120) -> Path:
    """n ShareGPT-style conversations of varied lengths (deterministic)."""
    import random

    rng = random.Random(seed)
    words = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex jumbled boxes".split()
    with open(path, "w", encoding="utf-8") as f:
        for i in range(n):
            turns = []
            for t in range(rng.choice([2, 2, 4])):
                k = rng.randint(3, max_words)
                turns.append({"from": "human" if t % 2 == 0 else "gpt", "value": " ".join(rng.choices(words, k=k))})
            f.write(json.dumps({"id": f"c{i}", "conversations": turns}) + "\n")
    return Path(path)


def subprocess_env() -> dict[str, str]:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"  # see one_thread in the tests
    env["TOKENIZERS_PARALLELISM"] = "false"
    return env


class Poison:
    """A forward pre-hook raising `exc` on any batch holding `tokens` (or on every call after the first `after`)."""

    def __init__(self, exc: BaseException, tokens: torch.Tensor | None = None, after: int = 0):
        self.exc, self.tokens, self.after = exc, tokens, after

    def __call__(self, module, args, kwargs):
        ids_BS = kwargs.get("input_ids", args[0] if args else None)
        if self.tokens is None:
            self.after -= 1
            if self.after < 0:
                raise self.exc
            return
        n = self.tokens.numel()
        rows = ids_BS.view(-1)[None] if ids_BS.shape[0] == 1 else ids_BS
        for row in rows:
            for start in range(0, row.numel() - n + 1):
                if torch.equal(row[start : start + n], self.tokens):
                    raise self.exc


def poison_backend(monkeypatch, poison: Poison):
    from eyas import extract

    real = extract.make_backend

    def make(cfg, setup, device):
        backend = real(cfg, setup, device)
        backend.base.register_forward_pre_hook(poison, with_kwargs=True)
        return backend

    monkeypatch.setattr(extract, "make_backend", make)
