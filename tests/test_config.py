"""The config: a key that moved is refused naming where it went."""

from __future__ import annotations

import pytest

from eyas.config import load_config
from eyas.errors import ConfigError


def test_a_moved_key_names_its_new_name():
    with pytest.raises(ConfigError, match="'train.layer_ids' is now extract.layer_ids"):
        load_config(None, ["--train.layer_ids=[1,2,3]"])
    assert load_config(None, ["--extract.layer_ids=[1,2,3]", "--train.mode=online"]).extract.layer_ids == [1, 2, 3]
