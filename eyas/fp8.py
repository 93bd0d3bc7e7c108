"""FP8 storage of hidden states (`--extract.store_dtype=float8`): e4m3 with one float32 scale per token.

    q_TX, scale_T = quantise(x_TX)                   # x ~= q * scale
    x_TX = dequantise(q_TX, scale_T, torch.bfloat16)
    q_TKD, scales_T2 = quantise_states(states_TKD, k) # extract's rows: aux and final scaled apart

Legend: T tokens, X any further dims, K aux layers, D hidden.

e4m3 (`torch.float8_e4m3fn`) holds values up to +-448 with 3 mantissa bits. Each token is scaled
so that its largest |value| lands on 448: scale = amax / 448, at least 1e-12 so that an all-zero
row (a failed sample's) stays zero instead of dividing by zero. Rounding to nearest then errs, in
units of the original values, by at most

    |x' - x| <= max(2^-4 |x|, 2^-10 scale)

2^-4 is half the last place of a 3-bit mantissa, relative to the value; below 2^-6 scale e4m3 is
subnormal with a fixed step of 2^-9 scale, hence the absolute floor. Dequantising multiplies in
float32 and rounds once into the requested dtype (bf16 adds at most 2^-9 |x'|), rather than
rounding the scale to bf16 first.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

E4M3_MAX = 448.0
"""Largest finite float8_e4m3fn value."""
MIN_SCALE = 1e-12
"""Floor of a scale: an all-zero token quantises to zeros, not to 0/0."""
CHUNK_ELEMENTS = 1 << 26
"""Elements quantised at a time by quantise_states: its float32 temporaries stay near 256 MB,
whatever the batch (a 16k-token batch of a 7168-wide target with 3 aux layers is 470M elements)."""


def float8_dtype() -> torch.dtype | None:
    """torch.float8_e4m3fn, or None on a torch without it."""
    return getattr(torch, "float8_e4m3fn", None)


def quantise(x_TX: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (q_TX float8_e4m3fn, scale_T float32): one scale per index of dim 0, over all other dims."""
    x = x_TX.float()
    amax_T = x.abs().reshape(x.shape[0], -1).amax(1) if x.numel() else x.new_zeros(x.shape[0])
    scale_T = (amax_T / E4M3_MAX).clamp(min=MIN_SCALE)
    y = x / scale_T.view(-1, *([1] * (x.dim() - 1)))
    # amax / (amax / 448) may land a hair above 448 in float32: clamped, so no backend's overflow rule (NaN or
    # saturation) decides
    return y.clamp_(-E4M3_MAX, E4M3_MAX).to(float8_dtype()), scale_T


def dequantise(q_TX: torch.Tensor, scale_T: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q * scale in float32, rounded once into `dtype`. On the host the e4m3 values come from a
    256-entry table (`e4m3_values`): ~3x torch's element-wise float8 conversion on a CPU core
    (~500 vs ~150 M values/s), which the training loader pays for every value it reads."""
    if q_TX.device.type == "cpu":
        x = torch.from_numpy(e4m3_values()[q_TX.view(torch.uint8).numpy()])
    else:
        x = q_TX.float()
    return x.mul_(scale_T.float().view(-1, *([1] * (q_TX.dim() - 1)))).to(dtype)


@functools.cache
def e4m3_values() -> np.ndarray:
    """float32 value of each of the 256 float8_e4m3fn bit patterns (0x7F and 0xFF are NaN)."""
    return torch.arange(256, dtype=torch.uint8).view(float8_dtype()).float().numpy()


def quantise_states(states_TKD: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """extract's rows [T, K+1, D] (K aux states, then the final one) -> (q_TKD, scales_T2), column 0
    the aux scale, column 1 the final one.

    Aux and final get one scale each. The aux states are the residual stream, whose magnitude grows
    with depth and carries a few outlier channels (the "massive activations" of large targets, in
    the thousands); the final state is the final norm's output, far smaller. Under one shared
    scale the final state's values sit that ratio below the token's amax, more of them in e4m3's
    subnormal range where mantissa bits are lost, and it is the state the teacher logits come
    from. On SmolLM2-135M the aux amax is ~19x the final's (medians 362 and 19.6): shared, the
    final state's relative RMS error is 2.6% instead of 2.3%; the gap grows with the ratio. A
    second scale costs 4 bytes per token next to (K+1) x D."""
    t = states_TKD.shape[0]
    q_TKD = torch.empty(states_TKD.shape, dtype=float8_dtype(), device=states_TKD.device)
    scales_T2 = torch.empty(t, 2, dtype=torch.float32, device=states_TKD.device)
    step = max(1, CHUNK_ELEMENTS // max(1, states_TKD[0].numel()))
    for a in range(0, t, step):
        rows = states_TKD[a : a + step]
        q_TKD[a : a + step, :k], scales_T2[a : a + step, 0] = quantise(rows[:, :k])
        q_TKD[a : a + step, k], scales_T2[a : a + step, 1] = quantise(rows[:, k])
    return q_TKD, scales_T2


def dequantise_states(q_SKD: torch.Tensor, scales_S2: torch.Tensor, k: int,
                      dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of quantise_states -> (aux_SKD, final_SD) in `dtype`."""
    return dequantise(q_SKD[:, :k], scales_S2[:, 0], dtype), dequantise(q_SKD[:, k], scales_S2[:, 1], dtype)
