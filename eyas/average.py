"""Weight averaging of drafts (`eyas export --export.average_with=[DIR,...]`).

Drafts trained one from the other (`train.init_from`, each a fresh learning-rate schedule) end
near one another; their mean is often better than the last (stochastic weight averaging over
the ends of the schedules, Izmailov et al. 2018). On SmolLM2-135M a draft that simulates at
MT-bench chain tau 3.82 gave 3.84 averaged with the draft it started from (docs/benchmarks.md);
averages of drafts farther apart lost.

Every tensor of the exported draft becomes the mean over the drafts. The lm_head is averaged by
target token: the row of draft-vocabulary id r (target token r + d2t[r]) is the mean over the
drafts whose vocabulary holds that token; a token the others lack keeps the trained draft's row.
The exported draft keeps the trained draft's vocabulary (d2t/t2d), so it still matches prepare.

Legend: W draft vocab (each draft its own), V target vocab, D hidden.
"""

from __future__ import annotations

from typing import Any

import torch

from eyas.draft import SHAPE_FIELDS, Eagle3Draft
from eyas.errors import ArtifactError
from eyas.vocab import draft_rows, draft_to_target

# what every averaged draft must share: the shape, whatever the vocabulary, and what the layer computes
SAME_FIELDS = tuple(f for f in SHAPE_FIELDS if f != "draft_vocab_size") + (
    "hidden_act", "rms_norm_eps", "rope_theta", "rope_scaling", "max_position_embeddings")
NOT_AVERAGED = ("d2t", "t2d", "embed_weight", "lm_head.weight")


def float_state(model: Eagle3Draft) -> dict[str, torch.Tensor]:
    """The state_dict on the CPU, floating-point tensors in float32 (d2t stays int64, t2d bool)."""
    return {k: (v.float() if v.is_floating_point() else v).detach().cpu() for k, v in model.state_dict().items()}


def average_drafts(model: Eagle3Draft, others: list[Eagle3Draft], names: list[str]) -> list[dict[str, Any]]:
    """`model`'s weights replaced (in place) by the mean of it and `others` (named by `names` in
    errors); returns per other draft how many of model's lm_head rows it shared."""
    c = model.config
    for other, name in zip(others, names, strict=True):
        diff = [f"{f} {getattr(other.config, f)} (trained draft: {getattr(c, f)})"
                for f in SAME_FIELDS if getattr(other.config, f) != getattr(c, f)]
        if diff:
            raise ArtifactError(f"export.average_with: {name} is not the same draft architecture: {'; '.join(diff)}")
    sd = float_state(model)
    sums = {k: v.clone() for k, v in sd.items() if k not in NOT_AVERAGED}
    token_of_row_W = draft_to_target(torch.arange(c.draft_vocab_size), sd["d2t"])
    head_sum_WD = sd["lm_head.weight"].clone()
    count_W = torch.ones(c.draft_vocab_size)
    shared = []
    for other in others:
        osd = float_state(other)
        for k in sums:
            sums[k] += osd[k]
        rows_W = draft_rows(osd["d2t"], c.vocab_size)[token_of_row_W]
        have_W = rows_W >= 0
        head_sum_WD[have_W] += osd["lm_head.weight"][rows_W[have_W]]
        count_W += have_W.float()
        shared.append(int(have_W.sum()))
    n = 1 + len(others)
    averaged = {k: (v / n) for k, v in sums.items()}
    averaged["lm_head.weight"] = head_sum_WD / count_W[:, None]
    with torch.no_grad():
        for k, p in model.state_dict().items():
            if k in averaged:
                p.copy_(averaged[k].to(p.dtype))
    return [{"lm_head_rows_shared": s} for s in shared]

