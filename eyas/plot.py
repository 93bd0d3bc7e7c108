"""plot: training curves of a train run as PNG files.

    eyas plot runs/eyas/train            # -> runs/eyas/train/plots/{loss,acc,tau}.png
    eyas plot runs/eyas                  # the same (a run directory holding train/)

Reads RUN_DIR/metrics.jsonl (written by `eyas train`) and draws, against optimizer steps, the loss
and the top-1 accuracy of every TTT step (train solid, held-out dashed) and the simulated
acceptance length tau. Needs matplotlib (`pip install matplotlib`, or eyas[plot]).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from eyas.config import EyasConfig
from eyas.errors import ArtifactError, ConfigError, EyasError


def read_metrics(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        raise ArtifactError(f"{path} not found: point `eyas plot` at a train output directory (one `eyas train` wrote)")
    recs = []
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            recs.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise ArtifactError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
    if not recs:
        raise ArtifactError(f"{path} holds no records yet: train for at least train.log_every steps")
    return recs


def _series(recs: list[dict[str, Any]], split: str, key: str) -> tuple[list[int], list[Any]]:
    rows = [r for r in recs if r.get("split") == split and key in r]
    return [r["step"] for r in rows], [r[key] for r in rows]


def plot_run(run_dir: Path, out_dir: Path) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise EyasError("`eyas plot` needs matplotlib: pip install matplotlib") from e
    recs = read_metrics(run_dir / "metrics.jsonl")
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for key, label in (("loss_T", "loss (soft cross-entropy)"), ("acc_T", "top-1 accuracy")):
        fig, ax = plt.subplots(figsize=(8, 5))
        for split, style in (("train", "-"), ("eval", "--")):
            steps, vals = _series(recs, split, key)
            if not steps:
                continue
            for i in range(len(vals[0])):
                ax.plot(steps, [v[i] for v in vals], style, color=f"C{i}", marker="o" if split == "eval" else None,
                        label=f"{split} TTT step {i}")
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(label)
        ax.set_title(f"{run_dir.name}: {label} per TTT step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
        path = out_dir / f"{key.removesuffix('_T')}.png"
        fig.savefig(path, dpi=110, bbox_inches="tight")
        plt.close(fig)
        written.append(path)
    fig, ax = plt.subplots(figsize=(8, 5))
    for split, style in (("train", "-"), ("eval", "--o")):
        steps, vals = _series(recs, split, "tau")
        if steps:
            ax.plot(steps, vals, style, label=split)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("simulated acceptance length tau")
    ax.grid(alpha=0.3)
    ax.legend()
    path = out_dir / "tau.png"
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    written.append(path)
    return written


def main(cfg: EyasConfig) -> int:
    run_dir = Path(cfg.plot.run_dir) if cfg.plot.run_dir else cfg.stage_dir("train")
    if not (run_dir / "metrics.jsonl").is_file() and (run_dir / "train" / "metrics.jsonl").is_file():
        run_dir = run_dir / "train"  # `eyas plot RUN_DIR` with the whole run's directory
    if not run_dir.is_dir():
        raise ConfigError(f"plot.run_dir={str(run_dir)!r} is not a directory: give `eyas plot RUN_DIR/train`")
    out = Path(cfg.plot.out_dir) if cfg.plot.out_dir else run_dir / "plots"
    for p in plot_run(run_dir, out):
        print(f"[eyas:plot] wrote {p}")
    return 0
