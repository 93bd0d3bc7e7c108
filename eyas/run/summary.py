"""What a run records: run.log (everything printed, `teed`) and summary.json (per-stage status,
wall time and throughput, the evaluation's numbers, the failure when a stage failed)."""

from __future__ import annotations

import contextlib
import copy
import importlib
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

from eyas import artifacts
from eyas.config import EyasConfig
from eyas.errors import SECRETS, ArtifactError, describe_exception, redact, stopped_by


class Tee:
    """Copy everything written to a stream into the run log too."""

    def __init__(self, stream, log):
        self.stream, self.log = stream, log

    def write(self, text):
        shown = redact(text) if SECRETS else text  # a configured secret reaches neither the console nor run.log
        self.stream.write(shown)
        self.log.write(shown)
        return len(text)

    def flush(self):
        self.stream.flush()
        self.log.flush()

    def __getattr__(self, name):
        return getattr(self.stream, name)


@contextlib.contextmanager
def teed(path: Path):
    """Everything printed to stdout and stderr inside also goes to `path` (appended)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with artifacts.open_no_follow(path, "a", "give another --run_dir") as log:
        out, err = sys.stdout, sys.stderr
        sys.stdout, sys.stderr = Tee(out, log), Tee(err, log)
        try:
            yield
        finally:
            sys.stdout, sys.stderr = out, err


RECORDED = "_eyas_recorded_in_summary"


def record_failure(cfg: EyasConfig, run_dir: Path, record: dict[str, Any], stage: str, out: Path,
                   exc: Exception, wall: float, started: float) -> None:
    """summary.json for a run a stage failed: the stages so far, the failure (type, message,
    traceback), and the evaluation's numbers when evaluate wrote its results before failing (a
    lossless-check failure does). A failure to write it is reported, never raised over `exc`."""
    from eyas.run.ranks import ApartRunFailed  # here, not above: ranks imports `teed` from this module

    with contextlib.suppress(AttributeError):  # recorded once, however many handlers it passes through
        setattr(exc, RECORDED, True)
    if isinstance(exc, ApartRunFailed) and (run_dir / "summary.json").is_file():
        print(f"[eyas:run] {stage} and the stages after it ran in one process apart, which stopped; what it did: "
              f"{run_dir / 'summary.json'}", file=sys.stderr, flush=True)
        return
    from eyas.cli import exit_status, write_roots

    status = "interrupted" if stopped_by(exc) else "failed"  # also an error raised over the signal as it unwound
    record["stages"][stage] = {"status": status, "dir": str(out), "wall_s": round(wall, 2),
                               "error": describe_exception(exc)}
    record["failed_stage"] = stage
    record["exit_status"] = exit_status(exc, write_roots(cfg))  # eyas's own (torchrun reports 1 for any failed rank)
    try:
        results = cfg.stage_dir("evaluate") / "results.json"
        if stage == "evaluate" and results.is_file() and results.stat().st_mtime >= started:
            record.update(evaluation(results.parent))
        artifacts.atomic_write_json(run_dir / "summary.json", record)
        print(f"[eyas:run] {stage} {status}; what the run did so far: {run_dir / 'summary.json'}", file=sys.stderr, flush=True)
    except Exception as e:  # reported in full; the stage's own exception is the one re-raised
        d = describe_exception(e)
        print(f"[eyas:run] {stage} {status}, and writing summary.json failed too: {d['type']}: {d['message']}\n"
              f"{d['traceback']}", file=sys.stderr, flush=True)


def throughput(stage: str, meta: dict[str, Any]) -> dict[str, Any]:
    """The tokens/s a stage measured itself (model loading excluded), where it reports one; for a
    training resumed over several runs also what all of them did (wall_s and tokens_per_s are the last run's)."""
    counts = meta.get("counts") or {}
    tps = {
        "regenerate": counts.get("tokens_per_s"),
        "extract": (counts.get("this_run") or {}).get("tokens_per_s"),
        "train": (meta.get("metrics") or {}).get("tokens_per_s"),
    }.get(stage)
    out: dict[str, Any] = {"tokens_per_s": tps} if tps else {}
    stream = (meta.get("metrics") or {}).get("stream") if stage == "train" else None
    if stream:  # train.mode=stream: the ledger's counts and the throughput accounting
        out["stream"] = stream
    total = (meta.get("metrics") or {}).get("all_runs") if stage == "train" else None
    if total and total["runs"] > 1:
        out["all_runs"] = total
    return out


def plot_training(cfg: EyasConfig) -> None:
    """`eyas plot` of the training just run, where matplotlib is installed."""
    if importlib.util.find_spec("matplotlib") is None:  # an optional extra (eyas[plot]): the run goes on without
        print("[eyas:run] training plots not drawn: no matplotlib here (`pip install matplotlib`, then "
              f"`eyas plot {cfg.stage_dir('train')}`)", flush=True)
        return
    plot = importlib.import_module("eyas.plot")
    c = copy.deepcopy(cfg)
    c.plot.run_dir = str(cfg.stage_dir("train"))
    plot.main(c)


def evaluation(eval_dir: Path) -> dict[str, Any]:
    path = eval_dir / "results.json"
    if not path.is_file():
        raise ArtifactError(f"{path} is missing: the evaluate stage wrote no results")
    res = json.loads(path.read_text())
    keys = ("tau_chain", "tau_tree", "tau_chain_simulated", "tau_tree_simulated", "acceptance_per_position", "lossless",
            "lossless_up_to_ties", "num_divergent", "num_divergent_near_tie", "speedup")
    out = {k: res.get(k) for k in keys}  # the un-suffixed ones: the tree's when it ran (results.json's primary mode)
    tf = res.get("teacher_forced") or {}
    out["acceptance_per_position_chain_simulated"] = tf.get("acceptance_per_position")
    out["acceptance_per_position_tree_simulated"] = (tf.get("tree") or {}).get("acceptance_per_position")
    for mode, m in (res.get("modes") or {}).items():
        out[f"acceptance_per_position_{mode}"] = m.get("acceptance_per_position")
        out[f"speedup_{mode}"] = m.get("speedup")
    return out


def print_summary(rec: dict[str, Any]) -> None:
    lines = [f"[eyas:run] summary ({rec['run_dir']}/summary.json)"]
    for s, r in rec["stages"].items():
        tps = f"{r['tokens_per_s']:,.0f} tok/s" if r.get("tokens_per_s") else ""
        wall = f"{r['wall_s']:.1f} s" if r.get("wall_s") is not None else ""
        status = r["status"] + (" partial" if r.get("partial") else "")
        lines.append(f"  {s:<11} {status:<16} {wall:>10} {tps:>16}  {r['dir']}")
        if r.get("all_runs"):
            a = r["all_runs"]
            lines.append(f"  {'':<11} over {a['runs']} runs: {a['steps']:,} steps, {a['seconds']:.1f} s of training"
                         + (f", {a['tokens_per_s']:,.0f} tok/s" if a.get("tokens_per_s") else ""))
    for mode in ("chain", "tree"):
        if rec.get(f"tau_{mode}") is None:
            continue
        acc = [a["conditional"] for a in rec.get(f"acceptance_per_position_{mode}") or []]
        speedup = rec.get(f"speedup_{mode}")
        lines.append(f"  {mode:<11} tau {rec[f'tau_{mode}']:.3f}  speedup " + (f"{speedup:.2f}x" if speedup else "-")
                     + "  P(accept | reached) per draft position: " + " ".join(f"{a:.2f}" for a in acc))
    if rec.get("tau_chain_simulated") is not None and rec.get("tau_chain") is None:  # evaluate.mode=simulate
        acc = [a["conditional"] for a in rec.get("acceptance_per_position_chain_simulated") or []]
        lines.append(f"  {'chain':<11} tau {rec['tau_chain_simulated']:.3f} simulated from the teacher-forced draft "
                     "(evaluate.mode=simulate)  P(accept | reached) per draft position: " + " ".join(f"{a:.2f}" for a in acc))
    if rec.get("tau_tree_simulated") is not None and rec.get("tau_tree") is None:
        acc = [a["conditional"] for a in rec.get("acceptance_per_position_tree_simulated") or []]
        lines.append(f"  {'tree':<11} tau {rec['tau_tree_simulated']:.3f} simulated pass by pass on the target's "
                     "outputs (evaluate.mode=simulate)  P(accept | reached) per tree depth: "
                     + " ".join(f"{a:.2f}" for a in acc))
    decoded = rec.get("tau_chain") is not None or rec.get("tau_tree") is not None  # not evaluate.mode=simulate
    if "lossless" in rec and (decoded or rec.get("tau_chain_simulated") is None):
        lines.append(f"  lossless    {rec['lossless']}" + (
            f" ({rec['num_divergent']} outputs differ, {rec['num_divergent_near_tie']} first at a near-tie: lossless up to "
            f"numerics {rec['lossless_up_to_ties']})" if rec.get("num_divergent") else ""))
    print("\n".join(lines), flush=True)
