from __future__ import annotations

import re
from dataclasses import dataclass, field

from eyas.config.base import require

BACKENDS = ("hf", "vllm", "server")


@dataclass
class RegenerateConfig:
    enabled: bool = False
    """In `eyas run`: regenerate the assistant answers with the target before prepare (prepare then
    reads the regenerate stage's conversations.jsonl: in regenerate.out_dir, else RUN_DIR/regenerate).
    `eyas regenerate` always runs."""
    backend: str = "hf"
    """hf: in-process transformers `generate` (batched, KV cache); vllm: vLLM's offline engine in this
    process, with extract's vLLM settings (extract.vllm_tensor_parallel_size, vllm_engine_args, ...);
    with extract.backend=vllm, `eyas run` loads the target once for both stages; server: any
    OpenAI-compatible `/v1/chat/completions` endpoint (vllm serve, SGLang) at `server_url`."""
    max_new_tokens: int = 512
    """Most tokens generated per assistant turn."""
    temperature: float = 0.0
    """0 = greedy; > 0 samples with this temperature."""
    top_p: float = 1.0
    """Nucleus sampling mass (with temperature > 0)."""
    max_prompt_tokens: int = 2048
    """A turn whose prompt (the conversation so far) is longer stops the conversation there."""
    batch_size: int = 64
    """hf backend: prompts generated together (sorted by length). With the static cache a shorter
    batch is filled up to the next power of two (>= 8) rows: one CUDA graph per shape."""
    static_widths: list[int] = field(default_factory=list)
    """hf backend with the static cache: the prompt widths (left-padded) batches are padded to; a
    batch takes the smallest that fits, and its KV buffers hold width + max_new_tokens slots per
    row (attention reads them all, so small widths decode faster). Empty = [512, max_prompt_tokens]."""
    max_turns: int = 0
    """Regenerate at most this many assistant turns per conversation; the conversation ends after
    its last regenerated answer (0 = all turns). Late rounds hold few conversations, so a cap
    trades the long tail of a multi-turn set for throughput."""
    max_seconds: float = 0.0
    """Wall-clock budget (0 = none): after the first chunk, no new chunk is started when the time
    used plus its planned time would exceed it (the slowest chunk so far per batch of batch_size
    rows, times the batches the next chunk fills: a short last chunk is planned at its own cost;
    sampling self_prompts counts too). What was written stays (the count is reported and recorded in
    meta.json as `stopped_early`); a later run with a larger budget continues from there."""
    chunk_conversations: int = 256
    """Conversations regenerated (all their turns) and then written together; the resume unit."""
    static_cache: bool = True
    """hf backend on CUDA: eyas's batched decoder, fixed-size KV buffers and the decode step as one CUDA
    graph (eyas/spec/static.py BatchDecoder); false = transformers `generate` with its dynamic cache."""
    device: str = ""
    """hf backend device (empty = cuda if available, else cpu)."""
    server_url: str = "http://127.0.0.1:8000"
    """server backend: base URL (the endpoint is {server_url}/v1/chat/completions). Credentials in it
    (`https://user:password@host`) go as HTTP basic auth and are shown as `user:***@host` in every
    file and message eyas writes."""
    server_api_key_env: str = ""
    """server backend: the name of an environment variable holding the server's API key (vLLM's
    `--api-key`), sent as `Authorization: Bearer ...`; the key itself never enters a config, file
    or log. Empty = no key."""
    server_model: str = ""
    """server backend: the `model` field of each request (empty = target.model)."""
    concurrency: int = 16
    """server backend: requests in flight at once."""
    retries: int = 3
    """server backend: attempts after the first for connection errors, HTTP 5xx/429, answers that are
    not JSON, cut off, stalled or empty (then the run fails; an empty answer is refused)."""
    max_retry_wait_s: float = 300.0
    """server backend: most seconds one request waits between its attempts, all retries together.
    A wait is the server's `Retry-After` (HTTP 429/503) plus up to a quarter of it, else 1, 2, 4, ...
    (at most 30) seconds, each jittered by half either way so that requests turned away together
    do not come back together; a wait that would pass this total fails the run at once, naming it."""
    max_refused_fraction: float = 0.01
    """server backend: the share of answers that may be refused before the stage fails (checked
    after each chunk, before it is written). Refused: empty (no content, no reasoning) after the
    retries, longer than max_new_tokens (a server that ignores `max_tokens`: its own token count
    over it, or more than 1 MiB + 4 KiB per token, where reading stops), or not valid UTF-8. A
    refused answer is never written: its conversation ends before that turn; each is printed when
    it happens and counted in meta.json (`answers_refused_*`)."""
    timeout_s: float = 600.0
    """server backend: seconds per request."""
    stall_s: float = 60.0
    """server backend: answers are streamed (the response starts at once, then one event per token);
    a request that receives nothing for this many seconds, its start included (a server that
    stopped generating but keeps its connections open), is reported as stalled when it happens, and
    retried like a failed one. With extra_body {stream: false} timeout_s applies instead."""
    out_dir: str = ""
    """Output directory; empty = RUN_DIR/regenerate."""
    extra_body: dict = field(default_factory=dict)
    """server backend: extra fields merged into every request body."""
    self_prompts: int = 0
    """Also write single-turn conversations whose user turn the target writes itself: this many
    samples from the chat template's text before a user message's content (the Magpie method,
    Xu et al. 2024), each answered like the data's turns. Prompts of the target's own kind where
    the data has few short, self-contained requests. Samples that do not end within
    self_prompt_max_tokens, are empty or repeat an earlier one are dropped (counted in meta.json).
    With prepare.system_prompt they are sampled and answered after it. hf backend only; the chat
    template's user turn must end with a token the target stops at (ChatML, Llama 3 do)."""
    self_prompt_temperature: float = 1.0
    """Sampling temperature of the self-written user turns (0 = greedy: one distinct prompt)."""
    self_prompt_top_p: float = 0.95
    """Nucleus mass of the self-written user turns."""
    self_prompt_max_tokens: int = 256
    """Most tokens of a self-written user turn."""
    self_prompt_systems: list[str] = field(default_factory=list)
    """System prompts that steer what kind of user turn the target writes (Magpie's control of the
    task, e.g. "You are an AI assistant that helps with math problems."), used only while sampling
    the user turns: sample i follows the (i mod n)-th; the conversations do not keep them and are
    answered like the other self-written ones (after prepare.system_prompt, else the template's
    own). For prompts of the kinds a benchmark asks (writing, math, coding, ...) without its
    questions. Empty = sample after the prompt the answers get. meta.json counts the kept turns per
    system prompt."""

    def __post_init__(self) -> None:
        require(self.backend in BACKENDS, f"regenerate.backend={self.backend!r}: choose one of {', '.join(BACKENDS)}")
        require(self.max_new_tokens >= 1, f"regenerate.max_new_tokens={self.max_new_tokens} must be >= 1")
        require(self.temperature >= 0, f"regenerate.temperature={self.temperature} must be >= 0")
        require(0 < self.top_p <= 1, f"regenerate.top_p={self.top_p} must lie in (0, 1]")
        require(all(w >= 8 for w in self.static_widths), f"regenerate.static_widths={self.static_widths}: widths must be >= 8")
        require(self.max_turns >= 0, f"regenerate.max_turns={self.max_turns} must be >= 0 (0 = all)")
        require(self.max_seconds >= 0, f"regenerate.max_seconds={self.max_seconds} must be >= 0 (0 = no budget)")
        require(self.batch_size >= 1, f"regenerate.batch_size={self.batch_size} must be >= 1")
        require(self.chunk_conversations >= 1, f"regenerate.chunk_conversations={self.chunk_conversations} must be >= 1")
        require(self.concurrency >= 1, f"regenerate.concurrency={self.concurrency} must be >= 1")
        require(self.retries >= 0, f"regenerate.retries={self.retries} must be >= 0")
        require(self.max_retry_wait_s >= 0, f"regenerate.max_retry_wait_s={self.max_retry_wait_s} must be >= 0")
        require(0 <= self.max_refused_fraction <= 1,
                f"regenerate.max_refused_fraction={self.max_refused_fraction} must lie in [0, 1]")
        require(self.stall_s > 0 and self.timeout_s > 0,
                f"regenerate.stall_s={self.stall_s} and regenerate.timeout_s={self.timeout_s} must be > 0")
        require(not self.server_api_key_env or re.fullmatch(r"[A-Z_][A-Z0-9_]*", self.server_api_key_env) is not None,
                "regenerate.server_api_key_env names the environment variable that holds the key, in capitals (e.g. "
                "VLLM_API_KEY), not the key itself; the value given is no such name (not shown: it may be a key)")
        require(self.max_prompt_tokens >= 8, f"regenerate.max_prompt_tokens={self.max_prompt_tokens} is too small")
        require(self.self_prompts >= 0, f"regenerate.self_prompts={self.self_prompts} must be >= 0 (0 = none)")
        require(self.self_prompts == 0 or self.backend == "hf",
                f"regenerate.self_prompts={self.self_prompts} needs regenerate.backend=hf (the target samples "
                "from its own chat template's text, which a chat-completions server does not take)")
        require(self.self_prompt_temperature >= 0,
                f"regenerate.self_prompt_temperature={self.self_prompt_temperature} must be >= 0")
        require(0 < self.self_prompt_top_p <= 1, f"regenerate.self_prompt_top_p={self.self_prompt_top_p} must lie in (0, 1]")
        require(self.self_prompt_max_tokens >= 1, f"regenerate.self_prompt_max_tokens={self.self_prompt_max_tokens} must be >= 1")
        require(not self.self_prompt_systems or self.self_prompts > 0,
                "regenerate.self_prompt_systems steers self-written user turns: set regenerate.self_prompts too")
        require(all(isinstance(t, str) and t.strip() for t in self.self_prompt_systems),
                f"regenerate.self_prompt_systems={self.self_prompt_systems!r}: each must be a non-empty string")
