"""Replicating the draft over ranks: a function applied to a built module (the model never knows).

    model = parallelize(TTTDraft(draft), kind="ddp" | "fsdp", world_size, device)

World size 1 returns the module unchanged. DDP keeps full replicas (buffers are not re-broadcast
each step: the frozen V x D embedding is identical on every rank). FSDP2 (`fully_shard`) shards
parameters, gradients and AdamW state over the ranks, for drafts too large to replicate (a draft
for DeepSeek-V3's widths, D=7168 with a 32,000-token vocabulary, has 1.19B trainable parameters:
~19 GB of fp32 weights, gradients and Adam state); parameters are
gathered in bf16 for compute (MixedPrecisionPolicy), gradients reduced in fp32. The draft has one
decoder layer (or a few, train.num_layers), so the whole module is one FSDP unit.
"""

from __future__ import annotations

import contextlib
import inspect

import torch
from torch import nn


def parallelize(model: nn.Module, kind: str, world_size: int, device: torch.device, bf16: bool) -> nn.Module:
    if world_size == 1:
        return model
    if kind == "fsdp":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else MixedPrecisionPolicy()
        fully_shard(model, mp_policy=mp)
        return model
    from torch.nn.parallel import DistributedDataParallel as DDP

    ids = [device.index] if device.type == "cuda" else None
    params = inspect.signature(DDP.__init__).parameters
    no_buffer_sync = {"forward_sync_buffers": False} if "forward_sync_buffers" in params else {"broadcast_buffers": False}
    return DDP(model, device_ids=ids, **no_buffer_sync)


def unwrap(model: nn.Module) -> nn.Module:
    return model.module if hasattr(model, "module") and not hasattr(model, "draft") else model


@contextlib.contextmanager
def no_sync(model: nn.Module, sync: bool):
    """Skip the gradient all-reduce for all but the last micro-batch of an accumulation window."""
    if sync:
        yield
    elif hasattr(model, "no_sync"):  # DDP
        with model.no_sync():
            yield
    elif hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    else:
        yield


def clip_grad_norm(model: nn.Module, max_norm: float) -> torch.Tensor:
    """Global grad norm (clipped to max_norm when > 0) as a plain tensor, also under FSDP2."""
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf"))
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm
