"""eyas.train, the stage: its config errors, a tiny run on real SmolLM2 hidden states that learns
(outputs: final draft, meta.json, plots), and a second run refused without --train.resume."""

from __future__ import annotations

import pytest
import torch

from eyas.errors import ConfigError
from eyas.train import build, run
from tests.train.runs import InMemoryStates, read_metrics, tiny_cfg, train_config


def test_config_errors_name_the_flag(tmp_path):
    with pytest.raises(ConfigError, match="train.ttt_steps"):
        train_config(tmp_path, "--train.ttt_steps=0")
    with pytest.raises(ConfigError, match="train.betas"):
        train_config(tmp_path, "--train.betas=[0.9]")
    with pytest.raises(ConfigError, match=r"train.top1_weight=1.5 must lie in \[0, 1\]"):
        train_config(tmp_path, "--train.top1_weight=1.5")
    with pytest.raises(ConfigError, match="train.align_norm='kept' needs train.align_top_k > 0"):
        train_config(tmp_path, "--train.align_norm=kept")
    with pytest.raises(ConfigError, match="train.align_norm='rows': choose one of valid, kept"):
        train_config(tmp_path, "--train.align_norm=rows", "--train.align_top_k=3")
    with pytest.raises(ConfigError, match=r"train.target_group_tokens=-1 must be >= 0 \(0 = one forward per batch\)"):
        train_config(tmp_path, "--train.target_group_tokens=-1")
    with pytest.raises(ConfigError, match="train.init_vocab='remap' needs train.init_from"):
        train_config(tmp_path, "--train.init_vocab=remap")
    with pytest.raises(ConfigError, match="train.init_vocab='any': choose one of same, remap"):
        train_config(tmp_path, "--train.init_vocab=any", "--train.init_from=/d")
    with pytest.raises(ConfigError, match="train.init_head='zeros': choose one of random, target"):
        train_config(tmp_path, "--train.init_head=zeros")
    with pytest.raises(ConfigError, match="train.init_head='target' with train.init_from"):
        train_config(tmp_path, "--train.init_head=target", "--train.init_from=/d")
    with pytest.raises(ConfigError, match="did you mean 'train.max_tokens'"):
        train_config(tmp_path, "--train.max_token=5")


# ---------------------------------------------------------------- training


def smol_data(prep_dir, model, max_samples: int) -> build.TrainData:
    from eyas.capture import default_layer_ids
    from eyas.prepared import Prepared

    prep = Prepared(prep_dir)
    layer_ids = default_layer_ids(model.config.num_hidden_layers)
    head = model.get_input_embeddings().weight.detach()  # SmolLM2 ties its LM head to the embedding
    return build.TrainData(InMemoryStates(prep, model, layer_ids, max_samples), prep.d2t, prep.t2d, layer_ids,
                           head, head, model.config)


@pytest.mark.slow
def test_tiny_run_on_real_smollm2_states_learns(tmp_path, smol_prep, smol_model):
    data = smol_data(smol_prep, smol_model, max_samples=10)
    cfg = train_config(
        tmp_path, "--train.ttt_steps=3", "--train.num_attention_heads=4", "--train.num_key_value_heads=2",
        "--train.intermediate_size=256", "--train.max_tokens=256", "--train.epochs=20", "--train.max_steps=30",
        "--train.lr=3e-3", "--train.warmup_steps=3", "--train.log_every=5", "--train.eval_fraction=0.1",
        "--train.save_every=0",
    )
    meta = run(cfg, data)
    recs = read_metrics(cfg.stage_dir("train"))
    first, last = recs[0], recs[-1]
    assert last["loss"] < 0.7 * first["loss"], [r["loss"] for r in recs]
    assert last["tau"] > first["tau"] + 0.1, [r["tau"] for r in recs]
    assert len(last["acc_T"]) == len(last["loss_T"]) == 3 and last["tokens_per_s"] > 0 and last["grad_norm"] > 0
    assert 1.0 <= first["tau_chain_rows"] < last["tau_chain_rows"] <= 4.0 and all(0 <= a <= 1 for a in last["chain_acc_rows_T"])
    assert all(r["trained_share_T"] == [1.0, 1.0, 1.0] for r in recs)  # without align_top_k every valid row trains
    assert read_metrics(cfg.stage_dir("train"), "eval")
    # outputs: final draft (eyas.draft format), meta.json with the final metrics, plots
    from eyas.artifacts import read_meta
    from eyas.draft_files import load_draft

    out = cfg.stage_dir("train")
    assert read_meta(out, "train")["metrics"]["tau"] == pytest.approx(last["tau"]) == meta["metrics"]["tau"]
    # the stage's rate: every window of the run (not the last one alone), then without the first
    seconds = [r["tokens"] / r["tokens_per_s"] for r in recs]
    assert [r["seconds"] for r in recs] == pytest.approx(seconds, rel=1e-9)
    assert all(0 < r["loader_s"] < r["seconds"] for r in recs)  # the loader's share of each window, on the host
    m = meta["metrics"]
    assert m["tokens_per_s"] == pytest.approx(sum(r["tokens"] for r in recs) / sum(seconds), rel=1e-9)
    assert m["tokens_per_s_after_first_window"] == pytest.approx(
        sum(r["tokens"] for r in recs[1:]) / sum(seconds[1:]), rel=1e-9)
    assert m["tokens_per_s_last_window"] == last["tokens_per_s"]
    draft = load_draft(out / "final", data.embed_VD)
    assert draft.config.aux_layer_ids == [2, 15, 27] and draft.config.draft_vocab_size == 512
    assert torch.equal(draft.d2t, data.d2t) and torch.equal(draft.t2d, data.t2d)
    pytest.importorskip("matplotlib")
    from eyas.cli import main as cli

    assert cli(["plot", str(out)]) == 0
    assert sorted(p.name for p in (out / "plots").iterdir()) == ["acc.png", "loss.png", "tau.png"]


def test_an_existing_run_needs_resume(tmp_path, smol_prep, tiny_target):
    cfg = tiny_cfg(tmp_path, smol_prep, tiny_target, "--train.mode=online", "--train.max_steps=2")
    run(cfg)
    with pytest.raises(ConfigError, match="--train.resume=auto"):
        run(cfg)
