"""A training that cannot teach the draft anything stops, with the numbers, instead of exporting it:

* a learning rate of 1e4 kills the draft within a step or two (gradient norm exactly 0, loss frozen;
  at 1e5 and more the gradient turns NaN first, which stops training as before): training stops at
  train.collapse_steps, naming the steps, the loss, the accuracy and train.lr;
* the counting itself, on hand-made windows (a window without trained positions is no collapse);
* data that makes fewer than FEW_STEPS optimizer steps is refused unless train.max_steps asks for
  that few; each logged lr is the one its step used (the first step of a warmup, not the next);
* a run whose draft ends bit-identical to its start fails;
* a train.max_tokens so small that every row is cut before its first assistant token (nothing is
  trained) is said so, naming --train.max_tokens, not blamed on the learning rate; so is a memory
  limit hit in the steps (a real one: RLIMIT_AS), not left as the allocator's words alone.
"""

from __future__ import annotations

import json

import pytest

from eyas.errors import EyasError
from eyas.train import main as train
from eyas.train.loop import CollapseWatch, TrainingCollapsed
from tests.train.runs import tiny_cfg


def rec(loss: float, acc0: float = 0.0, valid: int = 10) -> dict:
    return {"loss": loss, "acc_T": [acc0, 0.0], "valid_T": [valid, valid]}


def test_the_watch_counts_zero_gradients_and_frozen_losses_in_a_row():
    w = CollapseWatch(limit=4, total=100, lr=1e6)
    w.check(2, [0.6, 0.0], rec(11.39))  # one dead step
    w.check(4, [0.0, 0.0], rec(11.18))  # three in a row
    with pytest.raises(TrainingCollapsed, match=r"step 6: the gradient norm was exactly 0 over the last 5 steps.*train.lr=1e\+06"):
        w.check(6, [0.0, 0.0], rec(11.18))
    w = CollapseWatch(limit=4, total=100, lr=1.0)
    w.check(2, [0.1, 0.1], rec(7.5))
    w.check(4, [0.1, 0.1], rec(7.5, acc0=0.2))  # frozen but accurate: not counted
    w.check(6, [0.1, 0.1], rec(7.5))  # the same loss as the window before, at accuracy 0: two steps
    with pytest.raises(TrainingCollapsed, match="step 8: the loss stayed at 7.5 with step-0 accuracy 0 over the last 4"):
        w.check(8, [0.1, 0.1], rec(7.5000001))  # within 1e-7: frozen
    w = CollapseWatch(limit=3, total=100, lr=1.0)
    for done in (1, 2, 3, 4):
        w.check(done, [0.0], rec(5.0 + done, valid=0))  # nothing trained in these windows: a zero gradient is right
    assert CollapseWatch(limit=0, total=10, lr=1.0).check(1, [0.0] * 50, rec(1.0)) is None  # off
    short = CollapseWatch(limit=10, total=6, lr=1.0)  # a run shorter than the limit: its second half judges
    for done in (1, 2, 3, 4, 5):
        short.check(done, [0.5 if done == 1 else 0.0], rec(9.0 - done * 0.1))
    with pytest.raises(TrainingCollapsed, match="over the last 5 steps"):
        short.check(6, [0.0], rec(8.0))


def test_a_huge_learning_rate_stops_training_with_the_numbers(tmp_path, smol_prep, tiny_target):
    cfg = tiny_cfg(tmp_path, smol_prep, tiny_target, "--train.mode=online", "--train.lr=1e4", "--train.epochs=20",
                   "--train.ttt_steps=2")
    with pytest.raises(TrainingCollapsed) as e:
        train(cfg)
    msg = str(e.value)
    assert "the gradient norm was exactly 0 over the last 10 steps" in msg and "train.lr=10000" in msg
    steps = [json.loads(line) for line in (tmp_path / "train" / "metrics.jsonl").read_text().splitlines()]
    assert len(steps) < 20 and steps[-1]["grad_norm"] == 0.0  # stopped early, not at the end of 20 epochs
    assert not (tmp_path / "train" / "meta.json").exists() and (tmp_path / "train" / "errors.jsonl").is_file()


def test_few_steps_are_refused_unless_asked_for_and_the_logged_lr_is_the_steps_own(tmp_path, smol_prep, tiny_target):
    with pytest.raises(EyasError, match=r"only \d optimizer step\(s\).*--train.max_steps to train that few steps on purpose"):
        train(tiny_cfg(tmp_path / "a", smol_prep, tiny_target, "--train.mode=online", "--train.max_tokens=4096"))
    train(tiny_cfg(tmp_path / "b", smol_prep, tiny_target, "--train.mode=online", "--train.max_steps=4", "--train.warmup_ratio=0.5",
                   "--train.min_lr_ratio=0"))
    lrs = [json.loads(line)["lr"] for line in (tmp_path / "b" / "train" / "metrics.jsonl").read_text().splitlines()]
    assert lrs[0] == pytest.approx(0.5e-3) and lrs[1] == pytest.approx(1e-3)  # warmup 2 steps: 1/2, 2/2 of 1e-3
    assert lrs[-1] > 0  # the last step's own lr, not the 0 after it


def test_a_draft_that_did_not_change_fails_the_run(tmp_path, smol_prep, tiny_target):
    """At lr 1e-30 every update rounds away in fp32: three steps, the same draft."""
    with pytest.raises(TrainingCollapsed, match=r"the draft did not change in 3 optimizer steps \(train.lr=1e-30"):
        train(tiny_cfg(tmp_path, smol_prep, tiny_target, "--train.mode=online", "--train.max_steps=3", "--train.lr=1e-30"))


def test_the_watch_says_when_no_window_trained_a_position():
    w = CollapseWatch(limit=3, total=100, lr=1e-4, max_tokens=8)
    for done in (1, 2, 3):
        w.check(done, [0.0], rec(0.0, valid=0))  # a frozen loss at accuracy 0, but nothing was trained
    with pytest.raises(TrainingCollapsed, match=r"step 4: no position was trained .*train\.max_tokens=8.*Raise --train\.max_tokens"):
        w.check(4, [0.0], rec(0.0, valid=0))
    w = CollapseWatch(limit=3, total=100, lr=1e-4, max_tokens=8)
    w.check(1, [0.0], rec(0.0, valid=2))
    assert w.nothing_trained(1) == ""


def test_rows_cut_before_any_assistant_token_are_blamed_on_max_tokens_not_the_lr(tmp_path, smol_prep, tiny_target):
    """train.max_tokens=8: every sample cut to its first 8 tokens (the template's system prompt), no
    position trained, the draft unchanged."""
    with pytest.raises(TrainingCollapsed) as e:
        train(tiny_cfg(tmp_path, smol_prep, tiny_target, "--train.mode=online", "--train.max_steps=3", "--train.max_tokens=8"))
    assert "no position was trained in 3 optimizer steps" in str(e.value) and "--train.max_tokens" in str(e.value)
    assert "train.lr" not in str(e.value)


@pytest.mark.slow  # a subprocess that loads torch and trains: ~11 s
@pytest.mark.parametrize("margin_mib", [64])
def test_a_memory_limit_hit_in_the_steps_names_train_max_tokens(tmp_path, smol_prep, tiny_target, margin_mib):
    """A real allocation failure: the address space limited (RLIMIT_AS, tests/train/memory_limit.py)
    to what the process maps when training starts plus a little; the steps of 2048-token micro-batches
    need more. Exit 2 naming --train.max_tokens and its value, not the allocator's words alone."""
    import subprocess
    import sys
    from pathlib import Path

    helper = Path(__file__).with_name("memory_limit.py")
    proc = subprocess.run([sys.executable, str(helper), str(margin_mib), "train", f"--run_dir={tmp_path}",
                           f"--prepare.out_dir={smol_prep}", f"--target.model={tiny_target}", "--train.mode=online",
                           "--train.ttt_steps=3", "--train.max_tokens=2048", "--train.max_steps=2",
                           "--train.eval_fraction=0"], capture_output=True, text=True, timeout=300, check=False)
    out = proc.stdout + proc.stderr
    assert "[memory_limit] RLIMIT_AS" in out, out[-3000:]
    assert proc.returncode == 2, out[-3000:]
    assert "eyas train: error: train ran out of memory in its steps" in out and "lower --train.max_tokens (now 2048" in out
