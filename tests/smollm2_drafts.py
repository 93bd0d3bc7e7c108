"""Drafts sized for the real SmolLM2-135M config, exported as for that target (tests/test_draft_files.py,
tests/test_export.py and the vLLM controls in tests/vllm_serving.py).

* `smollm2_draft`: an untrained draft (models.random_draft) with SmolLM2's default aux layers and a
  W = 512 vocabulary of random target ids, its norm weights away from 1 so that a swapped norm
  tensor shows in the outputs; it has no target embedding (a zero one) and is left trainable.
* `export`: eyas.draft_files.export_draft with SmolLM2 as the verifier.
"""

from __future__ import annotations

from eyas.draft_files import export_draft
from tests.models import random_draft

L = 30  # SmolLM2-135M layers
AUX = [2, 15, 27]


def smollm2_draft(tcfg, draft_vocab: int = 512, aux_layer_ids=tuple(AUX), seed: int = 0, **overrides):
    return random_draft(tcfg, aux_layer_ids=aux_layer_ids, seed=seed, draft_vocab=draft_vocab, norm_range=(0.5, 1.5),
                        frozen=False, **overrides)  # fmt: skip


def export(draft, out, **kw):
    kw.setdefault("num_target_layers", L)
    kw.setdefault("verifier", "HuggingFaceTB/SmolLM2-135M-Instruct")
    kw.setdefault("verifier_arch", ["LlamaForCausalLM"])
    return export_draft(draft, out, **kw)
