"""The extract tests' inputs, built once per session: one prepare output (synthetic chats, the
SmolLM2 tokenizer) and tiny random targets of each architecture saved next to that tokenizer."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.data import run_prepare, write_synthetic_chats
from tests.models import save_tiny


NUM_CHATS = 24


@pytest.fixture(scope="session")
def prep(tmp_path_factory, smollm2_dir) -> Path:
    """One prepare output (SmolLM2 tokenizer) shared by every tiny target: they all carry that tokenizer."""
    root = tmp_path_factory.mktemp("prep")
    chats = write_synthetic_chats(root / "chats.jsonl", NUM_CHATS, max_words=40)
    return run_prepare(root, chats, max_length=128, model=smollm2_dir)


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory, smollm2_dir):
    made: dict[str, Path] = {}

    def get(arch: str) -> Path:
        if arch not in made:
            made[arch] = save_tiny(arch, tmp_path_factory.mktemp(arch), smollm2_dir)
        return made[arch]

    return get


@pytest.fixture(scope="session")
def no_weights(tiny_dirs, tmp_path_factory) -> Path:
    """A target directory with config and tokenizer but no weights: preflight must fail before loading."""
    out = tmp_path_factory.mktemp("noweights")
    for f in tiny_dirs("llama").iterdir():
        if not f.name.endswith(".safetensors"):
            shutil.copy(f, out / f.name)
    return out
