from __future__ import annotations

from dataclasses import dataclass, field

from eyas.config.base import require

BACKENDS = ("hf",)
STORE_DTYPES = ("auto", "bfloat16", "float16", "float32")
DEVICE_MAPS = ("", "auto", "balanced", "sequential")


@dataclass
class ExtractConfig:
    layer_ids: list[int] = field(default_factory=list)
    """Aux layer ids (id k = the hidden state entering decoder layer k = HF `hidden_states[k]`);
    empty = [2, L//2, L-3] for a target with L layers. Each id must lie in [0, L-1]."""
    token_budget: int = 16384
    """Tokens per forward batch, padding included (rows x padded length, or the packed row length).
    Lower it on an out-of-memory error; raise it for throughput on large GPUs."""
    max_batch_size: int = 512
    """Most samples in one batch, whatever their length."""
    pack: bool = False
    """Pack samples into one row per batch (per-sample position ids and a block-diagonal causal
    mask, built by transformers from the position ids) instead of right-padding length-sorted rows."""
    shard_bytes: int = 1_000_000_000
    """Target size of one output shard in bytes (a shard holds whole batches; at least one batch)."""
    store_dtype: str = "auto"
    """dtype of the stored hidden states: auto (= the compute dtype), bfloat16, float16, float32."""
    verify: int = 0
    """Samples compared against a plain batch-1 forward in addition to the whole first batch."""
    parity_tol: float = 0.0
    """Largest allowed per-token relative RMS error of the parity check; 0 = auto (0.05 for bf16/fp16, 1e-3 for fp32)."""
    max_failures: int = 0
    """Samples allowed to fail (recorded in errors.jsonl and skipped) before the run stops; 0 = stop at the first."""
    allow_failures: bool = False
    """Exit 0 when samples failed within extract.max_failures (default: the run completes but exits non-zero)."""
    device: str = ""
    """Device of this process: empty = cuda:LOCAL_RANK when CUDA is available, else cpu."""
    device_map: str = ""
    """Split a target too large for one GPU over this process's visible GPUs with accelerate
    (`auto`, `balanced`, `sequential`); empty = the whole target on extract.device. Single process only."""
    attn_implementation: str = ""
    """transformers attention implementation (sdpa, eager, flash_attention_2, ...); empty = transformers' default."""
    backend: str = "hf"
    """Extraction backend; `hf` (transformers). The writer, index and resume code do not depend on it."""
    max_samples: int = 0
    """Extract only the first N samples of the prepare output (0 = all)."""
    writer_queue: int = 3
    """Batches in flight between the GPU and the background writer (each holds one pinned host buffer)."""
    progress: bool = True
    """Show a tqdm progress bar on rank 0."""
    compile: bool = False
    """torch.compile the decoder layers (inductor, dynamic shapes; a minute or two of compiling at the
    start). The parity check compares against the eager layers, so it also checks the compiler."""
    out_dir: str = ""
    """Output directory; empty = RUN_DIR/extract."""

    def __post_init__(self) -> None:
        require(all(k >= 0 for k in self.layer_ids), f"extract.layer_ids={self.layer_ids}: ids must be >= 0")
        require(len(set(self.layer_ids)) == len(self.layer_ids), f"extract.layer_ids={self.layer_ids} has duplicates")
        require(self.token_budget >= 8, f"extract.token_budget={self.token_budget} is too small (>= 8)")
        require(self.max_batch_size >= 1, f"extract.max_batch_size={self.max_batch_size} must be >= 1")
        require(self.shard_bytes >= 1, f"extract.shard_bytes={self.shard_bytes} must be >= 1")
        require(
            self.store_dtype in STORE_DTYPES,
            f"extract.store_dtype={self.store_dtype!r}: choose one of {', '.join(STORE_DTYPES)}",
        )
        require(self.verify >= 0, f"extract.verify={self.verify} must be >= 0")
        require(self.parity_tol >= 0, f"extract.parity_tol={self.parity_tol} must be >= 0 (0 = auto)")
        require(self.max_failures >= 0, f"extract.max_failures={self.max_failures} must be >= 0")
        require(
            self.device_map in DEVICE_MAPS,
            f"extract.device_map={self.device_map!r}: choose one of {', '.join(repr(d) for d in DEVICE_MAPS)}",
        )
        require(self.backend in BACKENDS, f"extract.backend={self.backend!r}: choose one of {', '.join(BACKENDS)}")
        require(self.max_samples >= 0, f"extract.max_samples={self.max_samples} must be >= 0")
        require(self.writer_queue >= 1, f"extract.writer_queue={self.writer_queue} must be >= 1")
