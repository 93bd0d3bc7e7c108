"""eyas.spec: acceptance maths, trees, caches and the decoding loop, against hand-computed values
and naive references (target-only decoding, the draft run path by path, exact target probabilities).

Constructions (tests/models.py, tests/spec/known_drafts.py): tiny random Llamas (real attention, KV cache); a Markov
Llama whose layers are switched off, with hand-set real Eagle3Drafts that copy it / are always
wrong / are right only at draft position 1; an oracle control draft that runs the target to
propose and checks the context its cache exposes.
"""

from __future__ import annotations

import math

import pytest
import torch

from eyas.spec import SpecStats, chain_tree, speculative_generate, target_generate
from eyas.spec.cache import DraftCache, crop, keep_positions
from eyas.spec.propose import extend
from eyas.spec.sampling import (
    accept_greedy_chain,
    accept_sampling_chain,
    draft_probs_on_target_vocab,
    residual_probs,
)
from eyas.spec.tree import Tree, accept_greedy_tree, ancestor_mask, select_nodes
from eyas.spec.verify import new_cache, target_forward
from tests.models import random_draft, tiny_llama
from tests.spec.known_drafts import OracleDraft, markov_draft, markov_target

K = 4  # chain length used throughout


# --- acceptance maths ------------------------------------------------------------------------------


def test_accept_greedy_chain_hand_computed():
    t = torch.tensor
    assert accept_greedy_chain(t([5, 6, 7]), t([5, 6, 7, 8])) == (3, 8)  # all accepted: bonus 8
    assert accept_greedy_chain(t([5, 6, 7]), t([5, 9, 7, 8])) == (1, 9)  # first miss at 1: emit 9
    assert accept_greedy_chain(t([5, 6, 7]), t([4, 6, 7, 8])) == (0, 4)  # later matches don't count


def test_draft_probs_on_target_vocab_uses_d2t():
    q_W = torch.tensor([0.5, 0.3, 0.2])
    d2t = torch.tensor([1, 2, 4])  # draft ids 0,1,2 -> target ids 1,3,6
    q_V = draft_probs_on_target_vocab(q_W, d2t, 8)
    assert q_V.tolist() == pytest.approx([0, 0.5, 0, 0.3, 0, 0, 0.2, 0])


def test_residual_is_positive_part_normalised():
    p, q = torch.tensor([0.5, 0.3, 0.2]), torch.tensor([0.2, 0.6, 0.2])
    assert residual_probs(p, q).tolist() == pytest.approx([1.0, 0.0, 0.0])
    assert residual_probs(p, p).tolist() == pytest.approx(p.tolist())  # p <= q: fall back to p


def _chi2_0999(df: int) -> float:
    """Upper 0.1% point of chi-square(df), Wilson-Hilferty (plenty accurate for a test bound)."""
    z = 3.090232
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def _first_emitted(p0, q0, n, seed, rule=accept_sampling_chain):
    """Emitted-token histogram after one draft token x ~ q0 under `rule`, over n trials."""
    g = torch.Generator().manual_seed(seed)
    p = torch.stack([p0, torch.full_like(p0, 1 / p0.numel())])  # row 1: bonus distribution (irrelevant)
    counts = torch.zeros_like(p0)
    for _ in range(n):
        x = torch.multinomial(q0, 1, generator=g)
        accepted, tok = rule(x, p, q0[None], g)
        counts[x[0] if accepted else tok] += 1
    return counts


def test_speculative_sampling_rule_emits_target_distribution():
    """One draft token x ~ q, then the rule: the first emitted token must follow p, also where q is 0
    (a target token outside the draft vocab) and where q >> p. Fixed seed; chi-square at the 0.1%
    level (df = V-1). A rule that resamples from p instead of the residual fails the same bound."""
    p0 = torch.tensor([0.40, 0.25, 0.15, 0.10, 0.06, 0.04])
    q0 = torch.tensor([0.10, 0.50, 0.00, 0.30, 0.10, 0.00])
    n = 2000
    counts = _first_emitted(p0, q0, n, seed=0)
    chi2 = float((((counts - n * p0) ** 2) / (n * p0)).sum())
    assert chi2 < _chi2_0999(5), (chi2, counts / n)

    def wrong_rule(x, p, q, g):  # on rejection resample from p (not the residual): biased towards q
        n_acc, _ = accept_sampling_chain(x, p, q, g)
        return n_acc, int(torch.multinomial(p[0], 1, generator=g))

    bad = _first_emitted(p0, q0, n, seed=0, rule=wrong_rule)
    assert float((((bad - n * p0) ** 2) / (n * p0)).sum()) > _chi2_0999(5)  # the test has teeth


def test_pooled_tau_is_not_a_mean_of_ratios():
    a, b = SpecStats(), SpecStats()
    for n in (3, 3):  # 2 passes, 8 tokens: tau 4
        a.add_pass(n, min(n + 1, K))
    for n in (0, 0, 0, 0):  # 4 passes, 4 tokens: tau 1
        b.add_pass(n, 1)
    a.merge(b)
    assert a.tau == 12 / 6  # not (4 + 1) / 2
    assert a.accept_counts == [4, 0, 0, 2]
    pos = a.acceptance_per_position()
    assert [p["reached"] for p in pos] == [6, 2, 2, 2] and [p["accepted"] for p in pos] == [2, 2, 2, 0]
    assert pos[0]["conditional"] == 2 / 6 and pos[1]["conditional"] == 1.0 and pos[1]["unconditional"] == 2 / 6


# --- trees -----------------------------------------------------------------------------------------


def test_ancestor_mask_and_children():
    #      0
    #    1   2
    #   3 4   5
    tree = Tree([9, 1, 2, 3, 4, 5], [-1, 0, 0, 1, 1, 2], [0, 1, 1, 2, 2, 2])
    m = ancestor_mask(tree.parents).int().tolist()
    assert m[3] == [1, 1, 0, 1, 0, 0] and m[5] == [1, 0, 1, 0, 0, 1] and m[0] == [1, 0, 0, 0, 0, 0]
    assert tree.children() == [[1, 2], [3, 4], [5], [], [], []]
    chain_mask = ancestor_mask(chain_tree(9, [1, 2, 3]).parents)
    assert torch.equal(chain_mask, torch.ones(4, 4, dtype=torch.bool).tril())


def test_accept_greedy_tree_walks_matching_children():
    tree = Tree([9, 1, 2, 3, 4, 5], [-1, 0, 0, 1, 1, 2], [0, 1, 1, 2, 2, 2])
    # target argmax per node: after root -> 2 (node 2), after node 2 -> 5 (node 5), after node 5 -> 7
    argmax = torch.tensor([2, 0, 5, 0, 0, 7])
    assert accept_greedy_tree(tree, argmax) == ([2, 5], 7)
    assert accept_greedy_tree(tree, torch.tensor([8, 0, 0, 0, 0, 0])) == ([], 8)


def test_select_nodes_is_ancestor_closed_under_ties():
    # level 1: a(0) b(1); level 2: children of a: c(2) d(3), of b: e(4). c ties with a (log-prob 0).
    scores = torch.tensor([-0.5, -1.0, -0.5, -3.0, -1.2])
    tree = select_nodes(7, [10, 11, 12, 13, 14], [-1, -1, 0, 0, 1], scores, [1, 1, 2, 2, 2], total_tokens=2)
    assert tree.tokens == [7, 10, 12] and tree.parents == [-1, 0, 1]  # a before its tied child c
    tree = select_nodes(7, [10, 11, 12, 13, 14], [-1, -1, 0, 0, 1], scores, [1, 1, 2, 2, 2], total_tokens=4)
    assert tree.tokens == [7, 10, 11, 12, 14] and tree.parents == [-1, 0, 0, 1, 2]


def _prefilled(target, prompt):
    cache = new_cache(target)
    target_forward(target, prompt, torch.arange(len(prompt)), cache)
    return cache


def test_tree_verify_equals_chain_verify_for_a_chain():
    """A chain laid out as a tree (4-D float mask, explicit positions) gives the chain's logits
    and aux states, and keep_positions on the accepted path leaves the same cache as crop."""
    from eyas.capture import HiddenStateCapture

    for attn in ("sdpa", "eager"):
        target = tiny_llama(vocab=16, attn=attn)
        prompt = torch.tensor([3, 1, 4, 1, 5, 9])
        drafts = [2, 6, 5, 3]
        tree = chain_tree(7, drafts)
        cap = HiddenStateCapture(target, [0, 2, 3])
        L = len(prompt) + 1
        chain_cache, tree_cache = _prefilled(target, prompt), _prefilled(target, prompt)
        ids = torch.tensor(tree.tokens)
        lc, ac = target_forward(target, ids, torch.arange(L - 1, L + K), chain_cache, cap)
        mask = torch.cat([torch.ones(K + 1, L - 1, dtype=torch.bool), ancestor_mask(tree.parents)], dim=1)
        lt, at = target_forward(target, ids, L - 1 + torch.tensor(tree.depths), tree_cache, cap, mask)
        torch.testing.assert_close(lt, lc, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(at, ac, rtol=1e-5, atol=1e-5)
        assert accept_greedy_tree(tree, lt.argmax(-1)) == (
            list(range(1, accept_greedy_chain(torch.tensor(drafts), lc.argmax(-1))[0] + 1)),
            accept_greedy_chain(torch.tensor(drafts), lc.argmax(-1))[1],
        )
        crop(chain_cache, L + 2)
        keep_positions(tree_cache, torch.cat([torch.arange(L - 1), L - 1 + torch.tensor([0, 1, 2])]))
        for a, b in zip(chain_cache.layers, tree_cache.layers):
            torch.testing.assert_close(a.keys, b.keys)
            torch.testing.assert_close(a.values, b.values)


def test_tree_with_top1_is_the_chain():
    """tree_top_k=1, depth K, K nodes: the EAGLE-2 tree degenerates to the greedy chain, so the
    whole generation (tokens and every pass's acceptance) equals chain mode's."""
    target = tiny_llama(vocab=8, seed=2)
    draft = random_draft(target, draft_tokens=[0, 1, 2, 4, 5, 7], seed=1)
    prompt = torch.tensor([1, 2, 3, 4, 5])
    chain = speculative_generate(target, draft, prompt, max_new_tokens=24, mode="chain", num_draft_tokens=K)
    tree = speculative_generate(
        target, draft, prompt, max_new_tokens=24, mode="tree", tree_top_k=1, tree_depth=K, tree_total_tokens=K
    )
    assert tree.tokens == chain.tokens
    assert tree.stats.accept_counts == chain.stats.accept_counts and tree.stats.reached == chain.stats.reached


def test_draft_tree_scores_are_path_log_probs():
    """Each tree node's score equals the sum of draft log-probs along its path, computed naively by
    running the draft down that path alone (a causal chain over a copy of the committed cache):
    checks the tree attention masks, positions and hidden-state routing of draft_tree."""
    from eyas.capture import HiddenStateCapture
    from eyas.spec.propose import draft_tree

    target = tiny_llama(vocab=16, seed=4)
    draft = random_draft(target, draft_tokens=list(range(0, 16, 2)) + [1, 3], seed=5, logit_scale=20.0)
    t2d_rank = {int(t): d for d, t in enumerate((torch.arange(draft.d2t.numel()) + draft.d2t).tolist())}
    prompt = torch.tensor([5, 3, 8, 1, 2])
    cap = HiddenStateCapture(target, draft.config.aux_layer_ids)
    logits, aux = target_forward(target, prompt, torch.arange(5), new_cache(target), cap)
    root = int(logits[-1].argmax())
    tokens = prompt.tolist() + [root]
    dcache = DraftCache()
    h = extend(draft, dcache, torch.tensor(tokens[1:]), aux, 0)
    last_pos = len(tokens) - 2
    tree = draft_tree(draft, dcache, h, root, last_pos, top_k=3, depth=3, total_tokens=9)
    assert tree.num_nodes == 10 and len(dcache) == dcache.committed + 3 + 3  # two expansion levels of 3
    dcache.rollback()
    for node in range(1, tree.num_nodes):
        path = []
        i = node
        while i > 0:
            path.insert(0, i)
            i = tree.parents[i]
        k, v, hh, score = dcache.k, dcache.v, h, 0.0
        for step, n in enumerate(path):
            lp = torch.log_softmax(draft.logits(hh)[0, -1].float(), -1)
            score += float(lp[t2d_rank[tree.tokens[n]]])
            if step + 1 < len(path):
                mask = torch.ones(1, 1, k.shape[2] + 1, dtype=torch.bool)
                ids, pos = torch.tensor([[tree.tokens[n]]]), torch.tensor([[last_pos + step + 1]])
                hh, k1, v1 = draft.forward_step(ids, hh, pos, k, v, mask)
                k, v = torch.cat([k, k1], 2), torch.cat([v, v1], 2)
        assert tree.depths[node] == len(path)
        assert float(tree.scores[node]) == pytest.approx(score, abs=1e-4)


# --- the loop: exact tau with known drafts -----------------------------------------------------------


@pytest.mark.parametrize("mode", ["chain", "tree"])
@pytest.mark.parametrize("kind,tau", [("copy", K + 1), ("wrong", 1), ("first", 2)])
def test_markov_drafts_give_exact_tau(mode, kind, tau):
    """Real Eagle3Drafts with hand-set weights on the Markov target (tests/spec/known_drafts.py's markov_draft)."""
    target = markov_target()
    draft = markov_draft(target, kind)
    prompt = torch.tensor([3, 5, 7])
    ref = target_generate(target, prompt, max_new_tokens=21)
    out = speculative_generate(
        target, draft, prompt, max_new_tokens=21, mode=mode, num_draft_tokens=K, tree_depth=K, tree_top_k=3,
        tree_total_tokens=10,
    )  # fmt: skip
    assert out.tokens == ref.tokens
    assert out.stats.tau == tau  # every pass: the same accepted length
    assert out.stats.accept_counts[tau - 1] == out.stats.verify_passes == math.ceil(20 / tau)


@pytest.mark.parametrize("mode", ["chain", "tree"])
@pytest.mark.parametrize("wrong_at,tau", [(None, K + 1), (0, 1), (2, 3)])
def test_oracle_with_known_accept_pattern(mode, wrong_at, tau):
    """The oracle proposes the (context-dependent) target's greedy token except at draft position
    `wrong_at` (0-based): every pass accepts exactly wrong_at tokens, tau = wrong_at + 1. The oracle
    also asserts that its cache+mask show it exactly the committed context."""
    target = tiny_llama(vocab=16, seed=1)
    prompt = torch.tensor([1, 4, 9, 2])
    ref = target_generate(target, prompt, max_new_tokens=13)
    oracle = OracleDraft(target, prompt[0], wrong_at)
    out = speculative_generate(
        target, oracle, prompt, max_new_tokens=13, mode=mode, num_draft_tokens=K, tree_depth=K, tree_top_k=2,
        tree_total_tokens=6,
    )  # fmt: skip
    assert out.tokens == ref.tokens
    assert out.stats.tau == tau and out.stats.accept_counts[tau - 1] == out.stats.verify_passes


# --- the loop: lossless greedy, stops, sampling distribution -----------------------------------------


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_greedy_is_lossless_with_partial_acceptance(mode):
    """Random tiny target (V = 8, real attention) and a random draft with W = 6 < V: some draft
    tokens are accepted, some not, and the output is still target-only greedy output exactly."""
    total = SpecStats()
    for seed in range(3):
        target = tiny_llama(vocab=8, seed=10 + seed)
        draft = random_draft(target, draft_tokens=[0, 1, 2, 4, 5, 7], seed=seed)
        prompt = torch.randint(0, 8, (9,), generator=torch.Generator().manual_seed(seed))
        ref = target_generate(target, prompt, max_new_tokens=30)
        out = speculative_generate(
            target, draft, prompt, max_new_tokens=30, mode=mode, num_draft_tokens=K, tree_depth=3, tree_top_k=3,
            tree_total_tokens=8,
        )  # fmt: skip
        assert out.tokens == ref.tokens, seed
        total.merge(out.stats)
    assert 0 < sum(total.accepted) < total.verify_passes * K  # both outcomes were exercised


def test_stop_tokens_and_max_new_tokens_cut_the_output():
    target = markov_target()
    draft = markov_draft(target, "copy")
    prompt = torch.tensor([3, 5, 7])  # continues 8, 9, 10, 11, 0, 1, ...
    out = speculative_generate(target, draft, prompt, max_new_tokens=30, num_draft_tokens=K, stop_ids=(10,))
    assert out.tokens == [8, 9, 10]
    assert target_generate(target, prompt, max_new_tokens=30, stop_ids=(10,)).tokens == [8, 9, 10]
    out = speculative_generate(target, draft, prompt, max_new_tokens=4, num_draft_tokens=K)
    # prefill: 8; one pass emits 9, 10, 11, 0, 1 (counted in tau); the output is cut to 4 tokens
    assert out.tokens == [8, 9, 10, 11] and out.stats.new_tokens == 5 and out.stats.verify_passes == 1


def _calibration_z(target, tokens: list[int], n_prompt: int, temperature: float) -> torch.Tensor:
    """z-score per token id y of (observed count of y) - sum_i p_i(y), p_i = the target's exact
    distribution at each generated position (one plain forward over the final sequence). The sum of
    1[y_i = y] - p_i(y) is a martingale with variance sum_i p_i(y)(1 - p_i(y)): z ~ N(0, 1) when
    every token was drawn from the target's distribution."""
    with torch.no_grad():
        logits = target(torch.tensor([tokens])).logits[0, n_prompt - 1 : -1]
    p = torch.softmax(logits.float() / temperature, -1)
    obs = torch.nn.functional.one_hot(torch.tensor(tokens[n_prompt:]), p.shape[-1]).float()
    return (obs - p).sum(0) / (p * (1 - p)).sum(0).clamp_min(1e-9).sqrt()


def _sampled_z(mode: str) -> tuple[torch.Tensor, SpecStats]:
    target = tiny_llama(vocab=8, hidden=32, layers=2, seed=3, logit_scale=20.0)
    draft = random_draft(target, aux_layer_ids=(0, 1), draft_tokens=[0, 1, 2, 4, 5, 7], seed=3, logit_scale=20.0)
    prompt = [1, 2, 3]
    g = torch.Generator().manual_seed(0)
    out = speculative_generate(
        target, draft, torch.tensor(prompt), max_new_tokens=400, mode=mode, num_draft_tokens=3, tree_depth=3,
        tree_top_k=3, tree_total_tokens=8, temperature=1.0, generator=g,
    )  # fmt: skip
    assert len(out.tokens) == 400
    return _calibration_z(target, prompt + out.tokens, len(prompt), 1.0), out.stats


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_sampling_preserves_target_distribution(mode):
    """Speculative sampling at T = 1 on a context-dependent tiny target (V = 8, peaked: lm_head x20)
    with a random draft over W = 6 tokens (q = 0 on two target tokens): 400 generated tokens, fixed
    seed. Tolerance: every |z| < 4 (the z-scores are ~N(0, 1) under the null; 8 of them)."""
    z, stats = _sampled_z(mode)
    assert 0 < sum(stats.accepted) < stats.verify_passes * 3  # accepts and rejections both happen
    assert z.abs().max() < 4, z


def test_sampling_calibration_catches_a_broken_rule(monkeypatch):
    """The same statistic on a loop that accepts every draft token (ignoring p/q) fails clearly."""
    import eyas.spec.generate as gen
    from eyas.spec.sampling import sample

    def accept_all(draft_K, p_K1V, q_KV, generator):
        k = draft_K.shape[0]
        return k, int(sample(p_K1V[k], generator))

    monkeypatch.setattr(gen, "accept_sampling_chain", accept_all)
    z, _ = _sampled_z("chain")
    assert z.abs().max() > 8, z


@pytest.fixture(scope="module")
def smollm2_fp32(smollm2_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32, attn_implementation="sdpa")
    return model.eval().requires_grad_(False)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_smollm2_lossless_with_random_eagle3_draft(smollm2_fp32, smollm2_tokenizer, mode):
    """The real SmolLM2-135M-Instruct (fp32) and a real, untrained Eagle3Draft (aux layers
    2, 15, 27; W = 2048): tau ~ 1, but the output equals target-only greedy output for two chat
    prompts."""
    target, tok = smollm2_fp32, smollm2_tokenizer
    draft = random_draft(target, aux_layer_ids=(2, 15, 27), draft_tokens=list(range(2048)), seed=0)
    for text in ("What is the capital of France?", "Write a haiku about the sea."):
        chat = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
        prompt = torch.tensor(tok(chat, add_special_tokens=False)["input_ids"])
        ref = target_generate(target, prompt, max_new_tokens=10)
        out = speculative_generate(
            target, draft, prompt, max_new_tokens=10, mode=mode, num_draft_tokens=3, tree_depth=3, tree_top_k=4,
            tree_total_tokens=10,
        )  # fmt: skip
        assert out.tokens == ref.tokens, (text, out.tokens, ref.tokens)
