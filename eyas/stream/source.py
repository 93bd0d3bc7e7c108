"""What train reads in stream mode: each batch's hidden states, asked of the engines ahead of need.

`StreamStates` takes the place `OnlineStates` has in online mode (eyas/train/data.py): the loop hands
it each batch of prepare's samples and it fills the batch's aux and final states. The data order is
the offline loop's (a pure function of seed, epoch and step), so the controller knows every sample
this rank will train and asks the engines for them in that order, ahead of need, while
`train.stream.window_gb` has room (the bytes asked for, in the store, and fetched but not yet trained).

One controller thread per trainer rank:
  queue (this rank's samples, in training order; a failed one back at the front)
    -> engine call (Ray; up to DEPTH calls waiting per engine, so an engine never idles)
    -> manifest -> fetch from Mooncake's store -> checks (token ids sent, shape) -> final norm -> ready
The ledger (eyas/stream/ledger.py) records every step; `trained` marks a batch's samples after the
optimizer step that used them; the ledgers are saved with each checkpoint.

Failures: an engine's refusal or error marker, a fetch timeout, a damaged object or a dead engine
puts the sample back in the queue (never skipped) until train.stream.max_attempts; a dead engine is
restarted by Ray (train.stream.engine_restarts); past either bound the run stops naming the samples,
engines and errors (the last checkpoint then resumes with nothing lost).

Shapes: S tokens of a sample, K aux layers, D hidden size.
"""

from __future__ import annotations

import collections
import itertools
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from eyas.errors import EyasError, exception_message
from eyas.stream.ledger import Ledger, LedgerError

DEPTH = 2  # engine calls waiting per engine: one prefilling, one queued behind it
FETCHERS = 4  # threads fetching objects from the store (each with its own registered buffer)
EVAL = -1  # the "epoch" of held-out samples
PROBE_PAUSE_S = 0.2  # between probes of an engine Ray is restarting (a probe sent then fails at once)


class StreamError(EyasError):
    """Streaming stopped: a sample past its attempts, every engine dead, or states that never came."""


@dataclass
class _Call:
    engine: int
    items: list[tuple[int, int, str, int]]  # (epoch, sample, request id, bytes)


@dataclass
class Rates:
    """Throughput accounting of one rank, since the last `take` (and in all)."""

    trained_tokens: int = 0
    wait_s: float = 0.0  # the trainer waited for states
    held_s: float = 0.0  # the engines had room for work but the window was full
    retries: int = 0
    started: float = field(default_factory=time.perf_counter)


class StreamStates:
    """Stream mode's batch filler (see the module docstring). `engines`: Ray actor handles;
    `transport`: this rank's Mooncake client; `prep`: prepare's samples; `norm`: the target's final
    norm (the engines return the last layer's state before it); `bytes_per_token`: of the engine's
    objects, for the window."""

    def __init__(self, engines: list, names: list[str], transport, prep, layer_ids: list[int], hidden: int,
                 norm, compute_dtype: torch.dtype, dtype: torch.dtype, sc, max_tokens: int, bytes_per_token: int,
                 window_bytes: int, saved: list[dict[str, Any]] | None = None, rank: int = 0, world: int = 1,
                 reference=None):
        self.engines, self.names, self.transport, self.prep = engines, names, transport, prep
        self.num_states, self.hidden = len(layer_ids) + 1, hidden
        self.norm, self.compute_dtype, self.dtype, self.sc = norm, compute_dtype, dtype, sc
        self.max_tokens, self.bytes_per_token, self.window = max_tokens, bytes_per_token, window_bytes
        self.rank, self.world = rank, world
        self.reference = reference  # () -> a backend with .references() (transformers on CPU), for parity
        self.parity: dict[str, list[float]] = {}  # engine -> the checked samples' errors
        self.parity_lock = threading.Lock()  # one check at a time (one reference model, loaded at the first)
        self._ref = None
        self.saved = _merge(saved or [])  # (epoch, sample) -> (state, attempt) from a checkpoint
        self.ledgered = True  # False: resumed from a checkpoint written without ledgers
        self.index = {sid: i for i, sid in enumerate(prep.ids)}
        self.lengths = prep.lengths.tolist()  # once: `prep.lengths` recomputes every sample's length
        self.ledgers: dict[int, Ledger] = {}
        self.left: dict[int, int] = {}  # an open epoch's samples not yet trained (counted: a step is O(batch))
        self.plan: collections.deque[tuple[int, list[int]]] = collections.deque()  # batches to come: (epoch, samples)
        self.queue: collections.deque[tuple[int, int]] = collections.deque()  # (epoch, sample) to ask for
        self.calls: dict[Any, _Call] = {}  # ObjectRef -> the call
        self.probes: dict[Any, int] = {}  # ObjectRef of a ready() probe -> the engine it waits for
        self.failures: collections.Counter[int] = collections.Counter()
        self.ready: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.in_window = 0  # bytes asked for or held
        self.errors: dict[tuple[int, int], list[str]] = collections.defaultdict(list)
        self.fatal: BaseException | None = None
        self.rates, self.total = Rates(), Rates()
        self.lock = threading.Condition()
        self.stop = False
        self.fetchers = ThreadPoolExecutor(FETCHERS, thread_name_prefix="eyas-stream-fetch")
        self.waiting: set[tuple[int, int]] = set()  # the samples the trainer waits for now
        self._rates_unknown = False
        self.thread = threading.Thread(target=self._run, name="eyas-stream-controller", daemon=True)
        self.thread.start()

    # ------------------------------------------------------------ the loop's side

    def expect(self, epoch: int, plans: list[list[int]], first: int) -> None:
        """The loop will train `plans[first:]` of `epoch` (this rank's micro-batches, in order)."""
        dealt = [i for p in plans for i in p]
        with self.lock:
            if epoch not in self.ledgers:
                led = Ledger(epoch, dealt)
                for k, p in enumerate(plans):
                    for i in p:
                        # a checkpoint of offline or online training has no ledger: its steps are what it trained
                        state, attempt = self.saved.get((epoch, i), ("queued" if self.ledgered else "trained", 0))
                        led.entries[i].attempt = attempt
                        if k < first and state != "trained":
                            raise StreamError(f"resuming epoch {epoch} at micro-batch {first}: sample "
                                              f"{self.prep.ids[i]!r} of an earlier micro-batch is {state} in the "
                                              "checkpoint's ledger, not trained; skipping it would never train it. The "
                                              "data order differs from the run that wrote the checkpoint "
                                              "(train.max_tokens, seed, the number of ranks or the held-out split "
                                              "changed): resume with that run's settings, or start a fresh "
                                              "--train.out_dir")
                        if k >= first and state == "trained" and self.ledgered:
                            raise StreamError(f"resuming epoch {epoch} at micro-batch {first}: sample "
                                              f"{self.prep.ids[i]!r} was trained already after the checkpoint's ledger; "
                                              "training it again would train it twice. The data order differs from "
                                              "the run that wrote the checkpoint (train.max_tokens, seed, the "
                                              "number of ranks or the held-out split changed): resume with that "
                                              "run's settings, or start a fresh --train.out_dir")
                        if k < first:
                            led.entries[i].state = "trained"
                self.ledgers[epoch] = led
                self.left[epoch] = sum(e.state != "trained" for e in led.entries.values())
            for p in plans[first:]:
                self.plan.append((epoch, list(p)))
                self.queue.extend((epoch, i) for i in p)
            self.lock.notify_all()

    def resume(self, saved: list[dict[str, Any]] | None) -> None:
        """The ledgers of the checkpoint resumed from (every rank's, `state_dict`), before `expect`; None:
        a checkpoint without ledgers (offline or online training), whose steps say what it trained."""
        self.saved = _merge(saved or [])
        self.ledgered = saved is not None

    def evaluating(self, loader_fn, plans: list[list[int]]):
        """`loader_fn` (the held-out batches of `plans`) whose samples are asked of the engines first,
        ahead of the training samples queued (no ledger: held-out samples are not trained)."""
        def fn():
            with self.lock:
                self.ledgers[EVAL] = Ledger(EVAL, [i for p in plans for i in p])
                self.plan.extendleft((EVAL, list(p)) for p in reversed(plans))
                self.queue.extendleft((EVAL, i) for p in reversed(plans) for i in reversed(p))
                self.lock.notify_all()
            return loader_fn()

        return fn

    def __call__(self, batch):
        """Fill `batch` (the next planned micro-batch) with its samples' states; waits for them."""
        t0 = time.perf_counter()
        with self.lock:
            if not self.plan:
                raise StreamError("a batch came that the stream was not told of (expect() not called)")
            epoch, samples = self.plan.popleft()
            got = [self.prep.ids[i] for i in samples]
            if got != list(batch.sample_ids):
                raise StreamError(f"the batch holds samples {list(batch.sample_ids)[:4]}, the stream planned {got[:4]}")
            keys = [(epoch, i) for i in samples]
            self.waiting = set(keys)  # urgent for the controller, whatever the window (see _dispatch)
            self.lock.notify_all()
            deadline = t0 + self.sc.wait_timeout_s if self.sc.wait_timeout_s else None
            while not all(k in self.ready for k in keys):
                if self.fatal is not None:
                    raise self.fatal
                left = None if deadline is None else deadline - time.perf_counter()
                if left is not None and left <= 0:
                    raise StreamError(self._stalled(keys))
                self.lock.wait(timeout=1.0 if left is None else min(left, 1.0))
            self.waiting = set()
            parts = [self.ready.pop(k) for k in keys]
            if epoch == EVAL:  # held-out: out of the window once read
                self.in_window -= sum(self._bytes(i) for i in samples)
                self.lock.notify_all()
        aux = torch.cat([a for a, _ in parts])
        final = torch.cat([f for _, f in parts])
        s, n = batch.input_ids_BS.shape[1], aux.shape[0]
        if n != sum(batch.lengths):
            raise StreamError(f"samples {batch.sample_ids[:4]}: {n} streamed token states for {sum(batch.lengths)} tokens")
        if s > n:  # the batch's padding (train.pad_multiple)
            aux = torch.cat([aux, aux.new_zeros(s - n, *aux.shape[1:])])
            final = torch.cat([final, final.new_zeros(s - n, final.shape[1])])
        batch.aux_BSKD, batch.final_BSD = aux[None], final[None]
        self._waited(time.perf_counter() - t0, n)
        return batch

    def trained(self, batches) -> None:
        """After the optimizer step over `batches`: their samples are trained (the ledger checks each
        was delivered and is trained once); their bytes leave the window."""
        with self.lock:
            for b in batches:
                idx = [self.index[s] for s in b.sample_ids]
                epoch = self._epoch_of(idx)
                self.ledgers[epoch].trained(idx)
                self.left[epoch] -= len(idx)
                self.in_window -= sum(self._bytes(i) for i in idx)
            newest = max(self.left)
            for epoch in [e for e, n in self.left.items() if n == 0 and e < newest]:  # checked once, then closed
                self.ledgers[epoch].close_epoch()
                del self.left[epoch]
            self.lock.notify_all()

    def _epoch_of(self, idx: list[int]) -> int:
        for epoch in sorted(self.ledgers):
            led = self.ledgers[epoch]
            if all(led.entries.get(i) is not None and led.state(i) == "delivered" for i in idx):
                return epoch
        raise LedgerError(f"samples {idx[:4]} trained but not delivered in any epoch's ledger")

    def state_dict(self) -> dict[str, Any]:
        with self.lock:
            return {"ledgers": [led.state_dict() for e, led in self.ledgers.items() if e != EVAL]}

    def summary(self) -> dict[str, Any]:
        engines = self._engine_rates()  # outside the lock: the engines may take seconds to answer
        with self.lock:
            parity = {"stream_parity_checked": sum(len(v) for v in self.parity.values()),
                      "stream_parity_max_error": max((e for v in self.parity.values() for e in v), default=None)}
            return {"epochs": [led.summary() for e, led in self.ledgers.items() if e != EVAL],
                    **self._rates(self.total, engines), **(parity if self.rank == 0 else {})}

    def take_rates(self) -> dict[str, float]:
        """The throughput accounting since the last call (the loop logs it per window)."""
        engines = self._engine_rates()
        with self.lock:
            out = self._rates(self.rates, engines)
            self.rates = Rates()
            return out

    def finish(self) -> None:
        """The schedule ran to its end: every sample of every epoch this rank was dealt was trained
        (LedgerError naming the ones that were not)."""
        with self.lock:
            for epoch, led in self.ledgers.items():
                if epoch != EVAL:
                    led.close_epoch()

    def close(self) -> None:
        with self.lock:
            self.stop = True
            self.lock.notify_all()
        self.thread.join(timeout=30)
        self.fetchers.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------ the controller thread

    def _bytes(self, sample: int) -> int:
        return min(self.lengths[sample], self.max_tokens) * self.bytes_per_token

    def _tokens(self, sample: int) -> list[int]:
        return self.prep[sample]["input_ids"][: self.max_tokens].tolist()

    def _run(self) -> None:
        import ray

        try:
            while True:
                with self.lock:
                    if self.stop:
                        return
                    self._dispatch()
                    refs = list(self.calls) + list(self.probes)
                if not refs:
                    with self.lock:
                        if not self.stop:
                            self.lock.wait(timeout=0.05)
                    continue
                done, _ = ray.wait(refs, num_returns=1, timeout=0.05)
                for ref in done:
                    self._answer(ref)
        except BaseException as e:  # handed to the trainer, which raises it at its next batch
            with self.lock:
                self.fatal = self.fatal or e
                self.lock.notify_all()

    def _dispatch(self) -> None:
        """Hand queued samples to engines with fewer than DEPTH calls waiting, while the window has room."""
        busy = collections.Counter(c.engine for c in self.calls.values())
        usable = [k for k in range(len(self.engines)) if k not in self.probes.values()]
        held = False
        # urgent: the batch the trainer waits for and the next one, sent whatever the window holds (bytes of
        # later batches can fill it, and only a trained step frees them: waiting on them would never end)
        urgent = set(self.waiting) | ({(self.plan[0][0], i) for i in self.plan[0][1]} if self.plan else set())
        if urgent and self.queue and self.queue[0] not in urgent:  # the urgent ones queued further back go first
            # (they are near the front: the queue is in training order and retries go first, so a short
            # look suffices; the whole queue, an epoch long, is not scanned every turn of the loop)
            first = [k for k in itertools.islice(self.queue, 4 * len(urgent) + 64) if k in urgent]
            for k in first:
                self.queue.remove(k)
            self.queue.extendleft(reversed(first))
        while self.queue and usable:
            engine = min(usable, key=lambda k: busy[k])
            if busy[engine] >= DEPTH:
                break
            items, tokens = [], 0
            while self.queue:
                epoch, i = self.queue[0]
                nbytes = self._bytes(i)
                n = nbytes // self.bytes_per_token
                if items and tokens + n > self.sc.request_tokens:
                    break
                if self.in_window + nbytes > self.window and (epoch, i) not in urgent and (items or self.in_window > 0):
                    held = True
                    break
                self.queue.popleft()
                rid = self.ledgers[epoch].send(i, self.names[engine])
                items.append((epoch, i, rid, nbytes))
                self.in_window += nbytes
                tokens += n
            if not items:
                break
            ref = self.engines[engine].extract.remote([(rid, self._tokens(i)) for _, i, rid, _ in items])
            self.calls[ref] = _Call(engine, items)
            busy[engine] += 1
        if held:
            self._held_since = getattr(self, "_held_since", None) or time.perf_counter()
        elif getattr(self, "_held_since", None):
            dt = time.perf_counter() - self._held_since
            self.rates.held_s += dt
            self.total.held_s += dt
            self._held_since = None

    def _answer(self, ref) -> None:
        import ray

        if ref in self.probes:
            self._probed(ref)
            return
        with self.lock:
            call = self.calls.pop(ref)
        name = self.names[call.engine]
        try:
            results = ray.get(ref)
        except Exception as e:  # the engine died (RayActorError) or its method raised: every sample of the call again
            why = f"engine {name} failed: {type(e).__name__}: {exception_message(e)}"
            with self.lock:
                for epoch, i, rid, nbytes in reversed(call.items):
                    self._retry(epoch, i, rid, nbytes, why, delivered=False)
                if call.engine not in self.probes.values():
                    self._engine_failed(call.engine, why)
                self.lock.notify_all()
            return
        for (epoch, i, rid, nbytes), res in zip(call.items, results):  # fetched apart: a slow object holds no other
            self.fetchers.submit(self._fetch, epoch, i, rid, nbytes, res, name)

    def _fetch(self, *args) -> None:
        try:
            self._one(*args)
        except BaseException as e:  # handed to the trainer, which raises it at its next batch
            with self.lock:
                self.fatal = self.fatal or e
                self.lock.notify_all()

    def _engine_failed(self, engine: int, why: str) -> None:
        """(lock held) No more work for `engine` until it answers a probe (Ray restarts a dead one);
        past train.stream.engine_restarts failures the run stops."""
        self.failures[engine] += 1
        name = self.names[engine]
        if self.failures[engine] > self.sc.engine_restarts:
            self.fatal = self.fatal or StreamError(
                f"engine {name} failed {self.failures[engine]} times (train.stream.engine_restarts="
                f"{self.sc.engine_restarts}); last: {why}. Its log is in Ray's session directory "
                "(/tmp/ray/session_latest/logs/worker-*.err). The samples it held are queued again in the "
                "checkpoint's ledger: fix the cause and run the same command to resume from the last checkpoint")
            return
        print(f"[eyas:train] stream: {why}; waiting for Ray to restart it ({self.failures[engine]} of "
              f"train.stream.engine_restarts={self.sc.engine_restarts})", flush=True)
        self.probes[self.engines[engine].ready.remote()] = engine

    def _probed(self, ref) -> None:
        import ray

        engine = self.probes.pop(ref)
        try:
            info = ray.get(ref)
        except ray.exceptions.ActorUnavailableError:  # Ray is restarting it: not a failure of its own, ask again
            time.sleep(PROBE_PAUSE_S)
            with self.lock:
                self.probes[self.engines[engine].ready.remote()] = engine
            return
        except Exception as e:
            with self.lock:
                self._engine_failed(engine, f"engine {self.names[engine]} did not come back: {type(e).__name__}: "
                                            f"{exception_message(e)}")
                self.lock.notify_all()
            return
        print(f"[eyas:train] stream: engine {self.names[engine]} is back (pid {info.get('pid')}, loaded in "
              f"{info.get('load_s', 0):.0f} s)", flush=True)

    def _one(self, epoch: int, i: int, rid: str, nbytes: int, res: dict[str, Any], name: str) -> None:
        """One request's answer: fetch, check, norm; or back to the queue."""
        if "error" in res:
            with self.lock:
                self._retry(epoch, i, rid, nbytes, f"engine {name}: {res['error']}", delivered=False)
            return
        manifest = res["manifest"]
        key = manifest.get("handle", "")
        with self.lock:
            current = self.ledgers[epoch].arrived(rid)
        if not current:  # a late answer to an attempt already given up: its object is never trained
            self.transport.discard(key)
            return
        try:
            tensors = self.transport.fetch(manifest, self.sc.fetch_timeout_s)
            states_SKD = self._check(i, tensors, key)
        except EyasError as e:
            self.transport.discard(key)
            with self.lock:
                self._retry(epoch, i, rid, nbytes, str(e), delivered=True)
            return
        self.transport.discard(key)
        aux, final = split_states(states_SKD, self.norm, self.compute_dtype, self.dtype)
        self._parity(name, i, aux, final)
        with self.lock:
            self.ready[(epoch, i)] = (aux, final)
            self.lock.notify_all()

    def _parity(self, engine: str, i: int, aux: torch.Tensor, final: torch.Tensor) -> None:
        """Rank 0: the engine's first train.stream.parity samples against a plain forward of the target
        (extract's check_parity); a mismatch is fatal (StreamError naming the engine and the sample)."""
        from eyas.extract.backend import ParityError, check_parity, default_tolerance

        if self.rank != 0 or self.reference is None or len(self.parity.get(engine, ())) >= self.sc.parity:
            return
        with self.parity_lock:
            if len(self.parity.get(engine, ())) >= self.sc.parity:
                return
            if self._ref is None:
                self._ref = self.reference()
            states = torch.cat([aux, final[:, None]], dim=1)
            tol = max(default_tolerance(self.compute_dtype), default_tolerance(self.dtype))
            try:
                result = check_parity(self._ref, [(self.prep.ids[i], states, torch.as_tensor(self._tokens(i)))], tol)
            except ParityError as e:
                raise StreamError(f"engine {engine}: the streamed states of sample {self.prep.ids[i]!r} are not the "
                                  f"target's: {e}. {self._ref.parity_hint}; train.stream.parity=0 turns the check off")
            with self.lock:
                self.parity[engine] = self.parity.get(engine, []) + result.errors
            print(f"[eyas:train] stream: engine {engine}: sample {self.prep.ids[i]!r} equals a plain forward of the "
                  f"target (largest relative error {max(result.errors):.2e}, tolerance {tol:g})", flush=True)

    def _check(self, i: int, tensors: dict[str, torch.Tensor], key: str) -> torch.Tensor:
        from eyas.extract.vllm_backend import _first_difference

        sent = self._tokens(i)
        got = tensors["token_ids"].tolist()
        if got != sent:
            raise StreamError(f"object {key}: token ids other than those sent ({_first_difference(sent, got)})")
        states = tensors["hidden_states"]
        want = (len(sent), self.num_states, self.hidden)
        if tuple(states.shape) != want:
            raise StreamError(f"object {key}: hidden_states of shape {tuple(states.shape)}, expected {want}")
        return states

    def _retry(self, epoch: int, i: int, rid: str, nbytes: int, why: str, delivered: bool) -> None:
        """(lock held) Sample i's attempt `rid` failed: back to the front of the queue, or fatal past its attempts."""
        led = self.ledgers[epoch]
        if delivered:
            led.requeue_delivered(i, why)
        elif not led.failed(rid, why):
            return
        self.in_window -= nbytes
        self.errors[(epoch, i)].append(why)
        self.rates.retries += 1
        self.total.retries += 1
        print(f"[eyas:train] stream: sample {self.prep.ids[i]!r} (request {rid}) asked for again: {why}", flush=True)
        if led.entries[i].attempt >= self.sc.max_attempts:
            self.fatal = self.fatal or StreamError(
                gave_up(self.prep.ids[i], i, led.entries[i].attempt, self.errors[(epoch, i)], self.sc, self.window))
            self.lock.notify_all()  # the trainer waiting for this sample raises now, not at its next poll
            return
        self.queue.appendleft((epoch, i))

    def _stalled(self, keys) -> str:
        waiting = [self.prep.ids[i] for (e, i) in keys if (e, i) not in self.ready]
        calls = {self.names[c.engine]: len(c.items) for c in self.calls.values()}
        return (f"no states for samples {waiting[:8]} within train.stream.wait_timeout_s={self.sc.wait_timeout_s:g} s "
                f"(requests in engines: {calls or 'none'}, queued: {len(self.queue)}, window "
                f"{self.in_window / 1e9:.2f} of {self.window / 1e9:.2f} GB): an engine stalled; its log is in "
                "Ray's session directory. Run the same command to resume from the last checkpoint")

    def _waited(self, dt: float, tokens: int) -> None:
        with self.lock:
            for r in (self.rates, self.total):
                r.wait_s += dt
                r.trained_tokens += tokens

    def _rates(self, r: Rates, engines: float | None) -> dict[str, float]:
        """The accounting of a span (`r`): inference capacity I (tokens/s the engines prefill while busy,
        summed over engines, since they started: rank 0 asks them), training capacity T (this rank's tokens per second not
        spent waiting for states, times the ranks), the achieved rate, and the seconds the trainer
        waited and the engines were held back by the window. `achieved / min(I, T)` near 1: the
        slower side sets the pace and the other keeps up."""
        wall = max(time.perf_counter() - r.started, 1e-9)
        out = {"stream_wait_s": r.wait_s, "stream_held_s": r.held_s, "stream_retries": r.retries,
               "stream_window_gb": self.in_window / 1e9, "stream_wall_s": wall,
               "stream_achieved_tok_s": r.trained_tokens * self.world / wall,
               "stream_train_tok_s": r.trained_tokens * self.world / max(wall - r.wait_s, 1e-9)}
        if engines is not None:
            out["stream_engine_tok_s"] = engines
            out["stream_efficiency"] = out["stream_achieved_tok_s"] / max(min(engines, out["stream_train_tok_s"]), 1e-9)
        return out

    def _engine_rates(self) -> float | None:
        """Inference capacity: sum over engines of the tokens each prefilled / the seconds it was busy,
        since it started (a span's own would be 0 when every sample of it was asked for earlier).
        Rank 0 only; None elsewhere, or when an engine does not answer within 10 s (restarting)."""
        import ray

        if self.rank != 0:
            return None
        try:
            now = ray.get([e.stats.remote() for e in self.engines], timeout=10)
        except Exception as e:  # an engine restarting: no figure for this span (said once)
            if not self._rates_unknown:
                self._rates_unknown = True
                print(f"[eyas:train] stream: the engines' capacity is left out of a logged window: "
                      f"{type(e).__name__}: {exception_message(e)}", flush=True)
            return None
        return sum(b["tokens"] / b["busy_s"] for b in now if b["busy_s"] > 0)


def split_states(states_SKD: torch.Tensor, norm, compute: torch.dtype, dtype: torch.dtype):
    """An engine's captured states [S, K+1, D] -> (aux [S, K, D], final [S, D]) as training reads them:
    the last one (the last layer's output, before the model's norm) through the target's final norm
    in `compute`, both in `dtype`."""
    with torch.no_grad():
        final = norm(states_SKD[:, -1].to(compute)).to(dtype)
    return states_SKD[:, :-1].to(dtype), final


def gave_up(sample_id: str, index: int, attempts: int, errors: list[str], sc, window: int) -> str:
    """Why the run stops on a sample past train.stream.max_attempts: its last errors, and when the
    store refused the engine's puts for want of room (Mooncake status -200: the master's eviction
    is off), that the store is full and which flag to change."""
    text = (f"sample {sample_id!r} (prepare index {index}) failed {attempts} times "
            f"(train.stream.max_attempts={sc.max_attempts}): " + " | ".join(errors[-3:]))
    if any(re.search(r"status=-200\b", e) for e in errors):
        text += (f". Mooncake's store is full (status -200: no room for the engine's put; its master evicts "
                 f"nothing): raise train.stream.store_gb (now {sc.store_gb:g} GB per engine) or lower "
                 f"train.stream.window_gb (now {window / 1e9:.3g} GB per rank) below the store's size")
    return text


def _merge(saved: list[dict[str, Any]]) -> dict[tuple[int, int], tuple[str, int]]:
    """Every rank's saved ledgers -> (epoch, sample) -> (state, attempt)."""
    out: dict[tuple[int, int], tuple[str, int]] = {}
    for rank_state in saved:
        for led in rank_state.get("ledgers", []):
            for i, v in led["entries"].items():
                out[(int(led["epoch"]), int(i))] = (v["state"], int(v["attempt"]))
    return out


def combine_summaries(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """Every rank's `StreamStates.summary()` -> one record: per epoch the ledgers' counts summed over
    the ranks, and each rank's waits."""
    epochs: dict[int, dict[str, int]] = {}
    for r in per_rank:
        for e in r["epochs"]:
            tot = epochs.setdefault(e["epoch"], {k: 0 for k in e if k != "epoch"})
            for k in tot:
                tot[k] += e[k]
    return {"epochs": [{"epoch": e, **v} for e, v in sorted(epochs.items())],
            "ranks": [{k.removeprefix("stream_"): v for k, v in r.items() if k.startswith("stream_")} for r in per_rank]}
