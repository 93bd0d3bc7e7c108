"""Case cells, family `input`: bad input and limits a user meets. Each must end in exit 2 (an error a
user can act on) naming the file:line, field, path or flag and what to change, never a bare traceback
(exit 1), a hang, or a wrong cause: a byte that is not UTF-8, a lone surrogate, a number as text, a
cut JSON line and a number as content in the chat data; a YAML alias bomb; a target weight file cut
short; a read-only run directory; a malformed evaluate bench line (refused before any stage runs);
train.max_tokens too small to reach an assistant token; a memory limit hit in training; SIGHUP."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

from tests.fault_matrix import Case, _env, _wait_for, hangup_default

GOOD = {"messages": [{"role": "user", "content": "What is two and two?"}, {"role": "assistant", "content": "Four."}]}


def _said(rc: int, out: str, *needles: str, code: int = 2) -> tuple[bool, str]:
    """Held when the command exited `code` (an EyasError) and its last error line says every needle.
    (A stage's failure may also be recorded above it with its traceback: that is the record, not the
    answer.)"""
    lines = [ln for ln in out.splitlines() if ": error: " in ln] or out.strip().splitlines()[-1:] or ["(no output)"]
    held = rc == code and all(n in lines[-1] for n in needles)
    return held, f"exit {rc}: {lines[-1][:300]}" + ("" if held else f" (wanted exit {code} saying {list(needles)})")


def _data_with(m, work: Path, rng, bad: bytes) -> tuple[Path, int]:
    """The matrix's chat data with one line replaced by `bad` at a seeded line -> (file, line)."""
    lines = m.chats.read_bytes().splitlines(keepends=True)
    k = rng.randrange(1, len(lines))
    lines[k] = bad + b"\n"
    path = work / "chats.jsonl"
    path.write_bytes(b"".join(lines))
    return path, k + 1


def _prepare(m, work: Path, data: Path) -> tuple[int, str]:
    return m.eyas(["prepare", f"--run_dir={work / 'run'}", f"--target.model={m.target}", f"--prepare.data={data}"],
                  work / "prepare.log")


def _record(content) -> bytes:
    return json.dumps({"messages": [{"role": "user", "content": content},
                                    {"role": "assistant", "content": "an answer"}]}).encode()


def invalid_utf8(m, work, rng):
    data, line = _data_with(m, work, rng, _record("caf\u00e9 au lait").replace(b"\\u00e9", b"\xe9"))
    return _said(*_prepare(m, work, data), f"{data}:{line}: not valid UTF-8: byte 0xe9", "iconv")


def lone_surrogate(m, work, rng):
    data, line = _data_with(m, work, rng, _record("half \ud800 of a pair"))
    return _said(*_prepare(m, work, data), f"chats.jsonl:{line}", "turn 0 'content': a lone surrogate \\ud800")


def number_as_text(m, work, rng):
    data, line = _data_with(m, work, rng, _record([{"type": "text", "text": 5}]))
    return _said(*_prepare(m, work, data), f"chats.jsonl:{line}", "part 0: the text must be a string, got int")


def number_as_content(m, work, rng):
    data, line = _data_with(m, work, rng, _record(42))
    return _said(*_prepare(m, work, data), f"chats.jsonl:{line}", "expected text", "got int '42'")


def cut_json_line(m, work, rng):
    data, line = _data_with(m, work, rng, json.dumps(GOOD).encode()[:30])
    return _said(*_prepare(m, work, data), f"{data}:{line}: malformed JSON line", "the line ends (column 31)",
                 "cut short")


def yaml_alias_bomb(m, work, rng):
    lines = ["regenerate:", "  extra_body:", '    a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for prev, name in zip("abcdefgh", "bcdefghi"):
        lines.append(f"    {name}: &{name} [" + ",".join([f"*{prev}"] * 9) + "]")
    bomb = work / "bomb.yaml"
    bomb.write_text("\n".join(lines) + "\n")
    try:
        rc, out = m.eyas(["config", str(bomb)], work / "config.log", timeout=60)
    except subprocess.TimeoutExpired:
        return False, "`eyas config` on 9**9 aliased values still ran after 60 s"
    return _said(rc, out, f"{bomb}: its aliases (*name) expand", "write the values out")


def damaged_target(m, work, rng):
    target = shutil.copytree(m.target, work / "target")
    weights = target / "model.safetensors"
    data = weights.read_bytes()
    cut = rng.randrange(len(data) // 4, len(data) - 1)
    weights.write_bytes(data[:cut])
    run = work / "run"
    rc, out = m.eyas([*m.run_args(run), f"--target.model={target}"], work / "run.log")
    held, what = _said(rc, out, f"{weights}: a weight file of target.model=", "cut short", "download it again")
    if (run / "prepare").exists():
        held, what = False, what + "; a stage ran before the damage was found"
    return held, f"model.safetensors cut to {cut:,} of {len(data):,} bytes: {what}"


def _read_only(path: Path) -> bool:
    """Make `path` unwritable for this process (root: chattr +i; others: mode 555) -> done."""
    if os.geteuid() != 0:
        path.chmod(0o555)
        return True
    return subprocess.run(["chattr", "+i", str(path)], capture_output=True, check=False).returncode == 0


def read_only_run_dir(m, work, rng):
    run = work / "read-only"
    run.mkdir()
    if not _read_only(run):
        return False, "cell error: could not make a read-only directory here (chattr +i failed)"
    try:
        rc, out = m.eyas(m.run_args(run), work / "run.log")
    finally:
        subprocess.run(["chattr", "-i", str(run)], capture_output=True, check=False) if os.geteuid() == 0 else run.chmod(0o755)
    return _said(rc, out, f"{run}", "may not write", "--run_dir")


def bad_bench_line(m, work, rng):
    bench = work / "bench.jsonl"
    bench.write_text('{"turns": ["What is a draft model?"]}\n{"turns": ["cut off\n')
    run = work / "run"
    t0 = time.perf_counter()
    rc, out = m.eyas([*m.run_args(run), f"--evaluate.bench={bench}"], work / "run.log")
    held, what = _said(rc, out, f"{bench}:2: malformed JSON line")
    ran = [s for s in ("regenerate", "prepare", "extract", "train") if (run / s).exists()]
    if ran:
        held, what = False, what + f"; found only after {', '.join(ran)} ran"
    return held, what + f" ({time.perf_counter() - t0:.1f} s)"


def max_tokens_8(m, work, rng):
    run = m.finished_run(work)
    rc, out = m.eyas(["train", f"--run_dir={run}", f"--train.out_dir={work / 'train'}", f"--target.model={m.target}",
                      "--target.dtype=float32", "--train.max_tokens=8", "--train.max_steps=12", "--train.ttt_steps=2",
                      "--train.eval_fraction=0"], work / "train.log")
    held, what = _said(rc, out, "no position was trained", "--train.max_tokens")
    if "train.lr" in what:
        held, what = False, what + " (blames the learning rate)"
    return held, what


def memory_limit_in_train(m, work, rng):
    """The address space limited when training starts (tests/train/memory_limit.py) to what is mapped
    then plus 64 MiB: one micro-batch of 8192 tokens needs more (its target-vocabulary logits)."""
    run = m.finished_run(work)
    helper = Path(__file__).resolve().parents[1] / "train" / "memory_limit.py"
    log = work / "train.log"
    with open(log, "w") as f:
        proc = subprocess.run([m.python, str(helper), "64", "train", f"--run_dir={run}",
                               f"--train.out_dir={work / 'train'}", f"--target.model={m.target}",
                               "--target.dtype=float32", "--train.max_tokens=8192", "--train.max_steps=2",
                               "--train.ttt_steps=2", "--train.eval_fraction=0"],
                              stdout=f, stderr=subprocess.STDOUT, env=_env(), timeout=300, check=False)
    out = log.read_text(errors="replace")
    if "[memory_limit] RLIMIT_AS" not in out:
        return False, "cell error: training never started: " + out.strip()[-300:]
    return _said(proc.returncode, out, "train ran out of memory in its steps", "lower --train.max_tokens (now 8192")


def sighup(m, work, rng):
    run = m.finished_run(work)
    log = work / "run.log"
    with open(log, "w") as f, hangup_default():
        proc = subprocess.Popen([m.python, "-m", "eyas", *m.run_args(run), "--train.max_steps=400"], stdout=f,
                                stderr=subprocess.STDOUT, env=_env(), start_new_session=True)
    started = _wait_for(log, "[eyas:run] train: running", proc)
    delay = rng.uniform(0.2, 1.0)
    time.sleep(delay)
    if proc.poll() is not None:
        return False, f"cell error: the run ended before SIGHUP (exit {proc.returncode}, train started: {started})"
    os.killpg(proc.pid, signal.SIGHUP)
    rc = proc.wait(120)
    try:
        rec = json.loads((run / "summary.json").read_text())
        said = f"summary.json: {rec['failed_stage']} {rec['stages'][rec['failed_stage']]['status']}"
        held = rc == 129 and rec["stages"]["train"]["status"] == "interrupted"
    except (OSError, ValueError, KeyError) as e:
        said, held = f"no summary.json ({type(e).__name__})", False
    return held, f"SIGHUP {delay:.2f} s into train: exit {rc}; {said}"


CASES = [
    Case("input", "prepare-invalid-utf8-byte", invalid_utf8, "prepare"),
    Case("input", "prepare-lone-surrogate", lone_surrogate, "prepare"),
    Case("input", "prepare-number-as-text-part", number_as_text, "prepare"),
    Case("input", "prepare-number-as-content", number_as_content, "prepare"),
    Case("input", "prepare-cut-json-line", cut_json_line, "prepare"),
    Case("input", "config-yaml-alias-bomb", yaml_alias_bomb),
    Case("input", "run-damaged-target-weights", damaged_target, "extract"),
    Case("input", "run-read-only-run-dir", read_only_run_dir),
    Case("input", "run-bad-bench-line", bad_bench_line, "evaluate"),
    Case("input", "train-max-tokens-8", max_tokens_8, "train"),
    Case("input", "train-memory-limit", memory_limit_in_train, "train"),
    Case("input", "run-sighup", sighup, "train"),
]
