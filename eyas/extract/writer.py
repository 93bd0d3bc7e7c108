"""Device -> host copies overlapped with compute, and background threads that write the shards.

Per batch, the main thread enqueues the forward, then `HostCopier.copy` queues a copy into a
pinned host buffer on a side CUDA stream (so the next forward overlaps it) and hands the buffer to
the `Writer`. Shard s is written by worker thread s % WRITER_THREADS: it waits for the copy's
event, streams the bytes into the shard (hashed alongside, store.py), gives the buffer back, asks
the kernel to start writing them to disk, and at the end of the shard fsyncs, renames and journals
it. So two shards are hashed and written at once and one shard's fsync overlaps the next one's
writes: the disk path runs at about min(disk, 2 x one core's sha256), not at one thread's
sum of hash, write and fsync. Shards may complete out of order; each is atomic and journalled on
its own (store.py), which is all resume needs.

The pinned pool (`depth` buffers of the largest batch) is allocated once, on a helper thread while
the smoke test and the first batch run. The GPU waits only when every buffer is still queued for
the disk. On CPU the states are already in host memory and are handed over as they are (nothing
is pinned).
"""

from __future__ import annotations

import queue
import threading
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from eyas.errors import EyasError, record_error
from eyas.extract import store
from eyas.extract.plan import Batch
from eyas.extract.profile import NULL_TIMER, NullTimer

WRITER_THREADS = 2
"""Shards written at once: two hash streams (~1.5-2 GB/s each) and fsyncs that overlap the writes."""


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
    scales_T2: torch.Tensor | None = None
    """float8 states' scales (aux, final per token); None for other dtypes."""
    event: Any = None
    buffer: tuple[torch.Tensor, ...] | None = None
    """The pooled (states, finite[, scales]) pinned buffers to give back once written."""


class HostCopier:
    """A pool of pinned host buffers, allocated once, and a side stream for the device->host copies.
    float8 states travel with their scales (a third, small buffer)."""

    def __init__(self, max_tokens: int, num_layers: int, hidden: int, dtype: torch.dtype, depth: int,
                 check: Callable[[], None]):
        self.shape = (max_tokens, num_layers, hidden)
        self.dtype, self.depth, self.check = dtype, depth, check
        self.scaled = store.scale_bytes(dtype) > 0
        self.free: queue.Queue = queue.Queue()
        self.stream = None
        self.error: BaseException | None = None
        self._pool: threading.Thread | None = None

    def start(self) -> None:
        """Allocate the pool on a helper thread (pinning takes ~0.1-0.2 s per GB) while the main
        thread runs the smoke test and the first batch. Called for GPU runs only: CPU runs never pin."""
        if self._pool is None:
            self._pool = threading.Thread(target=self._allocate, name="eyas-extract-pin", daemon=True)
            self._pool.start()

    def _allocate(self) -> None:
        try:
            for _ in range(self.depth):
                scales = (torch.empty(self.shape[0], 2, dtype=torch.float32, pin_memory=True),) if self.scaled else ()
                self.free.put((torch.empty(self.shape, dtype=self.dtype, pin_memory=True),
                               torch.empty(self.shape[0], dtype=torch.bool, pin_memory=True), *scales))
        except BaseException as e:  # raised on the main thread by _buffer()
            self.error = e

    def _buffer(self) -> tuple[torch.Tensor, ...]:
        self.start()
        while True:  # wait for the pool or for a writer to give one back, but notice if either died
            try:
                return self.free.get(timeout=0.5)
            except queue.Empty:
                if self.error is not None:
                    raise self.error
                self.check()

    def copy(self, states_TKD: torch.Tensor, finite_T: torch.Tensor, scales_T2: torch.Tensor | None = None,
             timer: NullTimer = NULL_TIMER) -> Pending:
        assert (scales_T2 is not None) == self.scaled, "float8 states come with their scales, others without"
        if states_TKD.device.type != "cuda":
            return Pending(states_TKD.contiguous(), finite_T, scales_T2)
        dev = states_TKD.device
        if self.stream is None:
            self.stream = torch.cuda.Stream(dev)
        with timer.host("wait for a pinned buffer"):
            buffer = self._buffer()
        buf, fin = buffer[:2]
        n = states_TKD.shape[0]
        self.stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(self.stream), timer.gpu("device->host copy (side stream)"):
            buf[:n].copy_(states_TKD, non_blocking=True)
            fin[:n].copy_(finite_T, non_blocking=True)
            if scales_T2 is not None:
                buffer[2][:n].copy_(scales_T2, non_blocking=True)
            event = torch.cuda.Event(blocking=True)  # a writer waiting on it sleeps instead of spinning a core
            event.record(self.stream)
        # the caching allocator must not reuse these before the side stream has read them
        for t in (states_TKD, finite_T) if scales_T2 is None else (states_TKD, finite_T, scales_T2):
            t.record_stream(self.stream)
        return Pending(buf[:n], fin[:n], None if scales_T2 is None else buffer[2][:n], event, buffer)

    def release(self, p: Pending) -> None:
        if p.buffer is not None:
            self.free.put(p.buffer)


class Writer:
    """Writes the planned shards of one rank, shard s on worker s % threads; the main thread submits
    the batches in plan order."""

    def __init__(self, out: Path, rank: int, numbers: list[int], shards: list[list[Batch]], prepared,
                 num_layers: int, hidden: int, dtype: torch.dtype, copier: HostCopier, failures: Failures,
                 threads: int = WRITER_THREADS, placer: store.ShardPlacer | None = None):
        assert len(numbers) >= len(shards), (numbers, len(shards))
        self.out, self.rank, self.numbers, self.shards = out, rank, numbers, shards  # shard s is r{rank}-{numbers[s]}
        self.placer = placer or store.ShardPlacer(out, [], 0, check=False)
        self.row_bytes = num_layers * hidden * torch.empty((), dtype=dtype).element_size()
        self.prepared, self.num_layers, self.hidden, self.dtype = prepared, num_layers, hidden, dtype
        self.copier, self.failures = copier, failures
        n = max(1, min(threads, len(shards)))
        self.worker_of = [s % n for s, batches in enumerate(shards) for _ in batches]  # per batch, in plan order
        self.queues: list[queue.Queue] = [queue.Queue() for _ in range(n)]
        self.slots = threading.Semaphore(copier.depth + 1)  # batches submitted and not yet written
        self.threads = [threading.Thread(target=self._run, args=(w,), name=f"eyas-extract-writer-r{rank}-{w}",
                                         daemon=True) for w in range(n)]
        self.lock = threading.Lock()  # journal appends, the first error
        self.error: BaseException | None = None
        self.submitted = 0
        self._bytes = [0] * n  # each written by its own worker only
        self._seconds = [defaultdict(float) for _ in range(n)]

    @property
    def bytes_written(self) -> int:
        return sum(self._bytes)

    def stats(self) -> dict[str, float]:
        """Seconds the workers spent per activity, summed over workers."""
        out: dict[str, float] = defaultdict(float)
        for seconds in self._seconds:
            for k, v in seconds.items():
                out[k] += v
        return dict(out)

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def check(self) -> None:
        if self.error is not None:
            raise self.error

    def submit(self, batch: Batch, pending: Pending, failed: list[int]) -> None:
        while not self.slots.acquire(timeout=0.5):  # back-pressure (CPU runs; GPU runs wait on buffers first)
            self.check()
        self.check()
        self.queues[self.worker_of[self.submitted]].put((batch, pending, failed))
        self.submitted += 1

    def finish(self) -> None:
        """Wait for every submitted batch to be on disk; re-raise a worker's error if any."""
        for q in self.queues:
            q.put(None)
        for t in self.threads:
            t.join()
        self.check()

    def abort(self) -> None:
        """Stop: shards being written are deleted (their samples are extracted again on resume)."""
        for q in self.queues:
            q.put(None)
        for t in self.threads:
            if t.ident is not None:
                t.join(timeout=60)

    def _run(self, w: int) -> None:
        current, seconds = None, self._seconds[w]
        try:
            for s in range(w, len(self.shards), len(self.threads)):
                batches = self.shards[s]
                indices = [i for b in batches for i in b.indices]
                samples = [self.prepared[i] for i in indices]
                ids = torch.cat([x["input_ids"] for x in samples])
                current = self.placer.open_shard(
                    self.rank, self.numbers[s], ids.numel(), self.row_bytes + store.scale_bytes(self.dtype),
                    lambda name: store.ShardWriter(self.out, name, self.num_layers, self.hidden, self.dtype,
                                                   ids, torch.cat([x["loss_mask"] for x in samples])))
                name = current.name
                failed: list[int] = []
                for expected in batches:
                    t0 = time.perf_counter()
                    item = self.queues[w].get()
                    seconds["idle (no batch queued)"] += time.perf_counter() - t0
                    if item is None:
                        return  # aborted: the temp file is deleted below
                    batch, pending, batch_failed = item
                    assert batch is expected, "writer and main loop disagree on the batch order"
                    failed += batch_failed + self._write(w, current, batch, pending)
                    self.slots.release()
                t0 = time.perf_counter()
                info = current.close()
                self.placer.closed(current)
                self._bytes[w] += info["bytes"] - current.num_tokens * current.row_bytes  # header, scales, ids, mask
                current = None
                entry = {"shard": name, "rank": self.rank, **info, "samples": indices,
                         "lengths": [n for b in batches for n in b.lengths], "failed": failed}
                with self.lock:
                    store.append_journal(self.out, self.rank, entry)
                seconds["close (tail, fsync, rename, journal)"] += time.perf_counter() - t0
            assert self.queues[w].get() is None, "the main loop submitted more batches than planned"
        except BaseException as e:  # handed to the main thread, which re-raises it
            with self.lock:
                if self.error is None:
                    self.error = e
        finally:
            if current is not None:
                current.abort()
                self.placer.closed(current)

    def _write(self, w: int, shard: store.ShardWriter, batch: Batch, p: Pending) -> list[int]:
        seconds = self._seconds[w]
        t0 = time.perf_counter()
        if p.event is not None:
            p.event.synchronize()
        t1 = time.perf_counter()
        shard.write_states(p.states_TKD, p.scales_T2)
        self._bytes[w] += p.states_TKD.numel() * p.states_TKD.element_size()
        bad, start = [], 0
        if not bool(p.finite_T.all()):
            for i, n in zip(batch.indices, batch.lengths):
                if not bool(p.finite_T[start : start + n].all()):
                    bad.append(i)
                start += n
        self.copier.release(p)
        t2 = time.perf_counter()
        shard.start_writeback()  # after the release: the buffer is free while the kernel queues the disk writes
        t3 = time.perf_counter()
        seconds["wait for the copy"] += t1 - t0
        seconds["hash + write"] += t2 - t1
        seconds["start writeback"] += t3 - t2
        if bad:
            self.failures.record(NonFiniteStates(f"hidden states contain inf/NaN for samples {bad}"), bad)
        return bad
