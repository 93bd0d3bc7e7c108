"""Multi-head latent attention written from the DeepSeek-V2/V3 papers' equations, and YaRN as
DeepSeek-V3's own inference code computes it: the independent reference that judges transformers'
DeepseekV3Attention and vLLM's MLA on the same weights. It reads the checkpoint's tensors by name
and uses no transformers or vLLM code. Float64 throughout.

Legend: S tokens, H heads, D hidden, R latent (kv_lora_rank), dn / dr / dv the no-RoPE, RoPE and
value head dims.

    c_Q = RMSNorm(W_DQ h)          with q_lora (q_lora_rank set); without it q = W_Q h
    q = W_UQ c_Q                   per head [q_nope (dn) | q_rope (dr)]
    [c_KV | k_rope] = W_DKV h      c_KV = RMSNorm(c_KV) (R wide), k_rope shared by every head
    [k_nope | v] = W_UKV c_KV      per head
    RoPE on interleaved pairs (x_2i, x_2i+1), angle pos * f_i, f_i = base^(-2i / dr) (YaRN: blended)
    o_t = sum_{s <= t} softmax_s(q_t . k_s * (dn + dr)^-0.5 * m) v_s     (m = 1, or YaRN's mscale^2)
    out = W_O o
"""

from __future__ import annotations

import math
from typing import Any

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.double()
    return weight.double() * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def rope_interleaved(x_SHd: torch.Tensor, pos_S: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotate each pair (x_2i, x_2i+1) of the last axis by pos * inv_freq[i], in place of the pair."""
    angle_S1I = (pos_S.double()[:, None] * inv_freq.double()[None])[:, None]
    cos, sin = angle_S1I.cos(), angle_S1I.sin()
    even, odd = x_SHd[..., 0::2].double(), x_SHd[..., 1::2].double()
    out = torch.empty(x_SHd.shape, dtype=torch.float64)
    out[..., 0::2] = even * cos - odd * sin
    out[..., 1::2] = odd * cos + even * sin
    return out


def rope_frequencies(rope_dim: int, base: float, yarn: dict[str, Any] | None = None) -> tuple[torch.Tensor, float]:
    """-> (inv_freq [rope_dim / 2], the factor the softmax scale is multiplied by).

    YaRN as DeepSeek-V3's inference code has it (model.py precompute_freqs_cis and MLA's
    softmax_scale): the frequencies between the correction dims of beta_fast and beta_slow blend
    linearly from extrapolated (f) to interpolated (f / factor); the scale gains
    (0.1 * mscale_all_dim * ln(factor) + 1)^2."""
    inv_freq = 1.0 / base ** (torch.arange(0, rope_dim, 2, dtype=torch.float64) / rope_dim)
    if not yarn:
        return inv_freq, 1.0
    factor, original = float(yarn["factor"]), float(yarn["original_max_position_embeddings"])

    def correction_dim(rotations: float) -> float:
        return rope_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(yarn["beta_fast"])), 0)
    high = min(math.ceil(correction_dim(yarn["beta_slow"])), rope_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(rope_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    inv_freq = inv_freq / factor * ramp + inv_freq * (1 - ramp)
    mscale = 0.1 * float(yarn.get("mscale_all_dim", 1.0)) * math.log(factor) + 1.0
    return inv_freq, mscale * mscale


def rope_settings(config: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(base, YaRN settings or None) from a config.json in DeepSeek's form (rope_theta, rope_scaling)
    or transformers 5's (rope_parameters)."""
    params = dict(config.get("rope_scaling") or config.get("rope_parameters") or {})
    base = float(config.get("rope_theta") or params.get("rope_theta", 10000.0))
    kind = params.get("type", params.get("rope_type", "default"))
    return base, (params if kind == "yarn" else None)


def mla_attention(weights: dict[str, torch.Tensor], prefix: str, config: dict[str, Any], h_SD: torch.Tensor,
                  pos_S: torch.Tensor) -> torch.Tensor:
    """One MLA layer's attention output [S, D] (after W_O) for the normed hidden states h_SD, causal
    over the S tokens. `weights` holds the checkpoint's tensors; `prefix` names the attention module
    (e.g. model.layers.0.self_attn); `config` is the checkpoint's config.json."""
    H, dn, dr, dv = (config[k] for k in ("num_attention_heads", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"))
    R, eps = config["kv_lora_rank"], config.get("rms_norm_eps", 1e-6)
    inv_freq, scale_factor = rope_frequencies(dr, *rope_settings(config))

    def w(name: str) -> torch.Tensor:
        return weights[f"{prefix}.{name}"].double()

    h, S = h_SD.double(), h_SD.shape[0]
    if config.get("q_lora_rank"):
        q = rms_norm(h @ w("q_a_proj.weight").T, w("q_a_layernorm.weight"), eps) @ w("q_b_proj.weight").T
    else:
        q = h @ w("q_proj.weight").T
    q_SHd = q.view(S, H, dn + dr)
    q_nope, q_rope = q_SHd[..., :dn], rope_interleaved(q_SHd[..., dn:], pos_S, inv_freq)
    latent = h @ w("kv_a_proj_with_mqa.weight").T
    c_SR = rms_norm(latent[:, :R], w("kv_a_layernorm.weight"), eps)
    k_rope_Sd = rope_interleaved(latent[:, None, R:], pos_S, inv_freq)[:, 0]
    kv_SHd = (c_SR @ w("kv_b_proj.weight").T).view(S, H, dn + dv)
    k_nope, v = kv_SHd[..., :dn], kv_SHd[..., dn:]
    scores_HSS = torch.einsum("shd,thd->hst", q_nope, k_nope) + torch.einsum("shd,td->hst", q_rope, k_rope_Sd)
    scores_HSS = scores_HSS * (dn + dr) ** -0.5 * scale_factor
    future = torch.ones(S, S, dtype=torch.bool).triu(1)
    p_HSS = scores_HSS.masked_fill(future, float("-inf")).softmax(-1)
    o_SV = torch.einsum("hst,thd->shd", p_HSS, v).reshape(S, H * dv)
    return o_SV @ w("o_proj.weight").T


def first_layer_attention(weights: dict[str, torch.Tensor], config: dict[str, Any], ids_S: torch.Tensor) -> torch.Tensor:
    """Layer 0's attention output for token ids: embedding, input RMSNorm, `mla_attention`."""
    h = rms_norm(weights["model.embed_tokens.weight"][ids_S], weights["model.layers.0.input_layernorm.weight"],
                 config.get("rms_norm_eps", 1e-6))
    return mla_attention(weights, "model.layers.0.self_attn", config, h, torch.arange(ids_S.numel()))
