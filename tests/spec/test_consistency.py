"""Training (eyas.train: TTT, teacher, loss mask) and inference (eyas.spec) compute the same function.

A draft that trains well and then serves at tau ~ 1 almost always has training and inference
disagreeing on an alignment: token vs hidden state off by one, RoPE positions, aux-layer order, the
pre-norm vs post-norm state fed back, the d2t direction, a shifted loss mask. Each test here runs
the real code on both sides (no re-implementation) on a tiny random Llama target and a real random
Eagle3Draft (tests/models.py, with the recording draft of tests/spec/recording_draft.py), in fp32:

  a. TTT step i at row t == eyas.spec's draft step i in the round whose accepted context ends at
     token t+1, with the round's earlier proposals forced to the ground truth t+2 .. t+1+i; both
     through spec's building blocks (extend + draft_chain, many round sizes) and through the whole
     decoding loop (speculative_generate, chain and tree, with partial acceptance);
  b. the aux states the decoding loop feeds the draft (captured in KV-cached verify forwards, trimmed
     after partial acceptance) == what extract stores and what online training captures, same layer
     ids, same order;
  c. the teacher of TTT step i at row t (lm_head(final[t+1+i]), loss mask at t+2+i) == the target's
     own next-token distribution for token t+2+i from a plain forward;
  d. spec proposes d + d2t[d] for the draft's argmax d, and the training accuracy of step 0 at row t
     is exactly "spec's first proposal is accepted" in that round.
"""

from __future__ import annotations

import pytest
import torch

from eyas.capture import capture
from eyas.spec import speculative_generate, target_generate
from eyas.spec.cache import DraftCache
from eyas.spec.propose import draft_chain, draft_tree, extend, to_target_ids
from eyas.spec.sampling import accept_greedy_chain, draft_probs_on_target_vocab
from eyas.train.loop import Teacher
from eyas.train.loss import step_terms
from eyas.vocab import draft_to_target, target_to_draft
from tests import models
from eyas.ttt import naive_ttt
from tests.spec.recording_draft import RecordingDraft, draft_ids_of, ttt_logits

T = 4  # TTT steps = draft tokens per round
AUX = (0, 2, 3)
TOL = dict(rtol=1e-4, atol=1e-5)


@pytest.fixture(scope="module")
def target():
    """A random Llama (fp32, GQA, real RoPE and KV cache) with weights large enough that every
    decoder layer changes the residual stream (aux states of different layers differ)."""
    return models.tiny_model(vocab=48, hidden=32, layers=4, max_positions=256, attn="sdpa", std=0.12, embed_std=1.0,
                             frozen=True)  # fmt: skip


def random_draft(target, sel, aux_layer_ids=AUX, seed: int = 0):
    """An untrained Eagle3Draft sized from the target, draft vocab = the target ids `sel` (W < V, so
    d2t is not all zeros), weights large enough that a wrong position, hidden state or token moves
    its logits by far more than the tolerances."""
    return models.random_draft(target, sel, aux_layer_ids, seed, std=0.2, norm_range=(0.5, 1.5))


def rand_ids(n: int, seed: int, pool) -> torch.Tensor:
    pool = torch.as_tensor(pool)
    g = torch.Generator().manual_seed(seed)
    return pool[torch.randint(0, pool.numel(), (n,), generator=g)]


def target_states(target, ids_S: torch.Tensor, layer_ids=AUX) -> tuple[torch.Tensor, torch.Tensor]:
    """(aux_SKD, final_SD) of one plain forward: what training reads (eyas.capture)."""
    aux, final = capture(target, ids_S[None], layer_ids=list(layer_ids))
    return aux[0], final[0]


def assert_same_logits(spec, ttt, keys):
    assert keys
    for key in keys:
        torch.testing.assert_close(spec[key], ttt[key], **TOL, msg=lambda m: f"(t, i) = {key}: {m}")


# --- a. TTT step i == spec draft step i under teacher forcing ----------------------------------------


def test_ttt_equals_spec_building_blocks_for_every_position_and_step(target):
    """Spec's round loop, driven by hand over a fixed sequence: each round step-0-extends the newly
    accepted positions (1..4 at a time, as partial acceptance leaves them) and runs draft_chain with
    proposals forced to the ground truth; the draft logits of every (t, i) equal TTT's, computed on
    a packed row where another sample precedes this one."""
    v = target.config.vocab_size
    sel = sorted(set(range(3, v, 2)) | {4, 10})  # W < V, d2t far from zero
    draft = random_draft(target, sel, AUX, seed=1)
    ids = rand_ids(30, 0, sel)
    other = rand_ids(11, 1, range(v))
    aux, _ = target_states(target, ids)
    ttt = ttt_logits(draft, aux, ids, T, before=(target_states(target, other)[0], other))

    for grow in ([1], [1, 3, 1, 2, 4, 1]):  # every t once; then rounds of several new positions
        rec = RecordingDraft(draft, force=ids.tolist())
        dcache, L = DraftCache(), 2
        for r in range(ids.numel()):
            if L > ids.numel():
                break
            c = dcache.committed  # new step-0 positions c .. L-2, each (fc(aux_p), token p+1)
            h = extend(rec, dcache, ids[c + 1 : L], aux[c : L - 1], c)
            draft_chain(rec, dcache, h, L - 2, T)
            dcache.rollback()
            L += grow[r % len(grow)]
        keys = [k for k in ttt if k in rec.clean]
        assert {i for _, i in keys} == set(range(T)) and len(keys) > (80 if grow == [1] else 15)
        assert grow != [1] or len(keys) == len(ttt)
        assert_same_logits(rec.records, ttt, keys)
    # the test has teeth: the state fed back at step i >= 1 is the draft's own output, not fc(aux):
    # TTT (t+1, i-1) sees the same tokens at the same positions but differs
    for t, i in keys:
        if i >= 1 and (t + 1, i - 1) in ttt:
            assert (rec.records[(t, i)] - ttt[(t + 1, i - 1)]).abs().max() > 1e-2


def wrong_at(t: int, i: int) -> int:
    """Which forced proposals are wrong: 1 = the ground truth ranks second, 2 = outside a top-2."""
    return 1 if (t + 3 * i) % 7 == 2 else 2 if (2 * t + i) % 11 == 5 else 0


def forced_generation(target, mode: str, layer_ids, seed: int, new: int = 40, sliding_window: int = 0):
    """speculative_generate with the real draft's proposals forced to the target's greedy
    continuation except at `wrong_at` -> (recording draft, generation, prompt + continuation)."""
    v = target.config.vocab_size
    prompt = rand_ids(7, seed, range(v))
    ref = target_generate(target, prompt, max_new_tokens=new).tokens
    seq = torch.tensor(prompt.tolist() + ref)
    sel = sorted(set(seq.tolist()) | set(range(0, v, 3)))
    assert len(sel) < v
    draft = random_draft(target, sel, layer_ids, seed=seed + 1)
    draft.config.sliding_window = sliding_window
    rec = RecordingDraft(draft, force=seq.tolist(), wrong=wrong_at)
    out = speculative_generate(target, rec, prompt, max_new_tokens=new, mode=mode, num_draft_tokens=T,
                               tree_top_k=2, tree_depth=T, tree_total_tokens=12)
    assert out.tokens == ref  # greedy speculative decoding is lossless
    counts = out.stats.accept_counts
    assert len(counts) == T + 1 and counts[T] > 0 and 0 < sum(counts[:T]), counts  # full and partial
    return rec, out, seq


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_ttt_equals_spec_inside_the_decoding_loop(target, mode):
    """speculative_generate itself (aux states from KV-cached verify forwards, target-cache trims
    after partial acceptance, EAGLE-2 tree with siblings in the draft cache) with the draft's
    proposals forced to the target's greedy continuation, wrong at some (t, i): every draft step
    whose inputs are the ground truth gives TTT's logits on the final sequence."""
    rec, _, seq = forced_generation(target, mode, AUX, seed=2)
    aux, _ = target_states(target, seq)
    ttt = ttt_logits(rec.draft, aux, seq, T)
    keys = [k for k in rec.clean if k in ttt]
    assert len(keys) > 20 and {i for _, i in keys} == set(range(T)), sorted(keys)
    assert_same_logits(rec.records, ttt, keys)


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_windowed_draft_decodes_as_a_recomputation_with_its_window(target, mode):
    """A draft with a 5-position sliding window on a 47-token sequence: every draft step of
    speculative_generate whose inputs are the ground truth (KV caches trimmed after partial
    acceptance, tree siblings in the draft cache) gives the logits of naive_ttt's recomputation
    from scratch, which cuts its own position-tracked cache to the window; the training unroll's
    windowed masks agree; and the window matters (a full-attention recomputation differs)."""
    window = 5
    rec, _, seq = forced_generation(target, mode, AUX, seed=2, sliding_window=window)
    aux, _ = target_states(target, seq)
    ref_TSD = naive_ttt(rec.draft, aux, seq, T)
    keys = [(t, i) for t, i in rec.clean if t + 1 + i < seq.numel()]
    assert len(keys) > 20 and max(t for t, _ in keys) > 3 * window
    with torch.no_grad():
        ref = {(t, i): rec.draft.logits(ref_TSD[i, t]) for t, i in keys}
    assert_same_logits(rec.records, ref, keys)
    ttt = ttt_logits(rec.draft, aux, seq, T)
    assert_same_logits(rec.records, ttt, [k for k in keys if k in ttt])
    rec.draft.config.sliding_window = 0
    full_TSD = naive_ttt(rec.draft, aux, seq, T)
    far = [(t, i) for t, i in keys if t + i >= window]
    assert all(not torch.allclose(ref_TSD[i, t], full_TSD[i, t], **TOL) for t, i in far)


# --- b. aux states: verify-time capture == extract == online training --------------------------------


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_aux_states_fed_at_inference_equal_the_stored_ones(target, mode):
    """The step-0 aux states of every position, as the decoding loop hands them to draft.fuse (from
    the prefill, then from KV-cached verify forwards over chains/trees, trimmed to the accepted
    path after full and partial acceptance), equal what the extract backend stores for that
    sequence (padded and packed batches) and what online training captures (OnlineStates on a
    packed training batch), each in layer-id order: entry j is the state entering layer ids[j]."""
    from eyas.extract.backend import HFBackend
    from eyas.extract.plan import Batch as ExtractBatch
    from eyas.train.data import OnlineStates, pack

    layer_ids = [0, 1, 3]
    rec, _, seq = forced_generation(target, mode, layer_ids, seed=4)
    fed_AKD = torch.cat(rec.fed_aux)  # positions 0, 1, ..., in order
    n = min(fed_AKD.shape[0], seq.numel())
    assert n >= seq.numel() - T - 2

    v = target.config.vocab_size
    other = rand_ids(9, 5, range(v))
    backend = HFBackend(target, layer_ids, torch.float32)
    assert backend.layer_ids == layer_ids == rec.config.aux_layer_ids
    k = len(layer_ids)
    for packed in (False, True):
        batch = ExtractBatch([0, 1], [seq.numel(), other.numel()], 1 if packed else 2,
                             seq.numel() + other.numel() if packed else seq.numel(), packed)
        stored_TKD = backend.forward(batch, [seq, other])
        torch.testing.assert_close(fed_AKD[:n], stored_TKD[:n, :k], **TOL)
    smp = lambda ids, j: dict(input_ids=ids, loss_mask=torch.ones_like(ids), id=str(j), index=j)  # noqa: E731
    tb = OnlineStates(target, layer_ids, "cpu")(pack([smp(other, 0), smp(seq, 1)], T, 10_000))
    torch.testing.assert_close(fed_AKD[:n], tb.aux_BSKD[0, other.numel() : other.numel() + n], **TOL)
    # and each aux entry is the state entering that decoder layer (HF hidden_states[k]), not another
    hs = target.model(seq[None], output_hidden_states=True).hidden_states
    for j, lid in enumerate(layer_ids):
        torch.testing.assert_close(fed_AKD[:n, j], hs[lid][0, :n], **TOL)


def test_aux_layer_ids_must_be_ascending(target):
    """vLLM and SGLang append the aux states while walking the layers (`if idx in
    aux_hidden_state_layers: append`), so the served fc input is in ascending layer order whatever
    order the config lists. Training in another order would serve at tau ~ 1: refused up front."""
    from eyas.capture import HiddenStateCapture, check_layer_ids
    from eyas.errors import ConfigError

    assert check_layer_ids([0, 2, 3], 4) == [0, 2, 3]
    for bad in ([3, 0, 2], [0, 0, 2]):
        with pytest.raises(ConfigError, match="ascending"):
            check_layer_ids(bad, 4)
        with pytest.raises(ConfigError, match="ascending"):
            HiddenStateCapture(target, bad)


# --- c. the teacher: lm_head(final[t+1+i]) is the target's distribution for token t+2+i ---------------


def test_teacher_is_the_targets_next_token_distribution(target):
    """Through the training path (pack -> gather_indices -> Teacher on captured final states), the
    teacher of step i at row t, on a packed row of two samples with random loss masks, is the
    softmax over the draft vocab of the target's plain-forward logits at t+1+i (its distribution
    for token t+2+i), its top-1 is the target's argmax (as a draft id, -1 outside the draft vocab),
    and the row is trained iff loss_mask[t+2+i] = 1 inside the sample."""
    from eyas.train.data import pack

    v = target.config.vocab_size
    sel = torch.tensor(sorted(set(range(1, v, 3)) | {0, 7, 8}))
    draft = random_draft(target, sel.tolist(), AUX)
    g = torch.Generator().manual_seed(6)
    samples, plain = [], []
    for j, n in enumerate((13, 17)):
        ids = torch.randint(0, v, (n,), generator=g)
        aux, final = target_states(target, ids)
        mask = (torch.rand(n, generator=g) < 0.6).long()
        samples.append(dict(input_ids=ids, loss_mask=mask, aux=aux, final=final, id=str(j), index=j))
        plain.append(target(ids[None]).logits[0])
    b = pack(samples, T, 10_000, pad_multiple=16)
    teacher = Teacher(lm_head_VD=target.lm_head.weight, draft_ids_W=torch.arange(sel.numel()) + draft.d2t,
                      target_to_draft_V=target_to_draft(torch.arange(v), draft.t2d), chunk=7)  # as build_trainer
    p_NW, top1_N = teacher(b)
    starts = [0, 13]
    checked = 0
    for i in range(T):
        rows = set(b.rows_T[i].tolist())
        for j, smp in enumerate(samples):
            n = smp["input_ids"].numel()
            want = {starts[j] + t for t in range(n - 2 - i) if smp["loss_mask"][t + 2 + i] == 1}
            assert want == {r for r in rows if starts[j] <= r < starts[j] + n}, (i, j)
        for r, tix in zip(b.rows_T[i].tolist(), b.tix_T[i].tolist()):
            j = 0 if r < starts[1] else 1
            logits_V = plain[j][r - starts[j] + 1 + i]  # after tokens .. t+1+i: predicts token t+2+i
            torch.testing.assert_close(p_NW[tix], torch.softmax(logits_V[sel], -1), **TOL)
            assert int(top1_N[tix]) == int(target_to_draft(logits_V.argmax()[None], draft.t2d)[0])
            checked += 1
    assert checked > 20 and bool((top1_N < 0).any()) and bool((top1_N >= 0).any())


# --- d. d2t: the draft's argmax through d2t is what spec proposes; train accuracy = spec acceptance ----


def test_d2t_maps_draft_argmax_to_the_proposed_target_id(target):
    """Draft vocab = the target's 3 most frequent greedy tokens on the sequence (so the target's
    choice is often inside it and a random draft is sometimes right). For every t: spec's first
    proposal is d + d2t[d] for the draft's argmax d (in the draft vocab; vocab.draft_to_target agrees,
    and target_to_draft inverts it); the tree's first level is the d2t image of the top-k; sampling
    puts q_W(d) on that same target id; and the training accuracy of TTT step 0 at row t (draft
    argmax == teacher top-1 as draft ids) is exactly whether spec's greedy verify accepts it."""
    v = target.config.vocab_size
    ids = rand_ids(40, 7, range(v))
    greedy_S = target(ids[None]).logits[0].argmax(-1)
    counts = torch.bincount(greedy_S, minlength=v)
    sel = sorted(torch.sort(counts, descending=True, stable=True).indices[:3].tolist())
    assert sel != list(range(3))
    draft = random_draft(target, sel, AUX, seed=8)
    w = len(sel)
    assert torch.equal(target_to_draft(draft_to_target(torch.arange(w), draft.d2t), draft.t2d), torch.arange(w))

    aux, final = target_states(target, ids)
    smp = dict(input_ids=ids, loss_mask=torch.ones_like(ids), aux=aux, final=final, id="s", index=0)
    from eyas.train.data import pack
    from eyas.ttt import TTTDraft, sdpa_masks

    b = pack([smp], 1, 10_000)
    teacher = Teacher(target.lm_head.weight, torch.arange(w) + draft.d2t,
                      target_to_draft(torch.arange(v), draft.t2d), chunk=16)
    p_NW, top1_N = teacher(b)
    logits_MW = TTTDraft(draft)(b.aux_BSKD, b.input_ids_BS, b.pos_BS, sdpa_masks(b.doc_BS, 1), b.rows_T)[0]
    train_correct = {}
    for m, (r, tix) in enumerate(zip(b.rows_T[0].tolist(), b.tix_T[0].tolist())):
        _, correct, _, _, _, _ = step_terms([logits_MW[m : m + 1]], p_NW, top1_N, [torch.tensor([tix])],
                                         [torch.tensor([r])], b.input_ids_BS.numel())
        train_correct[r] = bool(correct[0])

    rec, dcache = RecordingDraft(draft), DraftCache()
    spec_accept = {}
    for t in range(ids.numel() - 2):
        h = extend(rec, dcache, ids[t + 1 : t + 2], aux[t : t + 1], t)
        tok_K, _ = draft_chain(rec, dcache, h, t, 1)
        d = rec.records[(t, 0)].argmax()
        assert int(tok_K[0]) == int(d + draft.d2t[d]) == int(draft_to_target(d, draft.d2t)) and draft.t2d[tok_K[0]]
        n, _ = accept_greedy_chain(tok_K, greedy_S[t + 1 : t + 3])  # [t+1]: the target's choice for token t+2
        spec_accept[t] = n == 1
        if t % 9 == 0:
            tree = draft_tree(draft, dcache, h, int(ids[t + 1]), t, top_k=2, depth=1, total_tokens=2)
            top = rec.records[(t, 0)].topk(2).indices
            assert sorted(tree.tokens[1:]) == sorted(to_target_ids(draft, top).tolist())
            q_W = torch.softmax(rec.records[(t, 0)], -1)
            q_V = draft_probs_on_target_vocab(q_W[None], draft.d2t, v)[0]
            assert float(q_V[tok_K[0]]) == float(q_W[d]) and float(q_V[draft.t2d].sum()) == pytest.approx(1.0)
        dcache.rollback()
    assert spec_accept == train_correct
    assert 0 < sum(spec_accept.values()) < len(spec_accept)  # both outcomes occur
    assert set(spec_accept) == set(range(ids.numel() - 2))
    # (the mapping is not the identity here, so a reversed d2t would propose other tokens)
    assert bool((draft.d2t != 0).any()) and draft_ids_of(draft, torch.tensor(sel)).tolist() == list(range(w))
