"""Batches for the trainer: split, per-epoch shuffle, token-budget packing, TTT gather indices.

Legend: B rows (1: one packed row per micro-batch), S packed length, K aux layers, D target
hidden, T TTT steps, M selected rows.

A *source* is anything indexable that returns sample dicts (`input_ids`, `loss_mask`, `id`,
`index`, and in offline mode `aux` [S, K, D] and `final` [S, D]) and has `lengths`:
`eyas.hidden_states.HiddenStates` (offline: shards, checksums verified on first read) or
`eyas.prepared.Prepared` (online: the target fills the states per batch, `OnlineStates`).

Each epoch the training indices are shuffled with (seed, epoch); consecutive samples are packed
into one row until the next would exceed `max_tokens`; the micro-batches are dealt to the ranks
(rank r takes every world_size-th, all ranks get the same count). Positions restart at 0 in each
sample, `doc` numbers the samples of the row (-1 = padding) and keeps attention and every TTT
shift inside its sample. Everything is a pure function of (seed, epoch, step): resuming at a
step replays the same batches.
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from eyas.errors import EyasError
from eyas.capture import HiddenStateCapture, base_model, to_device
from eyas.ttt import shift_left


@dataclass
class Batch:
    input_ids_BS: torch.Tensor
    loss_mask_BS: torch.Tensor
    doc_BS: torch.Tensor
    pos_BS: torch.Tensor
    rows_T: list[torch.Tensor]
    """Flat rows (b*S + t) trained at TTT step i: loss_mask[t+2+i] = 1 inside t's sample."""
    tix_T: list[torch.Tensor]
    """For each of rows_T[i], its teacher's index in teacher_rows_N (row t+1+i)."""
    teacher_rows_N: torch.Tensor
    """Flat rows whose final state needs the teacher (the next token is loss-masked, same sample)."""
    lengths: list[int]
    sample_ids: list[str]
    aux_BSKD: torch.Tensor | None = None
    final_BSD: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return sum(self.lengths)

    def to(self, device, non_blocking: bool = False) -> "Batch":
        def mv(x):
            if isinstance(x, torch.Tensor):
                return x.to(device, non_blocking=non_blocking)
            if isinstance(x, list) and x and isinstance(x[0], torch.Tensor):
                return [t.to(device, non_blocking=non_blocking) for t in x]
            return x

        return Batch(**{f.name: mv(getattr(self, f.name)) for f in fields(self)})

    def pin_memory(self) -> "Batch":
        def pin(x):
            if isinstance(x, torch.Tensor):
                return x.pin_memory()
            if isinstance(x, list) and x and isinstance(x[0], torch.Tensor):
                return [t.pin_memory() for t in x]
            return x

        return Batch(**{f.name: pin(getattr(self, f.name)) for f in fields(self)})


def split_indices(num_samples: int, eval_fraction: float, seed: int,
                  groups: list[int] | None = None, say: bool = True) -> tuple[list[int], list[int]]:
    """-> (train, eval) sample indices; eval is a seeded random subset (>= 1 when fraction > 0).

    With `groups` (a label per sample, `split_groups`) eval takes whole groups, in a seeded random
    order, until it holds n = round(num_samples * eval_fraction) samples or more; a group that would
    take eval past n + n // 2 stays in training (a group as large as a whole source must not move
    it to eval). When no group fits, the split is per sample (said on stdout when `say`)."""
    n_eval = 0 if eval_fraction <= 0 else max(1, int(round(num_samples * eval_fraction)))
    if num_samples - n_eval < 1:
        n_eval = num_samples - 1
    gen = torch.Generator().manual_seed(seed)
    if groups is not None and n_eval > 0:
        if len(groups) != num_samples:
            raise ValueError(f"{len(groups)} group labels for {num_samples} samples")
        members: dict[int, list[int]] = {}
        for i, g in enumerate(groups):
            members.setdefault(g, []).append(i)
        labels = list(members)
        cap = min(n_eval + n_eval // 2, num_samples - 1)
        chosen: list[int] = []
        for k in torch.randperm(len(labels), generator=gen).tolist():
            if len(chosen) >= n_eval:
                break
            if len(chosen) + len(members[labels[k]]) <= cap:
                chosen += members[labels[k]]
        largest = max(len(m) for m in members.values())
        if say and largest > max(cap, num_samples // 20):
            print(f"[eyas:train] held-out split: one group of samples (ids sharing a stem or identical prompts) holds "
                  f"{largest} of {num_samples}; a group too large for the held-out split stays in training", flush=True)
        if chosen:
            held = set(chosen)
            return [i for i in range(num_samples) if i not in held], sorted(chosen)
        if say:
            print(f"[eyas:train] held-out split: no group of samples fits {cap} held-out samples; splitting per sample",
                  flush=True)
    perm = torch.randperm(num_samples, generator=gen).tolist()
    return sorted(perm[n_eval:]), sorted(perm[:n_eval])


STEM = re.compile(r"_\d+$")


def split_groups(ids: list[str], prompts: list) -> list[int]:
    """A group label per sample for the held-out split: samples whose ids share a stem (ShareGPT
    stores one long conversation as `X_0`, `X_1`, ...: the id without a trailing `_<digits>`) or
    whose prompts are identical (the tokens before the first trained token; greedy regeneration
    answers an identical prompt identically; None = no prompt) get the same label (connected
    components)."""
    parent = list(range(len(ids)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for keys in ([STEM.sub("", x) for x in ids], prompts):
        first: dict = {}
        for i, k in enumerate(keys):
            if k is None:  # no prompt (trained from its first token): nothing to be identical to
                continue
            j = first.setdefault(k, i)
            if j != i:
                parent[find(i)] = find(j)
    return [find(i) for i in range(len(ids))]


def pack_plan(order: list[int], lengths, max_tokens: int) -> list[list[int]]:
    """Greedy token-budget packing of `order` (a longer sample is truncated to the budget)."""
    if isinstance(lengths, torch.Tensor):
        lengths = lengths.tolist()
    batches: list[list[int]] = []
    cur: list[int] = []
    used = 0
    for i in order:
        n = min(int(lengths[i]), max_tokens)
        if cur and used + n > max_tokens:
            batches.append(cur)
            cur, used = [], 0
        cur.append(i)
        used += n
    if cur:
        batches.append(cur)
    return batches


def epoch_batches(
    indices: list[int], lengths: torch.Tensor, max_tokens: int, seed: int, epoch: int, rank: int, world_size: int,
    shuffle: bool = True,
) -> list[list[int]]:
    """This rank's micro-batches of one epoch (the same count on every rank)."""
    if shuffle:
        g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
        order = [indices[j] for j in torch.randperm(len(indices), generator=g).tolist()]
    else:
        order = list(indices)
    plan = pack_plan(order, lengths, max_tokens)
    per_rank = len(plan) // world_size
    return plan[rank : per_rank * world_size : world_size]


def gather_indices(loss_mask_BS: torch.Tensor, doc_BS: torch.Tensor, num_steps: int):
    """-> (rows_T, tix_T, teacher_rows_N); see `Batch`. Pure index arithmetic, on CPU."""
    b, s = doc_BS.shape
    flat_BS = torch.arange(b * s).view(b, s)
    real_BS = doc_BS >= 0

    def next_masked(k: int) -> torch.Tensor:  # loss_mask[t+k] = 1 and t+k in t's sample
        return (shift_left(loss_mask_BS, k, 0) == 1) & (shift_left(doc_BS, k, -2) == doc_BS) & real_BS

    teacher_rows_N = flat_BS[next_masked(1)]
    slot = torch.full((b * s,), -1, dtype=torch.long)
    slot[teacher_rows_N] = torch.arange(teacher_rows_N.numel())
    rows_T, tix_T = [], []
    for i in range(num_steps):
        rows_M = flat_BS[next_masked(2 + i)]
        tix_M = slot[rows_M + 1 + i]
        assert bool((tix_M >= 0).all()), "a trained row has no teacher"
        rows_T.append(rows_M)
        tix_T.append(tix_M)
    return rows_T, tix_T, teacher_rows_N


def pack(samples: list[dict[str, Any]], num_steps: int, max_tokens: int, pad_multiple: int = 0) -> Batch:
    """Samples -> one packed row [1, S] (S padded up to a multiple of pad_multiple)."""
    cut = [{k: (v[:max_tokens] if isinstance(v, torch.Tensor) else v) for k, v in smp.items()} for smp in samples]
    lengths = [int(smp["input_ids"].shape[0]) for smp in cut]
    n = sum(lengths)
    s = n if not pad_multiple else -(-n // pad_multiple) * pad_multiple
    pad = s - n

    def cat(key: str, fill=0) -> torch.Tensor:
        parts = [smp[key] for smp in cut]
        if pad:
            parts.append(torch.full((pad, *parts[0].shape[1:]), fill, dtype=parts[0].dtype))
        return torch.cat(parts)[None]

    doc = torch.cat([torch.full((L,), j, dtype=torch.long) for j, L in enumerate(lengths)] + [torch.full((pad,), -1, dtype=torch.long)])[None]
    pos = torch.cat([torch.arange(L) for L in lengths] + [torch.zeros(pad, dtype=torch.long)])[None]
    loss_mask = cat("loss_mask")
    rows_T, tix_T, teacher_rows = gather_indices(loss_mask, doc, num_steps)
    has_states = "aux" in cut[0]
    return Batch(
        input_ids_BS=cat("input_ids"),
        loss_mask_BS=loss_mask,
        doc_BS=doc,
        pos_BS=pos,
        rows_T=rows_T,
        tix_T=tix_T,
        teacher_rows_N=teacher_rows,
        lengths=lengths,
        sample_ids=[str(smp["id"]) for smp in cut],
        aux_BSKD=cat("aux") if has_states else None,
        final_BSD=cat("final") if has_states else None,
    )


class PackedBatches(torch.utils.data.Dataset):
    """Map-style view of a list of micro-batch plans (for a DataLoader with workers)."""

    def __init__(self, source, plans: list[list[int]], num_steps: int, max_tokens: int, pad_multiple: int):
        self.source, self.plans = source, plans
        self.num_steps, self.max_tokens, self.pad_multiple = num_steps, max_tokens, pad_multiple

    def __len__(self) -> int:
        return len(self.plans)

    def __getitem__(self, k: int) -> Batch:
        return pack([self.source[i] for i in self.plans[k]], self.num_steps, self.max_tokens, self.pad_multiple)


def batch_loader(source, plans: list[list[int]], num_steps: int, max_tokens: int, pad_multiple: int, num_workers: int,
                 pin: bool, timeout_s: float = 0.0):
    """The packed batches of `plans`, in order; with workers, a batch that does not come within
    `timeout_s` (a worker that died, or failed to hand its batch over and only printed why, as
    multiprocessing's queue feeder does) raises LoaderStalled instead of waiting forever."""
    loader = torch.utils.data.DataLoader(
        PackedBatches(source, plans, num_steps, max_tokens, pad_multiple),
        batch_size=None,
        shuffle=False,
        num_workers=num_workers,
        pin_memory=pin,
        persistent_workers=False,
        timeout=timeout_s if num_workers > 0 else 0,
    )
    return _Loud(loader, timeout_s)


class LoaderStalled(EyasError):
    """train's data loader lost a worker, or produced no batch within train.loader_timeout_s."""


class _Loud:
    def __init__(self, loader, timeout_s: float):
        self.loader, self.timeout_s = loader, timeout_s

    def __iter__(self):
        it = iter(self.loader)
        while True:
            try:
                yield next(it)
            except StopIteration:
                return
            except RuntimeError as e:
                if "DataLoader worker" in str(e) and ("exited unexpectedly" in str(e) or "killed by signal" in str(e)):
                    raise LoaderStalled(
                        f"train's data loader lost a worker ({e}): killed from outside or by the kernel's "
                        "out-of-memory killer (lower --train.num_workers or --train.max_tokens if memory is "
                        "short); run the same command: training resumes from its last checkpoint") from e
                if "timed out" not in str(e):
                    raise
                raise LoaderStalled(
                    f"train's data loader produced no batch in train.loader_timeout_s={self.timeout_s:g} s: a loader "
                    "worker died or could not hand its batch over (its error is printed above; a full /dev/shm or "
                    "disk is a common cause). Fix that and run the same command: training resumes from its last "
                    "checkpoint") from e


def row_groups(lengths: list[int], overhead_tokens: int, quantum: int = 64) -> list[list[int]]:
    """The samples of one packed batch (their `lengths`) as groups for right-padded target forwards,
    each group longest first. One padded forward of all of them computes n x max(length) tokens (4x
    the real ones on SmolLM2's training mix); each extra forward costs about
    `overhead_tokens` of compute in launches. Sorted longest first, the groups are the contiguous
    runs that minimise padded tokens + overhead_tokens per group (dynamic programming); cuts fall
    only where the length rounded up to `quantum` changes, so the search is over at most
    max(length) / quantum buckets whatever the number of samples."""
    if not lengths:
        return []
    order = sorted(range(len(lengths)), key=lambda j: -lengths[j])
    key = [-(-lengths[j] // quantum) for j in order]
    bounds = [0] + [k for k in range(1, len(order)) if key[k] != key[k - 1]] + [len(order)]
    best, cut = [0] + [None] * (len(bounds) - 1), [0] * len(bounds)
    for b in range(1, len(bounds)):  # the last group ends at bounds[b] and starts at some bounds[a]
        for a in range(b):
            cost = best[a] + (bounds[b] - bounds[a]) * lengths[order[bounds[a]]] + overhead_tokens
            if best[b] is None or cost < best[b]:
                best[b], cut[b] = cost, a
    groups, b = [], len(bounds) - 1
    while b > 0:
        groups.append(order[bounds[cut[b]] : bounds[b]])
        b = cut[b]
    return groups[::-1]


# SDPA kernels the online target forward may use (`OnlineStates.sdpa_backends`): all but cuDNN's,
# which builds a plan per input shape, and online batches are all new shapes. On an H200 (torch
# 2.11, bench/online_states.py) a SmolLM2-135M batch of 16k tokens took 151 ms with
# every kernel allowed, 96 ms when the same shapes came again, and 106 ms (both times) with flash
# alone (run after the others in the same process; cuDNN's plans the likely cause, not isolated;
# this set itself not yet measured there)
ONLINE_SDPA = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)


class OnlineStates:
    """Online mode: the target (possibly on its own device) fills a batch's aux/final states with
    the same capture code as the extract stage, one right-padded row per sample and, as there, no
    attention mask: attention is causal, so a real token never sees the padding after it, and SDPA
    keeps its fused causal path (no padded mask built or checked on the host). The rows go through
    the target in groups of similar length (`row_groups`, `group_overhead_tokens`) rather than all
    padded to the longest, when `group_overhead_tokens` is given (`train.target_group_tokens`); by
    default (None) all rows go in one forward, padded to the longest: on one H200
    (bench/online_states.py) ~3 groups of similar length took as long as one forward
    for a SmolLM2-135M batch of 16k tokens (104 against 106 ms, flash attention), though they
    compute 1.3x the real tokens against 4.1x: on that small target the padding saved about what
    two more forwards cost. The forward runs under `sdpa_backends` (None: whatever PyTorch
    picks). Called on the host-side batch; the states stay on the target's device until
    `Batch.to` moves them."""

    def __init__(self, model, layer_ids: list[int], device, group_overhead_tokens: int | None = None,
                 group_quantum: int = 64, sdpa_backends=ONLINE_SDPA):
        self.model, self.layer_ids, self.device = model, list(layer_ids), torch.device(device)
        self.capture, self.base = HiddenStateCapture(model, self.layer_ids), base_model(model)  # as extract's backend
        self.group_overhead_tokens, self.group_quantum = group_overhead_tokens, group_quantum
        single = sdpa_backends is None or isinstance(sdpa_backends, SDPBackend)
        self.sdpa_backends = sdpa_backends if single else list(sdpa_backends)  # sdpa_kernel takes a list, not a tuple
        self.num_forwards = 0  # target forwards so far (a test counts them)

    @torch.no_grad()
    def __call__(self, batch: Batch) -> Batch:
        ids_S = batch.input_ids_BS[0].cpu()
        s = batch.input_ids_BS.shape[1]
        starts = [0]
        for L in batch.lengths:
            starts.append(starts[-1] + L)
        aux_BSKD = final_BSD = None
        if self.group_overhead_tokens is None:  # one forward, the longest row first (it sets the width)
            groups = [sorted(range(len(batch.lengths)), key=lambda j: -batch.lengths[j])]
        else:
            groups = row_groups(batch.lengths, self.group_overhead_tokens, self.group_quantum)
        kernels = contextlib.nullcontext() if self.sdpa_backends is None else sdpa_kernel(self.sdpa_backends)
        with self.capture as cap, kernels:
            for group in groups:
                ids_nL = torch.zeros(len(group), batch.lengths[group[0]], dtype=torch.long)
                for r, j in enumerate(group):
                    ids_nL[r, : batch.lengths[j]] = ids_S[starts[j] : starts[j + 1]]
                self.base(input_ids=to_device(ids_nL, self.device), use_cache=False)
                self.num_forwards += 1
                aux_nLKD, final_nLD = cap.result()
                if aux_BSKD is None:
                    aux_BSKD = aux_nLKD.new_zeros(1, s, *aux_nLKD.shape[2:])
                    final_BSD = final_nLD.new_zeros(1, s, final_nLD.shape[-1])
                for r, j in enumerate(group):
                    aux_BSKD[0, starts[j] : starts[j + 1]] = aux_nLKD[r, : batch.lengths[j]]
                    final_BSD[0, starts[j] : starts[j + 1]] = final_nLD[r, : batch.lengths[j]]
                del aux_nLKD, final_nLD  # the longest group's states need not live through the next forward
                cap.clear()
        assert aux_BSKD is not None, "OnlineStates: a batch without samples"
        batch.aux_BSKD, batch.final_BSD = aux_BSKD, final_BSD  # on the target's device
        return batch
