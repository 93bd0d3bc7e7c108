"""Provenance cells: what the records say is what ran. A standalone regenerate into answers of other
inputs, a resume with a changed learning rate or more steps, a resume from another run's checkpoint
or into another draft shape, a recipe with a section twice: each either applies and records the
change or is refused (exit 2) naming it, leaving what was there as it was."""

from __future__ import annotations

import json
import math
from pathlib import Path

from tests.fault_matrix import Case


def _files(d: Path) -> dict[str, bytes]:
    """Every file under `d` with its bytes, but the lock each command that writes there rewrites."""
    return {str(f.relative_to(d)): f.read_bytes() for f in sorted(d.rglob("*")) if f.is_file() and f.name != ".eyas.lock"}


def _stage_args(m, run: Path, *extra: str) -> list[str]:
    """The reference run's settings for a standalone stage command (`eyas STAGE ARGS`)."""
    return [*m.run_args(run)[1:], *extra]


def regenerate_other_inputs(m, work: Path, rng) -> tuple[bool, str]:
    """`eyas regenerate` (the server backend) into a finished run's answers with another data file,
    server model or temperature: refused, naming the change, the answers and their records untouched."""
    server, served = m._server()
    try:
        run = m.finished_run(work, "run", *served)
        before = _files(run / "regenerate")
        lines = m.chats.read_text().splitlines(keepends=True)
        other = work / "other.jsonl"
        other.write_text("".join(rng.sample(lines, len(lines) - 1)))  # one conversation fewer, in another order
        said = []
        for extra, key in [((f"--prepare.data={other}",), "prepare.data"),
                           (("--regenerate.server_model=other-model",), "regenerate.server_model"),
                           (("--regenerate.temperature=0.7",), "regenerate.temperature")]:
            rc, out = m.eyas(["regenerate", *_stage_args(m, run, *served, *extra)], work / f"{key}.log")
            if rc != 2 or key not in out or _files(run / "regenerate") != before:
                return False, f"{key} changed: exit {rc}, {'named' if key in out else 'not named'}, answers " \
                              f"{'kept' if _files(run / 'regenerate') == before else 'changed'}"
            said.append(key)
        return True, f"refused (exit 2) naming {', '.join(said)}; the answers and meta.json untouched"
    finally:
        server.__exit__(None, None, None)


def _changes(train_dir: Path) -> list[dict]:
    return json.loads((train_dir / "meta.json").read_text()).get("changes") or []


def _lrs(train_dir: Path) -> dict[int, float]:
    recs = [json.loads(ln) for ln in (train_dir / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    return {r["step"]: r["lr"] for r in recs if r["split"] == "train"}


def _cosine(lr: float, step: int, total: int) -> float:
    """The lr of step `step` (1-based) of a `total`-step cosine schedule to 0 without warmup."""
    return lr * 0.5 * (1 + math.cos(math.pi * (step - 1) / total))


def train_resume_changed_schedule(m, work: Path, rng) -> tuple[bool, str]:
    """`eyas train --train.resume=CHECKPOINT` with 10x the lr, and one step past the finished
    schedule (a second epoch): both apply (the lr logged is the new schedule's, never 0) and
    meta.json records each change."""
    run = m.finished_run(work)
    first, last = sorted((run / "train" / "checkpoints").glob("step_*"))[-2:]
    n, total = int(first.name[5:]), int(last.name[5:])  # the data makes fewer steps than max_steps=12
    lr = 1e-3  # the reference's is TrainConfig's 1e-4
    rc, out = m.eyas(["train", *_stage_args(m, run, f"--train.resume={first}", f"--train.lr={lr}",
                                            f"--train.out_dir={work / 'lr'}")], work / "lr.log")
    got = _lrs(work / "lr") if rc == 0 else {}
    want = {"step": n, "key": "train.lr", "from": 1e-4, "to": lr}
    if rc != 0 or want not in _changes(work / "lr") or abs(got.get(total, 0) - _cosine(lr, total, total)) > 1e-12:
        return False, f"lr 1e-4 -> {lr} on resume at step {n}: exit {rc}, lr at step {total} {got.get(total)} (want " \
                      f"{_cosine(lr, total, total):.3g}), changes {_changes(work / 'lr') if rc == 0 else out[-300:]}"
    rc, out = m.eyas(["train", *_stage_args(m, run, f"--train.resume={last}", "--train.epochs=2",
                                            f"--train.max_steps={total + 1}", f"--train.out_dir={work / 'longer'}")],
                     work / "longer.log")
    got = _lrs(work / "longer") if rc == 0 else {}
    want = {"step": total, "key": "schedule.total_steps", "from": total, "to": total + 1}
    if rc != 0 or abs(got.get(total + 1, 0) - _cosine(1e-4, total + 1, total + 1)) > 1e-12 \
            or want not in _changes(work / "longer"):
        return False, f"one step past the {total}-step schedule on resume: exit {rc}, lr at step {total + 1} " \
                      f"{got.get(total + 1)}: {out.strip()[-300:]}"
    return True, (f"lr 1e-4 -> {lr} at step {n}: step {total} trained at {_lrs(work / 'lr')[total]:.3g}, recorded; "
                  f"{total} -> {total + 1} steps: step {total + 1} at lr {got[total + 1]:.3g} (not 0), recorded")


def train_resume_other_run(m, work: Path, rng) -> tuple[bool, str]:
    """`--train.resume` of a finished run's checkpoint in a run on other data (a prepare of fewer
    conversations, online), and into a narrower draft: refused, exit 2, naming what differs."""
    run = m.finished_run(work)
    ckpt = sorted((run / "train" / "checkpoints").glob("step_*"))[-1]
    before = _files(ckpt)
    other = work / "other"
    keep = rng.randint(30, 40)
    rc, out = m.eyas(["prepare", *_stage_args(m, other, f"--prepare.max_conversations={keep}")], work / "prepare.log")
    if rc != 0:
        return False, f"the other run's prepare failed: exit {rc}: {out.strip()[-300:]}"
    rc, out = m.eyas(["train", *_stage_args(m, other, "--train.mode=online", f"--train.resume={ckpt}")],
                     work / "other.log")
    if rc != 2 or "--train.init_from" not in out or not ("other data" in out or "another draft vocabulary" in out):
        return False, f"another run's checkpoint ({keep} of 48 conversations): exit {rc}: {out.strip()[-300:]}"
    rc2, out2 = m.eyas(["train", *_stage_args(m, run, f"--train.resume={ckpt}", "--train.intermediate_size=96",
                                              f"--train.out_dir={work / 'narrow'}")], work / "narrow.log")
    if rc2 != 2 or "train.intermediate_size" not in out2 or _files(ckpt) != before:
        return False, f"a narrower draft on resume: exit {rc2}: {out2.strip()[-300:]}"
    why = "other data" if "other data" in out else "another draft vocabulary"
    return True, f"another run's checkpoint refused ({why}, exit 2); a narrower draft refused naming train.intermediate_size"


def recipe_section_twice(m, work: Path, rng) -> tuple[bool, str]:
    """A recipe with two `train:` sections: refused naming both lines before anything runs."""
    recipe = work / "recipe.yaml"
    first = "train:\n  lr: 1.0e-3\n"
    recipe.write_text(first + "prepare:\n  max_length: 128\n" + "train:\n  lr: 1.0e-2\n")
    run = work / "run"
    rc, out = m.eyas(["run", str(recipe), *m.run_args(run)[1:], "--stop_after=prepare"], work / "run.log")
    named = f"{recipe}:1" in out and f"{recipe}:5" in out
    if rc != 2 or not named or (run / "prepare").exists():
        return False, f"exit {rc}, both lines {'named' if named else 'not named'}: {out.strip()[-300:]}"
    return True, "refused (exit 2) naming recipe.yaml:1 and :5, nothing run"


CASES = [
    Case("provenance", "regenerate-other-inputs", regenerate_other_inputs, "regenerate"),
    Case("provenance", "train-resume-changed-schedule", train_resume_changed_schedule, "train"),
    Case("provenance", "train-resume-other-run", train_resume_other_run, "train"),
    Case("provenance", "recipe-section-twice", recipe_section_twice, "run"),
]
