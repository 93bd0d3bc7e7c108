"""Exactly once: every streamed sample's state, per epoch, saved with each checkpoint.

A pure state machine, one per trainer rank (its share of the epoch's samples):

    queued --send--> in_flight(request id s<sample>_e<epoch>_a<attempt>) --arrived--> delivered --trained--> trained
       ^                 |  failed (error marker, fetch timeout, failed put, dead engine, refused prompt)
       +-----------------+

* Only the current attempt of an in-flight sample can arrive or fail; an answer to an older attempt
  (a request re-sent after a timeout whose first answer came late) is a duplicate: `arrived` says
  so and the caller discards its object. A duplicate is never trained.
* `trained` is called after the optimizer step that used the sample; a sample trained twice, or
  trained without having been delivered, raises LedgerError (a bug, never silently absorbed).
* `state_dict` is saved with each checkpoint; `load_state_dict` keeps the trained samples and sends
  every other one (queued, in flight, delivered but not stepped on) back to queued: after a crash the
  resumed run trains each of them once, none twice.
* `close_epoch` checks that every sample the epoch dealt to this rank was trained exactly once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

QUEUED, IN_FLIGHT, DELIVERED, TRAINED = "queued", "in_flight", "delivered", "trained"


class LedgerError(AssertionError):
    """A sample would be trained twice, or trained without its states: eyas's bug, never the user's."""


@dataclass
class Entry:
    state: str = QUEUED
    attempt: int = 0  # the attempt now in flight (or the last one); 0 = never sent
    engine: str = ""
    failures: list[str] = field(default_factory=list)


class Ledger:
    def __init__(self, epoch: int, samples: list[int]):
        if len(set(samples)) != len(samples):
            raise LedgerError(f"epoch {epoch}: a sample is dealt twice to this rank")
        self.epoch = epoch
        self.entries: dict[int, Entry] = {i: Entry() for i in samples}
        self.duplicates = 0

    # ------------------------------------------------------------ requests

    def request_id(self, sample: int) -> str:
        e = self.entries[sample]
        return f"s{sample}_e{self.epoch}_a{e.attempt}"

    @staticmethod
    def parse(rid: str) -> tuple[int, int, int]:
        """'s12_e0_a3' (epoch -1: held-out samples) -> (sample, epoch, attempt)."""
        s, e, a = rid.split("_")[:3]
        return int(s[1:]), int(e[1:]), int(a[1:])

    def send(self, sample: int, engine: str) -> str:
        """A queued sample goes in flight: -> its new request id."""
        e = self.entries[sample]
        if e.state != QUEUED:
            raise LedgerError(f"sample {sample} sent while {e.state}")
        e.state, e.attempt, e.engine = IN_FLIGHT, e.attempt + 1, engine
        return self.request_id(sample)

    def _current(self, rid: str) -> Entry | None:
        sample, epoch, attempt = self.parse(rid)
        e = self.entries.get(sample)
        if e is None or epoch != self.epoch or attempt != e.attempt or e.state != IN_FLIGHT:
            return None
        return e

    def arrived(self, rid: str) -> bool:
        """The states of request `rid` are here: True when they are the sample's current attempt
        (now delivered); False for a duplicate or stale answer (the caller discards its object)."""
        e = self._current(rid)
        if e is None:
            self.duplicates += 1
            return False
        e.state = DELIVERED
        return True

    def failed(self, rid: str, reason: str) -> bool:
        """Request `rid` failed: its sample goes back to queued (True), unless it is not the current
        attempt (False: nothing changes)."""
        e = self._current(rid)
        if e is None:
            return False
        e.state = QUEUED
        e.failures.append(f"attempt {e.attempt} on {e.engine}: {reason}")
        return True

    def requeue_delivered(self, sample: int, reason: str) -> None:
        """A delivered sample whose states failed a check (token ids, shape) is asked for again."""
        e = self.entries[sample]
        if e.state != DELIVERED:
            raise LedgerError(f"sample {sample} re-queued while {e.state}")
        e.state = QUEUED
        e.failures.append(f"attempt {e.attempt} on {e.engine}: {reason}")

    def trained(self, samples: list[int]) -> None:
        """Every sample of `samples` is checked before any is marked: a refused step marks none (a
        ledger saved after it still queues them all)."""
        seen: set[int] = set()
        for i in samples:
            e = self.entries.get(i)
            if e is None:
                raise LedgerError(f"sample {i} trained in epoch {self.epoch} but not dealt to this rank")
            if e.state != DELIVERED or i in seen:
                state = TRAINED if i in seen else e.state
                raise LedgerError(f"sample {i} trained while {state} (epoch {self.epoch}, attempt {e.attempt})")
            seen.add(i)
        for i in samples:
            self.entries[i].state = TRAINED

    # ------------------------------------------------------------ questions

    def state(self, sample: int) -> str:
        return self.entries[sample].state

    def count(self, state: str) -> int:
        return sum(e.state == state for e in self.entries.values())

    def attempts(self) -> int:
        return sum(e.attempt for e in self.entries.values())

    def close_epoch(self) -> None:
        left = [i for i, e in self.entries.items() if e.state != TRAINED]
        if left:
            raise LedgerError(f"epoch {self.epoch} ended with {len(left)} samples not trained: {left[:8]}")

    # ------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "duplicates": self.duplicates,
                "entries": {str(i): {"state": e.state, "attempt": e.attempt, "failures": e.failures[-3:]}
                            for i, e in self.entries.items()}}

    @classmethod
    def from_state_dict(cls, d: dict[str, Any]) -> "Ledger":
        """A saved ledger: trained samples stay trained, every other one is queued again (its attempt
        count kept, so a late answer to an attempt made before the crash is a duplicate)."""
        led = cls(int(d["epoch"]), [int(i) for i in d["entries"]])
        led.duplicates = int(d.get("duplicates", 0))
        for i, v in d["entries"].items():
            e = led.entries[int(i)]
            e.attempt, e.failures = int(v["attempt"]), list(v.get("failures", []))
            e.state = TRAINED if v["state"] == TRAINED else QUEUED
        return led

    def summary(self) -> dict[str, int]:
        return {"epoch": self.epoch, "samples": len(self.entries), "trained": self.count(TRAINED),
                "attempts": self.attempts(), "retried": sum(e.attempt > 1 for e in self.entries.values()),
                "duplicates_dropped": self.duplicates}
