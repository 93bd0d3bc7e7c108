"""Shared by the evaluate tests: `eyas evaluate`'s arguments for the tiny run (conftest.py's tiny_run)."""

from __future__ import annotations


def cli_args(root, *extra):
    return [
        "evaluate", f"--run_dir={root / 'run'}", f"--target.model={root / 'target'}", "--target.dtype=float32",
        "--bench", str(root / "bench.jsonl"), "--max_new_tokens=6", "--device=cpu", "--tree_total_tokens=6",
        "--tree_depth=3", "--tree_top_k=3", "--num_draft_tokens=3", *extra,
    ]  # fmt: skip
