"""Every shipped recipe loads, validates, and starts with the exact command that runs it."""

from pathlib import Path

import pytest

from eyas.config import load_config

RECIPES = sorted((Path(__file__).parent.parent / "recipes").glob("*.yaml"))


@pytest.mark.parametrize("path", RECIPES, ids=[p.name for p in RECIPES])
def test_recipe_loads(path):
    head = path.read_text().splitlines()[:4]
    assert head[0].startswith("#") and any("eyas " in line or "make " in line for line in head), head
    load_config(path)


def test_there_are_recipes():
    assert RECIPES


def test_the_cpu_sized_recipe_command_in_the_docs_is_the_one_the_tests_run():
    """docs/vllm.md gives the 8-GPU recipe's command on 2 CPU cores; tests/test_deepseek_v3.py runs
    the recipe with these overrides (tests/vllm_serving.py CPU_SIZED): the same flags, none missing."""
    import re

    from tests.vllm_serving import CPU_SIZED

    docs = (Path(__file__).resolve().parents[1] / "docs" / "vllm.md").read_text()
    block = next(b for b in re.findall(r"```bash\n(.*?)```", docs, re.S) if "eyas run recipes/deepseek-v3-8gpu.yaml" in b)
    flags = set(re.findall(r"--[\w.]+=\S+", block))
    assert set(CPU_SIZED) <= flags, set(CPU_SIZED) - flags
    assert "--extract.layer_ids=[1,2,3]" in flags and "--nproc-per-node 2" in block
