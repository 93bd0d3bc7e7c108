"""Decoding runs: the target and the draft loaded for one device, one decoder per mode (target-only,
chain, tree), every decoder over every question in order within a time budget, each turn rendered
with that decoder's own earlier answers."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any, Callable

import torch

from eyas.config import EyasConfig
from eyas.draft_files import DraftFiles, locate, open_draft, read_config
from eyas.errors import ArtifactError
from eyas.evaluate.inputs import render, stop_token_ids, target_placement
from eyas.spec import Generation, SpecStats, speculative_generate, target_generate
from eyas.target import load_model, load_tokenizer


WARMUP_TOKENS = 8


def default_draft_dir(cfg: EyasConfig) -> Path:
    """evaluate.draft's default: the trained checkpoint, or the export when export.average_with
    makes the exported draft another one (the mean of several): evaluate what is served."""
    if cfg.export.average_with:
        return cfg.stage_dir("export")  # open_draft picks a layout inside it
    return cfg.stage_dir("train") / "final"


def load_eval_draft(draft_dir: Path, embed_weight_VD: torch.Tensor, device: torch.device, dtype: torch.dtype):
    """Any draft form (eyas.draft_files.open_draft) on `device` in `dtype`, for inference."""
    draft = open_draft(draft_dir, embed_weight_VD, what="evaluate.draft")
    return draft.to(device=device, dtype=dtype).eval().requires_grad_(False)


def check_draft_fits(draft_cfg, target_cfg) -> None:
    """The draft must have been built for this target: vocab, hidden size, aux layers. From the two
    configs alone (a DraftConfig, the target's text config), so that both evaluators refuse a draft
    of another target before any model or engine loads (vLLM would load the target, then stop on a
    shape error)."""
    c, t = draft_cfg, target_cfg
    num_layers = int(t.num_hidden_layers)
    problems = []
    if c.vocab_size != t.vocab_size:
        problems.append(f"vocab size {c.vocab_size} != target's {t.vocab_size}")
    if c.target_hidden_size != t.hidden_size:
        problems.append(f"target_hidden_size {c.target_hidden_size} != target's hidden size {t.hidden_size}")
    ids = list(c.aux_layer_ids)
    if len(ids) != c.num_aux_layers or not all(0 <= k < num_layers for k in ids):
        problems.append(
            f"aux_layer_ids {ids} do not fit num_aux_layers={c.num_aux_layers} and a {num_layers}-layer target"
        )
    if problems:
        raise ArtifactError(
            "the draft does not fit the target (" + "; ".join(problems) + "): pass the target it was trained "
            "for with --target.model, or the matching draft with --evaluate.draft"
        )


def check_draft_files_fit(cfg: EyasConfig, files: DraftFiles) -> None:
    """`check_draft_fits` for a located draft and cfg.target, reading configs only."""
    from eyas.target import load_config

    check_draft_fits(read_config(files), load_config(cfg.target))


@dataclasses.dataclass
class Setup:
    tok: Any
    target: Any
    draft: Any
    device: torch.device
    dtype: torch.dtype
    draft_files: DraftFiles
    stop_ids: frozenset[int]
    seed: int
    engine: Any = None


def load_setup(cfg: EyasConfig) -> Setup:
    ec = cfg.evaluate
    files = locate(ec.draft or default_draft_dir(cfg), "evaluate.draft")  # before any model loads
    check_draft_files_fit(cfg, files)
    device, target_cfg, dtype = target_placement(cfg)
    tok = load_tokenizer(target_cfg)
    # sdpa: tree verification passes a custom 4-D mask, which flash-attention kernels do not take
    target = load_model(target_cfg, device=device, attn_implementation="sdpa")
    draft = load_eval_draft(files.dir, target.get_input_embeddings().weight, device, dtype)
    seed = cfg.seed if ec.seed < 0 else ec.seed
    engine = None
    if device.type == "cuda" and ec.cuda_graphs:
        from eyas.spec.static import StaticEngine

        engine = StaticEngine(target, draft, max_len=ec.max_context)
    return Setup(tok, target, draft, device, dtype, files, stop_token_ids(tok, target), seed, engine)


def _generator(device: torch.device, seed: int) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


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


def run_conversations(
    generate: Callable[[torch.Tensor], Generation], tok, questions: list[dict[str, Any]], device, stop_ids
) -> list[dict[str, Any]]:
    """Decode every turn of every question with `generate`; turn i+1 sees the model's own answer i.
    -> one record per turn: id, turn, prompt_tokens, tokens, wall_s, stats."""
    out = []
    for q in questions:
        messages: list[dict[str, str]] = list(q.get("history", []))  # evaluate.context_tokens' earlier turns
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
            # a run killed from outside (a job time limit) still shows how far it got and where τ stood
            print(progress_line(runs, done, len(questions), time.perf_counter() - t0), flush=True)
            shown, shown_done = time.perf_counter(), done
    if shown_done != done:  # the last question, or where the budget stopped
        print(progress_line(runs, done, len(questions), time.perf_counter() - t0), flush=True)
    return runs, done, time.perf_counter() - t0
