"""The plan of a run: which stages run, the config each sees, their run keys, and the state of
each stage's output (done, partial, made from other inputs, stale)."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Any

from eyas import artifacts
from eyas.config import STAGES, EyasConfig, to_dict
from eyas.errors import ArtifactError, ConfigError

# The config sections whose values define each stage's output (besides the stage before it).
SECTIONS = {
    "regenerate": ("target", "prepare", "regenerate"),
    "prepare": ("target", "prepare"),
    "extract": ("target", "extract"),
    "train": ("target", "train", "seed"),
    "export": ("export",),
    "evaluate": ("target", "evaluate", "seed"),
}


# Keys that bound how long one invocation works on a stage or how it runs, not what the stage
# produces: changing them neither invalidates an output nor re-runs a stage (so `--train.resume
# auto` or a new budget never deletes a partial training; `--extract.allow_failures=true` accepts
# an extraction's skipped samples without extracting again). evaluate.max_seconds stays in the key:
# evaluation does not resume, so a larger budget has to re-run it.
BUDGET_KEYS = {
    "regenerate": ("max_seconds", "stall_s", "timeout_s", "retries", "concurrency", "server_api_key_env",
                   "max_retry_wait_s", "max_refused_fraction"),
    "prepare": ("num_workers",),
    "extract": ("allow_failures", "progress", "spill_dirs", "min_free_gb"),  # where shards go, not what they hold
    "train": ("max_seconds", "stop_by", "resume", "num_workers", "loader_timeout_s", "collapse_steps", "tensorboard",
              "keep_checkpoints", "loss_kernel", "target_group_tokens",
              "stream"),  # where and how the states are captured and moved, not which: its flags never wipe a training
}


KEY_SCHEME = "v3"
"""Run keys name the scheme they were made by; a stage directory whose key is of another scheme
(an earlier eyas) is never removed as "made with other settings": it may hold a training."""


def stage_plan(cfg: EyasConfig) -> tuple[dict[str, EyasConfig], list[str]]:
    """The stages to run and the config each sees: with regenerate enabled, regenerate reads
    `prepare.data` and every later stage sees prepare reading regenerate's conversations; online
    and stream training need no extract stage."""
    stages = [s for s in STAGES if (s != "regenerate" or cfg.regenerate.enabled)
              and (s != "extract" or cfg.train.mode == "offline")]
    later = copy.deepcopy(cfg)
    if cfg.regenerate.enabled:
        later.prepare.data = str(cfg.stage_dir("regenerate") / "conversations.jsonl")
        later.prepare.format = "openai"
    return {s: cfg if s == "regenerate" else later for s in stages}, stages


def run_keys(configs: dict[str, EyasConfig], stages: list[str]) -> dict[str, str]:
    keys, prev = {}, ""
    for s in stages:
        sections = {name: changed_fields(getattr(configs[s], name)) for name in SECTIONS[s]}
        if s == "regenerate":  # regenerate reads only the data fields of prepare
            p = sections["prepare"]
            sections["prepare"] = {k: p[k] for k in ("data", "format", "max_conversations", "system_prompt") if k in p}
        if s == "train" and "extract" not in stages:  # online, stream: train captures the aux layers itself
            sections["extract"] = {"layer_ids": configs[s].extract.layer_ids}
            if configs[s].train.mode == "stream":
                sections["extract"]["store_dtype"] = configs[s].extract.store_dtype
        for name, budget in BUDGET_KEYS.items():
            if name in sections:
                sections[name] = {k: v for k, v in sections[name].items() if k not in budget}
        keys[s] = prev = f"{KEY_SCHEME}:" + artifacts.hash_json({"stage": s, "sections": sections, "previous": prev})
    return keys


def changed_fields(section) -> dict[str, Any]:
    """A config section's fields whose values differ from their defaults: what a run key hashes, so
    that a field a later eyas adds (at its default) leaves the keys of earlier runs alone."""
    values = to_dict(section)
    if not dataclasses.is_dataclass(section):  # a top-level value (seed, ...)
        return values
    out = {}
    for f in dataclasses.fields(section):
        if f.name not in values:
            continue
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            out[f.name] = values[f.name]
            continue
        if values[f.name] != to_dict(default):
            out[f.name] = values[f.name]
    return out


def source_fingerprint(data: str) -> str:
    """What the first stage reads: the data file's content (sha256; a `datasets` directory by its
    files' names and sizes), as prepare records it."""
    from eyas.prepare import data_hash

    if data != "embedded:sharegpt" and not Path(data).exists():
        raise ConfigError(f"prepare.data={data!r}: no such file or directory")
    return "data:" + data_hash(data)


def stage_state(stage_dir: Path, stage: str, key: str, upstream: str) -> tuple[str, dict[str, Any]]:
    """("done" | "partial" | "inputs" | "stale", meta): a complete output of this key made from the
    previous stage's current output (`upstream`: the hash of its meta.json; for the first stage the
    data file's `source_fingerprint`), one that stopped early at its time budget, one made from an
    earlier state of its input (continued or edited since), or anything else (missing, interrupted,
    other settings)."""
    try:
        meta = artifacts.read_meta(stage_dir, stage)
    except ArtifactError:
        return "stale", {}
    if meta.get("run_key") != key:
        return "stale", meta
    if meta.get("upstream") != upstream:
        return "inputs", meta
    return ("partial" if is_partial(meta) else "done"), meta


def is_partial(meta: dict[str, Any]) -> bool:
    return bool((meta.get("counts") or {}).get("stopped_early"))


def partial_progress(stage: str, meta: dict[str, Any]) -> str:
    c = meta.get("counts") or {}
    if stage == "regenerate":
        return f"{c.get('conversations_written')} of {(c.get('conversations_in') or 0) + (c.get('self_written') or 0)} conversations"
    if stage == "train":
        return f"{c.get('steps')} of {c.get('planned_steps')} steps"
    return "stopped early"
