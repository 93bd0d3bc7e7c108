"""Which directories a command may write and remove: eyas deletes only what its own records say it made.

`eyas run` checks, before any stage runs (`check_run`):

* every stage's output directory against every other's and against the run directory (the same
  path, or one inside the other): two stages in one directory replace each other's outputs, so
  `--export.out_dir=RUN_DIR/train` would delete the trained draft. Refused naming both settings;
* every stage directory that already holds something: `eyas run` made it (its `run_key.txt`, which
  also records the run directory that made it), or it is refused; a directory made by another run
  with other settings is refused naming that run and the flag to change, never removed.

`claim_stage_dir` applies the same rule again when `eyas run` is about to replace a directory.
Each directory a command writes is locked (`dir_locks`), not only the run directory: two commands
writing one stage directory from two run directories (or none) stop at the second one.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path
from typing import Iterator

from eyas.artifacts import LOCK_FILE, atomic_write_text, run_dir_lock
from eyas.config import STAGES, EyasConfig
from eyas.errors import ConfigError, EyasError

MARKER = "run_key.txt"
"""A stage directory `eyas run` made: its run key on the first line, then `run_dir=` (the run
directory that made it), `stage=` and `dir=` (where it was made)."""


def setting(cfg: EyasConfig, stage: str) -> str:
    """The flag that places `stage`'s directory: its own out_dir, else the run directory."""
    given = getattr(getattr(cfg, stage), "out_dir", "")
    return f"--{stage}.out_dir={given}" if given else f"--run_dir={cfg.run_dir} (its {stage}/)"


def overlap(a: Path, b: Path) -> str:
    """How two resolved directories collide, in words ("" when apart)."""
    if a == b:
        return "is the same directory as"
    if a.is_relative_to(b):
        return "lies inside"
    if b.is_relative_to(a):
        return "contains"
    return ""


def check_overlaps(cfg: EyasConfig, stages: list[str]) -> None:
    """ConfigError when a planned stage's output directory (of `stages`) holds the run directory
    (run.log, summary.json, the other stages), or is the directory of another stage (planned or
    not: the run directory's own subdirectory of a stage not planned may hold its earlier output),
    or lies inside one or holds one: a stage that runs replaces its whole directory."""
    run_dir = Path(cfg.run_dir).resolve()
    dirs = {s: cfg.stage_dir(s).resolve() for s in STAGES}
    for a in stages:
        if dirs[a] == run_dir or run_dir.is_relative_to(dirs[a]):
            raise ConfigError(f"{setting(cfg, a)} {overlap(dirs[a], run_dir)} the run directory --run_dir={cfg.run_dir}, "
                              f"whose run.log, summary.json and other stages the {a} stage would replace: give it a "
                              f"directory of its own (e.g. --{a}.out_dir={run_dir / a})")
    if "extract" in stages:
        check_spill_dirs(cfg, dirs, run_dir)
    pairs = [(a, b) for a in stages for b in STAGES if b != a and overlap(dirs[a], dirs[b])]
    if pairs:
        a, b = pairs[0]
        if not getattr(cfg, a).out_dir:  # the setting given first (one of the two is given)
            a, b = b, a
        given = [f"--{x}.out_dir" for x in (a, b) if getattr(cfg, x).out_dir]
        raise ConfigError(f"{setting(cfg, a)} {overlap(dirs[a], dirs[b])} {setting(cfg, b)}: each stage replaces its "
                          f"own output directory when it runs, so the {a} stage and the {b} stage would delete each "
                          f"other's output. Give each a directory of its own: change {' or '.join(given)}")


def check_spill_dirs(cfg: EyasConfig, dirs: dict[str, Path], run_dir: Path) -> None:
    """extract.spill_dirs hold extract's shards: none may lie in (or hold) another stage's directory,
    which that stage replaces when it runs, nor hold the run directory."""
    for given in cfg.extract.spill_dirs:
        spill = Path(given).resolve()
        if spill == run_dir or run_dir.is_relative_to(spill):
            raise ConfigError(f"--extract.spill_dirs entry {given} {overlap(spill, run_dir)} the run directory "
                              f"--run_dir={cfg.run_dir}: give the spill directory a place of its own")
        for b in STAGES:
            if b != "extract" and overlap(spill, dirs[b]):
                raise ConfigError(f"--extract.spill_dirs entry {given} {overlap(spill, dirs[b])} {setting(cfg, b)}: the "
                                  f"{b} stage replaces its directory when it runs, and extract's shards spilled there "
                                  "with it. Give the spill directory a place of its own: change --extract.spill_dirs")


def read_marker(out: Path) -> dict[str, str] | None:
    """A stage directory's run_key.txt as {key, run_dir, stage} (run_dir and stage absent when an
    earlier eyas wrote it), or None when there is none."""
    path = out / MARKER
    if not path.is_file():
        return None
    lines = path.read_text().splitlines() or [""]
    rec = dict(line.split("=", 1) for line in lines[1:] if "=" in line)
    return {"key": lines[0].strip(), **rec}


def marker_text(key: str, run_dir: Path | None, stage: str, out: Path) -> str:
    if run_dir is None:
        return key
    return f"{key}\nrun_dir={Path(run_dir).resolve()}\nstage={stage}\ndir={Path(out).resolve()}\n"


def owner(out: Path, marker: dict[str, str], run_dir: Path) -> Path | None:
    """The run directory that made a stage directory, as its marker records it. A directory moved
    or copied since (its marker names another path: a run directory copied whole) or marked by an
    earlier eyas belongs to this run when it lies in this run's directory; elsewhere, by its layout,
    to the run directory around RUN_DIR/STAGE (None when it has none)."""
    here, run_dir = out.resolve(), Path(run_dir).resolve()
    if marker.get("run_dir") and marker.get("dir") == str(here):
        return Path(marker["run_dir"])
    if here.is_relative_to(run_dir):
        return run_dir
    return here.parent if here.name in STAGES else None


def is_empty(out: Path) -> bool:
    """Nothing in `out` but eyas's lock file (or no `out`)."""
    return not out.is_dir() or all(p.name == LOCK_FILE for p in out.iterdir())


def refuse_foreign(stage: str, out: Path, key: str, run_dir: Path | None) -> None:
    """EyasError when `eyas run` (of `run_dir`, with run key `key`) may not replace `out`: not
    made by `eyas run`, made by an earlier eyas, or made by another run with other settings."""
    if is_empty(out):
        return
    marker = read_marker(out)
    if marker is None:
        raise EyasError(f"{out} is not empty and was not made by `eyas run`: nothing is removed; remove it yourself "
                        f"or point --{stage}.out_dir elsewhere")
    from eyas.run.plan import KEY_SCHEME

    if not marker["key"].startswith(f"{KEY_SCHEME}:"):
        raise EyasError(f"{out} was made by an earlier eyas, whose run keys this one cannot compare: nothing is "
                        f"removed; delete it yourself to run {stage} again there, or point --{stage}.out_dir (or "
                        "--run_dir) elsewhere")
    if run_dir is None or marker["key"] == key:
        return
    made_by = owner(out, marker, run_dir)
    if made_by == Path(run_dir).resolve():
        return
    what = f"the {marker.get('stage') or stage} output of the run in {made_by}" if made_by else \
        "the output of another run (which one, its run_key.txt does not say)"
    raise EyasError(f"{out} holds {what}, made with other settings: eyas never removes another run's output. Point "
                    f"--{stage}.out_dir elsewhere (or run with --run_dir={made_by or '...'} to replace it there)")


def check_run(cfg: EyasConfig, stages: list[str], keys: dict[str, str]) -> None:
    """`eyas run`, before any stage: overlapping stage directories, and a stage directory that the
    stage could not replace when it runs (`refuse_foreign`); a directory it will skip (its meta.json
    carries this run's key) is left alone. Then locks the stage directories there already that the
    run will write (inside the run's `dir_locks`); one it only reads is not locked, so that runs
    sharing an up-to-date prepare or extract directory (a sweep) run side by side."""
    check_overlaps(cfg, stages)
    end = stages.index(cfg.stop_after) + 1 if cfg.stop_after in stages else len(stages)
    remade = False  # an earlier stage runs: every later one is made again from its new output
    for s in stages[:end]:
        out = cfg.stage_dir(s)
        if out.exists() and not out.is_dir():
            raise ConfigError(f"{setting(cfg, s)}: {out} is a file, not a directory; nothing is removed: point "
                              f"--{s}.out_dir at a directory")
        if not is_empty(out) and (remade or recorded_key(out) != keys[s]):
            refuse_foreign(s, out, "" if remade else keys[s], Path(cfg.run_dir))
        remade = remade or recorded_key(out) != keys[s]
    for s in stages[:end]:  # a directory up to date is only read (runs of a sweep share one): locked if it is made again
        out = cfg.stage_dir(s)
        if out.is_dir() and recorded_key(out) != keys[s]:
            lock_also(out.resolve())  # the stage directories to write that are there already (the others as made)


def check_alone(command: str, cfg: EyasConfig) -> None:
    """A stage run alone (`eyas extract`, ...), before it locks its output directory: EyasError when
    that directory holds another stage's output (its meta.json or run_key.txt says so), or is not
    empty and no eyas command wrote there (none of those, nor the lock that `eyas COMMAND` leaves in
    the directories it writes: a lock another command left, refused before it wrote, is no record):
    its own files would overwrite what is there."""
    if command not in STAGES:
        return
    out = cfg.stage_dir(command)
    marker = read_marker(out) or {}
    try:
        meta_stage = json.loads((out / "meta.json").read_text()).get("stage")
    except (OSError, ValueError, AttributeError):
        meta_stage = None
    other = next((s for s in (marker.get("stage"), meta_stage) if s and s != command), None)
    if other:
        record = "run_key.txt" if marker.get("stage") == other else "meta.json"
        raise EyasError(f"{out} holds the output of the {other} stage ({record} says so), which `eyas {command}` "
                        f"would overwrite: nothing is written; point --{command}.out_dir elsewhere")
    if command == "export" or is_empty(out) or marker or meta_stage == command or locked_by(out) == f"eyas {command}":
        return  # (export checks each file in its way against its own records)
    raise EyasError(f"{out} is not empty and holds no record of an eyas command (no {command} meta.json, {MARKER} or "
                    f"{LOCK_FILE}): `eyas {command}` would write over what is there (its meta.json, config.yaml, ...). "
                    f"Nothing is written; point --{command}.out_dir at a new or empty directory")


def locked_by(out: Path) -> str | None:
    """The command the last holder of `out`'s lock file was (`eyas extract`, ...), or None."""
    try:
        return json.loads((out / LOCK_FILE).read_text()).get("command")
    except (OSError, ValueError, AttributeError):
        return None


def recorded_key(out: Path) -> str | None:
    try:
        return json.loads((out / "meta.json").read_text()).get("run_key")
    except (OSError, ValueError, AttributeError):
        return None


def clear(out: Path) -> None:
    """Empty a stage directory eyas made, keeping its lock file (another command may wait on it)."""
    for p in out.iterdir():
        if p.name == LOCK_FILE:
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink()


INPUTS_CHANGED = "its inputs changed: an earlier stage ran again"


def claim_stage_dir(stage: str, out: Path, key: str, fresh: bool = False,
                    why_fresh: str = INPUTS_CHANGED, run_dir: Path | None = None) -> bool:
    """Make `out` ready for a run of `stage` with `key`; True when an interrupted or partial run
    with the same key is there to resume. A complete or partial output made by `eyas run` with
    other settings, or (`fresh`) from inputs that have changed since, is removed; a non-empty
    directory `eyas run` did not make, made with another KEY_SCHEME, or (given `run_dir`, the run
    claiming it) made by another run with other settings, is never touched (`refuse_foreign`)."""
    lock_also(out)  # held until the run ends (dir_locks)
    if not is_empty(out):
        marker = read_marker(out)
        refuse_foreign(stage, out, key if marker and marker["key"] == key and not fresh else "", run_dir)
        same = marker["key"] == key
        if same and not fresh:  # resumed when there is something to resume: a claim alone (by a parent
            return any(p.name not in (MARKER, LOCK_FILE) for p in out.iterdir())  # `eyas run`) starts afresh
        why = why_fresh if same else "made with other settings"
        print(f"[eyas:run] {stage}: removing {out} ({why})", flush=True)
        clear(out)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / MARKER, marker_text(key, run_dir, stage, out))
    return False


# --- locks ---------------------------------------------------------------------------------------

def written_dirs(command: str, cfg: EyasConfig, stages: list[str] | None = None) -> list[Path]:
    """The stage directories a command writes: its own stage's, or (`eyas run`) every planned one up
    to stop_after."""
    if command in STAGES:
        return [cfg.stage_dir(command)]
    stages = list(stages or ())
    end = stages.index(cfg.stop_after) + 1 if cfg.stop_after in stages else len(stages)
    return [cfg.stage_dir(s) for s in stages[:end]]


_HELD: list[contextlib.ExitStack] = []
"""The locks of the `dir_locks` block in progress, which `lock_also` adds to."""


@contextlib.contextmanager
def dir_locks(dirs: list[Path], command: str, make: bool = False) -> Iterator[None]:
    """Hold the lock (artifacts.run_dir_lock: DIR/.eyas.lock) of each directory in `dirs` that exists,
    or (`make`) of each, made if missing, and of each one `lock_also` adds, until the block ends;
    one another eyas command holds stops this one, naming the holder. (A directory not there yet is locked when a stage makes it, so a
    run refused or stopped before a stage leaves no directory of it behind.) Not on ranks > 0 under
    torchrun: rank 0 holds them for the command."""
    with contextlib.ExitStack() as stack:
        _HELD.append(stack)
        try:
            for d in sorted({Path(d).resolve() for d in dirs if make or Path(d).is_dir()}):
                lock_also(d, command)
            yield
        finally:
            _HELD.remove(stack)


def lock_also(out: Path, command: str = "run") -> None:
    """Lock `out` (made if missing) for the rest of the `dir_locks` block in progress; nothing
    outside one."""
    if _HELD and os.environ.get("RANK", "0") == "0":
        _HELD[-1].enter_context(run_dir_lock(out, command, what="output directory"))
