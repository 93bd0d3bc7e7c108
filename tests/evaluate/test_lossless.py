"""eyas.evaluate.lossless: the first divergence, the near-tie tolerance and the plain-forward score of
a divergence."""

from __future__ import annotations

import pytest
import torch

from eyas.evaluate.lossless import first_divergence, score_divergence, tie_scale
from tests.models import tiny_llama


def test_first_divergence():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 5, 3], [1, 2, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2


@pytest.mark.parametrize("dtype,rel", [(torch.bfloat16, 2**-6), (torch.float16, 2**-9)])
def test_default_tie_tolerance_is_four_units_in_the_last_place(dtype, rel):
    """By dtype, a near-tie is four representable steps of that dtype wherever the logit lies in its
    binade: 5.5625 vs 5.6875 in bf16 (H200, SmolLM2, MT-bench question 128; float32
    decoding of that question is exact) is a tie, one step more is not."""
    for x in (1.0, 1.5, 3.99, 4.0, 5.6875, 7.9, 28.5, 100.0):
        xd = torch.tensor(x, dtype=dtype)
        up = torch.nextafter(xd, torch.tensor(1e4, dtype=dtype))
        ulp = float(up - xd)
        assert rel * tie_scale(float(xd), float(xd) - 4 * ulp) == 4 * ulp, (x, ulp)
    assert 0.125 <= 2**-6 * tie_scale(5.6875, 5.5625) < 0.125 + 2**-5


def test_score_divergence_reads_the_target_at_the_diverging_position():
    """The two tokens are scored by a plain forward at the first differing position: compared with
    one forward of the whole baseline sequence, the near-tie verdict flips exactly at the gap."""
    model = tiny_llama(vocab=300, hidden=32, layers=2, seed=3)
    g = torch.Generator().manual_seed(0)
    prompt, ref = torch.randint(0, 300, (7,), generator=g).tolist(), torch.randint(0, 300, (9,), generator=g).tolist()
    with torch.no_grad():
        full_SV = model(input_ids=torch.tensor([prompt + ref])).logits[0].float()
    both_wrong_checked = 0
    for pos in (0, 2, 4, 6, 8):
        row_V = full_SV[len(prompt) + pos - 1]  # the logits that choose new token #pos
        top2 = row_V.topk(2)
        first, second = int(top2.indices[0]), int(top2.indices[1])
        gap = float(top2.values[0] - top2.values[1])
        scale = tie_scale(float(top2.values[0]), float(top2.values[1]))
        diff = {"position": pos, "target_only": first, "speculative": second}
        near = score_divergence(model, prompt, ref, diff, rel_tol=1.01 * gap / scale)
        assert near["near_tie"] and near["plain_forward_top1"] == first
        assert near["logit_target_only"] == pytest.approx(float(row_V[first]), abs=1e-5)
        assert near["logit_gap"] == pytest.approx(gap, abs=1e-5)
        assert not score_divergence(model, prompt, ref, diff, rel_tol=0.99 * gap / scale)["near_tie"]
        far = {**diff, "speculative": int(row_V.argmin())}
        assert not score_divergence(model, prompt, ref, far, rel_tol=1.01 * gap / scale)["near_tie"]
        # the 2nd and 3rd tokens tied, the top one well above both: both decoders missed it
        third = int(row_V.topk(3).indices[2])
        gap23 = float(row_V[second] - row_V[third])
        if gap23 < gap:
            both_wrong = {"position": pos, "target_only": second, "speculative": third}
            assert not score_divergence(model, prompt, ref, both_wrong, rel_tol=1.01 * gap23 / scale)["near_tie"]
            both_wrong_checked += 1
    assert both_wrong_checked
    assert score_divergence(model, prompt, ref, {"position": 9, "target_only": None, "speculative": 5}, 1.0) == {"near_tie": False}
