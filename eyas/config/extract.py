from __future__ import annotations

from dataclasses import dataclass, field

from eyas.config.base import require

BACKENDS = ("hf", "vllm")
STORE_DTYPES = ("auto", "bfloat16", "float16", "float32", "float8")
DEVICE_MAPS = ("", "auto", "balanced", "sequential")
PROXY_PARITY = ("auto", "always", "never")


@dataclass
class ExtractConfig:
    layer_ids: list[int] = field(default_factory=list)
    """Aux layer ids: the target layers the draft reads (id k = the hidden state entering decoder
    layer k = HF `hidden_states[k]`), for the extract stage and for online training alike (the one
    key for both); empty = [2, L//2, L-3] for a target with L layers. Each id must lie in [0, L-1],
    ascending."""
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
    """dtype of the stored hidden states: auto (= the compute dtype), bfloat16, float16, float32, or
    float8: e4m3 (torch.float8_e4m3fn) with one float32 scale per token for the aux states and one for
    the final state, about half of bf16's bytes per token; states are compared with the plain forward
    before quantising and dequantised on read into the compute dtype (eyas/fp8.py: error <= 2^-4 of
    a value, or 2^-10 of the token's scale for values below 2^-6 of it)."""
    verify: int = 0
    """Samples compared against a plain batch-1 forward in addition to the whole first batch."""
    parity_tol: float = 0.0
    """Largest allowed per-token relative RMS error of the parity check; 0 = auto (0.05 for bf16/fp16, 1e-3 for fp32).
    bf16/fp16 states past it are judged once more against a float32 forward (eyas/extract/backend.py check_parity)."""
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
    """Extraction backend: `hf` (transformers, this process's device) or `vllm` (vLLM's offline engine,
    its own parallelism; run eyas from a venv with vLLM, docs/reference.md "vLLM backend"). The writer, index,
    checksums and resume code do not depend on it."""
    vllm_tensor_parallel_size: int = 1
    """vLLM backend: GPUs the target's layers are split over (vLLM `tensor_parallel_size`)."""
    vllm_pipeline_parallel_size: int = 1
    """vLLM backend: pipeline stages (vLLM `pipeline_parallel_size`); GPUs used = TP x PP."""
    vllm_enable_expert_parallel: bool = False
    """vLLM backend: shard MoE experts instead of tensor-splitting them (vLLM `enable_expert_parallel`;
    the expert-parallel size is then TP x DP, vLLM has no separate knob)."""
    vllm_max_model_len: int = 0
    """vLLM backend: the engine's context length; 0 = the longest prepared sample + 1 (the engine
    samples one token after each prompt)."""
    vllm_gpu_memory_utilization: float = 0.9
    """vLLM backend: fraction of each GPU vLLM may take (weights, activations, hidden-state cache)."""
    vllm_engine_args: dict = field(default_factory=dict)
    """vLLM backend: any other `vllm.LLM(...)` keyword arguments, applied last, e.g.
    `--extract.vllm_engine_args.max_num_batched_tokens=16384`."""
    vllm_parity: int = 2
    """vLLM backend: samples of the first batch compared with the HF reference forward (transformers
    on CPU, loaded at the first check; extract.verify adds more); 0 = none, for targets whose
    weights do not fit in host memory: vLLM is then checked on a proxy of the target
    (extract.vllm_proxy_parity)."""
    vllm_proxy_parity: str = "auto"
    """vLLM backend: before the target's engine loads, run the same vLLM path on a tiny random model of
    the target's architecture (its config.json with few layers, small widths, few experts; quantized as
    the target where that is compressed-tensors INT4/INT8, else unquantized) and check it against
    transformers on every captured layer (eyas/extract/vllm_proxy.py); a
    disagreement stops the run. auto = when extract.vllm_parity=0 (the target itself has no float
    reference); always; never. train.mode=stream runs it too, through one stream engine (Mooncake's
    store and all) before the target's engines start: there auto = when train.stream.parity=0."""
    vllm_scratch_dir: str = ""
    """vLLM backend: the engine writes one safetensors file per request into DIR/vllm-scratch, read
    back and deleted within the batch; empty = vllm-scratch-extract beside the output directory (in
    the run directory). A tmpfs (/dev/shm) saves disk traffic when it holds a few batches."""
    max_samples: int = 0
    """Extract only the first N samples of the prepare output (0 = all)."""
    writer_queue: int = 3
    """Batches in flight between the GPU and the background writer (each holds one pinned host buffer)."""
    progress: bool = True
    """Show a tqdm progress bar on rank 0."""
    compile: bool = False
    """torch.compile the decoder layers (inductor, dynamic shapes; a minute or two of compiling at the
    start). The parity check compares against the eager layers, so it also checks the compiler (past
    parity_tol, against a float32 forward: compiled bf16 layers round differently from eager ones)."""
    out_dir: str = ""
    """Output directory; empty = RUN_DIR/extract."""
    spill_dirs: list[str] = field(default_factory=list)
    """More directories for shards, tried in order after the output directory: each new shard goes to
    the first one whose filesystem keeps extract.min_free_gb free beside it (a tmpfs first and a
    disk after it, say; the output directory keeps at least 256 MB for its index and meta). The
    index lists their shards by absolute path, so they are read where they are: every process that
    reads the states must see them there (not a node-local tmpfs on another node). Each holds the
    shards of one output directory (its eyas-spill.json names which); when the stage runs, shard
    files in it that no journal lists (or listed with another size) are deleted first, and one a
    journal lists at a path that is gone (a moved spill directory) stops the run."""
    min_free_gb: float = 0.0
    """GB every filesystem the shards go to keeps free. A tmpfs's free space is its size limit less
    what it holds, not memory: to keep M GB of memory, keep (tmpfs free - (MemAvailable - M)) free
    there (scripts/place_states.py does). Shards other ranks are writing are not counted: add
    (ranks - 1) x 2 shards (extract.shard_bytes, or one batch when larger). 0 with no
    extract.spill_dirs: no check per shard (the stage still refuses to start when the whole extract
    does not fit the free space)."""

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
        if self.store_dtype == "float8":
            import torch

            require(hasattr(torch, "float8_e4m3fn"),
                    f"extract.store_dtype=float8 needs torch.float8_e4m3fn, which torch {torch.__version__} lacks: "
                    "upgrade torch (>= 2.1) or store --extract.store_dtype=bfloat16")
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
        require(self.min_free_gb >= 0, f"extract.min_free_gb={self.min_free_gb} must be >= 0")
        require(all(d.strip() for d in self.spill_dirs), f"extract.spill_dirs={self.spill_dirs} has an empty entry")
        for key in ("vllm_tensor_parallel_size", "vllm_pipeline_parallel_size"):
            require(getattr(self, key) >= 1, f"extract.{key}={getattr(self, key)} must be >= 1")
        require(self.vllm_max_model_len >= 0,
                f"extract.vllm_max_model_len={self.vllm_max_model_len} must be >= 0 (0 = auto)")
        require(0 < self.vllm_gpu_memory_utilization <= 1,
                f"extract.vllm_gpu_memory_utilization={self.vllm_gpu_memory_utilization} must lie in (0, 1]")
        require(self.vllm_parity >= 0, f"extract.vllm_parity={self.vllm_parity} must be >= 0")
        require(self.vllm_proxy_parity in PROXY_PARITY,
                f"extract.vllm_proxy_parity={self.vllm_proxy_parity!r}: choose one of {', '.join(PROXY_PARITY)}")
        if self.backend == "vllm":
            hf_only = {"device_map": self.device_map, "attn_implementation": self.attn_implementation,
                       "compile": self.compile, "pack": self.pack}
            used = [k for k, v in hf_only.items() if v]
            require(not used, f"extract.{', extract.'.join(used)} configure the hf backend; with extract.backend=vllm "
                              "leave them unset (vLLM has its own kernels and placement: extract.vllm_*)")
