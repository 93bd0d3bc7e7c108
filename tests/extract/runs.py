"""Shared by the extract tests: the stage's flags, one run in this process, and the check of stored
states against a fresh batch-1 capture of the same samples."""

from __future__ import annotations

from pathlib import Path

import torch

from eyas import HiddenStates, extract
from eyas.capture import capture
from eyas.config import load_config
from eyas.extract.backend import relative_error


def overrides(out: Path, prep: Path, model: Path | str, *extra: str) -> list[str]:
    return [f"--run_dir={out}", f"--prepare.out_dir={prep}", f"--target.model={model}",
            "--extract.token_budget=512", "--extract.progress=false", *extra]


def run_extract(out: Path, prep: Path, model, *extra: str) -> int:
    return extract.main(load_config(None, overrides(out, prep, model, *extra)))


def check_against_capture(hs: HiddenStates, model_dir: Path, samples: list[int], tol: float = 1e-5) -> None:
    """Stored states == a fresh fp32 batch-1 capture of the same sample (relative error per token <= tol)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    for i in samples:
        s = hs[i]
        aux_BSKD, final_BSD = capture(model, s["input_ids"].view(1, -1), layer_ids=hs.layer_ids)
        assert s["aux"].shape == aux_BSKD[0].shape and s["final"].shape == final_BSD[0].shape
        assert float(relative_error(s["aux"], aux_BSKD[0]).max()) <= tol, f"sample {i}: aux"
        assert float(relative_error(s["final"][:, None], final_BSD[0][:, None]).max()) <= tol, f"sample {i}: final"
