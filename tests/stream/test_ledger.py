"""eyas/stream/ledger.py: every streamed sample trained exactly once per epoch, across duplicates,
failures and crash + resume.

The property test drives a Ledger with random event sequences beside `Model`, a naive account
written here (per sample: the attempts sent, the one now in flight, delivered or not; the list of
samples trained), and compares the two after every event; each epoch must end with every sample
trained exactly once."""

from __future__ import annotations

import json
import random

import pytest

from eyas.stream.ledger import (
    DELIVERED,
    IN_FLIGHT,
    QUEUED,
    TRAINED,
    Ledger,
    LedgerError,
)


class Model:
    """The naive reference: what a ledger should say, by plain bookkeeping."""

    def __init__(self, epoch: int, samples: list[int]):
        self.epoch, self.samples = epoch, list(samples)
        self.sent = {i: 0 for i in samples}  # attempts sent so far (kept across a resume)
        self.flying: dict[int, int | None] = {i: None for i in samples}  # attempt whose answer counts now
        self.delivered: set[int] = set()
        self.trained: list[int] = []  # in order, duplicates kept: the test counts them
        self.duplicates = 0

    def phase(self, i: int) -> str:
        if i in self.trained:
            return TRAINED
        if i in self.delivered:
            return DELIVERED
        return IN_FLIGHT if self.flying[i] is not None else QUEUED

    def send(self, i: int) -> str:
        self.sent[i] += 1
        self.flying[i] = self.sent[i]
        return f"s{i}_e{self.epoch}_a{self.sent[i]}"

    def current(self, sample: int, epoch: int, attempt: int) -> bool:
        return epoch == self.epoch and sample in self.flying and self.flying[sample] == attempt

    def arrived(self, sample: int, epoch: int, attempt: int) -> bool:
        if not self.current(sample, epoch, attempt):
            self.duplicates += 1
            return False
        self.flying[sample] = None
        self.delivered.add(sample)
        return True

    def failed(self, sample: int, epoch: int, attempt: int) -> bool:
        if not self.current(sample, epoch, attempt):
            return False
        self.flying[sample] = None
        return True

    def requeue(self, i: int) -> None:
        self.delivered.discard(i)

    def train(self, batch: list[int]) -> None:
        for i in batch:
            self.delivered.discard(i)
            self.trained.append(i)

    def crash(self) -> None:
        """A resume from a checkpoint: what was not trained is asked for again (answers to the
        attempts made before it, still on their way, count for nothing)."""
        self.delivered.clear()
        self.flying = {i: None for i in self.samples}


def agree(led: Ledger, model: Model) -> None:
    for i in model.samples:
        assert led.state(i) == model.phase(i), (i, led.entries[i])
        assert led.entries[i].attempt == model.sent[i]
    assert led.duplicates == model.duplicates


def run_epoch(rng: random.Random, epoch: int, samples: list[int], late: list[str]) -> tuple[list[str], dict]:
    """One epoch of random events; `late`: request ids of the last epoch still on their way.
    -> the request ids of this epoch (answered or not) for the next, and the events seen."""
    led, model = Ledger(epoch, samples), Model(epoch, samples)
    rids = list(late)  # every request ever sent: any of them may (again) be answered or fail
    seen: dict[str, int] = {}  # events that changed something, for the test to check each kind happened
    for _ in range(2000):
        if len(set(model.trained)) == len(samples):
            break
        queued = [i for i in samples if model.phase(i) == QUEUED]
        delivered = [i for i in samples if model.phase(i) == DELIVERED]
        flying = [f"s{i}_e{epoch}_a{a}" for i, a in model.flying.items() if a is not None]
        event = rng.choices(["send", "arrive", "any", "fail", "requeue", "train", "crash"], [6, 6, 2, 1, 1, 3, 0.2])[0]
        if event == "send" and queued:
            i = rng.choice(queued)
            rid = led.send(i, engine=f"engine-{rng.randrange(2)}")
            assert rid == model.send(i) and Ledger.parse(rid) == (i, epoch, model.sent[i])
            rids.append(rid)
        elif event in ("arrive", "any") and rids:  # the answer awaited, or any (a late or repeated one)
            rid = rng.choice(flying if event == "arrive" and flying else rids)
            current = led.arrived(rid)
            assert current == model.arrived(*Ledger.parse(rid)), rid
            seen["delivered" if current else "duplicate"] = seen.get("delivered" if current else "duplicate", 0) + 1
        elif event == "fail" and rids:
            rid = rng.choice(flying or rids)
            if led.failed(rid, "error marker") != model.failed(*Ledger.parse(rid)):
                raise AssertionError(rid)
            seen["failed"] = seen.get("failed", 0) + 1
        elif event == "requeue" and delivered:
            i = rng.choice(delivered)
            led.requeue_delivered(i, "token ids other than those sent")
            model.requeue(i)
        elif event == "train" and delivered:
            batch = rng.sample(delivered, rng.randint(1, min(3, len(delivered))))
            led.trained(batch)
            model.train(batch)
        elif event == "crash":
            saved = json.loads(json.dumps(led.state_dict()))  # as a checkpoint holds it
            led = Ledger.from_state_dict(saved)
            model.crash()
            seen["resume"] = seen.get("resume", 0) + 1
            untrained = sorted(set(samples) - set(model.trained))
            assert sorted(i for i in samples if led.state(i) == QUEUED) == untrained
        agree(led, model)
    led.close_epoch()
    assert sorted(model.trained) == sorted(samples), "a sample trained twice or never"
    assert led.summary()["trained"] == len(samples)
    return [r for r in rids if Ledger.parse(r)[1] == epoch], seen


@pytest.mark.parametrize("seed", range(12))
def test_random_events_train_every_sample_exactly_once_per_epoch(seed):
    rng = random.Random(seed)
    samples = rng.sample(range(200), 24)
    late: list[str] = []
    seen: dict[str, int] = {}
    for epoch in range(3):
        rng.shuffle(samples)
        late, now = run_epoch(rng, epoch, samples, late)
        seen = {k: seen.get(k, 0) + now.get(k, 0) for k in seen | now}
    assert {"delivered", "duplicate", "failed", "resume"} <= set(seen), seen  # each path was driven


# ---------------------------------------------------------------- by hand


def delivered_ledger(samples=(3, 5, 7)) -> Ledger:
    led = Ledger(0, list(samples))
    for i in samples:
        assert led.arrived(led.send(i, "engine-0"))
    return led


def test_a_stale_answer_is_a_duplicate_and_changes_nothing():
    led = Ledger(0, [3])
    first = led.send(3, "engine-0")
    assert led.failed(first, "fetch timeout")
    second = led.send(3, "engine-1")
    assert (first, second) == ("s3_e0_a1", "s3_e0_a2")
    assert led.arrived(first) is False  # the late answer to the attempt given up
    assert (led.state(3), led.duplicates) == (IN_FLIGHT, 1)
    assert led.failed(first, "late error") is False and led.state(3) == IN_FLIGHT
    assert led.arrived(second) is True and led.state(3) == DELIVERED
    assert led.arrived(second) is False and led.duplicates == 2  # the same answer twice
    assert led.entries[3].failures == ["attempt 1 on engine-0: fetch timeout"]


def test_an_answer_for_another_epoch_is_a_duplicate():
    led = Ledger(1, [3])
    led.send(3, "engine-0")
    assert led.arrived("s3_e0_a1") is False and led.state(3) == IN_FLIGHT


def test_trained_twice_raises():
    led = delivered_ledger()
    led.trained([3])
    with pytest.raises(LedgerError, match="sample 3 trained while trained"):
        led.trained([3])


def test_trained_while_in_flight_or_queued_raises():
    led = Ledger(0, [3, 5])
    led.send(3, "engine-0")
    with pytest.raises(LedgerError, match="sample 3 trained while in_flight"):
        led.trained([3])
    with pytest.raises(LedgerError, match="sample 5 trained while queued"):
        led.trained([5])
    with pytest.raises(LedgerError, match="sample 9 trained in epoch 0 but not dealt"):
        led.trained([9])


def test_a_refused_batch_marks_none_of_its_samples():
    led = delivered_ledger()
    with pytest.raises(LedgerError):
        led.trained([3, 5, 5])
    assert [led.state(i) for i in (3, 5, 7)] == [DELIVERED] * 3


def test_requeue_of_a_sample_not_delivered_raises():
    led = Ledger(0, [3])
    with pytest.raises(LedgerError, match="sample 3 re-queued while queued"):
        led.requeue_delivered(3, "shape")


def test_a_sample_dealt_twice_raises():
    with pytest.raises(LedgerError, match="dealt twice"):
        Ledger(0, [1, 2, 1])


def test_resume_keeps_trained_queues_the_rest_and_keeps_attempts():
    led = delivered_ledger((3, 5, 7, 9))
    led.trained([3])  # 5: delivered, not stepped on; 7: re-sent, in flight; 9: re-queued
    led.requeue_delivered(7, "shape")
    pre_crash = led.send(7, "engine-1")
    led.requeue_delivered(9, "token ids")
    back = Ledger.from_state_dict(json.loads(json.dumps(led.state_dict())))
    assert {i: back.state(i) for i in (3, 5, 7, 9)} == {3: TRAINED, 5: QUEUED, 7: QUEUED, 9: QUEUED}
    assert {i: back.entries[i].attempt for i in (3, 5, 7, 9)} == {3: 1, 5: 1, 7: 2, 9: 1}
    assert back.send(7, "engine-0") == "s7_e0_a3"
    assert back.arrived(pre_crash) is False  # asked before the crash: never trained
    assert back.state(7) == IN_FLIGHT and back.duplicates == 1
    assert back.entries[9].failures == ["attempt 1 on engine-0: token ids"]


def test_request_ids_round_trip_through_parse():
    assert Ledger.parse("s12_e0_a3") == (12, 0, 3)
    assert Ledger.parse("s7_e-1_a1") == (7, -1, 1)  # held-out samples
    held_out = Ledger(-1, [7, 0])
    assert Ledger.parse(held_out.send(7, "engine-0")) == (7, -1, 1)
    assert Ledger.parse(held_out.send(0, "engine-0")) == (0, -1, 1)


def test_close_epoch_names_the_untrained():
    led = delivered_ledger((3, 5, 7))
    led.trained([5])
    with pytest.raises(LedgerError, match=r"epoch 0 ended with 2 samples not trained: \[3, 7\]"):
        led.close_epoch()
    led.trained([3, 7])
    led.close_epoch()
