"""Process-group setup: one process is world size 1, `torchrun` gives N ranks; nothing else changes.

    ddp, rank, local_rank, world_size, device = compute_init()   # reads RANK/WORLD_SIZE/LOCAL_RANK
    ...
    compute_cleanup()

NCCL on CUDA, gloo on CPU. Models never import this module: stages call it around them.
"""

from __future__ import annotations

import gc
import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


def is_ddp() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" in os.environ


def resolve_device(device: str, local_rank: int, cuda_available: bool) -> torch.device:
    """The device a rank computes on: `device` as given, except that a bare "cuda" means this rank's
    GPU (cuda:LOCAL_RANK; torch.cuda.set_device refuses a device without an index); with no
    `device`, cuda:LOCAL_RANK when CUDA is available, else cpu."""
    if device:
        dev = torch.device(device)
        return torch.device("cuda", local_rank) if dev.type == "cuda" and dev.index is None else dev
    return torch.device("cuda", local_rank) if cuda_available else torch.device("cpu")


def compute_init(device: str = "") -> tuple[bool, int, int, int, torch.device]:
    """-> (ddp, rank, local_rank, world_size, device); joins the process group under torchrun.

    `device` overrides the default (cuda:LOCAL_RANK when CUDA is available, else cpu).
    """
    ddp = is_ddp()
    rank = int(os.environ.get("RANK", "0")) if ddp else 0
    local_rank = int(os.environ.get("LOCAL_RANK", "0")) if ddp else 0
    world_size = int(os.environ.get("WORLD_SIZE", "1")) if ddp else 1
    dev = resolve_device(device, local_rank, torch.cuda.is_available())
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if ddp and not dist.is_initialized():
        backend = "nccl" if dev.type == "cuda" else "gloo"
        # long timeout: ranks wait at the final barrier for the slowest rank's extraction
        kwargs = {"device_id": dev} if dev.type == "cuda" else {}
        dist.init_process_group(backend=backend, timeout=timedelta(hours=6), **kwargs)
    return ddp, rank, local_rank, world_size, dev


_HELD = False  # `eyas run` under torchrun holds the group across its stages (hold_group)


def hold_group() -> None:
    """Keep the process group past the stages' compute_cleanup (for `eyas run`, which runs several
    stages in one process group); release_group() ends it."""
    global _HELD
    _HELD = True


def release_group() -> None:
    global _HELD
    _HELD = False
    compute_cleanup()


def barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def all_reduce_max(value: float, device: torch.device) -> float:
    """Max of a float over ranks (the value itself at world size 1)."""
    if not (dist.is_available() and dist.is_initialized()):
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())  # .item(): a sync point, called once per run


def host_group(timeout: timedelta):
    """A gloo process group over every rank beside the stages' own (NCCL on GPUs): messages on it
    hold no GPU collective, so a rank can wait on it while another one works alone."""
    return dist.new_group(backend="gloo", timeout=timeout)


def broadcast_object(obj: Any, group) -> Any:
    """Rank 0's `obj` (any picklable object) on every rank of `group`; the others pass None."""
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def gather_objects(obj: Any) -> list[Any]:
    """Every rank's `obj` (picklable), in rank order, on every rank ([obj] at world size 1). A collective."""
    if not (dist.is_available() and dist.is_initialized()):
        return [obj]
    box: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(box, obj)
    return box


def rank0_object(obj: Any) -> Any:
    """Rank 0's `obj` on every rank (the others pass None; `obj` itself at world size 1). A collective."""
    if not (dist.is_available() and dist.is_initialized()):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def all_reduce_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum of `x` over ranks, in place (`x` itself at world size 1)."""
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(x, op=dist.ReduceOp.SUM)
    return x


def rank0_flag(flag: bool, device: torch.device) -> bool:
    """Rank 0's `flag` on every rank (the value itself at world size 1), so that every rank takes the
    branch rank 0 decided on (its clock, its budget). A collective: every rank calls it."""
    if not (dist.is_available() and dist.is_initialized()):
        return flag
    t = torch.tensor([float(flag)], device=device)
    dist.broadcast(t, src=0)
    return bool(t.item())  # .item(): a sync point, at a logging step that already syncs


def compute_cleanup() -> None:
    if _HELD:
        return
    if dist.is_available() and dist.is_initialized():
        # DDP/FSDP modules hold the process group in reference cycles: freed only by the garbage
        # collector, possibly during interpreter shutdown, when the group's C++ threads can no
        # longer be torn down cleanly. Collect them while the interpreter is whole. (Without it a
        # torchrun test's rank 1 aborted at exit with "terminate called without an active exception",
        # now and then.)
        gc.collect()
        dist.destroy_process_group()
