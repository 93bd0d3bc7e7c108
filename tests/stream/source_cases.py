"""StreamStates' controller (eyas/stream/source.py) against real Ray and a real Mooncake store; run in
the vLLM venv (it has Ray, Mooncake and hs-connectors) by tests/stream/test_source.py:

    python -m tests.stream.source_cases PREPARE_DIR WORK_DIR RESULT_JSON

`StoreEngine` stands in for the vLLM engine at the Ray boundary (eyas.stream.engines.Engine's
interface: `extract(requests)`, `ready()`): it puts each request's states into the store with
hs-connectors' `put_sample` under the manifest hs-connectors' connector builds and returns that
manifest, as vLLM's connector does. Its states are a known function of the token ids, position and
layer (`states_of`), so a batch shows whose states it got. A per-request script makes it refuse a
request, publish an error marker instead of the object, put nothing, put another prompt's states, or
die mid-call (Ray restarts it). Every
call is logged to a file (it survives a restart) for the test to read what was asked and when.

Each case uses its own epoch numbers, so request ids never repeat across cases: one engine actor,
one store, one Ray init for all. Each case's observations (or its traceback) go to RESULT_JSON.
"""

from __future__ import annotations

import os

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # a local cluster on 127.0.0.1

import json
import sys
import threading
import time
import traceback
from pathlib import Path

import ray
import torch

from eyas.config.stream import StreamConfig
from eyas.prepared import Prepared
from eyas.stream.source import StreamError, StreamStates
from eyas.stream.transport import Master, Transport, load_ibverbs, store_config
from eyas.train.data import epoch_batches, pack

LAYERS = [1, 3]  # K = 2 aux layers, + the last layer = 3 states per token
STATES, HIDDEN = len(LAYERS) + 1, 8
BYTES_PER_TOKEN = STATES * HIDDEN * 4 + 8  # float32 states + the int64 token id
MAX_TOKENS = 256
EPS = 1e-6


def states_of(ids: torch.Tensor) -> torch.Tensor:
    """[S, K+1, D] float32: token id, position, layer and channel each visible in the value."""
    s = ids.numel()
    tok = ids.to(torch.float64)[:, None, None] * 1e-4
    pos = torch.arange(s, dtype=torch.float64)[:, None, None] * 1e-2
    layer = torch.arange(STATES, dtype=torch.float64)[None, :, None]
    chan = torch.arange(HIDDEN, dtype=torch.float64)[None, None, :] * 0.1
    return (tok + pos + layer + chan + 0.5).float()


class StoreEngine:
    """The engine actor's interface, putting real tensors into Mooncake's store (see the module docstring)."""

    def __init__(self, master: str, log: str, script: dict[str, str]):
        load_ibverbs()
        from hs_connectors.mooncake_store import (
            MooncakeHiddenStatesStore,
            MooncakeStoreConfig,
        )

        cfg = store_config(master, 0, buffer_bytes=16 << 20)  # the store's memory: see `main`
        self.store = MooncakeHiddenStatesStore(MooncakeStoreConfig.from_dict(cfg)).setup()
        self.log, self.script = log, script
        self.lock = threading.Lock()  # one extract at a time, as the vLLM engine

    def ready(self) -> dict:
        return {"pid": os.getpid(), "load_s": 0.0}

    def extract(self, requests: list[tuple[str, list[int]]]) -> list[dict]:
        with self.lock:
            with open(self.log, "a") as f:
                f.write(json.dumps({"t": time.time(), "pid": os.getpid(), "rids": [r for r, _ in requests],
                                    "tokens": [len(ids) for _, ids in requests]}) + "\n")
            return [self._one(rid, ids) for rid, ids in requests]

    def _one(self, rid: str, ids: list[int]) -> dict:
        from hs_connectors.mooncake_store import VERSION, packed_layout

        act = self.script.get(rid)
        if act == "die":
            os._exit(1)  # the engine process dies holding the call
        if act == "error":
            return {"rid": rid, "error": "vLLM refused the prompt: scripted"}
        ids_t = torch.tensor(ids, dtype=torch.int64)
        spec, total = packed_layout({"hidden_states": ([len(ids), STATES, HIDDEN], torch.float32),
                                     "token_ids": ([len(ids)], torch.int64)})
        manifest = {"handle": rid, "version": VERSION, "tensors": spec,
                    "metadata": {"num_tokens": len(ids), "total_aligned_bytes": total, "extract_mode": "prompt_only"}}
        if act == "marker":
            self.store.put_error(manifest, "put_from failed: no space (scripted)")
        elif act == "lost":
            pass  # the manifest, but the object never reaches the store
        else:
            if act == "other_ids":
                ids_t = ids_t + 1  # states of other tokens than those asked for
            try:
                self.store.put_sample(manifest, {"hidden_states": states_of(ids_t), "token_ids": ids_t})
            except Exception as e:  # as the connector: a failed put publishes an error marker for the trainer
                self.store.put_error(manifest, f"{type(e).__name__}: {e}")
        return {"rid": rid, "manifest": manifest, "prompt_ids": list(ids)}


class Harness:
    """The trainer's side of one case: a StreamStates over the shared engine and transport."""

    def __init__(self, prep: Prepared, engine, transport: Transport):
        self.prep, self.engine, self.transport = prep, engine, transport
        self.norm = torch.nn.RMSNorm(HIDDEN, eps=EPS)
        self.steps: list[tuple[float, list[int]]] = []  # (time just before `trained`, samples)

    def nbytes(self, i: int) -> int:
        return min(self.prep.length(i), MAX_TOKENS) * BYTES_PER_TOKEN

    def states(self, window: int, **sc) -> StreamStates:
        cfg = StreamConfig(**{"fetch_timeout_s": 5.0, "wait_timeout_s": 60.0, "max_attempts": 3,
                              "engine_restarts": 1, **sc})
        return StreamStates([self.engine], ["engine-0"], self.transport, self.prep, LAYERS, HIDDEN, self.norm,
                            torch.float32, torch.float32, cfg, MAX_TOKENS, BYTES_PER_TOKEN, window)

    def plans(self, epoch: int) -> list[list[int]]:
        """This rank's micro-batches of `epoch`, as the train loop plans them (one rank)."""
        return epoch_batches(list(range(len(self.prep))), self.prep.lengths, MAX_TOKENS, 0, epoch, 0, 1)

    def train(self, states: StreamStates, epoch: int, plans: list[list[int]], first: int = 0,
              last: int | None = None, accum: int = 1, expect: bool = True) -> list[int]:
        """The loop's calls for micro-batches plans[first:last] (`expect`: the epoch starts here):
        each batch filled and checked against `states_of`, `trained` after every `accum` of them.
        -> the samples trained, in order."""
        if expect:
            states.expect(epoch, plans, first)
        done, pending = [], []
        for plan in plans[first:last]:
            batch = pack([self.prep[i] for i in plan], 1, MAX_TOKENS, pad_multiple=8)
            states(batch)
            self.check(batch, plan)
            pending.append(batch)
            if len(pending) == accum:
                self.steps.append((time.time(), [i for b in pending for i in (self.idx(s) for s in b.sample_ids)]))
                states.trained(pending)
                done += self.steps[-1][1]
                pending = []
        if pending:  # the epoch's last optimizer step, over fewer micro-batches
            self.steps.append((time.time(), [self.idx(s) for b in pending for s in b.sample_ids]))
            states.trained(pending)
            done += self.steps[-1][1]
        return done

    def idx(self, sample_id: str) -> int:
        return self.prep.ids.index(sample_id)

    def check(self, batch, plan: list[int]) -> None:
        """The batch holds its own samples' states: aux layers as stored, the last through the norm."""
        want = torch.cat([states_of(self.prep[i]["input_ids"][:MAX_TOKENS]) for i in plan])
        n = want.shape[0]
        last = want[:, -1].double()
        normed = (last / torch.sqrt(last.pow(2).mean(-1, keepdim=True) + EPS)).float()
        assert torch.equal(batch.aux_BSKD[0, :n], want[:, :-1]), f"aux states of {plan} are not theirs"
        torch.testing.assert_close(batch.final_BSD[0, :n], normed, rtol=1e-5, atol=1e-6)
        assert not batch.aux_BSKD[0, n:].any() and not batch.final_BSD[0, n:].any(), "padding is not zero"


def rid(sample: int, epoch: int, attempt: int) -> str:
    return f"s{sample}_e{epoch}_a{attempt}"


def asked(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.is_file() else []


def case_orders(h: Harness) -> dict:
    """(a) two epochs: every sample back in training order, each trained once."""
    st = h.states(window=1 << 30)
    plans = [h.plans(0), h.plans(1)]
    trained = [h.train(st, 0, plans[0], accum=2), h.train(st, 1, plans[1])]
    summary = st.summary()["epochs"]
    end = st.in_window
    st.close()
    return {"plans": plans, "trained": trained, "summary": summary, "in_window_end": end}


def case_held_out(h: Harness) -> dict:
    """Held-out batches asked for after the epoch's first step, the window full of training samples:
    asked for before the training samples still queued, read once, never trained."""
    epoch = 10
    train = list(range(len(h.prep) - 3))
    plans = epoch_batches(train, h.prep.lengths, MAX_TOKENS, 0, epoch, 0, 1)
    held = [[i] for i in range(len(h.prep) - 3, len(h.prep))]
    st = h.states(window=sum(h.nbytes(i) for i in plans[0] + plans[1]))  # training samples wait behind them
    trained = h.train(st, epoch, plans, last=1)
    t_eval = time.time()
    batches = st.evaluating(lambda: [pack([h.prep[i] for i in p], 1, MAX_TOKENS, pad_multiple=8) for p in held], held)()
    for b, p in zip(batches, held):
        st(b)
        h.check(b, p)
    trained += h.train(st, epoch, plans, first=1, expect=False)
    out = {"plans": plans, "held": held, "trained": trained, "t_eval": t_eval, "summary": st.summary()["epochs"],
           "in_window_end": st.in_window}
    st.close()
    return out


def case_held_out_fault(h: Harness) -> dict:
    """A held-out sample whose first answer is an error, asked for while the window is full of training
    samples that only a later step frees: it is asked again at once (not held back by the window until
    train.stream.wait_timeout_s), read once, never trained."""
    epoch = 11
    train = list(range(len(h.prep) - 4))
    plans = epoch_batches(train, h.prep.lengths, MAX_TOKENS, 0, epoch, 0, 1)
    held = [[len(h.prep) - 4], [len(h.prep) - 1]]  # the first is scripted to fail once (no other case asks it held out)
    t_start = time.time()
    st = h.states(window=sum(h.nbytes(i) for i in plans[0] + plans[1]), wait_timeout_s=20.0)
    trained = h.train(st, epoch, plans, last=1)
    time.sleep(0.5)  # the window fills with the next training samples
    out = {"held": held, "window_full_before": st.in_window, "t_start": t_start}
    try:
        batches = st.evaluating(lambda: [pack([h.prep[i] for i in p], 1, MAX_TOKENS, pad_multiple=8) for p in held],
                                held)()
        for b, p in zip(batches, held):
            st(b)
            h.check(b, p)
        trained += h.train(st, epoch, plans, first=1, expect=False)
        out["trained"] = trained
    except StreamError as e:
        out["error"] = str(e)
    out.update(plans=plans, summary=st.summary()["epochs"], errors={str(i): w for (_, i), w in st.errors.items()})
    st.close()
    return out


def case_resume_offline(h: Harness) -> dict:
    """Resumed from a checkpoint of offline training (no ledger): its k steps count as trained, the rest
    trains once and `finish` finds every sample trained; a schedule left short makes `finish` raise."""
    epoch, k = 12, 2
    plans = h.plans(epoch)
    st = h.states(window=1 << 30)
    st.resume(None)
    trained = h.train(st, epoch, plans, first=k)
    st.finish()
    out = {"plans": plans, "k": k, "trained": trained, "summary": st.summary()["epochs"]}
    st.close()
    short = h.states(window=1 << 30)
    h.train(short, epoch, plans, last=len(plans) - 1)
    try:
        short.finish()
    except AssertionError as e:  # LedgerError
        out["short"] = f"{type(e).__name__}: {e}"
    short.close()
    return out


def case_fault(h: Harness, epoch: int, act: str, **sc) -> dict:
    """The first sample of the epoch's second micro-batch meets `act` (the engine's script)."""
    st = h.states(window=1 << 30, **sc)
    plans = h.plans(epoch)
    hit = plans[1][0]
    out = {"plans": plans, "sample": hit, "sample_id": h.prep.ids[hit]}
    try:
        out["trained"] = h.train(st, epoch, plans)
    except StreamError as e:
        out["error"] = str(e)
    out["summary"] = st.summary()["epochs"]
    out["in_window_end"] = st.in_window
    out["errors"] = {str(i): why for (_, i), why in st.errors.items()}
    st.close()
    return out


def case_window(h: Harness) -> dict:
    """(f) a window of two micro-batches' bytes: never more asked for and not yet trained."""
    epoch = 5
    plans = h.plans(epoch)
    window = sum(h.nbytes(i) for i in plans[0] + plans[1])
    st = h.states(window=window, request_tokens=1 << 20)
    peak = [0]
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            peak[0] = max(peak[0], st.in_window)
            time.sleep(0.001)

    w = threading.Thread(target=watch)
    w.start()
    h.steps.clear()
    trained = h.train(st, epoch, plans)
    stop.set()
    w.join()
    end = st.in_window
    st.close()
    return {"plans": plans, "trained": trained, "window": window, "peak_in_window": peak[0], "in_window_end": end,
            "bytes": {i: h.nbytes(i) for i in range(len(h.prep))}, "steps": h.steps}


def case_resume(h: Harness) -> dict:
    """(g) a checkpoint after k steps; a new StreamStates resumed from its ledger trains the rest."""
    epoch, k = 6, 2
    plans = h.plans(epoch)
    st = h.states(window=1 << 30)
    before = h.train(st, epoch, plans, last=k)
    saved = json.loads(json.dumps(st.state_dict()))  # as the checkpoint holds it
    st.close()
    t_resume = time.time()
    st = h.states(window=1 << 30)
    st.resume([saved])
    after = h.train(st, epoch, plans, first=k)
    summary = st.summary()["epochs"]
    end = st.in_window
    st.close()

    def resumed_with(sample: int, state: str) -> str | None:
        """A resume at step k from `saved` with `sample` put in `state`: -> the refusal, or None."""
        tampered = json.loads(json.dumps(saved))
        tampered["ledgers"][0]["entries"][str(sample)]["state"] = state
        st = h.states(window=1 << 30)
        st.resume([tampered])
        try:
            st.expect(epoch, plans, k)
            return None
        except StreamError as e:
            return str(e)
        finally:
            st.close()

    later, earlier = plans[k + 1][0], plans[0][0]
    refused = resumed_with(later, "trained")
    skipped = resumed_with(earlier, "queued")
    return {"plans": plans, "k": k, "before": before, "earlier_id": h.prep.ids[earlier], "skipped": skipped, "after": after, "saved": saved, "summary": summary,
            "t_resume": t_resume, "in_window_end": end, "later": later, "later_id": h.prep.ids[later], "refused": refused}


def main(prep_dir: str, work: str, result: str) -> None:
    work_dir = Path(work)
    prep = Prepared(prep_dir)
    log = work_dir / "engine.jsonl"
    master = Master(work_dir / "mooncake_master.log")
    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)  # never a stranger cluster
    out: dict = {}
    try:
        probe = Harness(prep, None, None)
        script = {}
        for epoch, act, attempts in ((2, "error", 1), (3, "marker", 1), (4, "error", 2), (7, "die", 1), (8, "lost", 1),
                                     (9, "other_ids", 1)):
            hit = probe.plans(epoch)[1][0]
            script.update({rid(hit, epoch, a): act for a in range(1, attempts + 1)})
        script[rid(len(prep) - 4, -1, 1)] = "error"  # the held-out fault case's first held-out sample
        engine = ray.remote(StoreEngine).options(max_restarts=1, max_task_retries=0, max_concurrency=2,
                                                 num_cpus=0).remote(master.address, str(log), script)
        ray.get(engine.ready.remote())
        # The store's memory is the trainer's client's, not the engine's (as in a run): a dead engine's
        # segment stays mounted at the master for its client_ttl (10 s), and a put from the engine Ray
        # restarted within it may be placed there and fail (TRANSFER_FAIL, -800), its error marker too.
        transport = Transport(store_config(master.address, 64 << 20))
        h = Harness(prep, engine, transport)
        cases = {"orders": lambda: case_orders(h),
                 "error": lambda: case_fault(h, 2, "error"),
                 "marker": lambda: case_fault(h, 3, "marker"),
                 "attempts": lambda: case_fault(h, 4, "error", max_attempts=2),
                 "lost": lambda: case_fault(h, 8, "lost", fetch_timeout_s=0.5),
                 "other_ids": lambda: case_fault(h, 9, "other_ids"),
                 "window": lambda: case_window(h),
                 "resume": lambda: case_resume(h),
                 "held_out": lambda: case_held_out(h),
                 "held_out_fault": lambda: case_held_out_fault(h),
                 "resume_offline": lambda: case_resume_offline(h),
                 "dead_engine": lambda: case_fault(h, 7, "die")}  # last: the engine is a restarted one after it
        for name, fn in cases.items():
            t0 = time.perf_counter()
            try:
                out[name] = fn()
            except Exception:
                out[name] = {"traceback": traceback.format_exc()}
            out[name]["seconds"] = time.perf_counter() - t0
        out["asked"] = asked(log)
        out["ids"] = prep.ids
    finally:
        Path(result).write_text(json.dumps(out))
        ray.shutdown()
        master.stop()


if __name__ == "__main__":
    main(*sys.argv[1:4])
