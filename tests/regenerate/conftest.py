"""The regenerate tests' data file and the real SmolLM2 (fp32) with its tokenizer, loaded once for the
directory."""

from __future__ import annotations

import json

import pytest
import torch

from tests.regenerate.runs import CONVS


@pytest.fixture(scope="package")
def data(tmp_path_factory):
    p = tmp_path_factory.mktemp("data") / "chats.jsonl"
    p.write_text("\n".join(json.dumps(c) for c in CONVS) + "\n")
    return p


@pytest.fixture(scope="package")
def target(smollm2_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(str(smollm2_dir))
