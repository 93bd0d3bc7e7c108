"""eyas.evaluate.report: pooling the results (tau, histograms, speedup, divergences and their verdicts)."""

from __future__ import annotations

import pytest

from eyas.evaluate.report import collect_results
from eyas.spec import Generation, SpecStats


def _gen(tokens, passes_accepted):
    stats = SpecStats()
    for n in passes_accepted:
        stats.add_pass(n, n + 1)
    stats.wall_s = 1.0
    return Generation(tokens, 1.0, stats)


def test_collect_results_pools_tau_and_reports_divergence():
    base = [{"id": "q", "turn": 0, "prompt_tokens": 5, "gen": Generation([1, 2, 3, 4, 5, 6, 7], 2.0)},
            {"id": "q", "turn": 1, "prompt_tokens": 9, "gen": Generation([8, 9, 10], 1.0)}]  # fmt: skip
    chain = [{**base[0], "gen": _gen([1, 2, 3, 4, 5, 6, 7], [5])},  # 1 pass, 6 tokens (+1 from prefill)
             {**base[1], "gen": _gen([8, 9, 11], [0, 0])}]  # 2 passes, 2 tokens; diverges at #2  # fmt: skip
    r = collect_results(base, {"chain": chain}, check=True)
    assert r["tau_chain"] == r["tau"] == 8 / 3  # pooled (6 + 2) / 3, not the mean of 6 and 1
    assert r["accept_length_histogram"] == [2, 0, 0, 0, 0, 1]
    assert r["lossless"] is False and r["num_divergent"] == 1
    div = {"mode": "chain", "id": "q", "turn": 1, "position": 2, "speculative": 11, "target_only": 10, "near_tie": False}
    assert r["first_divergence"] == r["first_unexplained_divergence"] == div
    assert r["lossless_up_to_ties"] is False and r["num_divergent_near_tie"] == 0
    assert r["speedup"] == pytest.approx((10 / 2.0) / (10 / 3.0))
    assert r["records"][0]["chain"]["lossless"] and not r["records"][1]["chain"]["lossless"]
    seen = []
    r = collect_results(base, {"chain": chain}, check=True, score=lambda b, ref, d: seen.append((b["turn"], ref, d["position"])) or {"near_tie": True})
    assert seen == [(1, [8, 9, 10], 2)]  # scored against the baseline run of the same prompt
    assert r["lossless"] is False and r["lossless_up_to_ties"] is True and r["num_divergent_near_tie"] == 1
    assert r["first_unexplained_divergence"] is None
    r = collect_results(None, {"chain": chain}, check=False)
    assert r["lossless"] is None and r["speedup"] is None and r["target_only_wall_s"] is None


def test_a_later_turn_after_a_differing_answer_inherits_its_verdict():
    """Turn 2 is rendered with each decoder's own turn-1 answer: after a difference the prompts
    differ, so turn 2 is not scored against the baseline's; it takes turn 1's verdict."""
    base = [{"id": "q", "turn": 0, "prompt_tokens": 3, "prompt_ids": [1, 2, 3], "gen": Generation([4, 5, 6], 1.0)},
            {"id": "q", "turn": 1, "prompt_tokens": 7, "prompt_ids": [1, 2, 3, 4, 5, 6, 9], "gen": Generation([7, 8], 1.0)}]
    spec = [{**base[0], "gen": _gen([4, 6, 6], [2])},
            {**base[1], "prompt_ids": [1, 2, 3, 4, 6, 6, 9], "gen": _gen([8, 8], [1])}]  # fmt: skip
    for tie in (True, False):
        scored = []
        r = collect_results(base, {"chain": spec}, check=True,
                            score=lambda b, ref, d: scored.append(b["turn"]) or {"near_tie": tie})
        assert scored == [0]  # turn 1 (index 1) is not scored against another prompt
        second = r["records"][1]["chain"]["first_divergence"]
        assert second["inherited"] and second["near_tie"] is tie
        assert (r["num_divergent"], r["num_divergent_inherited"], r["lossless_up_to_ties"]) == (2, 1, tie)
