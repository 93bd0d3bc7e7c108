"""train: loss on a hand-built example, a tiny run on real SmolLM2 hidden states, offline = online,
non-finite stop, kill -9 + resume, outputs (final draft, meta.json, plots)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from eyas.draft import Eagle3Draft
from eyas.errors import ArtifactError, ConfigError
from eyas import vocab
from eyas.train import build, init_from, run
from eyas.train.loss import acceptance_length, step_terms, teacher_targets, weighted_loss
from train_helpers import InMemoryStates, read_metrics, run_prepare, save_tiny_llama, train_config, write_chats


@pytest.fixture(scope="session")
def smol_prep(tmp_path_factory, smollm2_dir):
    tmp = tmp_path_factory.mktemp("train_prep")
    return run_prepare(tmp / "run", write_chats(tmp / "chats.jsonl", 16), max_length=128, draft_vocab=512)


@pytest.fixture(scope="session")
def smol_model(smollm2_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory, smollm2_dir, smol_prep):
    """A tiny random Llama whose LM-head rows outside the draft vocabulary are zero, so its top-1
    usually lies inside the vocabulary and every position trains (random heads pick any of 49k)."""
    from transformers import AutoModelForCausalLM

    from eyas.prepared import Prepared

    out = save_tiny_llama(tmp_path_factory.mktemp("tiny") / "tiny", smollm2_dir)
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    with torch.no_grad():
        model.lm_head.weight[~Prepared(smol_prep).t2d] = 0
    model.save_pretrained(str(out))
    return out


# ---------------------------------------------------------------- loss, metrics


def test_loss_on_a_hand_built_example():
    # V = 6 target tokens, draft vocab = target ids [1, 3, 4]; final rows are one-hot, so the
    # target's logits of row j are column j of the LM head.
    logits_VN = torch.tensor([[0, 3, 0], [2, 0, 0], [1, 0, 0], [1, 1, 1], [0.5, 2, 4], [-1, 0, 0]], dtype=torch.float64)
    t2d = torch.tensor([False, True, False, True, True, False])
    from eyas.vocab import target_to_draft

    p, top1 = teacher_targets(torch.eye(3, dtype=torch.float64), logits_VN, torch.tensor([1, 3, 4]),
                              target_to_draft(torch.arange(6), t2d), chunk=2)
    assert top1.tolist() == [0, -1, 2]  # row 1's top-1 is target token 0: outside the draft vocab

    def softmax(z):
        e = [math.exp(x) for x in z]
        return [x / sum(e) for x in e]

    teacher = [softmax([2, 1, 0.5]), softmax([0, 1, 2]), softmax([0, 1, 4])]
    torch.testing.assert_close(p, torch.tensor(teacher, dtype=torch.float32))

    def ce(z, q):  # -sum_w q_w log softmax(z)_w
        lse = math.log(sum(math.exp(x) for x in z))
        return -sum(qi * (zi - lse) for zi, qi in zip(z, q))

    z0 = [[1.0, 0, 0], [0, 0, 1.0], [0, 0, 3.0]]  # step 0 drafts rows 0, 1, 2
    z1 = [[0, 2.0, 0]]  # step 1 drafts row 2 only
    rows = [torch.tensor([0, 1, 2]), torch.tensor([2])]  # the flat rows, here equal to their teacher rows
    loss_sum, correct, valid, reached, chain, _ = step_terms([torch.tensor(z0), torch.tensor(z1)], p, top1, rows, rows, 3)
    want0 = ce(z0[0], teacher[0]) + ce(z0[2], teacher[2])  # row 1 is not valid
    want1 = ce(z1[0], teacher[2])
    torch.testing.assert_close(loss_sum, torch.tensor([want0, want1]))
    assert correct.tolist() == [2, 0] and valid.tolist() == [2, 1]
    assert chain.tolist() == [2, 0]  # rows 0 and 2 accepted at step 0; row 2's step 1 drafts 1, not 2
    assert reached.tolist() == [3, 1]  # every row reaches step 0; of rows 0 and 2, only row 2 has a step 1
    loss = weighted_loss(loss_sum, torch.tensor([4, 1]), torch.tensor([1.0, 0.8]))
    assert loss.item() == pytest.approx(want0 / 4 + 0.8 * want1, rel=1e-6)

    # train.top1_weight w: (1 - w) x the soft cross-entropy + w x -log softmax(z)[teacher top-1]
    def nll(z, k):
        return math.log(sum(math.exp(x) for x in z)) - z[k]

    for w in (0.25, 1.0):
        l0, l1 = torch.tensor(z0, requires_grad=True), torch.tensor(z1, requires_grad=True)
        mixed, correct, valid, _, _, _ = step_terms([l0, l1], p, top1, rows, rows, 3, top1_weight=w)
        hard0 = nll(z0[0], 0) + nll(z0[2], 2)  # top-1 draft ids of rows 0 and 2; row 1 still not valid
        hard1 = nll(z1[0], 2)
        torch.testing.assert_close(mixed.detach(), torch.tensor([(1 - w) * want0 + w * hard0, (1 - w) * want1 + w * hard1]))
        assert correct.tolist() == [2, 0] and valid.tolist() == [2, 1]
        # d/dz of each valid row: (1 - w)(softmax(z) - teacher) + w(softmax(z) - onehot(top-1)); row 1: 0
        mixed.sum().backward()
        def grad(z, row, k):
            q = torch.tensor(softmax(z))
            return (1 - w) * (q - torch.tensor(teacher[row])) + w * (q - torch.eye(3)[k])

        torch.testing.assert_close(l0.grad, torch.stack([grad(z0[0], 0, 0), torch.zeros(3), grad(z0[2], 2, 2)]))
        torch.testing.assert_close(l1.grad, grad(z1[0], 2, 2)[None])


@pytest.mark.parametrize("k", [0, 1, 3])
def test_chain_counts_and_align_mask_match_a_per_row_loop(k):
    # Random steps over 40 flat rows, each step training its own subset (rows drop in and out as
    # loss masks do), draft logits near the teacher so that about half the top-1s agree.
    g = torch.Generator().manual_seed(k)
    num_rows, num_teacher, w, steps = 40, 30, 6, 4
    p = torch.softmax(torch.randn(num_teacher, w, generator=g) * 2, -1)
    top1 = p.argmax(-1)
    top1[torch.randperm(num_teacher, generator=g)[:4]] = -1  # outside the draft vocab
    rows_T = [torch.randperm(num_rows, generator=g)[:30].sort().values for _ in range(steps)]
    tix_T = [torch.randint(num_teacher, (30,), generator=g) for _ in range(steps)]
    logits_T = [p[t].log() + torch.randn(30, w, generator=g) for t in tix_T]
    loss, correct, valid, reached, chain, kept = step_terms(logits_T, p, top1, tix_T, rows_T, num_rows, align_top_k=k)

    def at(i, r):  # -> (logits, teacher row) of flat row r at step i, or None if step i skips it
        hits = (rows_T[i] == r).nonzero()
        return (logits_T[i][hits[0, 0]], int(tix_T[i][hits[0, 0]])) if len(hits) else None

    def agrees(i, r, top_k):
        got = at(i, r)
        return got is not None and int(top1[got[1]]) >= 0 and int(top1[got[1]]) in got[0].topk(top_k).indices.tolist()

    for i in range(steps):
        want_loss, want_chain, want_reached, want_kept = 0.0, 0, 0, 0
        for r in rows_T[i].tolist():
            z, t = at(i, r)
            trained = int(top1[t]) >= 0 and (k == 0 or all(agrees(j, r, k) for j in range(i)))
            if trained:
                want_loss += float(-(p[t] * torch.log_softmax(z, -1)).sum())
                want_kept += 1
            want_reached += all(agrees(j, r, 1) for j in range(i))
            want_chain += all(agrees(j, r, 1) for j in range(i + 1))
        assert loss[i].item() == pytest.approx(want_loss, rel=1e-5)
        assert int(chain[i]) == want_chain and int(reached[i]) == want_reached and int(kept[i]) == want_kept
    assert 0 < int(chain[-1]) < int(chain[0]) == int(correct[0]) < len(rows_T[0])  # both branches run
    assert any(int(reached[i]) < int(chain[i - 1]) for i in range(1, steps))  # alive rows with no next step
    assert valid.tolist() == [int((top1[t] >= 0).sum()) for t in tix_T]
    assert (kept == valid).all() if k == 0 else (kept[1:] < valid[1:]).all()


@pytest.mark.parametrize("top1_weight,k,dtype", [(0.0, 0, torch.float32), (0.5, 3, torch.bfloat16), (1.0, 1, torch.float32)])
def test_compiled_loss_kernel_equals_eager(top1_weight, k, dtype):
    """train.loss_kernel=compiled (row_terms under torch.compile, dynamic row counts) gives the eager
    loss sums, counts and logits gradients, on steps of different row counts and with bf16 logits
    (read in float32 either way), for the soft, mixed and top-1 losses and the align mask."""
    g = torch.Generator().manual_seed(7)
    num_rows, num_teacher, w = 50, 40, 300
    p = torch.softmax(torch.randn(num_teacher, w, generator=g) * 3, -1)
    top1 = p.argmax(-1)
    top1[torch.randperm(num_teacher, generator=g)[:5]] = -1
    sizes = [37, 29, 41, 33]  # a new row count per step: compiled once with dynamic shapes
    rows_T = [torch.randperm(num_rows, generator=g)[:m].sort().values for m in sizes]
    tix_T = [torch.randint(num_teacher, (m,), generator=g) for m in sizes]
    base_T = [(p[t].log() + torch.randn(len(t), w, generator=g)).to(dtype) for t in tix_T]
    out, grads = {}, {}
    for compiled in (False, True):
        logits_T = [z.clone().requires_grad_() for z in base_T]
        terms = step_terms(logits_T, p, top1, tix_T, rows_T, num_rows, top1_weight, k, compiled)
        (terms[0] * torch.tensor([1.0, 0.8, 0.64, 0.512])).sum().backward()
        out[compiled], grads[compiled] = terms, [z.grad for z in logits_T]
    torch.testing.assert_close(out[True][0], out[False][0], rtol=1e-5, atol=1e-4)
    assert out[False][0].min() > 1  # every step trains rows
    for a, b in zip(out[True][1:], out[False][1:]):
        assert torch.equal(a, b)
    assert 0 < int(out[True][4][-1]) < int(out[True][1][0])  # chains both survive and die
    for a, b in zip(grads[True], grads[False]):
        assert a.dtype == dtype and a.abs().sum() > 0
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6) if dtype == torch.float32 else \
            torch.testing.assert_close(a.float(), b.float(), rtol=1e-2, atol=1e-4)


def test_acceptance_length():
    assert acceptance_length([0.8, 0.5, 0.25]) == pytest.approx(1 + 0.8 + 0.4 + 0.1)
    assert acceptance_length([0.0, 1.0]) == 1.0
    assert acceptance_length([1.0] * 7) == 8.0


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


# ---------------------------------------------------------------- target tensors


def test_embedding_and_head_without_loading_the_model(smollm2_dir, smol_model, tiny_target):
    from transformers import AutoModelForCausalLM

    from eyas.config.target import TargetConfig
    from eyas.train.target_weights import load_embed_and_head

    emb, head = load_embed_and_head(TargetConfig(model=str(smollm2_dir)))  # tied
    assert head is emb
    torch.testing.assert_close(emb.float(), smol_model.get_input_embeddings().weight)
    emb, head = load_embed_and_head(TargetConfig(model=str(tiny_target)))  # untied
    ref = AutoModelForCausalLM.from_pretrained(str(tiny_target), dtype=torch.float32)
    assert torch.equal(emb, ref.model.embed_tokens.weight) and torch.equal(head, ref.lm_head.weight)


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


def tiny_cfg(run_dir, prep, target, *extra):
    return train_config(
        run_dir, f"--prepare.out_dir={prep}", f"--target.model={target}", "--train.ttt_steps=3",
        "--train.max_tokens=128", "--train.lr=1e-3", "--train.eval_fraction=0", "--train.log_every=1", *extra,
    )


def first_window(cfg, data):
    """-> (trainer, its schedule, the training split, the first optimizer step, its micro-batches)."""
    from eyas.train.loop import Schedule, micro_batches

    train_idx, _ = build.splits(cfg, data)
    sched = Schedule(cfg.train, train_idx, data.lengths, cfg.seed, 0, 1)
    tr, _ = build.build_trainer(cfg, data, torch.device("cpu"), total_steps=sched.total)
    step, _, batches = next(micro_batches(tr, sched, data.source, 0, 0, 0))
    return tr, sched, train_idx, step, batches


def first_step(cfg, data):
    from eyas.train.loop import train_step

    tr, _, _, step, batches = first_window(cfg, data)
    out = train_step(tr, batches, step)
    return out, [b.sample_ids for b in batches], torch.cat([p.detach().flatten() for p in tr.draft.parameters()])


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


def test_init_head_target_starts_from_the_targets_rows_of_the_draft_tokens(tmp_path, smol_prep, tiny_target):
    """--train.init_head=target: lm_head row i is the target's row of draft token i (target id
    i + d2t[i], checked token by token against t2d's own order) times one factor that gives the
    rows the random head's mean norm; every other weight is what the same seed gives with a random
    head; a resumed run (init=False) keeps the random one (its checkpoint holds the weights)."""
    cpu = torch.device("cpu")
    rand = tiny_cfg(tmp_path / "r", smol_prep, tiny_target, "--train.mode=online")
    data = build.load_data(rand, cpu)
    head = tiny_cfg(tmp_path / "h", smol_prep, tiny_target, "--train.mode=online", "--train.init_head=target")
    base, _ = build.build_trainer(rand, data, cpu, total_steps=5)
    tr, _ = build.build_trainer(head, data, cpu, total_steps=5)
    kept = sorted(torch.nonzero(data.t2d).flatten().tolist())  # the draft vocabulary, in target-id order
    assert len(kept) == data.d2t.numel()
    head_WD, target_WD = tr.draft.lm_head.weight.detach(), data.lm_head_VD[kept].float()
    scale = float(base.draft.lm_head.weight.detach().norm(dim=1).mean() / target_WD.norm(dim=1).mean())
    assert 0 < scale < 1  # the target's rows are longer than PyTorch's default ones
    for i, tok in enumerate(kept):
        torch.testing.assert_close(head_WD[i], data.lm_head_VD[tok].float() * scale, msg=f"draft id {i}, token {tok}")
    torch.testing.assert_close(head_WD.norm(dim=1).mean(), base.draft.lm_head.weight.detach().norm(dim=1).mean())
    for (name, p), q in zip(tr.draft.named_parameters(), base.draft.parameters()):
        assert name == "lm_head.weight" or torch.equal(p, q), name
    resumed, _ = build.build_trainer(head, data, cpu, total_steps=5, init=False)
    assert torch.equal(resumed.draft.lm_head.weight, base.draft.lm_head.weight)


def test_remap_head_copies_shared_tokens_and_fits_the_rest():
    """A hand-built remap: V 10 target tokens, D 3; the trained draft holds target ids 1 2 3 4 7 8,
    the new vocabulary 0 1 3 4 5 7 8 9 (in another order, without 2). Shared tokens keep their
    trained rows; the new ones are the target's rows times the float64 normal-equations solution on
    the shared tokens only (token 2's row must not enter the fit). A mere reordering copies every row."""
    g = torch.Generator().manual_seed(0)
    lm_head_VD = torch.randn(10, 3, generator=g)
    src_ids = torch.tensor([1, 2, 3, 4, 7, 8])
    head_UD = torch.randn(6, 3, generator=g)
    src_d2t = src_ids - torch.arange(6)
    ids = torch.tensor([9, 4, 1, 0, 8, 3, 5, 7])
    out, counts = vocab.remap_head(head_UD, src_d2t, ids - torch.arange(8), lm_head_VD)
    assert counts == {"copied": 5, "new": 3}
    src_row = {int(t): i for i, t in enumerate(src_ids)}
    shared = [1, 3, 4, 7, 8]
    X, Y = lm_head_VD.double()[shared], head_UD.double()[[src_row[t] for t in shared]]
    M = torch.linalg.solve(X.T @ X, X.T @ Y)
    for w, t in enumerate(ids.tolist()):
        want = head_UD[src_row[t]] if t in src_row else (lm_head_VD.double()[t] @ M).float()
        torch.testing.assert_close(out[w], want, rtol=1e-5, atol=1e-5)
    perm = torch.tensor([8, 1, 7, 2, 4, 3])
    out, counts = vocab.remap_head(head_UD, src_d2t, perm - torch.arange(6), lm_head_VD)
    assert counts == {"copied": 6, "new": 0}
    assert torch.equal(out, head_UD[[src_row[t] for t in perm.tolist()]])
    with pytest.raises(ArtifactError, match="share no token"):
        vocab.remap_head(head_UD, src_d2t, torch.tensor([0, 5]) - torch.arange(2), lm_head_VD)


@pytest.mark.parametrize("num_layers", [1, 2])
def test_with_vocab_moves_a_draft_to_another_vocabulary_keeping_its_proposals(num_layers):
    """tools/draft_variants.py whole-vocab: a W = 10 draft of a V = 40 target moved to W = V keeps
    its layers and the logit of each of its tokens; the 30 new tokens get rows fitted from the
    target's (remap_head, tested above). Moved back, it is the first draft again. Another target's
    lm_head is refused."""
    from transformers import LlamaConfig

    from eyas.draft import DraftConfig
    from eyas.vocab import d2t_t2d

    tcfg = LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=4,
                       num_attention_heads=2, num_key_value_heads=1)
    torch.manual_seed(0)
    cfg = DraftConfig.from_target(tcfg, draft_vocab_size=10, aux_layer_ids=[0, 1, 2], num_layers=num_layers)
    draft = Eagle3Draft(cfg, torch.randn(40, 16))
    ids = torch.tensor([1, 3, 4, 8, 13, 21, 22, 30, 31, 39])
    draft.set_vocab(*d2t_t2d(ids.numpy(), 40))
    before = {k: v.clone() for k, v in draft.state_dict().items()}
    lm_head_VD = torch.randn(40, 16)
    full, counts = vocab.with_vocab(draft, torch.zeros(40, dtype=torch.int64), lm_head_VD)
    assert counts == {"copied": 10, "new": 30}
    assert full.config.draft_vocab_size == 40 and full.t2d.all() and not full.d2t.any()
    assert all(torch.equal(v, draft.state_dict()[k]) for k, v in before.items())  # the source is untouched
    for name, p in full.named_parameters():
        if name == "lm_head.weight":
            assert torch.equal(p, vocab.remap_head(before[name], draft.d2t, full.d2t, lm_head_VD)[0])
        else:
            assert torch.equal(p, before[name]) and p.data_ptr() != draft.get_parameter(name).data_ptr(), name
    h_BSD = torch.randn(1, 5, 16)
    with torch.no_grad():
        # draft id = target id at W = V (equal up to the matmul's blocking over another W)
        torch.testing.assert_close(full.logits(h_BSD)[..., ids], draft.logits(h_BSD), rtol=1e-6, atol=1e-6)
    back, counts = vocab.with_vocab(full, draft.d2t, lm_head_VD)
    assert counts == {"copied": 10, "new": 0}
    assert all(torch.equal(v, before[k]) for k, v in back.state_dict().items())
    with pytest.raises(ValueError, match="the draft's own target"):
        vocab.with_vocab(draft, torch.zeros(48, dtype=torch.int64), torch.randn(48, 16))


@pytest.mark.parametrize("group_tokens", [0, 40])
def test_offline_equals_online_for_one_step(tmp_path, smol_prep, tiny_target, group_tokens):
    """One optimizer step on states the target captures per batch (one forward per batch, or in
    groups of similar length: train.target_group_tokens) equals one on states captured beforehand."""
    from transformers import AutoModelForCausalLM

    from eyas.prepared import Prepared
    from eyas.train.target_weights import load_embed_and_head

    cfg = tiny_cfg(tmp_path, smol_prep, tiny_target, "--train.mode=online", "--train.grad_accum=2",
                   f"--train.target_group_tokens={group_tokens}")
    online = build.load_data(cfg, torch.device("cpu"))  # the target captures states per batch
    assert online.states.group_overhead_tokens == (group_tokens or None)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_target), dtype=torch.float32).eval()
    prep = Prepared(smol_prep)
    emb, head = load_embed_and_head(cfg.target)
    offline = build.TrainData(InMemoryStates(prep, model, online.layer_ids), prep.d2t, prep.t2d, online.layer_ids,
                              emb, head, online.target_config)
    out_on, ids_on, params_on = first_step(cfg, online)
    out_off, ids_off, params_off = first_step(cfg, offline)
    assert ids_on == ids_off and len(ids_on) == 2
    assert out_on["valid_T"].sum() > 50
    for key in ("loss_sum_T", "grad_norm"):
        torch.testing.assert_close(out_on[key], out_off[key], rtol=1e-5, atol=1e-5)
    assert torch.equal(out_on["correct_T"], out_off["correct_T"])
    torch.testing.assert_close(params_on, params_off, rtol=1e-5, atol=1e-6)


def test_top1_weight_trains_on_the_teachers_top1(tmp_path, smol_prep, tiny_target):
    """--train.top1_weight=1: the first step's loss per TTT step is the negative log-probability of
    the target's own top-1 (its lm_head on the final states, argmax over all V), from the draft's
    logits before the update, summed over loss-mask positions whose top-1 is in the draft vocab;
    the held-out evaluation reads the same."""
    from eyas.train.loop import evaluate, train_step

    cfg = tiny_cfg(tmp_path, smol_prep, tiny_target, "--train.mode=online", "--train.top1_weight=1")
    data = build.load_data(cfg, torch.device("cpu"))
    tr, _, _, step, batches = first_window(cfg, data)
    b = tr.prepare(batches[0])
    with torch.no_grad():
        logits_T = tr.forward(b)
        final_ND = b.final_BSD.flatten(0, 1)[b.teacher_rows_N]
        # draft ids are the kept target ids in order: a kept token's draft id counts the kept ones before it
        top1_N = (data.t2d.long().cumsum(0) - 1).where(data.t2d, -1)[(final_ND @ data.lm_head_VD.T).argmax(-1)]
    want = []
    for logits_MW, tix_M in zip(logits_T, b.tix_T):
        k_M = top1_N[tix_M]
        ok = k_M >= 0
        want.append(-torch.log_softmax(logits_MW[ok].double(), -1).gather(1, k_M[ok, None]).sum())
    # the held-out evaluation reads the same loss: per TTT step, the sum over its valid positions
    held = evaluate(tr, [b])
    valid = [int((top1_N[tix_M] >= 0).sum()) for tix_M in b.tix_T]
    assert held["valid_T"] == valid
    assert held["loss_T"] == pytest.approx([float(x) / v for x, v in zip(want, valid)], rel=1e-5)
    out = train_step(tr, [b], step)
    assert out["valid_T"].sum() > 50
    torch.testing.assert_close(out["loss_sum_T"].double(), torch.stack(want), rtol=1e-5, atol=1e-4)


FIT_STEPS = 12


def test_align_top_k_trains_only_rows_whose_greedy_chain_is_alive(tmp_path, smol_prep, tiny_target, capsys):
    """--train.align_top_k=1: step i's loss sums the soft cross-entropy over the rows whose draft
    top-1 matched the target's top-1 at every step before i (found here row by row); the held-out
    evaluation reads the same, and its tau_chain_rows counts the rows still matching after each step."""
    from eyas.train.loop import evaluate, train_step

    cfg = tiny_cfg(tmp_path, smol_prep, tiny_target, "--train.mode=online", "--train.align_top_k=1",
                   "--train.lr=1e-2", "--train.warmup_steps=1")
    data = build.load_data(cfg, torch.device("cpu"))
    tr, _, _, step, batches = first_window(cfg, data)
    # from random weights the mask leaves the later steps few positions: said at the start
    assert "warning: train.align_top_k=1 on a draft from random weights" in capsys.readouterr().out
    b = tr.prepare(batches[0])
    for _ in range(FIT_STEPS):  # a draft that gets some tokens right (a fresh one gets none)
        train_step(tr, [b], step)
    with torch.no_grad():
        logits_T = tr.forward(b)
        p_NW, top1_N = tr.teacher(b)
    hit, want, chain, reached, kept = {}, [], [], [], []  # hit[(row, step)]: the draft's top-1 is the target's there
    for i, (logits_MW, tix_M, rows_M) in enumerate(zip(logits_T, b.tix_T, b.rows_T)):
        total, alive, reach, trained = 0.0, 0, 0, 0
        for z, t, r in zip(logits_MW, tix_M.tolist(), rows_M.tolist()):
            earlier = all(hit.get((r, j), False) for j in range(i))
            hit[(r, i)] = int(top1_N[t]) >= 0 and int(z.argmax()) == int(top1_N[t])
            if earlier and int(top1_N[t]) >= 0:
                total += float(-(p_NW[t] * torch.log_softmax(z.double(), -1)).sum())
                trained += 1
            alive += earlier and hit[(r, i)]
            reach += earlier
        want.append(total)
        chain.append(alive)
        reached.append(reach)
        kept.append(trained)
    assert chain[0] > chain[1] > 0  # some rows miss, some go on: both branches of the mask run
    held = evaluate(tr, [b])
    valid = [int((top1_N[tix_M] >= 0).sum()) for tix_M in b.tix_T]
    assert held["loss_T"] == pytest.approx([w / v for w, v in zip(want, valid)], rel=1e-5)
    rows0 = len(b.rows_T[0])
    assert held["tau_chain_rows"] == pytest.approx(1 + sum(chain) / rows0)
    assert reached[0] == rows0 and held["chain_acc_rows_T"] == pytest.approx([c / r for c, r in zip(chain, reached)])
    # the share of valid rows each step trained on: all of step 0's, fewer after it
    assert kept[0] == valid[0] and kept[1] < valid[1]
    assert held["trained_share_T"] == pytest.approx([k / v for k, v in zip(kept, valid)])
    out = train_step(tr, [b], step)
    torch.testing.assert_close(out["loss_sum_T"].double(), torch.tensor(want, dtype=torch.float64), rtol=1e-5, atol=1e-4)
    assert out["chain_T"].tolist() == chain and out["reached_T"].tolist() == reached and out["kept_T"].tolist() == kept
    # a run's log line shows step 1's and the last step's trained share, as its metrics record them
    short = tiny_cfg(tmp_path / "run", smol_prep, tiny_target, "--train.mode=online", "--train.align_top_k=1",
                     "--train.max_steps=2")
    run(short)
    logged = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[eyas:train] step ")]
    recs = read_metrics(short.stage_dir("train"))
    assert len(logged) == len(recs) == 2
    for line, r in zip(logged, recs):
        assert f" trained {r['trained_share_T'][1]:.2f}..{r['trained_share_T'][2]:.2f} " in line, line


@pytest.mark.parametrize("norm", ["valid", "kept"])
def test_align_norm_divides_each_step_by_its_valid_or_its_kept_rows(tmp_path, smol_prep, tiny_target, norm):
    """--train.align_top_k=1 with --train.align_norm: one train_step's gradient norm equals that of
    sum_i w_i x (step i's soft cross-entropy summed over its kept rows) / n_i, built here row by
    row, with n_i the step's valid rows (valid) or its kept rows (kept)."""
    from eyas.train.loop import train_step

    cfg = tiny_cfg(tmp_path, smol_prep, tiny_target, "--train.mode=online", "--train.align_top_k=1",
                   f"--train.align_norm={norm}", "--train.lr=1e-2", "--train.warmup_steps=1")
    data = build.load_data(cfg, torch.device("cpu"))
    tr, _, _, step, batches = first_window(cfg, data)
    b = tr.prepare(batches[0])
    for _ in range(FIT_STEPS):  # a draft that gets some tokens right, so the mask drops rows
        train_step(tr, [b], step)
    with torch.no_grad():
        p_NW, top1_N = tr.teacher(b)
    logits_T = tr.forward(b)
    hit, loss, kept, valid = {}, 0.0, [], []
    for i, (logits_MW, tix_M, rows_M) in enumerate(zip(logits_T, b.tix_T, b.rows_T)):
        terms = []
        for z, t, r in zip(logits_MW, tix_M.tolist(), rows_M.tolist()):
            earlier = all(hit.get((r, j), False) for j in range(i))
            hit[(r, i)] = int(top1_N[t]) >= 0 and int(z.argmax()) == int(top1_N[t])
            if earlier and int(top1_N[t]) >= 0:
                terms.append(-(p_NW[t] * torch.log_softmax(z.float(), -1)).sum())
        kept.append(len(terms))
        valid.append(int((top1_N[tix_M] >= 0).sum()))
        loss = loss + tr.tc.step_weight**i * torch.stack(terms).sum() / (kept[i] if norm == "kept" else valid[i])
    assert kept[0] == valid[0] and kept[-1] < valid[-1]  # the two normalisers differ past step 0
    tr.optimizer.zero_grad(set_to_none=True)
    loss.backward()
    want = torch.cat([p.grad.flatten() for p in tr.model.parameters() if p.grad is not None]).norm()
    tr.optimizer.zero_grad(set_to_none=True)
    out = train_step(tr, [b], step)
    torch.testing.assert_close(out["grad_norm"], want.float(), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("overhead, forwards", [(0, 6), (40, 3), (None, 1)])
def test_online_states_of_right_padded_rows_equal_plain_forwards(smol_prep, tiny_target, overhead, forwards):
    """OnlineStates runs samples of different lengths as right-padded rows without an attention
    mask, in groups of similar length: six prefixes of 128, 30, 97, 12, 64 and 101 tokens go
    through the target one per forward (overhead 0), as {128} {101, 97, 64} {30, 12} (40 tokens
    per extra forward: padded rows inside groups) or all in one (the default: no overhead given).
    Each sample's states must equal a plain output_hidden_states forward of it alone (a prefix's
    states are the prefix of the whole sample's: attention is causal), and the packed row's tail up
    to pad_multiple stays zero."""
    from transformers import AutoModelForCausalLM

    from eyas.prepared import Prepared
    from eyas.train.data import OnlineStates, pack

    model = AutoModelForCausalLM.from_pretrained(str(tiny_target), dtype=torch.float32).eval()
    prep = Prepared(smol_prep)
    ref = InMemoryStates(prep, model, [1, 2, 3], max_samples=6)
    cuts = [128, 30, 97, 12, 64, 101]
    samples = [{k: (v[:n] if isinstance(v, torch.Tensor) else v) for k, v in prep[i].items()} for i, n in enumerate(cuts)]
    assert [int(x["input_ids"].numel()) for x in samples] == cuts
    grouping = {} if overhead is None else dict(group_overhead_tokens=overhead, group_quantum=1)
    states = OnlineStates(model, [1, 2, 3], "cpu", **grouping)
    batch = states(pack(samples, 3, max_tokens=8192, pad_multiple=64))
    assert states.num_forwards == forwards
    assert batch.input_ids_BS.shape[1] == 448  # 432 tokens, padded up to a multiple of 64
    start = 0
    for smp, n in zip(ref.samples, cuts):
        torch.testing.assert_close(batch.aux_BSKD[0, start : start + n], smp["aux"][:n], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(batch.final_BSD[0, start : start + n], smp["final"][:n], rtol=1e-5, atol=1e-5)
        start += n
    assert not batch.aux_BSKD[0, start:].any() and not batch.final_BSD[0, start:].any()


def test_online_states_forward_runs_under_its_sdpa_kernels(smol_prep, tiny_target, monkeypatch):
    """The target's attention runs with only the SDPA kernels OnlineStates names: by default
    ONLINE_SDPA (cuDNN's off, flash, memory-efficient and math on), read from PyTorch's flags inside
    every attention call; None leaves PyTorch's own flags; the flags come back afterwards, also
    when the forward fails. Naming only the memory-efficient kernel, which this CPU build lacks,
    must fail the forward: the restriction reaches the attention."""
    from torch.nn.attention import SDPBackend
    from transformers import AutoModelForCausalLM

    from eyas.prepared import Prepared
    from eyas.train.data import ONLINE_SDPA, OnlineStates, pack

    cuda = torch.backends.cuda
    flags = lambda: (cuda.cudnn_sdp_enabled(), cuda.flash_sdp_enabled(), cuda.mem_efficient_sdp_enabled(),  # noqa: E731
                     cuda.math_sdp_enabled())
    seen, sdpa = [], torch.nn.functional.scaled_dot_product_attention

    def recording(*args, **kwargs):
        seen.append(flags())
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_target), dtype=torch.float32).eval()
    batch = lambda: pack([Prepared(smol_prep)[0]], 3, 8192)  # noqa: E731
    before = flags()
    assert before[0], "PyTorch allows cuDNN attention by default"
    assert SDPBackend.CUDNN_ATTENTION not in ONLINE_SDPA
    out = OnlineStates(model, [1, 2, 3], "cpu")(batch())
    assert seen and set(seen) == {(False, True, True, True)} and flags() == before
    assert out.final_BSD.abs().sum() > 0
    seen.clear()
    OnlineStates(model, [1, 2, 3], "cpu", sdpa_backends=None)(batch())
    assert seen and set(seen) == {before}
    with pytest.raises(RuntimeError, match="No viable backend"):
        OnlineStates(model, [1, 2, 3], "cpu", sdpa_backends=SDPBackend.EFFICIENT_ATTENTION)(batch())
    assert flags() == before


def test_row_groups_trade_padding_against_forwards():
    """Hand-counted: lengths 2000, 100, 90, 1900, 80 at 2,048 tokens per extra forward. One group
    costs 5 x 2000 + 2048 = 12,048; {2000, 1900} {100, 90, 80} 2 x 2000 + 3 x 100 + 2 x 2048 =
    8,396; three groups {2000} {1900} {...} 2000 + 1900 + 300 + 3 x 2048 = 10,344: two it is.
    Without overhead every 64-token bucket is its own group; with a huge one, a single group."""
    from eyas.train.data import row_groups

    lengths = [2000, 100, 90, 1900, 80]
    assert row_groups(lengths, 2048) == [[0, 3], [1, 2, 4]]
    assert row_groups(lengths, 0) == [[0], [3], [1, 2, 4]]  # 100, 90 and 80 share the bucket (64, 128]
    assert row_groups(lengths, 0, quantum=1) == [[0], [3], [1], [2], [4]]
    assert row_groups(lengths, 10**9) == [[0, 3, 1, 2, 4]]
    assert row_groups([], 2048) == []
    many = [(7 * k) % 500 + 1 for k in range(3000)]  # thousands of samples: buckets bound the search
    groups = row_groups(many, 2048)
    assert sorted(j for g in groups for j in g) == list(range(3000))
    assert all(many[g[0]] == max(many[j] for j in g) for g in groups)


def test_accumulated_window_equals_one_packed_row(tmp_path, smol_prep, tiny_target):
    """Two micro-batches accumulated (teacher recomputed per micro-batch) give the loss sums,
    gradient norm and updated weights of the same samples packed into one row: attention, TTT
    shifts and teachers stay inside each sample, and both normalise by the same valid count."""
    from eyas.train.data import pack
    from eyas.train.loop import train_step

    cfg = tiny_cfg(tmp_path, smol_prep, tiny_target, "--train.mode=online", "--train.grad_accum=2")
    data = build.load_data(cfg, torch.device("cpu"))
    tr, sched, train_idx, step, batches = first_window(cfg, data)
    by_id = {str(data.source[i]["id"]): i for i in train_idx}
    samples = [data.source[by_id[sid]] for b in batches for sid in b.sample_ids]
    assert len(batches) == 2 and len(samples) >= 2
    one = pack(samples, cfg.train.ttt_steps, max_tokens=cfg.train.max_tokens)  # truncates each sample alike
    accumulated = train_step(tr, batches, step)
    params_acc = torch.cat([p.detach().flatten() for p in tr.draft.parameters()])
    tr2, _ = build.build_trainer(cfg, data, torch.device("cpu"), total_steps=sched.total)
    packed = train_step(tr2, [one], step)
    params_one = torch.cat([p.detach().flatten() for p in tr2.draft.parameters()])
    for key in ("loss_sum_T", "valid_T", "correct_T", "reached_T", "chain_T", "grad_norm"):
        torch.testing.assert_close(accumulated[key], packed[key], rtol=1e-5, atol=1e-6)
    # AdamW's first update is about lr (1e-3) x sign(grad) wherever |grad| >> eps, and a gradient
    # near eps turns summation-order noise into up to ~1e-6 here (seen once in 90k weights): 1% of lr
    torch.testing.assert_close(params_acc, params_one, rtol=1e-5, atol=1e-5)


def test_one_step_with_the_compiled_loss_kernel_equals_eager(tmp_path, smol_prep, tiny_target):
    """A whole optimizer step (teacher, TTT forward, loss, backward, AdamW) with
    --train.loss_kernel=compiled gives eager's loss sums, counts, gradient norm and weights."""
    cfg = tiny_cfg(tmp_path, smol_prep, tiny_target, "--train.mode=online", "--train.align_top_k=2")
    data = build.load_data(cfg, torch.device("cpu"))
    eager = first_step(cfg, data)
    compiled = first_step(tiny_cfg(tmp_path / "c", smol_prep, tiny_target, "--train.mode=online",
                                   "--train.align_top_k=2", "--train.loss_kernel=compiled"), data)
    assert eager[1] == compiled[1] and eager[0]["valid_T"].sum() > 50
    for key in ("loss_sum_T", "grad_norm"):
        torch.testing.assert_close(compiled[0][key], eager[0][key], rtol=1e-5, atol=1e-5)
    for key in ("correct_T", "valid_T", "reached_T", "chain_T", "kept_T"):
        assert torch.equal(compiled[0][key], eager[0][key])
    torch.testing.assert_close(compiled[2], eager[2], rtol=1e-5, atol=1e-5)


def test_offline_from_extract_shards_equals_online(tmp_path, smol_prep, tiny_target):
    """The whole offline path (`eyas extract` shards read through HiddenStates) against online."""
    from eyas.extract import main as extract

    extract(train_config(tmp_path, f"--prepare.out_dir={smol_prep}", f"--target.model={tiny_target}",
                         "--extract.progress=false"))
    losses = {}
    for mode in ("offline", "online"):
        cfg = tiny_cfg(tmp_path, smol_prep, tiny_target, f"--train.mode={mode}", f"--train.out_dir={tmp_path / mode}",
                       "--train.max_steps=2", "--train.max_tokens=256")
        meta = run(cfg)
        assert meta["config"]["train"]["mode"] == mode and ("extract" in meta["inputs"]) == (mode == "offline")
        losses[mode] = [r["loss"] for r in read_metrics(tmp_path / mode)]
    assert len(losses["offline"]) == 2
    assert losses["offline"] == pytest.approx(losses["online"], rel=1e-5)


def test_offline_from_spilled_shards_equals_online(tmp_path, smol_prep, tiny_target, shm_dir, monkeypatch):
    """Shards split over a tmpfs output directory and a spill directory on the disk
    (extract.spill_dirs): the trainer's checksum pass and reads find both kinds, and two offline
    steps give the online losses. The tmpfs reports room for about half the shards (shutil.disk_usage:
    a capacity less what its shards/ holds); the bytes go to the real tmpfs and disk."""
    import shutil
    from pathlib import Path

    from eyas.extract import main as extract
    from eyas.hidden_states import HiddenStates
    from eyas.prepared import Prepared

    out = shm_dir / "extract"
    row = 4 * 64 * 4 + 5  # the tiny target: 3 aux layers + final, D=64, float32; id, mask
    from eyas.extract import store

    cap = store.OUT_RESERVE + int(Prepared(smol_prep).offsets[-1]) * row // 2

    def used() -> int:
        return sum(f.stat().st_size for f in (out / "shards").iterdir()) if (out / "shards").is_dir() else 0

    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda d: shutil._ntuple_diskusage(cap, used(), cap - used())
                        if Path(d).resolve() == out.resolve() else real(d))
    place = [f"--extract.out_dir={out}", f"--extract.spill_dirs=[{tmp_path / 'spill'}]"]
    extract(train_config(tmp_path, f"--prepare.out_dir={smol_prep}", f"--target.model={tiny_target}",
                         "--extract.progress=false", "--extract.token_budget=128", "--extract.shard_bytes=1", *place))
    monkeypatch.undo()
    names = HiddenStates(out).shards
    assert any(Path(n).is_absolute() for n in names) and not all(Path(n).is_absolute() for n in names), names
    losses = {}
    for mode in ("offline", "online"):
        cfg = tiny_cfg(tmp_path, smol_prep, tiny_target, f"--train.mode={mode}", f"--train.out_dir={tmp_path / mode}",
                       "--train.max_steps=2", "--train.max_tokens=256", *place)
        run(cfg)
        losses[mode] = [r["loss"] for r in read_metrics(tmp_path / mode)]
    assert len(losses["offline"]) == 2
    assert losses["offline"] == pytest.approx(losses["online"], rel=1e-5)


def test_non_finite_loss_stops_with_step_samples_and_term(tmp_path, smol_prep, tiny_target):
    from eyas.train.loop import TrainingDiverged

    cfg = tiny_cfg(tmp_path, smol_prep, tiny_target, "--train.mode=online", "--train.max_tokens=4096")
    data = build.load_data(cfg, torch.device("cpu"))
    bad = data.source[3]["id"]
    states = data.states

    def poisoned(batch):  # the target "produces" NaN states for one sample
        batch = states(batch)
        start = 0
        for sid, n in zip(batch.sample_ids, batch.lengths):
            if sid == bad:
                batch.aux_BSKD[0, start : start + n] = float("nan")
            start += n
        return batch

    data.states = poisoned
    with pytest.raises(TrainingDiverged, match=r"step 0: non-finite loss of TTT step 0.*" + bad):
        run(cfg, data)
    rec = json.loads((cfg.stage_dir("train") / "errors.jsonl").read_text().splitlines()[-1])
    assert rec["type"].endswith("TrainingDiverged") and "Traceback" in rec["traceback"]


def test_online_target_failure_names_its_samples(tmp_path, smol_prep, tiny_target):
    """A target forward that raises (here with an empty message) on the second window stops the run
    with that window's sample ids, the repr and the traceback, in errors.jsonl and the exception."""
    from eyas.capture import find_decoder_layers
    from eyas.errors import EyasError
    from extract_helpers import Poison

    cfg = tiny_cfg(tmp_path, smol_prep, tiny_target, "--train.mode=online", "--train.max_steps=4")
    data = build.load_data(cfg, torch.device("cpu"))
    calls = []
    states = data.states

    def recording(batch):
        calls.append(batch.sample_ids)
        return states(batch)

    data.states = recording
    find_decoder_layers(states.model)[0].register_forward_pre_hook(Poison(RuntimeError(), after=1), with_kwargs=True)
    with pytest.raises(EyasError, match=r"online target forward failed on samples .*RuntimeError\(\)") as err:
        run(cfg, data)
    assert len(calls) == 2 and str(calls[1]) in str(err.value) and str(calls[0]) not in str(err.value)
    rec = json.loads((cfg.stage_dir("train") / "errors.jsonl").read_text().splitlines()[-1])
    assert rec["stage"] == "train" and str(calls[1]) in rec["message"] and "extract_helpers.py" in rec["traceback"]


def test_an_existing_run_needs_resume(tmp_path, smol_prep, tiny_target):
    cfg = tiny_cfg(tmp_path, smol_prep, tiny_target, "--train.mode=online", "--train.max_steps=2")
    run(cfg)
    with pytest.raises(ConfigError, match="--train.resume=auto"):
        run(cfg)


def test_time_is_up_by_the_budget_or_before_the_deadline():
    from functools import partial

    from eyas.train.loop import time_is_up

    at = partial(time_is_up, elapsed_s=11.0, now=1000.0, window_s=5.0)
    assert at(budget_s=12.0, stop_by=0.0) == ""
    assert at(budget_s=10.0, stop_by=0.0) == "train.max_seconds=10 reached"
    # stop_by: stop when the time to the next logging step would end past it
    assert at(budget_s=0.0, stop_by=1006.0) == ""
    assert at(budget_s=0.0, stop_by=1005.0) == ""
    assert at(budget_s=0.0, stop_by=1004.0) == "train.stop_by=1004 in 4 s, a logging window takes 5 s"
    assert at(budget_s=0.0, stop_by=990.0) == "train.stop_by=990 passed, a logging window takes 5 s"
    assert at(budget_s=10.0, stop_by=990.0) == "train.max_seconds=10 reached"


def test_stop_by_stops_early_and_is_not_part_of_the_run_key(tmp_path, smol_prep, tiny_target, capsys):
    """A deadline already past: a warning at the start, then the first logging window is trained,
    saved and recorded as stopped early (as max_seconds); `--train.resume=auto` with a later
    deadline finishes it, and the deadline is not part of `eyas run`'s key for the stage."""
    from eyas.run import run_keys, stage_plan

    cfg = tiny_cfg(tmp_path, smol_prep, tiny_target, "--train.mode=online", "--train.max_steps=5",
                   "--train.log_every=2", "--train.stop_by=1")
    meta = run(cfg)
    printed = capsys.readouterr().out
    assert "warning: train.stop_by=1 passed" in printed
    assert "train.stop_by=1 passed, a logging window takes" in printed and "stopping at step 2 of 5" in printed
    assert meta["counts"]["steps"] == 2 and meta["counts"]["stopped_early"]
    later = tiny_cfg(tmp_path, smol_prep, tiny_target, "--train.mode=online", "--train.max_steps=5",
                     "--train.log_every=2", f"--train.stop_by={time.time() + 3600:.0f}", "--train.resume=auto")
    assert run_keys(*stage_plan(later))["train"] == run_keys(*stage_plan(cfg))["train"]
    meta = run(later)
    assert meta["counts"]["steps"] == 5 and not meta["counts"]["stopped_early"]


def test_max_seconds_stops_early_and_resume_finishes(tmp_path, smol_prep, tiny_target):
    cfg = tiny_cfg(tmp_path, smol_prep, tiny_target, "--train.mode=online", "--train.max_steps=5",
                   "--train.log_every=2", "--train.max_seconds=1e-6")
    meta = run(cfg)
    train_dir = cfg.stage_dir("train")
    assert meta["counts"]["steps"] == 2 and meta["counts"]["planned_steps"] == 5 and meta["counts"]["stopped_early"]
    assert [r["step"] for r in read_metrics(train_dir)] == [2]
    assert (train_dir / "final" / "draft.safetensors").is_file() and (train_dir / "checkpoints" / "step_0000002").is_dir()

    first = read_metrics(train_dir)
    assert meta["counts"]["resumed_from_step"] == 0
    assert meta["metrics"]["all_runs"] == {"runs": 1, "steps": 2, "tokens": first[0]["tokens"],
                                           "seconds": pytest.approx(first[0]["tokens"] / first[0]["tokens_per_s"]),
                                           "tokens_per_s": pytest.approx(first[0]["tokens_per_s"])}

    cfg.train.max_seconds, cfg.train.resume = 0.0, "auto"
    meta = run(cfg)
    assert meta["counts"]["steps"] == 5 and not meta["counts"]["stopped_early"]
    recs = read_metrics(train_dir)
    assert [r["step"] for r in recs] == [2, 4, 5]
    # both runs' training, from the metrics log's windows; the last run's own rate stays tokens_per_s
    assert meta["counts"]["resumed_from_step"] == 2
    tokens, seconds = sum(r["tokens"] for r in recs), sum(r["tokens"] / r["tokens_per_s"] for r in recs)
    total = meta["metrics"]["all_runs"]
    assert (total["runs"], total["steps"], total["tokens"]) == (2, 5, tokens)
    assert total["seconds"] == pytest.approx(seconds) and total["tokens_per_s"] == pytest.approx(tokens / seconds)
    assert meta["metrics"]["tokens_per_s"] == pytest.approx(
        sum(r["tokens"] for r in recs[1:]) / sum(r["tokens"] / r["tokens_per_s"] for r in recs[1:]))


def test_a_checkpoint_between_logging_steps_counts_the_window_in_progress(tmp_path, smol_prep, tiny_target):
    from eyas.train import checkpoint

    cfg = tiny_cfg(tmp_path, smol_prep, tiny_target, "--train.mode=online", "--train.max_steps=4",
                   "--train.log_every=2", "--train.save_every=3", "--train.keep_checkpoints=0")
    run(cfg)
    recs = read_metrics(cfg.stage_dir("train"))
    assert [r["step"] for r in recs] == [2, 4]
    state = torch.load(cfg.stage_dir("train") / "checkpoints" / "step_0000003" / checkpoint.TRAINER_STATE,
                       weights_only=False)
    work = state["all_runs"]
    assert (work["runs"], work["steps"]) == (1, 3)
    # steps 1-2 (the first window) and step 3, short of the second window's step 4
    assert recs[0]["tokens"] < work["tokens"] < recs[0]["tokens"] + recs[1]["tokens"]
    assert recs[0]["tokens"] / recs[0]["tokens_per_s"] < work["seconds"]


def test_flex_rows_have_one_length():
    assert [build.flex_row_length(n) for n in (8, 128, 129, 16384)] == [128, 128, 256, 16384]
    assert build.resolve_attention("auto", torch.device("cpu")) == "sdpa"
    assert build.resolve_attention("auto", torch.device("cuda")) == "flex"


@pytest.mark.slow
def test_kill_9_then_resume_continues_the_same_loss_curve(tmp_path, smol_prep, tiny_target):
    args = [f"--prepare.out_dir={smol_prep}", f"--target.model={tiny_target}", "--train.mode=online",
            "--train.ttt_steps=3", "--train.max_tokens=128", "--train.lr=1e-3", "--train.eval_fraction=0",
            "--train.log_every=1", "--train.save_every=4", "--train.epochs=50", "--train.max_steps=36"]
    ref_cfg = train_config(tmp_path / "ref", *args)
    run(ref_cfg)
    ref = read_metrics(ref_cfg.stage_dir("train"))
    assert [r["step"] for r in ref] == list(range(1, 37))

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "eyas.cli", "train", f"--run_dir={tmp_path / 'run'}", *args]
    train_dir = tmp_path / "run" / "train"
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.time() + 120
    while not (train_dir / "checkpoints" / "step_0000008").is_dir():
        assert proc.poll() is None, proc.stdout.read().decode()
        assert time.time() < deadline, "no checkpoint within 120 s"
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL and not (train_dir / "meta.json").exists()
    killed_at = max(r["step"] for r in read_metrics(train_dir))
    assert killed_at < 36

    res = subprocess.run(cmd + ["--resume", "auto"], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "resuming from" in res.stdout
    got = read_metrics(train_dir)
    assert [r["step"] for r in got] == list(range(1, 37))
    for a, b in zip(got, ref):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6, abs=1e-6), (a["step"], a["loss"], b["loss"])
        assert a["acc_T"] == pytest.approx(b["acc_T"], abs=1e-9) and a["lr"] == pytest.approx(b["lr"], rel=1e-9)
    assert (train_dir / "final" / "draft.safetensors").is_file()


@pytest.mark.slow
def test_torchrun_ddp_and_fsdp_match_one_process_accumulating_the_same_window(tmp_path, smol_prep, tiny_target):
    """Rank r takes every world_size-th micro-batch, so 2 ranks x grad_accum 1 see the window one
    process sees with grad_accum 2: same losses (normalised by the global valid count), same weights."""
    from safetensors.torch import load_file

    args = [f"--prepare.out_dir={smol_prep}", f"--target.model={tiny_target}", "--train.mode=online",
            "--train.ttt_steps=3", "--train.max_tokens=128", "--train.lr=1e-3", "--train.eval_fraction=0",
            "--train.log_every=1", "--train.max_steps=3"]
    run(train_config(tmp_path / "one", *args, "--train.grad_accum=2"))
    runs = {"one": tmp_path / "one" / "train"}
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    for kind in ("ddp", "fsdp"):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "eyas.cli",
               "train", f"--run_dir={tmp_path / kind}", *args, f"--train.parallel={kind}"]
        res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
        runs[kind] = tmp_path / kind / "train"
        assert json.loads((runs[kind] / "meta.json").read_text())["counts"]["world_size"] == 2
    ref = read_metrics(runs["one"])
    weights = load_file(runs["one"] / "final" / "draft.safetensors")
    assert [r["step"] for r in ref] == [1, 2, 3] and sum(ref[0]["valid_T"]) > 100
    for kind in ("ddp", "fsdp"):
        got = read_metrics(runs[kind])
        assert [r["valid_T"] for r in got] == [r["valid_T"] for r in ref], kind  # both micro-batches counted
        for a, b in zip(got, ref):
            assert a["loss"] == pytest.approx(b["loss"], rel=1e-5), (kind, a["step"], a["loss"], b["loss"])
            assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4), (kind, a["step"])
        theirs = load_file(runs[kind] / "final" / "draft.safetensors")
        assert theirs.keys() == weights.keys()
        for name, w in weights.items():
            torch.testing.assert_close(theirs[name], w, rtol=1e-4, atol=1e-5, msg=f"{kind}: {name}")


def test_held_out_split_keeps_conversation_pieces_and_identical_prompts_together(smol_prep):
    import hashlib

    from eyas.assets import iter_json_array, sharegpt_path
    from eyas.prepared import Prepared
    from eyas.train.data import split_groups, split_indices

    p = Prepared(smol_prep)
    keys = p.prompt_keys()
    for i in range(len(p)):
        s = p[i]
        first = int(s["loss_mask"].nonzero()[0])
        prompt = s["input_ids"][:first].to(p._ids.dtype).numpy().tobytes()
        assert keys[i] == hashlib.blake2b(prompt, digest_size=16).digest()
    g = split_groups(["a_0", "a_1", "b_0", "c"], [b"p", b"q", b"r", b"p"])  # c asks what a_0 asks
    assert g[0] == g[1] == g[3] != g[2]
    assert len(set(split_groups(["x", "y", "z"], [None, None, None]))) == 3  # no prompt: not "the same prompt"
    for seed in range(10):  # {a_0, a_1, c} would triple the one held-out sample asked for: it stays in training
        assert split_indices(4, 0.25, seed, g) == ([0, 1, 3], [2])
    big = [0] * 60 + list(range(1, 41))  # one source whose ids all share a stem, and 40 other samples
    for seed in range(10):
        tr, ev = split_indices(100, 0.1, seed, big)
        assert 10 <= len(ev) <= 15 and not set(ev) & set(range(60)) and sorted(tr + ev) == list(range(100))
    tr, ev = split_indices(3, 0.34, 0, [7, 7, 7])  # one group holds everything: per sample, said so
    assert len(tr) == 2 and len(ev) == 1
    # real ShareGPT ids: its long conversations are stored as pieces X_0, X_1, ...
    ids, prompts = [], []
    for i, rec in iter_json_array(sharegpt_path()):
        if i >= 2000:
            break
        ids.append(rec["id"])
        prompts.append(next((t["value"] for t in rec["conversations"] if t["from"] == "human"), "").encode())
    g = split_groups(ids, prompts)
    stems = [x.rsplit("_", 1)[0] for x in ids]
    leaks = []
    for groups in (None, g):
        tr, ev = split_indices(len(ids), 0.05, 0, groups)
        assert len(ev) >= 100 and len(tr) + len(ev) == len(ids)
        seen = {stems[i] for i in tr} | {prompts[i] for i in tr}
        leaks.append(sum(stems[i] in seen or prompts[i] in seen for i in ev))
    assert leaks[0] > 20 and leaks[1] == 0, leaks  # per-sample split leaks; grouped does not
