"""Where an offline run's hidden states fit on this machine, decided from prepare's token count
before the first extract: prints the eyas overrides to add (nothing when the run directory's disk
holds them). SmolLM2-135M's states, for example, take 4 x 576 x 2 + 5 = 4,613 bytes per token, so
10.8M tokens need 49.9 GB. Run it after prepare, before extract.

    python scripts/place_states.py RUN/prepare --bytes-per-token 4613 --disk RUN --shm /dev/shm --spill

Inputs: prepare's output directory (its token offsets), the bytes one token's states take, the run
directory's disk and a tmpfs; free space and /proc/meminfo's MemAvailable are measured now.
Output (stdout): the overrides, one line; why they were chosen goes to stderr. In order:

- the run directory's disk when the states fit there with --margin-gb to spare: nothing to add;
- else tmpfs (--shm) when they fit there and leave --keep-ram-gb of memory for the training job:
  --extract.out_dir=SHM/eyas-extract;
- else, with --spill, tmpfs first and the disk after it when the two hold them together (the tmpfs
  no fuller than --keep-ram-gb of memory allows, the disk keeping --margin-gb):
  --extract.out_dir=SHM/eyas-extract --extract.spill_dirs=[DISK/eyas-spill] --extract.min_free_gb=G,
  one G for both filesystems, the larger of what each must keep free;
- else as many of the first conversations as fit one of those ways (the most for which one
  does), counted from prepare's token offsets (--prepare.max_conversations=N beside that way's
  overrides; extract checks the space itself before it writes anything).

Free space is measured as it is now: remove the states of an earlier run first, or they count
against the new one.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from eyas.prepared import Prepared

GB = 1e9
SHARD = 1e9  # extract.shard_bytes' default: shards are placed whole


def mem_available() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return float(line.split()[1]) * 1024
    raise RuntimeError("/proc/meminfo has no MemAvailable line")


def fits(need: float, bytes_per_token: int, disk_free: float, shm_free: float, ram_free: float, margin: float,
         keep_ram: float, shm: str, disk: str) -> tuple[list[str], str] | None:
    """Where `need` bytes of states go whole: (overrides, where), or None when nowhere."""
    if need + margin <= disk_free:
        return [], f"fit the disk ({disk_free / GB:.1f} GB free)"
    if need + margin <= shm_free and ram_free - need >= keep_ram:
        return [f"--extract.out_dir={shm}/eyas-extract"], (
            f"not on the disk ({disk_free / GB:.1f} GB free): into {shm} ({shm_free / GB:.1f} GB free, "
            f"{ram_free / GB:.1f} GB of memory available)")
    if not disk or shm_free <= 0:
        return None
    # tmpfs, then the disk: extract keeps one min_free on each filesystem, so the tmpfs keeps what
    # the memory needs (its free space less the room memory allows) and the disk at least the margin
    shm_room = max(0.0, min(shm_free - margin, ram_free - keep_ram))
    min_free = max(shm_free - shm_room, margin)
    both = max(0.0, shm_free - min_free) + max(0.0, disk_free - min_free)
    if need + 2 * SHARD > both:  # a shard that does not fit the tmpfs's rest goes to the disk whole
        return None
    return [f"--extract.out_dir={shm}/eyas-extract", f"--extract.spill_dirs=[{disk}/eyas-spill]",
            f"--extract.min_free_gb={min_free / GB:.1f}"], (
        f"into {shm} ({shm_free / GB:.1f} GB free, {ram_free / GB:.1f} GB of memory available, {keep_ram / GB:.0f} GB "
        f"of it to keep free), the rest to {disk}/eyas-spill ({disk_free / GB:.1f} GB free); {min_free / GB:.1f} GB "
        "kept free on each")


def place(offsets: list[int], bytes_per_token: int, disk_free: float, shm_free: float,
          ram_free: float, margin: float, keep_ram: float, shm: str, disk: str = "") -> tuple[list[str], str]:
    """offsets: prepare's cumulative token counts (conversation i holds offsets[i]..offsets[i+1]);
    disk: the run directory (the spill directory goes in it; empty = no spilling); -> (overrides, why)."""
    room = (bytes_per_token, disk_free, shm_free, ram_free, margin, keep_ram, shm, disk)
    conversations, need = len(offsets) - 1, offsets[-1] * bytes_per_token
    whole = fits(need, *room)
    if whole is not None:
        return whole[0], f"{need / GB:.1f} GB of states: {whole[1]}"
    # the most first conversations that fit somewhere (fits() holds for every shorter prefix too);
    # max_conversations counts records, of which prepare may drop some, so the first `fit` records
    # hold no more tokens than that
    lo, hi = 0, conversations  # fits(offsets[lo]) (0 tokens fit), not fits(offsets[hi])
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(offsets[mid] * bytes_per_token, *room) is not None else (lo, mid)
    if lo < 1:
        raise SystemExit(f"no room for any hidden states: {disk_free / GB:.1f} GB free on the disk, "
                         f"{shm_free / GB:.1f} GB in {shm}")
    overrides, where = fits(offsets[lo] * bytes_per_token, *room)
    return [*overrides, f"--prepare.max_conversations={lo}"], (
        f"{need / GB:.1f} GB of states fit nowhere ({disk_free / GB:.1f} GB free on the disk, {shm_free / GB:.1f} GB in "
        f"{shm}, {ram_free / GB:.1f} GB of memory, {keep_ram / GB:.0f} GB of it to keep free): the first {lo} of "
        f"{conversations} conversations, {offsets[lo] * bytes_per_token / GB:.1f} GB, {where}; the last "
        f"{conversations - lo} are left out of training (to keep them: a smaller --keep-ram-gb, or --train.mode=online"
        + (")" if disk else "; or --spill, the tmpfs and the disk together)"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("prepare_dir", help="RUN/prepare")
    ap.add_argument("--bytes-per-token", type=int, required=True,
                    help="as extract's disk check counts: (aux layers + 1) x hidden x dtype bytes + 5 (ids, mask)")
    ap.add_argument("--disk", required=True, help="the run directory (or a directory on its disk)")
    ap.add_argument("--shm", default="/dev/shm", help="a tmpfs the states may go to (default: %(default)s)")
    ap.add_argument("--margin-gb", type=float, default=6.0,
                    help="GB each filesystem keeps free beside the states (default: %(default)s)")
    ap.add_argument("--keep-ram-gb", type=float, default=40.0,
                    help="GB of memory the tmpfs leaves to the training job (default: %(default)s)")
    ap.add_argument("--spill", action="store_true",
                    help="when tmpfs alone is too small, the tmpfs first and --disk after it (extract.spill_dirs)")
    a = ap.parse_args(argv)
    offsets = Prepared(a.prepare_dir).offsets.tolist()
    shm_free = shutil.disk_usage(a.shm).free if Path(a.shm).is_dir() else 0.0
    overrides, why = place(offsets, a.bytes_per_token, shutil.disk_usage(a.disk).free, shm_free, mem_available(),
                           a.margin_gb * GB, a.keep_ram_gb * GB, a.shm, str(Path(a.disk).resolve()) if a.spill else "")
    print(f"[place_states] {why}", file=sys.stderr)
    print(" ".join(overrides))
    return 0


if __name__ == "__main__":
    sys.exit(main())
