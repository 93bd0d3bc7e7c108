"""KV caches during speculative decoding: the target's (HF DynamicCache) and the draft's.

Legend: P cached positions, Hkv kv heads, d head dim.

Invariants kept by eyas.spec.generate between verify passes, with L tokens known so far:
  * the target cache holds positions 0..L-2: every token except the last one, which is fed to the
    next verify forward as the root of the draft chain/tree;
  * the draft cache holds `committed` step-0 entries, one per position t whose input
    (fc(target aux states at t), token t+1) is final; drafted entries of a round sit after them
    and are dropped (`rollback`) before the next round.
After a verify pass only the accepted path is kept in the target cache (`keep_positions`): the
rejected nodes' keys/values were computed for tokens that are not part of the output.
"""

from __future__ import annotations

import torch

from eyas.errors import EyasError


def _check_full_attention(layer) -> None:
    if getattr(layer, "is_sliding", False) or not hasattr(layer, "keys"):
        raise EyasError(
            f"speculative decoding needs a full-attention KV cache; this target's cache has a "
            f"{type(layer).__name__} layer (sliding-window / linear attention are not supported)"
        )


def keep_positions(cache, keep_P: torch.Tensor) -> None:
    """Keep only the cached entries at indices `keep_P` (ascending) in every layer of a DynamicCache."""
    for layer in cache.layers:
        _check_full_attention(layer)
        if layer.keys is None or layer.keys.numel() == 0:
            continue
        idx = keep_P.to(layer.keys.device)
        layer.keys = layer.keys.index_select(-2, idx)
        layer.values = layer.values.index_select(-2, idx)


def crop(cache, length: int) -> None:
    """Keep the first `length` cached positions (a chain's accepted prefix)."""
    for layer in cache.layers:
        _check_full_attention(layer)
        if layer.keys is None or layer.keys.numel() == 0:
            continue
        layer.keys = layer.keys[..., :length, :]
        layer.values = layer.values[..., :length, :]


def cache_length(cache) -> int:
    return int(cache.get_seq_length())


class DraftCache:
    """The draft layers' keys/values [1, L*Hkv, P, d] (L draft layers, stacked by head as
    eyas.draft returns them) with a committed prefix and a scratch tail."""

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.committed = 0

    def __len__(self) -> int:
        return 0 if self.k is None else self.k.shape[2]

    def append(self, k_BHSd: torch.Tensor, v_BHSd: torch.Tensor) -> None:
        self.k = k_BHSd if self.k is None else torch.cat([self.k, k_BHSd], dim=2)
        self.v = v_BHSd if self.v is None else torch.cat([self.v, v_BHSd], dim=2)

    def commit(self) -> None:
        """Everything cached so far is final (step-0 entries of accepted positions)."""
        self.committed = len(self)

    def rollback(self) -> None:
        """Drop the entries after the committed prefix (the drafted tokens of this round)."""
        if self.k is not None:
            self.k = self.k[:, :, : self.committed]
            self.v = self.v[:, :, : self.committed]
