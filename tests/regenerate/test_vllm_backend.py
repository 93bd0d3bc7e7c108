"""regenerate.backend=vllm (eyas/regenerate/vllm_backend.py) on vLLM's CPU build, in the vLLM venv:
`eyas run` with extract.backend=vllm regenerates the real SmolLM2's answers (float32, greedy) and
extracts their hidden states with one engine load. The answers equal an independent batch-1 greedy
transformers `generate`, turn by turn; extraction passes its parity check on the same engine."""

from __future__ import annotations

import re

from tests.evaluate.test_vllm import eyas_cli
from tests.extract.test_vllm_backend import needs_vllm
from tests.regenerate.runs import CONVS, NEW, read, reference
from tests.vllm_serving import vllm_python


@needs_vllm
def test_regenerate_and_extract_in_one_vllm_engine(tmp_path, data, target, smollm2_dir):
    model, tok = target
    run = tmp_path / "run"
    res = eyas_cli(vllm_python(), [
        "run", f"--run_dir={run}", f"--target.model={smollm2_dir}", "--target.dtype=float32", f"--prepare.data={data}",
        "--regenerate.enabled=true", "--regenerate.backend=vllm", f"--regenerate.max_new_tokens={NEW}",
        "--prepare.draft_vocab_size=100", "--extract.backend=vllm", "--extract.vllm_parity=3", "--stop_after=extract",
    ], tmp_path / "run.log")
    log = (tmp_path / "run.log").read_text()
    assert res.returncode == 0, log[-4000:]
    assert log.count("starting the engine") == 1, log[-4000:]  # regenerate's; extract takes it
    assert "serves extraction too (no second load)" in log
    recs = read(run / "regenerate" / "conversations.jsonl")
    assert [r["id"] for r in recs] == [c["id"] for c in CONVS]
    for rec, conv in zip(recs, CONVS):
        assert rec["messages"] == reference(model, tok, conv)
    assert re.search(r"parity +3 samples vs a plain forward, max relative error [0-9.e-]+", log), log[-3000:]
    assert not (run / "vllm-scratch-extract").exists()  # the request files (regenerate's and extract's) are gone
