"""Resuming is safe with what a crash or a stranger leaves behind: a trainer.pt whose pickle would run
code is refused without running it; a torn last line of metrics.jsonl is cut off with a note, a
malformed line before it is an error naming file:line; a genuine checkpoint resumes bit-identically."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file

from eyas.errors import ArtifactError
from eyas.train import checkpoint, run
from tests.train.runs import read_metrics, tiny_cfg


class WritesAFile:
    """Unpickling this creates `marker`: what a hostile trainer.pt could do with any callable."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def four_steps(tmp_path, smol_prep, tiny_target, *extra):
    """A 4-step online run on the tiny target, logging and saving every step; -> (config, train dir)."""
    cfg = tiny_cfg(tmp_path, smol_prep, tiny_target, "--train.mode=online", "--train.max_steps=4",
                   "--train.save_every=1", "--train.keep_checkpoints=0", *extra)
    run(cfg)
    return cfg, cfg.stage_dir("train")


def resume_cfg(tmp_path, smol_prep, tiny_target, ckpt, out_dir):
    return tiny_cfg(tmp_path, smol_prep, tiny_target, "--train.mode=online", "--train.max_steps=4",
                    "--train.save_every=1", "--train.keep_checkpoints=0", f"--train.resume={ckpt}",
                    f"--train.out_dir={out_dir}")


def test_a_trainer_pt_whose_pickle_runs_code_is_refused_without_running_it(tmp_path, smol_prep, tiny_target):
    _, train_dir = four_steps(tmp_path, smol_prep, tiny_target)
    ckpt = train_dir / "checkpoints" / "step_0000002"
    trainer_pt = ckpt / checkpoint.TRAINER_STATE
    state = checkpoint.read_trainer_state(ckpt)
    marker = tmp_path / "pwned"
    state["note"] = WritesAFile(marker)  # every field resume needs is still there
    torch.save(state, trainer_pt)
    (ckpt / checkpoint.CHECKSUMS).unlink()  # from elsewhere: no checksums to catch the change (or matching ones)

    again = resume_cfg(tmp_path, smol_prep, tiny_target, ckpt, tmp_path / "again")
    with pytest.raises(ArtifactError, match=re.escape(str(trainer_pt)) + r".*--train.init_from=") as err:
        run(again)
    assert "io.open" in str(err.value)  # what it would have called
    assert not marker.exists()


def test_a_genuine_checkpoint_resumes_bit_identically(tmp_path, smol_prep, tiny_target):
    _, train_dir = four_steps(tmp_path, smol_prep, tiny_target)
    again = resume_cfg(tmp_path, smol_prep, tiny_target, train_dir / "checkpoints" / "step_0000002", tmp_path / "again")
    meta = run(again)
    assert meta["counts"]["resumed_from_step"] == 2
    ref, got = read_metrics(train_dir), read_metrics(tmp_path / "again")
    assert [r["step"] for r in got] == [3, 4]
    for a, b in zip(got, ref[2:]):
        assert (a["loss_T"], a["acc_T"], a["lr"], a["grad_norm"]) == (b["loss_T"], b["acc_T"], b["lr"], b["grad_norm"])
    want, have = load_file(str(train_dir / "final" / "draft.safetensors")), load_file(str(tmp_path / "again" / "final" / "draft.safetensors"))
    assert want.keys() == have.keys() and all(torch.equal(want[k], have[k]) for k in want)
    # the optimizer state it saves after the resumed steps is the original run's too
    a, b = (checkpoint.read_trainer_state(d / "checkpoints" / "step_0000004") for d in (train_dir, tmp_path / "again"))
    assert a["optimizer"]["state"].keys() == b["optimizer"]["state"].keys()
    for k, st in a["optimizer"]["state"].items():
        assert all(torch.equal(v, b["optimizer"]["state"][k][n]) for n, v in st.items())


def crashed_after_step_3(train_dir, tail: str) -> list[str]:
    """As if the run died writing step 4's record: steps 1-3 logged, `tail` after them, no step-4
    checkpoint, no final draft; -> the lines of steps 1-3."""
    lines = (train_dir / "metrics.jsonl").read_text().splitlines(keepends=True)
    assert [json.loads(ln)["step"] for ln in lines] == [1, 2, 3, 4]
    (train_dir / "metrics.jsonl").write_text("".join(lines[:3]) + tail)
    for done in ("checkpoints/step_0000004", "final"):
        shutil.rmtree(train_dir / done)
    (train_dir / "meta.json").unlink()
    return lines


@pytest.mark.parametrize("torn", ["half", "zeros"])
def test_a_torn_last_metrics_line_is_cut_off_with_a_note(tmp_path, smol_prep, tiny_target, capsys, torn):
    """A record cut short (kill or full disk mid-write), or the zeros a filesystem leaves after a power
    cut, at the end of metrics.jsonl: resume cuts it off, says so naming the file, and continues."""
    cfg, train_dir = four_steps(tmp_path, smol_prep, tiny_target)
    lines = (train_dir / "metrics.jsonl").read_text().splitlines(keepends=True)
    tail = lines[3][: len(lines[3]) // 2] if torn == "half" else "\0" * 64
    crashed_after_step_3(train_dir, tail)
    capsys.readouterr()

    cfg.train.resume = "auto"
    meta = run(cfg)
    assert meta["counts"]["resumed_from_step"] == 3
    out = capsys.readouterr().out
    assert re.search(re.escape(str(train_dir / "metrics.jsonl")) + r":4 .*cut off", out), out
    # steps 1-3 kept as they were, step 4 logged again by the resumed run
    assert (train_dir / "metrics.jsonl").read_text().splitlines(keepends=True)[:3] == lines[:3]
    assert [r["step"] for r in read_metrics(train_dir)] == [1, 2, 3, 4]


def test_a_malformed_metrics_line_before_the_last_names_file_and_line(tmp_path, smol_prep, tiny_target):
    cfg, train_dir = four_steps(tmp_path, smol_prep, tiny_target)
    lines = crashed_after_step_3(train_dir, "")
    path = train_dir / "metrics.jsonl"
    path.write_text(lines[0] + lines[1][:20] + "\n" + lines[2])

    cfg.train.resume = "auto"
    with pytest.raises(ArtifactError, match=re.escape(f"{path}:2")):
        run(cfg)
    assert path.read_text() == lines[0] + lines[1][:20] + "\n" + lines[2]  # left as it was, for the user to fix


def test_a_whole_last_record_without_its_newline_is_kept(tmp_path, capsys):
    """Only a record that does not parse is torn: one complete but for its newline is kept (and given one)."""
    from eyas.train.loop import metrics_up_to

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "split": "train"}\n\n{"step": 2, "split": "eval"}\n{"step": 3, "split": "train"}')
    assert metrics_up_to(path, 2) == ['{"step": 1, "split": "train"}', '{"step": 2, "split": "eval"}']
    assert metrics_up_to(path, 3)[-1] == '{"step": 3, "split": "train"}' and capsys.readouterr().out == ""
