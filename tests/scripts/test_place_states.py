"""scripts/place_states.py decides where an offline run's hidden states go on a machine: the disk,
tmpfs, tmpfs and then the disk, or the first conversations that fit the disk (e.g. ~98 GB of states of
39,115 conversations would leave less memory beside them in tmpfs than the default 40 GB kept free)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

from place_states import GB, place  # noqa: E402

OFFSETS = [0, 10, 30, 60, 100]  # 4 conversations, 100 tokens; at 1 GB per token, 100 GB of states


def test_states_go_to_the_disk_when_they_fit_there_with_the_margin():
    overrides, why = place(OFFSETS, int(GB), disk_free=106 * GB, shm_free=200 * GB, ram_free=200 * GB,
                           margin=6 * GB, keep_ram=40 * GB, shm="/dev/shm")
    assert overrides == [] and "fit the disk" in why


def test_states_go_to_tmpfs_only_when_the_memory_to_keep_stays_free():
    args = dict(disk_free=105 * GB, shm_free=137 * GB, margin=6 * GB, shm="/dev/shm")
    overrides, _ = place(OFFSETS, int(GB), ram_free=140 * GB, keep_ram=40 * GB, **args)
    assert overrides == ["--extract.out_dir=/dev/shm/eyas-extract"]
    # 134 - 100 = 34 GB left: not with 40 kept free (the default), yes with 24
    overrides, why = place(OFFSETS, int(GB), ram_free=134 * GB, keep_ram=40 * GB, **args)
    assert overrides == ["--prepare.max_conversations=3"], why  # 60 tokens fit 105 - 6 GB, 100 do not
    assert "the last 1 are left out of training" in why and "--keep-ram-gb" in why
    overrides, _ = place(OFFSETS, int(GB), ram_free=134 * GB, keep_ram=24 * GB, **args)
    assert overrides == ["--extract.out_dir=/dev/shm/eyas-extract"]


def test_no_room_for_even_the_first_conversation_is_an_error():
    with pytest.raises(SystemExit, match="no room"):
        place(OFFSETS, int(GB), disk_free=15 * GB, shm_free=0.0, ram_free=200 * GB, margin=6 * GB,
              keep_ram=40 * GB, shm="/dev/shm")


def test_tmpfs_then_the_disk_when_neither_holds_the_states_alone():
    """~113 GB of states, 137 GB of tmpfs, 134 GB of memory, 68.7 GB of disk.
    One min_free for both filesystems: what the tmpfs must keep for memory (137 - (134 - 30))."""
    offsets = [0, 30, 60, 90, 113]
    args = dict(disk_free=68.7 * GB, shm_free=137 * GB, ram_free=134 * GB, margin=6 * GB, keep_ram=30 * GB,
                shm="/dev/shm")
    overrides, why = place(offsets, int(GB), disk="/data/run", **args)
    assert overrides == ["--extract.out_dir=/dev/shm/eyas-extract", "--extract.spill_dirs=[/data/run/eyas-spill]",
                         "--extract.min_free_gb=33.0"], why
    # 104 GB in the tmpfs + 35.7 on the disk: 139.7 GB (less 2 GB for shards placed whole) hold 113,
    # not 141: the first 3 conversations, and those 90 GB fit the tmpfs alone
    overrides, why = place([0, 30, 60, 90, 141], int(GB), disk="/data/run", **args)
    assert overrides == ["--extract.out_dir=/dev/shm/eyas-extract", "--prepare.max_conversations=3"], why
    overrides, why = place([0, 30, 60, 100, 120, 141], int(GB), disk="/data/run", **args)
    assert overrides == ["--extract.out_dir=/dev/shm/eyas-extract", "--extract.spill_dirs=[/data/run/eyas-spill]",
                         "--extract.min_free_gb=33.0", "--prepare.max_conversations=4"], why
    assert "the last 1 are left out" in why
    # without a spill directory: the first conversations that fit the disk or the tmpfs alone
    overrides, why = place(offsets, int(GB), **args)
    assert overrides == ["--extract.out_dir=/dev/shm/eyas-extract", "--prepare.max_conversations=3"], why
    assert "or --spill" in why
    # little memory: the tmpfs keeps so much free that the disk (one min_free for both) takes
    # nothing beside it; the fallback still keeps what the disk alone holds (60 GB: 2 conversations)
    for ram in (50, 80):
        overrides, why = place(offsets, int(GB), disk="/data/run", **{**args, "ram_free": ram * GB})
        assert overrides == ["--prepare.max_conversations=2"] and "fit the disk" in why, (ram, why)
