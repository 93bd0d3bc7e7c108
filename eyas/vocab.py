"""The draft vocabulary: the W most frequent target tokens over loss-masked positions.

Conventions shared by the EAGLE-3 reference, vLLM and SGLang:
    draft ids are the selected target ids sorted ascending;
    d2t[d] = target_id(d) - d            (int64 offsets, length W):  target = d + d2t[d]
    t2d[t] = t is in the draft vocab      (bool, length V)
"""

from __future__ import annotations

import numpy as np
import torch


def token_counts(input_ids: np.ndarray, loss_mask: np.ndarray, vocab_size: int) -> np.ndarray:
    """How often each target id occurs at loss-masked positions: int64 [V]."""
    ids = input_ids[loss_mask.astype(bool)]
    if ids.size and int(ids.max()) >= vocab_size:
        raise ValueError(f"token id {int(ids.max())} >= target vocab size {vocab_size}")
    return np.bincount(ids, minlength=vocab_size).astype(np.int64)


def select_draft_tokens(counts: np.ndarray, k: int) -> np.ndarray:
    """Target ids of the draft vocab: the k most frequent (ties -> smaller id), sorted by id."""
    v = counts.shape[0]
    assert 1 <= k <= v, (k, v)
    order = np.lexsort((np.arange(v), -counts))  # primary key -count, then id
    return np.sort(order[:k]).astype(np.int64)


def d2t_t2d(selected: np.ndarray, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    sel = torch.as_tensor(selected, dtype=torch.int64)
    d2t = sel - torch.arange(sel.numel(), dtype=torch.int64)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[sel] = True
    return d2t, t2d


def draft_to_target(draft_ids: torch.Tensor, d2t: torch.Tensor) -> torch.Tensor:
    return draft_ids + d2t[draft_ids]


def draft_rows(d2t: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[V]: the draft id (lm_head row) of each target id, -1 outside the draft vocab. From d2t, so
    it also holds for a W == V draft whose rows are a permutation (target_to_draft assumes draft
    ids ascend in target order, as prepare makes them)."""
    rows = torch.full((vocab_size,), -1, dtype=torch.long)
    rows[draft_to_target(torch.arange(d2t.numel()), d2t)] = torch.arange(d2t.numel())
    return rows


def target_to_draft(target_ids: torch.Tensor, t2d: torch.Tensor) -> torch.Tensor:
    """Draft id of each target id, -1 where the target id is outside the draft vocab."""
    rank = torch.cumsum(t2d.to(torch.int64), 0) - 1
    return torch.where(t2d[target_ids], rank[target_ids], torch.full_like(target_ids, -1))


def coverage(counts: np.ndarray, selected: np.ndarray) -> float:
    total = int(counts.sum())
    return float(counts[selected].sum()) / total if total else 0.0
