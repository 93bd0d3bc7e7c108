"""The embedded assets (eyas/assets.py): the MT-bench questions, and the SmolLM2 directory as scripts use it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def test_smollm2_dir_prints_only_the_path_on_stdout_when_it_converts(tmp_path):
    """Scripts read the directory as `$(python -c "...print(smollm2_dir())")`: the one-time conversion's line on a fresh machine must not reach stdout, or the path read
    begins with it. The line belongs on stderr."""
    env = {**os.environ, "EYAS_CACHE_DIR": str(tmp_path / "cache")}
    code = "from eyas import assets; print(assets.smollm2_dir())"
    first = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert "converting" in first.stderr
    out = Path(first.stdout.strip())
    assert first.stdout.count("\n") == 1 and out.parent == tmp_path / "cache"
    assert json.loads((out / "config.json").read_text())["model_type"] == "llama"
    again = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert again.stdout == first.stdout and "converting" not in again.stderr


def test_mtbench_loader():
    from eyas import assets

    qs = assets.load_mtbench()
    assert len(qs) == 80 and all(len(q["turns"]) == 2 for q in qs)
    assert qs[0]["question_id"] == 81


def test_embedded_smollm2_resolves_in_the_vllm_venv_from_the_cached_conversion(tmp_path, smollm2_dir):
    """`embedded:smollm2` in the vLLM venv (scripts/vllm-venv.sh installs the package and gguf there,
    for the demo recipe) is the copy another environment converted into the same cache: found, not
    converted again."""
    import pytest

    from eyas.assets import cache_dir
    from tests.vllm_serving import vllm_env, vllm_python

    if vllm_python() is None:
        pytest.skip("no vLLM venv: run scripts/vllm-venv.sh (or set EYAS_VLLM_VENV)")
    code = "from eyas.assets import resolve_model; print(resolve_model('embedded:smollm2'))"
    res = subprocess.run([str(vllm_python()), "-c", code], env=vllm_env(EYAS_CACHE_DIR=str(cache_dir())),
                         capture_output=True, text=True, check=False)
    assert res.returncode == 0 and Path(res.stdout.strip()) == Path(smollm2_dir), res.stderr[-2000:]
    assert "converting" not in res.stderr
