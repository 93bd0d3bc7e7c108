"""The case cells of the fault matrix (tests/fault_matrix.py, `Case`): one module per family, each
with `CASES`, a list of `Case(family, label, check)`. A check gets the Matrix (the tiny target, its
data, `finished_run`, `eyas`, `run_args`, `_server`), its own work directory and a seeded
random.Random, and returns (held, what happened in words)."""

from __future__ import annotations

import importlib

FAMILIES = ("data_loss", "provenance", "server", "input", "large_target", "stream")


def all_cases() -> list:
    out = []
    for family in FAMILIES:
        try:
            module = importlib.import_module(f"tests.fault_cases.{family}")
        except ModuleNotFoundError as e:
            if e.name != f"tests.fault_cases.{family}":
                raise
            continue
        out += module.CASES
    return out
