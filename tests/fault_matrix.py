"""The fault matrix: every stage of `eyas run` x the faults a real run meets, on a tiny pipeline
(a random-weight Llama with SmolLM2's tokenizer and template, 48 conversations, regenerate ->
prepare -> extract (several shards) -> train (12 steps, checkpoints) -> export -> evaluate; ~15 s).

A cell injects its fault into a real run (or into the outputs of a finished one), then runs the
same command again. It holds when that command either completes with every stage's output
bit-identical to an uninterrupted run (`fingerprint`), or exits non-zero with an error naming the
file and what to run; a fault that never showed (a kill after the process had ended) is said so.

Faults: kill -9 and SIGTERM at a seeded random moment of each stage; a file-size limit
(RLIMIT_FSIZE, as a full disk) while each stage writes; a torn (cut) and a flipped byte in each
artifact kind (regenerate's conversations, prepare's tokens, vocabulary and ids, extract's shards
and index, train's final draft and checkpoints, the exports, evaluate's results); a dead worker in
prepare's pool and in train's loader; a stalled and a dead chat server under regenerate's server
backend (a real HTTP server around the tiny model, tests/regenerate/chat_server.py).

Beside those, case cells (tests/fault_cases/): a situation a user meets outside a crash (two stages'
directories overlapping, a changed setting on resume, a server answering HTML, a bad byte in the
data, ...), set up and judged by its own check; families data_loss, provenance, server, input and
large_target, one module each.

Run a seeded sample in the suite (tests/test_fault_matrix.py) or every cell:
    python bench/fault_matrix.py            # -> the table in docs/benchmarks.md
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import resource
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

STAGES = ("regenerate", "prepare", "extract", "train", "export", "evaluate")
DAMAGED = (  # (stage, file under RUN_DIR, fault)
    ("regenerate", "regenerate/conversations.jsonl", "torn"), ("regenerate", "regenerate/conversations.jsonl", "flip"),
    ("prepare", "prepare/tokens.safetensors", "torn"), ("prepare", "prepare/tokens.safetensors", "flip"),
    ("prepare", "prepare/vocab.safetensors", "flip"), ("prepare", "prepare/sample_ids.json", "flip"),
    ("extract", "extract/shards/r000-00001.safetensors", "torn"), ("extract", "extract/shards/r000-00001.safetensors", "flip"),
    ("extract", "extract/index.json", "torn"), ("extract", "extract/index.json", "flip"),
    ("train", "train/final/draft.safetensors", "torn"), ("train", "train/final/draft.safetensors", "flip"),
    ("train", "train/checkpoints/LATEST/draft.safetensors", "flip"), ("train", "train/checkpoints/LATEST/trainer.pt", "torn"),
    ("train", "train/metrics.jsonl", "torn"),
    ("export", "export/speculators/model.safetensors", "torn"), ("export", "export/sglang/model.safetensors", "flip"),
    ("export", "export/speculators/config.json", "flip"),
    ("evaluate", "evaluate/results.json", "torn"), ("evaluate", "evaluate/results.json", "flip"),
)  # fmt: skip


@dataclass(frozen=True)
class Cell:
    stage: str
    fault: str  # kill9 | sigterm | disk_full | torn | flip | dead_worker | stalled_server | dead_server
    file: str = ""

    @property
    def name(self) -> str:  # e.g. train-flip-final.draft.safetensors
        where = self.file.split("/", 1)[-1].replace("checkpoints/LATEST", "checkpoint").replace("shards/", "")
        return f"{self.stage}-{self.fault}" + (f"-{where.replace('/', '.')}" if self.file else "")


@dataclass(frozen=True)
class Case:
    """A case cell: `check(matrix, work, rng)` sets up its situation under `work` (a finished run to
    start from: `matrix.finished_run(work)`), runs eyas and judges what it did -> (held, what
    happened). `family` (data_loss | provenance | server | input | large_target | stream) is its fault."""

    family: str
    label: str
    check: Callable[..., tuple[bool, str]] = field(compare=False, repr=False)
    stage: str = ""

    @property
    def fault(self) -> str:
        return self.family

    @property
    def name(self) -> str:  # e.g. data_loss-export-into-train
        return f"{self.family}-{self.label}"


def cells() -> list[Cell | Case]:
    from tests.fault_cases import all_cases

    out: list[Cell | Case] = [Cell(s, f) for f in ("kill9", "sigterm", "disk_full") for s in STAGES]
    out += [Cell(s, f, file) for s, file, f in DAMAGED]
    out += [Cell("prepare", "dead_worker"), Cell("train", "dead_worker")]
    out += [Cell("regenerate", "stalled_server"), Cell("regenerate", "dead_server")]
    return out + all_cases()


@dataclass
class Outcome:
    held: bool
    result: str  # "identical" | "loud" | what went wrong
    detail: str
    seconds: float


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def fingerprint(run: Path) -> dict[str, Any]:
    """Every stage's output as content hashes (evaluate: its numbers and target-only tokens, not its times)."""
    out: dict[str, Any] = {
        "regenerate": _sha(run / "regenerate" / "conversations.jsonl"),
        "prepare": {f: _sha(run / "prepare" / f) for f in ("tokens.safetensors", "vocab.safetensors", "sample_ids.json")},
        "extract": {f.name: _sha(f) for f in sorted((run / "extract" / "shards").glob("r*.safetensors"))},  # not
        # the damaged files `eyas run` kept aside (damaged-NAME)
        "extract_index": _sha(run / "extract" / "index.json"),
        "train": _sha(run / "train" / "final" / "draft.safetensors"),
        "export": {str(f.relative_to(run / "export")): _sha(f) for f in sorted((run / "export").rglob("*"))
                   if f.is_file() and (f.suffix == ".safetensors" or f.name == "config.json")},
    }
    res = json.loads((run / "evaluate" / "results.json").read_text())
    outputs = json.loads((run / "evaluate" / "target_outputs.json").read_text())
    out["evaluate"] = {k: res.get(k) for k in ("tau_chain", "lossless", "num_prompts", "acceptance_per_position")}
    out["evaluate_tokens"] = [r["tokens"] for r in outputs["runs"]]
    return out


class Matrix:
    """The tiny target, its data and the uninterrupted run every cell is judged against, under `root`."""

    def __init__(self, root: Path, smollm2_dir: Path, python: str = sys.executable):
        from tests.data import write_synthetic_chats
        from tests.models import save_tiny

        self.root, self.python = Path(root), python
        self.target = self.root / "tiny"
        if not (self.target / "config.json").is_file():
            save_tiny("llama", self.target, smollm2_dir)
        self.chats = write_synthetic_chats(self.root / "chats.jsonl", 48, max_words=60)
        self.references: dict[str, tuple[dict[str, Any], dict[str, float]]] = {}
        self.reference_dirs: dict[str, Path] = {}

    def args(self, run: Path, *extra: str) -> list[str]:
        return [self.python, "-m", "eyas", "run", f"--run_dir={run}", f"--target.model={self.target}",
                "--target.dtype=float32", f"--prepare.data={self.chats}", "--regenerate.enabled=true",
                "--regenerate.max_new_tokens=8", "--regenerate.chunk_conversations=16", "--prepare.max_length=128",
                "--prepare.draft_vocab_size=500", "--prepare.num_workers=2", "--prepare.batch_size=8", "--extract.shard_bytes=1000000",
                "--extract.token_budget=256", "--train.ttt_steps=2", "--train.max_tokens=512", "--train.max_steps=12",
                "--train.save_every=4", "--train.eval_fraction=0", "--train.num_workers=1", "--train.loader_timeout_s=20",
                "--evaluate.num_questions=1", "--evaluate.max_new_tokens=8", "--evaluate.mode=chain",
                "--evaluate.num_draft_tokens=2", *extra]  # fmt: skip

    def reference(self, *extra: str) -> tuple[dict[str, Any], dict[str, float]]:
        """(fingerprint, wall seconds per stage) of an uninterrupted run with `extra`, made once."""
        key = " ".join(extra)
        if key not in self.references:
            run = self.root / f"reference-{len(self.references)}"
            proc = self._run(self.args(run, *extra), run.parent / f"{run.name}.log")
            assert proc.returncode == 0, (run.parent / f"{run.name}.log").read_text()[-4000:]
            summary = json.loads((run / "summary.json").read_text())
            self.references[key] = fingerprint(run), {s: r["wall_s"] for s, r in summary["stages"].items()}
            self.reference_dirs[key] = run
        self.reference_dir = self.reference_dirs[key]
        return self.references[key]

    def _run(self, args: list[str], log: Path, timeout: float = 600, limit: int = 0) -> subprocess.CompletedProcess:
        def fsize():
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

        with open(log, "w") as f:
            return subprocess.run(args, stdout=f, stderr=subprocess.STDOUT, env=_env(), timeout=timeout, check=False,
                                  start_new_session=True, preexec_fn=fsize if limit else None)

    def finished_run(self, work: Path, name: str = "run", *extra: str) -> Path:
        """A copy, under `work`, of the uninterrupted run with `extra` (every stage done): what a
        case cell starts from. (Its run keys and records are the reference's own; the copy's
        absolute paths are its own: run again under another --run_dir, the stages from prepare on,
        which read regenerate's conversations by path, are out of date.)"""
        import shutil

        self.reference(*extra)
        run = work / name
        shutil.copytree(self.reference_dir, run, symlinks=True)
        return run

    def eyas(self, args: list[str], log: Path, timeout: float = 600, env: dict[str, str] | None = None,
             limit: int = 0) -> tuple[int, str]:
        """`python -m eyas ARGS` (any command) -> (exit status, everything it printed)."""
        def fsize():
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

        with open(log, "w") as f:
            proc = subprocess.run([self.python, "-m", "eyas", *args], stdout=f, stderr=subprocess.STDOUT,
                                  env=env or _env(), timeout=timeout, check=False, start_new_session=True,
                                  preexec_fn=fsize if limit else None)
        return proc.returncode, log.read_text(errors="replace")

    def run_args(self, run: Path, *extra: str) -> list[str]:
        """`eyas run`'s arguments of the reference run (without `python -m eyas`), for `eyas`."""
        return self.args(run, *extra)[3:]

    def run_cell(self, cell: Cell | Case, seed: int) -> Outcome:
        t0 = time.perf_counter()
        work = self.root / f"cell-{cell.name}-{seed}"
        if isinstance(cell, Case):
            work.mkdir(parents=True, exist_ok=True)
            try:
                held, detail = cell.check(self, work, random.Random(f"{seed}-{cell.name}"))
                return Outcome(held, "as required" if held else "not as required", detail, time.perf_counter() - t0)
            except Exception as e:  # a cell whose set-up itself broke: not held, said why
                import traceback

                return Outcome(False, f"cell error: {type(e).__name__}", "".join(
                    traceback.format_exception(e))[-800:], time.perf_counter() - t0)
        run, rng = work / "run", random.Random(f"{seed}-{cell.name}")
        work.mkdir(parents=True, exist_ok=True)
        extra: tuple[str, ...] = ()
        server = None
        try:
            if cell.fault in ("stalled_server", "dead_server"):
                server, extra = self._server()
                self.server = server
            ref, walls = self.reference(*extra)
            self.unsaid = ""  # set by a fault whose first run did not report it as it should
            note = getattr(self, f"_{cell.fault}")(cell, run, work, rng, walls, extra)
            if self.unsaid:
                return Outcome(False, self.unsaid, note, time.perf_counter() - t0)
            if server is not None and getattr(self, "server", None) is not server:  # it died: back on its port
                server = self.server
            if server is not None:
                server.mode = "model"  # the server works again
            again = self._run(self.args(run, *extra), work / "again.log")
            log = (work / "again.log").read_text()
            if again.returncode == 0:
                same = fingerprint(run) == ref
                return Outcome(same, "identical" if same else "completed with other outputs", note, time.perf_counter() - t0)
            loud = _names_a_file_and_a_fix(log, run)
            return Outcome(loud, "loud" if loud else "failed without naming a file and a fix",
                           note + " | " + _last_error(log), time.perf_counter() - t0)
        except Exception as e:  # a cell whose injection itself broke: not held, said why
            return Outcome(False, f"cell error: {type(e).__name__}", str(e)[:500], time.perf_counter() - t0)
        finally:
            for up in {id(x): x for x in (server, getattr(self, "server", None)) if x is not None}.values():
                up.__exit__(None, None, None)
            self.server = None

    # ---------------------------------------------------------------- the faults

    def _signal_at(self, cell, run, work, rng, walls, extra, sig) -> str:
        log = work / "first.log"
        with open(log, "w") as f:
            proc = subprocess.Popen(self.args(run, *extra), stdout=f, stderr=subprocess.STDOUT, env=_env(),
                                    start_new_session=True)
        started = _wait_for(log, f"[eyas:run] {cell.stage}: running", proc)
        delay = rng.uniform(0, 0.5 * (walls.get(cell.stage) or 0.2))  # inside the stage, most likely
        time.sleep(delay)
        ended_first = proc.poll() is not None
        if not ended_first:
            os.killpg(proc.pid, sig)
        rc = proc.wait(300)
        summary = run / "summary.json"
        said = ""
        if sig == signal.SIGTERM and rc == 143:
            rec = json.loads(summary.read_text())
            said = f"; summary.json: {rec['failed_stage']} {rec['stages'][rec['failed_stage']]['status']}"
        elif sig == signal.SIGTERM and not ended_first:
            self.unsaid = f"SIGTERM ended the run with exit {rc}, not 143 with a summary"
        return (f"{signal.Signals(sig).name} {delay:.2f} s into {cell.stage}" + (" (it had ended)" if ended_first else "")
                + ("" if started else " (the stage never started)") + f", exit {rc}{said}")

    def _kill9(self, *a) -> str:
        return self._signal_at(*a, sig=signal.SIGKILL)

    def _sigterm(self, *a) -> str:
        return self._signal_at(*a, sig=signal.SIGTERM)

    def _disk_full(self, cell, run, work, rng, walls, extra) -> str:
        i = STAGES.index(cell.stage)
        if i:
            assert self._run(self.args(run, *extra, f"--stop_after={STAGES[i - 1]}"), work / "before.log").returncode == 0
        largest = max(f.stat().st_size for f in (self.reference_dir / cell.stage).rglob("*") if f.is_file())
        limit = max(512, largest // 2)  # bytes per file: half the stage's largest (a full disk hits any file: run.log too)
        proc = self._run(self.args(run, *extra), work / "full.log", limit=limit)
        text = (work / "full.log").read_text(errors="replace")
        hint = "out of disk space or over a file-size limit" in text or "a full /dev/shm or disk" in text
        if proc.returncode == 0 or not hint:
            self.unsaid = "the limit was never hit" if proc.returncode == 0 else "a full disk not said as such"
        return f"RLIMIT_FSIZE {limit} B from {cell.stage} on: exit {proc.returncode}" + (", said so" if hint else ", NOT said")

    def _damage(self, cell, run, work, rng, walls, extra) -> str:
        assert self._run(self.args(run, *extra), work / "first.log").returncode == 0
        path = run / cell.file
        if "LATEST" in cell.file:
            latest = sorted((run / "train" / "checkpoints").glob("step_*"))[-1]
            path = latest / Path(cell.file).name
        data = bytearray(path.read_bytes())
        if cell.fault == "torn":
            cut = rng.randrange(1, len(data))
            path.write_bytes(bytes(data[:cut]))
            return f"{path.relative_to(run)} cut to {cut:,} of {len(data):,} bytes"
        at = rng.randrange(len(data))
        data[at] ^= 1 << rng.randrange(8)
        path.write_bytes(bytes(data))
        return f"{path.relative_to(run)}: one bit flipped at byte {at:,} of {len(data):,}"

    _torn = _flip = _damage

    def _dead_worker(self, cell, run, work, rng, walls, extra) -> str:
        log = work / "first.log"
        with open(log, "w") as f:
            proc = subprocess.Popen(self.args(run, *extra), stdout=f, stderr=subprocess.STDOUT, env=_env(),
                                    start_new_session=True)
        _wait_for(log, f"[eyas:run] {cell.stage}: running", proc)
        victim, deadline = None, time.monotonic() + 60
        later = [f"[eyas:run] {t}: running" for t in STAGES[STAGES.index(cell.stage) + 1:]]
        while victim is None and proc.poll() is None and time.monotonic() < deadline:
            if any(line in log.read_text(errors="replace") for line in later):
                break  # the stage ended before a worker of it was seen
            kids = _children(proc.pid)
            if kids:
                victim = kids[0]
                os.kill(victim, signal.SIGKILL)
            else:
                time.sleep(0.01)
        rc = proc.wait(300)
        if victim is None or rc == 0:
            self.unsaid = "no worker was killed" if victim is None else "a dead worker went unnoticed (exit 0)"
        return (f"SIGKILL to {cell.stage}'s worker pid {victim}" if victim else f"no {cell.stage} worker seen") + f", exit {rc}"

    def _server(self):
        from tests.regenerate.chat_server import ChatServer

        model, tok = _tiny_model(self.target)
        server = ChatServer(model, tok).__enter__()
        return server, ("--regenerate.backend=server", f"--regenerate.server_url={server.url}",
                        "--regenerate.server_model=tiny", "--regenerate.stall_s=5", "--regenerate.retries=1",
                        "--regenerate.concurrency=1")  # the server answers one request at a time

    def _stalled_server(self, cell, run, work, rng, walls, extra) -> str:
        self.server.mode = "stall"
        proc = self._run(self.args(run, *extra), work / "first.log")
        text = (work / "first.log").read_text()
        if proc.returncode == 0 or "the server stalled" not in text:
            self.unsaid = "a stalled server not reported as such"
        return f"the server stalls every request: exit {proc.returncode}" + (", reported as stalled" if "stalled" in text else "")

    def _dead_server(self, cell, run, work, rng, walls, extra) -> str:
        from tests.regenerate.chat_server import ChatServer

        port = self.server.httpd.server_address[1]
        self.server.__exit__(None, None, None)  # gone: connections refused
        proc = self._run(self.args(run, *extra), work / "first.log")
        if proc.returncode == 0 or "Connection refused" not in (work / "first.log").read_text():
            self.unsaid = "a dead server not reported as such"
        model, tok = _tiny_model(self.target)
        self.server = ChatServer(model, tok, port=port).__enter__()  # started again for the same command
        return f"the server is down (connection refused): exit {proc.returncode}"


_MODELS: dict[str, Any] = {}


def _tiny_model(path: Path):
    if str(path) not in _MODELS:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        _MODELS[str(path)] = (AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval(),
                              AutoTokenizer.from_pretrained(str(path)))
    return _MODELS[str(path)]


def _env() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")


@contextlib.contextmanager
def hangup_default():
    """SIGHUP at its default while children are started inside (they inherit it), as a terminal's
    shell leaves it: a suite started under nohup ignores SIGHUP, its children would inherit that, and
    eyas rightly keeps an ignored SIGHUP ignored. (Main thread only, as signal.signal is.)"""
    before = signal.signal(signal.SIGHUP, signal.SIG_DFL)
    try:
        yield
    finally:
        signal.signal(signal.SIGHUP, before)


def _wait_for(log: Path, line: str, proc, timeout: float = 300) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if line in log.read_text(errors="replace"):
            return True
        if proc.poll() is not None:
            return False
        time.sleep(0.01)
    return False


def _children(pid: int) -> list[int]:
    """The worker processes of `pid`: its children but multiprocessing's resource tracker."""
    try:
        kids = [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
        return [k for k in kids if b"resource_tracker" not in Path(f"/proc/{k}/cmdline").read_bytes()]
    except OSError:
        return []


def _last_error(log: str) -> str:
    lines = [line for line in log.splitlines() if "error" in line.lower() or "damaged" in line or "Error" in line]
    return (lines[-1] if lines else log.strip().splitlines()[-1] if log.strip() else "(no output)")[:400]


def _names_a_file_and_a_fix(log: str, run: Path) -> bool:
    line = _last_error(log)
    return (str(run) in line or ".safetensors" in line or ".json" in line) and any(
        w in line for w in ("run ", "remove", "delete", "free ", "again"))
