"""The evaluate tests' tiny run, built once for the directory."""

from __future__ import annotations

import json

import pytest

from tests.models import random_draft, tiny_llama


@pytest.fixture(scope="package")
def tiny_run(tmp_path_factory, smollm2_dir):
    """A tiny random Llama with SmolLM2's vocabulary, tokenizer and chat template, saved as an HF
    directory, and a random Eagle3Draft saved in eyas's own format where the trainer puts it."""
    from transformers import AutoTokenizer

    from eyas.draft_files import save_draft

    root = tmp_path_factory.mktemp("eval")
    tok = AutoTokenizer.from_pretrained(str(smollm2_dir))
    target = tiny_llama(vocab=len(tok), hidden=32, layers=4, seed=0)
    target.save_pretrained(str(root / "target"))
    tok.save_pretrained(str(root / "target"))
    draft = random_draft(target, aux_layer_ids=(0, 2, 3), draft_tokens=list(range(512)), seed=0)
    save_draft(draft, root / "run" / "train" / "final")
    bench = root / "bench.jsonl"
    bench.write_text(json.dumps({"turns": ["Hi there!", "And again?"]}) + "\n" + json.dumps("Name a colour.") + "\n")
    return root, draft
