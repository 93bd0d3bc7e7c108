"""Which samples go in which batch, on which rank, into which shard: pure functions of the lengths.

Samples are sorted longest first (an out-of-memory batch shows up at once, not hours in) and dealt
round-robin to ranks, so ranks get near-equal token counts. Each rank cuts its list into batches
under `token_budget` tokens, padding included: padded mode fills rows x (longest length) <= budget,
so neighbours in the sorted order have similar lengths and padding stays small; packed mode puts
samples back to back in one row of <= budget tokens. Batches are grouped into shards of about
`shard_bytes`. All of it is deterministic, so a resumed run plans the remaining samples the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eyas.errors import ConfigError


@dataclass
class Batch:
    indices: list[int]
    """Prepare sample indices, in the order their tokens are stored."""
    lengths: list[int]
    rows: int
    seq_len: int
    """Forward shape: rows x seq_len (packed: 1 x sum of lengths)."""
    packed: bool

    @property
    def num_tokens(self) -> int:
        return sum(self.lengths)

    @property
    def padded_tokens(self) -> int:
        return self.rows * self.seq_len

    def input_ids(self, tokens: list[torch.Tensor], pad_id: int = 0) -> torch.Tensor:
        """ids_BS, right-padded (padded mode) or concatenated (packed mode)."""
        if self.packed:
            return torch.cat(tokens).view(1, -1)
        ids_BS = torch.full((self.rows, self.seq_len), pad_id, dtype=torch.long)
        for b, t in enumerate(tokens):
            ids_BS[b, : t.numel()] = t
        return ids_BS

    def position_ids(self) -> torch.Tensor | None:
        """pos_BS restarting at 0 for each packed sample; None (= 0..S-1) when padded."""
        if not self.packed:
            return None
        return torch.cat([torch.arange(n) for n in self.lengths]).view(1, -1)

    def token_index(self) -> torch.Tensor | None:
        """Flat positions in rows x seq_len of the real tokens, in storage order; None = all of them."""
        if self.packed or all(n == self.seq_len for n in self.lengths):
            return None
        return torch.cat([b * self.seq_len + torch.arange(n) for b, n in enumerate(self.lengths)])


def sort_longest_first(indices: list[int], lengths: torch.Tensor) -> list[int]:
    return sorted(indices, key=lambda i: (-int(lengths[i]), i))


def rank_slice(indices: list[int], lengths: torch.Tensor, rank: int, world_size: int) -> list[int]:
    """This rank's share: every world_size-th sample of the longest-first order."""
    return sort_longest_first(indices, lengths)[rank::world_size]


def make_batches(indices: list[int], lengths: torch.Tensor, token_budget: int, max_batch_size: int,
                 pack: bool) -> list[Batch]:
    """Cut longest-first `indices` into batches of <= token_budget tokens (padding included)."""
    batches: list[Batch] = []
    cur: list[int] = []

    def flush() -> None:
        lens = [int(lengths[i]) for i in cur]
        batches.append(Batch(list(cur), lens, 1 if pack else len(cur), sum(lens) if pack else max(lens), pack))
        cur.clear()

    for i in sort_longest_first(indices, lengths):
        n = int(lengths[i])
        if n > token_budget:
            raise ConfigError(
                f"sample {i} has {n} tokens, more than extract.token_budget={token_budget}: raise the budget to >= {n}"
            )
        if cur:
            if pack:
                fits = sum(int(lengths[j]) for j in cur) + n <= token_budget
            else:  # sorted longest first: the batch's first sample sets the padded length
                fits = (len(cur) + 1) * int(lengths[cur[0]]) <= token_budget
            if not fits or len(cur) >= max_batch_size:
                flush()
        cur.append(i)
    if cur:
        flush()
    return batches


def group_shards(batches: list[Batch], bytes_per_token: int, shard_bytes: int) -> list[list[Batch]]:
    """Consecutive batches, about shard_bytes of hidden states per group (at least one batch)."""
    shards: list[list[Batch]] = []
    cur: list[Batch] = []
    size = 0
    for b in batches:
        if cur and size + b.num_tokens * bytes_per_token > shard_bytes:
            shards.append(cur)
            cur, size = [], 0
        cur.append(b)
        size += b.num_tokens * bytes_per_token
    if cur:
        shards.append(cur)
    return shards


def padding_waste(batches: list[Batch]) -> float:
    padded = sum(b.padded_tokens for b in batches)
    return 1.0 - sum(b.num_tokens for b in batches) / padded if padded else 0.0
