"""evaluate: speculative decoding with the trained draft — acceptance length tau, per-position
acceptance, draft/verify time, wall-clock speedup over target-only decoding, and a lossless check.

    eyas evaluate --draft runs/eyas/train/final --bench mtbench --mode both
    eyas evaluate recipe.yaml --evaluate.num_questions=10 --evaluate.temperature=0.7

One process on one device (decoding is one sequence at a time; there is no torchrun form).
Everything runs in-process with HF models (eyas.spec): the target verifies with a KV cache and
hands the draft its aux hidden states exactly as the extract stage captured them for training.

Per prompt (MT-bench: 2 turns per question; turn 2 is rendered with the model's own turn-1
answer) the target-only baseline and each mode decode with the same prompts, seeds and device;
one warm-up generation of each precedes the timed ones. Under greedy decoding every speculative
output is compared with the baseline token for token (`lossless_check`). In fp32 they are equal.
In bf16/fp16 a verify pass over several tokens and a one-token decode round differently, and
where the target's top two tokens are nearly tied the greedy choice can flip; from there the
outputs differ. So at each first difference the target scores both chosen tokens in a plain
forward (no cache) of the common prefix: within `tie_tolerance` of each other it is a near-tie
(counted, reported); otherwise the run fails (exit 2) after results.json is written, naming the
position and both logits.

Under greedy with a chain mode, `teacher_forced` re-derives the chain decoder from the draft's
training-time forward (eyas.spec.simulate): one plain target forward and one TTT forward per
prompt over the target-only greedy output give the per-step accuracy as training measures it
(acc_T, tau_hat) and the chain decoder's passes simulated from it (tau_sim), which must equal the
measured ones (exactly in float32) wherever the chain's output is the target-only output. A low
tau with a high acc_T and matching simulation is the data (domain shift); a mismatch is a
train/serve difference in the decoder. Mode simulate decodes target-only only (whatever
measure_speedup and lossless_check say) and reports this simulated chain alone
(`tau_chain_simulated`).

Output (RUN_DIR/evaluate/): results.json (tau_chain / tau_tree, per-position acceptance,
accepted-length histogram, times, speedup, lossless, teacher_forced, per-prompt records),
meta.json, config.yaml, and under greedy target_outputs.json (the target-only outputs with what
they depend on: `evaluate.target_outputs` lets a later simulate run of another draft read them
instead of decoding them again).

Modules: inputs (bench, prompts, placement, the target-outputs file), decoding (setup, decoders,
the run over the questions), lossless (the check and its near-tie scoring), teacher_forced (the
simulated decoders), report (pooling, the table).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

from eyas import artifacts
from eyas.assets import sha256_file
from eyas.config import EyasConfig, dump_config, to_dict
from eyas.errors import EyasError, describe_exception, exception_message
from eyas.evaluate.decoding import Setup, decode_questions, decoder, load_setup, warm_up
from eyas.draft_files import DraftFiles
from eyas.evaluate.inputs import (TARGET_OUTPUTS, bench_hash, load_bench, outputs_key, read_target_outputs, replay,
                                  with_context, write_target_outputs)
from eyas.evaluate.lossless import check_lossless, score_divergence, tie_tolerance
from eyas.evaluate.report import collect_results, format_table
from eyas.evaluate.teacher_forced import teacher_forced_chain
from eyas.spec import Generation
from eyas.target import describe_target


def main(cfg: EyasConfig) -> dict[str, Any]:
    ec = cfg.evaluate
    out_dir = cfg.stage_dir("evaluate")
    questions = load_bench(ec.bench, ec.num_questions)  # before any model: a bad bench fails fast
    if ec.backend == "vllm":
        from eyas.evaluate import vllm

        results, files, modes, reused = *vllm.evaluate(cfg, questions, out_dir), ["chain"], None
    else:
        results, files, modes, reused = in_process(cfg, questions, out_dir)
    results["num_questions"] = done = results.pop("done")
    results["questions_requested"] = len(questions)
    results["stopped_early"] = done < len(questions)
    results["target_outputs"] = str(reused) if reused else None  # read there, their wall times those of that run
    write(cfg, out_dir, results, files, bench_hash(ec.bench), reused, modes)
    print(format_table(results))
    check_lossless(results, results["tie_tolerance"], out_dir / "results.json")
    if (results["teacher_forced"] or {}).get("error"):
        err = results["teacher_forced"]["error"]
        skip = ("evaluate.mode=simulate is that check: --evaluate.mode=chain decodes instead" if ec.mode == "simulate"
                else "--evaluate.teacher_forced=false skips the check")
        raise EyasError(f"evaluate: the teacher-forced check failed ({err['type']}: {err['message']}); the decoding "
                        f"results are in {out_dir / 'results.json'}; {skip}")
    return results


def in_process(cfg: EyasConfig, questions: list[dict[str, Any]], out_dir: Path):
    """The target and the draft in this process (eyas.spec) -> (results, the draft's files, modes,
    the stored target outputs read instead of decoding, if any)."""
    ec = cfg.evaluate
    key = outputs_key(cfg, questions)
    reused, stored = read_target_outputs(ec.target_outputs, key) if ec.target_outputs else (None, None)
    s = load_setup(cfg)
    questions = with_context(questions, s.tok, ec.context_tokens)
    simulate = ec.mode == "simulate"  # target-only decoding, the chain simulated from it
    modes = [] if simulate else ["chain", "tree"] if ec.mode == "both" else [ec.mode]
    check = ec.temperature == 0 and ec.lossless_check and not simulate
    if reused is None:
        warm_up(s, ec, questions, modes)
    decoders: dict[str | None, Callable[[torch.Tensor], Generation]] = {}
    if reused is not None:
        print(f"[eyas:evaluate] target-only outputs from {reused} (evaluate.target_outputs), not decoded", flush=True)
        decoders[None] = replay(stored, reused)
    elif check or ec.measure_speedup or simulate:
        decoders[None] = decoder(s, ec, None, ec.max_new_tokens)
    decoders.update({m: decoder(s, ec, m, ec.max_new_tokens) for m in modes})
    names = ", ".join("target-only" if m is None else m for m in decoders)
    print(f"[eyas:evaluate] {len(questions)} questions ({sum(len(q['turns']) for q in questions)} prompts), each "
          f"decoded by: {names}", flush=True)
    runs, done, decode_s = decode_questions(s, decoders, questions, ec.max_seconds)
    phase_s: dict[str, float | None] = {"decode": decode_s, "teacher_forced": None}
    base_runs = runs.pop(None, None)
    spec_runs = runs
    out_dir.mkdir(parents=True, exist_ok=True)
    if base_runs is not None and ec.temperature == 0:
        write_target_outputs(out_dir, key, base_runs, complete=done == len(questions))
    rel_tol = tie_tolerance(ec, s.dtype)
    tc = time.perf_counter()
    results = collect_results(
        base_runs, spec_runs, check,
        score=lambda base, ref, diff: score_divergence(s.target, base["prompt_ids"], ref, diff, rel_tol),
    )  # fmt: skip
    phase_s["compare"] = time.perf_counter() - tc
    results["tie_tolerance"] = rel_tol
    tt = time.perf_counter()
    results["teacher_forced"] = teacher_forced(s, ec, base_runs, spec_runs, phase_s)
    if results["teacher_forced"] is not None:
        phase_s["teacher_forced"] = time.perf_counter() - tt
    results["phase_s"] = phase_s
    tf = results["teacher_forced"]
    results["tau_chain_simulated"] = tf["tau_sim"] if tf and "error" not in tf else None
    results["tau_tree_simulated"] = tf["tree"]["tau_sim"] if tf and "error" not in tf and tf["tree"] else None
    results["done"] = done
    results["settings"] = settings(s, ec)
    return results, s.draft_files, modes, reused


def teacher_forced(s: Setup, ec, base_runs, spec_runs, phase_s: dict[str, float | None]) -> dict[str, Any] | None:
    """`teacher_forced_chain` where it applies (greedy; a chain mode, simulate, or a tree to simulate),
    on the target-only outputs when they were decoded, else on a decoder's own (greedy) ones. Its
    failure is recorded (a diagnostic: the decoding results are kept and the run fails after them)."""
    simulate = ec.mode == "simulate"
    sim_tree = ec.simulate_tree and ("tree" in spec_runs or simulate)
    if not (ec.teacher_forced and ec.temperature == 0 and ("chain" in spec_runs or simulate or sim_tree)):
        return None
    ref_runs = base_runs if base_runs is not None else spec_runs["chain" if "chain" in spec_runs else "tree"]
    print(f"[eyas:evaluate] decoded in {phase_s['decode']:.1f} s, compared in {phase_s['compare']:.1f} s; "
          f"teacher-forced check on {len(ref_runs)} prompts", flush=True)
    try:
        tree = (ec.tree_total_tokens, ec.tree_depth, ec.tree_top_k) if sim_tree else None
        return teacher_forced_chain(s.target, s.draft, ec.num_draft_tokens, ref_runs, spec_runs.get("chain"), tree,
                                    spec_runs.get("tree"))
    except Exception as e:  # recorded with type, message and traceback; main raises after writing the results
        err = describe_exception(e)
        print(f"[eyas:evaluate] the teacher-forced check failed: {type(e).__name__}: {exception_message(e)}\n"
              f"{err['traceback']}", file=sys.stderr, flush=True)
        return {"error": err}


def settings(s: Setup, ec) -> dict[str, Any]:
    """What the numbers were measured under (results.json `settings`)."""
    return {
        "mode": ec.mode,
        "temperature": ec.temperature,
        "max_new_tokens": ec.max_new_tokens,
        "num_draft_tokens": ec.num_draft_tokens,
        "tree_total_tokens": ec.tree_total_tokens,
        "tree_depth": ec.tree_depth,
        "tree_top_k": ec.tree_top_k,
        "seed": s.seed,
        "device": str(s.device),
        "cuda_graphs": s.engine is not None,
        "dtype": str(s.dtype).replace("torch.", ""),
        "draft": str(s.draft_files.dir),
        "bench": ec.bench,
        "context_tokens": ec.context_tokens,
        "backend": "hf",
    }


def write(cfg: EyasConfig, out_dir: Path, results: dict[str, Any], files: DraftFiles, bench: str,
          reused: Path | None, modes: list[str]) -> None:
    """results.json, config.yaml and meta.json (last: the output is complete)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    artifacts.atomic_write_json(out_dir / "results.json", results)
    artifacts.atomic_write_text(out_dir / "config.yaml", dump_config(cfg))
    artifacts.write_meta(
        out_dir,
        "evaluate",
        files=artifacts.file_record(out_dir, [f for f in ("results.json", TARGET_OUTPUTS) if (out_dir / f).is_file()]),
        config={"target": to_dict(cfg.target), "evaluate": to_dict(cfg.evaluate)},
        target=describe_target(cfg.target),
        draft=str(files.dir),
        hashes={"draft_weights": sha256_file(files.weights), "bench": bench,
                **({"target_outputs": sha256_file(reused)} if reused else {})},
        counts={
            "questions": results["num_questions"],
            "questions_requested": results["questions_requested"],
            "prompts": results["num_prompts"],
            **{f"tau_{m}": results[f"tau_{m}"] for m in modes},
            **({"tau_chain_simulated": results["tau_chain_simulated"]} if cfg.evaluate.mode == "simulate" else {}),
            **({"tau_tree_simulated": results["tau_tree_simulated"]}
               if results["tau_tree_simulated"] is not None else {}),
        },
    )
