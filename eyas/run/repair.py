"""Outputs a run finds damaged: what each finished stage has lost (files against their recorded
sha256, extract's shards), the damaged files kept aside, and whether the stage made again wrote
the same output (then what follows it stands)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from eyas import artifacts
from eyas.errors import ArtifactError, DamagedArtifact

RESUMED_REPAIR = ("extract", "train")
"""Stages whose damaged output is made again by resuming (extract: the missing shards' samples;
train: its final draft from the last checkpoint); the others start afresh."""


def output_damage(stage: str, out: Path, meta: dict[str, Any]) -> tuple[str, list[Path]]:
    """What a finished stage's output has lost, in words, and the files to delete before it is made
    again ("" when whole): the files its meta.json records with their sha256 (prepare's outputs,
    regenerate's conversations, extract's index, train's final draft, the exports, evaluate's
    results), and extract's shards with their recorded sizes and sha256."""
    bad: list[tuple[Path, str]] = []
    for name, rec in (meta.get("files") or {}).items():
        try:
            artifacts.check_files(out, stage, {name: rec})
        except DamagedArtifact as e:
            bad.append((Path(e.path), str(e).split(";")[0].removeprefix(str(e.path)).strip()))
    if stage == "extract":
        bad += _damaged_shards(out, meta)
    if not bad:
        return "", []
    shown = ", ".join(f"{p.relative_to(out) if p.is_relative_to(out) else p} ({why})" for p, why in bad[:5])
    return f"{len(bad)} damaged file(s): {shown}" + (" ..." if len(bad) > 5 else ""), [p for p, _ in bad]


def move_aside(stage: str, out: Path, damaged: list[Path]) -> None:
    """Keep the damaged files, out of the way of the stage made again: extract's renamed in place
    (`damaged-NAME`: a shard may be large, or on a spill disk; extract neither lists nor cleans such
    names), the others' moved to OUT.damaged/ beside the stage directory (which is replaced)."""
    moved = []
    for f in damaged:
        if not f.exists():
            continue
        dest = f.with_name("damaged-" + f.name) if stage == "extract" else out.parent / f"{out.name}.damaged" / f.relative_to(out)
        dest.parent.mkdir(parents=True, exist_ok=True)
        os.replace(f, dest)
        moved.append(dest)
    if moved:
        print(f"[eyas:run] {stage}: the damaged file(s) kept as {', '.join(map(str, moved[:3]))}"
              + (" ..." if len(moved) > 3 else "") + " (delete them when no longer needed)", flush=True)


def _damaged_shards(out: Path, meta: dict[str, Any]) -> list[tuple[Path, str]]:
    """Extract's shards that are missing, of another size or another sha256 (hashed in threads; for
    a few TB, minutes of the run's hours). When all are whole, train in this process skips its own
    check of them (hidden_states.VERIFIED)."""
    from concurrent.futures import ThreadPoolExecutor

    from eyas.assets import sha256_file
    from eyas.hidden_states import VERIFIED, verified_mark

    gone = sorted({(out / name).parent for name in meta.get("shards") or {} if not (out / name).parent.is_dir()})
    if gone:  # a spill disk not mounted: not damage to repair by extracting terabytes again
        raise ArtifactError(f"extract's shards in {', '.join(map(str, gone))} are gone with their directory (a spill "
                            "directory not mounted?): mount it and run again; or create the directory empty to have "
                            "eyas extract those shards again")

    def check(item) -> tuple[Path, str] | None:
        name, rec = item
        path = out / name  # an absolute (spilled) name stays itself
        size = path.stat().st_size if path.is_file() else None
        if size != rec["bytes"]:
            return path, "missing" if size is None else f"{size:,} of {rec['bytes']:,} bytes"
        return (path, "its sha256 differs from meta.json") if sha256_file(path) != rec["sha256"] else None

    shards = list((meta.get("shards") or {}).items())
    with ThreadPoolExecutor(min(8, os.cpu_count() or 1)) as pool:
        bad = [b for b in pool.map(check, shards) if b]
    if not bad and shards:
        os.environ[VERIFIED] = verified_mark(out, meta)
    return bad


def same_output(stage: str, old: dict[str, Any], new: dict[str, Any]) -> bool:
    """Whether a stage made again wrote what it had written before (so what follows it stands)."""
    return bool(old.get("files")) and old.get("files") == new.get("files") and old.get("shards") == new.get("shards")
