"""The store's size in stream mode: the message a streamed run stops with when a sample is past
train.stream.max_attempts (eyas/stream/source.py `gave_up`): a store that refused the engine's puts
for want of room (Mooncake's status -200, as hs-connectors words it) is named as full, with the
flags to change; a store smaller than Mooncake takes is refused as a setting."""

from __future__ import annotations

import pytest

from eyas.config.stream import StreamConfig
from eyas.errors import ConfigError
from eyas.stream.source import gave_up

FULL = ("object s3_e0_a2: MooncakeIntegrityError: Mooncake producer error for key=eyas-s3_e0_a2:error: "
        "Mooncake put failed for key=eyas-s3_e0_a2 with status=-200")


def test_a_full_store_is_named_with_the_flags_to_change():
    sc = StreamConfig(store_gb=0.017, window_gb=1.0, max_attempts=3)
    text = gave_up("chat-7", 3, 3, ["object s3_e0_a1 did not reach the store within 10 s", FULL, FULL], sc, 10**9)
    assert text.startswith("sample 'chat-7' (prepare index 3) failed 3 times (train.stream.max_attempts=3): ")
    assert "Mooncake's store is full" in text
    assert "raise train.stream.store_gb (now 0.017 GB per engine)" in text
    assert "lower train.stream.window_gb (now 1 GB per rank)" in text


def test_other_failures_say_only_what_failed():
    sc = StreamConfig(max_attempts=2)
    errors = ["engine engine-0 failed: RayActorError: died", "object k did not reach the store within 300 s"]
    text = gave_up("chat-1", 1, 2, errors, sc, 4 * 10**9)
    assert text.endswith(" | ".join(errors)) and "store_gb" not in text
    # status -2000 or -20 is not -200
    assert "store_gb" not in gave_up("c", 0, 2, ["put failed with status=-2000", "status=-20"], sc, 1)


def test_a_store_smaller_than_mooncake_takes_is_refused_naming_the_flag():
    """Mooncake's store refuses a segment under 16 MiB (setup status -600), which stopped the engine at
    its first put with vLLM's EngineDeadError: the setting is refused before anything starts."""
    with pytest.raises(ConfigError, match=r"train.stream.store_gb=0.016 is below the smallest store Mooncake takes"):
        StreamConfig(store_gb=0.016)
    assert StreamConfig(store_gb=0.0168).store_gb == 0.0168  # 16.8e6 bytes >= 16 MiB
