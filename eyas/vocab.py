"""The draft vocabulary: the W most frequent target tokens over loss-masked positions, and moving a
draft from one draft vocabulary to another.

Conventions shared by the EAGLE-3 reference, vLLM and SGLang:
    draft ids are the selected target ids sorted ascending;
    d2t[d] = target_id(d) - d            (int64 offsets, length W):  target = d + d2t[d]
    t2d[t] = t is in the draft vocab      (bool, length V)

Legend: V target vocab, W / U draft vocabs, D hidden.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from eyas.draft import Eagle3Draft
from eyas.errors import ArtifactError


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


def target_head_rows(lm_head_VD: torch.Tensor, d2t: torch.Tensor) -> torch.Tensor:
    """The target's lm_head rows of the draft vocabulary's tokens, in draft-id order -> W x D
    (float32, on the CPU; only those rows leave the target's device)."""
    ids_W = draft_to_target(torch.arange(d2t.numel()), d2t.cpu())
    return lm_head_VD.detach()[ids_W.to(lm_head_VD.device)].cpu().float()


def remap_head(
    head_UD: torch.Tensor, src_d2t: torch.Tensor, d2t: torch.Tensor, lm_head_VD: torch.Tensor
) -> tuple[torch.Tensor, dict[str, int]]:
    """A trained draft's lm_head (U rows: draft ids of `src_d2t`) -> one for the draft vocab `d2t`
    (W rows) and {copied, new}: a token both hold keeps its trained row; each other row is the
    target's row of that token times M, the least-squares fit of target rows -> trained rows on the
    shared tokens (float32, on the CPU). None shared is refused: nothing would carry over."""
    ids_W = draft_to_target(torch.arange(d2t.numel()), d2t.cpu())
    row_W = draft_rows(src_d2t.cpu(), lm_head_VD.shape[0])[ids_W]
    shared_W = row_W >= 0
    n_shared = int(shared_W.sum())
    if n_shared == 0:
        raise ArtifactError("train.init_vocab=remap: the two draft vocabularies share no token")
    trained_UD = head_UD.detach().cpu().float()
    target_WD = target_head_rows(lm_head_VD, d2t)
    out_WD = torch.empty(ids_W.numel(), trained_UD.shape[1])
    out_WD[shared_W] = trained_UD[row_W[shared_W]]
    if n_shared < ids_W.numel():
        fit_DD = torch.linalg.lstsq(target_WD[shared_W], trained_UD[row_W[shared_W]], driver="gelsd").solution
        out_WD[~shared_W] = target_WD[~shared_W] @ fit_DD
    return out_WD, {"copied": n_shared, "new": ids_W.numel() - n_shared}


def with_vocab(draft: Eagle3Draft, d2t: torch.Tensor, lm_head_VD: torch.Tensor) -> tuple[Eagle3Draft, dict[str, int]]:
    """`draft` moved to the draft vocabulary `d2t` (W = len(d2t): another selection, or the whole
    vocabulary with d2t all zeros) -> a new draft with the same layers, dtype and device and its
    lm_head by token (`remap_head`), and {copied, new}. What --train.init_vocab=remap does at a
    training's start, for a draft outside any training (tools/draft_variants.py). `lm_head_VD` must
    be the draft's target's: its V and D are checked."""
    c = draft.config
    if tuple(lm_head_VD.shape) != (c.vocab_size, c.target_hidden_size):
        raise ValueError(f"with_vocab: the target lm_head is {tuple(lm_head_VD.shape)}, the draft's target has "
                         f"vocab_size {c.vocab_size} and hidden size {c.target_hidden_size}: pass the draft's own target")
    ids_W = draft_to_target(torch.arange(d2t.numel()), d2t.cpu())
    t2d = torch.zeros(c.vocab_size, dtype=torch.bool)
    t2d[ids_W] = True
    out = Eagle3Draft(replace(c, draft_vocab_size=d2t.numel()), draft.embed_weight)
    out.set_vocab(d2t.cpu(), t2d)
    out.to(device=draft.fc.weight.device, dtype=draft.fc.weight.dtype)
    head_WD, counts = remap_head(draft.lm_head.weight, draft.d2t, d2t, lm_head_VD)
    trained = dict(draft.named_parameters())
    with torch.no_grad():
        for name, p in out.named_parameters():
            p.copy_(head_WD if name == "lm_head.weight" else trained[name])
    return out, counts
