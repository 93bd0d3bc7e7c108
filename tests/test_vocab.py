"""eyas.vocab: the draft vocabulary (selection, d2t/t2d, both directions) on hand-computed
examples, and the moves between vocabularies (remap_head, with_vocab)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from eyas import vocab
from eyas.draft import Eagle3Draft
from eyas.errors import ArtifactError


# ---- draft vocabulary -------------------------------------------------------------------------


def test_vocab_hand_computed():
    # V = 8; loss-masked tokens: 5 x3, 2 x2, 7 x2, 1 x1; token 3 appears only unmasked.
    ids = np.array([5, 5, 2, 3, 7, 5, 2, 7, 1, 3])
    mask = np.array([1, 1, 1, 0, 1, 1, 1, 1, 1, 0])
    counts = vocab.token_counts(ids, mask, 8)
    assert counts.tolist() == [0, 1, 2, 0, 0, 3, 0, 2]
    sel = vocab.select_draft_tokens(counts, 3)  # 5 (3), then 2 and 7 (2 each; tie -> smaller id first)
    assert sel.tolist() == [2, 5, 7]
    d2t, t2d = vocab.d2t_t2d(sel, 8)
    assert d2t.tolist() == [2, 4, 5]  # target = draft + d2t[draft]: 0->2, 1->5, 2->7
    assert t2d.tolist() == [False, False, True, False, False, True, False, True]
    assert vocab.draft_rows(d2t, 8).tolist() == [-1, -1, 0, -1, -1, 1, -1, 2]
    # a W == V draft whose rows are a permutation: draft 0 holds target 3, 1 -> 0, 2 -> 2, 3 -> 1
    assert vocab.draft_rows(torch.tensor([3, -1, 0, -2]), 4).tolist() == [1, 3, 2, 0]
    assert vocab.coverage(counts, sel) == pytest.approx(7 / 8)
    # ties broken by id: k=2 takes 5 and then 2 (not 7)
    assert vocab.select_draft_tokens(counts, 2).tolist() == [2, 5]


def test_vocab_round_trip():
    g = torch.Generator().manual_seed(0)
    v = 1000
    counts = torch.randint(0, 50, (v,), generator=g).numpy()
    sel = vocab.select_draft_tokens(counts, 300)
    d2t, t2d = vocab.d2t_t2d(sel, v)
    draft = torch.arange(300)
    target = vocab.draft_to_target(draft, d2t)
    assert torch.equal(target, torch.as_tensor(sel))
    assert torch.equal(vocab.target_to_draft(target, t2d), draft)
    outside = torch.nonzero(~t2d).flatten()
    assert (vocab.target_to_draft(outside, t2d) == -1).all()


# ---- a trained draft moved to another vocabulary ------------------------------------------------


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
