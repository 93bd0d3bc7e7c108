"""Extraction backends: batch in, hidden states of its real tokens out; and the parity check.

The interface the rest of the stage relies on (eyas/extract/vllm_backend.py implements it too):

    backend.layer_ids, backend.hidden_size, backend.num_layers, backend.dtype
    backend.forward(batch, tokens, timer=NULL_TIMER) -> states_TKD   # any device, backend.dtype; T = batch.num_tokens
    backend.references([tokens_S, ...], float32=False) -> [states_SKD, ...]  # plain batch-1 forwards, the parity reference
    backend.parity_hint                                     # what a parity failure points the user to

`states_TKD` holds the batch's samples back to back in `batch.indices` order; its K+1 layer entries
are the aux states in `layer_ids` order, then the final-norm state. The writer, index and resume
code see nothing else.

Padded batches are right-padded and run **without an attention mask**: attention is causal, so a
real token never attends to the padding after it, and its states equal those of the unpadded
sample; dropping the mask lets SDPA take its fused causal (flash) path. Pad positions are
discarded. Packed batches pass per-sample position ids and no mask; transformers (>= 4.53) builds
the block-diagonal causal mask from the position-id restarts. Both are checked against the plain
forward on the first batch of every run (and by tests/extract/test_stage.py per architecture).

`compile=True` runs each decoder layer's `forward` through `torch.compile` (inductor fuses the
norms, RoPE, SiLU-gating and residual adds that eager runs as separate memory-bound kernels). Only
`forward` is compiled, not `Module.__call__`, so the capture hooks stay plain Python around it; the
graph has dynamic shapes, so one compilation serves every batch shape and, the layers sharing their
code, every layer (plus one for batches of a single row, which torch specializes). The parity
reference always runs the eager layers, so the check also covers the compiler.

Shapes: B batch, S sequence, T tokens of a batch, K layers (aux + final), D hidden size.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Iterator

import torch
from torch import nn

from eyas.capture import HiddenStateCapture, base_model, text_config, to_device
from eyas.errors import EyasError, describe_exception, exception_message
from eyas.extract.plan import Batch
from eyas.extract.profile import NULL_TIMER, NullTimer


class ParityError(EyasError):
    """Extracted states differ from a plain forward: the run stops (wrong sample, mask or position)."""


class HFBackend:
    """transformers forward with capture hooks; the LM head is skipped (no V-wide logits)."""

    name = "hf"
    parity_hint = ("States would be stored for the wrong sample, mask or positions. Try --extract.pack=false or "
                   "another --extract.attn_implementation")

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
        return to_device(t, self.device)

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

    def reference(self, tokens_S: torch.Tensor, float32: bool = False) -> torch.Tensor:
        return self.references([tokens_S], float32)[0]

    @torch.no_grad()
    def references(self, tokens: list[torch.Tensor], float32: bool = False) -> list[torch.Tensor]:
        """Plain batch-1 forwards of the decoder, no hooks: aux k = hidden_states[k], final =
        last_hidden_state (the final-norm output in every transformers version; hidden_states[-1]
        is the same tensor in 5.x, tests/test_capture.py checks it). float32: with the weights
        cast to float32 once for all of them (see `as_float32`)."""
        # the reference is the plain model, also when the layers are compiled
        with self._eager(), (as_float32(self.base) if float32 else nullcontext()):
            return [self._plain(t) for t in tokens]

    def _plain(self, tokens_S: torch.Tensor) -> torch.Tensor:
        out = self.base(input_ids=self._to_device(tokens_S.view(1, -1)), output_hidden_states=True, use_cache=False)
        hs = out.hidden_states
        assert len(hs) == self.num_layers + 1, f"expected {self.num_layers + 1} hidden states, got {len(hs)}"
        final = getattr(out, "last_hidden_state", None)
        final = hs[-1] if final is None else final
        return torch.stack([hs[k][0].to(final.device) for k in self.layer_ids] + [final[0]], dim=1)


@contextmanager
def as_float32(module: nn.Module) -> Iterator[None]:
    """The module's floating parameters and buffers in float32 for the duration, then each back to
    its own dtype: bf16/fp16 -> fp32 -> bf16/fp16 is exact, so the weights come back bit for bit.
    Needs float32 room for the weights for a moment (on an 8B model 32 GB)."""
    tensors = [t for t in [*module.parameters(), *module.buffers()] if t.is_floating_point()]
    dtypes = [t.dtype for t in tensors]
    try:
        for t in tensors:
            t.data = t.data.float()
        yield
    finally:
        for t, dtype in zip(tensors, dtypes):
            t.data = t.data.to(dtype)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # the float32 copies' blocks: give them back to other processes


def default_tolerance(dtype: torch.dtype) -> float:
    return 1e-3 if dtype == torch.float32 else 0.05


def relative_error(got_SKD: torch.Tensor, ref_SKD: torch.Tensor) -> torch.Tensor:
    """Per token and layer: |got - ref| / |ref| (L2 over D) -> [S, K], in fp32."""
    got, ref = got_SKD.float(), ref_SKD.float().to(got_SKD.device)
    return (got - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-6)


FLOOR_FACTOR = 1.5
"""States past the tolerance still pass when, against a float32 forward, they are within this
factor of the plain bf16/fp16 forward's own error (see check_parity)."""
FLOOR_MAX = 0.25
"""...and only while that own error stays below this: a plain forward further than this from
float32 is no yardstick (another sample's states are ~1.4 away)."""

PROXY_FLOOR_MAX = 1 / FLOOR_FACTOR
"""The proxy check's limit instead (eyas.extract.vllm_proxy): a random model's bf16 forward can be far
from its float32 one (a tiny DeepSeek-V3 with routed experts, at tensor parallel 2: 0.32 at one token,
transformers' own rounding), so the engine is judged against that rounding of the same reference
for as long as FLOOR_FACTOR times it stays below 1, short of the ~1.4 of unrelated states."""


@dataclass
class Parity:
    errors: list[float]
    """Per checked sample: the largest relative error against the plain forward."""
    float32_judged: int = 0
    """Samples past the tolerance that passed against the float32 forward."""


def check_parity(backend, checks: list[tuple[str, torch.Tensor, torch.Tensor]], tol: float,
                 proxy: bool = False) -> Parity:
    """Compare samples' extracted states with the plain forward; ParityError past `tol`.

    checks: (sample id, extracted states_SKD, tokens_S) per sample. In bf16/fp16 two correct
    computations of the same states differ by their rounding, and on a deep model (random weights
    above all) that can exceed `tol`: a compiled layer rounds where the eager one does not. Samples
    past `tol` are therefore judged once more against a float32 forward (the truth both
    approximate; the weights are cast once for all of them): one passes when, for every layer, its
    error against float32 is at most FLOOR_FACTOR x the plain forward's own, both at the worst
    token and on average over the tokens (or `tol`), and the plain forward's own error is finite and
    at most FLOOR_MAX (`proxy`: judged as float32_verdict says for a random proxy). States of the
    wrong sample, mask or position, or wrong at some of the tokens, are far from both and still fail."""
    refs = backend.references([t for _, _, t in checks])
    result, over = Parity(errors=[]), []
    for (sample, states_SKD, tokens_S), ref_SKD in zip(checks, refs):
        if ref_SKD.shape != states_SKD.shape:
            raise ParityError(f"sample {sample}: extracted states have shape {tuple(states_SKD.shape)}, "
                              f"the plain forward {tuple(ref_SKD.shape)}")
        err_SK = relative_error(states_SKD, ref_SKD)
        per_layer = err_SK.amax(dim=0).tolist()  # .tolist(): a sync point, only on checked samples
        result.errors.append(max(per_layer))
        if not all(e <= tol for e in per_layer):  # also catches NaN
            over.append((sample, states_SKD, tokens_S, ref_SKD, err_SK, per_layer))
    if not over:
        return result
    judged = [""] * len(over)  # per sample over tol: "" = passes against float32, else why not
    cause: Exception | None = None
    if refs[0].dtype == torch.float32:
        judged = ["float32 states"] * len(over)
    else:
        try:
            exacts = backend.references([o[2] for o in over], float32=True)
        except Exception as e:  # flash attention refuses fp32, offloaded weights, out of memory: say so, fail below
            cause = e
            d = describe_exception(e)
            print(f"[eyas:extract] samples {', '.join(o[0] for o in over)}: the float32 forward that judges bf16/fp16 "
                  f"rounding failed: {d['type']}: {d['message']}\n{d['traceback']}", file=sys.stderr, flush=True)
            judged = [f"the float32 forward that judges bf16/fp16 rounding failed ({type(e).__name__}: "
                      f"{exception_message(e)})"] * len(over)
        else:
            for j, ((sample, states_SKD, _, ref_SKD, _, per_layer), exact_SKD) in enumerate(zip(over, exacts)):
                judged[j] = float32_verdict(relative_error(states_SKD, exact_SKD), relative_error(ref_SKD, exact_SKD), tol,
                                            proxy)
                print(f"[eyas:extract] sample {sample}: relative error {max(per_layer):.3g} against the plain forward "
                      f"(> tolerance {tol:g}); against a float32 forward: {judged[j] or 'rounding, passes'}", flush=True)
    for (sample, states_SKD, _, ref_SKD, err_SK, per_layer), why in zip(over, judged):
        if not why:
            result.float32_judged += 1
            continue
        worst = max(range(len(per_layer)), key=lambda j: per_layer[j] if per_layer[j] == per_layer[j] else float("inf"))
        names = [f"aux layer {k}" for k in backend.layer_ids] + ["final norm"]
        tok = int(err_SK[:, worst].argmax())
        abs_err = float((states_SKD[:, worst].float() - ref_SKD[:, worst].float().to(states_SKD.device)).abs().max())
        raise ParityError(
            f"sample {sample}: {names[worst]} differs from a plain batch-1 forward by a relative error of "
            f"{per_layer[worst]:.4g} (max abs error {abs_err:.4g}, first at token {tok}) > tolerance {tol:g} "
            f"(extract.parity_tol), and not by rounding: {why}. {backend.parity_hint}"
        ) from cause
    return result


def float32_verdict(got_SK: torch.Tensor, floor_SK: torch.Tensor, tol: float, proxy: bool = False) -> str:
    """'' when states with error got_SK against float32 are as good as the plain forward (its own
    error floor_SK), per layer at the worst token and on average; else what is wrong, with numbers.

    `proxy` (the proxy check's random MoE model): a bf16 rounding flips a routed expert at one token,
    in one layer of one forward and in another of the other, so the worst token of each layer is
    judged against the plain forward's worst anywhere, and that may be up to PROXY_FLOOR_MAX from
    float32 (FLOOR_MAX otherwise); the average per layer, which a wrong kernel raises, stays as is."""
    limit = PROXY_FLOOR_MAX if proxy else FLOOR_MAX
    floor_max, got_max = floor_SK.amax(dim=0), got_SK.amax(dim=0)
    floor_mean, got_mean = floor_SK.mean(dim=0), got_SK.mean(dim=0)
    numbers = (f"error {float(got_max.max()):.3g} (mean {float(got_mean.max()):.3g}), the plain forward's own "
               f"{float(floor_max.max()):.3g} (mean {float(floor_mean.max()):.3g})")
    if not bool(torch.isfinite(floor_max).all()) or float(floor_max.max()) > limit:
        return f"{numbers}: the plain forward itself is more than {limit:.3g} from float32, no yardstick"
    if proxy:
        floor_max = floor_max.amax().expand_as(floor_max)
    ok = (got_max <= torch.clamp(FLOOR_FACTOR * floor_max, min=tol)) & (got_mean <= torch.clamp(FLOOR_FACTOR * floor_mean, min=tol))
    return "" if bool(ok.all()) else f"{numbers}: more than {FLOOR_FACTOR}x it"
