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
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

from eyas import artifacts
from eyas.assets import sha256_file
from eyas.config import EyasConfig, dump_config, to_dict
from eyas.errors import ArtifactError, ConfigError, DataError, EyasError, describe_exception, exception_message
from eyas.spec import Generation, SpecStats, speculative_generate, target_generate
from eyas.target import describe_target, load_model, load_tokenizer, resolve_dtype

WARMUP_TOKENS = 8


class LosslessError(EyasError):
    """Greedy speculative output differs from target-only greedy output."""


# --- inputs -------------------------------------------------------------------------------------


def load_bench(bench: str, num_questions: int = 0) -> list[dict[str, Any]]:
    """-> [{"id", "turns": [user message, ...]}]: MT-bench or a JSONL file (see EvaluateConfig.bench)."""
    from eyas.assets import load_mtbench

    if bench in ("mtbench", "embedded:mtbench"):
        questions = [
            {"id": str(q.get("question_id", i)), "turns": list(q["turns"])} for i, q in enumerate(load_mtbench())
        ]
    else:
        path = Path(bench)
        if not path.is_file():
            raise ConfigError(f"evaluate.bench={bench!r}: not `mtbench` and no such file")
        questions = []
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if line.strip():
                    questions.append(_bench_record(path, lineno, line))
        if not questions:
            raise DataError(f"{path}: no prompts (expected one JSON object or string per line)")
    return questions[:num_questions] if num_questions else questions


def _bench_record(path: Path, lineno: int, line: str) -> dict[str, Any]:
    try:
        rec = json.loads(line)
    except json.JSONDecodeError as e:
        raise DataError(f"{path}:{lineno}: malformed JSON line: {e.msg}") from None
    if isinstance(rec, str):
        rec = {"turns": [rec]}
    elif isinstance(rec, dict) and "turns" not in rec and isinstance(rec.get("prompt"), str):
        rec = {**rec, "turns": [rec["prompt"]]}
    turns = rec.get("turns") if isinstance(rec, dict) else None
    if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t.strip() for t in turns):
        raise DataError(
            f'{path}:{lineno}: expected {{"turns": [non-empty strings]}}, {{"prompt": "..."}} or a JSON string'
        )
    return {"id": str(rec.get("question_id", rec.get("id", lineno))), "turns": turns}


def bench_hash(bench: str) -> str:
    from eyas.assets import mtbench_path

    return sha256_file(mtbench_path() if bench in ("mtbench", "embedded:mtbench") else bench)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"evaluate.device={name!r} but CUDA is not available; use --evaluate.device=cpu")
    return torch.device(name)


def default_draft_dir(cfg: EyasConfig) -> Path:
    """evaluate.draft's default: the trained checkpoint, or the export when export.average_with
    makes the exported draft another one (the mean of several): evaluate what is served."""
    if cfg.export.average_with:
        return cfg.stage_dir("export")  # resolve_draft_dir picks a layout inside it
    return Path(cfg.run_dir) / "train" / "final"


def resolve_draft_dir(draft_dir: Path) -> Path:
    """eyas's checkpoint or one exported layout; `eyas export`'s output root -> a layout inside it."""
    from eyas.draft import DRAFT_CONFIG

    if not draft_dir.is_dir():
        raise ArtifactError(
            f"evaluate.draft={str(draft_dir)!r}: no such directory (train a draft with `eyas train`, "
            "or point --evaluate.draft at one)"
        )
    if (draft_dir / DRAFT_CONFIG).is_file() or (draft_dir / "config.json").is_file():
        return draft_dir
    layouts = [draft_dir / f for f in ("speculators", "sglang") if (draft_dir / f / "config.json").is_file()]
    return layouts[0] if layouts else draft_dir


def draft_weights_file(draft_dir: Path) -> Path:
    from eyas.draft import DRAFT_WEIGHTS

    own = draft_dir / DRAFT_WEIGHTS
    return own if own.is_file() else draft_dir / "model.safetensors"


def load_eval_draft(draft_dir: Path, embed_weight_VD: torch.Tensor, device: torch.device, dtype: torch.dtype):
    """eyas's own checkpoint (draft_config.json) via load_draft, else an exported directory."""
    from eyas.draft import DRAFT_CONFIG, load_draft

    draft_dir = resolve_draft_dir(draft_dir)
    if (draft_dir / DRAFT_CONFIG).is_file():
        draft = load_draft(draft_dir, embed_weight_VD, device=device)
    else:
        from eyas.export import load_exported

        draft = load_exported(draft_dir, embed_weight_VD)
    return draft.to(device=device, dtype=dtype).eval().requires_grad_(False)


def check_draft_fits(draft, target) -> None:
    """The draft must have been built for this target: vocab, hidden size, aux layers."""
    from eyas.capture import num_layers, text_config

    c, t = draft.config, text_config(target)
    problems = []
    if c.vocab_size != t.vocab_size:
        problems.append(f"vocab size {c.vocab_size} != target's {t.vocab_size}")
    if c.target_hidden_size != t.hidden_size:
        problems.append(f"target_hidden_size {c.target_hidden_size} != target's hidden size {t.hidden_size}")
    ids = list(c.aux_layer_ids)
    if len(ids) != c.num_aux_layers or not all(0 <= k < num_layers(target) for k in ids):
        problems.append(
            f"aux_layer_ids {ids} do not fit num_aux_layers={c.num_aux_layers} and a {num_layers(target)}-layer target"
        )
    if problems:
        raise ArtifactError(
            "the draft does not fit the target (" + "; ".join(problems) + "): pass the target it was trained "
            "for with --target.model, or the matching draft with --evaluate.draft"
        )


def stop_token_ids(tok, target) -> frozenset[int]:
    """End-of-turn ids: the tokenizer's eos and the generation config's eos list."""
    ids = set()
    for src in (tok.eos_token_id, getattr(getattr(target, "generation_config", None), "eos_token_id", None)):
        if isinstance(src, int):
            ids.add(src)
        elif isinstance(src, (list, tuple)):
            ids.update(int(i) for i in src)
    return frozenset(ids)


def render(tok, messages: list[dict[str, str]]) -> list[int]:
    """The target's chat template with the generation prompt, tokenised without extra specials."""
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tok(text, add_special_tokens=False)["input_ids"]


# --- running ------------------------------------------------------------------------------------


def run_conversations(
    generate: Callable[[torch.Tensor], Generation], tok, questions: list[dict[str, Any]], device, stop_ids
) -> list[dict[str, Any]]:
    """Decode every turn of every question with `generate`; turn i+1 sees the model's own answer i.
    -> one record per turn: id, turn, prompt_tokens, tokens, wall_s, stats."""
    out = []
    for q in questions:
        messages: list[dict[str, str]] = []
        for turn, user in enumerate(q["turns"]):
            messages.append({"role": "user", "content": user})
            ids = render(tok, messages)
            gen = generate(torch.tensor(ids, device=device))
            out.append({"id": q["id"], "turn": turn, "prompt_tokens": len(ids), "prompt_ids": ids, "gen": gen})
            answer = tok.decode([t for t in gen.tokens if t not in stop_ids], skip_special_tokens=True)
            messages.append({"role": "assistant", "content": answer})
    return out


PROGRESS_EVERY_S = 30.0
"""Seconds between the decoding's progress lines (and one after the last question)."""


def progress_line(runs: dict[str | None, list[dict[str, Any]]], done: int, total: int, elapsed_s: float) -> str:
    """`[eyas:evaluate] 12/80 questions in 61 s: target-only 4,812 tok in 25.1 s, chain tau 3.210 over
    1,482 passes in 12.3 s, ...`: each decoder's tokens or τ (pooled over its passes) and wall time so far."""
    parts = []
    for mode, rs in runs.items():
        wall = sum(r["gen"].wall_s for r in rs)
        if mode is None:
            parts.append(f"target-only {sum(len(r['gen'].tokens) for r in rs):,} tok in {wall:.1f} s")
        else:
            pooled = SpecStats()  # pooled as collect_results pools them
            for r in rs:
                pooled.merge(r["gen"].stats)
            parts.append(f"{mode} tau {pooled.tau:.3f} over {pooled.verify_passes:,} passes in {wall:.1f} s")
    return f"[eyas:evaluate] {done}/{total} questions in {elapsed_s:.0f} s: " + ", ".join(parts)


def first_divergence(spec: list[int], ref: list[int]) -> int | None:
    """Index of the first differing new token (a length difference counts), None when equal."""
    for i, (a, b) in enumerate(zip(spec, ref)):
        if a != b:
            return i
    return None if len(spec) == len(ref) else min(len(spec), len(ref))


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


def _generator(device: torch.device, seed: int) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


@dataclasses.dataclass
class Setup:
    tok: Any
    target: Any
    draft: Any
    device: torch.device
    dtype: torch.dtype
    draft_dir: Path
    stop_ids: frozenset[int]
    seed: int
    engine: Any = None


def target_placement(cfg: EyasConfig):
    """-> (device, the target config with evaluate.dtype applied, its torch dtype)."""
    ec = cfg.evaluate
    device = resolve_device(ec.device)
    target_cfg = dataclasses.replace(cfg.target, dtype=ec.dtype) if ec.dtype else cfg.target
    return device, target_cfg, resolve_dtype(target_cfg.dtype, str(device))


def load_setup(cfg: EyasConfig) -> Setup:
    ec = cfg.evaluate
    draft_dir = resolve_draft_dir(Path(ec.draft) if ec.draft else default_draft_dir(cfg))
    device, target_cfg, dtype = target_placement(cfg)
    tok = load_tokenizer(target_cfg)
    # sdpa: tree verification passes a custom 4-D mask, which flash-attention kernels do not take
    target = load_model(target_cfg, device=device, attn_implementation="sdpa")
    draft = load_eval_draft(draft_dir, target.get_input_embeddings().weight, device, dtype)
    check_draft_fits(draft, target)
    seed = cfg.seed if ec.seed < 0 else ec.seed
    engine = None
    if device.type == "cuda" and ec.cuda_graphs:
        from eyas.spec.static import StaticEngine

        engine = StaticEngine(target, draft, max_len=ec.max_context)
    return Setup(tok, target, draft, device, dtype, draft_dir, stop_token_ids(tok, target), seed, engine)


def decoder(s: Setup, ec, mode: str | None, max_new_tokens: int) -> Callable[[torch.Tensor], Generation]:
    """prompt ids -> Generation: target-only (mode None) or speculative in `mode`, fresh seeded RNG."""
    gen = _generator(s.device, s.seed)
    if mode is None:
        return lambda ids: target_generate(
            s.target, ids, max_new_tokens=max_new_tokens, temperature=ec.temperature, generator=gen,
            stop_ids=s.stop_ids, engine=s.engine,
        )  # fmt: skip
    return lambda ids: speculative_generate(
        s.target, s.draft, ids, max_new_tokens=max_new_tokens, mode=mode, num_draft_tokens=ec.num_draft_tokens,
        tree_total_tokens=ec.tree_total_tokens, tree_depth=ec.tree_depth, tree_top_k=ec.tree_top_k,
        temperature=ec.temperature, generator=gen, stop_ids=s.stop_ids, engine=s.engine,
    )  # fmt: skip


def warm_up(s: Setup, ec, questions: list[dict[str, Any]], modes: list[str]) -> None:
    """One short generation per decoder (kernels, allocator, lazy inits), not timed."""
    ids = torch.tensor(render(s.tok, [{"role": "user", "content": questions[0]["turns"][0]}]), device=s.device)
    for mode in [None, *modes]:
        decoder(s, ec, mode, WARMUP_TOKENS)(ids)


TARGET_OUTPUTS = "target_outputs.json"
"""Written by every greedy evaluation that decodes target-only; evaluate.target_outputs reads it."""


def outputs_key(cfg: EyasConfig, questions: list[dict[str, Any]]) -> dict[str, Any]:
    """What target-only greedy outputs depend on, known before any model loads (the chat template
    is checked afterwards, by rendering every prompt again)."""
    device, _, dtype = target_placement(cfg)
    target = {k: v for k, v in describe_target(cfg.target).items() if k not in ("dtype", "path")}  # where, not what
    if "asset" in target:  # an embedded target: its file's sha256, not where the package put it
        target["asset"] = {k: v for k, v in target["asset"].items() if k != "source"}
    key = {"target": target, "dtype": str(dtype).replace("torch.", ""), "device": device.type,
           "bench": bench_hash(cfg.evaluate.bench), "questions": [q["id"] for q in questions],
           "max_new_tokens": cfg.evaluate.max_new_tokens}
    if device.type == "cuda":  # static caches and graphs round bf16 otherwise than transformers' own decoding
        key["cuda_graphs"] = cfg.evaluate.cuda_graphs
    return key


def write_target_outputs(out_dir: Path, key: dict[str, Any], runs: list[dict[str, Any]], complete: bool) -> None:
    artifacts.atomic_write_json(out_dir / TARGET_OUTPUTS, {"key": key, "complete": complete, "runs": [
        {"id": r["id"], "turn": r["turn"], "prompt_ids": r["prompt_ids"], "tokens": r["gen"].tokens,
         "wall_s": r["gen"].wall_s} for r in runs]})


def read_target_outputs(where: str, key: dict[str, Any]) -> tuple[Path, list[dict[str, Any]]]:
    """evaluate.target_outputs -> (the file, its runs), refused unless made under `key` and complete."""
    path = Path(where) / TARGET_OUTPUTS if Path(where).is_dir() else Path(where)
    if not path.is_file():
        raise ConfigError(f"evaluate.target_outputs={where!r}: no {path.name} there (a greedy evaluation that decodes "
                          f"target-only writes one into its output directory)")
    try:
        data = json.loads(path.read_text())
        theirs, runs, complete = data["key"], data["runs"], data["complete"]
        if not isinstance(theirs, dict) or not all(isinstance(r, dict) and {"id", "turn", "prompt_ids", "tokens",
                                                                           "wall_s"} <= r.keys() for r in runs):
            raise TypeError("a key that is no object, or a run without id, turn, prompt_ids, tokens or wall_s")
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
        raise DataError(f"{path}: not a {TARGET_OUTPUTS} ({type(e).__name__}: {exception_message(e)})") from e

    def shown(k, v):
        return f"{len(v)} questions" if k == "questions" and isinstance(v, list) else repr(v)

    diff = [f"{k} {shown(k, theirs.get(k))} there, {shown(k, v)} here" for k, v in key.items() if theirs.get(k) != v]
    if diff:
        raise ConfigError(f"evaluate.target_outputs={where!r} was decoded under other settings ({'; '.join(diff)}): "
                          f"drop evaluate.target_outputs to decode them again")
    if not complete:
        raise ConfigError(f"evaluate.target_outputs={where!r}: that evaluation stopped before its last question "
                          f"(evaluate.max_seconds); its {len(runs)} outputs do not cover these prompts")
    return path, runs


def replay(runs: list[dict[str, Any]], source: Path) -> Callable[[torch.Tensor], Generation]:
    """A target-only decoder for `run_conversations` that hands back stored outputs in order, each
    after checking that the prompt rendered here (from the stored earlier answers) is the stored one."""
    stored = iter(runs)

    def generate(ids: torch.Tensor) -> Generation:
        r = next(stored, None)
        if r is None:
            raise DataError(f"{source}: {len(runs)} outputs, fewer than the prompts asked for")
        if r["prompt_ids"] != ids.tolist():
            at = first_divergence(ids.tolist(), r["prompt_ids"])
            raise DataError(f"{source}: question {r['id']} turn {r['turn']}: the prompt renders to other tokens here "
                            f"(first difference at token #{at}): another tokenizer or chat template; drop "
                            f"evaluate.target_outputs to decode them again")
        return Generation(list(r["tokens"]), float(r["wall_s"]))

    return generate


def compare(spec: list[int], ref: list[int]) -> dict[str, Any] | None:
    """None when equal, else the first diverging new-token index and both tokens there."""
    pos = first_divergence(spec, ref)
    if pos is None:
        return None
    return {
        "position": pos,
        "speculative": spec[pos] if pos < len(spec) else None,
        "target_only": ref[pos] if pos < len(ref) else None,
    }


def tie_tolerance(ec, dtype: torch.dtype) -> float:
    if ec.tie_tolerance >= 0:
        return ec.tie_tolerance
    return {torch.bfloat16: 2**-6, torch.float16: 2**-9}.get(dtype, 1e-4)


def tie_scale(la: float, lb: float) -> float:
    """The power of two just above the largest of |la|, |lb| and 1: the top of the larger's binade.

    A float's spacing is constant within a binade [2^e, 2^(e+1)), so 2^-6 x 2^(e+1) is four units
    in the last place of a bfloat16 anywhere in it (2^-9: of a float16). Scaling by the magnitude
    itself would allow four units at the top of a binade but only 2.8 at 1.4 x its bottom."""
    return math.ldexp(1.0, math.frexp(max(abs(la), abs(lb), 1.0))[1])


@torch.no_grad()
def score_divergence(target, prompt_ids: list[int], ref: list[int], diff: dict[str, Any], rel_tol: float) -> dict[str, Any]:
    """The target's logits for the two tokens chosen at a first difference, from a plain forward
    (no cache, one pass) of the prompt and the common prefix; near_tie when they are within
    rel_tol x tie_scale(both logits) of each other and the better of them is as close to
    the forward's top logit (else both decoders missed the top token: not a tie, a bug they share).
    A length difference (one output ended) is never a tie."""
    a, b = diff["target_only"], diff["speculative"]
    if a is None or b is None:
        return {"near_tie": False}
    device = target.get_input_embeddings().weight.device
    ids = torch.tensor([prompt_ids + ref[: diff["position"]]], device=device)
    logits_V = target(input_ids=ids, use_cache=False, logits_to_keep=1).logits[0, -1].float()
    la, lb, top = float(logits_V[a]), float(logits_V[b]), float(logits_V.max())
    gap, scale = abs(la - lb), tie_scale(la, lb)
    tol = rel_tol * scale
    return {"logit_target_only": la, "logit_speculative": lb, "logit_gap": gap, "logit_top": top,
            "plain_forward_top1": int(logits_V.argmax()), "near_tie": gap <= tol and top - max(la, lb) <= tol}


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


@torch.no_grad()
def teacher_forced_chain(
    target, draft, k: int, ref_runs: list[dict[str, Any]], chain_runs: list[dict[str, Any]] | None,
    tree: tuple[int, int, int] | None = None, tree_runs: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """The greedy chain decoder with k drafts simulated on the greedy outputs of `ref_runs`
    (eyas.spec.simulate): per prompt one plain target forward (aux states, eyas.capture) and one
    TTT forward of the draft over prompt + output. acc[i]: TTT step i's top-1 == the output token
    it predicts, over every output token (as training's acc_T); tau_hat from acc as training logs
    it; tau_sim etc.: the simulated passes, pooled (a pass running past a prompt's output counts
    its lower bound); `prompts`: each prompt's simulated passes and tokens, for splits by turn.
    Where chain_runs[i] decoded the same prompt into the same output, its measured passes are
    compared with the simulated ones (`SimulatedChain.matches`); chain_runs None
    (evaluate.mode=simulate): nothing to compare. `tree` = (total_tokens, depth, top_k): the greedy
    tree decoder simulated too (eyas.spec.simulate.simulate_tree, from the same aux states), under
    "tree", compared with `tree_runs` the same way."""
    from eyas.capture import capture
    from eyas.spec.simulate import label_mask, simulate_chain, simulate_tree, teacher_forced_steps
    from eyas.train.loss import acceptance_length

    t0 = time.perf_counter()
    device = target.get_input_embeddings().weight.device
    layer_ids = list(draft.config.aux_layer_ids)
    correct_T = torch.zeros(k, dtype=torch.long, device=device)
    valid_T = torch.zeros(k, dtype=torch.long, device=device)
    chain, trees, tree_s = _SimulatedPasses(), _SimulatedPasses(), 0.0
    none = [None] * len(ref_runs)
    for ref, run, trun in zip(ref_runs, chain_runs or none, tree_runs or none):
        start = len(ref["prompt_ids"])
        ids_S = torch.tensor(ref["prompt_ids"] + ref["gen"].tokens, device=device)
        try:
            aux_1SKD, _ = capture(target, ids_S[None], layer_ids=layer_ids)
            correct_TS = teacher_forced_steps(draft, aux_1SKD[0], ids_S, k, first_label=start)
            if tree is not None:
                tt = time.perf_counter()
                sim = simulate_tree(draft, aux_1SKD[0], ids_S, start, ids_S.shape[0],
                                    top_k=tree[2], depth=tree[1], total_tokens=tree[0])
                trees.add(sim, ref, trun)
                tree_s += time.perf_counter() - tt
        except Exception as e:  # which prompt: the caller records type, message and the chained traceback
            raise EyasError(f"question {ref['id']} turn {ref['turn']} ({ids_S.shape[0]} tokens): "
                            f"{type(e).__name__}: {exception_message(e)}") from e
        correct_T += correct_TS.sum(1)
        valid_T += label_mask(k, ids_S.shape[0], start, device).sum(1)
        chain.add(simulate_chain(correct_TS, start, ids_S.shape[0], k), ref, run)  # one host copy per prompt
    acc = (correct_T / valid_T.clamp(min=1)).tolist()
    return {
        "outputs": "chain" if ref_runs is chain_runs else "tree" if ref_runs is tree_runs else "target_only",
        "num_draft_tokens": k,
        "num_prompts": len(ref_runs),
        "acc": acc,
        "num_positions": valid_T.tolist(),
        "tau_hat": acceptance_length(acc),
        **chain.fields(),
        "tree": None if tree is None else {
            "tree_total_tokens": tree[0], "tree_depth": tree[1], "tree_top_k": tree[2], **trees.fields(),
            "wall_s": tree_s,
        },
        "wall_s": time.perf_counter() - t0,
    }


class _SimulatedPasses:
    """One simulated decoder's passes pooled over prompts, and where a decoder produced the same
    output for a prompt, whether its measured passes are the simulated ones (`matches`)."""

    def __init__(self) -> None:
        self.pooled, self.compared, self.mismatches, self.prompts = SpecStats(), 0, [], []

    def add(self, sim, ref: dict[str, Any], run: dict[str, Any] | None) -> None:
        stats = sim.stats()
        self.pooled.merge(stats)
        self.prompts.append({"id": ref["id"], "turn": ref["turn"], "verify_passes": stats.verify_passes,
                             "new_tokens": stats.new_tokens})
        if run is not None and run["prompt_ids"] == ref["prompt_ids"] and run["gen"].tokens == ref["gen"].tokens:
            self.compared += 1
            if not sim.matches(run["gen"].stats):
                self.mismatches.append({"id": run["id"], "turn": run["turn"], "simulated": sim.accepted,
                                        "last_is_lower_bound": sim.last_is_lower_bound,
                                        "decoder_histogram": list(run["gen"].stats.accept_counts)})

    def fields(self) -> dict[str, Any]:
        return {
            "tau_sim": self.pooled.tau,
            "verify_passes": self.pooled.verify_passes,
            "acceptance_per_position": self.pooled.acceptance_per_position(),
            "accept_length_histogram": list(self.pooled.accept_counts),
            "num_compared": self.compared,
            "num_matching": self.compared - len(self.mismatches),
            "matches_decoder": not self.mismatches if self.compared else None,
            "mismatches": self.mismatches,
            "prompts": self.prompts,
        }


def decode_questions(
    s: Setup, decoders: dict[str | None, Callable[[torch.Tensor], Generation]], questions: list[dict[str, Any]],
    max_seconds: float,
) -> tuple[dict[str | None, list[dict[str, Any]]], int, float]:
    """Every decoder on every question, in order, within `max_seconds` (0 = none) -> (each decoder's
    runs, questions done, seconds), with a progress line every PROGRESS_EVERY_S and where it ends."""
    runs: dict[str | None, list[dict[str, Any]]] = {m: [] for m in decoders}
    t0, longest, done = time.perf_counter(), 0.0, 0
    shown, shown_done = t0, 0  # when the last progress line was printed, and after how many questions
    for q in questions:  # every decoder finishes a question before the next: a budget cuts all alike
        if done and max_seconds and time.perf_counter() - t0 + longest > max_seconds:
            print(f"[eyas:evaluate] evaluate.max_seconds={max_seconds:g} reached after {done} of "
                  f"{len(questions)} questions", flush=True)
            break
        tq = time.perf_counter()
        for m, gen in decoders.items():
            runs[m] += run_conversations(gen, s.tok, [q], s.device, s.stop_ids)
        longest, done = max(longest, time.perf_counter() - tq), done + 1
        if time.perf_counter() - shown >= PROGRESS_EVERY_S:
            # a call killed from outside (a lease's limit) still shows how far it got and where τ stood
            print(progress_line(runs, done, len(questions), time.perf_counter() - t0), flush=True)
            shown, shown_done = time.perf_counter(), done
    if shown_done != done:  # the last question, or where the budget stopped
        print(progress_line(runs, done, len(questions), time.perf_counter() - t0), flush=True)
    return runs, done, time.perf_counter() - t0


def main(cfg: EyasConfig) -> dict[str, Any]:
    ec = cfg.evaluate
    out_dir = cfg.stage_dir("evaluate")
    questions = load_bench(ec.bench, ec.num_questions)  # before any model: a bad bench fails fast
    key = outputs_key(cfg, questions)
    reused, stored = read_target_outputs(ec.target_outputs, key) if ec.target_outputs else (None, None)
    s = load_setup(cfg)
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
    results["teacher_forced"] = None
    sim_tree = ec.simulate_tree and ("tree" in spec_runs or simulate)
    if ec.teacher_forced and ec.temperature == 0 and ("chain" in spec_runs or simulate or sim_tree):
        # on the target-only outputs when they were decoded, else on a decoder's own (greedy) ones
        ref_runs = base_runs if base_runs is not None else spec_runs["chain" if "chain" in spec_runs else "tree"]
        print(f"[eyas:evaluate] decoded in {phase_s['decode']:.1f} s, compared in {phase_s['compare']:.1f} s; "
              f"teacher-forced check on {len(ref_runs)} prompts", flush=True)
        tt = time.perf_counter()
        try:
            tree = (ec.tree_total_tokens, ec.tree_depth, ec.tree_top_k) if sim_tree else None
            results["teacher_forced"] = teacher_forced_chain(s.target, s.draft, ec.num_draft_tokens, ref_runs,
                                                             spec_runs.get("chain"), tree, spec_runs.get("tree"))
        except Exception as e:  # a diagnostic: keep the decoding results, fail the run after writing them
            results["teacher_forced"] = {"error": describe_exception(e)}
            print(f"[eyas:evaluate] the teacher-forced check failed: {type(e).__name__}: {exception_message(e)}\n"
                  f"{results['teacher_forced']['error']['traceback']}", file=sys.stderr, flush=True)
        phase_s["teacher_forced"] = time.perf_counter() - tt
    results["phase_s"] = phase_s
    tf = results["teacher_forced"]
    results["tau_chain_simulated"] = tf["tau_sim"] if tf and "error" not in tf else None
    results["tau_tree_simulated"] = tf["tree"]["tau_sim"] if tf and "error" not in tf and tf["tree"] else None
    results["num_questions"] = done
    results["questions_requested"] = len(questions)
    results["stopped_early"] = done < len(questions)
    results["target_outputs"] = str(reused) if reused else None  # read there, their wall times those of that run
    results["settings"] = {
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
        "draft": str(s.draft_dir),
        "bench": ec.bench,
    }
    artifacts.atomic_write_json(out_dir / "results.json", results)
    artifacts.atomic_write_text(out_dir / "config.yaml", dump_config(cfg))
    artifacts.write_meta(
        out_dir,
        "evaluate",
        config={"target": to_dict(cfg.target), "evaluate": to_dict(ec)},
        target=describe_target(cfg.target),
        draft=str(s.draft_dir),
        hashes={"draft_weights": sha256_file(draft_weights_file(s.draft_dir)), "bench": key["bench"],
                **({"target_outputs": sha256_file(reused)} if reused else {})},
        counts={
            "questions": done,
            "questions_requested": len(questions),
            "prompts": results["num_prompts"],
            **{f"tau_{m}": results[f"tau_{m}"] for m in modes},
            **({"tau_chain_simulated": results["tau_chain_simulated"]} if simulate else {}),
            **({"tau_tree_simulated": results["tau_tree_simulated"]}
               if results["tau_tree_simulated"] is not None else {}),
        },
    )
    print(format_table(results))
    if results["lossless_up_to_ties"] is False:
        d = results["first_unexplained_divergence"]
        n_bad = results["num_divergent"] - results["num_divergent_near_tie"]
        logits = (f"; the target's plain forward scores them {d['logit_speculative']:.4f} vs {d['logit_target_only']:.4f} "
                  f"(gap {d['logit_gap']:.4f} > tie_tolerance {rel_tol:g} relative)" if "logit_gap" in d else
                  " (one output ended before the other)")
        raise LosslessError(
            f"{n_bad} greedy speculative output(s) differ from target-only greedy decoding beyond a near-tie; first: "
            f"mode {d['mode']}, question {d['id']} turn {d['turn']}, new token #{d['position']}: speculative "
            f"{d['speculative']} vs target-only {d['target_only']}{logits} (all in {out_dir / 'results.json'})"
        )
    if (results["teacher_forced"] or {}).get("error"):
        err = results["teacher_forced"]["error"]
        skip = ("evaluate.mode=simulate is that check: --evaluate.mode=chain decodes instead" if simulate
                else "--evaluate.teacher_forced=false skips the check")
        raise EyasError(f"evaluate: the teacher-forced check failed ({err['type']}: {err['message']}); the decoding "
                        f"results are in {out_dir / 'results.json'}; {skip}")
    return results


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
