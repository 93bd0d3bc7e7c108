"""eyas.evaluate, the stage: config, CLI flags, the default draft, and `eyas evaluate` end to end (a
tiny random Llama carrying SmolLM2's real tokenizer and chat template, so it runs in seconds; the
real SmolLM2 run is marked slow): time budgets, a divergence fails the run, sampling, exported drafts."""

from __future__ import annotations

import json

import pytest
import torch

from eyas.config import load_config
from eyas.errors import ConfigError
from eyas.evaluate.decoding import load_eval_draft
from tests.evaluate.runs import cli_args


# --- config ----------------------------------------------------------------------------------------


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


# --- end to end ------------------------------------------------------------------------------------


def test_eyas_evaluate_end_to_end(tiny_run, capsys):
    from eyas.artifacts import read_meta
    from eyas.cli import main

    root, _ = tiny_run
    assert main(cli_args(root, "--mode=both")) == 0
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
    assert main(cli_args(root, "--mode=both", "--max_seconds=1e-6", f"--out_dir={out}")) == 0
    r = json.loads((out / "results.json").read_text())
    lines = [line for line in capsys.readouterr().out.splitlines() if " questions in " in line]
    assert len(lines) == 1 and lines[0].startswith("[eyas:evaluate] 1/2 questions in ")  # not again where it stopped
    monkeypatch.setattr(decoding, "PROGRESS_EVERY_S", 1e9)  # no timed line: the one where the budget stopped it
    assert main(cli_args(root, "--mode=tree", "--max_seconds=1e-6", f"--out_dir={root / 'budget_tree'}")) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if " questions in " in line]
    assert len(lines) == 1 and lines[0].startswith("[eyas:evaluate] 1/2 questions in ") and " tree tau " in lines[0]
    tree_only = json.loads((root / "budget_tree" / "results.json").read_text())
    # no chain decoded: the check simulates both on the target-only outputs, the tree compared with its decoder
    tf = tree_only["teacher_forced"]
    assert tf["num_compared"] == 0 and (tf["tree"]["num_compared"], tf["tree"]["matches_decoder"]) == (2, True)
    assert main(cli_args(root, "--mode=tree", "--max_seconds=1e-6", "--simulate_tree=false",
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
    assert main(cli_args(root, "--mode=chain", "--num_questions=1", f"--out_dir={root / 'bad'}")) == 2
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
    lossless under greedy (fp32 on CPU), and the target-only outputs the check compares with are
    transformers' own `generate` (not only eyas's decoder, which shares the target forward with the
    speculative one)."""
    import json

    from transformers import AutoConfig, AutoModelForCausalLM

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
    runs = json.loads((tmp_path / "evaluate" / "target_outputs.json").read_text())["runs"]
    model = AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32).eval()
    assert len(runs) == 2
    for run in runs:
        ids = torch.tensor([run["prompt_ids"]])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                                 temperature=None, top_p=None, top_k=None)
        assert run["tokens"] == out[0, ids.shape[1]:].tolist(), run["id"]


def test_long_context_evaluation_decodes_after_earlier_turns(tiny_run):
    """--evaluate.context_tokens=N: every prompt holds at least N tokens (earlier ShareGPT turns ahead
    of the question), decoding stays lossless, and results.json says under which context it ran."""
    from eyas.cli import main

    root, _ = tiny_run
    out = root / "long"
    assert main(cli_args(root, "--mode=chain", "--context_tokens=300", "--measure_speedup=false",
                         f"--out_dir={out}")) == 0
    r = json.loads((out / "results.json").read_text())
    assert r["settings"]["context_tokens"] == 300 and r["lossless"] is True and r["num_prompts"] == 3
    assert all(rec["prompt_tokens"] >= 300 for rec in r["records"])
