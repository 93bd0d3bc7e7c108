"""eyas/stream/source.py: StreamStates' controller with real Ray and a real Mooncake store.

The controller needs Ray, which only the vLLM venv has: `streamed` runs tests/stream/source_cases.py
there once (one Ray cluster, one mooncake_master, one engine actor for every case) on a real prepare
output, and the tests below read what it saw: the samples each step trained, every call the engine
got (request ids, process id, time), the ledgers' summaries and the errors raised.
"""

from __future__ import annotations

import json
import subprocess
from collections import Counter
from pathlib import Path

import pytest

from tests.data import run_prepare, write_synthetic_chats
from tests.vllm_serving import vllm_env, vllm_python

pytestmark = [pytest.mark.vllm, pytest.mark.slow,
              pytest.mark.skipif(vllm_python() is None, reason="no vLLM venv (Ray, Mooncake): run scripts/vllm-venv.sh "
                                 "(or set EYAS_VLLM_VENV)")]

SAMPLES = 10


@pytest.fixture(scope="module")
def streamed(tmp_path_factory, smollm2_dir) -> dict:
    work = tmp_path_factory.mktemp("stream")
    chats = write_synthetic_chats(work / "chats.jsonl", SAMPLES, max_words=40)
    prep = run_prepare(work / "run", chats, model=smollm2_dir)
    result, log = work / "result.json", work / "cases.log"
    with open(log, "w") as f:
        proc = subprocess.run([str(vllm_python()), "-m", "tests.stream.source_cases", str(prep), str(work), str(result)],
                              check=False, stdout=f, stderr=subprocess.STDOUT, env=vllm_env(OMP_NUM_THREADS="1"),
                              timeout=300, cwd=str(Path(__file__).resolve().parents[2]))
    tail = log.read_text()[-4000:]
    assert proc.returncode == 0 and result.is_file(), f"source_cases exited {proc.returncode}:\n{tail}"
    out = json.loads(result.read_text())
    for name, case in out.items():
        if isinstance(case, dict):
            assert "traceback" not in case, f"case {name}:\n{case['traceback']}"
    return out


def flat(plans) -> list[int]:
    return [i for p in plans for i in p]


def parse(rid: str) -> tuple[int, int, int]:
    s, e, a = rid.split("_")
    return int(s[1:]), int(e[1:]), int(a[1:])


def calls(streamed, epoch: int) -> list[dict]:
    """The engine's calls of `epoch`: {t, pid, rids: [(sample, attempt)]}, in the order it got them."""
    out = []
    for c in streamed["asked"]:
        rids = [parse(r) for r in c["rids"] if parse(r)[1] == epoch]
        if rids:
            out.append({"t": c["t"], "pid": c["pid"], "rids": [(s, a) for s, _, a in rids]})
    return out


def asked(streamed, epoch: int) -> list[tuple[int, int]]:
    return [r for c in calls(streamed, epoch) for r in c["rids"]]


def test_two_epochs_come_back_in_training_order_each_trained_once(streamed):
    case = streamed["orders"]
    for epoch in (0, 1):
        order = flat(case["plans"][epoch])
        assert sorted(order) == list(range(SAMPLES))  # the epoch deals every sample once
        assert case["trained"][epoch] == order
        assert asked(streamed, epoch) == [(i, 1) for i in order]  # asked for in training order, once
        assert case["summary"][epoch] == {"epoch": epoch, "samples": SAMPLES, "trained": SAMPLES,
                                          "attempts": SAMPLES, "retried": 0, "duplicates_dropped": 0}


@pytest.mark.parametrize("name,epoch,why", [
    ("error", 2, "vLLM refused the prompt: scripted"),  # the engine answers {rid, error}
    ("marker", 3, "Mooncake producer error for key=s{}_e3_a1:error: put_from failed: no space"),  # a failed put's marker
    ("lost", 8, "object s{}_e8_a1 did not reach the store within 0.5 s"),  # a manifest, no object
    ("other_ids", 9, "object s{}_e9_a1: token ids other than those sent"),  # another prompt's states
])
def test_a_failed_request_is_asked_again_and_trained_once(streamed, name, epoch, why):
    case = streamed[name]
    assert len(case["errors"]) == 1 and why.format(case["sample"]) in case["errors"][str(case["sample"])][0]
    hit = case["sample"]
    assert "error" not in case, case.get("error")
    assert case["trained"] == flat(case["plans"])
    assert Counter(case["trained"])[hit] == 1
    got = asked(streamed, epoch)
    assert [a for s, a in got if s == hit] == [1, 2]
    assert sorted(s for s, _ in got if s != hit) == sorted(i for i in range(SAMPLES) if i != hit)  # the rest once
    assert case["summary"][0]["attempts"] == SAMPLES + 1 and case["summary"][0]["retried"] == 1


def test_a_sample_past_its_attempts_stops_the_run_naming_it(streamed):
    case = streamed["attempts"]
    assert f"sample {case['sample_id']!r}" in case["error"] and "train.stream.max_attempts=2" in case["error"]
    assert "trained" not in case  # the step needing it never ran
    assert [a for s, a in asked(streamed, 4) if s == case["sample"]] == [1, 2]  # not a third time
    assert case["summary"][0]["trained"] < SAMPLES
    assert case["seconds"] < 5  # raised when the last attempt failed, not at a timeout


def test_an_engine_dying_mid_call_is_restarted_and_its_samples_trained_once(streamed):
    case = streamed["dead_engine"]
    hit = case["sample"]
    assert "error" not in case, case.get("error")  # a restarting engine is not counted as failing again
    cs = calls(streamed, 7)
    dead = next(c for c in cs if (hit, 1) in c["rids"])
    held = {s for s, a in dead["rids"]}
    after = [c for c in cs if c["pid"] != dead["pid"]]
    assert after, "no call reached a restarted engine"
    assert {s for c in after for s, a in c["rids"] if a == 2} >= held  # every sample of the dead call again
    assert case["trained"] == flat(case["plans"]) and sorted(case["trained"]) == list(range(SAMPLES))
    assert case["summary"][0]["trained"] == SAMPLES


def test_the_window_bounds_the_bytes_asked_for_and_not_trained(streamed):
    case = streamed["window"]
    plans, window = case["plans"], case["window"]
    nbytes = {int(k): v for k, v in case["bytes"].items()}
    cs = calls(streamed, 5)
    assert window == sum(nbytes[i] for i in plans[0] + plans[1])
    assert sorted(s for s, _ in cs[0]["rids"]) == sorted(plans[0] + plans[1])  # ahead of need, no further
    steps = case["steps"]
    for c in cs:  # asked (seen by the engine) minus stepped on (noted before `trained`): a lower bound
        out = sum(nbytes[s] for d in cs if d["t"] <= c["t"] for s, _ in d["rids"])
        done = sum(nbytes[i] for t, samples in steps if t <= c["t"] for i in samples)
        assert out - done <= window, c
    assert case["peak_in_window"] <= window
    assert case["trained"] == flat(plans)


def test_resume_from_a_checkpoints_ledger_trains_exactly_the_rest(streamed):
    case = streamed["resume"]
    plans, k = case["plans"], case["k"]
    assert case["before"] == flat(plans[:k]) and case["after"] == flat(plans[k:])
    saved = {int(i): v for i, v in case["saved"]["ledgers"][0]["entries"].items()}
    assert {i for i, v in saved.items() if v["state"] == "trained"} == set(flat(plans[:k]))
    resumed = [(s, a) for c in calls(streamed, 6) if c["t"] >= case["t_resume"] for s, a in c["rids"]]
    assert sorted(s for s, _ in resumed) == sorted(flat(plans[k:]))  # the rest, once each
    assert all(a == saved[s]["attempt"] + 1 for s, a in resumed)  # a pre-crash answer would be stale
    assert case["summary"][0]["trained"] == SAMPLES


def test_resume_refuses_a_ledger_of_another_data_order(streamed):
    """A later sample trained (it would be trained twice) or an earlier one not (it would never be)."""
    case = streamed["resume"]
    assert f"sample {case['later_id']!r} was trained already" in case["refused"]
    assert f"sample {case['earlier_id']!r} of an earlier micro-batch is queued" in case["skipped"]
    for said in (case["refused"], case["skipped"]):
        assert "resume with that run's settings, or start a fresh --train.out_dir" in said


def test_held_out_batches_come_first_are_read_once_and_never_trained(streamed):
    case = streamed["held_out"]
    held = [i for p in case["held"] for i in p]
    assert case["trained"] == flat(case["plans"]) and not set(held) & set(case["trained"])
    before = streamed["held_out_fault"]["t_start"]  # the calls of this case, not of the one after it
    cs = [c for c in calls(streamed, -1) if c["t"] < before]
    assert sorted(s for c in cs for s, _ in c["rids"]) == sorted(held) and all(c["t"] >= case["t_eval"] for c in cs)
    # the training samples still queued (plans[3:]: the window holds two micro-batches) come after them
    queued = set(flat(case["plans"][3:]))
    order = [parse(r) for c in streamed["asked"] if c["t"] < before for r in c["rids"]]
    last_held = max(k for k, (s, e, a) in enumerate(order) if e == -1)
    first_queued = min(k for k, (s, e, a) in enumerate(order) if e == 10 and s in queued)
    assert queued and last_held < first_queued
    assert case["summary"] == [{"epoch": 10, "samples": SAMPLES - 3, "trained": SAMPLES - 3, "attempts": SAMPLES - 3,
                                "retried": 0, "duplicates_dropped": 0}]  # no ledger of held-out samples is saved


@pytest.mark.parametrize("name", ["orders", "error", "marker", "lost", "other_ids", "dead_engine", "window", "resume",
                                  "held_out"])
def test_nothing_stays_in_the_window_once_everything_is_trained(streamed, name):
    assert streamed[name]["in_window_end"] == 0


def test_a_held_out_sample_asked_again_while_the_window_is_full_is_not_held_back(streamed):
    """The window full of training samples only a later step frees; a held-out sample that failed
    once must be asked again at once (the batch the trainer waits for passes the window), or the
    evaluation would wait for train.stream.wait_timeout_s and stop the run."""
    case = streamed["held_out_fault"]
    assert "error" not in case, case.get("error")
    first = case["held"][0][0]
    assert len(case["errors"][str(first)]) == 1 and "scripted" in case["errors"][str(first)][0]
    assert case["trained"] == flat(case["plans"]) and case["summary"][0]["trained"] == len(flat(case["plans"]))
    assert case["seconds"] < 15


def test_resume_from_an_offline_checkpoint_and_finish_checks_every_sample_trained(streamed):
    case = streamed["resume_offline"]
    assert "traceback" not in case, case.get("traceback")
    assert case["trained"] == flat(case["plans"][case["k"]:])  # the rest, once; the checkpoint's steps not again
    assert case["summary"][0]["trained"] == SAMPLES
    last = case["plans"][-1]
    assert case["short"].startswith("LedgerError: epoch 12 ended with") and str(last[0]) in case["short"]
