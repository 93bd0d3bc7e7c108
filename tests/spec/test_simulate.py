"""eyas.spec.simulate: the greedy chain decoder re-derived from one teacher-forced TTT forward.

The reference is the real decoder (speculative_generate, eager path, float32) on a random tiny
Llama, with a draft fitted for a few steps to the target's greedy outputs (tests/models.py's fitted_draft)
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
from eyas.evaluate.report import format_table
from eyas.evaluate.teacher_forced import teacher_forced_chain
from eyas.spec import Generation, SpecStats, speculative_generate, target_generate
from eyas.spec.simulate import (
    SimulatedChain,
    SimulatedTree,
    greedy_walk_argmax,
    label_mask,
    simulate_chain,
    simulate_tree,
    teacher_forced_steps,
)
from eyas.spec.tree import Tree, accept_greedy_tree
from eyas.train.loss import acceptance_length
from tests.models import fitted_draft, tiny_llama

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


def _causal_later_steps(doc_BS, num_steps, *_):
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


TREE = (10, 4, 3)  # total tokens, depth, top-k: small enough that the draft's misses show


@pytest.fixture(scope="module")
def tree_decoded(decoded):
    """The same target, draft and prompts decoded by the real tree decoder (eager, float32), with
    its (accepted, tested) per verify pass."""
    target, draft, runs = decoded
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    add_pass, out = SpecStats.add_pass, []
    for run in runs:
        passes = []

        def record(self, n, tested, passes=passes):
            passes.append((n, tested))
            add_pass(self, n, tested)

        with mock.patch.object(SpecStats, "add_pass", record):
            gen = speculative_generate(target, draft, torch.tensor(run["prompt"]), max_new_tokens=MAX_NEW, mode="tree",
                                       tree_total_tokens=TREE[0], tree_depth=TREE[1], tree_top_k=TREE[2])
        p = len(run["prompt"])
        assert gen.tokens == run["seq"][p : p + MAX_NEW]  # lossless
        out.append({"gen": gen, "passes": passes})
    yield target, draft, runs, out
    torch.set_num_threads(threads)


def simulated_tree(target, draft, run, aux_shift: int = 0) -> SimulatedTree:
    ids_S = torch.tensor(run["seq"])
    aux_1SKD, _ = capture(target, ids_S[None], layer_ids=AUX)
    aux_SKD = torch.roll(aux_1SKD[0], aux_shift, dims=0)
    p = len(run["prompt"])
    return simulate_tree(draft, aux_SKD, ids_S, p, p + MAX_NEW, TREE[2], TREE[1], TREE[0])


def test_tree_simulation_equals_the_tree_decoder_pass_for_pass(tree_decoded):
    """float32: the simulated tree passes (the real draft tree per pass, the known output in place
    of the target's verify) accept and test what the decoder's did, pass for pass."""
    target, draft, runs, trees = tree_decoded
    lengths = []
    for run, dec in zip(runs, trees):
        sim = simulated_tree(target, draft, run)
        assert list(zip(sim.accepted, sim.tested)) == dec["passes"]
        assert not sim.last_is_lower_bound and sim.matches(dec["gen"].stats)
        lengths += sim.accepted
    # a test that can fail: passes of many lengths, up to the whole depth
    assert min(lengths) <= 1 and max(lengths) == TREE[1] and len(set(lengths)) >= 3, lengths


def test_tree_simulation_with_aux_states_one_row_off_differs(tree_decoded):
    """Step 0 fed the aux states of the position before or after: the passes no longer match."""
    target, draft, runs, trees = tree_decoded
    for shift in (1, -1):
        assert any(simulated_tree(target, draft, run, shift).accepted != [n for n, _ in dec["passes"]]
                   for run, dec in zip(runs, trees)), shift


def test_greedy_walk_hand_computed():
    """Root at position 2 of seq = [5, 6, 7, 8, 9, 4]; nodes: 1 (8, right), 2 (3, wrong), 3 (9 under
    node 1, right), 4 (4 under node 2: the right token on a wrong path), 5 (1 under node 3, wrong).
    The walk reads argmax 8 at the root, 9 at node 1, 4 at node 3: path [1, 3], emits 4."""
    tree = Tree([7, 8, 3, 9, 4, 1], [-1, 0, 0, 1, 2, 3], [0, 1, 1, 2, 2, 3])
    seq = [5, 6, 7, 8, 9, 4]
    argmax = greedy_walk_argmax(tree, seq, 2)
    assert argmax == [8, 9, -1, 4, -1, -1]
    assert accept_greedy_tree(tree, torch.tensor(argmax)) == ([1, 3], 4)
    # the known tokens end at 9: node 3's argmax is unknown, the walk stops there (a lower bound)
    argmax = greedy_walk_argmax(tree, seq[:5], 2)
    assert argmax == [8, 9, -1, -1, -1, -1] and accept_greedy_tree(tree, torch.tensor(argmax)) == ([1, 3], -1)


def _decoder(passes) -> SpecStats:
    out = SpecStats()
    for n, tested in passes:
        out.add_pass(n, tested)
    return out


def test_simulated_tree_matches_hand_computed():
    """Exact passes match only the same counters (SpecStats' histograms: pass order is not in them);
    a lower-bound last pass (accepted >= 2) matches a decoder that accepted 2..depth there with the
    path's or one more tested, and its earlier passes must still be the same: [3, then 4] matches,
    [2, then 5] (the same passes and tokens) does not."""
    exact = SimulatedTree([3, 2], [4, 3], False, 8)
    assert exact.matches(_decoder([(3, 4), (2, 3)])) and exact.matches(_decoder([(2, 3), (3, 4)]))
    assert not exact.matches(_decoder([(3, 4), (2, 2)])) and not exact.matches(_decoder([(3, 4), (1, 2)]))
    lower = SimulatedTree([3, 2], [4, 3], True, 8)
    assert lower.matches(_decoder([(3, 4), (2, 3)])) and lower.matches(_decoder([(3, 4), (4, 5)]))
    assert lower.matches(_decoder([(3, 4), (4, 4)])) and lower.matches(_decoder([(3, 4), (8, 8)]))
    assert not lower.matches(_decoder([(2, 3), (5, 6)]))  # 9 tokens in 2 passes, the first pass differs
    assert not lower.matches(_decoder([(3, 4), (1, 2)]))  # below the bound
    assert not lower.matches(_decoder([(3, 4), (4, 6)]))  # tested neither 4 nor 5
    assert not SimulatedTree([3, 2], [4, 3], True, 3).matches(_decoder([(3, 4), (4, 5)]))  # past the depth


def test_evaluate_teacher_forced_block_with_the_tree(tree_decoded):
    """teacher_forced_chain with `tree`: the pooled simulated tree equals the decoders' pooled
    counters, every prompt compared and matching; a tree decoder with one pass fewer is reported."""
    target, draft, runs, trees = tree_decoded
    ref_runs, tree_runs = [], []
    for i, (run, dec) in enumerate(zip(runs, trees)):
        start = len(run["prompt"])
        rec = {"id": str(i), "turn": 0, "prompt_ids": run["prompt"]}
        ref_runs.append({**rec, "gen": Generation(run["seq"][start : start + MAX_NEW], 0.0)})
        tree_runs.append({**rec, "gen": dec["gen"]})
    tf = teacher_forced_chain(target, draft, K, ref_runs, None, TREE, tree_runs)
    t = tf["tree"]
    assert (t["num_compared"], t["num_matching"], t["matches_decoder"]) == (3, 3, True)
    pooled = SpecStats()
    for dec in trees:
        pooled.merge(dec["gen"].stats)
    # the outputs end at MAX_NEW: a last pass whose walk reaches that end counts its lower bound
    assert t["tau_sim"] <= pooled.tau and t["verify_passes"] == pooled.verify_passes
    assert [p["verify_passes"] for p in t["prompts"]] == [len(dec["passes"]) for dec in trees]
    line = next(x for x in format_table({"modes": {}, "target_only_wall_s": None, "lossless_checked": False,
                                         "teacher_forced": tf}).splitlines() if x.startswith("simulated tree"))
    assert line.startswith(f"simulated tree 10/4/3 tau {t['tau_sim']:.3f}, P(accept | reached) ")
    assert line.endswith("(matches decoder on 3 of 3 prompts)")

    bad_stats = SpecStats()
    for n, tested in trees[2]["passes"][:-1]:
        bad_stats.add_pass(n, tested)
    bad = dict(tree_runs[2], gen=Generation(tree_runs[2]["gen"].tokens, 0.0, bad_stats))
    tf = teacher_forced_chain(target, draft, K, ref_runs, None, TREE, [tree_runs[0], tree_runs[1], bad])
    assert (tf["tree"]["num_matching"], tf["tree"]["matches_decoder"]) == (2, False)
    assert [m["id"] for m in tf["tree"]["mismatches"]] == ["2"]
