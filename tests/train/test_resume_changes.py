"""A resumed training is what its records say: a setting changed on resume (the learning rate, the
steps) is applied from the resumed step and recorded as a change in metrics.jsonl, meta.json and the
checkpoints after it; a checkpoint of other data, another draft vocabulary or another draft shape is
refused before its state is read."""

from __future__ import annotations

import json
import math

import pytest

from eyas.errors import ConfigError
from eyas.train import checkpoint, run
from tests.data import run_prepare, write_sharegpt_chats, write_synthetic_chats
from tests.train.runs import read_metrics, tiny_cfg
from tests.train.test_resume_safety import four_steps

LR = 1e-3  # tiny_cfg's


def cosine(lr: float, step: int, total: int) -> float:
    """The lr of 0-based optimizer step `step` of a `total`-step cosine schedule without warmup to 0."""
    return lr * 0.5 * (1 + math.cos(math.pi * step / total))


def resumed(tmp_path, smol_prep, tiny_target, ckpt, name, *extra, prep=None):
    return tiny_cfg(tmp_path, prep or smol_prep, tiny_target, "--train.mode=online", "--train.max_steps=4",
                    "--train.save_every=1", "--train.keep_checkpoints=0", f"--train.resume={ckpt}",
                    f"--train.out_dir={tmp_path / name}", *extra)


def test_a_new_lr_on_resume_is_applied_from_that_step_and_recorded(tmp_path, smol_prep, tiny_target):
    _, train_dir = four_steps(tmp_path, smol_prep, tiny_target)
    ref = read_metrics(train_dir)
    assert [r["lr"] for r in ref] == pytest.approx([cosine(LR, s, 4) for s in range(4)], rel=1e-12)
    meta = run(resumed(tmp_path, smol_prep, tiny_target, train_dir / "checkpoints" / "step_0000002", "again",
                       "--train.lr=1e-2"))
    change = {"step": 2, "key": "train.lr", "from": LR, "to": 1e-2}
    got = read_metrics(tmp_path / "again")
    assert [r["lr"] for r in got] == pytest.approx([cosine(1e-2, s, 4) for s in (2, 3)], rel=1e-12)
    assert got[0]["loss_T"] == ref[2]["loss_T"] and got[1]["loss_T"] != ref[3]["loss_T"]  # step 3 trained at 1e-2
    assert got[0]["changes"] == [change] and "changes" not in got[1]
    assert meta["changes"] == [change]
    assert checkpoint.read_trainer_state(tmp_path / "again" / "checkpoints" / "step_0000004")["changes"] == [change]
    # a resume with the same settings changes nothing and records nothing
    meta = run(resumed(tmp_path, smol_prep, tiny_target, train_dir / "checkpoints" / "step_0000002", "same"))
    assert meta["changes"] == [] and [r["loss_T"] for r in read_metrics(tmp_path / "same")] == [r["loss_T"] for r in ref[2:]]


def test_more_steps_on_resume_follow_the_longer_schedule_not_lr_0(tmp_path, smol_prep, tiny_target):
    """The 4-step schedule ends at lr 0; one step more used to be trained at lr 0 (and then stopped
    as a collapse blaming the lr). It follows the 5-step schedule, recorded as changed at step 4."""
    _, train_dir = four_steps(tmp_path, smol_prep, tiny_target)
    meta = run(resumed(tmp_path, smol_prep, tiny_target, train_dir / "checkpoints" / "step_0000004", "longer",
                       "--train.max_steps=5", "--seed=1"))
    (rec,) = read_metrics(tmp_path / "longer")
    assert rec["step"] == 5 and rec["lr"] == pytest.approx(cosine(LR, 4, 5), rel=1e-12) and rec["lr"] > 0
    assert meta["changes"] == [{"step": 4, "key": "train.max_steps", "from": 4, "to": 5},
                               {"step": 4, "key": "seed", "from": 0, "to": 1},  # another data order: recorded too
                               {"step": 4, "key": "schedule.total_steps", "from": 4, "to": 5}]
    assert meta["counts"]["steps"] == 5


def test_a_changed_draft_shape_on_resume_is_a_clear_error(tmp_path, smol_prep, tiny_target):
    _, train_dir = four_steps(tmp_path, smol_prep, tiny_target)
    ckpt = train_dir / "checkpoints" / "step_0000002"
    with pytest.raises(ConfigError, match=r"another shape.*num_layers 1 -> 2 \(train\.num_layers\)"):
        run(resumed(tmp_path, smol_prep, tiny_target, ckpt, "deeper", "--train.num_layers=2",
                    "--export.format=speculators"))
    with pytest.raises(ConfigError, match=r"intermediate_size 128 -> 96 \(train\.intermediate_size\)"):
        run(resumed(tmp_path, smol_prep, tiny_target, ckpt, "narrower", "--train.intermediate_size=96"))
    with pytest.raises(ConfigError, match=r"sliding_window 0 -> 4 \(train\.sliding_window\)"):
        run(resumed(tmp_path, smol_prep, tiny_target, ckpt, "windowed", "--train.sliding_window=4",
                    "--export.format=speculators"))
    with pytest.raises(ConfigError, match=r"sliding_window=4 with export.format='both'.*--export.format=speculators"):
        run(resumed(tmp_path, smol_prep, tiny_target, ckpt, "windowed_sglang", "--train.sliding_window=4"))


def test_a_checkpoint_of_other_data_or_vocabulary_is_refused(tmp_path, smol_prep, tiny_target):
    _, train_dir = four_steps(tmp_path, smol_prep, tiny_target)
    ckpt = train_dir / "checkpoints" / "step_0000002"
    before = {f.name: f.read_bytes() for f in ckpt.iterdir()}
    other = run_prepare(tmp_path / "other", write_synthetic_chats(tmp_path / "synthetic.jsonl", 16), max_length=128,
                        draft_vocab=512)
    with pytest.raises(ConfigError, match="trained on another draft vocabulary .*--train.init_from="):
        run(resumed(tmp_path, smol_prep, tiny_target, ckpt, "b", prep=other))
    assert {f.name: f.read_bytes() for f in ckpt.iterdir()} == before


def test_a_checkpoint_of_other_samples_in_the_same_vocabulary_is_refused(tmp_path, tiny_target):
    """The whole target vocabulary as the draft's (d2t 0, t2d all): the same vocabulary whatever the
    data, so only the samples (the same chats cut at another max_length) tell the two apart."""
    chats = write_sharegpt_chats(tmp_path / "chats.jsonl", 16)
    full = 49152  # SmolLM2's vocabulary
    first, shorter = (run_prepare(tmp_path / f"prep{n}", chats, max_length=n, draft_vocab=full) for n in (128, 120))
    cfg = tiny_cfg(tmp_path, first, tiny_target, "--train.mode=online", "--train.max_steps=2")
    run(cfg)
    ckpt = cfg.stage_dir("train") / "checkpoints" / "step_0000002"
    with pytest.raises(ConfigError, match=r"trained on other data \(14 samples, .*--train.init_from="):
        run(resumed(tmp_path, first, tiny_target, ckpt, "c", "--train.max_steps=2", prep=shorter))
    assert json.loads((ckpt / "identity.json").read_text())["num_samples"] == 14


@pytest.mark.parametrize("name", ["identity.json", "draft_config.json"])
def test_a_damaged_identity_or_draft_config_is_named_as_damaged_not_as_other_data(tmp_path, smol_prep, tiny_target, name):
    from eyas.errors import DamagedArtifact

    _, train_dir = four_steps(tmp_path, smol_prep, tiny_target, "--train.max_steps=2")
    ckpt = train_dir / "checkpoints" / "step_0000002"
    text = (ckpt / name).read_text()
    (ckpt / name).write_text(text[: len(text) // 2])  # cut: no longer JSON
    with pytest.raises(DamagedArtifact, match=f"step_0000002: {name} is damaged"):
        run(resumed(tmp_path, smol_prep, tiny_target, ckpt, "again"))


def test_a_new_train_loss_on_resume_is_recorded_as_a_change():
    """train.loss is a recorded setting: a resume with another loss lists it among the changes
    (the settings a checkpoint stores against those of the resuming run; no model needed)."""
    from types import SimpleNamespace

    from eyas.config.train import TrainConfig
    from eyas.train.resume import changes, settings

    sched = SimpleNamespace(seed=0, world=1, total=8)
    was = settings(TrainConfig(), sched)
    state = {"settings": was, "total_steps": 8, "world_size": 1,
             "optimizer": {"param_groups": [{"initial_lr": was["train.lr"], "betas": was["train.betas"],
                                             "weight_decay": was["train.weight_decay"]}]}}
    assert changes(state, settings(TrainConfig(loss="lk"), sched), 3) == [
        {"step": 3, "key": "train.loss", "from": "kl", "to": "lk"}]
    assert changes(state, settings(TrainConfig(), sched), 3) == []
