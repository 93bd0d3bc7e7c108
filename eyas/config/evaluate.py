from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EvaluateConfig:
    out_dir: str = ""
    """Output directory; empty = RUN_DIR/evaluate."""
