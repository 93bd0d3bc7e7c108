from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ExportConfig:
    out_dir: str = ""
    """Output directory; empty = RUN_DIR/export."""
