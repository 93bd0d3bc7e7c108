"""A seeded sample of the fault matrix (tests/fault_matrix.py): each sampled cell holds, i.e. after
its fault the same `eyas run` command completes with every stage's output bit-identical to an
uninterrupted run, or stops naming the file and what to run. EYAS_FAULT_SEED picks the sample
(default 0), EYAS_FAULT_CELLS how many (default 6: a signal, a damaged file, a resource fault, and
case cells (tests/fault_cases/) of data loss, provenance and a misbehaving server);
`python bench/fault_matrix.py` runs them all."""

from __future__ import annotations

import os
import random

import pytest

from tests.fault_matrix import Matrix, cells

SEED = int(os.environ.get("EYAS_FAULT_SEED", "0"))
FAMILIES = (("kill9", "sigterm"), ("torn", "flip"), ("disk_full", "dead_worker", "stalled_server", "dead_server"),
            ("data_loss",), ("provenance",), ("server",))
"""The sample takes its cells from these families in turn: a signal, a damaged file, a resource, a
case of data loss, of provenance and of a misbehaving server."""


def sample(seed: int, n: int) -> list:
    rng = random.Random(seed)
    pools = [pool for pool in ([c for c in cells() if c.fault in family] for family in FAMILIES) if pool]
    picked = []
    for i in range(n):
        pool = pools[i % len(pools)]
        if pool:
            picked.append(pool.pop(rng.randrange(len(pool))))
    return sorted(picked, key=lambda c: c.name)


SAMPLE = sample(SEED, int(os.environ.get("EYAS_FAULT_CELLS", "6")))


@pytest.fixture(scope="module")
def matrix(tmp_path_factory, smollm2_dir):
    return Matrix(tmp_path_factory.mktemp("faults"), smollm2_dir)


def test_the_matrix_has_every_stage_and_fault():
    all_cells = cells()
    assert len(all_cells) >= 70 and len({c.name for c in all_cells}) == len(all_cells)
    for fault in ("kill9", "sigterm", "disk_full"):
        assert {c.stage for c in all_cells if c.fault == fault} == {"regenerate", "prepare", "extract", "train", "export",
                                                                     "evaluate"}


@pytest.mark.slow
@pytest.mark.parametrize("cell", SAMPLE, ids=lambda c: c.name)
def test_a_sampled_cell_holds(matrix, cell):
    outcome = matrix.run_cell(cell, SEED)
    assert outcome.held, f"{cell.name}: {outcome.result}: {outcome.detail}"
