"""What a resumed training continues, and what it changes: checked and recorded, never assumed.

A checkpoint carries the identity of what it was trained on (`identity.json`: the samples' ids and
lengths, the draft vocabulary) and its draft's shape (`draft_config.json`); a resume on other data,
another vocabulary or another shape is refused before the checkpoint's state is read
(`check_resume`). The train settings it was trained with travel in trainer.pt; every one that
differs on resume is applied from the resumed step on and recorded as a change
(`{"step", "key", "from", "to"}`: in the checkpoints after it, metrics.jsonl and meta.json). The
optimizer and the learning-rate schedule live in the checkpoint's own state, so `apply_schedule`
sets them from this run's settings: the new lr, betas and weight decay, and the schedule (warmup,
cosine, min_lr_ratio) of this run's total steps, as if it had been planned so from step 0.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch

from eyas.artifacts import hash_json
from eyas.config import TrainConfig, to_dict
from eyas.errors import ArtifactError, ConfigError

IDENTITY = "identity.json"
"""In each checkpoint: `data_identity` of the data and draft vocabulary it was trained on."""

NOT_RECORDED = ("out_dir", "resume", "init_from", "init_vocab", "init_head")
"""train keys that are no change to a resumed run: where it writes, what it resumes, and how a run
starts (the checkpoint holds the weights)."""

DRAFT_KEYS = {"num_attention_heads": "train.num_attention_heads", "num_key_value_heads": "train.num_key_value_heads",
              "head_dim": "train.head_dim", "intermediate_size": "train.intermediate_size",
              "num_layers": "train.num_layers", "rope_theta": "train.rope_theta", "attention": "train.draft_attention",
              "norm_before_residual": "train.norm_before_residual", "fc_norm": "train.norms",
              "norm_output": "train.norms", "sliding_window": "train.sliding_window", "num_aux_layers": "extract.layer_ids",
              "aux_layer_ids": "extract.layer_ids", "draft_vocab_size": "prepare.draft_vocab_size"}
"""A draft_config.json key -> the setting that makes it (any other: the target, target.model)."""


def data_identity(source, d2t: torch.Tensor, t2d: torch.Tensor) -> dict[str, Any]:
    """The data a run trains on, by content: its samples' ids and token counts, and the draft
    vocabulary (d2t, t2d). The same prepare and extract outputs made again give the same identity."""
    ids = list(getattr(source, "ids", []) or [])
    lengths = torch.as_tensor(source.lengths).tolist()
    vocab = hashlib.sha256(d2t.cpu().contiguous().numpy().tobytes() + t2d.cpu().contiguous().numpy().tobytes())
    return {"samples": hash_json([ids, lengths])[:16], "num_samples": len(lengths),
            "vocab": vocab.hexdigest()[:16], "draft_vocab_size": int(d2t.numel())}


def check_resume(path: Path, identity: dict[str, Any], draft: dict[str, Any]) -> None:
    """ConfigError unless checkpoint `path` was trained on this data and vocabulary (`identity`)
    into a draft of this shape (`draft`, a DraftConfig dict). Reads its two small JSON files only."""
    how = (f"resume it with the data and settings it was trained with, or start a new run from its weights "
           f"(--train.init_from={path} and a new --train.out_dir")
    try:
        shape = json.loads((path / "draft_config.json").read_text())
    except (OSError, ValueError) as e:
        raise ArtifactError(f"checkpoint {path}: draft_config.json is unreadable ({type(e).__name__}: {e}); remove "
                            "the checkpoint to resume from the one before it") from e
    diff = [k for k in draft if k in shape and shape[k] != draft[k]]
    if diff:
        what = ", ".join(f"{k} {shape[k]} -> {draft[k]} ({DRAFT_KEYS.get(k, 'target.model')})" for k in diff)
        raise ConfigError(f"checkpoint {path} holds a draft of another shape than this run builds: {what}. Resume it "
                          "with the settings it was trained with, or start a new run (a new --train.out_dir)")
    file = path / IDENTITY
    if not file.is_file():
        print(f"[eyas:train] note: {path} was written by an earlier eyas and does not record its data: not checked",
              flush=True)
        return
    try:
        was = json.loads(file.read_text())
        same_data, same_vocab = was["samples"] == identity["samples"], was["vocab"] == identity["vocab"]
    except (ValueError, KeyError, TypeError) as e:
        raise ArtifactError(f"{file} is not a checkpoint identity ({type(e).__name__}: {e}): remove the checkpoint to "
                            "resume from the one before it") from e
    if not same_vocab:
        raise ConfigError(f"checkpoint {path} was trained on another draft vocabulary ({was['draft_vocab_size']} tokens, "
                          f"{was['vocab']}) than this run's prepare output ({identity['draft_vocab_size']}, "
                          f"{identity['vocab']}): {how}, with --train.init_vocab=remap)")
    if not same_data:
        raise ConfigError(f"checkpoint {path} was trained on other data ({was['num_samples']} samples, {was['samples']}) "
                          f"than this run reads ({identity['num_samples']} samples, {identity['samples']}): {how})")


def settings(tc: TrainConfig, sched) -> dict[str, Any]:
    """The train settings a checkpoint records, to compare a resume's with, the `seed` and world
    size that order the data, and the schedule they make (`sched`, a loop.Schedule):
    `schedule.total_steps` (train.max_steps, or epochs x the data) and `schedule.warmup_steps`."""
    from eyas.run.plan import BUDGET_KEYS

    skip = set(NOT_RECORDED) | set(BUDGET_KEYS["train"])
    out = {f"train.{k}": v for k, v in to_dict(tc).items() if k not in skip}
    out.update({"seed": sched.seed, "world_size": sched.world, "schedule.total_steps": sched.total,
                "schedule.warmup_steps": warmup_steps(tc, sched.total)})
    return out


def warmup_steps(tc: TrainConfig, total_steps: int) -> int:
    return tc.warmup_steps or int(round(tc.warmup_ratio * total_steps))


def changes(state: dict[str, Any], now: dict[str, Any], step: int) -> list[dict[str, Any]]:
    """`{"step", "key", "from", "to"}` for each recorded setting (`settings`) that differs from
    `now`. The optimizer's lr, betas and weight decay, the world size and the total steps are read from
    the state they ran with, so a checkpoint of an earlier eyas (no settings) is compared on them too."""
    group = state["optimizer"]["param_groups"][0]
    was = dict(state.get("settings") or {})
    was.update({"train.lr": group["initial_lr"], "train.betas": list(group["betas"]),
                "train.weight_decay": group["weight_decay"], "schedule.total_steps": state["total_steps"],
                "world_size": state["world_size"]})
    return [{"step": step, "key": k, "from": was[k], "to": v} for k, v in now.items() if k in was and was[k] != v]


def apply_schedule(optimizer, scheduler, tc: TrainConfig, step: int) -> float:
    """This run's lr, betas and weight decay in the optimizer restored from a checkpoint, and its
    schedule from `step` on (the scheduler's lambda is already this run's: built with its total and
    warmup); -> the lr of the first resumed step. Unchanged settings give the checkpoint's values."""
    scheduler.base_lrs = [tc.lr for _ in optimizer.param_groups]
    for group, lam in zip(optimizer.param_groups, scheduler.lr_lambdas):
        group.update(initial_lr=tc.lr, lr=tc.lr * lam(step), betas=tuple(tc.betas), weight_decay=tc.weight_decay)
    scheduler._last_lr = [g["lr"] for g in optimizer.param_groups]  # what get_last_lr() reports for this step
    return optimizer.param_groups[0]["lr"]
