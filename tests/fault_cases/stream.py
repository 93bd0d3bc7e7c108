"""Stream cases: `eyas run --train.mode=stream` (a vLLM engine actor on a local Ray cluster capturing
the target's states into Mooncake's store, the trainer asking for its samples ahead) under the
faults of a long run: the trainer killed (kill -9), the engine killed or stopped (SIGSTOP), the
store's master killed, a store too small for the window it is told to use.

Every cell runs in the vLLM venv (tests/vllm_serving.py: scripts/vllm-venv.sh, or EYAS_VLLM_VENV),
on a random-weight Llama (hidden 512: 8 KB of states a token) with
SmolLM2's tokenizer, in fp32 (bit-reproducible on CPU), 8 steps with a checkpoint every 2. Each is
judged against ONE uninterrupted run of the same command, made once (`reference`): a cell holds
when the same command, run again after the fault as a user would, completes with the final draft
bit-identical to the reference's and the ledger (meta.json metrics.stream) saying every sample was
trained once, none twice; where eyas is meant to stop, the faulted run exits non-zero naming the
cause and the flag. The window is kept to about two micro-batches (train.stream.window_gb), so the
engine works all through training and a fault after the first checkpoint lands mid-stream.

Every process a cell starts (the trainer, Ray's, the engine's, the master) is followed from the
trainer's pid down while it lives (`Tracked`) and killed by its id when the cell ends.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

from tests.fault_matrix import Case

STEPS, SAVE_EVERY = 8, 2
COMMON = ("--target.dtype=float32", "--prepare.max_length=128", "--prepare.draft_vocab_size=500",
          "--train.max_tokens=512", f"--train.max_steps={STEPS}", f"--train.save_every={SAVE_EVERY}",
          "--train.eval_fraction=0", "--train.log_every=2", "--seed=3", "--stop_after=train", "--train.mode=stream",
          "--train.stream.store_gb=0.5", "--train.stream.window_gb=0.012", "--train.stream.request_tokens=512")
BIG = ("--train.max_tokens=1024", "--train.stream.window_gb=0.04")  # 8 steps: ~30 MB of states
FULL_STORE = ("--train.stream.store_gb=0.017", "--train.stream.window_gb=1", "--train.stream.fetch_timeout_s=10",
              "--train.stream.request_tokens=16384")  # one call for every sample into 17 MB (Mooncake takes no less)


# ---------------------------------------------------------------- processes


def _stat(pid: int) -> tuple[int, str, int] | None:
    """(parent pid, state, start time in ticks) of `pid`, or None when it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()
    return int(fields[1]), fields[0], int(fields[19])


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


class Tracked:
    """`args` started in a session of its own, logging to `log`; every process descending from it is
    recorded (pid and start time, so a reused pid is never taken for it) while its ancestors live,
    every 0.2 s, so that the processes it leaves behind (orphans of a killed trainer) are known by id."""

    def __init__(self, args: list[str], log: Path, env: dict[str, str]):
        self.log = log
        self.seen: dict[int, int] = {}  # pid -> start time
        with open(log, "w") as f:
            self.proc = subprocess.Popen(args, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.seen[self.proc.pid] = (_stat(self.proc.pid) or (0, "", 0))[2]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._follow, daemon=True)
        self._thread.start()

    def _follow(self) -> None:
        while not self._stop.is_set():
            self.scan()
            self._stop.wait(0.2)

    def scan(self) -> None:
        parents: dict[int, list[int]] = {}
        for p in Path("/proc").iterdir():
            if p.name.isdigit():
                st = _stat(int(p.name))
                if st is not None:
                    parents.setdefault(st[0], []).append(int(p.name))
        todo = [pid for pid in self.seen if self.alive(pid)]
        while todo:
            pid = todo.pop()
            for kid in parents.get(pid, []):
                st = _stat(kid)
                if st is not None and kid not in self.seen:
                    self.seen[kid] = st[2]
                    todo.append(kid)

    def alive(self, pid: int) -> bool:
        """`pid` is still the process recorded under it, and not a zombie."""
        st = _stat(pid)
        return st is not None and st[2] == self.seen.get(pid) and st[1] != "Z"

    def living(self) -> dict[int, str]:
        """pid -> command line of every recorded process still alive (the trainer included)."""
        return {pid: _cmdline(pid) for pid in list(self.seen) if self.alive(pid)}

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for(self, pattern: str, timeout_s: float = 600) -> re.Match | None:
        """The first match of `pattern` in the log, waiting while the trainer lives."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            found = re.search(pattern, self.text())
            if found or self.proc.poll() is not None:
                return found or re.search(pattern, self.text())
            time.sleep(0.1)
        return None

    def wait_path(self, path: Path, timeout_s: float = 600) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.proc.poll() is None and not path.exists():
            time.sleep(0.05)
        return path.exists()

    def wait(self, timeout_s: float = 600) -> int | None:
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def close(self) -> list[str]:
        """Kill (SIGCONT, then SIGKILL, by pid) every recorded process still alive; -> what was left."""
        self.scan()
        self._stop.set()
        self._thread.join(5)
        left = self.living()
        for pid in left:
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
        if self.proc.poll() is None:
            self.proc.wait(30)
        return [f"{pid} {cmd[:60]}" for pid, cmd in left.items()]


# ---------------------------------------------------------------- runs


def _python() -> str:
    from tests.vllm_serving import vllm_python

    py = vllm_python()
    if py is None:
        raise RuntimeError("no vLLM venv: run scripts/vllm-venv.sh or set EYAS_VLLM_VENV")
    return str(py)


def _env() -> dict[str, str]:
    from tests.vllm_serving import vllm_env

    return vllm_env(VLLM_CPU_KVCACHE_SPACE="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")


def _target(m) -> Path:
    """The cells' target: a random-weight Llama, hidden 512, 4 layers, SmolLM2's tokenizer (the matrix's)."""
    from tests.models import save_tiny

    target = m.root / "stream-target"
    if not (target / "config.json").is_file():
        save_tiny("llama", target, m.target, hidden=512, layers=4, heads=8, kv_heads=4)
    return target


def _args(m, run: Path, *extra: str) -> list[str]:
    return [_python(), "-m", "eyas", "run", f"--run_dir={run}", f"--target.model={_target(m)}",
            f"--prepare.data={m.chats}", *COMMON, *extra]


def _start(m, run: Path, log: Path, *extra: str) -> Tracked:
    return Tracked(_args(m, run, *extra), log, _env())


def _complete(m, run: Path, log: Path, *extra: str, timeout_s: float = 600) -> tuple[int | None, str]:
    """The command run to its end (every process it left killed after); -> (exit status, output)."""
    t = _start(m, run, log, *extra)
    try:
        rc = t.wait(timeout_s)
    finally:
        t.close()
    return rc, t.text()


def reference(m, *extra: str) -> Path:
    """The uninterrupted run of the command with `extra` the cells are judged against: made once per
    work directory (kept there, with the command it ran; made again when the command differs)."""
    name = "stream-reference" + ("-" + hashlib.sha256(" ".join(extra).encode()).hexdigest()[:8] if extra else "")
    run = m.root / name
    args = _args(m, run, *extra)
    record = m.root / f"{name}.json"
    done = run / "train" / "final" / "draft.safetensors"
    if done.is_file() and record.is_file() and json.loads(record.read_text()) == args:
        return run
    if run.exists():
        import shutil

        shutil.rmtree(run)
    rc, out = _complete(m, run, m.root / f"{name}.log", *extra)
    assert rc == 0, out[-4000:]
    ok, why, _ = _judge(run, None)
    assert ok, why
    record.write_text(json.dumps(args))
    return run


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _judge(run: Path, ref: Path | None) -> tuple[bool, str, int]:
    """The final draft equals the reference's bit for bit (`ref` None: not compared) and the ledger
    trained every sample once -> (ok, what was found, samples retried)."""
    final = run / "train" / "final" / "draft.safetensors"
    if not final.is_file():
        return False, "no final draft", 0
    notes, ok = [], True
    if ref is not None:
        want = ref / "train" / "final" / "draft.safetensors"
        if _sha(final) != _sha(want):
            import torch
            from safetensors.torch import load_file

            got, exp = load_file(str(final)), load_file(str(want))
            differ = sorted(k for k in exp if k not in got or not torch.equal(got[k], exp[k]))
            ok = False
            notes.append(f"draft DIFFERS from the reference ({len(differ)} tensors: {differ[:3]})")
        else:
            notes.append("draft bit-identical")
    meta = json.loads((run / "train" / "meta.json").read_text())
    epochs = meta["metrics"].get("stream", {}).get("epochs", [])
    once = bool(epochs) and all(e["trained"] == e["samples"] > 0 and e["duplicates_dropped"] == 0 for e in epochs)
    retried = sum(e.get("retried", 0) for e in epochs)
    steps = meta["counts"]["steps"]
    if ref is not None:  # as many optimizer steps as the reference's (STEPS, or fewer where one epoch ends sooner)
        ok = ok and steps == json.loads((ref / "train" / "meta.json").read_text())["counts"]["steps"]
    ok = ok and once and 0 < steps <= STEPS
    notes.append("ledger: " + "; ".join(f"epoch {e['epoch']} trained {e['trained']} of {e['samples']}, retried "
                                        f"{e['retried']}, duplicates {e['duplicates_dropped']}" for e in epochs))
    return ok, ", ".join(notes), retried


def _last_error(out: str) -> str:
    """The CLI's own last word (`eyas run: error: ...`), else the last line that speaks of an error."""
    lines = [x for x in out.splitlines() if x.startswith("eyas run: error:")] or \
        [x for x in out.splitlines() if "error" in x.lower() and "[eyas" in x] or \
        [x for x in out.splitlines() if "error" in x.lower()] or out.strip().splitlines()[-1:] or ["(no output)"]
    return lines[-1][:400]


def _engine_pid(t: Tracked, after: int = 0) -> int | None:
    """The engine actor's pid as eyas printed it (ready, or back after a restart), the last one after
    character `after` of the log."""
    found = t.wait_for(r"engine-0 ready \(vLLM [^,]+, pid (\d+)")
    if found is None:
        return None
    back = re.findall(r"engine engine-0 is back \(pid (\d+)", t.text()[after:])
    return int(back[-1]) if back else int(found.group(1))


def _fresh(work: Path) -> Path:
    """This cell's run directory, empty: what an earlier try of the cell (same seed) left there is its own."""
    import shutil

    run = work / "run"
    if run.exists():
        shutil.rmtree(run)
    return run


def _checkpoint(run: Path, step: int) -> Path:
    return run / "train" / "checkpoints" / f"step_{step:07d}"


def _rerun(m, run: Path, work: Path, ref: Path, *extra: str) -> tuple[bool, str]:
    """The same command again after the fault -> (completed bit-identical with every sample once, what happened)."""
    t0 = time.monotonic()
    rc, out = _complete(m, run, work / "again.log", *extra)
    if rc != 0:
        return False, f"the same command again: exit {rc}: {_last_error(out)}"
    ok, why, _ = _judge(run, ref)
    resumed = re.search(r"resuming from \S*(step_\d+)", out)
    return ok, (f"the same command again: exit 0 in {time.monotonic() - t0:.0f} s"
                f"{', resumed from ' + resumed.group(1) if resumed else ''}, {why}")


# ---------------------------------------------------------------- the cells



def _seeded_pause(t, rng, most: float) -> tuple[float, bool]:
    """A seeded pause of up to `most` s past the moment a cell waited for: -> (seconds, whether the
    run had ended by then: a fault after the end never shows)."""
    delay = rng.uniform(0, most)
    time.sleep(delay)
    return delay, t.proc.poll() is not None

def trainer_kill9(m, work: Path, rng) -> tuple[bool, str]:
    """SIGKILL of the trainer (the `eyas run` process alone) at a seeded moment after its first
    checkpoint. Held: within 10 s no mooncake_master and no VLLM:: process of the run is left (the
    master dies with its parent, the engine's watchdog kills its process group once Ray's cluster is
    gone), and the same command resumes to a draft bit-identical to the reference's."""
    ref, run = reference(m), _fresh(work)
    t = _start(m, run, work / "first.log")
    try:
        t.wait_path(_checkpoint(run, SAVE_EVERY))
        delay, ended = _seeded_pause(t, rng, 1.0)
        if not ended:
            t.scan()
            os.kill(t.proc.pid, signal.SIGKILL)
        t.wait(60)
        t0, left = time.monotonic(), {}
        while time.monotonic() - t0 < 15:
            t.scan()
            left = {p: c for p, c in t.living().items() if "mooncake_master" in c or c.startswith("VLLM::")}
            if not left:
                break
            time.sleep(0.5)
        gone_s = time.monotonic() - t0
        others = [c[:40] for c in t.living().values()]
    finally:
        killed = t.close()
    ckpts = sorted(p.name for p in (run / "train" / "checkpoints").glob("step_*"))
    note = (f"SIGKILL to the trainer {delay:.2f} s after {_checkpoint(run, SAVE_EVERY).name}"
            + (" (it had ended: the fault never showed)" if ended else "") + f", checkpoints {ckpts}; "
            + (f"master/VLLM:: LEFT after {gone_s:.0f} s: {list(left.values())}" if left else
               f"no master or VLLM:: process left after {gone_s:.1f} s")
            + (f" (other processes left, killed by the cell: {others})" if others else ""))
    same, again = _rerun(m, run, work, ref)
    return (not ended and not left and same and "resumed from" in again), f"{note}; {again}" + (
        f"; cleanup killed {killed}" if killed else "")


def engine_kill9(m, work: Path, rng) -> tuple[bool, str]:
    """SIGKILL of the engine actor's pid mid-training: Ray restarts it (train.stream.engine_restarts),
    the samples it held are asked for again. Held: the same run completes bit-identical to the
    reference, its ledger showing retried > 0 and no sample trained twice."""
    ref, run = reference(m), _fresh(work)
    t = _start(m, run, work / "run.log")
    try:
        pid = _engine_pid(t)
        t.wait_path(_checkpoint(run, SAVE_EVERY))
        delay, ended = _seeded_pause(t, rng, 0.5)
        t.scan()
        vllm = [p for p, c in t.living().items() if c.startswith("VLLM::") and _group(p) == pid]  # the engine's own
        if pid is not None and not ended:
            os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()
        while any(t.alive(p) for p in vllm) and time.monotonic() - t0 < 15:
            time.sleep(0.2)
        left = [p for p in vllm if t.alive(p)]
        gone_s = time.monotonic() - t0
        rc = t.wait(600)
        out = t.text()
    finally:
        killed = t.close()
    back = re.search(r"engine engine-0 is back \(pid (\d+), loaded in (\d+) s", out)
    note = (f"SIGKILL to engine-0 (pid {pid}) {delay:.2f} s after {_checkpoint(run, SAVE_EVERY).name}"
            + (" (the run had ended: the fault never showed)" if ended else "")
            + (f"; its {len(vllm)} VLLM:: processes " + (f"LEFT after 15 s: {left}" if left else f"gone in {gone_s:.1f} s"))
            + (f"; Ray restarted it (pid {back.group(1)}, loaded in {back.group(2)} s)" if back else "; NOT seen back"))
    if rc != 0:
        return False, f"{note}; exit {rc}: {_last_error(out)}"
    ok, why, retried = _judge(run, ref)
    return (ok and retried > 0 and not ended and bool(vllm) and not left), f"{note}; exit 0, {why}" + (
        f"; cleanup killed {killed}" if killed else "")


def _group(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


def master_kill9(m, work: Path, rng) -> tuple[bool, str]:
    """SIGKILL of the mooncake_master mid-training: the store and every object in it are gone. Held:
    the run stops (non-zero) naming the store / Mooncake, or completes correctly; then the same
    command (a new master) resumes to a draft bit-identical to the reference's."""
    ref, run = reference(m), _fresh(work)
    t = _start(m, run, work / "first.log")
    try:
        found = t.wait_for(r"mooncake_master on [\d.]+:(\d+)")
        t.wait_path(_checkpoint(run, SAVE_EVERY))
        t.scan()
        port = found.group(1) if found else "?"
        masters = [p for p, c in t.living().items() if "mooncake_master" in c and f"-rpc_port={port}" in c]
        delay, ended = _seeded_pause(t, rng, 0.5)
        for pid in masters if not ended else []:
            os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()
        rc = t.wait(600)
        stop_s = time.monotonic() - t0
        out = t.text()
    finally:
        killed = t.close()
    line = _last_error(out)
    named = rc != 0 and any(w in line.lower() for w in ("mooncake", "store"))
    note = (f"SIGKILL to mooncake_master (pid {masters}, port {port}) {delay:.2f} s after "
            f"{_checkpoint(run, SAVE_EVERY).name}" + (" (the run had ended: the fault never showed)" if ended else "")
            + f"; exit {rc} {stop_s:.0f} s later: {line}")
    first_ok = named
    if rc == 0:
        first_ok, why, _ = _judge(run, ref)
        note += f" ({why})"
    same, again = _rerun(m, run, work, ref)
    return (first_ok and same and bool(masters) and not ended), f"{note}; {again}" + (
        f"; cleanup killed {killed}" if killed else "")


def _engine_log(pid: int) -> list[Path]:
    """The files the engine actor's stdout and stderr go to (Ray's worker logs): what its vLLM
    workers print reaches them while the trainer, which Ray forwards them to, is stopped."""
    out = []
    for fd in (1, 2):
        try:
            out.append(Path(os.readlink(f"/proc/{pid}/fd/{fd}")))
        except OSError:
            pass
    return [f for f in out if f.is_file()]


def _wait_in_files(files: list[Path], pattern: str, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(re.search(pattern, f.read_text(errors="replace")) for f in files):
            return True
        time.sleep(0.2)
    return False


def full_store(m, work: Path, rng) -> tuple[bool, str]:
    """A store far smaller than the window eyas is told to use (store_gb=0.017, window_gb=1; every
    sample asked for in one call). vLLM answers a request before the connector's put ends, so the
    trainer's fetchers drain the store while the engine fills it, and on an idle machine they keep
    up: the trainer is stopped (SIGSTOP) from the engine's first request until the engine's log says
    a put failed (Mooncake -200: the master's eviction is off), or 120 s, then continued. Held: a put
    failed and the run completes bit-identical with retries, or stops naming the store and
    train.stream.store_gb; then the same command with the normal store completes bit-identical."""
    ref, run = reference(m, *BIG), _fresh(work)
    t0 = time.monotonic()
    t = _start(m, run, work / "full.log", *BIG, *FULL_STORE)
    stopped_s, refused = 0.0, False
    try:
        pid = _engine_pid(t)
        first = t.wait_for(r"Passing raw prompts", 300)  # vLLM's warning at the engine's first request
        files = _engine_log(pid) if pid else []
        if first and files and t.proc.poll() is None:
            t.proc.send_signal(signal.SIGSTOP)
            s0 = time.monotonic()
            try:
                refused = _wait_in_files(files, r"status=-200", 120)
            finally:
                t.proc.send_signal(signal.SIGCONT)
                stopped_s = time.monotonic() - s0
        rc = t.wait(600)
        out = t.text()
    finally:
        killed = t.close()
    seconds = time.monotonic() - t0
    failed_puts = out.count("status=-200")  # as Mooncake's errors say it, in the engine's log and eyas's
    line = _last_error(out)
    how = (f"trainer stopped {stopped_s:.1f} s while the engine put" if stopped_s
           else "the trainer was NOT stopped (no engine log or first request found)")
    if rc == 0:
        ok, why, retried = _judge(run, ref)
        first_ok = ok and retried > 0 and failed_puts > 0 and refused
        note = f"store 0.017 GB, window 1 GB, {how}: exit 0 in {seconds:.0f} s, {why}"
        if not refused:
            note += " (the store refused no put: the fault never showed)"
    else:
        first_ok = refused and "train.stream.store_gb" in line and "store" in line
        note = f"store 0.017 GB, window 1 GB, {how}: exit {rc} in {seconds:.0f} s: {line}"
    same, again = _rerun(m, run, work, ref, *BIG)
    return first_ok and same, f"{note} ({failed_puts} mentions of status=-200 in its output); {again}" + (
        f"; cleanup killed {killed}" if killed else "")


def stalled_engine(m, work: Path, rng) -> tuple[bool, str]:
    """SIGSTOP of the engine actor's pid mid-training with train.stream.wait_timeout_s=20. Held: the
    run stops (non-zero) naming the samples it waited for and train.stream.wait_timeout_s within
    about that time (not hanging in its shutdown on the stopped actor); after SIGCONT and cleanup
    the same command resumes to a draft bit-identical to the reference's."""
    ref, run = reference(m), _fresh(work)
    wait = ("--train.stream.wait_timeout_s=20",)
    t = _start(m, run, work / "first.log", *wait)
    try:
        pid = _engine_pid(t)
        t.wait_path(_checkpoint(run, SAVE_EVERY))
        delay, ended = _seeded_pause(t, rng, 0.5)
        if pid is not None and not ended:
            os.kill(pid, signal.SIGSTOP)
        t0 = time.monotonic()
        said = t.wait_for(r"no states for samples .{0,200}train\.stream\.wait_timeout_s=20", 300)
        said_s = time.monotonic() - t0
        rc = t.wait(300)
        stop_s = time.monotonic() - t0
        out = t.text()
        if pid is not None:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
    finally:
        killed = t.close()
    note = (f"SIGSTOP to engine-0 (pid {pid}) {delay:.2f} s after {_checkpoint(run, SAVE_EVERY).name}"
            + (" (the run had ended: the fault never showed)" if ended else "")
            + (f"; said so {said_s:.0f} s later" if said else "; the stall NOT said")
            + f"; exit {rc} {stop_s:.0f} s after the SIGSTOP: {_last_error(out)}")
    first_ok = rc not in (0, None) and bool(said) and stop_s <= 20 + 25 and not ended
    same, again = _rerun(m, run, work, ref, *wait)
    return first_ok and same, f"{note}; {again}" + (f"; cleanup killed {killed}" if killed else "")


CASES = [
    Case("stream", "trainer-kill9", trainer_kill9, "train"),
    Case("stream", "engine-kill9", engine_kill9, "train"),
    Case("stream", "master-kill9", master_kill9, "train"),
    Case("stream", "full-store", full_store, "train"),
    Case("stream", "stalled-engine", stalled_engine, "train"),
]
