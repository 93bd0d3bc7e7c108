"""eyas.extract.store: shards spilled to another filesystem when the output one is full, the spill
directory's cleaning, the shard placer's accounting."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch

from eyas import HiddenStates
from eyas.config import load_config
from eyas.errors import ArtifactError, ConfigError
from eyas.prepared import Prepared
from tests.extract.runs import check_against_capture, overrides, run_extract


def test_spill_dirs_take_the_shards_that_do_not_fit(tmp_path, prep, tiny_dirs, shm_dir, capsys, monkeypatch):
    """The output directory on a tmpfs with room for about a third of the shards, a spill directory
    on the disk: the first shards stay in the tmpfs, the rest go to the disk (listed by absolute
    path), and every sample reads back as a plain forward computes it. Another rank's leftover in
    the spill directory is removed first; a complete re-run keeps every shard; the spill directory
    refuses a second output directory and the output directory itself; `eyas run` keys extract
    without the spill settings, so changing them (as the no-room error advises) resumes instead of
    starting over. The tmpfs's free space is made to run out (shutil.disk_usage reports a capacity
    less what its shards/ holds) so that nothing else writing to /dev/shm moves the boundary; the
    bytes are written to the real tmpfs and disk."""
    model, out, spill = tiny_dirs("llama"), shm_dir / "extract", tmp_path / "spill"
    p = Prepared(prep)
    row = 4 * 64 * 4 + 5  # 3 aux layers + final, D=64, float32; int32 id, uint8 mask
    base = ["--extract.token_budget=128", "--extract.shard_bytes=1", f"--extract.out_dir={out}",  # a batch per shard
            f"--extract.spill_dirs=[{spill}]"]
    assert run_extract(tmp_path, prep, model, *base, "--extract.max_samples=4") == 0  # the tmpfs has room
    first = HiddenStates(out)
    assert all(not Path(s).is_absolute() for s in first.shards) and (spill / "eyas-spill.json").is_file()

    def used() -> int:
        return sum(f.stat().st_size for f in (out / "shards").iterdir())

    from eyas.extract import store

    cap = used() + store.OUT_RESERVE + int(p.offsets[-1] - p.offsets[4]) * row // 3
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda d: shutil._ntuple_diskusage(cap, used(), cap - used())
                        if Path(d).resolve() == out.resolve() else real(d))
    (spill / "shards").mkdir(exist_ok=True)
    (spill / "shards" / "r001-00007.safetensors").write_bytes(b"another rank's, left by a kill")
    assert run_extract(tmp_path, prep, model, *base) == 0
    printed = capsys.readouterr().out
    assert f"removed 1 shard file(s) no journal lists from {spill.resolve()}" in printed, printed
    assert re.search(rf"spilled +\d+ of the shards, [\d.]+ GB, to {re.escape(str(spill.resolve()))}\n", printed), printed
    assert not (spill / "shards" / "r001-00007.safetensors").exists()
    hs = HiddenStates(out)
    hs.verify()
    in_shm = [s for s in hs.shards if not Path(s).is_absolute()]
    spilled = [s for s in hs.shards if Path(s).is_absolute()]
    assert len(in_shm) >= len(first.shards) + 1 and len(spilled) >= 2, hs.shards
    assert all(Path(s).parent == spill.resolve() / "shards" and Path(s).is_file() for s in spilled)
    assert hs.indices == list(range(len(p)))
    kind = {i: Path(hs.shards[hs._shard[i]]).is_absolute() for i in range(len(p))}
    check_against_capture(hs, model, [next(i for i in kind if not kind[i]), next(i for i in kind if kind[i])])
    assert run_extract(tmp_path, prep, model, *base) == 0  # complete: nothing to do, nothing removed
    assert "removed" not in capsys.readouterr().out
    again = HiddenStates(out)
    assert again.shards == hs.shards and all(Path(s).is_file() for s in spilled)
    again.verify()
    with pytest.raises(ConfigError, match="serves the extract in"):
        run_extract(tmp_path / "other", prep, model, f"--extract.spill_dirs=[{spill}]")
    with pytest.raises(ConfigError, match="output directory itself"):
        run_extract(tmp_path, prep, model, f"--extract.out_dir={out}", f"--extract.spill_dirs=[{out}]")
    from eyas.run.plan import run_keys, stage_plan

    def extract_key(*extra):
        return run_keys(*stage_plan(load_config(None, overrides(tmp_path, prep, model, *extra))))["extract"]

    plain = [a for a in base if "spill_dirs" not in a]
    assert extract_key(*base, "--extract.min_free_gb=3") == extract_key(*plain) != extract_key(*plain, "--extract.shard_bytes=7")


def test_clean_spill_keeps_listed_shards_by_identity_and_refuses_a_moved_spill_directory(tmp_path):
    """A journal that names a spilled shard through a symlinked path keeps it (same file); a shard
    the journal lists at a path that is gone is not deleted from where it is now (ConfigError)."""
    from eyas.extract import store

    out, real = tmp_path / "out", tmp_path / "real"
    (out / "progress").mkdir(parents=True)
    (real / "shards").mkdir(parents=True)
    (tmp_path / "link").symlink_to(real)
    kept = real / "shards" / "r000-00000.safetensors"
    kept.write_bytes(b"x" * 10)
    store.append_journal(out, 0, {"shard": str(tmp_path / "link" / "shards" / kept.name), "bytes": 10, "rank": 0})
    entries = store.read_journals(out)
    assert len(entries) == 1 and store.clean_spill(out, [real.resolve()], entries) == 0 and kept.is_file()
    moved = real / "shards" / "r000-00001.safetensors"
    moved.write_bytes(b"y" * 10)
    store.append_journal(out, 0, {"shard": str(tmp_path / "gone" / "shards" / moved.name), "bytes": 10, "rank": 0})
    with pytest.raises(ConfigError, match="was the spill directory moved"):
        store.clean_spill(out, [real.resolve()], store.read_journals(out))
    assert moved.is_file() and kept.is_file()


def test_shard_placer_counts_the_shards_being_written(tmp_path, shm_dir, monkeypatch):
    """Shards open at once (two writer threads): each sees the others' unwritten bytes as taken, so
    the third goes to the spill directory; with no room anywhere the error names the fix; a closed
    shard's bytes are no longer counted. The output directory (disk) and the spill directory
    (tmpfs) are real filesystems; their free space is set through shutil.disk_usage, because the
    accounting, not the filesystems, is under test."""
    from eyas.extract import store

    out, spill = tmp_path / "out", (shm_dir / "spill").resolve()
    out.mkdir()
    spill.mkdir()
    free = {out: 10**9 + 300_000_000, spill: 10**9 + 150_000_000}
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage",
                        lambda d: shutil._ntuple_diskusage(0, 0, free[Path(d)]) if Path(d) in free else real(d))
    placer = store.ShardPlacer(out, [spill], min_free=10**9, check=True)

    def make(name):
        return store.ShardWriter(out, name, 1, 1000, torch.float32, torch.zeros(25_000, dtype=torch.int32),
                                 torch.zeros(25_000, dtype=torch.uint8))  # 100.1 MB planned

    a = placer.open_shard(0, 0, 25_000, 4000, make)  # out keeps 1 GB: 300 MB of room
    b = placer.open_shard(0, 1, 25_000, 4000, make)  # 200 MB of it left: still out
    c = placer.open_shard(0, 2, 25_000, 4000, make)  # 100 MB left, less than the shard: spill
    assert a.name == "shards/r000-00000.safetensors" == store.shard_name(0, 0) and b.name == store.shard_name(0, 1)
    assert c.name == str(spill / "shards" / "r000-00002.safetensors") and c.path == Path(c.name)
    with pytest.raises(ArtifactError, match=r"no room for shard shards/r000-00003.*extract.spill_dirs.*run the stage again"):
        placer.open_shard(0, 3, 25_000, 4000, make)  # spill's 150 MB of room less c's 100 MB
    for w in (a, c):
        w.abort()
        placer.closed(w)
    d = placer.open_shard(0, 3, 25_000, 4000, make)
    assert d.name == store.shard_name(0, 3)
    for w in (b, d):
        w.abort()
