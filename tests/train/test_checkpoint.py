"""eyas.train.checkpoint: what a checkpoint holds between logging steps; kill -9, then resume continues
the same loss curve."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from eyas.train import run
from tests.train.runs import read_metrics, tiny_cfg, train_config


def test_a_checkpoint_between_logging_steps_counts_the_window_in_progress(tmp_path, smol_prep, tiny_target):
    from eyas.train import checkpoint

    cfg = tiny_cfg(tmp_path, smol_prep, tiny_target, "--train.mode=online", "--train.max_steps=4",
                   "--train.log_every=2", "--train.save_every=3", "--train.keep_checkpoints=0")
    run(cfg)
    recs = read_metrics(cfg.stage_dir("train"))
    assert [r["step"] for r in recs] == [2, 4]
    state = checkpoint.read_trainer_state(cfg.stage_dir("train") / "checkpoints" / "step_0000003")
    work = state["all_runs"]
    assert (work["runs"], work["steps"]) == (1, 3)
    # steps 1-2 (the first window) and step 3, short of the second window's step 4
    assert recs[0]["tokens"] < work["tokens"] < recs[0]["tokens"] + recs[1]["tokens"]
    assert recs[0]["tokens"] / recs[0]["tokens_per_s"] < work["seconds"]


def test_a_checkpoint_without_the_trainer_fields_is_refused_naming_init_from(tmp_path, smol_prep, tiny_target):
    """A trainer.pt without a field this eyas resumes from (an earlier eyas wrote it) is an
    ArtifactError naming the checkpoint and --train.init_from, not a KeyError from deep in the loop."""
    from eyas.errors import ArtifactError
    from eyas.train import checkpoint

    cfg = tiny_cfg(tmp_path, smol_prep, tiny_target, "--train.mode=online", "--train.max_steps=2", "--train.save_every=1")
    run(cfg)
    ckpt = cfg.stage_dir("train") / "checkpoints" / "step_0000002"
    state = checkpoint.read_trainer_state(ckpt)
    del state["all_runs"]
    torch.save(state, ckpt / checkpoint.TRAINER_STATE)
    (ckpt / checkpoint.CHECKSUMS).unlink()  # an earlier eyas wrote none
    again = tiny_cfg(tmp_path, smol_prep, tiny_target, "--train.mode=online", "--train.max_steps=3",
                     f"--train.resume={ckpt}", f"--train.out_dir={tmp_path / 'again'}")
    with pytest.raises(ArtifactError, match=r"lacks \['all_runs'\].*--train.init_from=.*step_0000002"):
        run(again)


def test_a_checkpoint_whose_file_changed_is_refused_naming_it(tmp_path, smol_prep, tiny_target):
    from eyas.errors import DamagedArtifact
    from eyas.train import checkpoint

    cfg = tiny_cfg(tmp_path, smol_prep, tiny_target, "--train.mode=online", "--train.max_steps=2", "--train.save_every=1")
    run(cfg)
    ckpt = cfg.stage_dir("train") / "checkpoints" / "step_0000002"
    weights = bytearray((ckpt / "draft.safetensors").read_bytes())
    weights[-3] ^= 0x10  # a weight's byte: the file still parses, the draft would resume wrong
    (ckpt / "draft.safetensors").write_bytes(bytes(weights))
    again = tiny_cfg(tmp_path, smol_prep, tiny_target, "--train.mode=online", "--train.max_steps=3",
                     f"--train.resume={ckpt}", f"--train.out_dir={tmp_path / 'again'}")
    with pytest.raises(DamagedArtifact, match=r"step_0000002: draft.safetensors is damaged \(sha256 differs from "
                                              r"checksums.json\); remove .* to resume from the checkpoint before it"):
        run(again)


@pytest.mark.slow
def test_kill_9_then_resume_continues_the_same_loss_curve(tmp_path, smol_prep, tiny_target):
    args = [f"--prepare.out_dir={smol_prep}", f"--target.model={tiny_target}", "--train.mode=online",
            "--train.ttt_steps=3", "--train.max_tokens=128", "--train.lr=1e-3", "--train.eval_fraction=0",
            "--train.log_every=1", "--train.save_every=4", "--train.epochs=50", "--train.max_steps=36"]
    ref_cfg = train_config(tmp_path / "ref", *args)
    run(ref_cfg)
    ref = read_metrics(ref_cfg.stage_dir("train"))
    assert [r["step"] for r in ref] == list(range(1, 37))

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "eyas.cli", "train", f"--run_dir={tmp_path / 'run'}", *args]
    train_dir = tmp_path / "run" / "train"
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.time() + 120
    while not (train_dir / "checkpoints" / "step_0000008").is_dir():
        assert proc.poll() is None, proc.stdout.read().decode()
        assert time.time() < deadline, "no checkpoint within 120 s"
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL and not (train_dir / "meta.json").exists()
    killed_at = max(r["step"] for r in read_metrics(train_dir))
    assert killed_at < 36

    res = subprocess.run(cmd + ["--resume", "auto"], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "resuming from" in res.stdout
    got = read_metrics(train_dir)
    assert [r["step"] for r in got] == list(range(1, 37))
    for a, b in zip(got, ref):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6, abs=1e-6), (a["step"], a["loss"], b["loss"])
        assert a["acc_T"] == pytest.approx(b["acc_T"], abs=1e-9) and a["lr"] == pytest.approx(b["lr"], rel=1e-9)
    assert (train_dir / "final" / "draft.safetensors").is_file()
