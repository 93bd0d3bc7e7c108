"""Extraction backends: batch in, hidden states of its real tokens out; and the parity check.

The interface the rest of the stage relies on (eyas/extract/vllm_backend.py implements it too):

    backend.layer_ids, backend.hidden_size, backend.num_layers, backend.dtype
    backend.forward(batch, tokens, timer=NULL_TIMER) -> states_TKD   # any device, backend.dtype; T = batch.num_tokens
    backend.reference(tokens_S)    -> states_SKD   # plain batch-1 forward, the parity reference

`states_TKD` holds the batch's samples back to back in `batch.indices` order; its K+1 layer entries
are the aux states in `layer_ids` order, then the final-norm state. The writer, index and resume
code see nothing else.

Padded batches are right-padded and run **without an attention mask**: attention is causal, so a
real token never attends to the padding after it, and its states equal those of the unpadded
sample; dropping the mask lets SDPA take its fused causal (flash) path. Pad positions are
discarded. Packed batches pass per-sample position ids and no mask; transformers (>= 4.53) builds
the block-diagonal causal mask from the position-id restarts. Both are checked against the plain
forward on the first batch of every run (and by tests/test_extract.py per architecture).

`compile=True` runs each decoder layer's `forward` through `torch.compile` (inductor fuses the
norms, RoPE, SiLU-gating and residual adds that eager runs as separate memory-bound kernels). Only
`forward` is compiled, not `Module.__call__`, so the capture hooks stay plain Python around it; the
graph has dynamic shapes, so one compilation serves every batch shape and, the layers sharing their
code, every layer (plus one for batches of a single row, which torch specializes). The parity
reference always runs the eager layers, so the check also covers the compiler.

Shapes: B batch, S sequence, T tokens of a batch, K layers (aux + final), D hidden size.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from torch import nn

from eyas.capture import HiddenStateCapture, base_model, text_config
from eyas.errors import EyasError
from eyas.extract.plan import Batch
from eyas.extract.profile import NULL_TIMER, NullTimer


class ParityError(EyasError):
    """Extracted states differ from a plain forward: the run stops (wrong sample, mask or position)."""


class HFBackend:
    """transformers forward with capture hooks; the LM head is skipped (no V-wide logits)."""

    name = "hf"

    def __init__(self, model: nn.Module, layer_ids: list[int], dtype: torch.dtype, compile: bool = False,
                 compile_backend: str = "inductor"):
        self.model = model
        self.base = base_model(model)
        self.capture = HiddenStateCapture(model, layer_ids)
        conf = text_config(model)
        self.layer_ids = self.capture.layer_ids
        self.num_layers = int(conf.num_hidden_layers)
        self.hidden_size = int(conf.hidden_size)
        self.dtype = dtype
        self.device = model.get_input_embeddings().weight.device
        self._compiled: dict[nn.Module, tuple[object, object]] = {}  # layer -> (compiled, own instance forward)
        if compile:
            for layer in self.capture.layers:
                own = layer.__dict__.get("forward")  # e.g. accelerate's device_map wrapper, kept inside
                self._compiled[layer] = (torch.compile(layer.forward, dynamic=True, backend=compile_backend), own)
            self._install(True)

    def _install(self, compiled: bool) -> None:
        """Put the compiled forwards on the layers (an instance attribute shadowing the class's
        `forward`), or give the layers back what they had."""
        for layer, (fn, own) in self._compiled.items():
            if compiled:
                layer.forward = fn
            elif own is not None:
                layer.forward = own
            else:
                layer.__dict__.pop("forward", None)

    @contextmanager
    def _eager(self) -> Iterator[None]:
        self._install(False)
        try:
            yield
        finally:
            self._install(True)

    def close(self) -> None:
        """Give the model its eager layers back (the model outlives the backend, e.g. in the bench)."""
        self._install(False)
        self._compiled = {}

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cuda":
            t = t.pin_memory()  # lets the host->device copy run asynchronously
        return t.to(self.device, non_blocking=True)

    @torch.no_grad()
    def forward(self, batch: Batch, tokens: list[torch.Tensor], timer: NullTimer = NULL_TIMER) -> torch.Tensor:
        kwargs = {"input_ids": self._to_device(batch.input_ids(tokens)), "use_cache": False}
        pos = batch.position_ids()
        if pos is not None:
            kwargs["position_ids"] = self._to_device(pos)
        index = batch.token_index()
        index = self._to_device(index) if index is not None else None
        with self.capture as cap:
            with timer.gpu("forward"):
                self.base(**kwargs)
            with timer.gpu("capture (stack, gather, cast)"):
                states_NKD = cap.states().flatten(0, 1)
                if index is not None:
                    states_NKD = states_NKD.index_select(0, index.to(states_NKD.device))
                return states_NKD.to(self.dtype)

    @torch.no_grad()
    def reference(self, tokens_S: torch.Tensor) -> torch.Tensor:
        """A plain batch-1 forward of the decoder, no hooks: aux k = hidden_states[k], final =
        last_hidden_state (the final-norm output in every transformers version; hidden_states[-1]
        is the same tensor in 5.x, tests/test_capture.py checks it)."""
        with self._eager():  # the reference is the plain model, also when the layers are compiled
            out = self.base(input_ids=self._to_device(tokens_S.view(1, -1)), output_hidden_states=True, use_cache=False)
        hs = out.hidden_states
        assert len(hs) == self.num_layers + 1, f"expected {self.num_layers + 1} hidden states, got {len(hs)}"
        final = getattr(out, "last_hidden_state", None)
        final = hs[-1] if final is None else final
        return torch.stack([hs[k][0].to(final.device) for k in self.layer_ids] + [final[0]], dim=1)


def default_tolerance(dtype: torch.dtype) -> float:
    return 1e-3 if dtype == torch.float32 else 0.05


def relative_error(got_SKD: torch.Tensor, ref_SKD: torch.Tensor) -> torch.Tensor:
    """Per token and layer: |got - ref| / |ref| (L2 over D) -> [S, K], in fp32."""
    got, ref = got_SKD.float(), ref_SKD.float().to(got_SKD.device)
    return (got - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-6)


def check_parity(backend, states_SKD: torch.Tensor, tokens_S: torch.Tensor, tol: float, sample: str) -> float:
    """Compare one sample's extracted states with the plain forward; ParityError past `tol`."""
    ref_SKD = backend.reference(tokens_S)
    if ref_SKD.shape != states_SKD.shape:
        raise ParityError(f"sample {sample}: extracted states have shape {tuple(states_SKD.shape)}, "
                          f"the plain forward {tuple(ref_SKD.shape)}")
    err_SK = relative_error(states_SKD, ref_SKD)
    per_layer = err_SK.amax(dim=0).tolist()  # .tolist(): a sync point, only on checked samples
    worst = max(range(len(per_layer)), key=lambda j: per_layer[j])
    if not per_layer[worst] <= tol:  # also catches NaN
        names = [f"aux layer {k}" for k in backend.layer_ids] + ["final norm"]
        tok = int(err_SK[:, worst].argmax())
        abs_err = float((states_SKD[:, worst].float() - ref_SKD[:, worst].float().to(states_SKD.device)).abs().max())
        raise ParityError(
            f"sample {sample}: {names[worst]} differs from a plain batch-1 forward by a relative error of "
            f"{per_layer[worst]:.4g} (max abs error {abs_err:.4g}, first at token {tok}) > tolerance {tol:g} "
            "(extract.parity_tol); states would be stored for the wrong sample, mask or positions. "
            "Try --extract.pack=false or another --extract.attn_implementation"
        )
    return per_layer[worst]
