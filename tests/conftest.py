"""Shared fixtures. Stage-specific helpers live beside their tests (tests/<stage>_helpers.py)."""

from __future__ import annotations

import os

import pytest
import torch

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(scope="session")
def smollm2_dir():
    """The real SmolLM2-135M-Instruct as a bf16 safetensors HF directory (converted once, cached)."""
    from eyas.assets import smollm2_dir as _dir

    return _dir()


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_dir))
