"""Atomic training checkpoints: OUT_DIR/checkpoints/step_XXXXXXX/.

    draft.safetensors, draft_config.json   the draft (eyas.draft_files checkpoint form)
    trainer.pt                             optimizer, scheduler, step, epoch, data position,
                                           RNG states (python, numpy, torch, cuda), world size,
                                           the train settings and the changes made on resumes
    identity.json                          the data and draft vocabulary it was trained on
                                           (eyas.train.resume, checked before a resume)
    checksums.json                         each file's sha256, checked before a resume reads any

trainer.pt is read with `torch.load(weights_only=True)`: tensors, numbers, strings and containers,
plus the numpy array of the numpy RNG state (`SAFE_GLOBALS`), never a callable, so a checkpoint
someone shares cannot run code on `--train.resume`. A file that needs more is refused naming it.

A checkpoint is written into a temporary sibling directory which is renamed into place when it
is complete, so `latest()` never sees a partial one (a kill -9 mid-write leaves only a
`.tmp-*` directory, removed on the next save). Full (unsharded) state dicts are gathered on
every rank through torch.distributed.checkpoint.state_dict, so the same code serves a plain
module, DDP and FSDP2; rank 0 writes.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from eyas.draft import DraftConfig, Eagle3Draft
from eyas.draft_files import save_draft
from eyas.artifacts import atomic_write_json, fsync_dir
from eyas.assets import sha256_file
from eyas.errors import ArtifactError, ConfigError, DamagedArtifact
from eyas.train.resume import IDENTITY

STEP_RE = re.compile(r"^step_(\d{7,})$")
TRAINER_STATE = "trainer.pt"
TRAINER_FIELDS = ("step", "epoch", "window", "world_size", "total_steps", "train_split", "all_runs", "init_from",
                  "optimizer", "scheduler", "rng")
"""What `load` needs from trainer.pt (train.loop.save writes them)."""


def _numpy_globals() -> list:
    """What the numpy RNG state (an ndarray of uint32) unpickles through, under the names numpy 2
    and numpy 1 write: they build an array and nothing else."""
    try:
        from numpy._core.multiarray import _reconstruct
    except ImportError:  # numpy 1
        from numpy.core.multiarray import _reconstruct
    return [np.ndarray, np.dtype, type(np.dtype(np.uint32)), (_reconstruct, "numpy._core.multiarray._reconstruct"),
            (_reconstruct, "numpy.core.multiarray._reconstruct")]


SAFE_GLOBALS = _numpy_globals()
"""Allowed in trainer.pt besides what torch.load(weights_only=True) allows by default."""


def _options(cpu: bool = True):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=cpu)


def model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The full draft state dict on CPU, with eyas.draft names. Collective."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    msd = get_model_state_dict(model, options=_options())
    return {k.removeprefix("draft."): v for k, v in msd.items()}


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """(draft state dict, full optimizer state dict). Collective."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return model_state(model), get_optimizer_state_dict(model, optimizer, options=_options())


def write_draft(state: dict[str, torch.Tensor], cfg: DraftConfig, out_dir: Path) -> None:
    """eyas.draft_files.save_draft on a module built on the meta device around the gathered tensors."""
    with torch.device("meta"):
        m = Eagle3Draft(cfg, torch.empty(cfg.vocab_size, cfg.hidden_size))
    m.load_state_dict(state, strict=True, assign=True)
    save_draft(m, out_dir)


def rng_state() -> dict[str, Any]:
    st = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        st["cuda"] = torch.cuda.get_rng_state_all()
    return st


def set_rng_state(st: dict[str, Any]) -> None:
    random.setstate(st["python"])
    np.random.set_state(st["numpy"])
    torch.set_rng_state(st["torch"])
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(st["cuda"])


def save(
    ckpt_root: Path, step: int, model: nn.Module, optimizer, scheduler, draft_cfg: DraftConfig,
    trainer: dict[str, Any], rank: int, keep: int, identity: dict[str, Any] | None = None,
) -> Path | None:
    """Write checkpoint `step` (collective: every rank calls it); -> its directory on rank 0.
    `identity`: the data and vocabulary it was trained on (train.resume.data_identity), IDENTITY."""
    msd, osd = full_state(model, optimizer)
    if rank != 0:
        return None
    ckpt_root.mkdir(parents=True, exist_ok=True)
    for stale in ckpt_root.glob(".tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    final = ckpt_root / f"step_{step:07d}"
    tmp = ckpt_root / f".tmp-step_{step:07d}-{os.getpid()}"
    tmp.mkdir()
    write_draft(msd, draft_cfg, tmp)
    state = dict(trainer, step=step, optimizer=osd, scheduler=scheduler.state_dict(), rng=rng_state())
    with open(tmp / TRAINER_STATE, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    if identity is not None:
        atomic_write_json(tmp / IDENTITY, identity)
    atomic_write_json(tmp / CHECKSUMS, {f.name: sha256_file(f) for f in sorted(tmp.iterdir())})
    if final.exists():  # a re-run of the same step after resume
        shutil.rmtree(final)
    os.replace(tmp, final)
    fsync_dir(ckpt_root)
    if keep:
        for old in checkpoints(ckpt_root)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    return final


CHECKSUMS = "checksums.json"
"""Each checkpoint file's sha256, written last inside the checkpoint; `load` checks them first."""


def check_checkpoint(path: Path, names: tuple[str, ...] = ()) -> None:
    """DamagedArtifact naming the first file of checkpoint `path` (of `names`, if given) whose sha256
    is not the one its checksums.json records (checkpoints of an earlier eyas have none: not checked)."""
    sums = path / CHECKSUMS
    if not sums.is_file():
        return
    for name, want in json.loads(sums.read_text()).items():
        if names and name not in names:
            continue
        f = path / name
        if not f.is_file() or sha256_file(f) != want:
            raise DamagedArtifact(f"checkpoint {path}: {name} is {'missing' if not f.is_file() else 'damaged'} "
                                  f"(sha256 differs from {CHECKSUMS}); remove {path} to resume from the checkpoint "
                                  "before it", f, "train")


def checkpoints(ckpt_root: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    if not ckpt_root.is_dir():
        return []
    found = [p for p in ckpt_root.iterdir() if STEP_RE.match(p.name) and (p / TRAINER_STATE).is_file()]
    return sorted(found, key=lambda p: int(STEP_RE.match(p.name).group(1)))


def resolve_resume(resume: str, ckpt_root: Path) -> Path | None:
    """--train.resume: '' -> None, 'auto' -> the latest checkpoint or None, else that directory."""
    if not resume:
        return None
    if resume == "auto":
        found = checkpoints(ckpt_root)
        return found[-1] if found else None
    path = Path(resume)
    if not (path / TRAINER_STATE).is_file():
        raise ConfigError(f"train.resume={resume!r} is not a checkpoint directory (no {TRAINER_STATE}); use auto or a step_XXXXXXX dir")
    return path


def read_trainer_state(path: Path) -> dict[str, Any]:
    """Checkpoint `path`'s trainer.pt as plain data; a file holding anything else (a pickled callable
    would run on load) is an ArtifactError naming it, raised before any of it runs."""
    file = path / TRAINER_STATE
    try:
        with torch.serialization.safe_globals(SAFE_GLOBALS):
            return torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        # torch's reason ("Unsupported global: GLOBAL io.open was not an allowed global by default.
        # Please use `torch.serialization.add_safe_globals`..."): its first sentence
        why = (str(e).partition("WeightsUnpickler error:")[2].strip() or str(e)).splitlines()[0]
        why = why.split(" was not an allowed global")[0].split(". ")[0]
        raise ArtifactError(
            f"{file} is not plain training state ({why}): eyas loads "
            "checkpoints without running code from them and does not load this one. If eyas wrote it, it is "
            "damaged: remove the checkpoint to resume from the previous one; otherwise start a new run from its "
            f"weights (draft.safetensors) with --train.init_from={path}") from e


def load(path: Path, model: nn.Module, optimizer, scheduler) -> dict[str, Any]:
    """Restore model, optimizer, scheduler and RNG from `path` (every rank); -> trainer state."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    check_checkpoint(path)
    try:
        state = read_trainer_state(path)
        msd = load_file(str(path / "draft.safetensors"))
    except (OSError, RuntimeError, SafetensorError) as e:
        raise ArtifactError(f"checkpoint {path} is unreadable ({e}); remove it to resume from the previous one") from e
    missing = [k for k in TRAINER_FIELDS if k not in state]
    if missing:
        raise ArtifactError(f"checkpoint {path} lacks {missing} (an earlier eyas wrote it): it cannot be resumed; start "
                            "a new run from its weights with --train.init_from=" + str(path))
    set_model_state_dict(model, {f"draft.{k}": v for k, v in msd.items()}, options=_options(cpu=False))
    set_optimizer_state_dict(model, optimizer, state["optimizer"], options=_options(cpu=False))
    scheduler.load_state_dict(state["scheduler"])
    set_rng_state(state["rng"])
    return state
