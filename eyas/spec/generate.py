"""Speculative generation with an EAGLE-3 draft, and the target-only baseline it is measured against.

Legend: S prompt tokens, K chain length / aux layers (by context), N tree nodes (root included),
D hidden, V target vocab, W draft vocab.

One round, with L tokens known (target cache: positions 0..L-2; root = tokens[L-1]):
  1. draft: step 0 over the newly committed positions (inputs: the target's aux states of the
     accepted tokens and the next tokens), then a chain of K tokens or an EAGLE-2 tree; the draft's
     scratch entries are dropped again (only committed step-0 entries stay in its cache);
  2. verify: ONE target forward over root + drafts (chain: causal; tree: 4-D ancestor mask) gives
     the target's logits after every draft prefix and the aux states of every fed token;
  3. accept (eyas.spec.sampling / eyas.spec.tree): n accepted draft tokens + 1 emitted token
     (the correction, or the bonus after a fully accepted chain/path): n + 1 >= 1 new tokens;
  4. keep only root + accepted path in the target cache; the aux states of those n + 1 positions
     are the next round's step-0 inputs.

tau (acceptance length) = new tokens from verify passes / verify passes, pooled over prompts; the
prefill's first token is not counted (no verify pass produced it).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from eyas.capture import HiddenStateCapture
from eyas.spec.cache import DraftCache, cache_length, crop, keep_positions
from eyas.spec.propose import draft_chain, draft_tree, extend
from eyas.spec.sampling import (
    accept_greedy_chain,
    accept_sampling_chain,
    draft_probs_on_target_vocab,
    logits_to_probs,
    next_token,
)
from eyas.spec.tree import accept_greedy_tree, accept_sampling_tree, ancestor_mask
from eyas.spec.verify import check_tree_attention, new_cache, target_forward

MODES = ("chain", "tree")


def clock(device: torch.device) -> float:
    """perf_counter once the device has finished its queued work (a deliberate sync: timings)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


@dataclass(frozen=True)
class SpecParams:
    mode: str = "chain"
    num_draft_tokens: int = 7
    tree_total_tokens: int = 60
    tree_depth: int = 8
    tree_top_k: int = 10
    temperature: float = 0.0

    def __post_init__(self) -> None:
        assert self.mode in MODES, self.mode
        assert min(self.num_draft_tokens, self.tree_total_tokens, self.tree_depth, self.tree_top_k) >= 1
        assert self.temperature >= 0

    def max_round_tokens(self) -> int:
        """Most target-cache entries one verify pass appends (root + drafts)."""
        return 1 + (self.num_draft_tokens if self.mode == "chain" else self.tree_total_tokens)


@dataclass
class SpecStats:
    """Counts of one or more speculative generations (pool them with `merge`)."""

    verify_passes: int = 0
    new_tokens: int = 0
    """Tokens emitted by verify passes (accepted + 1 each), before the cut at stop/max_new_tokens."""
    accept_counts: list[int] = field(default_factory=list)
    """accept_counts[n] = verify passes that accepted exactly n draft tokens (gpt-fast's histogram)."""
    reached: list[int] = field(default_factory=list)
    """reached[i] = passes that tested a draft token at position i+1 (every earlier one accepted)."""
    accepted: list[int] = field(default_factory=list)
    """accepted[i] = passes that accepted the draft token at position i+1."""
    prefill_time_s: float = 0.0
    draft_time_s: float = 0.0
    verify_time_s: float = 0.0
    wall_s: float = 0.0

    def add_pass(self, num_accepted: int, num_tested: int) -> None:
        self.verify_passes += 1
        self.new_tokens += num_accepted + 1
        _bump(self.accept_counts, num_accepted)
        for i in range(num_tested):
            _bump(self.reached, i)
        for i in range(num_accepted):
            _bump(self.accepted, i)

    def merge(self, other: "SpecStats") -> None:
        self.verify_passes += other.verify_passes
        self.new_tokens += other.new_tokens
        for mine, theirs in (
            (self.accept_counts, other.accept_counts),
            (self.reached, other.reached),
            (self.accepted, other.accepted),
        ):
            for i, c in enumerate(theirs):
                _bump(mine, i, c)
        self.prefill_time_s += other.prefill_time_s
        self.draft_time_s += other.draft_time_s
        self.verify_time_s += other.verify_time_s
        self.wall_s += other.wall_s

    @property
    def tau(self) -> float:
        """Pooled acceptance length: new tokens / verify passes (not a mean of per-prompt ratios)."""
        return self.new_tokens / self.verify_passes if self.verify_passes else 0.0

    def acceptance_per_position(self) -> list[dict[str, float | int]]:
        """Per draft position i: P(accepted | reached) and P(accepted) over all passes."""
        out = []
        for i, r in enumerate(self.reached):
            a = self.accepted[i] if i < len(self.accepted) else 0
            out.append(
                {
                    "position": i + 1,
                    "reached": r,
                    "accepted": a,
                    "conditional": a / r if r else 0.0,
                    "unconditional": a / self.verify_passes if self.verify_passes else 0.0,
                }
            )
        return out


def _bump(counts: list[int], i: int, by: int = 1) -> None:
    counts.extend([0] * (i + 1 - len(counts)))
    counts[i] += by


@dataclass
class Generation:
    tokens: list[int]
    """The new tokens, cut after the first stop token and at max_new_tokens."""
    wall_s: float
    stats: SpecStats | None = None
    """None for target-only decoding."""


@dataclass
class Round:
    emitted: list[int]
    """Accepted draft tokens, then the correction/bonus token."""
    aux_AKD: torch.Tensor
    """Target aux states of root + accepted path: the next round's step-0 inputs."""
    num_accepted: int
    num_tested: int
    draft_s: float
    verify_s: float


def _finished(new: list[int], max_new_tokens: int, stop_ids: frozenset[int]) -> bool:
    return len(new) >= max_new_tokens or any(t in stop_ids for t in new)


def _cut(new: list[int], max_new_tokens: int, stop_ids: frozenset[int]) -> list[int]:
    new = new[:max_new_tokens]
    for i, t in enumerate(new):
        if t in stop_ids:
            return new[: i + 1]
    return new


class EagerTarget:
    """The target with a transformers DynamicCache: the reference path (any device)."""

    def __init__(self, target, capture: HiddenStateCapture | None):
        self.target, self.capture, self.cache = target, capture, new_cache(target)

    def forward(self, ids_S, pos_S, mask_SS=None, logits_to_keep: int = 0):
        """Append S tokens; every cached entry is visible to them, and among themselves `mask_SS`
        (bool, True = attend; None = causal). -> (logits, aux [S, K, D] or None)."""
        mask_SP = None
        if mask_SS is not None:
            cached = cache_length(self.cache)
            mask_SP = torch.cat([torch.ones(mask_SS.shape[0], cached, dtype=torch.bool, device=mask_SS.device), mask_SS], 1)
        return target_forward(self.target, ids_S, pos_S, self.cache, self.capture, mask_SP, logits_to_keep)

    def keep(self, prefix: int, kept: list[int] | None, n: int) -> None:
        """Keep entries 0..prefix-1 and, of those appended after them, `kept` (None = the first n)."""
        if kept is None:
            crop(self.cache, prefix + n)
            return
        device = self.target.device
        keep_positions(self.cache, torch.cat([torch.arange(prefix, device=device), prefix + torch.tensor(kept, device=device)]))


class EagerDrafter:
    """The draft with a growing DraftCache (eyas.spec.propose as is)."""

    def __init__(self, draft, dcache=None):
        self.draft, self.dcache = draft, dcache if dcache is not None else DraftCache()

    def extend(self, next_tokens_S, aux_SKD, start_pos: int):
        return extend(self.draft, self.dcache, next_tokens_S, aux_SKD, start_pos)

    def chain(self, h_11D, last_pos: int, params: "SpecParams", generator):
        out = draft_chain(self.draft, self.dcache, h_11D, last_pos, params.num_draft_tokens, params.temperature, generator)
        self.dcache.rollback()
        return out

    def tree(self, h_11D, root: int, last_pos: int, params: "SpecParams"):
        tree = draft_tree(self.draft, self.dcache, h_11D, root, last_pos, params.tree_top_k, params.tree_depth,
                          params.tree_total_tokens)
        self.dcache.rollback()
        return tree


def chain_round(tgt, drafter, draft, tokens, h_11D, params: SpecParams, generator) -> Round:
    """Draft K tokens after the root tokens[-1], verify them in one causal forward, accept."""
    device, L = h_11D.device, len(tokens)
    t0 = clock(device)
    drafts_K, q_KW = drafter.chain(h_11D, L - 2, params, generator)
    t1 = clock(device)
    k = drafts_K.shape[0]
    ids_K1 = torch.cat([torch.tensor([tokens[-1]], device=device), drafts_K])
    pos_K1 = torch.arange(L - 1, L + k, device=device)
    logits_K1V, aux_K1KD = tgt.forward(ids_K1, pos_K1)
    if params.temperature == 0:
        n, tok = accept_greedy_chain(drafts_K, logits_K1V.argmax(-1))
    else:
        p_K1V = logits_to_probs(logits_K1V, params.temperature)
        q_KV = draft_probs_on_target_vocab(q_KW, draft.d2t, p_K1V.shape[-1])
        n, tok = accept_sampling_chain(drafts_K, p_K1V, q_KV, generator)
    tgt.keep(L - 1, None, n + 1)  # prefix 0..L-2, the root, n accepted draft tokens
    emitted = drafts_K[:n].tolist() + [tok]
    return Round(emitted, aux_K1KD[: n + 1], n, min(n + 1, k), t1 - t0, clock(device) - t1)


def tree_round(tgt, drafter, draft, tokens, h_11D, params: SpecParams, generator) -> Round:
    """Build an EAGLE-2 tree below the root tokens[-1], verify it in one forward, walk it."""
    device, L = h_11D.device, len(tokens)
    t0 = clock(device)
    tree = drafter.tree(h_11D, tokens[-1], L - 2, params)
    t1 = clock(device)
    ids_N = torch.tensor(tree.tokens, device=device)
    pos_N = L - 1 + torch.tensor(tree.depths, device=device)
    # the committed prefix is visible to every node; each node sees its ancestors and itself
    logits_NV, aux_NKD = tgt.forward(ids_N, pos_N, ancestor_mask(tree.parents, device))
    if params.temperature == 0:
        path, tok = accept_greedy_tree(tree, logits_NV.argmax(-1))
    else:
        path, tok = accept_sampling_tree(tree, logits_NV, params.temperature, generator)
    kept = [0] + path
    aux_AKD = aux_NKD[torch.tensor(kept, device=device)]
    tgt.keep(L - 1, kept, len(kept))
    emitted = [tree.tokens[i] for i in path] + [tok]
    tested = len(path) + (1 if tree.children()[path[-1] if path else 0] else 0)
    return Round(emitted, aux_AKD, len(path), tested, t1 - t0, clock(device) - t1)


@torch.no_grad()
def speculative_generate(
    target,
    draft,
    input_ids: torch.Tensor,
    *,
    max_new_tokens: int,
    mode: str = "chain",
    num_draft_tokens: int = 7,
    tree_total_tokens: int = 60,
    tree_depth: int = 8,
    tree_top_k: int = 10,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
    stop_ids=(),
    engine=None,
) -> Generation:
    """Up to `max_new_tokens` new tokens after `input_ids` ([S] or [1, S]): `draft` proposes,
    `target` verifies. Greedy when temperature == 0, and then the output equals `target_generate`'s.

    `draft`: an eyas.draft.Eagle3Draft on the target's device, with the target's embedding installed.
    `engine`: an eyas.spec.static.StaticEngine for this target and draft (fixed-size caches, CUDA
    graphs on GPUs); None = transformers' DynamicCache and the draft's growing cache.
    """
    params = SpecParams(mode, num_draft_tokens, tree_total_tokens, tree_depth, tree_top_k, temperature)
    if mode == "tree":
        check_tree_attention(target)
    prompt_S = input_ids.reshape(-1)
    device, n_prompt, stops = prompt_S.device, prompt_S.shape[0], frozenset(stop_ids)
    play_round = chain_round if mode == "chain" else tree_round
    stats = SpecStats()
    t_start = clock(device)
    if engine is None:
        tgt = EagerTarget(target, HiddenStateCapture(target, list(draft.config.aux_layer_ids)))
        drafter = EagerDrafter(draft)
    else:
        tgt, drafter = engine.start(n_prompt + max_new_tokens + params.max_round_tokens())
    pos_S = torch.arange(n_prompt, device=device)
    logits_1V, aux_AKD = tgt.forward(prompt_S, pos_S, logits_to_keep=1)
    tokens = prompt_S.tolist() + [int(next_token(logits_1V[-1], temperature, generator).item())]
    stats.prefill_time_s = clock(device) - t_start
    while not _finished(tokens[n_prompt:], max_new_tokens, stops):
        t0 = clock(device)
        c = drafter.dcache.committed  # step 0 on positions c..L-2: (fc(aux_t), token t+1)
        h_11D = drafter.extend(torch.tensor(tokens[c + 1 :], device=device), aux_AKD, c)
        stats.draft_time_s += clock(device) - t0
        r = play_round(tgt, drafter, draft, tokens, h_11D, params, generator)
        stats.draft_time_s += r.draft_s
        stats.verify_time_s += r.verify_s
        stats.add_pass(r.num_accepted, r.num_tested)
        tokens += r.emitted
        aux_AKD = r.aux_AKD
    stats.wall_s = clock(device) - t_start
    return Generation(_cut(tokens[n_prompt:], max_new_tokens, stops), stats.wall_s, stats)


@torch.no_grad()
def target_generate(
    target,
    input_ids: torch.Tensor,
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
    stop_ids=(),
    engine=None,
) -> Generation:
    """Target-only decoding, one token per forward with a KV cache: the reference output and the
    baseline time. `engine`: as in `speculative_generate` (the baseline then runs the same kind
    of cache and graphs as the speculative decoders it is compared with)."""
    prompt_S = input_ids.reshape(-1)
    device, n_prompt, stops = prompt_S.device, prompt_S.shape[0], frozenset(stop_ids)
    t_start = clock(device)
    tgt = EagerTarget(target, None) if engine is None else engine.start(n_prompt + max_new_tokens)[0]
    logits_1V, _ = tgt.forward(prompt_S, torch.arange(n_prompt, device=device), logits_to_keep=1)
    new: list[int] = []
    while True:
        tok = next_token(logits_1V[-1], temperature, generator)
        new.append(int(tok.item()))  # host sync per token: the stop test needs it
        if _finished(new, max_new_tokens, stops):
            break
        pos_1 = torch.tensor([n_prompt + len(new) - 1], device=device)
        logits_1V, _ = tgt.forward(tok.view(1), pos_1)
    return Generation(_cut(new, max_new_tokens, stops), clock(device) - t_start)
