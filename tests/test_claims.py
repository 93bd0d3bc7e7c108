"""eyas.claims: what `eyas run` may replace. Every stage's output directory set to each other
stage's (the same path, inside it, around it), to the run directory and to a foreign non-empty
folder is refused before any stage runs (no target is needed to get there), naming both settings,
by `eyas run` and by the stage run alone;
a stage directory another run made with other settings is never removed; each directory a
command writes is locked, not only the run directory."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys

import pytest

from eyas.cli import main as cli
from eyas.config import STAGES
from tests.data import write_synthetic_chats


def snapshot(root):
    """Every file under `root` with its bytes (and every symlink with its target), but the lock and
    the log a command keeps in its run directory."""
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() and not p.is_symlink() else str(p.readlink()))
            for p in sorted(root.rglob("*")) if (not p.is_dir() or p.is_symlink()) and p.name not in (".eyas.lock", "run.log")}


def test_every_stage_out_dir_on_another_stages_or_a_foreign_folder_is_refused_before_anything_runs(tmp_path, capsys):
    """The walk: each stage (regenerate on, so all six run) with its out_dir on each other stage's
    directory, inside it, around it, on the run directory, and on a folder eyas did not make.
    Each is exit 2 naming both settings (or the foreign folder and the flag to change), and
    nothing in the run directory or the folder changes. The run directory already holds a
    finished-looking output of every stage, so a refusal that came after a stage began would show."""
    run = tmp_path / "run"
    chats = write_synthetic_chats(tmp_path / "chats.jsonl", 2)
    for s in STAGES:  # each stage's directory as `eyas run` leaves it: its run key, an output file
        (run / s).mkdir(parents=True)
        (run / s / "run_key.txt").write_text(f"v3:{s}\nrun_dir={run}\nstage={s}\ndir={run / s}\n")
        (run / s / "output.bin").write_bytes(s.encode())
    foreign = tmp_path / "mine"
    (foreign / "sub").mkdir(parents=True)
    (foreign / "sub" / "thesis.tex").write_text("years of work")
    before = snapshot(run), snapshot(foreign)
    base = ["run", f"--run_dir={run}", f"--prepare.data={chats}", "--target.model=/nonexistent/target",
            "--regenerate.enabled=true"]
    for a in STAGES:
        for b in STAGES:
            if a == b:
                continue
            for where, how in ((run / b, "is the same directory as"), (run / b / "x", "lies inside")):
                assert cli([*base, f"--{a}.out_dir={where}"]) == 2, (a, b, where)
                err = capsys.readouterr().err
                assert f"--{a}.out_dir={where} {how} --run_dir={run} (its {b}/)" in err, err
                assert f"change --{a}.out_dir" in err
        moved = tmp_path / "moved"  # around another stage's moved directory
        other = STAGES[(STAGES.index(a) + 1) % len(STAGES)]
        assert cli([*base, f"--{a}.out_dir={moved}", f"--{other}.out_dir={moved / other}"]) == 2
        err = capsys.readouterr().err
        assert f"--{a}.out_dir={moved}" in err and f"--{other}.out_dir={moved / other}" in err, err
        assert "contains" in err or "lies inside" in err
        for holds_run in (run, tmp_path):  # the run directory itself, or one around it
            assert cli([*base, f"--{a}.out_dir={holds_run}"]) == 2
            assert f"--{a}.out_dir={holds_run}" in capsys.readouterr().err
        assert cli([*base, f"--{a}.out_dir={foreign}"]) == 2
        err = capsys.readouterr().err
        assert f"{foreign} is not empty and was not made by `eyas run`: nothing is removed" in err
        assert f"--{a}.out_dir elsewhere" in err
        assert cli([*base, f"--{a}.out_dir={foreign / 'sub' / 'thesis.tex'}"]) == 2  # a file
        assert "is a file, not a directory" in capsys.readouterr().err
        for b in STAGES:  # a stage run alone into another stage's directory
            if b != a:
                assert cli([a, f"--run_dir={run}", f"--{a}.out_dir={run / b}", "--target.model=/nonexistent/target",
                            f"--export.train_dir={run / 'train'}"]) == 2
                assert f"{run / b} holds the output of the {b} stage" in capsys.readouterr().err
        if a != "export":  # (export checks each file in its way: tests/test_export.py)
            assert cli([a, f"--run_dir={run}", f"--{a}.out_dir={foreign}", "--target.model=/nonexistent/target"]) == 2
            assert f"{foreign} is not empty and holds no record of an eyas command" in capsys.readouterr().err
    assert (snapshot(run), snapshot(foreign)) == before
    assert not moved.exists() and not (foreign / ".eyas.lock").exists()


def test_a_run_never_removes_a_stage_directory_another_run_made(tmp_path, capsys):
    """Run B pointed at run A's extract directory with other settings: refused before any stage
    runs, naming run A and --extract.out_dir, and A's shards stay. At the claim itself (the last
    guard, also for inputs that changed under the same key) the same. Its own run's directory of
    other settings is still replaced; the same key resumes."""
    from eyas.claims import claim_stage_dir
    from eyas.errors import EyasError
    from eyas.run.plan import KEY_SCHEME

    a, b = tmp_path / "A", tmp_path / "B"
    (a / "extract" / "shards").mkdir(parents=True)  # as run A's extract left it
    (a / "extract" / "run_key.txt").write_text(f"{KEY_SCHEME}:a\nrun_dir={a}\nstage=extract\ndir={a / 'extract'}\n")
    (a / "extract" / "shards" / "r000-00000.safetensors").write_bytes(b"A's hidden states")
    before = snapshot(a)
    chats = write_synthetic_chats(tmp_path / "chats.jsonl", 2)
    assert cli(["run", f"--run_dir={b}", f"--extract.out_dir={a / 'extract'}", "--extract.token_budget=512",
                f"--prepare.data={chats}", "--target.model=/nonexistent/target"]) == 2
    err = capsys.readouterr().err
    assert f"{a / 'extract'} holds the extract output of the run in {a}" in err and "--extract.out_dir" in err
    assert snapshot(a) == before and not (b / "prepare").exists()
    for key, fresh in ((f"{KEY_SCHEME}:b", False), (f"{KEY_SCHEME}:a", True)):
        with pytest.raises(EyasError, match=f"the run in {a}.*never removes another run's output.*--extract.out_dir"):
            claim_stage_dir("extract", a / "extract", key, fresh=fresh, run_dir=b)
        assert snapshot(a) == before
    assert claim_stage_dir("extract", a / "extract", f"{KEY_SCHEME}:a", run_dir=b) is True  # the same output: shared
    copy = tmp_path / "A-copy"  # a run directory copied whole is the copy's own
    shutil.copytree(a, copy)
    assert claim_stage_dir("extract", copy / "extract", f"{KEY_SCHEME}:c", run_dir=copy) is False
    assert not (copy / "extract" / "shards").exists() and snapshot(a) == before
    assert claim_stage_dir("extract", a / "extract", f"{KEY_SCHEME}:a2", run_dir=a) is False  # its own: replaced
    assert not (a / "extract" / "shards").exists()


HOLD = """
import sys, time
from eyas.artifacts import run_dir_lock
with run_dir_lock(sys.argv[1], "extract"):
    print("held", flush=True)
    time.sleep(600)
"""


def test_a_stage_directory_outside_any_run_directory_is_locked_too(tmp_path, capsys):
    """Two `eyas extract` with one out_dir outside their run directories: the second stops at once,
    naming the holder, and touches nothing (before, only a run directory had a lock, and the two
    wrote over each other's shards)."""
    out = tmp_path / "shared-extract"
    out.mkdir()
    (out / "index.json").write_text("the first command's")
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert cli(["extract", f"--run_dir={tmp_path / 'run'}", f"--extract.out_dir={out}",
                    "--target.model=/nonexistent/target"]) == 2
        err = capsys.readouterr().err
        assert f"output directory {out} is in use by another eyas command (pid {holder.pid} on " in err, err
        assert (out / "index.json").read_text() == "the first command's"
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()


def test_the_run_log_is_never_written_through_a_symlink(tmp_path, capsys):
    """RUN_DIR/run.log as a symbolic link to a file elsewhere (eyas makes none): refused naming the
    link, before anything is appended to what it points to."""
    run, victim = tmp_path / "run", tmp_path / "someone-elses.txt"
    run.mkdir()
    victim.write_text("kept")
    (run / "run.log").symlink_to(victim)
    chats = write_synthetic_chats(tmp_path / "chats.jsonl", 2)
    assert cli(["run", f"--run_dir={run}", f"--prepare.data={chats}", "--target.model=/nonexistent/target"]) == 2
    assert f"{run / 'run.log'} is a symbolic link (to {victim})" in capsys.readouterr().err
    assert victim.read_text() == "kept"


def test_a_lock_another_command_left_is_no_record_of_a_stage(tmp_path, capsys):
    """`eyas export` refused in a folder of the user's leaves its lock file there; that lock is no
    record that `eyas prepare` wrote the folder: prepare into it is refused too, nothing written."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "config.yaml").write_text("my own settings\n")
    (mine / ".eyas.lock").write_text('{"pid": 1, "command": "eyas export"}')
    before = snapshot(mine)
    assert cli(["prepare", f"--run_dir={tmp_path / 'run'}", f"--prepare.out_dir={mine}",
                f"--prepare.data={write_synthetic_chats(tmp_path / 'chats.jsonl', 2)}"]) == 2
    assert "holds no record of an eyas command" in capsys.readouterr().err
    assert snapshot(mine) == before


def test_a_stage_directory_a_run_only_reads_is_not_locked_so_a_sweep_shares_it(tmp_path):
    """Runs of a sweep that share an up-to-date extract directory (its meta.json carries their run
    key) run side by side: `check_run` locks only the directories the run will write."""
    from eyas.claims import check_run, dir_locks
    from eyas.config import load_config
    from eyas.run.plan import run_keys, stage_plan

    base = tmp_path / "base"
    shared = base / "extract"
    cfg = load_config(None, [f"--run_dir={tmp_path / 'sweep-1'}", f"--prepare.out_dir={base / 'prepare'}",
                             f"--extract.out_dir={shared}",
                             f"--prepare.data={write_synthetic_chats(tmp_path / 'chats.jsonl', 2)}"])
    configs, stages = stage_plan(cfg)
    keys = run_keys(configs, stages)
    for s in ("prepare", "extract"):  # made by the run in base, with the sweep's settings
        (base / s).mkdir(parents=True)
        (base / s / "meta.json").write_text('{"stage": "%s", "run_key": "%s"}' % (s, keys[s]))
        (base / s / "run_key.txt").write_text(f"{keys[s]}\nrun_dir={base.resolve()}\nstage={s}\ndir={(base / s).resolve()}\n")
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(shared)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"  # another command on it (the sweep's other runs only read it)
    try:
        with dir_locks([], "run"):
            check_run(cfg, stages, keys)  # not "in use by another eyas command"
        (shared / "meta.json").write_text('{"stage": "extract", "run_key": "v3:another"}')  # this run's, older
        (shared / "run_key.txt").write_text(f"v3:another\nrun_dir={(tmp_path / 'sweep-1').resolve()}\nstage=extract\n"
                                            f"dir={shared.resolve()}\n")
        with dir_locks([], "run"), pytest.raises(Exception, match="in use by another eyas command"):
            check_run(cfg, stages, keys)  # to be written: locked, and the holder is named
    finally:
        holder.kill()
        holder.wait()




def test_a_spill_directory_in_another_stages_directory_is_refused_before_anything_runs(tmp_path, capsys):
    """extract.spill_dirs inside train's directory: train would delete the spilled shards when it
    runs. Refused before any stage, naming both settings."""
    run = tmp_path / "run"
    chats = write_synthetic_chats(tmp_path / "chats.jsonl", 2)
    base = ["run", f"--run_dir={run}", f"--prepare.data={chats}", "--target.model=/nonexistent/target"]
    for spill, said in ((run / "train" / "spill", f"lies inside --run_dir={run} (its train/)"),
                        (tmp_path, "contains the run directory")):
        assert cli([*base, f"--extract.spill_dirs=[{spill}]"]) == 2
        err = capsys.readouterr().err
        assert f"--extract.spill_dirs entry {spill} {said}" in err, err
    assert not (run / "train").exists()


def test_another_runs_directory_that_an_earlier_stage_would_make_stale_is_refused_before_anything_runs(tmp_path):
    """B's extract directory is A's, made with B's very settings, but B's prepare has not run: B
    would prepare, then have to make A's extract again. Refused before prepare runs, naming A."""
    from eyas.claims import check_run, dir_locks
    from eyas.config import load_config
    from eyas.run.plan import run_keys, stage_plan

    a, b = tmp_path / "A", tmp_path / "B"
    shared = a / "extract"
    shared.mkdir(parents=True)
    cfg = load_config(None, [f"--run_dir={b}", f"--extract.out_dir={shared}",
                             f"--prepare.data={write_synthetic_chats(tmp_path / 'chats.jsonl', 2)}"])
    configs, stages = stage_plan(cfg)
    keys = run_keys(configs, stages)
    (shared / "meta.json").write_text('{"stage": "extract", "run_key": "%s"}' % keys["extract"])
    (shared / "run_key.txt").write_text(f"{keys['extract']}\nrun_dir={a.resolve()}\nstage=extract\ndir={shared.resolve()}\n")
    with dir_locks([], "run"), pytest.raises(Exception, match=f"holds the extract output of the run in {a.resolve()}"):
        check_run(cfg, stages, keys)
