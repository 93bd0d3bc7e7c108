"""eyas.extract.plan: batches under the token budget, rank slices (pure functions)."""

from __future__ import annotations

import pytest
import torch

from eyas.errors import ConfigError
from eyas.extract import plan


def test_plan_batches_respect_budget_and_cover_every_sample():
    lengths = torch.tensor([5, 40, 17, 33, 8, 40, 2, 25, 12, 30])
    for pack in (False, True):
        batches = plan.make_batches(list(range(10)), lengths, token_budget=64, max_batch_size=3, pack=pack)
        assert sorted(i for b in batches for i in b.indices) == list(range(10))
        assert all(b.padded_tokens <= 64 and len(b.indices) <= 3 for b in batches)
        assert batches[0].indices[0] in (1, 5)  # longest first: an OOM shows at once
    with pytest.raises(ConfigError, match="extract.token_budget"):
        plan.make_batches([1], lengths, token_budget=32, max_batch_size=8, pack=False)


def test_plan_rank_slices_are_disjoint_and_balanced():
    lengths = torch.randint(1, 100, (101,))
    slices = [plan.rank_slice(list(range(101)), lengths, r, 4) for r in range(4)]
    assert sorted(i for s in slices for i in s) == list(range(101))
    tokens = [int(lengths[s].sum()) for s in slices]
    assert max(tokens) - min(tokens) <= int(lengths.max())
