"""Greedy chain decoding simulated from one teacher-forced TTT forward: a train/serve check.

Legend: S tokens (prompt + output), K aux layers, D hidden, T TTT steps (= draft positions), W draft
vocab.

Why one forward is enough. Under greedy verification the chain decoder (eyas.spec.generate), with
L tokens known, drafts from row p = L-2: step 0's output at p predicts token L, draft i (0-based)
predicts token L+i = p+2+i. While the drafts are accepted, everything the draft sees is the
target's greedy output: draft i >= 1 reads the previous draft token (accepted, so token p+1+i) and
the previous step's pre-norm output, at RoPE position p+i, attending to the committed step-0
entries of positions 0..p and to its own earlier steps of this pass. That is TTT step i at row p
of eyas.ttt (token ids[t+1+i], position pos_t+i, keys: step 0 of rows <= t and the diagonal
of row t). So on the target's greedy output `seq`, a pass accepts

    n = the number of leading steps i < k whose top-1 at row p, as a target id, is seq[p+2+i],

then emits seq[p+2+n] (correction, or bonus when n = k), and the next pass starts at L + n + 1.
The prefill emits seq[S_prompt], so the first pass has L = S_prompt + 1 (p = S_prompt - 1), and
passes run while L < end (the decoder stops once the output holds `end - S_prompt` tokens or its
stop token, which is at end-1). After the first miss the decoder's drafts differ from the
teacher-forced ones, but they are rejected anyway.

The only input that differs: the decoder's step 0 reads the target's aux states from KV-cached
verify forwards, the simulation from one plain forward. In float32 the accepted lengths are equal
pass for pass (tests/spec/test_simulate.py); in bf16 an argmax may flip where two logits nearly tie.

The tree decoder (EAGLE-2, eyas.spec.generate.tree_round) is simulated pass by pass instead
(`simulate_tree`): its trees hold draft tokens off the greedy path, which no single forward covers.
Each pass runs the real draft code (extend, draft_tree) on the draft cache as the decoder does, with
step 0's aux states taken from the same plain forward; only the target's verify forward is replaced
by the known greedy output: the walk (accept_greedy_tree) reads the target's argmax at a node only
when the path to it was accepted, i.e. equals the output, and then that argmax is the next output
token.

A pass whose drafts run past the known tokens (the last one: the decoder accepts drafts beyond the
cut output or the stop token, which `seq` does not hold) has only a lower bound on n
(`SimulatedChain.last_is_lower_bound`, `SimulatedTree.last_is_lower_bound`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eyas.spec.generate import SpecStats
from eyas.spec.propose import DraftCache, draft_tree, extend, to_target_ids
from eyas.spec.tree import Tree, accept_greedy_tree
from eyas.ttt import sdpa_masks, ttt_forward


def label_mask(num_steps: int, s: int, first_label: int = 0, device=None) -> torch.Tensor:
    """valid_TS: step i at row t predicts token t+2+i; True where that index is in [first_label, S)."""
    j_TS = torch.arange(s, device=device)[None] + 2 + torch.arange(num_steps, device=device)[:, None]
    return (j_TS >= first_label) & (j_TS < s)


@torch.no_grad()
def teacher_forced_steps(
    draft, aux_SKD: torch.Tensor, ids_S: torch.Tensor, num_steps: int, first_label: int = 0
) -> torch.Tensor:
    """correct_TS: TTT step i's top-1 at row t (mapped to a target id through d2t) == ids[t+2+i].

    One TTT forward (eyas.ttt.ttt_forward, SDPA masks) over the whole sequence at positions
    0..S-1; draft logits only where label_mask(.., first_label) holds, False elsewhere.
    """
    s = ids_S.shape[0]
    valid_TS = label_mask(num_steps, s, first_label, ids_S.device)
    pos_1S = torch.arange(s, device=ids_S.device)[None]
    doc_1S = torch.zeros_like(pos_1S)
    outs = ttt_forward(draft, aux_SKD[None], ids_S[None], pos_1S, sdpa_masks(doc_1S, num_steps, pos_1S, draft.config.sliding_window))
    correct_TS = torch.zeros_like(valid_TS)
    for i, prenorm_1SD in enumerate(outs):
        lo, hi = max(0, first_label - 2 - i), s - 2 - i  # rows whose label t+2+i is in [first_label, S)
        if hi <= lo:
            continue
        pred = to_target_ids(draft, draft.logits(prenorm_1SD[0, lo:hi]).argmax(-1))
        correct_TS[i, lo:hi] = pred == ids_S[lo + 2 + i : hi + 2 + i]
    return correct_TS & valid_TS


@dataclass
class SimulatedChain:
    accepted: list[int]
    """Accepted draft tokens of each verify pass, in order."""
    last_is_lower_bound: bool
    """The last pass accepted every draft up to the end of the known tokens: its n is a lower bound."""
    k: int

    def stats(self, accepted: list[int] | None = None) -> SpecStats:
        """The decoder's counters for these passes (num_tested = min(n + 1, k), as chain_round)."""
        out = SpecStats()
        for n in self.accepted if accepted is None else accepted:
            out.add_pass(n, min(n + 1, self.k))
        return out

    def matches(self, dec: SpecStats) -> bool:
        """Same passes, accepted-length histogram and per-position counts as the decoder's `dec`.
        A lower-bound last pass takes the decoder's (from its new-token total) if it is >= the bound."""
        acc = list(self.accepted)
        if self.last_is_lower_bound:
            n_last = dec.new_tokens - sum(n + 1 for n in acc[:-1]) - 1
            if not acc[-1] <= n_last <= self.k:
                return False
            acc[-1] = n_last
        sim = self.stats(acc)
        fields = ("verify_passes", "new_tokens", "accept_counts", "reached", "accepted")
        return all(getattr(sim, f) == getattr(dec, f) for f in fields)


def simulate_chain(correct_TS: torch.Tensor, start: int, end: int, k: int) -> SimulatedChain:
    """The greedy chain decoder's passes with k drafts each, for a prompt of `start` tokens whose
    decoding stops at `end` tokens (see the module docstring); correct_TS from
    `teacher_forced_steps` over S >= end tokens, T >= k steps."""
    num_steps, s = correct_TS.shape
    assert k <= num_steps and start < end <= s, (k, num_steps, start, end, s)
    c = correct_TS[:k].tolist()  # one host copy; the walk below is scalar
    accepted, lower = [], False
    L = start + 1
    while L < end:
        p, n = L - 2, 0
        while n < k and c[n][p]:
            n += 1
        lower = n < k and L + n >= s  # the first miss would be at a token seq does not hold
        accepted.append(n)
        L += n + 1
    return SimulatedChain(accepted, lower, k)


@dataclass
class SimulatedTree:
    accepted: list[int]
    """Accepted draft tokens of each verify pass, in order."""
    tested: list[int]
    """Draft positions each pass tested (tree_round's num_tested: the path, plus one when the last
    accepted node has children)."""
    last_is_lower_bound: bool
    """The last pass's walk reached the end of the known tokens: its n is a lower bound."""
    depth: int
    """The tree's depth: the most a pass can accept."""

    def stats(self, accepted: list[int] | None = None, tested: list[int] | None = None) -> SpecStats:
        out = SpecStats()
        accepted = self.accepted if accepted is None else accepted
        for n, t in zip(accepted, self.tested if tested is None else tested):
            out.add_pass(n, t)
        return out

    def matches(self, dec: SpecStats) -> bool:
        """Same passes and counters as the tree decoder's `dec`. A lower-bound last pass takes the
        decoder's count there (from its new-token total) if it is between the bound and the depth;
        it tested that many positions, or one more where the last accepted node had children, which
        the simulation did not see: either matches."""
        fields = ("verify_passes", "new_tokens", "accept_counts", "reached", "accepted")
        if not self.last_is_lower_bound:
            sim = self.stats()
            return all(getattr(sim, f) == getattr(dec, f) for f in fields)
        n_last = dec.new_tokens - sum(n + 1 for n in self.accepted[:-1]) - 1
        if not self.accepted[-1] <= n_last <= self.depth:
            return False
        accepted = [*self.accepted[:-1], n_last]
        for t_last in {n_last, min(n_last + 1, self.depth)}:
            sim = self.stats(accepted, [*self.tested[:-1], t_last])
            if all(getattr(sim, f) == getattr(dec, f) for f in fields):
                return True
        return False


def greedy_walk_argmax(tree: Tree, seq: list[int], root_pos: int) -> list[int]:
    """The target's argmax after each node, where the walk can read it: at a node whose path from
    the root (at position root_pos, = seq[root_pos]) equals seq, the next token of seq; -1 elsewhere
    (off the greedy path, or past the known tokens)."""
    on_path = [False] * tree.num_nodes
    argmax = [-1] * tree.num_nodes
    for i, (tok, parent, depth) in enumerate(zip(tree.tokens, tree.parents, tree.depths)):
        pos = root_pos + depth
        on_path[i] = pos < len(seq) and seq[pos] == tok and (parent < 0 or on_path[parent])
        if on_path[i] and pos + 1 < len(seq):
            argmax[i] = seq[pos + 1]
    return argmax


@torch.no_grad()
def simulate_tree(
    draft, aux_SKD: torch.Tensor, ids_S: torch.Tensor, start: int, end: int, top_k: int, depth: int, total_tokens: int
) -> SimulatedTree:
    """The greedy tree decoder's passes for a prompt of `start` tokens whose decoding stops at `end`
    tokens, on the known greedy sequence ids_S (S >= end) with the target's aux states aux_SKD of a
    plain forward over it (see the module docstring)."""
    s = ids_S.shape[0]
    assert start < end <= s and aux_SKD.shape[0] == s, (start, end, s, tuple(aux_SKD.shape))
    seq = ids_S.tolist()
    dcache = DraftCache()
    accepted, tested, lower = [], [], False
    L = start + 1  # the prefill emitted seq[start]
    while L < end:
        c = dcache.committed  # step 0 on positions c..L-2, as speculative_generate
        h_11D = extend(draft, dcache, ids_S[c + 1 : L], aux_SKD[c : L - 1], c)
        tree = draft_tree(draft, dcache, h_11D, seq[L - 1], L - 2, top_k, depth, total_tokens)
        dcache.rollback()
        argmax = greedy_walk_argmax(tree, seq, L - 1)
        path, tok = accept_greedy_tree(tree, torch.tensor(argmax))
        lower = tok < 0  # the walk stopped only because the known tokens ended
        accepted.append(len(path))
        tested.append(len(path) + (1 if tree.children()[path[-1] if path else 0] else 0))
        L += len(path) + 1
    return SimulatedTree(accepted, tested, lower, depth)
