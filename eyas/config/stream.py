from __future__ import annotations

import math
from dataclasses import dataclass, field

from eyas.config.base import require

MOONCAKE_MIN_SEGMENT = 16 << 20  # Mooncake's store refuses a smaller segment (setup status -600)


@dataclass
class StreamConfig:
    """train.mode=stream: vLLM engines capture the target's hidden states and hand them to the trainer
    ranks through Mooncake's store (nothing on disk). The engines take extract's vLLM settings
    (extract.vllm_tensor_parallel_size, extract.vllm_engine_args, extract.layer_ids ...)."""

    engines: int = 1
    """vLLM engines (data parallel), each a Ray actor holding extract.vllm_tensor_parallel_size x
    extract.vllm_pipeline_parallel_size GPUs of one node."""
    engine_urls: list[str] = field(default_factory=list)
    """Running vLLM servers to use as the engines instead of starting them (http://HOST:PORT each):
    started with the extract_hidden_states method and hs-connectors' Mooncake connector on
    train.stream.master (which must then be given); eyas prints the `vllm serve` arguments it would
    use. train.stream.engines is then their number."""
    ray_address: str = ""
    """The Ray cluster to place engines on (`ray start --head` on one node, `ray start
    --address=HEAD:6379` on the others, then this = HEAD:6379 or `auto`); empty = a local cluster on
    127.0.0.1 that eyas starts and stops."""
    master: str = ""
    """A running mooncake_master (HOST:PORT) started with eviction off
    (--eviction_high_watermark_ratio=1.0 --eviction_ratio=0.0); empty = eyas starts one on
    127.0.0.1 (its log in OUT_DIR/stream/mooncake_master.log)."""
    host: str = "127.0.0.1"
    """The address Mooncake's master and clients (engines, trainer ranks) listen on: 127.0.0.1 on one
    node; `auto` on a cluster (each process its node's address as Ray knows it)."""
    protocol: str = "tcp"
    """Mooncake's transport: tcp, or rdma on clusters with RDMA NICs (with `device`)."""
    device: str = ""
    """Mooncake's RDMA device(s), e.g. mlx5_0 (empty: Mooncake chooses)."""
    store_gb: float = 4.0
    """Memory each engine adds to Mooncake's store, GB (host memory of the engine's node); at least
    0.0168 (16 MiB, the smallest segment Mooncake takes)."""
    window_gb: float = 0.0
    """Hidden states each trainer rank may have on their way (asked for, in the store, or fetched and
    not yet trained), GB; 0 = 80% of the store divided among the ranks. An engine is handed a sample
    only when its rank has room: the store never fills."""
    request_tokens: int = 16384
    """Prompt tokens per engine call (a batch of samples vLLM prefills together)."""
    fetch_timeout_s: float = 300.0
    """How long a rank waits for a sample's states once its engine answered (the object should be in
    the store within milliseconds); past it the sample is asked for again."""
    wait_timeout_s: float = 3600.0
    """How long a rank waits for a batch's states in all (engines loading count): past it the run
    stops naming the samples and the engines; 0 = forever."""
    parity: int = 2
    """The first this-many samples of every engine that trainer rank 0 receives are compared with a
    plain forward of the target through transformers on CPU (as extract.vllm_parity does); a
    mismatch stops the run naming the engine, sample and layer. It loads the whole target into
    host memory: 0 for targets that do not fit, where vLLM is checked on a proxy instead (a tiny random
    model of the target's architecture through one stream engine, before the target's engines load:
    extract.vllm_proxy_parity, whose auto runs it when this is 0)."""
    max_attempts: int = 3
    """Times one sample is asked for before the run stops naming it and its errors."""
    engine_restarts: int = 2
    """Times Ray restarts a dead engine (a reload of the target) before the run stops naming it."""

    def __post_init__(self) -> None:
        for name in ("store_gb", "window_gb", "fetch_timeout_s", "wait_timeout_s"):
            v = getattr(self, name)
            require(math.isfinite(v) and v >= 0, f"train.stream.{name}={v} must be a finite number >= 0")
        require(self.engines >= 1, f"train.stream.engines={self.engines} must be >= 1")
        require(self.store_gb > 0, f"train.stream.store_gb={self.store_gb} must be > 0")
        require(self.store_gb * 1e9 >= MOONCAKE_MIN_SEGMENT,
                f"train.stream.store_gb={self.store_gb} is below the smallest store Mooncake takes "
                f"({MOONCAKE_MIN_SEGMENT / 1e9:.4g} GB = 16 MiB per engine; a smaller one stops the engine at its first "
                "put): raise it")
        require(self.request_tokens >= 1, f"train.stream.request_tokens={self.request_tokens} must be >= 1")
        require(self.fetch_timeout_s > 0, f"train.stream.fetch_timeout_s={self.fetch_timeout_s} must be > 0")
        require(self.parity >= 0, f"train.stream.parity={self.parity} must be >= 0 (0 = off)")
        require(self.max_attempts >= 1, f"train.stream.max_attempts={self.max_attempts} must be >= 1")
        require(self.engine_restarts >= 0, f"train.stream.engine_restarts={self.engine_restarts} must be >= 0")
        require(not self.engine_urls or bool(self.master),
                "train.stream.engine_urls needs train.stream.master: the servers put into that master's store")
        require(self.protocol in ("tcp", "rdma"), f"train.stream.protocol={self.protocol!r}: choose tcp or rdma")
