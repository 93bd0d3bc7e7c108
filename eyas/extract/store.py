"""On-disk layout of an extract output: streamed safetensors shards, per-rank journals, the index.

    shards/r000-00000.safetensors   states [T, K+1, D] (K aux layers, then the final-norm state),
                                    input_ids int32 [T], loss_mask uint8 [T]; samples back to back;
                                    float8 states (extract.store_dtype=float8) also scales float32
                                    [T, 2]: x = states * scale, column 0 for aux, 1 for final
    progress/r000.jsonl             journal of rank 0: one line per complete shard (name, sha256,
                                    bytes, samples, lengths, failed samples), appended after the rename
    progress/run.json               what the states depend on (target, layers, dtype, prepare hashes)
    index.json, meta.json           written by rank 0 once every rank is done (meta.json last)

With extract.spill_dirs a shard may go to SPILL/shards/ instead (`ShardPlacer`: the first
directory whose filesystem keeps extract.min_free_gb free beside it); journals, index and meta
stay in the output directory and name such a shard by its absolute path (`out / name` is then
that path), SPILL/eyas-spill.json names the output directory the spill directory serves.

A shard is written to a temp file and renamed when whole, then listed in the journal; on resume a
shard counts only when listed *and* present with the listed size, anything else (temp files,
unlisted shards) is deleted and its samples are extracted again. So `kill -9` at any moment loses
at most the shards in progress, and no sample is ever stored twice; shards are independent, so
they may be completed in any order. The shard's contents (which samples, in which order) are
planned before it is opened, so its safetensors header is written first and the hidden states are
streamed straight from pinned host buffers, hashed on the way; after each batch the kernel is asked
to start writing it to disk (`start_writeback`), so the fsync at the end waits for one batch, not
for the whole shard.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

from eyas.errors import ArtifactError, ConfigError
from eyas import artifacts
from eyas.artifacts import fsync_dir

SHARD_DIR = "shards"
_HASHER = ThreadPoolExecutor(max_workers=4, thread_name_prefix="eyas-shard-hash")  # >= shards written at once
PROGRESS_DIR = "progress"
ST_DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.int32: "I32", torch.uint8: "U8"}
FLOAT8 = getattr(torch, "float8_e4m3fn", None)
if FLOAT8 is not None:
    ST_DTYPES[FLOAT8] = "F8_E4M3"
SCALE_BYTES = 8
"""Per token of a float8 shard: the float32 scales of its aux and final states (`scales` [T, 2])."""


def scale_bytes(dtype: torch.dtype) -> int:
    """Bytes of scales per token a shard of states in `dtype` holds beside the states."""
    return SCALE_BYTES if dtype == FLOAT8 else 0


def shard_name(rank: int, number: int) -> str:
    return f"{SHARD_DIR}/r{rank:03d}-{number:05d}.safetensors"


SPILL_MARKER = "eyas-spill.json"


def claim_spill_dirs(out: Path, spill_dirs: list[str]) -> list[Path]:
    """The spill directories, resolved, created, checked writable and marked as serving `out`;
    ConfigError when one is the output directory, a duplicate, not writable, or already serves
    another output directory (their shard names would collide and each run's cleanup would delete
    the other's shards)."""
    import tempfile

    from eyas.artifacts import atomic_write_json

    owner = str(out.resolve())
    dirs: list[Path] = []
    for d in spill_dirs:
        path = Path(d).expanduser().resolve()
        if path == out.resolve() or path in dirs:
            raise ConfigError(f"extract.spill_dirs: {d} is {'the output directory itself' if path == out.resolve() else 'named twice'}; "
                              "name other directories")
        marker = path / SPILL_MARKER
        try:
            path.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryFile(dir=path):
                pass
            if marker.is_file():
                try:
                    serves = json.loads(marker.read_text())["out_dir"]
                except (ValueError, KeyError, TypeError) as e:
                    raise ConfigError(f"extract.spill_dirs: {marker} is not an eyas spill marker ({type(e).__name__}: {e}): "
                                      "name another directory") from None
                if serves != owner:
                    raise ConfigError(
                        f"extract.spill_dirs: {path} serves the extract in {serves}, not {owner}: give this output "
                        f"directory a spill directory of its own (or, if that extract is gone, delete {marker})")
            else:
                atomic_write_json(marker, {"out_dir": owner})
        except OSError as e:
            raise ConfigError(f"extract.spill_dirs: cannot write to {path} ({e.strerror or e}): choose another") from None
        dirs.append(path)
    return dirs


def clean_spill(out: Path, spill: list[Path], entries: list[dict[str, Any]]) -> int:
    """Delete every shard file in the spill directories that is not one of `entries`' files (by
    device and inode, so a spill path reached another way still matches), whatever its rank: the
    markers prove the files are this output directory's, left by a kill, by an output directory
    removed to start over, by a run with more ranks, or listed with another size. Runs before the
    free space is measured, so that they do not count as used. A file that a journal lists at a
    path that is gone is not deleted: ConfigError (a moved spill directory); -> how many."""
    keep = {_identity(out / e["shard"]) for e in entries}
    listed_at = {Path(name).name: out / name for name in journal_names(out)}
    removed = 0
    for d in spill:
        for f in (d / SHARD_DIR).glob("r*-*"):
            if _identity(f) in keep:
                continue
            was = listed_at.get(f.name)
            if was is not None and not was.exists():
                raise ConfigError(
                    f"{f}: the journals of {out} list this shard at {was}, which is gone: was the spill directory "
                    "moved? Put it back where it was, or extract into a new output directory")
            f.unlink(missing_ok=True)
            removed += 1
    return removed


def _identity(path: Path) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_dev, st.st_ino


OUT_RESERVE = 256 * 10**6
"""Bytes the output directory's filesystem keeps free when shards spill (at least): its journals,
index.json (MBs for 100k samples), meta.json and errors.jsonl are written after the shards."""


def free_to_keep(out: Path, spill: list[Path], min_free: int) -> list[tuple[Path, int]]:
    """(directory, bytes its filesystem keeps free) for the output directory, then the spill
    directories: min_free on each, and at least OUT_RESERVE on the output directory's when
    spilling. The preflight's room and ShardPlacer's choice both use it."""
    return [(out, max(min_free, OUT_RESERVE) if spill else min_free), *((d, min_free) for d in spill)]


def shard_bytes(num_tokens: int, row_bytes: int) -> int:
    """A shard's size on disk, its header (< 1 KB, padded) rounded up to 4 KB; `row_bytes` counts
    a token's states and scales."""
    return 4096 + num_tokens * (row_bytes + 5)  # states (+ scales), int32 ids, uint8 mask


class ShardPlacer:
    """Where this rank's next shard goes: the output directory, then the spill directories, the
    first whose filesystem keeps `min_free` bytes free after the shard and after the rest of the
    shards this rank is still writing there (other ranks' are not counted: keep min_free above a
    few shards per rank). `check=False` (no spill directories, min_free 0): always the output
    directory, as before spilling existed. Thread-safe: the writer threads open shards at once."""

    def __init__(self, out: Path, spill: list[Path], min_free: int, check: bool):
        self.out, self.min_free, self.check = out, min_free, check
        self.dirs = free_to_keep(out, spill, min_free)
        self.open: dict[int, tuple[int, "ShardWriter"]] = {}  # id(writer) -> (device, writer)
        self.lock = threading.Lock()

    def open_shard(self, rank: int, number: int, num_tokens: int, row_bytes: int, make) -> "ShardWriter":
        """-> make(name), the shard's writer, opened in the chosen directory (its name relative to
        the output directory, or absolute in a spill directory)."""
        size = shard_bytes(num_tokens, row_bytes)
        base = shard_name(rank, number)
        with self.lock:
            where, name = self.out, base
            if self.check:
                where = self._choose(size, base)
                name = base if where == self.out else str(where / base)
            writer = make(name)
            self.open[id(writer)] = (os.stat(where).st_dev, writer)
            return writer

    def closed(self, writer: "ShardWriter") -> None:
        with self.lock:
            self.open.pop(id(writer), None)

    def _choose(self, size: int, base: str) -> Path:
        seen = []
        for d, keep in self.dirs:
            dev = os.stat(d).st_dev
            pending = sum(w.bytes - w.offset for dv, w in self.open.values() if dv == dev)
            free = shutil.disk_usage(d).free
            if free - pending - size >= keep:
                return d
            seen.append(f"{d} {free / 1e9:.2f} GB free ({pending / 1e9:.2f} GB of it promised to shards being written)")
        raise ArtifactError(
            f"no room for shard {base} ({size / 1e9:.2f} GB) keeping extract.min_free_gb={self.min_free / 1e9:g} free: "
            f"{'; '.join(seen)}; add a directory on another filesystem to --extract.spill_dirs, free space, or lower "
            "extract.min_free_gb, then run the stage again (the shards written so far are kept)"
        )


def journal_path(out: Path, rank: int) -> Path:
    return out / PROGRESS_DIR / f"r{rank:03d}.jsonl"


def _raw(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor without a copy (numpy has no bfloat16, bytes do)."""
    assert t.is_contiguous() and t.device.type == "cpu"
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


class ShardWriter:
    """One shard: header first (contents are planned), then states streamed in token order; a
    float8 shard's scales (a few bytes per token) are kept and written after the states."""

    def __init__(self, out: Path, name: str, num_layers: int, hidden: int, dtype: torch.dtype,
                 input_ids_T: torch.Tensor, loss_mask_T: torch.Tensor):
        self.name = name
        self.path = out / name  # an absolute name (a spill directory's shard) is that path
        self.tmp = self.path.with_name(self.path.name + ".tmp")
        self.num_tokens = int(input_ids_T.numel())
        self.row_bytes = num_layers * hidden * torch.empty((), dtype=dtype).element_size()
        self.dtype = dtype
        self._tail = [input_ids_T.to(torch.int32).contiguous(), loss_mask_T.to(torch.uint8).contiguous()]
        self._scales: list[torch.Tensor] | None = [] if scale_bytes(dtype) else None
        states_bytes = self.num_tokens * self.row_bytes
        header: dict[str, Any] = {
            "__metadata__": {"format": "pt", "eyas": "extract-shard-v1"},
            "states": {"dtype": ST_DTYPES[dtype], "shape": [self.num_tokens, num_layers, hidden],
                       "data_offsets": [0, states_bytes]},
        }
        end = states_bytes
        if self._scales is not None:
            header["scales"] = {"dtype": "F32", "shape": [self.num_tokens, 2],
                                "data_offsets": [end, end + SCALE_BYTES * self.num_tokens]}
            end += SCALE_BYTES * self.num_tokens
        header["input_ids"] = {"dtype": "I32", "shape": [self.num_tokens], "data_offsets": [end, end + 4 * self.num_tokens]}
        header["loss_mask"] = {"dtype": "U8", "shape": [self.num_tokens],
                               "data_offsets": [end + 4 * self.num_tokens, end + 5 * self.num_tokens]}
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)  # safetensors pads the header to 8 bytes
        self.hash = hashlib.sha256()
        self._offset = 0  # bytes handed to the file so far
        self._hinted = [0, 0]  # start of the range to hint next, end of the last range hinted
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.file = open(self.tmp, "wb")
        self._write(struct.pack("<Q", len(blob)) + blob)
        self.tokens_written = 0
        self.bytes = 8 + len(blob) + end + 5 * self.num_tokens

    @property
    def offset(self) -> int:
        """Bytes handed to the file so far (of `bytes`)."""
        return self._offset

    def _write(self, data) -> None:
        # hash on a helper thread while this one writes: both release the GIL, so a batch costs
        # max(write, hash) rather than their sum (each ~0.5 GB/s-2 GB/s on one core)
        pending = _HASHER.submit(self.hash.update, data)
        self.file.write(data)
        pending.result()
        self._offset += memoryview(data).nbytes

    def start_writeback(self) -> None:
        """Have the kernel start writing what the shard holds so far to disk, and drop from the page
        cache what is already there. Linux's POSIX_FADV_DONTNEED does both: it queues writeback of
        the dirty pages (without waiting for it) and evicts only clean ones, so no data can be lost.
        Without it the disk idles until the fsync in close() writes the whole shard, and GBs of
        dirty pages pile up. A hint: a no-op on tmpfs, skipped where the OS lacks it."""
        advise = getattr(os, "posix_fadvise", None)
        start, last = self._hinted
        if advise is None or self._offset <= start:
            return
        self.file.flush()
        try:
            # the range includes the previous batch: written out by now, it is evicted this time
            advise(self.file.fileno(), start, self._offset - start, os.POSIX_FADV_DONTNEED)
        except OSError:  # only a hint (a filesystem may refuse it): close() still fsyncs before the shard counts
            pass
        self._hinted = [last, self._offset]

    def write_states(self, states_TKD: torch.Tensor, scales_T2: torch.Tensor | None = None) -> None:
        """Stream the states; a float8 shard keeps their scales (a copy: the caller's buffer is reused)."""
        row_bytes = states_TKD.shape[1] * states_TKD.shape[2] * states_TKD.element_size()
        assert states_TKD.dtype == self.dtype and row_bytes == self.row_bytes, "states do not match the shard header"
        assert self.tokens_written + states_TKD.shape[0] <= self.num_tokens, "shard overflow: plan and data disagree"
        assert (scales_T2 is None) == (self._scales is None), "float8 states come with their scales, others without"
        if scales_T2 is not None:
            assert tuple(scales_T2.shape) == (states_TKD.shape[0], 2) and scales_T2.dtype == torch.float32
            self._scales.append(scales_T2.clone())
        self._write(_raw(states_TKD))
        self.tokens_written += states_TKD.shape[0]

    def close(self) -> dict[str, Any]:
        """Finish, fsync, rename into place; -> {name, sha256, bytes}."""
        assert self.tokens_written == self.num_tokens, f"shard got {self.tokens_written} of {self.num_tokens} tokens"
        scales = [] if self._scales is None else [torch.cat([torch.empty(0, 2), *self._scales]).contiguous()]
        for t in scales + self._tail:
            self._write(_raw(t))
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        os.replace(self.tmp, self.path)
        fsync_dir(self.path.parent)
        return {"sha256": self.hash.hexdigest(), "bytes": self.bytes}

    def abort(self) -> None:
        if not self.file.closed:
            self.file.close()
        self.tmp.unlink(missing_ok=True)


def append_journal(out: Path, rank: int, entry: dict[str, Any]) -> None:
    path = journal_path(out, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    with artifacts.open_no_follow(path, "a", "point --extract.out_dir elsewhere") as f:
        f.write(json.dumps(entry) + "\n")
        f.flush()
        os.fsync(f.fileno())


def read_journals(out: Path) -> list[dict[str, Any]]:
    """Every listed shard whose file exists with the listed size (a torn last line is ignored)."""
    entries = []
    for path in sorted((out / PROGRESS_DIR).glob("r*.jsonl")):
        for line in path.read_text(encoding="utf-8").split("\n"):  # not splitlines(): U+2028 in ids
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut by a kill: its shard is not counted and gets deleted below
            f = out / entry["shard"]
            if f.is_file() and f.stat().st_size == entry["bytes"]:
                entries.append(entry)
    return entries


def journal_names(out: Path) -> list[str]:
    """The shard names of every journal line, listed shards or not (a torn line is skipped)."""
    names = []
    for path in sorted((out / PROGRESS_DIR).glob("r*.jsonl")):
        for line in path.read_text(encoding="utf-8").split("\n"):
            try:
                names.append(json.loads(line)["shard"])
            except (json.JSONDecodeError, KeyError, TypeError):
                continue
    return names


def clean_unlisted(out: Path, ranks: list[int], listed: set[str]) -> int:
    """Delete temp files and unlisted shards of `ranks` (left by a kill) in the output directory
    (its spill directories: `clean_spill`); -> how many."""
    removed = 0
    for rank in ranks:
        for f in (out / SHARD_DIR).glob(f"r{rank:03d}-*"):
            if f"{SHARD_DIR}/{f.name}" not in listed:
                f.unlink(missing_ok=True)
                removed += 1
    return removed


def rewrite_journal(out: Path, rank: int, keep: list[dict[str, Any]]) -> None:
    """Drop journal lines whose shard is gone (so a deleted corrupt shard is re-extracted)."""
    from eyas.artifacts import atomic_write_text

    path = journal_path(out, rank)
    if path.is_file():
        atomic_write_text(path, "".join(json.dumps(e) + "\n" for e in keep if e["rank"] == rank))


def done_samples(entries: list[dict[str, Any]]) -> set[int]:
    done: set[int] = set()
    for e in entries:
        done.update(set(e["samples"]) - set(e["failed"]))
    return done


def check_run(out: Path, fingerprint: dict[str, Any]) -> None:
    """Refuse to mix states from different settings in one directory."""
    path = out / PROGRESS_DIR / "run.json"
    if not path.is_file():
        return
    old = json.loads(path.read_text())
    diff = sorted(k for k in set(old) | set(fingerprint) if old.get(k) != fingerprint.get(k))
    if diff:
        raise ConfigError(
            f"{out} holds a partial extract made with other settings ({', '.join(diff)} differ: "
            f"{ {k: old.get(k) for k in diff} } vs { {k: fingerprint.get(k) for k in diff} }); "
            "pass another --extract.out_dir, or delete the directory to start over"
        )


def build_index(out: Path, entries: list[dict[str, Any]], sample_ids: list[str]) -> dict[str, Any]:
    """Sample -> (shard, token offset, length), in prepare order; failed samples are left out."""
    rows = []
    shards = sorted({e["shard"] for e in entries})
    shard_no = {s: i for i, s in enumerate(shards)}
    for e in entries:
        offset, failed = 0, set(e["failed"])
        for i, n in zip(e["samples"], e["lengths"]):
            if i not in failed:
                rows.append((i, shard_no[e["shard"]], offset, n))
            offset += n
    rows.sort()
    idx = np.array(rows, dtype=np.int64).reshape(-1, 4)
    if len(np.unique(idx[:, 0])) != len(idx):
        raise ArtifactError(f"{out}: a sample is stored twice across shards; delete the directory and re-run `eyas extract`")
    return {
        "shards": shards,
        "index": idx[:, 0].tolist(),
        "id": [sample_ids[i] for i in idx[:, 0].tolist()],
        "shard": idx[:, 1].tolist(),
        "offset": idx[:, 2].tolist(),
        "length": idx[:, 3].tolist(),
    }
