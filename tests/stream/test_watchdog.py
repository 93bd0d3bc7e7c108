"""eyas/stream/engines.py's watchdog: once an engine actor is gone, every process of its group goes
(vLLM's EngineCore is the actor's child, its workers EngineCore's). Ray kills a dead worker's direct
children itself, the watchdog too when it was one: here the "actor" is a plain process that starts
the watchdog as the engine does, and a child with a grandchild in its group (EngineCore and a
worker); it is then killed as Ray does it (its direct children with SIGKILL, then itself)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ACTOR = """
import os, subprocess, sys, time
from eyas.stream.engines import reap_with_me
reap_with_me()
child = subprocess.Popen([sys.executable, "-c", "import subprocess, time; g = subprocess.Popen(['sleep', '120']); "
                          "print(g.pid, flush=True); time.sleep(120)"], stdout=subprocess.PIPE, text=True)
print(child.stdout.readline().strip(), flush=True)
time.sleep(120)
"""


def gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_a_dead_engine_actor_takes_its_grandchildren_with_it():
    import eyas

    env = dict(os.environ, PYTHONPATH=str(Path(eyas.__file__).resolve().parents[1]))  # this eyas
    actor = subprocess.Popen([sys.executable, "-c", ACTOR], stdout=subprocess.PIPE, text=True, env=env)
    grandchild = int(actor.stdout.readline())
    try:
        assert os.getpgid(grandchild) == actor.pid and not gone(grandchild)
        children = Path(f"/proc/{actor.pid}/task/{actor.pid}/children").read_text().split()
        for pid in children:  # as Ray does for a worker that died
            os.kill(int(pid), signal.SIGKILL)
        actor.kill()
        actor.wait()
        deadline = time.monotonic() + 10
        while not gone(grandchild) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert gone(grandchild), "the engine's grandchild outlived its actor"
    finally:
        if not gone(grandchild):
            os.kill(grandchild, signal.SIGKILL)
