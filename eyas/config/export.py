from __future__ import annotations

from dataclasses import dataclass, field

from eyas.config.base import require

FORMATS = ("sglang", "speculators", "both")
EXPORT_DTYPES = ("bfloat16", "float16", "float32")


@dataclass
class ExportConfig:
    train_dir: str = ""
    """The train stage output to export (its `final/` checkpoint is read), or an eyas draft
    checkpoint directory itself (holding draft.safetensors + draft_config.json); empty = the train
    stage's output directory (train.out_dir, else RUN_DIR/train)."""
    checkpoint: str = "final"
    """Subdirectory of train_dir holding the checkpoint to export (e.g. final, step_2000)."""
    format: str = "both"
    """sglang (EAGLE-3 reference layout, also served by vLLM), speculators (the layout `vllm serve DIR`
    recognises on its own) or both; each is written to OUT/<format>/."""
    dtype: str = "bfloat16"
    """dtype of the exported floating-point tensors: bfloat16, float16 or float32 (d2t stays int64,
    t2d bool)."""
    num_speculative_tokens: int = 3
    """Draft tokens per step recorded in the speculators config (vLLM's default when the serve command
    does not say)."""
    prepare_dir: str = ""
    """Prepare output the draft was trained on, checked against the draft's vocabulary mapping;
    empty = the one the train stage recorded, else the prepare stage's
    output directory (skipped with a note when absent)."""
    extract_dir: str = ""
    """Extract output the draft was trained on, checked against the draft's aux layer ids and target;
    empty = the one the train stage recorded, else the extract stage's
    output directory (skipped with a note when absent)."""
    average_with: list[str] = field(default_factory=list)
    """Drafts (either exported layout, an export root or an eyas checkpoint) to average the trained
    draft with: every tensor the mean over all of them, lm_head rows matched by target token
    (eyas/average.py). Same architecture required; the draft vocabulary may differ. Empty = none.
    When set, evaluate's default draft is this export, not the train stage's final/."""
    out_dir: str = ""
    """Output directory; empty = RUN_DIR/export."""

    def __post_init__(self) -> None:
        require(self.format in FORMATS, f"export.format={self.format!r}: choose one of {', '.join(FORMATS)}")
        require(
            self.dtype in EXPORT_DTYPES, f"export.dtype={self.dtype!r}: choose one of {', '.join(EXPORT_DTYPES)}"
        )
        require(all(d.strip() for d in self.average_with), f"export.average_with={self.average_with} has an empty entry")
        require(bool(self.checkpoint), "export.checkpoint is empty: name the checkpoint subdirectory (e.g. final)")
        require(
            1 <= self.num_speculative_tokens <= 64,
            f"export.num_speculative_tokens={self.num_speculative_tokens} must lie in [1, 64]",
        )

    @property
    def formats(self) -> tuple[str, ...]:
        return ("sglang", "speculators") if self.format == "both" else (self.format,)
