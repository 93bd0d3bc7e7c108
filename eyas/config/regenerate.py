from __future__ import annotations

from dataclasses import dataclass, field

from eyas.config.base import require

BACKENDS = ("hf", "server")


@dataclass
class RegenerateConfig:
    enabled: bool = False
    """In `eyas run`: regenerate the assistant answers with the target before prepare (prepare then
    reads RUN_DIR/regenerate/conversations.jsonl). `eyas regenerate` always runs."""
    backend: str = "hf"
    """hf: in-process transformers `generate` (batched, KV cache); server: any OpenAI-compatible
    `/v1/chat/completions` endpoint (vllm serve, SGLang) at `server_url`."""
    max_new_tokens: int = 512
    """Most tokens generated per assistant turn."""
    temperature: float = 0.0
    """0 = greedy; > 0 samples with this temperature."""
    top_p: float = 1.0
    """Nucleus sampling mass (with temperature > 0)."""
    max_prompt_tokens: int = 2048
    """A turn whose prompt (the conversation so far) is longer stops the conversation there."""
    batch_size: int = 64
    """hf backend: prompts generated together (sorted by length)."""
    chunk_conversations: int = 256
    """Conversations regenerated (all their turns) and then written together; the resume unit."""
    static_cache: bool = True
    """hf backend on CUDA: a static KV cache compiled by transformers (much faster after ~40 s of compilation)."""
    device: str = ""
    """hf backend device (empty = cuda if available, else cpu)."""
    server_url: str = "http://127.0.0.1:8000"
    """server backend: base URL (the endpoint is {server_url}/v1/chat/completions)."""
    server_model: str = ""
    """server backend: the `model` field of each request (empty = target.model)."""
    concurrency: int = 16
    """server backend: requests in flight at once."""
    retries: int = 3
    """server backend: attempts after the first for connection errors and HTTP 5xx/429 (then the run fails)."""
    timeout_s: float = 600.0
    """server backend: seconds per request."""
    out_dir: str = ""
    """Output directory; empty = RUN_DIR/regenerate."""
    extra_body: dict = field(default_factory=dict)
    """server backend: extra fields merged into every request body."""

    def __post_init__(self) -> None:
        require(self.backend in BACKENDS, f"regenerate.backend={self.backend!r}: choose one of {', '.join(BACKENDS)}")
        require(self.max_new_tokens >= 1, f"regenerate.max_new_tokens={self.max_new_tokens} must be >= 1")
        require(self.temperature >= 0, f"regenerate.temperature={self.temperature} must be >= 0")
        require(0 < self.top_p <= 1, f"regenerate.top_p={self.top_p} must lie in (0, 1]")
        require(self.batch_size >= 1, f"regenerate.batch_size={self.batch_size} must be >= 1")
        require(self.chunk_conversations >= 1, f"regenerate.chunk_conversations={self.chunk_conversations} must be >= 1")
        require(self.concurrency >= 1, f"regenerate.concurrency={self.concurrency} must be >= 1")
        require(self.retries >= 0, f"regenerate.retries={self.retries} must be >= 0")
        require(self.max_prompt_tokens >= 8, f"regenerate.max_prompt_tokens={self.max_prompt_tokens} is too small")
