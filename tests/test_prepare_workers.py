"""prepare.num_workers: a worker that dies or cannot start stops prepare with an error, never a hang.

The faults come from the target itself, as they do in production, not from a hook in eyas: the
target's tokenizer is code shipped with the model (trust_remote_code, as Kimi's is) that misbehaves
only inside a multiprocessing child, i.e. only in prepare's workers (`FAULTY_TOKENIZER_PY`):
"kill" SIGKILLs the worker on a text holding KILL_MARK (what the kernel's OOM killer does), "start"
fails to load (as a tokenizer directory the workers cannot read). prepare runs in a subprocess
under a timeout, so a hang fails the test instead of stalling the suite.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

TIMEOUT_S = 90
"""A fixed prepare exits within seconds; one that hangs is killed after this and fails the test."""
KILL_MARK = "KILL-THIS-WORKER"

FAULTY_TOKENIZER_PY = '''\
"""SmolLM2's fast tokenizer, with a fault injected only in multiprocessing children (prepare's workers)."""
import multiprocessing
import os
import signal

from transformers import PreTrainedTokenizerFast

FAULT = {fault!r}
STARTS = {starts!r}  # each load in a child appends its pid here: the test counts (re)spawns


def in_worker():
    return multiprocessing.parent_process() is not None


class FaultyTokenizerFast(PreTrainedTokenizerFast):
    def __init__(self, *args, **kwargs):
        if in_worker():
            with open(STARTS, "a") as f:
                f.write(f"{{os.getpid()}}\\n")
            if FAULT == "start":
                raise PermissionError(13, "Permission denied (injected start-up fault)", "tokenizer.json")
        super().__init__(*args, **kwargs)

    def __call__(self, text, *args, **kwargs):
        texts = [text] if isinstance(text, str) else text
        if FAULT == "kill" and in_worker() and any({mark!r} in t for t in texts):
            os.kill(os.getpid(), signal.SIGKILL)
        return super().__call__(text, *args, **kwargs)
'''


def faulty_target(root: Path, smollm2_dir, fault: str) -> Path:
    """SmolLM2's tokenizer files, loaded through FaultyTokenizerFast with `fault`."""
    model = root / f"faulty_{fault}"
    model.mkdir()
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(Path(smollm2_dir) / f, model / f)
    cfg = json.loads((model / "tokenizer_config.json").read_text())
    cfg.update(tokenizer_class="FaultyTokenizerFast", auto_map={"AutoTokenizer": [None, "tokenization_faulty.FaultyTokenizerFast"]})
    (model / "tokenizer_config.json").write_text(json.dumps(cfg))
    code = FAULTY_TOKENIZER_PY.format(fault=fault, starts=str(root / "starts.txt"), mark=KILL_MARK)
    (model / "tokenization_faulty.py").write_text(code)
    return model


def write_chats(path: Path, n: int, marked: int | None = None) -> Path:
    rows = [{"id": f"rec{i}", "messages": [
        {"role": "user", "content": f"question {i}" + (f" {KILL_MARK}" if i == marked else "")},
        {"role": "assistant", "content": f"answer {i}"}]} for i in range(n)]  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def run_prepare(tmp_path: Path, model: Path, chats: Path, num_workers: int) -> tuple[int, str, float]:
    """`eyas prepare` in a subprocess of its own session -> (exit code, stderr, seconds); on a hang the
    whole session (prepare and the workers it spawned) is killed and the test fails."""
    args = [sys.executable, "-m", "eyas", "prepare", f"--run_dir={tmp_path / 'run'}", f"--target.model={model}",
            "--target.trust_remote_code=true", f"--prepare.data={chats}", "--prepare.batch_size=4",
            f"--prepare.num_workers={num_workers}"]  # fmt: skip
    env = dict(os.environ, HF_MODULES_CACHE=str(tmp_path / "hf_modules"))  # the remote code of this test only
    t0 = time.perf_counter()
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            cwd=Path(__file__).parents[1], start_new_session=True)  # fmt: skip
    try:
        _, err = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # prepare and the workers it spawned
        _, err = proc.communicate()
        pytest.fail(f"prepare hung: no exit after {TIMEOUT_S} s; stderr:\n{err[-3000:]}")
    return proc.returncode, err, time.perf_counter() - t0


def starts(tmp_path: Path) -> int:
    f = tmp_path / "starts.txt"
    return len(f.read_text().split()) if f.is_file() else 0


def test_a_killed_worker_stops_prepare_naming_it(tmp_path, smollm2_dir):
    """SIGKILL in mid-chunk (40 conversations in 8 chunks of 5; rec23 is in chunk 5): prepare exits
    with an error naming the worker, its signal, the chunk's conversations and the fix."""
    model = faulty_target(tmp_path, smollm2_dir, "kill")
    rc, err, _ = run_prepare(tmp_path, model, write_chats(tmp_path / "chats.jsonl", 40, marked=23), 2)
    assert rc == 2, err
    assert "prepare worker" in err and "SIGKILL" in err, err
    assert "chunk 5 of 8" in err and "rec20" in err and "rec24" in err, err
    assert "--prepare.num_workers" in err, err
    assert starts(tmp_path) <= 2  # each worker started once (the other may have been stopped before loading)


def test_a_worker_that_cannot_start_stops_prepare_with_its_error(tmp_path, smollm2_dir):
    """The tokenizer loads in prepare's process but not in its workers: prepare exits with the
    workers' own exception (type, message, traceback down to the tokenizer's code), starting no
    worker again."""
    model = faulty_target(tmp_path, smollm2_dir, "start")
    rc, err, _ = run_prepare(tmp_path, model, write_chats(tmp_path / "chats.jsonl", 40), 2)
    assert rc == 2, err
    assert "could not start" in err, err
    assert "PermissionError" in err and "Permission denied (injected start-up fault)" in err, err
    assert "Traceback (most recent call last)" in err and "tokenization_faulty.py" in err, err
    assert starts(tmp_path) <= 2  # no respawn loop


def test_the_faulty_tokenizer_is_fine_in_one_process(tmp_path, smollm2_dir):
    """Control: with prepare.num_workers=1 the same targets and data prepare normally, so the
    failures above are the workers' faults alone."""
    for fault in ("kill", "start"):
        d = tmp_path / fault
        d.mkdir()
        model = faulty_target(d, smollm2_dir, fault)
        rc, err, _ = run_prepare(d, model, write_chats(d / "chats.jsonl", 40, marked=23), 1)
        assert rc == 0, err
        assert (d / "run" / "prepare" / "tokens.safetensors").is_file()
