"""eyas.spec.simulate: the greedy chain decoder re-derived from one teacher-forced TTT forward.

The reference is the real decoder (speculative_generate, eager path, float32) on a random tiny
Llama, with a draft fitted for a few steps to the target's greedy outputs (export_helpers.fitted_draft)
so that passes accept anything from 0 to all K drafts. Its accepted length per pass is recorded by
wrapping SpecStats.add_pass, and its draft logits by wrapping the draft's `logits`: where a pass's
drafts are fed the same tokens as the TTT (steps 0..n), the logits must agree too, which also
catches a convention error too small to flip an argmax of this little draft.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch

import eyas.spec.simulate as simulate
from eyas.capture import capture
from eyas.evaluate import format_table, teacher_forced_chain
from eyas.spec import Generation, SpecStats, speculative_generate, target_generate
from eyas.spec.simulate import SimulatedChain, label_mask, simulate_chain, teacher_forced_steps
from eyas.train.loss import acceptance_length
from export_helpers import fitted_draft
from spec_helpers import tiny_llama

K = 4
MAX_NEW = 30
KNOWN = MAX_NEW + K + 2  # target tokens known past the decoder's stop: no pass runs past them
AUX = [0, 1, 2]


@pytest.fixture(scope="module")
def decoded():
    """Target, a partly fitted draft (W = 48 < V = 64), and per prompt: its greedy sequence (KNOWN
    new tokens), the decoder's Generation (MAX_NEW tokens) and its accepted length per pass."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one summation order for the decoder and the TTT forward alike
    target = tiny_llama(vocab=64, hidden=32, layers=4, seed=3, logit_scale=4.0)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 64, (6,), generator=g).tolist() for _ in range(3)]
    seqs = [p + target_generate(target, torch.tensor(p), max_new_tokens=KNOWN).tokens for p in prompts]
    draft = fitted_draft(target, seqs, aux_layer_ids=AUX, draft_vocab=48, steps=20, ttt_steps=3, decoy_shifts=(),
                         intermediate_size=64)  # fmt: skip
    runs = []
    add_pass, logits = SpecStats.add_pass, draft.logits
    for p, seq in zip(prompts, seqs):
        passes, logits_W = [], []

        def record(self, n, tested, passes=passes):
            passes.append((n, tested))
            add_pass(self, n, tested)

        def record_logits(prenorm, logits_W=logits_W):  # draft_chain: K calls per pass, one token each
            out = logits(prenorm)
            logits_W.append(out.reshape(-1).clone())
            return out

        with mock.patch.object(SpecStats, "add_pass", record), mock.patch.object(draft, "logits", record_logits):
            gen = speculative_generate(target, draft, torch.tensor(p), max_new_tokens=MAX_NEW, num_draft_tokens=K)
        assert gen.tokens == seq[len(p) : len(p) + MAX_NEW]  # lossless: seq is the decoder's output too
        assert len(logits_W) == K * len(passes)
        runs.append({"prompt": p, "seq": seq, "gen": gen, "passes": passes, "logits_W": logits_W})
    yield target, draft, runs
    torch.set_num_threads(threads)


def simulated(target, draft, run, k=K) -> tuple[SimulatedChain, torch.Tensor]:
    """-> (the simulated chain, TTT logits_TSW) of one run, through eyas.spec.simulate's own
    ttt_forward and masks (so that a test may swap them)."""
    ids_S = torch.tensor(run["seq"])
    aux_1SKD, _ = capture(target, ids_S[None], layer_ids=AUX)
    correct_TS = teacher_forced_steps(draft, aux_1SKD[0], ids_S, k, first_label=len(run["prompt"]))
    pos_1S = torch.arange(len(ids_S))[None]
    outs = simulate.ttt_forward(draft, aux_1SKD, ids_S[None], pos_1S, simulate.sdpa_masks(pos_1S * 0, k))
    logits_TSW = torch.stack([draft.logits(o[0]) for o in outs])
    return simulate_chain(correct_TS, len(run["prompt"]), len(run["prompt"]) + MAX_NEW, k), logits_TSW


def same_logits(run, accepted: list[int], logits_TSW: torch.Tensor) -> bool:
    """The decoder's draft logits of each pass equal the TTT's at row p = L-2, steps 0..min(n, K-1)
    (their inputs are the same tokens), walking the passes `accepted` gives."""
    L, j = len(run["prompt"]) + 1, 0
    for n in accepted:
        for i in range(min(n, K - 1) + 1):
            if not torch.allclose(run["logits_W"][K * j + i], logits_TSW[i, L - 2], atol=1e-5, rtol=1e-5):
                return False
        L, j = L + n + 1, j + 1
    return True


def test_simulation_equals_the_decoder_pass_for_pass(decoded):
    """float32: the same accepted length at every verify pass, the same SpecStats counters, and the
    same draft logits wherever the decoder's drafts saw the tokens the TTT saw."""
    target, draft, runs = decoded
    lengths = []
    for run in runs:
        sim, logits_TSW = simulated(target, draft, run)
        assert sim.accepted == [n for n, _ in run["passes"]]
        assert [min(n + 1, K) for n in sim.accepted] == [t for _, t in run["passes"]]
        assert not sim.last_is_lower_bound and sim.matches(run["gen"].stats)
        assert same_logits(run, sim.accepted, logits_TSW)
        lengths += sim.accepted
    # a test that can fail: passes end at every possible place, not only all-wrong or all-right
    assert min(lengths) == 0 and max(lengths) == K and any(0 < n < K for n in lengths), lengths


def _causal_later_steps(doc_BS, num_steps):
    """The wrong TTT mask: step-j keys of every earlier row, not only the row's own (the diagonal)."""
    s = doc_BS.shape[1]
    causal_BSS = torch.ones(s, s, dtype=torch.bool).tril()[None] & (doc_BS[:, :, None] == doc_BS[:, None, :])
    return [torch.cat([causal_BSS] * (i + 1), dim=-1) for i in range(num_steps)]


@pytest.mark.parametrize("variant", ["rope-1", "rope+1", "causal later steps", "row-1", "row+1"])
def test_a_wrong_convention_changes_the_simulation(decoded, monkeypatch, variant):
    """Steps >= 1 at RoPE position t+i-1 or t+i+1 instead of t+i, the wrong mask for steps >= 1, or
    the pass read one TTT row off (the label offset): the simulated passes or the logits no longer
    equal the decoder's on some prompt. (The RoPE errors flip few argmaxes of this draft, but move
    its logits; shifting every position alike would change nothing: RoPE is relative.)"""
    target, draft, runs = decoded
    if variant.startswith("rope"):
        step, shift = draft.forward_step, -1 if variant == "rope-1" else 1

        def shifted(ids, h, pos, past_k=None, *args, **kw):  # steps >= 1 are the calls with past keys
            return step(ids, h, pos if past_k is None else pos + shift, past_k, *args, **kw)

        monkeypatch.setattr(draft, "forward_step", shifted)
    if variant == "causal later steps":
        monkeypatch.setattr(simulate, "sdpa_masks", _causal_later_steps)
    differs = False
    for run in runs:
        sim, logits_TSW = simulated(target, draft, run)
        if variant.startswith("row"):
            shift = 1 if variant == "row-1" else -1  # column p reads row p -/+ 1
            ids_S = torch.tensor(run["seq"])
            aux_1SKD, _ = capture(target, ids_S[None], layer_ids=AUX)
            c_TS = torch.roll(teacher_forced_steps(draft, aux_1SKD[0], ids_S, K), shift, dims=1)
            sim = simulate_chain(c_TS, len(run["prompt"]), len(run["prompt"]) + MAX_NEW, K)
            logits_TSW = torch.roll(logits_TSW, shift, dims=1)
        same = sim.accepted == [n for n, _ in run["passes"]] and same_logits(run, sim.accepted, logits_TSW)
        differs |= not same
    assert differs


def test_simulate_chain_hand_computed():
    """Prompt of 3 tokens, stop at 11 known of 12, k = 3. Pass 1: L = 4, row 2: steps 0, 1 right, 2
    wrong -> 2; L = 7, row 5: step 0 wrong -> 0; L = 8, row 6: all right -> 3; L = 12 stops."""
    c_TS = torch.zeros(3, 12, dtype=torch.bool)
    c_TS[:2, 2] = True
    c_TS[1:, 5] = True
    c_TS[:, 6] = True
    sim = simulate_chain(c_TS, 3, 11, 3)
    assert sim.accepted == [2, 0, 3] and not sim.last_is_lower_bound
    st = sim.stats()
    counters = (st.verify_passes, st.new_tokens, st.accept_counts, st.reached, st.accepted)
    assert counters == (3, 8, [1, 0, 1, 1], [3, 2, 2], [2, 2, 1])
    assert sim.matches(st) and not sim.matches(SimulatedChain([2, 1, 2], False, 3).stats())
    # 10 known tokens, stop at 10: the pass at L = 8 reads labels 8, 9 and unknown 10 -> n >= 2
    sim = simulate_chain(c_TS[:, :10] & label_mask(3, 10), 3, 10, 3)
    assert sim.accepted == [2, 0, 2] and sim.last_is_lower_bound
    assert sim.matches(sim.stats([2, 0, 3])) and sim.matches(sim.stats([2, 0, 2]))
    assert not sim.matches(sim.stats([2, 0, 1])) and not sim.matches(sim.stats([2, 1, 2]))


def test_evaluate_teacher_forced_block(decoded):
    """evaluate's block on target-only outputs cut like the decoder's: acc as counted by hand, tau_hat
    from it, every prompt compared and matching, a prompt with another output not compared, and a
    decoder whose counters differ reported as a mismatch."""
    target, draft, runs = decoded
    ref_runs, chain_runs = [], []
    for i, run in enumerate(runs):
        start = len(run["prompt"])
        rec = {"id": str(i), "turn": 0, "prompt_ids": run["prompt"]}
        ref_runs.append({**rec, "gen": Generation(run["seq"][start : start + MAX_NEW], 0.0)})
        chain_runs.append({**rec, "gen": run["gen"]})
    tf = teacher_forced_chain(target, draft, K, ref_runs, chain_runs)
    assert tf["num_compared"] == tf["num_matching"] == 3 and tf["matches_decoder"] is True
    correct, valid = torch.zeros(K), torch.zeros(K)
    for run in runs:
        ids_S = torch.tensor(run["seq"][: len(run["prompt"]) + MAX_NEW])
        aux_1SKD, _ = capture(target, ids_S[None], layer_ids=AUX)
        c_TS = teacher_forced_steps(draft, aux_1SKD[0], ids_S, K)
        for i in range(K):  # step i at row t predicts output token t+2+i >= len(prompt)
            rows = range(len(run["prompt"]) - 2 - i, len(ids_S) - 2 - i)
            correct[i] += sum(bool(c_TS[i, t]) for t in rows)
            valid[i] += len(rows)
    assert tf["acc"] == pytest.approx((correct / valid).tolist()) and tf["num_positions"] == valid.long().tolist()
    assert tf["tau_hat"] == pytest.approx(acceptance_length(tf["acc"]))
    pooled = SpecStats()
    for run in runs:
        pooled.merge(run["gen"].stats)
    assert tf["tau_sim"] <= pooled.tau and tf["verify_passes"] == pooled.verify_passes
    line = next(x for x in format_table({"modes": {}, "target_only_wall_s": None, "lossless_checked": False,
                                         "teacher_forced": tf}).splitlines() if x.startswith("teacher-forced"))
    assert line.startswith("teacher-forced on target-only outputs: acc ")
    assert line.endswith("(matches decoder on 3 of 3 prompts)")

    other = dict(chain_runs[0], gen=Generation(chain_runs[0]["gen"].tokens[:-1], 0.0, chain_runs[0]["gen"].stats))
    bad_stats = SpecStats()
    for n, tested in runs[1]["passes"][::-1][1:]:  # one pass fewer
        bad_stats.add_pass(n, tested)
    bad = dict(chain_runs[1], gen=Generation(chain_runs[1]["gen"].tokens, 0.0, bad_stats))
    tf = teacher_forced_chain(target, draft, K, ref_runs, [other, bad, chain_runs[2]])
    assert (tf["num_compared"], tf["num_matching"], tf["matches_decoder"]) == (2, 1, False)
    assert [(m["id"], m["turn"]) for m in tf["mismatches"]] == [("1", 0)]
