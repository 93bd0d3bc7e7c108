"""eyas.train.parallel: DDP and FSDP over torchrun match one process accumulating the same window."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from eyas.train import run
from tests.train.runs import read_metrics, train_config


@pytest.mark.slow
def test_torchrun_ddp_and_fsdp_match_one_process_accumulating_the_same_window(tmp_path, smol_prep, tiny_target):
    """Rank r takes every world_size-th micro-batch, so 2 ranks x grad_accum 1 see the window one
    process sees with grad_accum 2: same losses (normalised by the global valid count), same weights."""
    from safetensors.torch import load_file

    args = [f"--prepare.out_dir={smol_prep}", f"--target.model={tiny_target}", "--train.mode=online",
            "--train.ttt_steps=3", "--train.max_tokens=128", "--train.lr=1e-3", "--train.eval_fraction=0",
            "--train.log_every=1", "--train.max_steps=3"]
    run(train_config(tmp_path / "one", *args, "--train.grad_accum=2"))
    runs = {"one": tmp_path / "one" / "train"}
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    for kind in ("ddp", "fsdp"):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "eyas.cli",
               "train", f"--run_dir={tmp_path / kind}", *args, f"--train.parallel={kind}"]
        res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
        runs[kind] = tmp_path / kind / "train"
        assert json.loads((runs[kind] / "meta.json").read_text())["counts"]["world_size"] == 2
    ref = read_metrics(runs["one"])
    weights = load_file(runs["one"] / "final" / "draft.safetensors")
    assert [r["step"] for r in ref] == [1, 2, 3] and sum(ref[0]["valid_T"]) > 100
    for kind in ("ddp", "fsdp"):
        got = read_metrics(runs[kind])
        assert [r["valid_T"] for r in got] == [r["valid_T"] for r in ref], kind  # both micro-batches counted
        for a, b in zip(got, ref):
            assert a["loss"] == pytest.approx(b["loss"], rel=1e-5), (kind, a["step"], a["loss"], b["loss"])
            assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4), (kind, a["step"])
        theirs = load_file(runs[kind] / "final" / "draft.safetensors")
        assert theirs.keys() == weights.keys()
        for name, w in weights.items():
            torch.testing.assert_close(theirs[name], w, rtol=1e-4, atol=1e-5, msg=f"{kind}: {name}")
