"""Chain (or tree) tau of an `eyas evaluate` run on MT-bench, by turn and by category: the new
tokens over the verify passes of the prompts in each group.

    python tools/mtbench_breakdown.py RUN_DIR/evaluate/results.json [MORE results.json ...] [--mode tree]

Input: results.json of `eyas evaluate` runs on MT-bench. The counts come from the decoded chain's
records or, for a `--evaluate.mode=simulate` run, from the simulated `teacher_forced.prompts`; with
`--mode tree` from the tree's records, or the simulated tree's `teacher_forced.tree.prompts`.
Output: a Markdown table on stdout, one row per group (all, turn 1, turn 2, each category) and one
column per results.json (e.g. two drafts evaluated on the same outputs):

    python tools/mtbench_breakdown.py runs/a/evaluate/results.json runs/b/evaluate/results.json

A run whose `--evaluate.bench` was a copy of the embedded MT-bench question.jsonl (a file path
rather than `mtbench`) counts as MT-bench with `--copy-of-mtbench`: every prompt's question id must
then be one of MT-bench's.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

from eyas.assets import mtbench_path


def prompt_counts(results: dict, mode: str = "chain") -> list[tuple[str, int, int, int]]:
    """-> (question id, turn, new tokens, verify passes) per prompt."""
    decoded = [r for r in results["records"] if mode in r]
    if decoded:
        return [(r["id"], r["turn"], r[mode]["new_tokens"], r[mode]["verify_passes"]) for r in decoded]
    tf = results.get("teacher_forced") or {}
    sim = tf if mode == "chain" else tf.get("tree") or {}
    if not sim.get("prompts"):
        where = "teacher_forced.prompts" if mode == "chain" else "teacher_forced.tree.prompts"
        raise SystemExit(f"no {mode} records and no {where} in this results.json")
    return [(p["id"], p["turn"], p["new_tokens"], p["verify_passes"]) for p in sim["prompts"]]


def groups(counts, category: dict[str, str]) -> dict[str, float]:
    sums: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for qid, turn, new, passes in counts:
        for g in ("all", f"turn {turn + 1}", category.get(qid, "?")):
            sums[g][0] += new
            sums[g][1] += passes
    return {g: new / max(passes, 1) for g, (new, passes) in sums.items()}


def main(paths: list[str], mode: str = "chain", copy_of_mtbench: bool = False) -> None:
    category = {str(q["question_id"]): q["category"]
                for q in map(json.loads, filter(str.strip, Path(mtbench_path()).read_text().splitlines()))}
    columns = []
    for p in paths:
        results = json.loads(Path(p).read_text())
        bench = results["settings"]["bench"]
        if bench not in ("mtbench", "embedded:mtbench") and not copy_of_mtbench:
            raise SystemExit(f"{p}: evaluated on {bench!r}, not MT-bench: no categories to split by "
                             f"(--copy-of-mtbench if that file is a copy of it)")
        counts = prompt_counts(results, mode)
        unknown = sorted({q for q, *_ in counts} - category.keys())
        if unknown:
            raise SystemExit(f"{p}: question ids {unknown[:5]} are not MT-bench's: no categories to split by")
        columns.append(groups(counts, category))
    names = ["all", "turn 1", "turn 2", *sorted({g for c in columns for g in c} - {"all", "turn 1", "turn 2"})]
    print("| group | " + " | ".join(paths) + " |")
    print("| --- |" + " --- |" * len(paths))
    for g in names:
        print(f"| {g} | " + " | ".join(f"{c[g]:.2f}" if g in c else "-" for c in columns) + " |")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", nargs="+", help="results.json of `eyas evaluate` runs on MT-bench")
    ap.add_argument("--mode", choices=("chain", "tree"), default="chain")
    ap.add_argument("--copy-of-mtbench", action="store_true",
                    help="the runs' bench file is a copy of the embedded MT-bench question.jsonl")
    args = ap.parse_args()
    main(args.results, args.mode, args.copy_of_mtbench)
