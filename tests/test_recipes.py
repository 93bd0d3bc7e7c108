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
