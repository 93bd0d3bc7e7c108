"""Training-time test: the all-positions unroll against a literal per-position autoregressive loop.

`naive_ttt` runs the draft the way vLLM / SGLang serve it (prefill rows 0..t, then one token at a
time at positions t+1, t+2, ... with an ordinary KV cache); the batched unroll must reproduce
every (step, row) output of every packed sample.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from eyas.draft import DraftConfig, Eagle3Draft
from eyas.train.data import pack
from eyas.ttt import naive_ttt, sdpa_masks, shift_left, ttt_forward, ttt_mask_mod


def make_draft(norm_before_residual=False, seed=0, num_layers=1, eagle31=False, sliding_window=0) -> Eagle3Draft:
    cfg = DraftConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=48,
                      target_hidden_size=24, num_aux_layers=3, draft_vocab_size=30, vocab_size=60, rope_theta=10000.0,
                      norm_before_residual=norm_before_residual, num_layers=num_layers, fc_norm=eagle31,
                      norm_output=eagle31, sliding_window=sliding_window)
    torch.manual_seed(seed)
    m = Eagle3Draft(cfg, torch.randn(60, 32)).double()
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return m


def make_samples(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        dict(input_ids=torch.randint(0, 60, (L,), generator=g), loss_mask=(torch.rand(L, generator=g) < 0.7).long(),
             aux=torch.randn(L, 3, 24, generator=g, dtype=torch.float64), final=torch.randn(L, 24, generator=g),
             id=f"s{j}", index=j)
        for j, L in enumerate(lengths)
    ]


@pytest.mark.parametrize("num_steps,nbr,num_layers,eagle31", [(7, False, 1, False), (3, True, 1, False), (4, False, 2, False),
                                                        (4, False, 1, True), (3, False, 2, True)])
def test_ttt_matches_the_naive_autoregressive_loop(num_steps, nbr, num_layers, eagle31):
    m = make_draft(nbr, num_layers=num_layers, eagle31=eagle31)
    samples = make_samples([9, 4, 10])
    b = pack(samples, num_steps, max_tokens=100, pad_multiple=16)
    assert b.input_ids_BS.shape == (1, 32)
    outs = ttt_forward(m, b.aux_BSKD, b.input_ids_BS, b.pos_BS, sdpa_masks(b.doc_BS, num_steps))
    assert len(outs) == num_steps
    start = 0
    for smp in samples:
        L = smp["input_ids"].numel()
        ref_TSD = naive_ttt(m, smp["aux"], smp["input_ids"], num_steps)
        for i in range(num_steps):
            rows = max(0, L - 1 - i)  # rows whose step-i input token exists
            torch.testing.assert_close(outs[i][0, start : start + rows], ref_TSD[i, :rows], rtol=1e-9, atol=1e-9)
        start += L


@pytest.mark.parametrize("window,num_layers", [(3, 1), (1, 2), (5, 2)])
def test_windowed_ttt_matches_the_naive_loop_with_its_window(window, num_layers):
    """A window shorter than the samples: the unroll's masks cut by positions (pos_t + i against
    pos_t' + j) against the naive loop's KV cache cut by its own tracked positions; and the window
    really cuts (the unwindowed draft's outputs differ)."""
    num_steps = 4
    m = make_draft(num_layers=num_layers, sliding_window=window)
    samples = make_samples([9, 4, 10])
    b = pack(samples, num_steps, max_tokens=100, pad_multiple=16)
    masks = sdpa_masks(b.doc_BS, num_steps, b.pos_BS, window)
    outs = ttt_forward(m, b.aux_BSKD, b.input_ids_BS, b.pos_BS, masks)
    full = ttt_forward(m, b.aux_BSKD, b.input_ids_BS, b.pos_BS, sdpa_masks(b.doc_BS, num_steps))
    start = 0
    for smp in samples:
        L = smp["input_ids"].numel()
        ref_TSD = naive_ttt(m, smp["aux"], smp["input_ids"], num_steps)
        for i in range(num_steps):
            rows = max(0, L - 1 - i)
            torch.testing.assert_close(outs[i][0, start : start + rows], ref_TSD[i, :rows], rtol=1e-9, atol=1e-9)
        start += L
    assert not torch.allclose(outs[1][0, :8], full[1][0, :8])


def test_windowed_flex_mask_mod_equals_the_sdpa_mask():
    """The mask_mod materialised on index grids (and through create_block_mask) is the SDPA mask,
    step by step, over the padded T*S keys flex attends to."""
    from torch.nn.attention.flex_attention import create_mask

    from eyas.ttt import flex_masks

    s, num_steps, window = 128, 3, 7
    doc = torch.tensor([[0] * 50 + [1] * 60 + [-1] * 18])
    pos = torch.tensor([list(range(50)) + list(range(60)) + [0] * 18])
    dense = sdpa_masks(doc, num_steps, pos, window)
    for i in range(num_steps):
        mod = ttt_mask_mod(doc, s, torch.tensor(i), pos, window)
        got = create_mask(mod, 1, None, s, num_steps * s, device="cpu")[0, 0]
        assert torch.equal(got[:, : (i + 1) * s], dense[i][0]) and not got[:, (i + 1) * s :].any()
        assert 0 < int(dense[i].sum()) < int(sdpa_masks(doc, num_steps)[i].sum())  # the window cuts
    for i, bm in enumerate(flex_masks(doc, num_steps, compile=False, pos_BS=pos, window=window)):
        q_idx, kv_idx = torch.arange(s)[:, None], torch.arange(num_steps * s)[None, :]
        assert torch.equal(bm.mask_mod(0, 0, q_idx, kv_idx)[:, : (i + 1) * s], dense[i][0])
        tiles = dense[i][0].view(1, s, i + 1, s).any(-1).any(-2)  # S = one 128-tile: a tile per step block
        assert torch.equal(bm.to_dense().bool()[0, 0, :, : i + 1], tiles)  # no tile with a key is skipped


def test_sdpa_masks_are_the_figure_6_pattern():
    doc = torch.tensor([[0, 0, 0, 1, 1, -1]])
    masks = sdpa_masks(doc, 3)
    s = 6
    for i, m in enumerate(masks):
        assert m.shape == (1, s, (i + 1) * s)
        for q in range(s):
            for kv in range((i + 1) * s):
                blk, r = divmod(kv, s)
                want = (r <= q and doc[0, r] == doc[0, q]) if blk == 0 else r == q
                assert bool(m[0, q, kv]) == want, (i, q, kv)


def test_flex_block_masks_match_sdpa():
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    s = 128
    doc = torch.tensor([[0] * 50 + [1] * 60 + [-1] * 18])
    dense = sdpa_masks(doc, 3)
    mod = ttt_mask_mod(doc, s)
    for i in (0, 2):
        q_idx, kv_idx = torch.arange(s)[:, None], torch.arange((i + 1) * s)[None, :]
        assert torch.equal(mod(0, 0, q_idx, kv_idx), dense[i][0])
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 4, s, 8), torch.randn(1, 2, 3 * s, 8), torch.randn(1, 2, 3 * s, 8)
    bm = create_block_mask(mod, 1, None, s, 3 * s, device="cpu", _compile=False)
    with pytest.warns(UserWarning):  # eager flex on CPU: the unfused reference path
        out = flex_attention(q, k, v, block_mask=bm, enable_gqa=True)
    ref = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=dense[2][:, None])
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.filterwarnings("ignore:.*flex_attention.*:UserWarning")
@pytest.mark.parametrize("num_layers,window", [(1, 0), (2, 0), (1, 6)])
def test_flex_unroll_with_fixed_key_length_matches_the_naive_loop(monkeypatch, num_layers, window):
    """The flex path as training runs it: every step over T*S keys (padding masked by the step
    tensor in the mask_mod; with a sliding window, cut by position), FlexAttention run eagerly on
    the CPU, against the naive loop."""
    import eyas.draft
    from torch.nn.attention.flex_attention import flex_attention

    from eyas.ttt import flex_masks

    monkeypatch.setattr(eyas.draft, "_flex_call", lambda q, k, v, bm, enable_gqa: flex_attention(
        q, k, v, block_mask=bm, enable_gqa=enable_gqa))
    num_steps = 3
    m = make_draft(num_layers=num_layers, sliding_window=window)
    samples = make_samples([40, 25, 50])
    b = pack(samples, num_steps, max_tokens=200, pad_multiple=128)
    masks = flex_masks(b.doc_BS, num_steps, compile=False, pos_BS=b.pos_BS, window=window)
    assert all(bm.shape[-1] == num_steps * 128 for bm in masks)
    with torch.no_grad():  # no FlexAttention backward on CPU
        outs = ttt_forward(m, b.aux_BSKD, b.input_ids_BS, b.pos_BS, masks)
    start = 0
    for smp in samples:
        L = smp["input_ids"].numel()
        ref_TSD = naive_ttt(m, smp["aux"], smp["input_ids"], num_steps)
        for i in range(num_steps):
            rows = max(0, L - 1 - i)
            torch.testing.assert_close(outs[i][0, start : start + rows], ref_TSD[i, :rows], rtol=1e-9, atol=1e-9)
        start += L


def test_gather_indices_align_rows_teacher_and_mask():
    samples = make_samples([9, 3, 12], seed=1)
    T = 4
    b = pack(samples, T, max_tokens=100, pad_multiple=8)
    mask, doc = b.loss_mask_BS[0], b.doc_BS[0]
    s = doc.numel()
    assert sorted(b.teacher_rows_N.tolist()) == b.teacher_rows_N.tolist()
    for i in range(T):
        want = [t for t in range(s - 2 - i) if doc[t] >= 0 and doc[t + 2 + i] == doc[t] and mask[t + 2 + i] == 1]
        assert b.rows_T[i].tolist() == want
        assert (b.teacher_rows_N[b.tix_T[i]] == b.rows_T[i] + 1 + i).all()
    # the step-i input token of a trained row is the token right before the predicted one
    ids = b.input_ids_BS
    for i in range(T):
        shifted = shift_left(ids, 1 + i, 0)[0]
        for t in b.rows_T[i].tolist():
            assert shifted[t] == ids[0, t + 1 + i]


def test_pack_positions_restart_per_sample_and_truncate():
    samples = make_samples([5, 7])
    b = pack(samples, 2, max_tokens=6, pad_multiple=0)
    assert b.lengths == [5, 6]
    assert b.pos_BS[0].tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5]
    assert b.doc_BS[0].tolist() == [0] * 5 + [1] * 6
    torch.testing.assert_close(b.aux_BSKD[0, 5:], samples[1]["aux"][:6])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled FlexAttention needs a GPU")
@pytest.mark.parametrize("window", [0, 9])
def test_compiled_flex_unroll_equals_sdpa_on_the_gpu(window):
    """Training's CUDA path: compiled create_block_mask and flex_attention (eyas.draft's one compiled
    kernel), every step over T*S keys, with and without a sliding window, against the SDPA unroll
    (fp32; forward and the gradients of every parameter). Passed on an H100, 2026-12-06."""
    from eyas.ttt import flex_masks

    num_steps = 3
    cfg = DraftConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96,
                      target_hidden_size=24, num_aux_layers=3, draft_vocab_size=30, vocab_size=60, num_layers=2,
                      sliding_window=window)  # FlexAttention's kernels need a head dim of at least 16
    torch.manual_seed(0)
    m = Eagle3Draft(cfg, torch.randn(60, 64)).cuda()
    samples = make_samples([140, 60, 90])
    b = pack(samples, num_steps, max_tokens=400, pad_multiple=128)
    args = (b.aux_BSKD.float().cuda(), b.input_ids_BS.cuda(), b.pos_BS.cuda())
    doc = b.doc_BS.cuda()
    grads = []
    for masks in (flex_masks(doc, num_steps, pos_BS=args[2], window=window), sdpa_masks(doc, num_steps, args[2], window)):
        m.zero_grad()
        outs = ttt_forward(m, *args, masks)
        sum((o * torch.linspace(-1, 1, o.shape[-1], device="cuda")).sum() for o in outs).backward()
        grads.append(([o.detach() for o in outs], [p.grad.clone() for p in m.parameters() if p.grad is not None]))
    for a, b_ in zip(grads[0][0] + grads[0][1], grads[1][0] + grads[1][1]):
        torch.testing.assert_close(a, b_, rtol=1e-3, atol=1e-3)  # H100: a few gradient entries differ by ~3e-4
