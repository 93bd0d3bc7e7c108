"""eyas.evaluate.teacher_forced: evaluate.mode=simulate (and the check beside chain and tree runs) gives
the decoders' passes from a teacher-forced forward, without decoding."""

from __future__ import annotations

import json

import pytest
import torch

from eyas.config import load_config
from eyas.errors import ConfigError
from tests.evaluate.runs import cli_args
from tests.models import fitted_draft


def test_simulate_mode_gives_the_chain_decoders_passes_without_decoding(tiny_run, tmp_path, capsys):
    """evaluate.mode=simulate decodes target-only only and simulates the chain from the draft's
    teacher-forced forward; in float32 its passes are the chain decoder's own: a chain-mode run over
    the same prompts is the independent reference, with a draft fitted to the target's answers so
    that it accepts tokens (a random one accepts none, and any simulation would agree with it)."""
    from transformers import AutoTokenizer

    from eyas.assets import sha256_file
    from eyas.cli import main
    from eyas.draft_files import save_draft
    from eyas.evaluate.inputs import render
    from eyas.run.summary import evaluation, print_summary
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
        assert main(cli_args(root, "--mode=chain", f"--out_dir={tmp_path / 'chain'}", *args)) == 0
        assert main(cli_args(root, "--mode=tree", f"--out_dir={tmp_path / 'tree'}", *args)) == 0
        capsys.readouterr()
        assert main(cli_args(root, "--mode=simulate", f"--out_dir={tmp_path / 'sim'}", *args)) == 0
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
    print_summary({"run_dir": "r", "stages": {}, **evaluation(tmp_path / "sim")})
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
            assert main(cli_args(root, "--mode=simulate", f"--out_dir={again}", f"--target_outputs={tmp_path / source}",
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
    assert main(cli_args(root, "--mode=simulate", f"--target_outputs={tmp_path / 'sim'}", *args, "--max_new_tokens=11")) == 2
    assert "max_new_tokens 12 there, 11 here" in capsys.readouterr().err
    (tmp_path / "broken.json").write_text(json.dumps({"key": [], "runs": [], "complete": True}))
    assert main(cli_args(root, "--mode=simulate", f"--target_outputs={tmp_path / 'broken.json'}", *args)) == 2
    assert "broken.json: not a target_outputs.json (TypeError" in capsys.readouterr().err
    stored = json.loads((tmp_path / "sim" / "target_outputs.json").read_text())
    stored["runs"][0]["tokens"][0] = (stored["runs"][0]["tokens"][0] + 1) % 512  # question 1's first answer
    (tmp_path / "tampered.json").write_text(json.dumps(stored))
    assert main(cli_args(root, "--mode=simulate", f"--target_outputs={tmp_path / 'tampered.json'}", *args)) == 2
    assert "question 1 turn 1: the prompt renders to other tokens here" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="read by evaluate.mode=simulate only"):
        load_config(None, ["--evaluate.target_outputs=x", "--evaluate.mode=chain"])
