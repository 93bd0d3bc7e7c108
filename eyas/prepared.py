"""Reader of a prepare output directory.

    from eyas import Prepared
    p = Prepared("runs/eyas/prepare")
    len(p); p[0]  # {"input_ids": LongTensor[S], "loss_mask": LongTensor[S], "id": "QWJhYvA_0"}
    p.d2t, p.t2d  # int64 [W] offsets, bool [V]
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch

from eyas.artifacts import check_files, read_meta, read_safetensors


class Prepared:
    def __init__(self, out_dir: str | Path):
        self.dir = Path(out_dir)
        self.meta = read_meta(self.dir, "prepare")
        check_files(self.dir, "prepare", self.meta.get("files") or {})  # an output of an earlier eyas has no record
        tokens = read_safetensors(self.dir / "tokens.safetensors", "prepare")
        self._ids = tokens["input_ids"]
        self._mask = tokens["loss_mask"]
        self.offsets = tokens["offsets"]
        v = read_safetensors(self.dir / "vocab.safetensors", "prepare")
        self.d2t: torch.Tensor = v["d2t"]
        self.t2d: torch.Tensor = v["t2d"]
        self.token_counts: torch.Tensor = v["token_counts"]
        self.ids: list[str] = json.loads((self.dir / "sample_ids.json").read_text())
        assert len(self.ids) + 1 == self.offsets.numel(), "sample_ids.json and tokens.safetensors disagree"

    def __len__(self) -> int:
        return len(self.ids)

    def length(self, i: int) -> int:
        return int(self.offsets[i + 1] - self.offsets[i])

    @property
    def lengths(self) -> torch.Tensor:
        return self.offsets[1:] - self.offsets[:-1]

    def __getitem__(self, i: int) -> dict[str, Any]:
        if not -len(self) <= i < len(self):
            raise IndexError(f"sample {i} out of range for {len(self)} samples")
        i %= len(self)
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        return {"input_ids": self._ids[a:b].long(), "loss_mask": self._mask[a:b].long(), "id": self.ids[i], "index": i}

    def prompt_keys(self) -> list[bytes | None]:
        """Per sample, a 16-byte hash of its tokens before its first loss token (all of them if it
        has none; None when it is trained from its first token): equal keys = identical prompts."""
        starts, ends = self.offsets[:-1], self.offsets[1:]
        trained = self._mask.nonzero().flatten()
        # the first loss token at or after each sample's start, if it lies inside the sample
        first = trained[torch.searchsorted(trained, starts).clamp(max=max(trained.numel() - 1, 0))] \
            if trained.numel() else ends.clone()
        end = torch.where((first >= starts) & (first < ends), first, ends).tolist()
        ids = self._ids.numpy()
        return [hashlib.blake2b(ids[a:b].tobytes(), digest_size=16).digest() if b > a else None
                for a, b in zip(starts.tolist(), end)]

    def __repr__(self) -> str:
        return f"Prepared({str(self.dir)!r}, samples={len(self)}, draft_vocab={self.d2t.numel()})"
