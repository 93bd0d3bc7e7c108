"""The whole eyas configuration: one typed section per stage (see each section's field docs).

    cfg = load_config("recipe.yaml", ["--prepare.max_length=4096"])

Precedence: dataclass defaults < YAML file < `--section.key=value` overrides. The resolved config
is written as `config.yaml` beside every stage output.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from eyas.config.base import deep_merge, field_docs, from_dict, parse_overrides, read_yaml, require, to_dict
from eyas.config.evaluate import EvaluateConfig
from eyas.config.export import ExportConfig
from eyas.config.extract import ExtractConfig
from eyas.config.plot import PlotConfig
from eyas.config.prepare import PrepareConfig
from eyas.config.regenerate import RegenerateConfig
from eyas.config.target import TargetConfig
from eyas.config.train import TrainConfig

STAGES = ("regenerate", "prepare", "extract", "train", "export", "evaluate")
"""The stages in run order; stage S is the module eyas.S with `main(cfg)` and the config section S."""
RESUMABLE = ("regenerate", "train")
"""Stages a time budget can stop early; `eyas run` continues them (or takes them as they are: accept_partial)."""


@dataclass
class EyasConfig:
    run_dir: str = "runs/eyas"
    """Directory holding one subdirectory per stage (prepare/, extract/, ...)."""
    seed: int = 0
    """Seed for every random choice (shuffles, splits, initialisation, sampling)."""
    note: str = ""
    """A note `eyas run` prints with its summary (what the recipe is for, what it is not)."""
    stop_after: str = ""
    """`eyas run` only: stop after this stage (regenerate, prepare, extract, train, export); the next
    `eyas run` of the same recipe skips what is done and continues (for jobs with a time limit)."""
    accept_partial: str = ""
    """`eyas run` only: stages (comma-separated: regenerate, train) whose output, stopped early at
    their `max_seconds` budget, is used as it is. A partial stage not named here is continued by
    the next run, and the stages after it run again on the new output."""
    target: TargetConfig = field(default_factory=TargetConfig)
    """The target model every stage works for."""
    prepare: PrepareConfig = field(default_factory=PrepareConfig)
    """Chat data -> tokens, loss masks, draft vocabulary."""
    regenerate: RegenerateConfig = field(default_factory=RegenerateConfig)
    """Optional: the target rewrites the assistant answers (the largest lever on acceptance)."""
    extract: ExtractConfig = field(default_factory=ExtractConfig)
    """Target hidden states -> sharded safetensors."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """EAGLE-3 draft training."""
    export: ExportConfig = field(default_factory=ExportConfig)
    """Draft -> vLLM / SGLang layouts."""
    evaluate: EvaluateConfig = field(default_factory=EvaluateConfig)
    """Speculative decoding: acceptance length and speedup."""
    plot: PlotConfig = field(default_factory=PlotConfig)
    """Training curves as PNG."""

    def __post_init__(self) -> None:
        require(bool(self.run_dir), "run_dir is empty")
        require(self.stop_after in ("",) + STAGES, f"stop_after={self.stop_after!r}: choose one of {', '.join(STAGES)}")
        for name in self.accept_partial_stages():
            require(name in RESUMABLE, f"accept_partial: {name!r} is not one of {', '.join(RESUMABLE)}")
        # checked here, before any stage runs: the export stage would refuse it only after training
        require(
            self.train.num_layers == 1 or "sglang" not in self.export.formats,
            f"train.num_layers={self.train.num_layers} with export.format={self.export.format!r}: SGLang serves "
            "single-layer EAGLE-3 drafts only; add --export.format=speculators (vLLM serves multi-layer drafts)",
        )
        require(
            self.train.norms == "eagle3" or "sglang" not in self.export.formats,
            f"train.norms={self.train.norms!r} with export.format={self.export.format!r}: SGLang's EAGLE-3 draft has "
            "no EAGLE 3.1 norms (fc_norm, norm_output); add --export.format=speculators (vLLM serves them)",
        )
        require(
            self.train.draft_attention != "mla" or "speculators" not in self.export.formats,
            f"train.draft_attention=mla with export.format={self.export.format!r}: vLLM's speculators layout builds "
            "only Llama / Qwen3 draft layers; set --export.format=sglang (Eagle3DeepseekV3ForCausalLM, the layout vLLM "
            "and SGLang load an MLA draft from)",
        )
        require(
            self.train.sliding_window == 0 or "sglang" not in self.export.formats,
            f"train.sliding_window={self.train.sliding_window} with export.format={self.export.format!r}: SGLang "
            "applies no sliding window from a draft's config (it would serve the draft with full attention); add "
            "--export.format=speculators (vLLM reads sliding_window and layer_types)",
        )

    def accept_partial_stages(self) -> list[str]:
        return [n.strip() for n in self.accept_partial.split(",") if n.strip()]

    def stage_dir(self, stage: str) -> Path:
        """The output directory of `stage`: its own out_dir, else RUN_DIR/stage."""
        section = getattr(self, stage)
        out = getattr(section, "out_dir", "")
        return Path(out) if out else Path(self.run_dir) / stage


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> EyasConfig:
    data: dict[str, Any] = read_yaml(path) if path else {}
    if overrides:
        data = deep_merge(data, parse_overrides(overrides))
    return from_dict(EyasConfig, data)


def dump_config(cfg: EyasConfig, secrets: bool = False) -> str:
    """The config as YAML, URL passwords shown as *** unless `secrets` (see config.base.to_dict)."""
    return yaml.safe_dump(to_dict(cfg, secrets), sort_keys=False)


def describe(cls: type = EyasConfig, prefix: str = "") -> list[str]:
    """One line per field: dotted key, default, docstring (for `eyas config --help`)."""
    lines = []
    docs = field_docs(cls)
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default):
            lines.append(f"{key}: {docs.get(f.name, '')}")
            lines.extend(describe(type(default), key + "."))
        else:
            lines.append(f"  --{key}={default!r}  {docs.get(f.name, '')}")
    return lines


__all__ = [
    "STAGES",
    "RESUMABLE",
    "EyasConfig",
    "TargetConfig",
    "PrepareConfig",
    "RegenerateConfig",
    "ExtractConfig",
    "TrainConfig",
    "ExportConfig",
    "EvaluateConfig",
    "PlotConfig",
    "load_config",
    "dump_config",
    "describe",
    "to_dict",
]
