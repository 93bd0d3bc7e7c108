"""eyas.train.build: the draft's initial lm_head (--train.init_head=target); eyas.ttt: flex rows, attention kernel."""

from __future__ import annotations

import torch

from eyas.train import build
from eyas.ttt import flex_row_length, resolve_attention
from tests.train.runs import tiny_cfg


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


def test_flex_rows_have_one_length():
    assert [flex_row_length(n) for n in (8, 128, 129, 16384)] == [128, 128, 256, 16384]
    assert resolve_attention("auto", torch.device("cpu")) == "sdpa"
    assert resolve_attention("auto", torch.device("cuda")) == "flex"
