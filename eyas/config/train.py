from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TrainConfig:
    out_dir: str = ""
    """Output directory; empty = RUN_DIR/train."""
