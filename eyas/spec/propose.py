"""The draft side of a round: step 0 on newly committed positions, then a chain or an EAGLE-2 tree.

Legend: S new positions, K aux layers / chain length (by context), D hidden, W draft vocab,
M tree candidates, F frontier nodes (those expanded at the next level).

EAGLE-3 inputs. Step 0 at position t takes h_t = fc(target aux states at t, in layer-id order)
and the embedding of token t+1, and predicts token t+2. With L tokens known, step 0 runs over
every position whose input became final since the last round (committed .. L-2); its output at
L-2 predicts token L, the first draft token after the root tokens[L-1]. A later step feeds back
the previous step's pre-norm output as h and the previous draft token (a target id, via d2t) as
the token; step i >= 1 sits at position L-2+i (each token's real sequence position).

`draft` is an `eyas.draft.Eagle3Draft` or anything with the same `fuse`, `forward_step`, `logits`
and `d2t` (tests/spec/known_drafts.py has a control draft that runs the target).

A sliding-window draft (config.sliding_window > 0) gets the positions of every key it attends to
(`window_kw`): the committed entries sit at their own positions (cache index = position, as the
step-0 entries are appended in order), a chain's scratch entries too, a tree's level-l nodes all at
last_pos + l.
"""

from __future__ import annotations

import torch

from eyas.spec.cache import DraftCache
from eyas.spec.sampling import logits_to_probs, sample
from eyas.spec.tree import Tree, select_nodes


def to_target_ids(draft, draft_ids: torch.Tensor) -> torch.Tensor:
    """target id = d + d2t[d] (eyas.vocab's convention, shared with vLLM / SGLang).

    A gather, not `d2t[d]`: indexing with a 0-d tensor (a chain's argmax or sample) calls .item(),
    a host sync per draft token."""
    return draft_ids + draft.d2t.index_select(0, draft_ids.reshape(-1)).view(draft_ids.shape)


def window_kw(draft, key_pos: torch.Tensor) -> dict:
    """forward_step's key_pos for a sliding-window draft; nothing for any other (a draft without a
    window, or a control draft whose forward_step takes no key_pos)."""
    return {"key_pos": key_pos} if getattr(getattr(draft, "config", None), "sliding_window", 0) else {}


def extend(
    draft, dcache: DraftCache, next_tokens_S: torch.Tensor, aux_SKD: torch.Tensor, start_pos: int
) -> torch.Tensor:
    """Step 0 over positions start_pos .. start_pos+S-1 with inputs (fc(aux_t), token t+1).

    next_tokens_S[i] is token start_pos+i+1. The new entries are committed: they are final.
    Returns the pre-norm output at the last position, [1, 1, D].
    """
    assert start_pos == dcache.committed == len(dcache), (start_pos, dcache.committed, len(dcache))
    s = next_tokens_S.shape[0]
    h_1SD = draft.fuse(aux_SKD.unsqueeze(0))
    pos_1S = torch.arange(start_pos, start_pos + s, device=h_1SD.device).unsqueeze(0)
    # row i sees all committed entries and the new ones up to itself
    mask_1SP = torch.ones(s, start_pos + s, dtype=torch.bool, device=h_1SD.device).tril(start_pos).unsqueeze(0)
    key_pos = torch.arange(start_pos + s, device=h_1SD.device)
    pre_1SD, k, v = draft.forward_step(next_tokens_S.unsqueeze(0), h_1SD, pos_1S, dcache.k, dcache.v, mask_1SP,
                                       **window_kw(draft, key_pos))
    dcache.append(k, v)
    dcache.commit()
    return pre_1SD[:, -1:]


def draft_chain(
    draft,
    dcache: DraftCache,
    h_11D: torch.Tensor,
    last_pos: int,
    num_tokens: int,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """K draft tokens, each from the previous step's output; `last_pos` = position of h_11D.

    Greedy (T = 0): argmax of the draft logits. Sampling: x_i ~ q_i = softmax(logits_i / T), and
    q_i is returned for the acceptance rule. -> (target ids [K], q [K, W] or None).
    """
    assert len(dcache) == dcache.committed, "draft scratch entries left from an earlier round"
    tokens, qs = [], []
    h = h_11D
    logits_W = draft.logits(h)[0, 0]
    for i in range(num_tokens):
        if temperature == 0:
            d = logits_W.argmax(-1)
        else:
            q_W = logits_to_probs(logits_W, temperature)
            d = sample(q_W, generator)
            qs.append(q_W)
        tok = to_target_ids(draft, d)
        tokens.append(tok)
        if i + 1 == num_tokens:
            break
        pos_11 = torch.full((1, 1), last_pos + i + 1, device=h.device)
        mask_11P = torch.ones(1, 1, len(dcache) + 1, dtype=torch.bool, device=h.device)
        key_pos = torch.arange(len(dcache) + 1, device=h.device)  # entry j at position j; this step's at last_pos+i+1
        h, k, v = draft.forward_step(tok.view(1, 1), h, pos_11, dcache.k, dcache.v, mask_11P, **window_kw(draft, key_pos))
        dcache.append(k, v)
        logits_W = draft.logits(h)[0, 0]
    return torch.stack(tokens), (torch.stack(qs) if qs else None)


def draft_tree(
    draft,
    dcache: DraftCache,
    h_11D: torch.Tensor,
    root: int,
    last_pos: int,
    top_k: int,
    depth: int,
    total_tokens: int,
) -> Tree:
    """EAGLE-2 dynamic tree (Li et al. 2024), as the EAGLE reference's `topK_genrate`:

    level 1: the top-k draft tokens after the root, scored by their log-prob;
    level d -> d+1 (d < depth): run the draft once on the F = top-k frontier nodes of level d
      (each sees the committed prefix, its ancestors and itself), give each its top-k children
      with cumulative score = parent score + log q(child), and take as the next frontier the
      top-k of those F * k children by cumulative score;
    finally keep the `total_tokens` best of all candidates (`select_nodes`). A node's score is the
    draft's estimate of the log-probability that the whole path to it is accepted.
    """
    assert len(dcache) == dcache.committed, "draft scratch entries left from an earlier round"
    device = h_11D.device
    lp_W = torch.log_softmax(draft.logits(h_11D)[0, 0].float(), dim=-1)
    k = min(top_k, lp_W.shape[-1])
    top = lp_W.topk(k)
    frontier_scores_F = top.values
    frontier_tokens_F = to_target_ids(draft, top.indices)
    frontier_cands_F = torch.arange(k, device=device)  # candidate index of each frontier node
    frontier_h_1FD = h_11D.expand(1, k, h_11D.shape[-1])
    anc_FS = torch.zeros(k, 0, dtype=torch.bool, device=device)  # frontier x scratch cache entries
    scratch_pos = torch.zeros(0, dtype=torch.long, device=device)  # position of each scratch entry
    cand_tokens, cand_parents = [frontier_tokens_F], [torch.full((k,), -1, device=device)]
    cand_scores, cand_depths = [frontier_scores_F], [torch.full((k,), 1, device=device)]
    num_cands = k
    for level in range(1, depth):
        f = frontier_tokens_F.shape[0]
        mask_FP = torch.cat(
            [
                torch.ones(f, dcache.committed, dtype=torch.bool, device=device),
                anc_FS,
                torch.eye(f, dtype=torch.bool, device=device),
            ],
            dim=1,
        )
        pos_1F = torch.full((1, f), last_pos + level, device=device)
        key_pos = torch.cat([torch.arange(dcache.committed, device=device), scratch_pos, pos_1F[0]])
        pre_1FD, k_new, v_new = draft.forward_step(
            frontier_tokens_F.unsqueeze(0), frontier_h_1FD, pos_1F, dcache.k, dcache.v, mask_FP.unsqueeze(0),
            **window_kw(draft, key_pos)
        )
        dcache.append(k_new, v_new)
        scratch_pos = torch.cat([scratch_pos, pos_1F[0]])
        lp_FW = torch.log_softmax(draft.logits(pre_1FD)[0].float(), dim=-1)
        top = lp_FW.topk(k)
        cum_Fk = frontier_scores_F[:, None] + top.values
        child_tokens_Fk = to_target_ids(draft, top.indices)
        cand_tokens.append(child_tokens_Fk.flatten())
        cand_parents.append(frontier_cands_F.repeat_interleave(k))
        cand_scores.append(cum_Fk.flatten())
        cand_depths.append(torch.full((f * k,), level + 1, device=device))
        if level + 1 == depth:
            break
        best = cum_Fk.flatten().topk(min(k, f * k))
        parent_rows = best.indices // k
        frontier_cands_F = num_cands + best.indices
        num_cands += f * k
        frontier_scores_F = best.values
        frontier_tokens_F = child_tokens_Fk.flatten()[best.indices]
        frontier_h_1FD = pre_1FD[:, parent_rows]
        anc_FS = torch.cat([anc_FS[parent_rows], torch.eye(f, dtype=torch.bool, device=device)[parent_rows]], dim=1)
    # one host sync for the whole tree: the node lists become Python lists
    return select_nodes(
        root,
        torch.cat(cand_tokens).tolist(),
        torch.cat(cand_parents).tolist(),
        torch.cat(cand_scores),
        torch.cat(cand_depths).tolist(),
        total_tokens,
    )
