"""bench/ledger.py: the ledger it measures goes through trainer.pt's save and a resume's load intact."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import ledger as bench  # noqa: E402


def test_a_saved_ledger_comes_back_with_every_sample_trained():
    r = bench.measure(1000)  # raises (SystemExit) when the restored ledger lost a trained sample
    assert r["samples"] == 1000 and 20 < r["bytes_per_sample"] < 200
