"""eyas.fp8 against hand-computed e4m3 roundings, and its error bound against a float64 reference.

e4m3 (float8_e4m3fn): 1.mmm x 2^e for e >= -6, subnormals 0.mmm x 2^-6 (step 2^-9), max 448.
"""

from __future__ import annotations

import pytest
import torch

from eyas import fp8
from eyas.config.extract import ExtractConfig
from eyas.errors import ConfigError


def test_quantise_rounds_as_computed_by_hand():
    x_TD = torch.tensor([
        [7.0, -1.0, 0.1, 0.001],    # amax 7: scale 7/448 = 1/64, y = 64 x
        [0.0, 0.0, 0.0, 0.0],       # all zero: scale 1e-12, zeros back
        [448.0, 0.005, -0.01, 300.0],  # amax 448: scale 1, y = x
    ])
    q_TD, scale_T = fp8.quantise(x_TD)
    assert q_TD.dtype == torch.float8_e4m3fn and scale_T.dtype == torch.float32
    assert scale_T.tolist() == [1 / 64, pytest.approx(1e-12), 1.0]
    # token 0, y = [448, -64, 6.4, 0.064]: 448 and -64 are exact; 6.4 = 1.6 x 4 -> 1.625 x 4 = 6.5 (1.5 is
    # 0.1 away, 1.625 0.025); 0.064 = 1.024 x 2^-4 -> 1.0 x 2^-4 = 0.0625
    # token 2: 0.005 is subnormal, 2.56 steps of 2^-9 -> 3; -0.01 is 5.12 steps -> 5;
    # 300 = 1.171875 x 256 -> 1.125 x 256 = 288 (1.25 is 0.078 away, 1.125 0.047)
    want_TD = torch.tensor([
        [448.0, -64.0, 6.5, 0.0625],
        [0.0, 0.0, 0.0, 0.0],
        [448.0, 3 * 2**-9, -5 * 2**-9, 288.0],
    ])
    assert torch.equal(q_TD.float(), want_TD)
    back_TD = fp8.dequantise(q_TD, scale_T, torch.float32)
    assert back_TD.tolist() == [[7.0, -1.0, 6.5 / 64, 2**-10], [0.0] * 4, [448.0, 3 * 2**-9, -5 * 2**-9, 288.0]]
    assert fp8.dequantise(q_TD, scale_T, torch.bfloat16).dtype == torch.bfloat16


def test_dequantise_reads_e4m3_bit_patterns_as_the_format_defines_them():
    """Sign, 4 exponent bits (bias 7), 3 mantissa bits; exponent 0 is subnormal (m/8 x 2^-6);
    S.1111.111 is NaN (no infinities in e4m3fn). Host (table) path, scale 1 and 2."""
    bits = torch.tensor([0x00, 0x01, 0x07, 0x08, 0x38, 0xB8, 0x3C, 0x7E, 0xFE, 0x7F, 0xFF], dtype=torch.uint8)
    want = [0.0, 2**-9, 7 * 2**-9, 2**-6, 1.0, -1.0, 1.5, 448.0, -448.0, float("nan"), float("nan")]
    q = bits.view(torch.float8_e4m3fn)[:, None]
    got = fp8.dequantise(q, torch.ones(len(bits)), torch.float32)[:, 0]
    assert torch.equal(got[:-2], torch.tensor(want[:-2])) and bool(got[-2:].isnan().all())
    twice = fp8.dequantise(q[:-2], torch.full((len(bits) - 2,), 2.0), torch.float32)[:, 0]
    assert torch.equal(twice, 2 * torch.tensor(want[:-2]))
    strided = fp8.dequantise(q.expand(-1, 3)[:, ::2], torch.ones(len(bits)), torch.float32)  # a column slice
    assert torch.equal(strided[:-2], torch.tensor(want[:-2])[:, None].expand(-1, 2))


def test_quantise_states_scales_aux_and_final_apart():
    # one token, K=1 aux layer, D=2: aux amax 7 -> scale 1/64, final amax 3.5 -> scale 1/128
    states_TKD = torch.tensor([[[7.0, -0.5], [3.5, -0.875]]])
    q_TKD, scales_T2 = fp8.quantise_states(states_TKD, k=1)
    assert scales_T2.tolist() == [[1 / 64, 1 / 128]]
    assert q_TKD.float().tolist() == [[[448.0, -32.0], [448.0, -112.0]]]
    aux_SKD, final_SD = fp8.dequantise_states(q_TKD, scales_T2, 1, torch.float32)
    assert aux_SKD.tolist() == [[[7.0, -0.5]]] and final_SD.tolist() == [[3.5, -0.875]]


def test_error_bound_over_many_magnitudes(monkeypatch):
    """|x' - x| <= max(2^-4 |x|, 2^-10 scale): half an ulp of a 3-bit mantissa relative to the value,
    and half the subnormal step (2^-9 in scaled units) below 2^-6. Values spread over 2^-20..2^10,
    so every binade of e4m3 and its subnormals are hit; checked in float64 against the input."""
    g = torch.Generator().manual_seed(0)
    x_TKD = torch.randn(64, 4, 96, generator=g) * torch.exp2(torch.randint(-20, 11, (64, 4, 96), generator=g).float())
    monkeypatch.setattr(fp8, "CHUNK_ELEMENTS", 1000)  # several chunks of tokens
    q_TKD, scales_T2 = fp8.quantise_states(x_TKD, k=3)
    aux_TKD, final_TD = fp8.dequantise_states(q_TKD, scales_T2, 3, torch.float32)
    x = x_TKD.double()
    for got, want, amax_T in ((aux_TKD, x[:, :3], x[:, :3].abs().flatten(1).amax(1)),
                              (final_TD[:, None], x[:, 3:], x[:, 3].abs().amax(1))):
        scale = (amax_T / 448)[:, None, None]
        bound = torch.maximum(want.abs() / 16, scale / 1024)
        assert bool(((got.double() - want).abs() <= bound * (1 + 1e-6)).all())
        assert bool(((got.double() - want).abs() > bound / 4).any())  # the bound is near tight, not loose


def test_a_torch_without_float8_is_refused_naming_the_flag(monkeypatch):
    monkeypatch.delattr(torch, "float8_e4m3fn")
    with pytest.raises(ConfigError, match="extract.store_dtype=float8"):
        ExtractConfig(store_dtype="float8")
    ExtractConfig(store_dtype="bfloat16")  # the other dtypes do not need it
