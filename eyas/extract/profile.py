"""Where the extract loop's time goes, phase by phase (bench/extract.py --profile).

    timer = PhaseTimer(torch.device("cuda"))
    with timer.gpu("forward"):          # CUDA events on the current stream, read once at the end
        model(...)
    with timer.host("wait for buffer"): # host clock: time the main thread spends blocked
        ...
    timer.summary()                     # {phase: {"s": total seconds, "n": count, "max": longest}}

GPU phases are timed with CUDA events, so timing adds no host-device sync to the loop; the events
are read in `summary()`, once the GPU has passed them. On CPU every op is synchronous and GPU phases
fall back to the host clock. The stage itself runs with `NULL_TIMER`, whose contexts do nothing.
"""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager, nullcontext
from typing import Any, Iterator

import torch


class NullTimer:
    """Times nothing: what the extract stage runs with unless a caller (the bench) passes a PhaseTimer."""

    def gpu(self, name: str):
        return nullcontext()

    def host(self, name: str):
        return nullcontext()

    def add(self, name: str, seconds: float, count: int = 1) -> None:
        pass


NULL_TIMER = NullTimer()


class PhaseTimer(NullTimer):
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.events: dict[str, list[tuple[Any, Any]]] = defaultdict(list)
        self.seconds: dict[str, float] = defaultdict(float)
        self.counts: dict[str, int] = defaultdict(int)
        self.longest: dict[str, float] = defaultdict(float)

    @contextmanager
    def gpu(self, name: str) -> Iterator[None]:
        """Time the work enqueued inside on the current CUDA stream (its GPU time, idle gaps included)."""
        if not self.cuda:
            with self.host(name):
                yield
            return
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        try:
            yield
        finally:
            end.record()
            self.events[name].append((start, end))

    @contextmanager
    def host(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - t0)

    def add(self, name: str, seconds: float, count: int = 1) -> None:
        self.seconds[name] += seconds
        self.counts[name] += count
        self.longest[name] = max(self.longest[name], seconds / max(count, 1))

    def summary(self) -> dict[str, dict[str, float]]:
        """-> {phase: {"s": total seconds, "n": count, "max": longest one}}; GPU phases are prefixed
        `gpu ` (this waits for their events)."""
        out = {}
        for name, pairs in self.events.items():
            for _, end in pairs:
                end.synchronize()
            times = [a.elapsed_time(b) / 1e3 for a, b in pairs]
            out[f"gpu {name}"] = {"s": sum(times), "n": len(times), "max": max(times)}
        out.update({name: {"s": s, "n": self.counts[name], "max": self.longest[name]} for name, s in self.seconds.items()})
        return out
