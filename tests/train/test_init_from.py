"""eyas.train.init_from: --train.init_from starts from a trained draft or its export."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from eyas.draft import Eagle3Draft
from eyas.errors import ArtifactError, ConfigError
from eyas.train import build, init_from, run
from tests.train.runs import tiny_cfg


def test_init_from_a_trained_draft_or_its_export(tmp_path, smol_prep, tiny_target, monkeypatch, capsys):
    """--train.init_from starts from a trained draft's weights, from train's final/ or from an
    export, with a fresh optimizer and schedule, and records what it read; another draft shape or
    vocabulary is refused naming what differs, a directory without a draft before any work."""
    from eyas.assets import sha256_file
    from eyas.draft_files import export_draft, load_draft, save_draft

    cpu = torch.device("cpu")
    first = tiny_cfg(tmp_path / "a", smol_prep, tiny_target, "--train.mode=online", "--train.max_steps=3")
    run(first)
    final = first.stage_dir("train") / "final"
    data = build.load_data(first, cpu)
    trained = load_draft(final, data.embed_VD)
    exported = export_draft(trained, tmp_path / "exp", formats=("speculators",), dtype="float32",
                            verifier=str(tiny_target), verifier_arch=["LlamaForCausalLM"])["speculators"]
    fresh, _ = build.build_trainer(first, data, cpu, total_steps=5)
    assert not all(torch.equal(p, q) for p, q in zip(fresh.draft.parameters(), trained.parameters()))
    for src, weights in ((final, final / "draft.safetensors"), (exported, exported / "model.safetensors")):
        cfg = tiny_cfg(tmp_path / src.name, smol_prep, tiny_target, "--train.mode=online", f"--train.init_from={src}")
        tr, _ = build.build_trainer(cfg, data, cpu, total_steps=5)
        for (name, p), q in zip(tr.draft.named_parameters(), trained.parameters()):
            assert torch.equal(p, q), name
        assert tr.optimizer.state_dict()["state"] == {} and tr.scheduler.last_epoch == 0
        assert tr.init_from == {"dir": str(src), "weights_sha256": sha256_file(weights)}
        skipped, _ = build.build_trainer(cfg, data, cpu, total_steps=5, init=False)  # a resumed run's
        assert all(torch.equal(p, q) for p, q in zip(skipped.draft.parameters(), fresh.draft.parameters()))
    # the alignment mask on a trained draft, or on a resumed run, is not warned about (from random weights it is)
    capsys.readouterr()
    aligned = tiny_cfg(tmp_path / "al", smol_prep, tiny_target, "--train.mode=online", f"--train.init_from={final}",
                       "--train.align_top_k=3")
    build.build_trainer(aligned, data, cpu, total_steps=5)
    scratch = tiny_cfg(tmp_path / "as", smol_prep, tiny_target, "--train.mode=online", "--train.align_top_k=3")
    build.build_trainer(scratch, data, cpu, total_steps=5, init=False)
    assert "align_top_k" not in capsys.readouterr().out
    wider = tiny_cfg(tmp_path / "w", smol_prep, tiny_target, "--train.mode=online", f"--train.init_from={final}",
                     "--train.intermediate_size=64")
    with pytest.raises(ConfigError, match=r"intermediate_size \d+ there, 64 here"):
        build.build_trainer(wider, data, cpu, total_steps=5)
    eagle31 = tiny_cfg(tmp_path / "n", smol_prep, tiny_target, "--train.mode=online", f"--train.init_from={final}",
                       "--train.norms=eagle3.1", "--export.format=speculators")
    with pytest.raises(ConfigError, match="fc_norm False there, True here, norm_output False there, True here"):
        build.build_trainer(eagle31, data, cpu, total_steps=5)
    d2t = data.d2t.clone()
    d2t[-1] += 1
    with pytest.raises(ArtifactError, match="another draft vocabulary"):
        init_from.init_weights(fresh.draft, str(final), d2t, data.t2d)
    # init_vocab=remap: on the same vocabulary a plain copy; on another one the shared tokens' rows
    # by target id, every other weight as trained (remap_head's own test checks the new rows)
    remap = tiny_cfg(tmp_path / "m", smol_prep, tiny_target, "--train.mode=online", f"--train.init_from={final}",
                     "--train.init_vocab=remap")
    tr, _ = build.build_trainer(remap, data, cpu, total_steps=5)
    assert all(torch.equal(p, q) for p, q in zip(tr.draft.parameters(), trained.parameters()))
    assert "vocab" not in tr.init_from
    ids_W = torch.arange(data.d2t.numel()) + data.d2t
    ids_X = torch.cat([ids_W[100:], torch.tensor(sorted(set(range(700)) - set(ids_W.tolist()))[:50])])
    t2d_X = torch.zeros_like(data.t2d)
    t2d_X[ids_X] = True
    other = Eagle3Draft(dataclasses.replace(trained.config, draft_vocab_size=ids_X.numel()), data.embed_VD)
    other.set_vocab(ids_X - torch.arange(ids_X.numel()), t2d_X)
    with pytest.raises(ArtifactError, match="--train.init_vocab=remap"):
        init_from.init_weights(other, str(final), other.d2t, other.t2d)
    record = init_from.init_weights(other, str(final), other.d2t, other.t2d, data.lm_head_VD, remap=True)
    assert record["vocab"] == {"copied": data.d2t.numel() - 100, "new": 50}
    assert torch.equal(other.lm_head.weight[: ids_X.numel() - 50], trained.lm_head.weight[100:])
    for (name, p), q in zip(other.named_parameters(), trained.parameters()):
        assert name == "lm_head.weight" or torch.equal(p, q), name
    # a run refuses a draft of another vocabulary before it reads its data (online: loads the target)
    save_draft(other, tmp_path / "other")
    with monkeypatch.context() as m:
        m.setattr(build, "load_data", lambda *a: pytest.fail("read the data before checking the vocabulary"))
        with pytest.raises(ArtifactError, match="another draft vocabulary.*--train.init_vocab=remap"):
            run(tiny_cfg(tmp_path / "o", smol_prep, tiny_target, "--train.mode=online",
                         f"--train.init_from={tmp_path / 'other'}"))
    # a whole run records the draft it started from, also when it was resumed (the checkpoint keeps it)
    cfg = tiny_cfg(tmp_path / "r", smol_prep, tiny_target, "--train.mode=online", f"--train.init_from={exported}",
                   "--train.max_steps=3", "--train.save_every=1", "--train.keep_checkpoints=0")
    record = {"dir": str(exported), "weights_sha256": sha256_file(exported / "model.safetensors")}
    assert run(cfg)["inputs"]["init_from"] == record
    ckpt = cfg.stage_dir("train") / "checkpoints" / "step_0000002"
    resumed = run(tiny_cfg(tmp_path / "r", smol_prep, tiny_target, "--train.mode=online", f"--train.init_from={exported}",
                           "--train.max_steps=3", "--train.save_every=1", f"--train.resume={ckpt}"))
    assert resumed["counts"]["resumed_from_step"] == 2 and resumed["inputs"]["init_from"] == record
    # a directory without a draft: refused before the data is read
    monkeypatch.setattr(build, "load_data", lambda *a: pytest.fail("read the data before checking init_from"))
    with pytest.raises(ConfigError, match="not a draft directory"):
        run(tiny_cfg(tmp_path / "x", smol_prep, tiny_target, "--train.mode=online", f"--train.init_from={tmp_path}"))
