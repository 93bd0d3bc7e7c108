"""Faults injected into real runs (extract, train, `eyas run`): a forward pre-hook that raises."""

from __future__ import annotations

import torch


class Poison:
    """A forward pre-hook raising `exc` on any batch holding `tokens` (or on every call after the first `after`)."""

    def __init__(self, exc: BaseException, tokens: torch.Tensor | None = None, after: int = 0):
        self.exc, self.tokens, self.after = exc, tokens, after

    def __call__(self, module, args, kwargs):
        ids_BS = kwargs.get("input_ids", args[0] if args else None)
        if self.tokens is None:
            self.after -= 1
            if self.after < 0:
                raise self.exc
            return
        n = self.tokens.numel()
        rows = ids_BS.view(-1)[None] if ids_BS.shape[0] == 1 else ids_BS
        for row in rows:
            for start in range(0, row.numel() - n + 1):
                if torch.equal(row[start : start + n], self.tokens):
                    raise self.exc


def poison_backend(monkeypatch, poison: Poison):
    from eyas import extract

    real = extract.make_backend

    def make(cfg, setup, device):
        backend = real(cfg, setup, device)
        backend.base.register_forward_pre_hook(poison, with_kwargs=True)
        return backend

    monkeypatch.setattr(extract, "make_backend", make)
