"""The lossless check of greedy decoding: every speculative output against target-only greedy
decoding, token for token; each first difference scored by a plain forward of the target, so that
a near-tie of the target's two best logits (the numerics of a multi-token verify against a
one-token decode in bf16/fp16) is told apart from a real difference."""

from __future__ import annotations

import math
from typing import Any

import torch

from eyas.errors import EyasError


class LosslessError(EyasError):
    """Greedy speculative output differs from target-only greedy output."""


def first_divergence(spec: list[int], ref: list[int]) -> int | None:
    """Index of the first differing new token (a length difference counts), None when equal."""
    for i, (a, b) in enumerate(zip(spec, ref)):
        if a != b:
            return i
    return None if len(spec) == len(ref) else min(len(spec), len(ref))


def compare(spec: list[int], ref: list[int]) -> dict[str, Any] | None:
    """None when equal, else the first diverging new-token index and both tokens there."""
    pos = first_divergence(spec, ref)
    if pos is None:
        return None
    return {
        "position": pos,
        "speculative": spec[pos] if pos < len(spec) else None,
        "target_only": ref[pos] if pos < len(ref) else None,
    }


def tie_tolerance(ec, dtype: torch.dtype) -> float:
    if ec.tie_tolerance >= 0:
        return ec.tie_tolerance
    return {torch.bfloat16: 2**-6, torch.float16: 2**-9}.get(dtype, 1e-4)


def tie_scale(la: float, lb: float) -> float:
    """The power of two just above the largest of |la|, |lb| and 1: the top of the larger's binade.

    A float's spacing is constant within a binade [2^e, 2^(e+1)), so 2^-6 x 2^(e+1) is four units
    in the last place of a bfloat16 anywhere in it (2^-9: of a float16). Scaling by the magnitude
    itself would allow four units at the top of a binade but only 2.8 at 1.4 x its bottom."""
    return math.ldexp(1.0, math.frexp(max(abs(la), abs(lb), 1.0))[1])


@torch.no_grad()
def score_divergence(target, prompt_ids: list[int], ref: list[int], diff: dict[str, Any], rel_tol: float) -> dict[str, Any]:
    """The target's logits for the two tokens chosen at a first difference, from a plain forward
    (no cache, one pass) of the prompt and the common prefix; near_tie when they are within
    rel_tol x tie_scale(both logits) of each other and the better of them is as close to
    the forward's top logit (else both decoders missed the top token: not a tie, a bug they share).
    A length difference (one output ended) is never a tie."""
    a, b = diff["target_only"], diff["speculative"]
    if a is None or b is None:
        return {"near_tie": False}
    device = target.get_input_embeddings().weight.device
    ids = torch.tensor([prompt_ids + ref[: diff["position"]]], device=device)
    logits_V = target(input_ids=ids, use_cache=False, logits_to_keep=1).logits[0, -1].float()
    la, lb, top = float(logits_V[a]), float(logits_V[b]), float(logits_V.max())
    gap, scale = abs(la - lb), tie_scale(la, lb)
    tol = rel_tol * scale
    return {"logit_target_only": la, "logit_speculative": lb, "logit_gap": gap, "logit_top": top,
            "plain_forward_top1": int(logits_V.argmax()), "near_tie": gap <= tol and top - max(la, lb) <= tol}


def check_lossless(results: dict[str, Any], rel_tol: float, where) -> None:
    """LosslessError naming the first difference that is not a near-tie, if there is one."""
    if results["lossless_up_to_ties"] is not False:
        return
    d = results["first_unexplained_divergence"]
    n_bad = results["num_divergent"] - results["num_divergent_near_tie"]
    logits = (f"; the target's plain forward scores them {d['logit_speculative']:.4f} vs {d['logit_target_only']:.4f} "
              f"(gap {d['logit_gap']:.4f} > tie_tolerance {rel_tol:g} relative)" if "logit_gap" in d else
              " (one output ended before the other)")
    raise LosslessError(
        f"{n_bad} greedy speculative output(s) differ from target-only greedy decoding beyond a near-tie; first: "
        f"mode {d['mode']}, question {d['id']} turn {d['turn']}, new token #{d['position']}: speculative "
        f"{d['speculative']} vs target-only {d['target_only']}{logits} (all in {where})"
    )
