"""bench/draft_variants.py: its round-to-nearest quantizers give the values worked out by hand, its
variants' overrides are read only when chosen, and the GSM8K prompts it writes are the test split's
questions as evaluate.bench reads them."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import draft_variants as dv  # noqa: E402


def test_int8_is_symmetric_per_output_row():
    w = torch.tensor([[1.0, -0.5, 0.25, 0.127], [0.0, 2.0, -1.0, 0.0]])
    # row 0: scale 1/127; -63.5 rounds to -64 (half to even), 31.75 -> 32, 16.129 -> 16
    # row 1: scale 2/127; -63.5 -> -64 again
    want = torch.tensor([[127, -64, 32, 16], [0, 127, -64, 0]]) * torch.tensor([[1 / 127], [2 / 127]])
    torch.testing.assert_close(dv.int8_per_channel(w), want)


def test_int4_groups_of_128_with_a_shorter_last_group():
    row = torch.cat([torch.arange(16.0).repeat(8), torch.tensor([-1.0, 0.65, 2.0])])  # 128 + 3 inputs
    got = dv.int4_grouped(row[None])[0]
    assert torch.equal(got[:128], row[:128])  # 0..15: scale 1, zero point 0, exact
    # the last group alone: scale 3/15 = 0.2, zero point 5; 0.65 -> q 3 + 5 -> (8 - 5) * 0.2 = 0.6
    torch.testing.assert_close(got[128:], torch.tensor([-1.0, 0.6, 2.0]))


def test_a_variant_is_resolved_only_when_chosen():
    a = dv.parse(["--variants", "baseline,swa", "--window", "32", "--add", "wd=--train.weight_decay=0.1"])
    got = dv.chosen(a)
    assert list(got) == ["baseline", "swa", "wd"]
    assert dv.overrides(got["swa"], a) == ["--train.sliding_window=32", "--export.format=speculators"]
    assert dv.states_key(dv.VARIANTS["int8"], a) == "int8"
    assert dv.states_key(got["wd"], a) == dv.states_key(got["baseline"], a) == "target"
    with pytest.raises(SystemExit, match="prepare output, target and evaluation are shared"):
        dv.chosen(dv.parse(["--variants", "baseline", "--add", "x=--prepare.max_length=9"]))


@pytest.mark.skipif(importlib.util.find_spec(dv.GSM8K_PACKAGE) is None, reason=f"needs {dv.GSM8K_SPEC} (--no-deps)")
def test_gsm8k_prompts_are_the_test_split_as_evaluate_reads_them(tmp_path):
    from eyas.evaluate.inputs import load_bench

    path = tmp_path / "gsm8k.jsonl"
    assert dv.write_gsm8k(path) == 1319  # GSM8K's test split
    qs = load_bench(str(path), 2)
    assert qs[0]["id"] == "gsm8k-test-0" and len(qs[0]["turns"]) == 1
    assert qs[0]["turns"][0].startswith("Janet\u2019s ducks lay 16 eggs per day.")
    assert qs[1]["turns"][0].startswith("A robe takes 2 bolts of blue fiber")


def test_the_long_set_grows_mtbench_prompts_to_the_context_tokens():
    a = dv.parse(["--sets", "mtbench,long", "--context-tokens", "512", "--mtbench", "7"])
    assert dv.prompt_sets(a, Path("g.jsonl")) == [
        ("mtbench", "mtbench", 7, ()), ("mtbench-ctx512", "mtbench", 7, ("--evaluate.context_tokens=512",))]
    for bad in (["--sets", "long"], ["--context-tokens", "512"], ["--sets", "mtbench,wiki"]):
        with pytest.raises(SystemExit):
            dv.parse(bad)
