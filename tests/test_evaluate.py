"""The evaluate stage: config, bench loading, result pooling, lossless failure, and `eyas evaluate`
end to end (a tiny random Llama carrying SmolLM2's real tokenizer and chat template, so it runs in
seconds; the real SmolLM2 run is marked slow)."""

from __future__ import annotations

import json

import pytest
import torch

from eyas.config import load_config
from eyas.errors import ConfigError, DataError
from eyas.evaluate.decoding import load_eval_draft
from eyas.evaluate.inputs import load_bench
from eyas.evaluate.lossless import first_divergence, score_divergence, tie_scale
from eyas.evaluate.report import collect_results
from eyas.spec import Generation, SpecStats
from spec_helpers import random_draft, tiny_llama



# --- config and inputs -------------------------------------------------------------------------------


def test_config_defaults_and_validation():
    ec = load_config(None, []).evaluate
    assert (ec.num_draft_tokens, ec.tree_total_tokens, ec.tree_depth, ec.tree_top_k) == (7, 60, 8, 10)
    assert ec.temperature == 0 and ec.lossless_check and ec.measure_speedup
    with pytest.raises(ConfigError, match="evaluate.mode"):
        load_config(None, ["--evaluate.mode=beam"])
    with pytest.raises(ConfigError, match="evaluate.temperature"):
        load_config(None, ["--evaluate.temperature=-1"])
    with pytest.raises(ConfigError, match="evaluate.device"):
        load_config(None, ["--evaluate.device=tpu"])
    with pytest.raises(ConfigError, match="did you mean 'evaluate.tree_depth'"):
        load_config(None, ["--evaluate.tree_dept=3"])
    for bad in (["--evaluate.temperature=0.7"], ["--evaluate.teacher_forced=false"]):
        with pytest.raises(ConfigError, match="evaluate.mode=simulate"):
            load_config(None, ["--evaluate.mode=simulate", *bad])


def test_cli_short_flags_reach_the_evaluate_section():
    from eyas.cli import _own_section, _split

    path, overrides = _split(["--draft", "d", "--mode", "tree", "--bench=q.jsonl"])
    cfg = load_config(path, _own_section("evaluate", overrides))
    assert (cfg.evaluate.draft, cfg.evaluate.mode, cfg.evaluate.bench) == ("d", "tree", "q.jsonl")


def test_the_default_draft_is_the_averaged_export_when_export_averages(tmp_path):
    """With export.average_with the served draft is the mean, not train's checkpoint: evaluate's
    default follows it."""
    from eyas.evaluate.decoding import default_draft_dir

    assert default_draft_dir(load_config(None, [f"--run_dir={tmp_path}"])) == tmp_path / "train" / "final"
    averaged = load_config(None, [f"--run_dir={tmp_path}", "--export.average_with=[/drafts/a/speculators]"])
    assert default_draft_dir(averaged) == tmp_path / "export"
    out = load_config(None, [f"--run_dir={tmp_path}", "--export.average_with=[/a]", f"--export.out_dir={tmp_path / 'x'}"])
    assert default_draft_dir(out) == tmp_path / "x"


def test_load_bench_mtbench_and_jsonl(tmp_path):
    mt = load_bench("mtbench")
    assert len(mt) == 80 and all(len(q["turns"]) == 2 for q in mt)
    assert len(load_bench("mtbench", 3)) == 3
    f = tmp_path / "p.jsonl"
    f.write_text('{"turns": ["a", "b"], "question_id": 7}\n\n{"prompt": "c"}\n"d"\n')
    expected = [{"id": "7", "turns": ["a", "b"]}, {"id": "3", "turns": ["c"]}, {"id": "4", "turns": ["d"]}]
    assert load_bench(str(f)) == expected  # ids: question_id, else the line number
    f.write_text('{"turns": ["a"]}\n{"turns": []}\n')
    with pytest.raises(DataError, match=r"p.jsonl:2"):
        load_bench(str(f))
    f.write_text("{oops\n")
    with pytest.raises(DataError, match=r"p.jsonl:1: malformed"):
        load_bench(str(f))
    with pytest.raises(ConfigError, match="no such file"):
        load_bench(str(tmp_path / "missing.jsonl"))


def test_first_divergence():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 5, 3], [1, 2, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2


def _gen(tokens, passes_accepted):
    stats = SpecStats()
    for n in passes_accepted:
        stats.add_pass(n, n + 1)
    stats.wall_s = 1.0
    return Generation(tokens, 1.0, stats)


def test_collect_results_pools_tau_and_reports_divergence():
    base = [{"id": "q", "turn": 0, "prompt_tokens": 5, "gen": Generation([1, 2, 3, 4, 5, 6, 7], 2.0)},
            {"id": "q", "turn": 1, "prompt_tokens": 9, "gen": Generation([8, 9, 10], 1.0)}]  # fmt: skip
    chain = [{**base[0], "gen": _gen([1, 2, 3, 4, 5, 6, 7], [5])},  # 1 pass, 6 tokens (+1 from prefill)
             {**base[1], "gen": _gen([8, 9, 11], [0, 0])}]  # 2 passes, 2 tokens; diverges at #2  # fmt: skip
    r = collect_results(base, {"chain": chain}, check=True)
    assert r["tau_chain"] == r["tau"] == 8 / 3  # pooled (6 + 2) / 3, not the mean of 6 and 1
    assert r["accept_length_histogram"] == [2, 0, 0, 0, 0, 1]
    assert r["lossless"] is False and r["num_divergent"] == 1
    div = {"mode": "chain", "id": "q", "turn": 1, "position": 2, "speculative": 11, "target_only": 10, "near_tie": False}
    assert r["first_divergence"] == r["first_unexplained_divergence"] == div
    assert r["lossless_up_to_ties"] is False and r["num_divergent_near_tie"] == 0
    assert r["speedup"] == pytest.approx((10 / 2.0) / (10 / 3.0))
    assert r["records"][0]["chain"]["lossless"] and not r["records"][1]["chain"]["lossless"]
    seen = []
    r = collect_results(base, {"chain": chain}, check=True, score=lambda b, ref, d: seen.append((b["turn"], ref, d["position"])) or {"near_tie": True})
    assert seen == [(1, [8, 9, 10], 2)]  # scored against the baseline run of the same prompt
    assert r["lossless"] is False and r["lossless_up_to_ties"] is True and r["num_divergent_near_tie"] == 1
    assert r["first_unexplained_divergence"] is None
    r = collect_results(None, {"chain": chain}, check=False)
    assert r["lossless"] is None and r["speedup"] is None and r["target_only_wall_s"] is None


@pytest.mark.parametrize("dtype,rel", [(torch.bfloat16, 2**-6), (torch.float16, 2**-9)])
def test_default_tie_tolerance_is_four_units_in_the_last_place(dtype, rel):
    """By dtype, a near-tie is four representable steps of that dtype wherever the logit lies in its
    binade: 5.5625 vs 5.6875 in bf16 (H200, SmolLM2, MT-bench question 128; float32
    decoding of that question is exact) is a tie, one step more is not."""
    for x in (1.0, 1.5, 3.99, 4.0, 5.6875, 7.9, 28.5, 100.0):
        xd = torch.tensor(x, dtype=dtype)
        up = torch.nextafter(xd, torch.tensor(1e4, dtype=dtype))
        ulp = float(up - xd)
        assert rel * tie_scale(float(xd), float(xd) - 4 * ulp) == 4 * ulp, (x, ulp)
    assert 0.125 <= 2**-6 * tie_scale(5.6875, 5.5625) < 0.125 + 2**-5


def test_score_divergence_reads_the_target_at_the_diverging_position():
    """The two tokens are scored by a plain forward at the first differing position: compared with
    one forward of the whole baseline sequence, the near-tie verdict flips exactly at the gap."""
    model = tiny_llama(vocab=300, hidden=32, layers=2, seed=3)
    g = torch.Generator().manual_seed(0)
    prompt, ref = torch.randint(0, 300, (7,), generator=g).tolist(), torch.randint(0, 300, (9,), generator=g).tolist()
    with torch.no_grad():
        full_SV = model(input_ids=torch.tensor([prompt + ref])).logits[0].float()
    both_wrong_checked = 0
    for pos in (0, 2, 4, 6, 8):
        row_V = full_SV[len(prompt) + pos - 1]  # the logits that choose new token #pos
        top2 = row_V.topk(2)
        first, second = int(top2.indices[0]), int(top2.indices[1])
        gap = float(top2.values[0] - top2.values[1])
        scale = tie_scale(float(top2.values[0]), float(top2.values[1]))
        diff = {"position": pos, "target_only": first, "speculative": second}
        near = score_divergence(model, prompt, ref, diff, rel_tol=1.01 * gap / scale)
        assert near["near_tie"] and near["plain_forward_top1"] == first
        assert near["logit_target_only"] == pytest.approx(float(row_V[first]), abs=1e-5)
        assert near["logit_gap"] == pytest.approx(gap, abs=1e-5)
        assert not score_divergence(model, prompt, ref, diff, rel_tol=0.99 * gap / scale)["near_tie"]
        far = {**diff, "speculative": int(row_V.argmin())}
        assert not score_divergence(model, prompt, ref, far, rel_tol=1.01 * gap / scale)["near_tie"]
        # the 2nd and 3rd tokens tied, the top one well above both: both decoders missed it
        third = int(row_V.topk(3).indices[2])
        gap23 = float(row_V[second] - row_V[third])
        if gap23 < gap:
            both_wrong = {"position": pos, "target_only": second, "speculative": third}
            assert not score_divergence(model, prompt, ref, both_wrong, rel_tol=1.01 * gap23 / scale)["near_tie"]
            both_wrong_checked += 1
    assert both_wrong_checked
    assert score_divergence(model, prompt, ref, {"position": 9, "target_only": None, "speculative": 5}, 1.0) == {"near_tie": False}


def test_a_later_turn_after_a_differing_answer_inherits_its_verdict():
    """Turn 2 is rendered with each decoder's own turn-1 answer: after a difference the prompts
    differ, so turn 2 is not scored against the baseline's; it takes turn 1's verdict."""
    base = [{"id": "q", "turn": 0, "prompt_tokens": 3, "prompt_ids": [1, 2, 3], "gen": Generation([4, 5, 6], 1.0)},
            {"id": "q", "turn": 1, "prompt_tokens": 7, "prompt_ids": [1, 2, 3, 4, 5, 6, 9], "gen": Generation([7, 8], 1.0)}]
    spec = [{**base[0], "gen": _gen([4, 6, 6], [2])},
            {**base[1], "prompt_ids": [1, 2, 3, 4, 6, 6, 9], "gen": _gen([8, 8], [1])}]  # fmt: skip
    for tie in (True, False):
        scored = []
        r = collect_results(base, {"chain": spec}, check=True,
                            score=lambda b, ref, d: scored.append(b["turn"]) or {"near_tie": tie})
        assert scored == [0]  # turn 1 (index 1) is not scored against another prompt
        second = r["records"][1]["chain"]["first_divergence"]
        assert second["inherited"] and second["near_tie"] is tie
        assert (r["num_divergent"], r["num_divergent_inherited"], r["lossless_up_to_ties"]) == (2, 1, tie)


# --- end to end ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory, smollm2_dir):
    """A tiny random Llama with SmolLM2's vocabulary, tokenizer and chat template, saved as an HF
    directory, and a random Eagle3Draft saved in eyas's own format where the trainer puts it."""
    from transformers import AutoTokenizer

    from eyas.draft_files import save_draft

    root = tmp_path_factory.mktemp("eval")
    tok = AutoTokenizer.from_pretrained(str(smollm2_dir))
    target = tiny_llama(vocab=len(tok), hidden=32, layers=4, seed=0)
    target.save_pretrained(str(root / "target"))
    tok.save_pretrained(str(root / "target"))
    draft = random_draft(target, aux_layer_ids=(0, 2, 3), draft_tokens=list(range(512)), seed=0)
    save_draft(draft, root / "run" / "train" / "final")
    bench = root / "bench.jsonl"
    bench.write_text(json.dumps({"turns": ["Hi there!", "And again?"]}) + "\n" + json.dumps("Name a colour.") + "\n")
    return root, draft


def _args(root, *extra):
    return [
        "evaluate", f"--run_dir={root / 'run'}", f"--target.model={root / 'target'}", "--target.dtype=float32",
        "--bench", str(root / "bench.jsonl"), "--max_new_tokens=6", "--device=cpu", "--tree_total_tokens=6",
        "--tree_depth=3", "--tree_top_k=3", "--num_draft_tokens=3", *extra,
    ]  # fmt: skip


def test_eyas_evaluate_end_to_end(tiny_run, capsys):
    from eyas.artifacts import read_meta
    from eyas.cli import main

    root, _ = tiny_run
    assert main(_args(root, "--mode=both")) == 0
    out = root / "run" / "evaluate"
    r = json.loads((out / "results.json").read_text())
    assert r["lossless"] is True and r["lossless_checked"]
    assert r["num_questions"] == 2 and r["num_prompts"] == 3  # the second turn is its own prompt
    for mode in ("chain", "tree"):
        m = r["modes"][mode]
        assert r[f"tau_{mode}"] == m["tau"] == m["total_new_tokens"] / m["verify_passes"] >= 1
        assert sum(m["accept_length_histogram"]) == m["verify_passes"]
        assert m["wall_s"] > 0 and m["speedup"] > 0 and m["draft_time_s"] > 0 and m["verify_time_s"] > 0
    assert r["tau"] == r["tau_tree"] and r["target_only_wall_s"] > 0
    assert [(rec["id"], rec["turn"]) for rec in r["records"]] == [("1", 0), ("1", 1), ("2", 0)]
    assert all(rec["chain"]["lossless"] and rec["tree"]["lossless"] for rec in r["records"])
    assert read_meta(out, "evaluate")["counts"]["prompts"] == 3
    printed = capsys.readouterr().out
    assert "P(accept | reached)" in printed
    # the progress line after the last question pools what results.json pools
    (last,) = [line for line in printed.splitlines() if line.startswith("[eyas:evaluate] 2/2 questions in ")]
    target_tokens = sum(rec["target_only"]["output_tokens"] for rec in r["records"])
    assert f"target-only {target_tokens:,} tok in " in last
    for mode in ("chain", "tree"):
        assert f"{mode} tau {r['modes'][mode]['tau']:.3f} over {r['modes'][mode]['verify_passes']:,} passes" in last
    assert set(r["phase_s"]) == {"decode", "compare", "teacher_forced"} and all(v >= 0 for v in r["phase_s"].values())
    assert "teacher-forced check on 3 prompts" in printed


def test_time_budget_cuts_every_mode_at_the_same_question(tiny_run, monkeypatch, capsys):
    from eyas.cli import main
    from eyas.evaluate import decoding

    root, _ = tiny_run
    out = root / "budget"
    monkeypatch.setattr(decoding, "PROGRESS_EVERY_S", 0.0)  # a line after every question
    assert main(_args(root, "--mode=both", "--max_seconds=1e-6", f"--out_dir={out}")) == 0
    r = json.loads((out / "results.json").read_text())
    lines = [line for line in capsys.readouterr().out.splitlines() if " questions in " in line]
    assert len(lines) == 1 and lines[0].startswith("[eyas:evaluate] 1/2 questions in ")  # not again where it stopped
    monkeypatch.setattr(decoding, "PROGRESS_EVERY_S", 1e9)  # no timed line: the one where the budget stopped it
    assert main(_args(root, "--mode=tree", "--max_seconds=1e-6", f"--out_dir={root / 'budget_tree'}")) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if " questions in " in line]
    assert len(lines) == 1 and lines[0].startswith("[eyas:evaluate] 1/2 questions in ") and " tree tau " in lines[0]
    tree_only = json.loads((root / "budget_tree" / "results.json").read_text())
    # no chain decoded: the check simulates both on the target-only outputs, the tree compared with its decoder
    tf = tree_only["teacher_forced"]
    assert tf["num_compared"] == 0 and (tf["tree"]["num_compared"], tf["tree"]["matches_decoder"]) == (2, True)
    assert main(_args(root, "--mode=tree", "--max_seconds=1e-6", "--simulate_tree=false",
                      f"--out_dir={root / 'budget_tree_nosim'}")) == 0
    no_sim = json.loads((root / "budget_tree_nosim" / "results.json").read_text())
    assert no_sim["phase_s"]["teacher_forced"] is None and no_sim["teacher_forced"] is None  # no chain: no check
    assert (r["num_questions"], r["questions_requested"], r["stopped_early"]) == (1, 2, True)
    assert r["num_prompts"] == 2 and [(rec["id"], rec["turn"]) for rec in r["records"]] == [("1", 0), ("1", 1)]
    assert all(rec["chain"]["lossless"] and rec["tree"]["lossless"] for rec in r["records"])


def test_evaluate_fails_on_a_divergence(tiny_run, monkeypatch, capsys):
    """A decoder that changes one token must fail the run (exit 2) naming the first diverging position."""
    from eyas.cli import main
    from eyas.evaluate import decoding
    from eyas.spec import speculative_generate

    def off_by_one(*args, **kwargs):
        gen = speculative_generate(*args, **kwargs)
        gen.tokens[3] += 1
        return gen

    root, _ = tiny_run
    monkeypatch.setattr(decoding, "speculative_generate", off_by_one)
    assert main(_args(root, "--mode=chain", "--num_questions=1", f"--out_dir={root / 'bad'}")) == 2
    assert "new token #3" in capsys.readouterr().err
    r = json.loads((root / "bad" / "results.json").read_text())
    assert r["lossless"] is False and r["first_divergence"]["position"] == 3


def test_sampling_run_skips_the_lossless_check(tiny_run):
    from eyas.evaluate import main

    root, _ = tiny_run
    cfg = load_config(None, [
        f"--run_dir={root / 'run'}", f"--target.model={root / 'target'}", "--target.dtype=float32",
        f"--evaluate.bench={root / 'bench.jsonl'}", "--evaluate.temperature=0.8", "--evaluate.measure_speedup=false",
        "--evaluate.max_new_tokens=6", "--evaluate.device=cpu", "--evaluate.num_draft_tokens=3",
        f"--evaluate.out_dir={root / 'sampled'}",
    ])  # fmt: skip
    r = main(cfg)
    assert r["lossless"] is None and r["target_only_wall_s"] is None and r["tau_chain"] >= 1


def test_simulate_mode_gives_the_chain_decoders_passes_without_decoding(tiny_run, tmp_path, capsys):
    """evaluate.mode=simulate decodes target-only only and simulates the chain from the draft's
    teacher-forced forward; in float32 its passes are the chain decoder's own: a chain-mode run over
    the same prompts is the independent reference, with a draft fitted to the target's answers so
    that it accepts tokens (a random one accepts none, and any simulation would agree with it)."""
    from export_helpers import fitted_draft
    from transformers import AutoTokenizer

    from eyas.assets import sha256_file
    from eyas.cli import main
    from eyas.draft_files import save_draft
    from eyas.evaluate.inputs import render
    from eyas.run import _evaluation, print_summary
    from eyas.spec import target_generate

    root, _ = tiny_run
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one summation order for the decoder and the teacher-forced forward
    try:
        from transformers import AutoModelForCausalLM

        tok = AutoTokenizer.from_pretrained(str(root / "target"))
        target = AutoModelForCausalLM.from_pretrained(str(root / "target"), torch_dtype=torch.float32).eval()
        prompts = [render(tok, [{"role": "user", "content": t}]) for t in ("Hi there!", "Name a colour.")]
        seqs = [p + target_generate(target, torch.tensor(p), max_new_tokens=20).tokens for p in prompts]
        draft = fitted_draft(target, seqs, aux_layer_ids=(0, 2, 3), draft_vocab=512, steps=60, decoy_shifts=(),
                             intermediate_size=64)  # fmt: skip
        save_draft(draft, tmp_path / "fitted")
        args = (f"--draft={tmp_path / 'fitted'}", "--max_new_tokens=12", "--num_questions=2")
        assert main(_args(root, "--mode=chain", f"--out_dir={tmp_path / 'chain'}", *args)) == 0
        assert main(_args(root, "--mode=tree", f"--out_dir={tmp_path / 'tree'}", *args)) == 0
        capsys.readouterr()
        assert main(_args(root, "--mode=simulate", f"--out_dir={tmp_path / 'sim'}", *args)) == 0
        printed = capsys.readouterr().out
    finally:
        torch.set_num_threads(threads)
    chain = json.loads((tmp_path / "chain" / "results.json").read_text())
    sim = json.loads((tmp_path / "sim" / "results.json").read_text())
    assert sim["modes"] == {} and "tau_chain" not in sim and sim["lossless_checked"] is False
    assert sim["target_only_wall_s"] > 0 and "simulated; no chain decoded" in printed
    assert [(r["id"], r["turn"]) for r in sim["records"]] == [("1", 0), ("1", 1), ("2", 0)] and sim["num_prompts"] == 3
    tf, ref = sim["teacher_forced"], chain["modes"]["chain"]
    assert chain["teacher_forced"]["matches_decoder"] is True and chain["teacher_forced"]["num_compared"] == 3
    assert tf["num_compared"] == 0 and sum(ref["accept_length_histogram"][1:]) > 0  # the draft accepts tokens
    # the same passes, the same acceptances but in each prompt's last pass, which the simulation
    # counts at its lower bound (eyas.spec.simulate): tau no higher than the decoder's
    assert tf["verify_passes"] == ref["verify_passes"]
    # and per prompt (for splits by turn): the same passes as the decoder's record of that prompt
    decoded = {(r["id"], r["turn"]): r["chain"]["verify_passes"] for r in chain["records"]}
    assert {(p["id"], p["turn"]): p["verify_passes"] for p in tf["prompts"]} == decoded
    assert sum(p["new_tokens"] for p in tf["prompts"]) / tf["verify_passes"] == pytest.approx(tf["tau_sim"])
    assert [p["reached"] for p in tf["acceptance_per_position"]][:1] == [ref["verify_passes"]]
    assert sim["tau_chain_simulated"] == tf["tau_sim"] <= chain["tau_chain"]
    assert chain["tau_chain"] - tf["tau_sim"] <= 3 * 3 / ref["verify_passes"]  # at most k per prompt
    assert json.loads((tmp_path / "sim" / "meta.json").read_text())["counts"]["tau_chain_simulated"] == tf["tau_sim"]
    # the tree decoder simulated pass by pass (evaluate.simulate_tree): per prompt the passes of a
    # tree-mode run, which compared its own passes with the simulation on its own outputs
    tree = json.loads((tmp_path / "tree" / "results.json").read_text())
    tt, tref = tf["tree"], tree["modes"]["tree"]
    own = tree["teacher_forced"]["tree"]
    assert own["matches_decoder"] is True and own["num_compared"] == 3
    assert sum(tref["accept_length_histogram"][2:]) > 0  # paths of two or more drafts
    decoded = {(r["id"], r["turn"]): r["tree"]["verify_passes"] for r in tree["records"]}
    assert {(p["id"], p["turn"]): p["verify_passes"] for p in tt["prompts"]} == decoded
    assert tt["verify_passes"] == tref["verify_passes"]
    assert sim["tau_tree_simulated"] == tt["tau_sim"] <= tree["tau_tree"]
    assert "simulated tree 6/3/3 tau" in printed and "no tree decoded to compare" in printed
    # eyas run's summary names the simulated taus and prints no lossless verdict for them
    print_summary({"run_dir": "r", "stages": {}, **_evaluation(tmp_path / "sim")})
    summary = capsys.readouterr().out
    cond = " ".join(f"{p['conditional']:.2f}" for p in tf["acceptance_per_position"])
    assert f"tau {tf['tau_sim']:.3f} simulated" in summary and cond in summary and "lossless" not in summary
    assert f"tree        tau {tt['tau_sim']:.3f} simulated pass by pass" in summary
    # evaluate.target_outputs: the same draft on the outputs stored by the simulate run (and by the
    # chain run: its target-only baseline) gives the same teacher-forced pass without decoding
    for source in ("sim", "chain"):
        again = tmp_path / f"again-{source}"
        torch.set_num_threads(1)
        try:
            assert main(_args(root, "--mode=simulate", f"--out_dir={again}", f"--target_outputs={tmp_path / source}",
                              *args)) == 0
        finally:
            torch.set_num_threads(threads)
        printed = capsys.readouterr().out
        re_sim = json.loads((again / "results.json").read_text())
        assert f"target-only outputs from {tmp_path / source / 'target_outputs.json'}" in printed
        assert re_sim["target_outputs"] == str(tmp_path / source / "target_outputs.json")
        for k in ("acc", "tau_sim", "verify_passes", "prompts", "accept_length_histogram"):
            assert re_sim["teacher_forced"][k] == tf[k], k
        assert re_sim["phase_s"]["decode"] < sim["phase_s"]["decode"] / 3
    meta = json.loads((again / "meta.json").read_text())
    assert meta["hashes"]["target_outputs"] == sha256_file(tmp_path / "chain" / "target_outputs.json")
    # refused before any model loads when made under other settings, or when a prompt renders otherwise
    # (a later flag wins: --max_new_tokens=11 replaces args' 12)
    assert main(_args(root, "--mode=simulate", f"--target_outputs={tmp_path / 'sim'}", *args, "--max_new_tokens=11")) == 2
    assert "max_new_tokens 12 there, 11 here" in capsys.readouterr().err
    (tmp_path / "broken.json").write_text(json.dumps({"key": [], "runs": [], "complete": True}))
    assert main(_args(root, "--mode=simulate", f"--target_outputs={tmp_path / 'broken.json'}", *args)) == 2
    assert "broken.json: not a target_outputs.json (TypeError" in capsys.readouterr().err
    stored = json.loads((tmp_path / "sim" / "target_outputs.json").read_text())
    stored["runs"][0]["tokens"][0] = (stored["runs"][0]["tokens"][0] + 1) % 512  # question 1's first answer
    (tmp_path / "tampered.json").write_text(json.dumps(stored))
    assert main(_args(root, "--mode=simulate", f"--target_outputs={tmp_path / 'tampered.json'}", *args)) == 2
    assert "question 1 turn 1: the prompt renders to other tokens here" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="read by evaluate.mode=simulate only"):
        load_config(None, ["--evaluate.target_outputs=x", "--evaluate.mode=chain"])


def test_exported_draft_loads_and_decodes_the_same(tiny_run, tmp_path):
    """An `eyas export` SGLang directory (and its parent) loads back into the same draft."""
    from eyas.draft_files import export_draft

    root, draft = tiny_run
    export_draft(draft, tmp_path, formats=("sglang",), dtype="float32")
    embed = draft.embed_weight
    for where in (tmp_path / "sglang", tmp_path):
        loaded = load_eval_draft(where, embed, torch.device("cpu"), torch.float32)
        assert torch.equal(loaded.d2t, draft.d2t) and loaded.config.aux_layer_ids == [0, 2, 3]
        h = torch.randn(1, 3, 32)
        ids = torch.tensor([[1, 2, 3]])
        pos = torch.arange(3)[None]
        expected = draft.logits(draft.forward_step(ids, h, pos)[0])
        torch.testing.assert_close(loaded.logits(loaded.forward_step(ids, h, pos)[0]), expected)


@pytest.mark.slow
def test_eyas_evaluate_smollm2_lossless(tmp_path, smollm2_dir):
    """The real SmolLM2-135M-Instruct with a random Eagle3Draft, two MT-bench questions, both modes:
    lossless under greedy (fp32 on CPU)."""
    from transformers import AutoConfig

    from eyas.draft import DraftConfig, Eagle3Draft
    from eyas.draft_files import save_draft
    from eyas.evaluate import main

    tcfg = AutoConfig.from_pretrained(str(smollm2_dir))
    draft = Eagle3Draft(DraftConfig.from_target(tcfg, draft_vocab_size=tcfg.vocab_size, aux_layer_ids=[2, 15, 27]))
    save_draft(draft, tmp_path / "draft")
    cfg = load_config(None, [
        f"--run_dir={tmp_path}", "--target.dtype=float32", f"--evaluate.draft={tmp_path / 'draft'}",
        "--evaluate.num_questions=1", "--evaluate.max_new_tokens=8", "--evaluate.mode=both", "--evaluate.device=cpu",
        "--evaluate.tree_total_tokens=10", "--evaluate.tree_depth=3", "--evaluate.tree_top_k=4",
    ])  # fmt: skip
    r = main(cfg)
    assert r["lossless"] is True and r["num_prompts"] == 2 and r["tau_chain"] >= 1 and r["tau_tree"] >= 1
