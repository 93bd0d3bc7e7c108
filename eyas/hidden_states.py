"""Reader of an extract output directory.

    from eyas import HiddenStates
    hs = HiddenStates("runs/eyas/extract")
    len(hs); hs.lengths              # samples stored; LongTensor of their token counts
    s = hs[0]                        # sample 0 in prepare's order
    s["input_ids"], s["loss_mask"]   # LongTensor [S]
    s["aux"], s["final"]             # [S, K, D] and [S, D] (bf16 from a GPU run, fp32 from a CPU run)
    hs.dtype                         # theirs: the stored dtype, or the compute dtype for float8
    s["id"], s["index"]              # source conversation id, index in the prepare output
    hs.meta["layer_ids"], hs.meta["hidden_size"], hs.meta["prepare_dir"]

`aux[:, j]` is the hidden state entering decoder layer `layer_ids[j]` (HF `hidden_states[k]`);
`final` is the output of the target's final norm (what its LM head sees): `lm_head(final)` gives
the teacher logits. Every sample of the prepare output is stored unless it failed in a run that
allowed failures (`meta["counts"]["failed"]` lists them); then `hs[i]["index"]` says which sample
it is. A shard's sha256 is checked the first time it is read; a mismatch raises ArtifactError
naming the shard. States stored as float8 (`extract.store_dtype=float8`: e4m3 and a float32 scale
per token for aux and for final, eyas/fp8.py) are dequantised here into the compute dtype of the
extract run (`meta["compute_dtype"]`), so every reader gets bf16 or fp32 whatever the storage.
"""

from __future__ import annotations

import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Any, Iterable

import torch
from safetensors import safe_open

from eyas import fp8
from eyas.artifacts import read_meta
from eyas.errors import ArtifactError, DamagedArtifact


def _sha256(path: Path, chunk: int = 1 << 24) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


VERIFIED = "EYAS_EXTRACT_VERIFIED"
"""Set by `eyas run` once it has checked every shard's sha256 of an extract output (`verified_mark`),
so train in the same process does not hash them all again."""


def verified_mark(out_dir: Path, meta: dict[str, Any]) -> str:
    from eyas.artifacts import hash_json

    return f"{Path(out_dir).resolve()}@{hash_json(meta)}"


def _dtype(name: str) -> torch.dtype:
    """A meta.json dtype name ("bfloat16") -> torch's."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ArtifactError(f"meta.json names the dtype {name!r}, which this torch {torch.__version__} lacks: "
                            "read it with the torch that extracted it, or re-run `eyas extract`")
    return dtype


class HiddenStates:
    def __init__(self, out_dir: str | Path, verify_checksums: bool = True):
        self.dir = Path(out_dir)
        self.meta: dict[str, Any] = read_meta(self.dir, "extract")
        try:
            index = json.loads((self.dir / "index.json").read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ArtifactError(f"{self.dir}/index.json is unreadable ({e}): re-run `eyas extract`") from None
        self.shards: list[str] = index["shards"]
        self.ids: list[str] = index["id"]
        self.indices: list[int] = index["index"]
        self._shard = index["shard"]
        self._offset = index["offset"]
        self.lengths = torch.tensor(index["length"], dtype=torch.long)
        self.layer_ids: list[int] = self.meta["layer_ids"]
        self.hidden_size: int = self.meta["hidden_size"]
        self.quantised = self.meta.get("dtype") == "float8_e4m3fn"
        self.dtype: torch.dtype = _dtype(self.meta["compute_dtype"] if self.quantised else self.meta["dtype"])
        self.verify_checksums = verify_checksums
        self._verified: set[int] = set()
        if os.environ.get(VERIFIED) == verified_mark(self.dir, self.meta):  # `eyas run` hashed every shard just now
            self._verified = set(range(len(self.shards)))
        self._open: dict[int, Any] = {}
        self._pid = os.getpid()

    def __len__(self) -> int:
        return len(self.ids)

    def _handle(self, s: int):
        if self._pid != os.getpid():  # a forked DataLoader worker opens its own handles
            self._open, self._pid = {}, os.getpid()
        if s not in self._open:
            path = self.dir / self.shards[s]
            if not path.is_file():
                raise ArtifactError(f"shard {path} is missing: re-run the same `eyas extract` command to re-extract it")
            if self.verify_checksums and s not in self._verified:
                self._check(s)
                self._verified.add(s)
            self._open[s] = safe_open(str(path), framework="pt")
        return self._open[s]

    def __getitem__(self, i: int) -> dict[str, Any]:
        if not -len(self) <= i < len(self):
            raise IndexError(f"sample {i} out of range for {len(self)} samples")
        i %= len(self)
        f = self._handle(self._shard[i])
        a, b = self._offset[i], self._offset[i] + int(self.lengths[i])
        states_SKD = f.get_slice("states")[a:b]
        k = len(self.layer_ids)
        if self.quantised:
            aux_SKD, final_SD = fp8.dequantise_states(states_SKD, f.get_slice("scales")[a:b], k, self.dtype)
        else:
            aux_SKD, final_SD = states_SKD[:, :k], states_SKD[:, k]
        return {
            "input_ids": f.get_slice("input_ids")[a:b].long(),
            "loss_mask": f.get_slice("loss_mask")[a:b].long(),
            "aux": aux_SKD,
            "final": final_SD,
            "id": self.ids[i],
            "index": self.indices[i],
        }

    def _check(self, s: int) -> None:
        path = self.dir / self.shards[s]
        if not path.is_file():
            raise DamagedArtifact(f"shard {path} is missing: run the same `eyas run` (or `eyas extract`) command "
                                  "again; only its samples are extracted again", path, "extract")
        if _sha256(path) != self.meta["shards"][self.shards[s]]["sha256"]:
            raise DamagedArtifact(
                f"shard {path} is corrupt (sha256 differs from meta.json): run the same `eyas run` command again (it "
                "checks every shard and extracts the damaged ones' samples again), or delete it and run `eyas "
                "extract`", path, "extract")

    def verify(self, shards: Iterable[int] | None = None, threads: int = 0) -> int:
        """Check the sha256 of every shard (or of `shards`) now, `threads` at a time (0 = up to 8;
        hashing releases the GIL), instead of on first use; -> bytes checked. Verified shards are
        remembered, also by DataLoader workers forked afterwards (a worker's own checks die with it)."""
        todo = sorted({int(s) for s in (range(len(self.shards)) if shards is None else shards)} - self._verified)
        n = threads or min(8, os.cpu_count() or 1, max(1, len(todo)))
        pool = ThreadPoolExecutor(n)
        try:
            for future in as_completed([pool.submit(self._check, s) for s in todo]):
                future.result()  # the first corrupt or missing shard raises here
        finally:
            pool.shutdown(wait=True, cancel_futures=True)  # on an error: no hashing of the rest
        self._verified.update(todo)
        return sum((self.dir / self.shards[s]).stat().st_size for s in todo)

    def mark_verified(self, shards: Iterable[int]) -> None:
        """Shards checked elsewhere (by other ranks, whose results were gathered)."""
        self._verified.update(int(s) for s in shards)

    def __repr__(self) -> str:
        return (f"HiddenStates({str(self.dir)!r}, samples={len(self)}, layers={self.layer_ids}, "
                f"hidden={self.hidden_size}, shards={len(self.shards)})")
