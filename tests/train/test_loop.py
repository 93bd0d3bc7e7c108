"""eyas.train.loop: one optimizer step against losses built row by row (top-1 weight, the alignment
mask and its normalisers), accumulation against one packed row, the compiled loss kernel, failures
(non-finite loss, a failing target forward), time budgets and deadlines."""

from __future__ import annotations

import json
import time

import pytest
import torch

from eyas.train import build, run
from tests.train.runs import first_step, first_window, read_metrics, tiny_cfg


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


def test_train_loss_tv_reaches_the_first_step(tmp_path, smol_prep, tiny_target):
    """--train.loss=tv: the first step's loss per TTT step is the total variation 0.5 sum |p - q|
    between the target's distribution over the draft vocabulary (its lm_head on the final states,
    the draft tokens' logits softmaxed) and the draft's, from the draft's logits before the update,
    summed over loss-mask positions whose target top-1 is in the draft vocab."""
    from eyas.train.loop import train_step

    cfg = tiny_cfg(tmp_path, smol_prep, tiny_target, "--train.mode=online", "--train.loss=tv")
    data = build.load_data(cfg, torch.device("cpu"))
    tr, _, _, step, batches = first_window(cfg, data)
    b = tr.prepare(batches[0])
    with torch.no_grad():
        logits_T = tr.forward(b)
        final_ND = b.final_BSD.flatten(0, 1)[b.teacher_rows_N].double()
        logits_NV = final_ND @ data.lm_head_VD.T.double()
        p_NW = torch.softmax(logits_NV[:, data.t2d], -1)  # the draft tokens, in target-id order
        in_vocab_N = data.t2d[logits_NV.argmax(-1)]
    want = []
    for logits_MW, tix_M in zip(logits_T, b.tix_T):
        ok = in_vocab_N[tix_M]
        q_MW = torch.softmax(logits_MW[ok].double(), -1)
        want.append(0.5 * (p_NW[tix_M[ok]] - q_MW).abs().sum())
    out = train_step(tr, [b], step)
    assert out["valid_T"].sum() > 50
    torch.testing.assert_close(out["loss_sum_T"].double(), torch.stack(want), rtol=1e-5, atol=1e-5)


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


def test_accumulated_window_equals_one_packed_row(tmp_path, smol_prep, tiny_target):
    """Two micro-batches accumulated (teacher recomputed per micro-batch) give the loss sums,
    gradient norm and updated weights of the same samples packed into one row: attention, TTT
    shifts and teachers stay inside each sample, and both normalise by the same valid count."""
    from eyas.train.data import pack
    from eyas.train.loop import train_step

    cfg = tiny_cfg(tmp_path, smol_prep, tiny_target, "--train.mode=online", "--train.grad_accum=2", "--train.max_steps=1")
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


def test_non_finite_loss_stops_with_step_samples_and_term(tmp_path, smol_prep, tiny_target):
    from eyas.train.loop import TrainingDiverged

    cfg = tiny_cfg(tmp_path, smol_prep, tiny_target, "--train.mode=online", "--train.max_tokens=4096", "--train.max_steps=1")
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
    with pytest.raises(TrainingDiverged, match=r"step 1: non-finite loss of TTT step 0.*" + bad):  # as the log counts
        run(cfg, data)
    rec = json.loads((cfg.stage_dir("train") / "errors.jsonl").read_text().splitlines()[-1])
    assert rec["type"].endswith("TrainingDiverged") and "Traceback" in rec["traceback"]
    assert rec["step"] == 1 and bad in rec["sample_ids"]  # the step and the window's samples


def test_online_target_failure_names_its_samples(tmp_path, smol_prep, tiny_target):
    """A target forward that raises (here with an empty message) on the second window stops the run
    with that window's sample ids, the repr and the traceback, in errors.jsonl and the exception."""
    from eyas.capture import find_decoder_layers
    from eyas.errors import EyasError
    from tests.faults import Poison

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
    assert rec["stage"] == "train" and str(calls[1]) in rec["message"] and "faults.py" in rec["traceback"]


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
    from eyas.run.plan import run_keys, stage_plan

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


def test_a_windowed_draft_trains_through_its_window(tmp_path, smol_prep, tiny_target):
    """--train.sliding_window=4: the trainer's draft carries the window, and its forward over packed
    rows gives, at every trained row and TTT step of the first two samples, the logits of naive_ttt
    (the served-style loop over that sample alone, its cache cut to the window by its own positions)."""
    from eyas.ttt import naive_ttt

    cfg = tiny_cfg(tmp_path, smol_prep, tiny_target, "--train.mode=online", "--train.sliding_window=4",
                   "--export.format=speculators")
    data = build.load_data(cfg, torch.device("cpu"))
    tr, _, _, _, batches = first_window(cfg, data)
    assert tr.draft.config.sliding_window == 4
    b = tr.prepare(batches[0])
    with torch.no_grad():
        logits_T = tr.forward(b)
    s, checked = b.doc_BS.shape[1], 0
    for doc in [d for d in b.doc_BS[0].unique().tolist() if d >= 0][:2]:  # the first row's first two samples
        cols = (b.doc_BS[0] == doc).nonzero().flatten()
        start, n = int(cols[0]), cols.numel()
        ref_TSD = naive_ttt(tr.draft, b.aux_BSKD[0, start : start + n], b.input_ids_BS[0, start : start + n],
                            len(logits_T))
        for i, (logits_MW, rows_M) in enumerate(zip(logits_T, b.rows_T)):
            for z, r in zip(logits_MW, rows_M.tolist()):
                if r // s == 0 and start <= r % s < start + n:
                    with torch.no_grad():
                        want = tr.draft.logits(ref_TSD[i, r % s - start])
                    torch.testing.assert_close(z.float(), want.float(), rtol=1e-4, atol=1e-4)
                    checked += 1
    assert checked > 50 and n > 8  # rows well past the window
