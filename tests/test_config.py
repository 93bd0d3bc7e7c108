"""The config: a key that moved is refused naming where it went."""

from __future__ import annotations

import pytest

from eyas.config import load_config
from eyas.errors import ConfigError


def test_a_moved_key_names_its_new_name():
    with pytest.raises(ConfigError, match="'train.layer_ids' is now extract.layer_ids"):
        load_config(None, ["--train.layer_ids=[1,2,3]"])
    assert load_config(None, ["--extract.layer_ids=[1,2,3]", "--train.mode=online"]).extract.layer_ids == [1, 2, 3]


@pytest.mark.parametrize("arg", ["--train.lr=inf", "--train.lr=.inf", "--train.lr=nan", "--train.lr=-1e-4", "--train.lr=0",
                                 "--train.weight_decay=inf", "--train.weight_decay=nan", "--train.grad_clip=inf",
                                 "--train.warmup_ratio=nan", "--train.step_weight=inf", "--train.max_seconds=inf",
                                 "--train.betas=[0.9,nan]", "--evaluate.temperature=inf", "--regenerate.top_p=nan"])
def test_non_finite_or_non_positive_numbers_are_refused(arg):
    """A learning rate of inf or nan (or <= 0), or any other float knob that is not a finite number,
    is refused when the config is read, naming the key, not steps into training."""
    key = arg[2:].split("=")[0]
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, [arg])


def test_a_float_knob_built_in_code_is_checked_too():
    from eyas.config import TrainConfig

    for name in ("lr", "grad_clip", "weight_decay", "step_weight"):
        with pytest.raises(ConfigError, match=f"train.{name}=inf"):
            TrainConfig(**{name: float("inf")})
    assert TrainConfig(lr=3e-4, grad_clip=0.0).lr == 3e-4
    import typing

    from eyas.config.train import FLOAT_KNOBS

    hints = typing.get_type_hints(TrainConfig)
    assert set(FLOAT_KNOBS) == {k for k, t in hints.items() if t is float}  # a new float knob is checked too


@pytest.mark.parametrize("text, first, second, key", [
    ("train:\n  lr: 1.0e-3\nprepare:\n  max_conversations: 4\ntrain:\n  lr: 1.0e-2\n", 1, 5, "train"),
    ("train:\n  lr: 1.0e-3\n  epochs: 2\n  lr: 1.0e-2\n", 2, 4, "lr"),
])
def test_a_recipe_with_a_key_twice_is_refused_naming_both_lines(tmp_path, text, first, second, key):
    """YAML keeps the last of two equal keys: a second `train:` section would silently replace the
    first. Refused instead, naming file:line of both."""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_config(str(recipe), [])
    msg = str(e.value)
    assert f"{recipe}:{first}" in msg and f"{recipe}:{second}" in msg and repr(key) in msg, msg


def test_a_recipe_with_a_key_twice_exits_2(tmp_path):
    import subprocess
    import sys

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("train:\n  lr: 1.0e-3\ntrain:\n  lr: 1.0e-2\n")
    p = subprocess.run([sys.executable, "-m", "eyas", "config", str(recipe)], capture_output=True, text=True)
    assert p.returncode == 2, p.stdout + p.stderr
    assert f"{recipe}:1" in p.stderr + p.stdout and f"{recipe}:3" in p.stderr + p.stdout


def _alias_bomb(levels: int = 9) -> str:
    """A "billion laughs": each level a list of 9 aliases of the one before (9**levels values)."""
    lines = ["regenerate:", "  extra_body:", '    a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for prev, name in zip("abcdefghij", "bcdefghij"[:levels - 1]):
        lines.append(f"    {name}: &{name} [" + ",".join([f"*{prev}"] * 9) + "]")
    return "\n".join(lines) + "\n"


def test_a_yaml_alias_bomb_is_refused_not_expanded(tmp_path):
    """`eyas config` on a config whose aliases expand to 9**9 values: refused at once, naming the
    file and line, rather than hanging while it prints them."""
    import subprocess
    import sys

    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(_alias_bomb())
    proc = subprocess.run([sys.executable, "-m", "eyas", "config", str(bomb)], capture_output=True, text=True, timeout=60,
                          check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"{bomb}: its aliases (*name) expand the value at line" in proc.stderr and "write the values out" in proc.stderr
    with pytest.raises(ConfigError, match="--regenerate.extra_body: its aliases"):
        flow = _alias_bomb().split("extra_body:\n", 1)[1].strip().replace("\n    ", ", ")
        load_config(None, ["--regenerate.extra_body={" + flow + "}"])


def test_yaml_aliases_at_a_configs_size_still_work(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("regenerate:\n  extra_body: {top_k: &k 20, min_k: *k}\n")
    assert load_config(str(cfg), []).regenerate.extra_body == {"top_k": 20, "min_k": 20}
    assert load_config(None, ["--regenerate.extra_body={a: &a [1, 2], b: *a}"]).regenerate.extra_body == {"a": [1, 2], "b": [1, 2]}


def test_keys_a_merge_brings_in_may_be_set_again_also_through_nested_anchors(tmp_path):
    """`<<: *anchor` keys overridden in a mapping that is itself merged elsewhere: valid YAML, read
    as yaml.safe_load reads it (the duplicate check sees the text as written, not the merged result)."""
    import yaml

    from eyas.config.base import read_yaml

    text = "base: &base {lr: 1, wd: 2}\nx:\n  y: &b\n    <<: *base\n    lr: 3\nz:\n  <<: *b\n  e: 1\n"
    path = tmp_path / "merged.yaml"
    path.write_text(text)
    assert read_yaml(path) == yaml.safe_load(text) == {"base": {"lr": 1, "wd": 2}, "x": {"y": {"lr": 3, "wd": 2}},
                                                       "z": {"lr": 3, "wd": 2, "e": 1}}
