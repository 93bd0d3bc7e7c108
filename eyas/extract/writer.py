"""Device -> host copies overlapped with compute, and a background thread that writes the shards.

Per batch, the main thread enqueues the forward, then `HostCopier.copy` queues a copy into a
pinned host buffer on a side CUDA stream (so the next forward overlaps it) and hands the buffer to
the `Writer` thread, which waits for the copy's event, streams the bytes into the open shard and
gives the buffer back. With `depth` buffers in flight the GPU only waits when the disk cannot keep
up. On CPU the states are already in host memory and are handed over as they are.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from eyas.errors import EyasError, record_error
from eyas.extract import store
from eyas.extract.plan import Batch


class TooManyFailures(EyasError):
    """More samples failed than extract.max_failures allows."""


class NonFiniteStates(EyasError):
    """A sample's hidden states contain inf or NaN."""


class Failures:
    """Failed samples of this rank: each one recorded in errors.jsonl (and stderr) as it happens."""

    def __init__(self, limit: int, errors_path: Path, rank: int, sample_ids: list[str]):
        self.limit, self.path, self.rank, self.ids = limit, errors_path, rank, sample_ids
        self.samples: list[int] = []
        self.lock = threading.Lock()

    def record(self, exc: BaseException, indices: list[int], count: bool = True, **context: Any) -> None:
        """Record; count the samples as failed (raising TooManyFailures past the limit) unless count=False."""
        with self.lock:
            record_error(self.path, exc, stage="extract", rank=self.rank,
                         sample_ids=[self.ids[i] for i in indices], sample_indices=list(indices), **context)
            if count:
                self.samples.extend(indices)
            if count and len(self.samples) > self.limit:
                raise TooManyFailures(
                    f"{len(self.samples)} sample(s) failed on rank {self.rank}, more than extract.max_failures="
                    f"{self.limit} (details above and in {self.path}); fix the cause, or allow some with "
                    "--extract.max_failures=N, then re-run the same command to resume"
                ) from exc


@dataclass
class Pending:
    states_TKD: torch.Tensor
    finite_T: torch.Tensor
    event: Any = None
    buffer: torch.Tensor | None = None


class HostCopier:
    def __init__(self, max_tokens: int, num_layers: int, hidden: int, dtype: torch.dtype, depth: int,
                 check: Callable[[], None]):
        self.shape = (max_tokens, num_layers, hidden)
        self.dtype, self.depth, self.check = dtype, depth, check
        self.free: queue.Queue = queue.Queue()
        self.stream = None
        self.allocated = 0

    def _buffer(self) -> torch.Tensor:
        if self.allocated < self.depth:  # allocated lazily: CPU runs never pin
            self.allocated += 1
            return torch.empty(self.shape, dtype=self.dtype, pin_memory=True)
        while True:  # wait for the writer to give one back, but notice if it died
            try:
                return self.free.get(timeout=0.5)
            except queue.Empty:
                self.check()

    def copy(self, states_TKD: torch.Tensor, finite_T: torch.Tensor) -> Pending:
        if states_TKD.device.type != "cuda":
            return Pending(states_TKD.contiguous(), finite_T)
        dev = states_TKD.device
        if self.stream is None:
            self.stream = torch.cuda.Stream(dev)
        buf = self._buffer()
        n = states_TKD.shape[0]
        fin = torch.empty(n, dtype=torch.bool, pin_memory=True)
        self.stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(self.stream):
            buf[:n].copy_(states_TKD, non_blocking=True)
            fin.copy_(finite_T, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        # the caching allocator must not reuse these before the side stream has read them
        states_TKD.record_stream(self.stream)
        finite_T.record_stream(self.stream)
        return Pending(buf[:n], fin, event, buf)

    def release(self, p: Pending) -> None:
        if p.buffer is not None:
            self.free.put(p.buffer)


class Writer(threading.Thread):
    """Writes the planned shards of one rank in order; the main thread submits batches in the same order."""

    def __init__(self, out: Path, rank: int, first_number: int, shards: list[list[Batch]], prepared,
                 num_layers: int, hidden: int, dtype: torch.dtype, copier: HostCopier, failures: Failures):
        super().__init__(name=f"eyas-extract-writer-r{rank}", daemon=True)
        self.out, self.rank, self.first_number, self.shards = out, rank, first_number, shards
        self.prepared, self.num_layers, self.hidden, self.dtype = prepared, num_layers, hidden, dtype
        self.copier, self.failures = copier, failures
        self.q: queue.Queue = queue.Queue(maxsize=copier.depth + 1)
        self.error: BaseException | None = None
        self.bytes_written = 0
        self.shards_written = 0

    def check(self) -> None:
        if self.error is not None:
            raise self.error

    def submit(self, batch: Batch, pending: Pending, failed: list[int]) -> None:
        while True:
            self.check()
            try:
                self.q.put((batch, pending, failed), timeout=0.5)
                return
            except queue.Full:
                pass

    def finish(self) -> None:
        """Wait for every submitted batch to be on disk; re-raise the writer's error if any."""
        self.q.put(None)
        self.join()
        self.check()

    def abort(self) -> None:
        self.q.put(None)
        self.join(timeout=60)

    def run(self) -> None:
        current = None
        try:
            for number, batches in enumerate(self.shards, self.first_number):
                indices = [i for b in batches for i in b.indices]
                samples = [self.prepared[i] for i in indices]
                current = store.ShardWriter(
                    self.out, store.shard_name(self.rank, number), self.num_layers, self.hidden, self.dtype,
                    torch.cat([s["input_ids"] for s in samples]), torch.cat([s["loss_mask"] for s in samples]),
                )
                failed: list[int] = []
                for expected in batches:
                    item = self.q.get()
                    if item is None:
                        return  # aborted: the temp file is deleted below
                    batch, pending, batch_failed = item
                    assert batch is expected, "writer and main loop disagree on the batch order"
                    failed += batch_failed + self._write(current, batch, pending)
                info = current.close()
                self.bytes_written += info["bytes"] - current.num_tokens * current.row_bytes  # header, ids, mask
                current = None
                entry = {"shard": store.shard_name(self.rank, number), "rank": self.rank, **info,
                         "samples": indices, "lengths": [b for bt in batches for b in bt.lengths], "failed": failed}
                store.append_journal(self.out, self.rank, entry)
                self.shards_written += 1
            assert self.q.get() is None
        except BaseException as e:  # handed to the main thread, which re-raises it
            self.error = e
        finally:
            if current is not None:
                current.abort()

    def _write(self, shard: store.ShardWriter, batch: Batch, p: Pending) -> list[int]:
        if p.event is not None:
            p.event.synchronize()
        shard.write_states(p.states_TKD)
        self.bytes_written += p.states_TKD.numel() * p.states_TKD.element_size()
        bad, start = [], 0
        if not bool(p.finite_T.all()):
            for i, n in zip(batch.indices, batch.lengths):
                if not bool(p.finite_T[start : start + n].all()):
                    bad.append(i)
                start += n
        self.copier.release(p)
        if bad:
            self.failures.record(NonFiniteStates(f"hidden states contain inf/NaN for samples {bad}"), bad)
        return bad
