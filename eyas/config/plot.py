from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PlotConfig:
    run_dir: str = ""
    """Training directory whose metrics.jsonl is plotted (empty = the train stage's: train.out_dir, else
    RUN_DIR/train)."""
    out_dir: str = ""
    """Where the PNGs go (empty = RUN_DIR_OF_TRAINING/plots)."""
