"""Data-loss cases: a command pointed where something it did not make already lies. Each holds when
eyas refuses (exit 2, naming the settings or the path and the fix) and every byte of what was
there is kept; a cell whose command completed is judged by what it left in place."""

from __future__ import annotations

import hashlib
import json
import subprocess
import time
from pathlib import Path

from tests.fault_matrix import Case, _env

KEEP = (".eyas.lock", "run.log", "summary.json")  # what a command writes in its own run directory


def hashes(root: Path) -> dict[str, str]:
    """Every file under `root` (symlinks as their target) by sha256, but a run directory's lock and log."""
    return {str(p.relative_to(root)): str(p.readlink()) if p.is_symlink() else hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if (p.is_symlink() or p.is_file()) and p.name not in KEEP}


def last_line(out: str) -> str:
    lines = [x for x in out.strip().splitlines() if "error" in x] or out.strip().splitlines() or ["(no output)"]
    return lines[-1][:400]


def export_into_train(m, work: Path, rng) -> tuple[bool, str]:
    """`eyas run --export.out_dir=RUN/train` on a finished run: before, export removed the trained
    draft and every checkpoint, then failed."""
    run = m.finished_run(work)
    before = hashes(run / "train")
    rc, out = m.eyas(m.run_args(run, f"--export.out_dir={run / 'train'}"), work / "again.log")
    kept = hashes(run / "train") == before
    named = f"--export.out_dir={run / 'train'}" in out and "its train/" in out
    return rc == 2 and kept and named, f"exit {rc}, train/ {'kept' if kept else 'CHANGED'}: {last_line(out)}"


def shared_extract_dir(m, work: Path, rng) -> tuple[bool, str]:
    """Run B with run A's extract directory and another extract setting: before, B deleted A's
    hidden states (exit 0)."""
    a = m.finished_run(work, "A")
    before = hashes(a / "extract")
    rc, out = m.eyas(m.run_args(work / "B", f"--extract.out_dir={a / 'extract'}", "--extract.token_budget=512"),
                     work / "B.log")
    kept = hashes(a / "extract") == before
    named = f"the run in {a}" in out and "--extract.out_dir" in out
    return rc == 2 and kept and named, f"exit {rc}, A/extract {'kept' if kept else 'CHANGED'}: {last_line(out)}"


def export_over_a_foreign_tree(m, work: Path, rng) -> tuple[bool, str]:
    """A standalone `eyas export --format speculators --out_dir W` where W holds an unrelated
    sglang/ tree, config.yaml and meta.json: before, export removed the tree and overwrote both."""
    run = m.finished_run(work)
    w = work / "W"
    (w / "sglang" / "runs").mkdir(parents=True)
    (w / "sglang" / "runs" / "notes.txt").write_text("someone's serving notes")
    (w / "config.yaml").write_text("server: {port: 30000}\n")
    (w / "meta.json").write_text('{"owner": "another tool"}\n')
    before = hashes(w)
    rc, out = m.eyas(["export", str(run / "train"), f"--run_dir={run}", f"--target.model={m.target}",
                      "--target.dtype=float32", "--format", "speculators", f"--out_dir={w}"], work / "export.log")
    kept = hashes(w) == before
    return rc == 2 and kept and "notes.txt" in out, f"exit {rc}, W {'kept' if kept else 'CHANGED'}: {last_line(out)}"


def two_extracts_one_dir(m, work: Path, rng) -> tuple[bool, str]:
    """Two `eyas extract` at once with one out_dir outside any run directory: before, both wrote
    shards into it and crashed. Held: the second stops naming the first (or they did not overlap),
    and the directory holds one whole extract output."""
    run = m.finished_run(work)
    out_dir = work / "shared-extract"
    args = ["extract", *m.run_args(run)[1:], f"--extract.out_dir={out_dir}"]
    logs = [work / f"extract-{i}.log" for i in (1, 2)]
    procs = []
    for log in logs:
        with open(log, "w") as f:
            procs.append(subprocess.Popen([m.python, "-m", "eyas", *args], stdout=f, stderr=subprocess.STDOUT,
                                          env=_env(), start_new_session=True))
        time.sleep(rng.uniform(0, 0.5))
    rcs = [p.wait(600) for p in procs]
    texts = [log.read_text(errors="replace") for log in logs]
    refused = [t for rc, t in zip(rcs, texts) if rc == 2 and "is in use by another eyas command" in t]
    whole = (out_dir / "meta.json").is_file() and json.loads((out_dir / "meta.json").read_text()).get("stage") == "extract"
    held = whole and sorted(rcs) in ([0, 0], [0, 2]) and (rcs.count(2) == len(refused))
    how = "the second refused: " + last_line(refused[0]) if refused else "they did not overlap (both ran in turn)"
    return held, f"exits {rcs}, {'one whole output' if whole else 'NO whole output'}; {how}"


def regenerate_through_a_symlink(m, work: Path, rng) -> tuple[bool, str]:
    """A regenerate cut short whose conversations.jsonl is a symlink out of the run directory, to a
    file with a torn last line: before, resuming cut and appended to the link's target."""
    run = m.finished_run(work)
    conv = run / "regenerate" / "conversations.jsonl"
    outside = work / "elsewhere.jsonl"
    lines = conv.read_text().splitlines(keepends=True)
    outside.write_text("".join(lines[: len(lines) // 2]) + lines[len(lines) // 2][:20])  # cut short mid-line
    conv.unlink()
    conv.symlink_to(outside)
    (run / "regenerate" / "meta.json").unlink()  # cut short: the same command resumes it
    before = outside.read_bytes()
    rc, out = m.eyas(m.run_args(run), work / "again.log")
    kept = outside.read_bytes() == before
    said = rc == 0 or (str(conv) in out and "symbolic link" in out)
    return kept and said, f"exit {rc}, the link's target {'kept' if kept else 'CHANGED'}: {last_line(out)}"


CASES = [
    Case("data_loss", "export-into-train", export_into_train, "export"),
    Case("data_loss", "shared-extract-dir", shared_extract_dir, "extract"),
    Case("data_loss", "export-over-foreign-tree", export_over_a_foreign_tree, "export"),
    Case("data_loss", "two-extracts-one-dir", two_extracts_one_dir, "extract"),
    Case("data_loss", "regenerate-through-symlink", regenerate_through_a_symlink, "regenerate"),
]
