"""The report: each mode's passes pooled over prompts (tau, per-position acceptance, histogram,
times, speedup against the target-only baseline), the lossless verdicts, per-prompt records, and
the printed table.

tau = new tokens from verify passes / verify passes, summed over all prompts (not a mean of
per-prompt ratios); each pass yields its accepted draft tokens + 1 (the correction or bonus
token); the first token after the prompt comes from the prefill and is not counted.
speedup = speculative tokens/s / target-only tokens/s on the same prompts and device (under greedy
both produce the same tokens, so it is the ratio of wall times)."""

from __future__ import annotations

from typing import Any, Callable

from eyas.evaluate.lossless import compare
from eyas.spec import Generation, SpecStats


def summarize(stats: SpecStats, output_tokens: int, baseline: dict[str, Any] | None) -> dict[str, Any]:
    speedup = None
    if baseline and baseline["wall_s"] > 0 and stats.wall_s > 0 and baseline["output_tokens"] > 0:
        # throughput ratio; under greedy both produce the same tokens, so it is the wall-time ratio
        speedup = (output_tokens / stats.wall_s) / (baseline["output_tokens"] / baseline["wall_s"])
    return {
        "tau": stats.tau,
        "mean_accepted": stats.tau - 1 if stats.verify_passes else 0.0,
        "verify_passes": stats.verify_passes,
        "total_new_tokens": stats.new_tokens,
        "output_tokens": output_tokens,
        "acceptance_per_position": stats.acceptance_per_position(),
        "accept_length_histogram": list(stats.accept_counts),
        "prefill_time_s": stats.prefill_time_s,
        "draft_time_s": stats.draft_time_s,
        "verify_time_s": stats.verify_time_s,
        "wall_s": stats.wall_s,
        "speedup": speedup,
    }


def collect_results(
    base_runs: list[dict[str, Any]] | None, spec_runs: dict[str, list[dict[str, Any]]], check: bool,
    score: Callable[[dict[str, Any], list[int], dict[str, Any]], dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """Pool the runs of every mode; compare with the baseline when `check` (greedy). `score`
    (baseline run, baseline tokens, difference) -> its near-tie verdict; None = no difference is a tie."""
    baseline = None
    if base_runs is not None:
        baseline = {
            "wall_s": sum(r["gen"].wall_s for r in base_runs),
            "output_tokens": sum(len(r["gen"].tokens) for r in base_runs),
        }
    records: dict[tuple[str, int], dict[str, Any]] = {}
    for r in base_runs or []:  # every prompt decoded has a record, also with no speculative mode (simulate)
        records[(r["id"], r["turn"])] = {"id": r["id"], "turn": r["turn"], "prompt_tokens": r["prompt_tokens"],
                                         "target_only": {"output_tokens": len(r["gen"].tokens), "wall_s": r["gen"].wall_s}}
    summaries, divergences = {}, []
    verdicts: dict[tuple[str, str], bool] = {}  # (mode, question) -> near_tie of its latest difference
    for mode, runs in spec_runs.items():
        pooled = SpecStats()
        for i, r in enumerate(runs):
            gen: Generation = r["gen"]
            pooled.merge(gen.stats)
            key = (r["id"], r["turn"])
            rec = records.setdefault(key, {"id": r["id"], "turn": r["turn"], "prompt_tokens": r["prompt_tokens"]})
            entry: dict[str, Any] = {
                "output_tokens": len(gen.tokens),
                "new_tokens": gen.stats.new_tokens,
                "verify_passes": gen.stats.verify_passes,
                "tau": gen.stats.tau,
                "wall_s": gen.wall_s,
            }
            if base_runs is not None:
                ref = base_runs[i]["gen"]
                if check:
                    diff = compare(gen.tokens, ref.tokens)
                    entry["lossless"] = diff is None
                    if diff is not None:
                        if r.get("prompt_ids") != base_runs[i].get("prompt_ids"):
                            # a later turn after a differing answer: another prompt, nothing to score;
                            # it is what the earlier difference made it
                            diff.update(inherited=True, near_tie=verdicts.get((mode, r["id"]), False))
                        else:
                            diff.update(score(base_runs[i], ref.tokens, diff) if score else {"near_tie": False})
                        verdicts[(mode, r["id"])] = diff["near_tie"]
                        entry["first_divergence"] = diff
                        divergences.append({"mode": mode, "id": r["id"], "turn": r["turn"], **diff})
            rec[mode] = entry
        summaries[mode] = summarize(pooled, sum(len(r["gen"].tokens) for r in runs), baseline)
    primary = summaries.get("tree") or summaries.get("chain") or {}  # none: evaluate.mode=simulate
    return {
        **{f"tau_{m}": v["tau"] for m, v in summaries.items()},
        **primary,
        "target_only_wall_s": baseline["wall_s"] if baseline else None,
        "target_only_output_tokens": baseline["output_tokens"] if baseline else None,
        "lossless": (not divergences) if check else None,
        "lossless_up_to_ties": all(d["near_tie"] for d in divergences) if check else None,
        "lossless_checked": check,
        "num_divergent": len(divergences),
        "num_divergent_near_tie": sum(d["near_tie"] for d in divergences),
        "num_divergent_inherited": sum(bool(d.get("inherited")) for d in divergences),
        "first_divergence": divergences[0] if divergences else None,
        "first_unexplained_divergence": next((d for d in divergences if not d["near_tie"]), None),
        "modes": summaries,
        "num_prompts": len(records),
        "records": list(records.values()),
    }


def format_table(results: dict[str, Any]) -> str:
    header = ("mode", "tau", "passes", "new tok", "draft s", "verify s", "wall s", "speedup")
    widths = (-7, 7, 8, 9, 9, 10, 9, 9)  # negative: left-aligned

    def row(*cells) -> str:
        return "".join(f"{c:<{-w}}" if w < 0 else f"{c:>{w}}" for c, w in zip(cells, widths))

    lines = [row(*header)]
    for mode, r in results["modes"].items():
        speedup = f"{r['speedup']:.2f}x" if r["speedup"] is not None else "-"
        times = (f"{r[k]:.2f}" for k in ("draft_time_s", "verify_time_s", "wall_s"))
        lines.append(row(mode, f"{r['tau']:.3f}", r["verify_passes"], r["total_new_tokens"], *times, speedup))
    if results["target_only_wall_s"] is not None:
        tokens, wall = results["target_only_output_tokens"], f"{results['target_only_wall_s']:.2f}"
        lines.append(row("target", "", "", tokens, "", "", wall, "1.00x"))
    for mode, r in results["modes"].items():
        cond = " ".join(f"{p['conditional']:.2f}" for p in r["acceptance_per_position"])
        lines.append(f"{mode} P(accept | reached) by position: {cond or '-'}")
        lines.append(f"{mode} accepted-length histogram: {r['accept_length_histogram']}")
    tf = results.get("teacher_forced")
    if tf and "error" in tf:
        lines.append(f"teacher-forced check failed: {tf['error']['type']}: {tf['error']['message']}")
    elif tf:
        def agree(t, mode: str) -> str:
            return (f"matches decoder on {t['num_matching']} of {t['num_compared']} prompts" if t["num_compared"]
                    else f"simulated; no {mode} decoded to compare (evaluate.mode=simulate)" if not results["modes"]
                    else f"simulated; no {mode} decoded to compare" if mode not in results["modes"]
                    else f"no prompt where the {mode} output is the reference output")

        sim_cond = " ".join(f"{p['conditional']:.2f}" for p in tf["acceptance_per_position"])
        lines.append(f"teacher-forced on {tf['outputs'].replace('_', '-')} outputs: acc "
                     f"{' '.join(f'{a:.2f}' for a in tf['acc'])} tau_hat {tf['tau_hat']:.2f}; "
                     f"simulated chain tau {tf['tau_sim']:.3f}, P(accept | reached) {sim_cond} ({agree(tf, 'chain')})")
        if tf.get("tree"):
            t = tf["tree"]
            t_cond = " ".join(f"{p['conditional']:.2f}" for p in t["acceptance_per_position"])
            lines.append(f"simulated tree {t['tree_total_tokens']}/{t['tree_depth']}/{t['tree_top_k']} tau "
                         f"{t['tau_sim']:.3f}, P(accept | reached) {t_cond} ({agree(t, 'tree')})")
    if results["lossless_checked"]:
        lines.append(f"lossless (greedy == target-only greedy on every prompt): {results['lossless']}")
        if results["num_divergent"]:
            lines.append(f"  {results['num_divergent']} output(s) differ; {results['num_divergent_near_tie']} of them first at "
                         f"a near-tie of the target's logits (relative gap <= {results.get('tie_tolerance', 0):g}): "
                         f"lossless up to {(results.get('settings') or {}).get('dtype', '')} numerics: {results['lossless_up_to_ties']}")
    return "\n".join(lines)
