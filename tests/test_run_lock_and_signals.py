"""What a run directory survives from outside: a second command on it, SIGTERM and SIGHUP.

* A second eyas command on a run directory another one holds stops at once, naming the holder
  (pid, host, command line), and touches nothing; a holder killed with SIGKILL leaves no lock.
* SIGTERM (a scheduler's stop or a preemption) in the middle of `eyas run`'s training: exit 143,
  summary.json names the stage as interrupted with the signal, and the same command afterwards
  continues from the stage directory it left. SIGHUP (a closed terminal) likewise, exit 129.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from eyas.cli import main as cli
from tests.data import write_synthetic_chats
from tests.fault_matrix import hangup_default
from tests.models import save_tiny

HOLD = """
import sys, time
from eyas.artifacts import run_dir_lock
sys.argv.append("--regenerate.server_url=https://ann:pa55word@host")  # its command line, as the lock shows it
with run_dir_lock(sys.argv[1], "run"):
    print("held", flush=True)
    time.sleep(600)
"""


def test_a_second_command_on_a_held_run_directory_names_the_holder_and_touches_nothing(tmp_path, capsys):
    run = tmp_path / "run"
    (run / "prepare").mkdir(parents=True)
    (run / "prepare" / "tokens.safetensors").write_bytes(b"the first command's output")
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(run)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        chats = write_synthetic_chats(tmp_path / "chats.jsonl", 2)
        for command in (["run"], ["prepare"]):
            assert cli([*command, f"--run_dir={run}", f"--prepare.data={chats}", "--target.model=/nonexistent"]) == 2
            err = capsys.readouterr().err
            assert f"run directory {run} is in use by another eyas command (pid {holder.pid} on " in err
            assert "--run_dir" in err and str(run / ".eyas.lock") in err and "https://ann:***@host" in err
            assert "pa55word" not in err + (run / ".eyas.lock").read_text()
        assert (run / "prepare" / "tokens.safetensors").read_bytes() == b"the first command's output"
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    # the kernel released the killed holder's lock: the next command gets past it (and fails on its own terms)
    assert cli(["prepare", f"--run_dir={run}", f"--prepare.data={chats}", "--target.model=/nonexistent"]) == 2
    assert "in use" not in capsys.readouterr().err


@pytest.mark.slow
def test_sigterm_in_the_middle_of_training_leaves_a_summary_and_the_same_command_continues(tmp_path, smollm2_dir):
    target = save_tiny("llama", tmp_path / "tiny", smollm2_dir)
    chats = write_synthetic_chats(tmp_path / "chats.jsonl", 8, max_words=40)
    run = tmp_path / "run"
    args = [sys.executable, "-m", "eyas", "run", f"--run_dir={run}", f"--target.model={target}", "--target.dtype=float32",
            f"--prepare.data={chats}", "--prepare.max_length=128", "--prepare.draft_vocab_size=500",
            "--train.ttt_steps=2", "--train.max_tokens=512", "--train.log_every=1", "--train.eval_fraction=0.0",
            "--train.epochs=200", "--train.max_steps=300", "--train.save_every=5", "--evaluate.num_questions=1", "--evaluate.max_new_tokens=4", "--evaluate.mode=chain"]
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    log = tmp_path / "first.log"
    with open(log, "w") as f:
        first = subprocess.Popen(args, stdout=f, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 300
    while not list(run.glob("train/checkpoints/*/")) and first.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert first.poll() is None, log.read_text()[-3000:]
    first.send_signal(signal.SIGTERM)
    assert first.wait(120) == 143, log.read_text()[-3000:]
    out = log.read_text()
    assert "eyas run: terminated (SIGTERM)" in out
    summary = json.loads((run / "summary.json").read_text())
    assert summary["failed_stage"] == "train" and summary["stages"]["train"]["status"] == "interrupted"
    assert summary["stages"]["train"]["error"]["type"] == "eyas.errors.Terminated"
    assert summary["stages"]["extract"]["status"] == "ran"
    second = subprocess.run(args, check=False, capture_output=True, text=True, env=env, timeout=600)
    assert second.returncode == 0, (second.stdout + second.stderr)[-3000:]
    assert "[eyas:run] train: resuming" in second.stdout and "extract: up to date" in second.stdout


AT_FORK = """
import os, signal, sys, time
from eyas.cli import sigterm_as_interrupt
from eyas.errors import Terminated
# SIGTERM landing inside an at-fork hook (a DataLoader starting its workers): CPython prints the
# hook's exception as "ignored" and goes on, so eyas must raise it again
os.register_at_fork(after_in_parent=lambda: (os.kill(os.getpid(), signal.SIGTERM), time.sleep(0.2)))
try:
    with sigterm_as_interrupt():
        child = os.fork()
        if child == 0:
            os._exit(0)
        os.waitpid(child, 0)
        time.sleep(5)
    print("went on")
except Terminated:
    print("terminated")
"""


def _said_by(script: str) -> str:
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False)
    return out.stdout.strip() or out.stderr


def test_a_sigterm_that_python_would_ignore_in_an_at_fork_hook_still_stops_the_run():
    assert _said_by(AT_FORK) == "terminated"


SWALLOWED = """
import os, signal, time
from eyas.cli import sigterm_as_interrupt
from eyas.errors import Terminated, raise_if_terminated
try:
    with sigterm_as_interrupt():
        try:  # a library's `except BaseException` that does not re-raise
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1)
        except BaseException:
            pass
        raise_if_terminated()  # the next unit of work
    print("went on")
except Terminated:
    print("terminated")
"""


def test_a_sigterm_a_library_swallows_is_raised_again_before_the_next_unit_of_work():
    assert _said_by(SWALLOWED) == "terminated"


def test_sighup_stops_the_run_as_sigterm_does_with_a_summary(tmp_path, smollm2_dir):
    """SIGHUP (the terminal or ssh session closed) mid-stage: the stage is marked interrupted in
    summary.json and the command exits 129 (128 + SIGHUP), as SIGTERM gives 143 — not killed bare.
    The stage is prepare on enough conversations to take seconds."""
    chats = write_synthetic_chats(tmp_path / "chats.jsonl", 2000, max_words=200)
    run = tmp_path / "run"
    # PYTHONFAULTHANDLER: a run that does not stop is made to print every thread's stack (SIGABRT) before
    # the test fails, so that the failure says where it hung
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", PYTHONFAULTHANDLER="1")
    log = tmp_path / "run.out"
    with open(log, "w") as f, hangup_default():  # as a terminal leaves it, also in a suite run under nohup
        proc = subprocess.Popen([sys.executable, "-m", "eyas", "run", f"--run_dir={run}", f"--target.model={smollm2_dir}",
                                 f"--prepare.data={chats}"], stdout=f, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 120
        while "[eyas:run] prepare: running" not in log.read_text() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert proc.poll() is None, log.read_text()[-3000:]
        proc.send_signal(signal.SIGHUP)
        try:
            rc = proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGABRT)
            proc.wait(30)
            raise AssertionError("no exit within 60 s of SIGHUP; its stacks at SIGABRT:\n"
                                 + log.read_text()[-6000:]) from None
        assert rc == 129, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "eyas run: terminated (SIGHUP)" in log.read_text()
    summary = json.loads((run / "summary.json").read_text())
    assert summary["failed_stage"] == "prepare" and summary["stages"]["prepare"]["status"] == "interrupted"
    assert summary["stages"]["prepare"]["error"]["type"] == "eyas.errors.Terminated"
    assert summary["stages"]["prepare"]["error"]["message"] == "SIGHUP"


NOHUP = """
import os, signal, time
signal.signal(signal.SIGHUP, signal.SIG_IGN)  # as nohup leaves it
from eyas.cli import sigterm_as_interrupt
from eyas.errors import Terminated
try:
    with sigterm_as_interrupt():
        os.kill(os.getpid(), signal.SIGHUP)
        time.sleep(0.2)
    print("went on")
except Terminated:
    print("terminated")
"""


def test_under_nohup_sighup_stays_ignored():
    """`nohup eyas run ... &` outlives its terminal: a SIGHUP ignored when eyas starts stays ignored."""
    assert _said_by(NOHUP) == "went on"


DATALOADER_SIGCHLD = """
import os, signal, time
from eyas.cli import sigterm_as_interrupt
from eyas.errors import Terminated
def torch_like(signum, frame):  # what torch's DataLoader installs: raises when a worker died
    raise RuntimeError("DataLoader worker (pid 1) is killed by signal: Terminated.")
signal.signal(signal.SIGCHLD, torch_like)
try:
    with sigterm_as_interrupt():
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(1)
except Terminated:
    if os.fork() == 0:  # a worker that dies while the run unwinds (it got the SIGTERM too)
        os._exit(0)
    time.sleep(0.3)  # its SIGCHLD arrives here: must not raise over the unwinding
    os.wait()
    print("unwound")
"""


def test_a_worker_dying_of_the_same_sigterm_does_not_raise_over_the_unwinding():
    """SIGTERM to the process group kills DataLoader workers too; torch's SIGCHLD handler would then
    raise "worker killed" while summary.json is written. Once terminating, SIGCHLD is left alone."""
    assert _said_by(DATALOADER_SIGCHLD) == "unwound"
