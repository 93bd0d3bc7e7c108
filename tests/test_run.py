"""`eyas run`: every stage end to end on a tiny slice (real ShareGPT records, the real SmolLM2
tokenizer and chat template, a tiny random-weight Llama target; first up to `--stop_after=prepare`,
then the rest), then the skip logic: an unchanged second run skips every stage; a changed training
key re-runs train, export and evaluate only."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from eyas.cli import main as cli
from eyas.run.ranks import DIE_WITH_PARENT
from tests.data import write_synthetic_chats
from tests.faults import Poison, poison_backend
from tests.models import save_tiny


def recipe(tmp_path, target):
    y = tmp_path / "recipe.yaml"
    y.write_text(f"""# eyas run {y}
run_dir: {tmp_path / 'run'}
target: {{model: {target}, dtype: float32}}
regenerate: {{enabled: true, max_new_tokens: 8, max_prompt_tokens: 192, batch_size: 8}}
prepare: {{max_conversations: 8, max_length: 128, draft_vocab_size: 500}}
extract: {{verify: 2}}
train: {{max_steps: 3, ttt_steps: 2, max_tokens: 512, log_every: 1, eval_fraction: 0.0}}
evaluate: {{num_questions: 1, max_new_tokens: 8, mode: both, num_draft_tokens: 3, tree_total_tokens: 8, tree_depth: 3, tree_top_k: 2}}
""")
    return y


def stages_line(out: str) -> dict[str, str]:
    status = {}
    for line in out.splitlines():
        if line.startswith("[eyas:run] ") and ":" in line[11:]:
            stage, rest = line[11:].split(":", 1)
            if "skipped" in rest:
                status[stage] = "skipped"
            elif rest.strip().startswith(("running", "resuming")):
                status[stage] = "ran"
    return status


@pytest.mark.slow
def test_run_end_to_end_then_skips(tmp_path, smollm2_dir, capsys):
    target = save_tiny("llama", tmp_path / "tiny", smollm2_dir)
    y = recipe(tmp_path, target)
    run = tmp_path / "run"
    everything = ["regenerate", "prepare", "extract", "train", "export", "evaluate"]
    assert cli(["run", str(y), "--stop_after=prepare"]) == 0  # a job with a time limit ends here
    out = capsys.readouterr().out
    assert stages_line(out) == {"regenerate": "ran", "prepare": "ran"} and "stop_after=prepare" in out
    assert not (run / "extract").exists() and not (run / "summary.json").exists()
    assert cli(["run", str(y)]) == 0
    out = capsys.readouterr().out
    assert stages_line(out) == {"regenerate": "skipped", "prepare": "skipped", **{s: "ran" for s in everything[2:]}}
    summary = json.loads((run / "summary.json").read_text())
    assert list(summary["stages"]) == everything
    assert summary["lossless"] is True and summary["tau_chain"] >= 1.0 and summary["tau_tree"] >= 1.0
    results = json.loads((run / "evaluate" / "results.json").read_text())
    for mode in ("chain", "tree"):  # each mode's own per-position acceptance and speedup, printed by mode
        assert summary[f"acceptance_per_position_{mode}"] == results["modes"][mode]["acceptance_per_position"]
        assert summary[f"speedup_{mode}"] == results["modes"][mode]["speedup"] > 0
        assert re.search(rf"^  {mode} +tau {summary[f'tau_{mode}']:.3f}  speedup .*P\(accept \| reached\)", out, re.M)
    assert summary["acceptance_per_position"] == summary["acceptance_per_position_tree"]  # the primary mode
    assert summary["stages"]["extract"]["tokens_per_s"] > 0 and summary["stages"]["train"]["tokens_per_s"] > 0
    for s in everything:
        assert json.loads((run / s / "meta.json").read_text())["run_key"]
    assert (run / "export" / "sglang" / "config.json").is_file() and (run / "export" / "speculators" / "config.json").is_file()
    assert (run / "train" / "plots").is_dir() and (run / "run.log").stat().st_size > 0
    # prepare read the regenerated conversations
    assert json.loads((run / "prepare" / "meta.json").read_text())["config"]["prepare"]["data"].endswith("conversations.jsonl")

    assert cli(["run", str(y)]) == 0
    assert stages_line(capsys.readouterr().out) == {s: "skipped" for s in everything}

    assert cli(["run", str(y), "--train.lr=2e-4"]) == 0
    status = stages_line(capsys.readouterr().out)
    assert status == {"regenerate": "skipped", "prepare": "skipped", "extract": "skipped",
                      "train": "ran", "export": "ran", "evaluate": "ran"}

    # a bench file evaluate would refuse: refused before any stage runs (the preflight reads it), naming its
    # line; every output stays as it was (a stage that fails is in summary.json: test_run_stops_when_extract_drops_samples_then_retries_them)
    bad = tmp_path / "bad_bench.jsonl"
    bad.write_text('{"turns": []}\n')
    before = {s: (run / s / "meta.json").read_bytes() for s in everything}
    assert cli(["run", str(y), "--train.lr=3e-4", f"--evaluate.bench={bad}"]) == 2
    assert "bad_bench.jsonl:1" in capsys.readouterr().err
    assert {s: (run / s / "meta.json").read_bytes() for s in everything} == before


@pytest.mark.slow
def test_run_with_every_stage_directory_moved(tmp_path, smollm2_dir, capsys):
    """Every stage's out_dir outside RUN_DIR: each stage reads the one before it where that one
    wrote; export exports the draft of the moved train directory and evaluate evaluates it; RUN_DIR
    keeps only the run's log and summary; the same command again skips every stage."""
    target = save_tiny("llama", tmp_path / "tiny", smollm2_dir)
    y = str(recipe(tmp_path, target))
    run = tmp_path / "run"
    everything = ["regenerate", "prepare", "extract", "train", "export", "evaluate"]
    dirs = {s: tmp_path / "elsewhere" / f"my-{s}" for s in everything}
    moved = [f"--{s}.out_dir={d}" for s, d in dirs.items()]
    assert cli(["run", y, *moved]) == 0
    assert stages_line(capsys.readouterr().out) == {s: "ran" for s in everything}
    assert sorted(p.name for p in run.iterdir()) == [".eyas.lock", "run.log", "summary.json"]
    summary = json.loads((run / "summary.json").read_text())
    assert {s: summary["stages"][s]["dir"] for s in everything} == {s: str(d) for s, d in dirs.items()}
    assert summary["lossless"] is True
    meta = {s: json.loads((d / "meta.json").read_text()) for s, d in dirs.items()}
    assert meta["prepare"]["config"]["prepare"]["data"] == str(dirs["regenerate"] / "conversations.jsonl")
    assert meta["train"]["inputs"]["prepare"]["dir"] == str(dirs["prepare"])
    assert meta["train"]["inputs"]["extract"]["dir"] == str(dirs["extract"])
    assert meta["export"]["inputs"]["checkpoint"] == str(dirs["train"] / "final")
    assert meta["evaluate"]["draft"] == str(dirs["train"] / "final")
    assert json.loads((dirs["evaluate"] / "results.json").read_text())["settings"]["draft"] == str(dirs["train"] / "final")
    assert (dirs["export"] / "speculators" / "config.json").is_file() and (dirs["train"] / "plots").is_dir()
    assert cli(["run", y, *moved]) == 0
    assert stages_line(capsys.readouterr().out) == {s: "skipped" for s in everything}


def torchrun_eyas(*args, timeout=600):
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "eyas.cli", *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_run_under_torchrun_extracts_and_trains_on_every_rank_and_keeps_one_process_bookkeeping(
        tmp_path, smollm2_dir, capsys):
    """`torchrun --nproc-per-node 2 -m eyas run`: extract and train on both ranks, the other stages on
    rank 0; the run keys are one process's (a plain `eyas run` afterwards skips every stage); a
    failure of rank 0 in a stage of its own stops the other rank too, non-zero and saying why."""
    target = save_tiny("llama", tmp_path / "tiny", smollm2_dir)
    y = str(recipe(tmp_path, target))
    run = tmp_path / "run"
    everything = ["regenerate", "prepare", "extract", "train", "export", "evaluate"]
    res = torchrun_eyas("run", y)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    assert "[eyas:run] torchrun: 2 ranks" in res.stdout
    assert stages_line(res.stdout) == {s: "ran" for s in everything}
    assert counts(run, "extract")["this_run"]["world_size"] == 2 and counts(run, "train")["world_size"] == 2
    extracted = counts(run, "extract")
    assert extracted["samples"] == counts(run, "prepare")["conversations_kept"] and not extracted["failed"]
    summary = json.loads((run / "summary.json").read_text())
    assert list(summary["stages"]) == everything and summary["lossless"] is True and summary["tau_chain"] >= 1.0
    assert "[eyas:run] torchrun" in (run / "run.log").read_text()  # rank 0's log, written once
    assert (run / "run.log").read_text().count("[eyas:run] evaluate: running") == 1
    follower = (run / "run.rank1.log").read_text()  # rank 1's own log: the stages it ran, nothing else of the run's
    assert "[eyas:run] rank 1: extract" in follower and "[eyas:run] rank 1: train" in follower
    assert "evaluate" not in follower and "prepare" not in follower

    assert cli(["run", y]) == 0
    assert stages_line(capsys.readouterr().out) == {s: "skipped" for s in everything}

    bad = tmp_path / "bad_bench.jsonl"
    bad.write_text('{"turns": []}\n')
    res = torchrun_eyas("run", y, "--train.lr=2e-4", f"--evaluate.bench={bad}")  # refused by rank 0's preflight
    assert res.returncode != 0
    out = res.stdout + res.stderr
    assert stages_line(res.stdout) == {}
    assert "bad_bench.jsonl:1" in out and "rank 1: rank 0's run stopped with an error after the last stage the ranks ran together" in out
    assert counts(run, "train")["world_size"] == 2


def counts(run, stage):
    return json.loads((run / stage / "meta.json").read_text())["counts"]


@pytest.mark.slow
def test_run_continues_partial_stages(tmp_path, smollm2_dir, capsys):
    """A stage stopped at its time budget continues when the run is repeated (its budget is not part
    of the key, so a new budget does not start it over), the stages after it then run on the new
    output; --accept_partial=STAGE takes the partial output as it is."""
    target = save_tiny("llama", tmp_path / "tiny", smollm2_dir)
    y = str(recipe(tmp_path, target))
    run = tmp_path / "run"
    slot = ["--regenerate.chunk_conversations=2", "--regenerate.max_seconds=1e-6"]  # one chunk per run
    assert cli(["run", y, *slot, "--stop_after=regenerate"]) == 0
    assert counts(run, "regenerate")["conversations_written"] == 2 and counts(run, "regenerate")["stopped_early"]
    capsys.readouterr()
    assert cli(["run", y, "--regenerate.chunk_conversations=2", "--regenerate.max_seconds=2e-6", "--stop_after=regenerate"]) == 0
    out = capsys.readouterr().out
    assert "regenerate: partial (2 of 8 conversations" in out and stages_line(out) == {"regenerate": "ran"}
    assert counts(run, "regenerate")["resumed_from"] == 2 and counts(run, "regenerate")["conversations_written"] == 4

    assert cli(["run", y, *slot, "--accept_partial=regenerate", "--stop_after=prepare"]) == 0
    out = capsys.readouterr().out
    assert "partial output accepted (4 of 8 conversations)" in out
    assert stages_line(out) == {"regenerate": "skipped", "prepare": "ran"}
    assert counts(run, "prepare")["records"] == 4

    # regenerate continued in a run that stops right after it: the next run still knows prepare
    # was made from 4 conversations, not the 6 there are now
    assert cli(["run", y, *slot, "--stop_after=regenerate"]) == 0
    assert counts(run, "regenerate")["conversations_written"] == 6
    capsys.readouterr()
    assert cli(["run", y, *slot, "--accept_partial=regenerate", "--stop_after=prepare"]) == 0
    out = capsys.readouterr().out
    assert stages_line(out) == {"regenerate": "skipped", "prepare": "ran"} and "inputs changed" in out
    assert counts(run, "prepare")["records"] == 6

    # the rest of regenerate: prepare is out of date although its settings did not change
    assert cli(["run", y, "--regenerate.chunk_conversations=2", "--stop_after=prepare"]) == 0
    out = capsys.readouterr().out
    assert stages_line(out) == {"regenerate": "ran", "prepare": "ran"} and "inputs changed" in out
    regen = counts(run, "regenerate")
    assert (regen["resumed_from"], regen["not_started"], regen["stopped_early"]) == (6, 0, False)
    assert counts(run, "prepare")["records"] == regen["conversations_written"] > 4

    # train stopped at its budget (first logging step) resumes from its checkpoint on the next run
    train = ["--regenerate.chunk_conversations=2", "--train.epochs=4", "--train.max_steps=4", "--stop_after=train"]
    assert cli(["run", y, *train, "--train.max_seconds=1e-6"]) == 0
    assert (counts(run, "train")["steps"], counts(run, "train")["stopped_early"]) == (1, True)
    capsys.readouterr()
    assert cli(["run", y, *train, "--train.max_seconds=1e-6", "--train.resume=auto", "--train.num_workers=0"]) == 0
    out = capsys.readouterr().out  # how train runs (resume, workers) is not part of its key: nothing removed
    assert "train: partial (1 of 4 steps" in out and "resuming from" in out and "removing" not in out
    assert stages_line(out) == {"regenerate": "skipped", "prepare": "skipped", "extract": "skipped", "train": "ran"}
    assert counts(run, "train")["steps"] == 2
    assert cli(["run", y, *train, "--train.max_seconds=1e-6", "--accept_partial=regenerate,train"]) == 0
    assert stages_line(capsys.readouterr().out)["train"] == "skipped" and counts(run, "train")["steps"] == 2
    capsys.readouterr()
    assert cli(["run", y, *train[:-1]]) == 0  # and on to the summary
    assert (counts(run, "train")["steps"], counts(run, "train")["stopped_early"]) == (4, False)
    # the stage's wall time and rate are the last run's; what the three runs did together is beside them
    total = json.loads((run / "summary.json").read_text())["stages"]["train"]["all_runs"]
    assert (total["runs"], total["steps"]) == (3, 4) and total["seconds"] > 0
    assert "over 3 runs: 4 steps" in capsys.readouterr().out
    steps = [json.loads(ln)["step"] for ln in (run / "train" / "metrics.jsonl").read_text().splitlines()
             if json.loads(ln)["split"] == "train"]
    assert steps == [1, 2, 3, 4]  # one curve, no step twice


def test_edited_data_file_reruns_the_first_stage(tmp_path, smollm2_dir, capsys):
    """The first stage's input is the data file's content, not its path: the same path edited
    re-runs it (and so every stage after it); a missing file is a ConfigError before anything runs."""
    from eyas.errors import ConfigError

    y = str(recipe(tmp_path, smollm2_dir))
    run, data = tmp_path / "run", tmp_path / "chats.jsonl"

    def write(n):
        data.write_text("".join(json.dumps({"id": f"c{i}", "messages": [
            {"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": f"answer {i}"}]}) + "\n"
            for i in range(n)))

    write(3)
    args = ["run", y, "--regenerate.enabled=false", f"--prepare.data={data}", "--stop_after=prepare"]
    assert cli(args) == 0
    capsys.readouterr()
    assert cli(args) == 0
    assert stages_line(capsys.readouterr().out) == {"prepare": "skipped"}
    write(4)
    assert cli(args) == 0
    out = capsys.readouterr().out
    assert stages_line(out) == {"prepare": "ran"} and f"{data} is not the file it was made from" in out
    assert counts(run, "prepare")["records"] == 4
    # the data's fingerprint is what prepare's output records as its input
    meta = json.loads((run / "prepare" / "meta.json").read_text())
    assert meta["upstream"].startswith("data:")
    data.unlink()
    with pytest.raises(ConfigError, match="no such file"):
        from eyas.config import load_config
        from eyas.run import main as run_main

        run_main(load_config(y, args[2:]))


@pytest.mark.slow
def test_run_stops_when_extract_drops_samples_then_retries_them(tmp_path, smollm2_dir, capsys, monkeypatch):
    """extract skipping a failed sample (within max_failures) stops the run (exit 2, summary.json
    says so); the next run retries that sample, or goes on without it under allow_failures
    without extracting again."""
    from eyas.prepared import Prepared

    target = save_tiny("llama", tmp_path / "tiny", smollm2_dir)
    y = str(recipe(tmp_path, target))
    run = tmp_path / "run"
    assert cli(["run", y, "--stop_after=prepare"]) == 0
    samples = sorted(Prepared(run / "prepare"), key=lambda r: len(r["input_ids"]))
    bad = samples[len(samples) // 2]  # the smoke test runs the shortest
    poison_backend(monkeypatch, Poison(ValueError("poisoned sample"), bad["input_ids"]))
    args = ["run", y, "--extract.max_failures=1", "--stop_after=train", "--train.max_steps=1"]
    assert cli(args) == 2
    summary = json.loads((run / "summary.json").read_text())
    assert summary["failed_stage"] == "extract" and "status 1" in summary["stages"]["extract"]["error"]["message"]
    assert not (run / "train").exists()
    capsys.readouterr()
    assert cli([*args, "--extract.allow_failures=true"]) == 0
    assert stages_line(capsys.readouterr().out)["extract"] == "skipped"
    assert counts(run, "extract")["failed"] == [bad["id"]]
    monkeypatch.undo()
    assert cli(args) == 0
    out = capsys.readouterr().out
    assert "1 sample(s) failed last time: retrying them" in out and stages_line(out)["extract"] == "ran"
    assert counts(run, "extract")["failed"] == []


def test_online_training_plans_no_extract_stage(tmp_path):
    from eyas.config import load_config
    from eyas.run.plan import run_keys, stage_plan

    y = recipe(tmp_path, "unused-target")
    offline = stage_plan(load_config(str(y), []))[1]
    configs, online = stage_plan(load_config(str(y), ["--train.mode=online"]))
    assert offline == ["regenerate", "prepare", "extract", "train", "export", "evaluate"]
    assert online == ["regenerate", "prepare", "train", "export", "evaluate"]
    keys = run_keys(configs, online)  # train's key chains from prepare's, and differs from offline's
    assert keys["train"] != run_keys(*stage_plan(load_config(str(y), [])))["train"]
    from eyas.errors import ConfigError
    from eyas.run import main as run

    with pytest.raises(ConfigError, match="no extract stage"):  # not: every stage runs and never stops
        run(load_config(str(y), ["--train.mode=online", "--stop_after=extract"]))


def test_a_key_that_changes_the_draft_reruns_train_and_what_follows_not_extract(tmp_path):
    """train.num_layers, align_top_k, init_from, align_norm, init_vocab, init_head and loss change the
    draft: train's key, and export's and evaluate's after it, change while extract's does not;
    init_vocab=remap differs from init_from alone; evaluate.target_outputs changes evaluate's key only;
    in online training extract.layer_ids (the aux layers it captures) changes train's key."""
    import eyas.run.plan as r
    from eyas.config import load_config

    y = recipe(tmp_path, "unused-target")
    keys = r.run_keys(*r.stage_plan(load_config(str(y), [])))
    changed = [r.run_keys(*r.stage_plan(load_config(str(y), args))) for args in
               (["--train.num_layers=2", "--export.format=speculators"], ["--train.align_top_k=1"],
                ["--train.init_from=/drafts/a"], ["--train.align_top_k=3", "--train.align_norm=kept"],
                ["--train.init_from=/drafts/a", "--train.init_vocab=remap"], ["--train.init_head=target"],
                ["--train.loss=lk"])]
    for other in changed:
        assert other["extract"] == keys["extract"] and other["train"] != keys["train"] and other["export"] != keys["export"]
        assert other["evaluate"] != keys["evaluate"]
    assert changed[4]["train"] != changed[2]["train"]  # init_vocab=remap against init_from alone
    simulate = ["--evaluate.mode=simulate"]
    sim = r.run_keys(*r.stage_plan(load_config(str(y), simulate)))
    stored = r.run_keys(*r.stage_plan(load_config(str(y), [*simulate, "--evaluate.target_outputs=/outputs"])))
    assert stored["train"] == sim["train"] and stored["export"] == sim["export"] and stored["evaluate"] != sim["evaluate"]
    online = ["--train.mode=online"]
    plan = r.stage_plan(load_config(str(y), online))
    assert "extract" not in plan[1]
    other_layers = r.run_keys(*r.stage_plan(load_config(str(y), [*online, "--extract.layer_ids=[1,2,3]"])))
    assert other_layers["prepare"] == r.run_keys(*plan)["prepare"] and other_layers["train"] != r.run_keys(*plan)["train"]


def test_keys_of_how_a_stage_runs_leave_the_run_key_alone(tmp_path):
    """Budgets and ways of running that do not change what a stage makes (train's time limits,
    workers, loss kernel, the online target's forward grouping) keep every stage's key, so a
    later `eyas run` with them continues the run; a key that changes the draft does not."""
    import eyas.run.plan as r
    from eyas.config import load_config

    y = recipe(tmp_path, "unused-target")
    keys = r.run_keys(*r.stage_plan(load_config(str(y), ["--train.mode=online"])))
    for arg in ("--train.max_seconds=60", "--train.stop_by=1800000000", "--train.num_workers=3",
                "--train.loss_kernel=compiled", "--train.target_group_tokens=2048", "--train.keep_checkpoints=5",
                "--prepare.num_workers=4"):
        assert r.run_keys(*r.stage_plan(load_config(str(y), ["--train.mode=online", arg]))) == keys, arg
    assert r.run_keys(*r.stage_plan(load_config(str(y), ["--train.mode=online", "--train.lr=0.5"])))["train"] != keys["train"]


def test_multi_layer_drafts_are_refused_an_sglang_export_before_anything_runs():
    from eyas.config import load_config
    from eyas.errors import ConfigError

    with pytest.raises(ConfigError, match="--export.format=speculators"):
        load_config(None, ["--train.num_layers=2"])
    with pytest.raises(ConfigError, match="--export.format=speculators"):
        load_config(None, ["--train.num_layers=3", "--export.format=sglang"])
    with pytest.raises(ConfigError, match="num_layers=0"):
        load_config(None, ["--train.num_layers=0"])
    assert load_config(None, ["--train.num_layers=2", "--export.format=speculators"]).train.num_layers == 2


def test_eagle31_norms_are_refused_an_sglang_export_before_anything_runs():
    from eyas.config import load_config
    from eyas.errors import ConfigError

    for fmt in ([], ["--export.format=sglang"]):
        with pytest.raises(ConfigError, match="train.norms='eagle3.1'.*--export.format=speculators"):
            load_config(None, ["--train.norms=eagle3.1", *fmt])
    with pytest.raises(ConfigError, match="train.norms='eagle31': choose one of eagle3, eagle3.1"):
        load_config(None, ["--train.norms=eagle31", "--export.format=speculators"])
    cfg = load_config(None, ["--train.norms=eagle3.1", "--export.format=speculators"])
    assert cfg.train.draft_shape()["fc_norm"] and cfg.train.draft_shape()["norm_output"]
    assert not any(load_config(None, []).train.draft_shape()[k] for k in ("fc_norm", "norm_output"))


def test_inputs_inside_the_stage_directories_a_run_replaces_are_refused(tmp_path):
    """A new training replaces RUN_DIR/train, a new evaluation RUN_DIR/evaluate: `eyas run` refuses
    --train.init_from or --evaluate.target_outputs there before any stage runs (it would delete the
    draft or the outputs, then fail to find them)."""
    from eyas.config import load_config
    from eyas.errors import ConfigError
    from eyas.run import main as run

    y = recipe(tmp_path, "unused-target")
    for inside in ("train/final", "train"):
        with pytest.raises(ConfigError, match="inside this run's train directory"):
            run(load_config(str(y), [f"--train.init_from={tmp_path / 'run' / inside}"]))
    assert not (tmp_path / "run" / "regenerate").exists()
    with pytest.raises(ConfigError, match="inside this run's evaluate directory"):  # the same for stored outputs
        run(load_config(str(y), ["--evaluate.mode=simulate", f"--evaluate.target_outputs={tmp_path / 'run' / 'evaluate'}"]))
    assert not (tmp_path / "run" / "regenerate").exists()


def test_a_stage_directory_of_another_key_scheme_is_never_removed(tmp_path):
    """A stage directory whose run key an earlier eyas wrote (a bare hash: its keys hashed other
    sections) is refused, not removed as "made with other settings": it may hold a training's
    checkpoints. One of this scheme with other settings is removed; one with the same key resumes."""
    from eyas.claims import MARKER, claim_stage_dir
    from eyas.errors import EyasError
    from eyas.run.plan import KEY_SCHEME

    old = tmp_path / "train"
    (old / "checkpoints").mkdir(parents=True)
    (old / MARKER).write_text("0" * 64)
    with pytest.raises(EyasError, match="made by an earlier eyas.*nothing is removed.*--train.out_dir"):
        claim_stage_dir("train", old, f"{KEY_SCHEME}:abc")
    assert (old / "checkpoints").is_dir()
    (old / MARKER).write_text(f"{KEY_SCHEME}:other")
    assert claim_stage_dir("train", old, f"{KEY_SCHEME}:abc") is False
    assert not (old / "checkpoints").exists() and (old / MARKER).read_text() == f"{KEY_SCHEME}:abc"
    (old / "partial").write_text("x")
    assert claim_stage_dir("train", old, f"{KEY_SCHEME}:abc") is True  # the same key: resumed, kept
    assert (old / "partial").is_file()


def test_a_stage_run_apart_says_running_and_leaves_stop_after_to_its_parent(tmp_path, smollm2_dir, capsys,
                                                                          monkeypatch):
    """Under torchrun rank 0 claims regenerate's directory, then a child `eyas run` up to extract runs
    it (run_alone): the child starts it ("running", a claim alone is nothing to resume, not
    "resuming"), and where it stops at extract says the run goes on, not "stop_after=extract:
    stopping here" (a setting the user never gave)."""
    from eyas.claims import MARKER, claim_stage_dir
    from eyas.run.plan import KEY_SCHEME
    from eyas.run.ranks import APART, apart_env

    claimed = tmp_path / "claimed"
    claimed.mkdir()
    (claimed / MARKER).write_text(f"{KEY_SCHEME}:abc")
    assert claim_stage_dir("regenerate", claimed, f"{KEY_SCHEME}:abc") is False
    assert apart_env("extract")[APART] == "extract" and APART not in apart_env()
    monkeypatch.setenv(APART, "prepare")
    y = recipe(tmp_path, save_tiny("llama", tmp_path / "target", smollm2_dir))
    args = ["--regenerate.enabled=false", f"--prepare.data={write_synthetic_chats(tmp_path / 'c.jsonl', 6)}",
            "--stop_after=prepare"]
    assert cli(["run", str(y), *args]) == 0
    out = capsys.readouterr().out
    assert "prepare: done in this process apart; the run goes on" in out and "stopping here" not in out


def test_a_draft_to_start_from_of_another_vocabulary_is_refused_before_extract(tmp_path, smollm2_dir, capsys):
    """--train.init_from with a draft whose draft vocabulary is not this prepare's (new data selects
    another one) fails the run before extract, not after it (the extraction and the shards' checksum
    pass would be lost time): exit 2, summary.json names train. The same draft with prepare's own vocabulary, an
    export of a whole-vocabulary draft (no d2t/t2d in its file) on a whole-vocabulary prepare, or
    --train.init_vocab=remap pass that check; a draft for another target is refused as such."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from eyas.config import load_config
    from eyas.draft import DraftConfig, Eagle3Draft
    from eyas.draft_files import export_draft, save_draft
    from eyas.errors import ArtifactError, ConfigError
    from eyas.train.init_from import check_init_vocab

    target = save_tiny("llama", tmp_path / "tiny", smollm2_dir)
    y, run = str(recipe(tmp_path, target)), tmp_path / "run"
    args = ["--regenerate.enabled=false", f"--prepare.data={write_synthetic_chats(tmp_path / 'chats.jsonl', 6)}"]
    assert cli(["run", y, *args, "--stop_after=prepare"]) == 0
    v = load_file(str(run / "prepare" / "vocab.safetensors"))
    W, V = v["d2t"].numel(), v["t2d"].numel()
    ids_W = torch.arange(W) + v["d2t"]  # the draft tokens' target ids, ascending
    spare = next(i for i in range(V) if not v["t2d"][i])
    other_ids = torch.tensor(sorted(ids_W[1:].tolist() + [spare]))  # one token swapped for another
    other_t2d = torch.zeros_like(v["t2d"])
    other_t2d[other_ids] = True
    tcfg = AutoConfig.from_pretrained(target)
    draft = Eagle3Draft(DraftConfig.from_target(tcfg, W, [0, 1, 2]))
    for name, d2t, t2d in (("same", v["d2t"], v["t2d"]), ("other", other_ids - torch.arange(W), other_t2d)):
        draft.set_vocab(d2t, t2d)
        save_draft(draft, tmp_path / name)
    capsys.readouterr()
    assert cli(["run", y, *args, f"--train.init_from={tmp_path / 'other'}"]) == 2
    err = capsys.readouterr().err
    assert "train: refused before extract runs" in err and "1 of the 500 draft tokens here are not among its 500" in err
    assert not (run / "extract").exists()
    summary = json.loads((run / "summary.json").read_text())
    assert summary["failed_stage"] == "train" and summary["stages"]["prepare"]["status"] == "skipped"
    error = summary["stages"]["train"]["error"]
    assert error["type"].endswith("ArtifactError") and "--train.init_vocab=remap" in error["message"]

    def check(prepare_dir, *extra):
        check_init_vocab(load_config(y, [*args, *extra]).train, prepare_dir)

    check(run / "prepare", f"--train.init_from={tmp_path / 'same'}")  # no error
    check(run / "prepare", f"--train.init_from={tmp_path / 'other'}", "--train.init_vocab=remap")
    whole = tmp_path / "whole"
    assert cli(["run", y, *args, f"--run_dir={whole}", f"--prepare.draft_vocab_size={V}", "--stop_after=prepare"]) == 0
    full = Eagle3Draft(DraftConfig.from_target(tcfg, V, [0, 1, 2]))
    full.set_vocab(torch.zeros(V, dtype=torch.int64), torch.ones(V, dtype=torch.bool))
    exported = export_draft(full, tmp_path / "exp", formats=("speculators",), dtype="float32", verifier=str(target),
                            verifier_arch=["LlamaForCausalLM"])["speculators"]
    assert "d2t" not in load_file(str(exported / "model.safetensors"))
    check(whole / "prepare", f"--train.init_from={exported}")
    with pytest.raises(ArtifactError, match="another draft vocabulary"):
        check(run / "prepare", f"--train.init_from={exported}")
    wide = Eagle3Draft(DraftConfig.from_target(tcfg, W, [0, 1, 2], vocab_size=V + 1))
    save_draft(wide, tmp_path / "wide")
    with pytest.raises(ConfigError, match=f"a draft for another target \\(vocab_size {V + 1} there, {V} here\\)"):
        check(run / "prepare", f"--train.init_from={tmp_path / 'wide'}", "--train.init_vocab=remap")


def test_a_stage_run_apart_from_the_ranks_dies_with_its_rank(tmp_path):
    """run_alone's child (a vLLM engine under torchrun) gets SIGTERM when the rank that started it is
    killed (SIGKILL: no handler of the rank runs), and stops at once if that rank is already gone."""
    child_code = DIE_WITH_PARENT + "import time\ntime.sleep(120)\n"
    parent_code = (
        "import subprocess, sys, os, time\n"
        f"c = subprocess.Popen([sys.executable, '-c', {child_code!r}, str(os.getpid())])\n"
        "print(c.pid, flush=True)\n"
        "time.sleep(120)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", parent_code], stdout=subprocess.PIPE, text=True)
    child_pid = int(parent.stdout.readline())
    time.sleep(1.0)  # the child has run its prctl
    os.kill(child_pid, 0)  # alive
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    for _ in range(100):
        try:
            os.kill(child_pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        os.kill(child_pid, signal.SIGKILL)
        raise AssertionError("the child outlived its killed parent")
    orphan = subprocess.run([sys.executable, "-c", child_code, "1"], timeout=30, check=False)  # "parent" pid 1: not ours
    assert orphan.returncode == 143


def test_a_stage_run_apart_that_crashes_is_its_failure_not_a_missing_output(tmp_path):
    """run_alone's child exiting 1 with a traceback (here evaluate, on a target whose config.json
    transformers cannot read) fails the stage with that exit status; only extract's 1 (complete, but
    it skipped samples) is an output to judge. Before, summary.json blamed the evaluate output the
    crash never wrote ("holds no complete evaluate output")."""
    from transformers import LlamaConfig

    from eyas.config import load_config
    from eyas.errors import EyasError
    from eyas.run.ranks import run_alone
    from tests.test_preflight import draft_for_layers

    SHAPE = LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_attention_heads=4)
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps({"model_type": "no-such-architecture"}))
    cfg = load_config(None, [f"--run_dir={tmp_path / 'run'}", f"--target.model={target}", "--evaluate.mode=chain",
                             f"--evaluate.draft={draft_for_layers(tmp_path / 'draft', SHAPE, 4, [1, 2, 3])}"])
    with pytest.raises(EyasError, match=r"evaluate in vLLM stopped with exit status 1"):
        run_alone("evaluate", cfg)


def test_a_run_key_hashes_only_the_settings_that_differ_from_their_defaults(tmp_path):
    """A field a later eyas adds at its default leaves the run keys alone (an upgrade re-runs and
    removes nothing): a setting given at its default value keys like one not given; any other value
    changes the keys from that stage on."""
    from eyas.config import load_config
    from eyas.run.plan import changed_fields, run_keys, stage_plan

    def keys(*overrides):
        configs, stages = stage_plan(load_config(None, [f"--run_dir={tmp_path}", "--prepare.data=x.jsonl", *overrides]))
        return run_keys(configs, stages)

    plain = keys()
    assert keys("--prepare.reasoning=keep", "--train.lr=" + str(load_config(None, []).train.lr)) == plain
    assert changed_fields(load_config(None, ["--prepare.reasoning=drop"]).prepare) == {"reasoning": "drop"}
    changed = keys("--prepare.reasoning=drop")
    assert changed["prepare"] != plain["prepare"] and changed["train"] != plain["train"]
    lr = keys("--train.lr=1e-5")
    assert lr["prepare"] == plain["prepare"] and lr["extract"] == plain["extract"] and lr["train"] != plain["train"]
