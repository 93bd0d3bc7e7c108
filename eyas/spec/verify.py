"""The target side: forwards with a KV cache that also return the EAGLE-3 aux hidden states.

Legend: S query tokens, P keys (cached + new), K aux layers, D target hidden, V target vocab.

Aux states are captured with `eyas.capture.HiddenStateCapture` (forward pre-hooks on the aux
layers: id k = the state entering decoder layer k), the same code the extract stage uses, so the
draft sees at inference exactly what it was trained on. A tree is verified with a 4-D additive
float mask (0 = attend, dtype-min = blocked): transformers hands a 4-D mask to the attention
implementation as is, and a float mask means the same to "eager" and "sdpa".
"""

from __future__ import annotations

import inspect
from functools import lru_cache
from typing import Any

import torch

from eyas.errors import EyasError

TREE_ATTENTION = ("eager", "sdpa", "eyas_slots")  # eyas_slots: eyas.spec.static (falls back to sdpa)


@lru_cache(maxsize=None)
def _cache_kwarg(forward_cls: type) -> str:
    """Newer transformers (5.24 here) call the KV cache argument `cache`; older ones (4.56 - 5.1x)
    `past_key_values` (which 5.24 still takes, with a deprecation warning)."""
    params = inspect.signature(forward_cls.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def new_cache(target):
    from transformers import DynamicCache

    return DynamicCache(config=target.config)


def check_tree_attention(target) -> None:
    impl = getattr(target.config, "_attn_implementation", None)
    if impl not in TREE_ATTENTION:
        raise EyasError(
            f"tree verification needs a custom 4-D attention mask, which attn_implementation={impl!r} "
            f"does not take; load the target with one of {TREE_ATTENTION} (or use --evaluate.mode=chain)"
        )


def additive_mask(mask_SP: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """bool [S, P] (True = attend) -> float [1, 1, S, P] with 0 / dtype-min."""
    neg = torch.finfo(dtype).min
    return torch.zeros(mask_SP.shape, dtype=dtype, device=mask_SP.device).masked_fill(~mask_SP, neg)[None, None]


@torch.no_grad()
def target_forward(
    target,
    ids_S: torch.Tensor,
    pos_S: torch.Tensor,
    cache,
    capture=None,
    mask_SP: torch.Tensor | None = None,
    logits_to_keep: int = 0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One target forward that appends S tokens to `cache`.

    mask_SP: bool [S, cached + S] for trees; None = causal. capture: a HiddenStateCapture or None.
    -> (logits [S or logits_to_keep, V], aux [S, K, D] or None).
    """
    kwargs: dict[str, Any] = {
        "input_ids": ids_S.unsqueeze(0),
        "position_ids": pos_S.unsqueeze(0),
        _cache_kwarg(type(target)): cache,
        "use_cache": True,
    }
    if mask_SP is not None:
        s = ids_S.shape[0]
        assert mask_SP.shape == (s, int(cache.get_seq_length()) + s), (tuple(mask_SP.shape), s)
        kwargs["attention_mask"] = additive_mask(mask_SP, target.dtype)
    if logits_to_keep:
        kwargs["logits_to_keep"] = logits_to_keep
    if capture is None:
        return target(**kwargs).logits[0], None
    with capture:
        logits = target(**kwargs).logits[0]
    aux_1SKD, _ = capture.result()
    capture.clear()
    return logits, aux_1SKD[0]
