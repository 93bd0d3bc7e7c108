"""Every cell of the fault matrix (tests/fault_matrix.py): each stage of `eyas run` under kill -9,
SIGTERM, a full disk, torn and flipped artifacts, dead pool workers and a stalled or dead chat
server; then the same command again, judged against an uninterrupted run.

    python bench/fault_matrix.py [--seed 0] [--out results/fault_matrix.json] [--only NAME ...]

Prints one line per cell and writes the results (JSON) and a markdown table for docs/benchmarks.md.
About 10 minutes on a 2-core CPU.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eyas.assets import smollm2_dir
from tests.fault_matrix import Matrix, cells


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=0, help="seeds each cell's random moment, byte and cut")
    ap.add_argument("--out", default="results/fault_matrix.json")
    ap.add_argument("--only", nargs="*", default=[], help="cell names (e.g. train-kill9)")
    ap.add_argument("--work", default="", help="working directory (default: a temporary one)")
    a = ap.parse_args()
    work = Path(a.work) if a.work else Path(tempfile.mkdtemp(prefix="eyas-faults-"))
    m = Matrix(work, smollm2_dir())
    rows, t0 = [], time.perf_counter()
    for cell in cells():
        if a.only and cell.name not in a.only:
            continue
        o = m.run_cell(cell, a.seed)
        rows.append({"cell": cell.name, "stage": cell.stage, "fault": cell.fault, "file": getattr(cell, "file", "") or getattr(cell, "label", ""), "held": o.held,
                     "result": o.result, "detail": o.detail, "seconds": round(o.seconds, 1)})
        print(f"{cell.name:48s} {'held' if o.held else 'NOT HELD':8s} {o.result:12s} {o.seconds:6.1f} s  {o.detail}",
              flush=True)
    held = sum(r["held"] for r in rows)
    result = {"cells": len(rows), "held": held, "seed": a.seed, "seconds": round(time.perf_counter() - t0, 1),
              "date": time.strftime("%Y-%m-%d"), "machine": f"{platform.processor() or platform.machine()}, "
              f"{__import__('os').cpu_count()} cores", "command": "python bench/fault_matrix.py --seed " + str(a.seed),
              "rows": rows}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"{held} of {len(rows)} cells held ({result['seconds']:.0f} s); {a.out}")
    print("\n| cell | fault | result | what happened |\n| --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['stage']} | {r['fault']}{' ' + Path(r['file']).name if r['file'] else ''} | "
              f"{'held: ' + r['result'] if r['held'] else '**not held**: ' + r['result']} | {r['detail']} |")
    return 0 if held == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
