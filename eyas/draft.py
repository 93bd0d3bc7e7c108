"""The EAGLE-3 draft model, parameter for parameter the layout of the EAGLE-3 reference / SGLang
(with num_layers > 1, vLLM's multi-layer EAGLE-3: the reference layer, then plain Llama layers).

Legend: B batch, S sequence (queries), P prefix keys, D draft hidden, Dt target hidden, K aux
layers, H heads, Hkv kv heads, d head dim, W draft vocab, V target vocab.

    fc                      Linear(K*Dt -> D, no bias): fuses the K aux states (layer-id order)
    fc_norm.{k}             RMSNorm(Dt) on aux state k before fc (EAGLE 3.1's fc_norm; only then)
    midlayer.input_layernorm   RMSNorm(D) on the token embedding
    midlayer.hidden_norm       RMSNorm(D) on the hidden state h
    midlayer.self_attn.{q,k,v}_proj  Linear(2D -> H*d / Hkv*d): input cat([norm(emb), norm(h)])
    midlayer.self_attn.o_proj  Linear(H*d -> D)
    midlayer.post_attention_layernorm, midlayer.mlp.{gate,up,down}_proj  (Llama gated MLP)
    with attention=mla (an MLA target's own attention, vLLM's deepseek_eagle3.py layout), layer 0's
    self_attn is `MLAAttention`: {q_a_proj, q_a_layernorm, q_b_proj | q_proj}, kv_a_proj_with_mqa,
    kv_a_layernorm, kv_b_proj, o_proj; keys carry qk_nope + qk_rope dims, values v_head_dim
    extra_layers.{i}        draft layer i+1 when num_layers > 1: a plain Llama decoder layer
                            (input_layernorm, self_attn.{q,k,v}_proj Linear(D -> ..), o_proj,
                            post_attention_layernorm, mlp) on the residual stream of the layer
                            before it (vLLM's multi-layer EAGLE-3, llama_eagle3.py `layer_idx > 0`)
    norm                    final RMSNorm(D)
    lm_head                 Linear(D -> W, no bias)
    d2t int64 [W], t2d bool [V]   vocab mapping buffers (saved)
    embed_weight [V, D]     the target's input embedding: frozen, a non-persistent buffer (never saved)

The residual around attention is the **un-normed** h (the reference); with
`norm_before_residual=True` it is hidden_norm(h) (the variant some vLLM/speculators checkpoints
use). `forward_step` returns the state fed back as h at the next draft step (the pre-norm output of
the last layer; with EAGLE 3.1's `norm_output=True` its norm, the tensor lm_head reads, so `logits`
then applies no norm of its own) and the keys/values of this step, so callers own their caches:
training-time test (eyas.ttt) concatenates step blocks with a diagonal mask; speculative decoding (eyas.spec)
keeps an ordinary KV cache. With num_layers = L > 1 the keys/values of all layers travel as one
tensor with L*Hkv heads (layer l owns heads l*Hkv .. (l+1)*Hkv - 1): every cache stays a single
[B, L*Hkv, P, d] tensor along the sequence axis, and every layer sees the same positions and mask.

This module knows nothing of distribution (DDP/FSDP wrap it from outside).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


SHAPE_FIELDS = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
                "num_layers", "target_hidden_size", "num_aux_layers", "aux_layer_ids", "draft_vocab_size",
                "vocab_size", "norm_before_residual", "fc_norm", "norm_output", "attention", "q_lora_rank",
                "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
"""DraftConfig fields two drafts must share to carry weights from one to the other: --train.init_from
(with the vocabulary, unless remapped) and --export.average_with (whatever the vocabulary)."""


@dataclass
class DraftConfig:
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    target_hidden_size: int
    num_aux_layers: int
    draft_vocab_size: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    hidden_act: str = "silu"
    norm_before_residual: bool = False
    aux_layer_ids: list[int] = field(default_factory=list)
    num_layers: int = 1
    fc_norm: bool = False
    """EAGLE 3.1: an RMSNorm of its own on each aux state before fc (vLLM's `fc_norm`)."""
    norm_output: bool = False
    """EAGLE 3.1: the state fed back to the next draft step is norm(h), the one lm_head reads,
    not the pre-norm h (vLLM's `norm_output`)."""
    # attention=mla: multi-head latent attention with the target's sizes (`mla_shape`); then
    # num_key_value_heads = num_attention_heads and head_dim = qk_nope_head_dim + qk_rope_head_dim
    # (the decompressed keys), q_lora_rank 0 = no query compression
    attention: str = "gqa"
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    sliding_window: int = 0
    """W > 0: every draft layer attends only to keys less than W positions back (a query at position
    p sees keys at p-W+1 .. p, W keys with its own; 0 = full attention). The engines' convention:
    transformers masking_utils.py `sliding_window_overlay` (kv_idx > q_idx - sliding_window); vLLM
    0.32 v1/attention/backends/flash_attn.py window (sliding_window - 1, 0), flex_attention.py
    |q_idx - kv_idx| < sliding_window, models/llama.py giving a layer `config.sliding_window` when
    `config.layer_types[i] == "sliding_attention"`; its CPU backend (v1/attention/backends/cpu_attn.py,
    the window handed to its C++ kernel) served a windowed SmolLM2 draft at eyas's tau, 4.00, where
    eyas with a window one shorter / longer reads 3.85 / 3.92 (tests/test_vllm.py). Positions are
    RoPE positions (a TTT step-i key sits at pos_t + i), so `in_window` compares positions, never
    cache slots. Not a shape field: it changes no weight."""

    @classmethod
    def from_target(cls, tcfg, draft_vocab_size: int, aux_layer_ids: list[int], **overrides: Any) -> "DraftConfig":
        """Sizes from the target's (text) config; any field can be overridden."""
        tcfg = tcfg.get_text_config() if hasattr(tcfg, "get_text_config") else tcfg
        heads = tcfg.num_attention_heads
        hidden = tcfg.hidden_size
        rope_params = getattr(tcfg, "rope_parameters", None)
        if rope_params:  # transformers 5.x
            theta = rope_params.get("rope_theta", 10000.0)
            kind = rope_params.get("rope_type", rope_params.get("type", "default"))
            scaling = {k: v for k, v in rope_params.items() if k != "rope_theta"} if kind != "default" else None
        else:
            theta = getattr(tcfg, "rope_theta", 10000.0)
            scaling = getattr(tcfg, "rope_scaling", None)
        kw: dict[str, Any] = dict(
            hidden_size=hidden,
            num_attention_heads=heads,
            num_key_value_heads=getattr(tcfg, "num_key_value_heads", None) or heads,
            head_dim=getattr(tcfg, "head_dim", None) or hidden // heads,
            intermediate_size=tcfg.intermediate_size,
            target_hidden_size=hidden,
            num_aux_layers=len(aux_layer_ids),
            draft_vocab_size=draft_vocab_size,
            vocab_size=tcfg.vocab_size,
            rms_norm_eps=getattr(tcfg, "rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=dict(scaling) if scaling else None,
            max_position_embeddings=getattr(tcfg, "max_position_embeddings", 4096),
            hidden_act=getattr(tcfg, "hidden_act", "silu"),
            aux_layer_ids=list(aux_layer_ids),
        )
        kw.update({k: v for k, v in overrides.items() if v not in (None, 0, "")})
        if "hidden_size" in overrides and overrides["hidden_size"] and "head_dim" not in overrides:
            kw["head_dim"] = kw["hidden_size"] // kw["num_attention_heads"]
        if kw.get("attention") == "mla":
            kw.update(mla_shape(tcfg, kw["num_attention_heads"]))
        return cls(**kw)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def mla_shape(tcfg, num_heads: int) -> dict[str, Any]:
    """An MLA draft's sizes: the target's own latent and head sizes (its layer is one of the target's
    attention layers in shape, reading a 2D-wide input). After decompression every head has its own
    key and value: num_key_value_heads = num_heads, head_dim = the query/key head (no-RoPE + RoPE)."""
    from eyas.errors import ConfigError

    if not getattr(tcfg, "kv_lora_rank", None):
        raise ConfigError(
            f"--train.draft_attention=mla needs a target with multi-head latent attention (kv_lora_rank in its "
            f"config); this {getattr(tcfg, 'model_type', '?')} target has none: use --train.draft_attention=gqa"
        )
    nope, rope = int(tcfg.qk_nope_head_dim), int(tcfg.qk_rope_head_dim)
    return dict(q_lora_rank=int(getattr(tcfg, "q_lora_rank", None) or 0), kv_lora_rank=int(tcfg.kv_lora_rank),
                qk_nope_head_dim=nope, qk_rope_head_dim=rope, v_head_dim=int(tcfg.v_head_dim),
                num_key_value_heads=num_heads, head_dim=nope + rope)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Rotary(nn.Module):
    """RoPE exactly as the target's config computes it (transformers' own init functions)."""

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        scaling = dict(cfg.rope_scaling or {})
        kw: dict[str, Any] = dict(
            hidden_size=cfg.num_attention_heads * cfg.head_dim,
            num_attention_heads=cfg.num_attention_heads,
            head_dim=cfg.head_dim,
            max_position_embeddings=cfg.max_position_embeddings,
            rope_theta=cfg.rope_theta,
            rope_scaling=scaling or None,
        )
        lcfg = LlamaConfig(**kw)
        if getattr(lcfg, "rope_parameters", None) is not None:  # transformers 5.x
            lcfg.rope_parameters = {"rope_type": scaling.get("rope_type", scaling.get("type", "default")), **scaling, "rope_theta": cfg.rope_theta}
        self.inner = LlamaRotaryEmbedding(lcfg)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inner(x, position_ids)


def in_window(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int) -> torch.Tensor:
    """bool [.., Sq, Sk]: key at position k_pos within `window` of the query at q_pos (0 = all).
    Causality is the caller's mask; this only cuts keys W or more positions back."""
    if window <= 0:
        return torch.ones(q_pos.shape[-1], k_pos.shape[-1], dtype=torch.bool, device=q_pos.device)
    return (q_pos.unsqueeze(-1) - k_pos.unsqueeze(-2)) < window


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x_BHSd: torch.Tensor, cos_BSd: torch.Tensor, sin_BSd: torch.Tensor) -> torch.Tensor:
    # cos/sin in q/k's dtype (as transformers does): fp32 tables would silently upcast bf16 q/k
    # under autocast and push attention off the fused bf16 kernels.
    cos, sin = cos_BSd.unsqueeze(1).to(x_BHSd.dtype), sin_BSd.unsqueeze(1).to(x_BHSd.dtype)
    return x_BHSd * cos + rotate_half(x_BHSd) * sin


_flex_call = None


def init_flex_attention() -> None:
    """Compile flex_attention once per process (eager flex is a slow reference path), with
    automatic dynamic shapes so new sequence / key lengths stop recompiling after the first
    change. The caller is dynamo-disabled, so a compiled forward_step breaks its graph at the
    attention and runs this one compiled kernel. Call it before compiling a caller (lazy here
    because importing dynamo costs seconds that most eyas commands do not need)."""
    global _flex_call
    if _flex_call is None:
        from torch.nn.attention.flex_attention import flex_attention as _flex

        compiled = torch.compile(_flex)

        def call(q, k, v, block_mask, enable_gqa):
            return compiled(q, k, v, block_mask=block_mask, enable_gqa=enable_gqa)

        _flex_call = torch.compiler.disable(call)


def flex_attention(q_BHSd, k_BHPd, v_BHPd, block_mask, enable_gqa: bool) -> torch.Tensor:
    if _flex_call is None:
        assert not torch.compiler.is_compiling(), "call eyas.draft.init_flex_attention() before torch.compile"
        init_flex_attention()
    return _flex_call(q_BHSd, k_BHPd, v_BHPd, block_mask, enable_gqa)


class Attention(nn.Module):
    def __init__(self, cfg: DraftConfig, in_dim: int):
        super().__init__()
        self.h, self.hkv, self.d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(in_dim, self.h * self.d, bias=False)
        self.k_proj = nn.Linear(in_dim, self.hkv * self.d, bias=False)
        self.v_proj = nn.Linear(in_dim, self.hkv * self.d, bias=False)
        self.o_proj = nn.Linear(self.h * self.d, cfg.hidden_size, bias=False)

    def qkv(self, x_BSI: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        b, s, _ = x_BSI.shape
        q = self.q_proj(x_BSI).view(b, s, self.h, self.d).transpose(1, 2)
        k = self.k_proj(x_BSI).view(b, s, self.hkv, self.d).transpose(1, 2)
        v = self.v_proj(x_BSI).view(b, s, self.hkv, self.d).transpose(1, 2)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def attend(self, q_BHSd, k_BHPd, v_BHPd, mask_BSP) -> torch.Tensor:
        """Attention over all given keys. mask: bool (True = may attend) broadcastable to
        [B, 1, S, P] for SDPA, or a FlexAttention BlockMask (then flex_attention runs)."""
        if type(mask_BSP).__name__ == "BlockMask":
            o = flex_attention(q_BHSd, k_BHPd, v_BHPd, mask_BSP, enable_gqa=self.hkv != self.h)
        else:
            if mask_BSP is not None and mask_BSP.dim() == 3:
                mask_BSP = mask_BSP.unsqueeze(1)
            if self.hkv != self.h:
                rep = self.h // self.hkv
                k_BHPd = k_BHPd.repeat_interleave(rep, dim=1)
                v_BHPd = v_BHPd.repeat_interleave(rep, dim=1)
            o = F.scaled_dot_product_attention(q_BHSd, k_BHPd, v_BHPd, attn_mask=mask_BSP)
        b, _, s, _ = o.shape
        return self.o_proj(o.transpose(1, 2).reshape(b, s, self.h * self.d))


def apply_rope_interleaved(x_BHSd: torch.Tensor, cos_BSd: torch.Tensor, sin_BSd: torch.Tensor) -> torch.Tensor:
    """RoPE on interleaved pairs (x_2i, x_2i+1), pair i turned by frequency i in place: DeepSeek's
    layout, which vLLM's MLA serves (is_neox_style=False). cos/sin as `Rotary` returns them (the
    frequencies twice over): their first half."""
    half = cos_BSd.shape[-1] // 2
    cos = cos_BSd[..., :half].unsqueeze(1).to(x_BHSd.dtype)
    sin = sin_BSd[..., :half].unsqueeze(1).to(x_BHSd.dtype)
    even, odd = x_BHSd[..., 0::2], x_BHSd[..., 1::2]
    return torch.stack([even * cos - odd * sin, odd * cos + even * sin], dim=-1).flatten(-2)


def mla_softmax_factor(rope_scaling: dict[str, Any] | None) -> float:
    """DeepSeek's YaRN also sharpens MLA's softmax by (0.1 * mscale_all_dim * ln(factor) + 1)^2
    (vLLM's DeepseekV2MLAAttention, DeepSeek-V3's model.py); 1 without YaRN."""
    s = rope_scaling or {}
    factor = float(s.get("factor") or 1.0)
    if s.get("rope_type", s.get("type")) != "yarn" or factor <= 1.0:
        return 1.0
    return (0.1 * float(s.get("mscale_all_dim") or 0.0) * math.log(factor) + 1.0) ** 2


class MLAAttention(nn.Module):
    """Multi-head latent attention (DeepSeek-V2/V3), decompressed: the latent c_KV is expanded to
    per-head keys [k_nope | k_rope] (k_rope one vector shared by the heads) and values of
    v_head_dim, so callers keep k [B, H, P, dn+dr] and v [B, H, P, dv] caches as for any draft.
    vLLM serves the same weights in the absorbed form (the same attention, computed on the latent).
    The softmax scale is (dn+dr)^-0.5 times `mla_softmax_factor`, folded into q."""

    def __init__(self, cfg: DraftConfig, in_dim: int):
        super().__init__()
        self.h = self.hkv = cfg.num_attention_heads
        self.dn, self.dr, self.dv, self.r = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
        if cfg.q_lora_rank:
            self.q_a_proj = nn.Linear(in_dim, cfg.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, self.h * (self.dn + self.dr), bias=False)
        else:
            self.q_proj = nn.Linear(in_dim, self.h * (self.dn + self.dr), bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(in_dim, self.r + self.dr, bias=False)
        self.kv_a_layernorm = RMSNorm(self.r, cfg.rms_norm_eps)
        self.kv_b_proj = nn.Linear(self.r, self.h * (self.dn + self.dv), bias=False)
        self.o_proj = nn.Linear(self.h * self.dv, cfg.hidden_size, bias=False)
        self.q_factor = mla_softmax_factor(cfg.rope_scaling)

    def qkv(self, x_BSI: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        b, s, _ = x_BSI.shape
        if hasattr(self, "q_a_proj"):
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x_BSI)))
        else:
            q = self.q_proj(x_BSI)
        q_BHSd = q.view(b, s, self.h, self.dn + self.dr).transpose(1, 2)
        c_BSR, k_rope_BSd = self.kv_a_proj_with_mqa(x_BSI).split([self.r, self.dr], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(c_BSR)).view(b, s, self.h, self.dn + self.dv).transpose(1, 2)
        k_nope, v = kv.split([self.dn, self.dv], dim=-1)
        q_rope = apply_rope_interleaved(q_BHSd[..., self.dn:], cos, sin)
        k_rope = apply_rope_interleaved(k_rope_BSd.unsqueeze(1), cos, sin).expand(b, self.h, s, self.dr)
        q = torch.cat([q_BHSd[..., : self.dn], q_rope], dim=-1)
        if self.q_factor != 1.0:
            q = q * self.q_factor
        return q, torch.cat([k_nope, k_rope], dim=-1), v

    def attend(self, q_BHSd, k_BHPd, v_BHPd, mask_BSP) -> torch.Tensor:
        """As `Attention.attend` (no grouped heads); values and output heads are v_head_dim wide."""
        if type(mask_BSP).__name__ == "BlockMask":
            o = flex_attention(q_BHSd, k_BHPd, v_BHPd, mask_BSP, enable_gqa=False)
        else:
            if mask_BSP is not None and mask_BSP.dim() == 3:
                mask_BSP = mask_BSP.unsqueeze(1)
            o = F.scaled_dot_product_attention(q_BHSd, k_BHPd, v_BHPd, attn_mask=mask_BSP)
        b, _, s, _ = o.shape
        return self.o_proj(o.transpose(1, 2).reshape(b, s, self.h * self.dv))


class MLP(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        from transformers.activations import ACT2FN

        self.act = ACT2FN[cfg.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class Eagle3Layer(nn.Module):
    """Draft layer 0: attention over cat(norm(embedding), norm(h)), 2D wide."""

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.norm_before_residual = cfg.norm_before_residual
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.attention == "mla":
            self.self_attn = MLAAttention(cfg, 2 * cfg.hidden_size)
        else:
            self.self_attn = Attention(cfg, 2 * cfg.hidden_size)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)


class DecoderLayer(nn.Module):
    """Draft layers 1..L-1: a plain pre-norm Llama decoder layer on the residual stream."""

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, cfg.hidden_size)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)


class Eagle3Draft(nn.Module):
    def __init__(self, cfg: DraftConfig, embed_weight_VD: torch.Tensor | None = None):
        super().__init__()
        self.config = cfg
        self.fc = nn.Linear(cfg.num_aux_layers * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.fc_norm = (nn.ModuleList(RMSNorm(cfg.target_hidden_size, cfg.rms_norm_eps) for _ in range(cfg.num_aux_layers))
                        if cfg.fc_norm else None)
        if cfg.num_layers < 1:
            raise ValueError(f"num_layers={cfg.num_layers}: a draft has at least one layer")
        if cfg.attention == "mla" and cfg.num_layers != 1:
            raise ValueError(f"num_layers={cfg.num_layers}: an MLA draft has one layer")
        self.midlayer = Eagle3Layer(cfg)
        self.extra_layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers - 1))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        # MLA turns only the qk_rope_head_dim part of each head
        self.rotary = Rotary(dataclasses.replace(cfg, head_dim=cfg.qk_rope_head_dim) if cfg.attention == "mla" else cfg)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))
        if embed_weight_VD is None:
            embed_weight_VD = torch.zeros(cfg.vocab_size, cfg.hidden_size)
        self.register_buffer("embed_weight", embed_weight_VD.detach(), persistent=False)

    def set_vocab(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        assert d2t.shape == self.d2t.shape and t2d.shape == self.t2d.shape, (d2t.shape, t2d.shape)
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    def set_embedding(self, embed_weight_VD: torch.Tensor) -> None:
        """Install the target's (frozen) input embedding; it is never saved with the draft."""
        assert embed_weight_VD.shape == (self.config.vocab_size, self.config.hidden_size), embed_weight_VD.shape
        self.embed_weight = embed_weight_VD.detach().to(self.fc.weight.device)

    def embed(self, input_ids_BS: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids_BS, self.embed_weight)

    def fuse(self, aux_BSKD: torch.Tensor) -> torch.Tensor:
        """fc over the K aux states concatenated in layer-id order -> h_BSD (step 0 input); with
        fc_norm each state k first through its own fc_norm[k] (vLLM norms each chunk of the concat)."""
        if self.fc_norm is not None:
            aux_BSKD = torch.stack([norm(aux_BSKD[..., k, :]) for k, norm in enumerate(self.fc_norm)], dim=-2)
        return self.fc(aux_BSKD.flatten(-2).to(self.fc.weight.dtype))

    def forward_step(
        self,
        input_ids_BS: torch.Tensor,
        h_BSD: torch.Tensor,
        position_ids_BS: torch.Tensor,
        past_k: torch.Tensor | None = None,
        past_v: torch.Tensor | None = None,
        mask_BSP: torch.Tensor | None = None,
        kv_len: int = 0,
        key_pos: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One draft step. Keys attended = cat(past_k, this step's k) along the sequence axis.

        mask_BSP: bool [B or 1, S, P+S] (True = attend) or a FlexAttention BlockMask over the
        P+S keys; None with no past means causal. kv_len: zero-pad the keys/values to this length
        (fixed shapes for FlexAttention; the mask must block the padding).
        key_pos: positions of the P+S keys (past, then this step's), [P+S] or [B, P+S]: with a
        sliding window the mask is cut to it (`in_window`); without key_pos the caller's mask must
        already hold the window (TTT's masks do). None with no past applies it on position_ids.
        Returns (prenorm_BSD: the output fed back as h, pre-norm unless config.norm_output; k_BHSd,
        v_BHSd of this step, after RoPE; with L layers H = L*Hkv, layer by layer).
        """
        layer = self.midlayer
        emb = self.embed(input_ids_BS).to(h_BSD.dtype)
        h_normed = layer.hidden_norm(h_BSD)
        residual = h_normed if layer.norm_before_residual else h_BSD
        x = torch.cat([layer.input_layernorm(emb), h_normed], dim=-1)
        cos, sin = self.rotary(x, position_ids_BS)
        if mask_BSP is None:
            assert past_k is None, "a mask is required when past keys are given"
            s = x.shape[1]
            mask_BSP = torch.ones(s, s, dtype=torch.bool, device=x.device).tril().unsqueeze(0)
            key_pos = position_ids_BS
        if self.config.sliding_window and key_pos is not None:
            mask_BSP = mask_BSP & in_window(position_ids_BS, key_pos, self.config.sliding_window)
        hkv = layer.self_attn.hkv
        keys, values = [], []
        for i, block in enumerate([layer, *self.extra_layers]):
            if i > 0:
                residual, x = hidden, block.input_layernorm(hidden)
            q, k, v = block.self_attn.qkv(x, cos, sin)
            keys.append(k)
            values.append(v)
            past = slice(i * hkv, (i + 1) * hkv)
            k_all = k if past_k is None else torch.cat([past_k[:, past], k], dim=2)
            v_all = v if past_v is None else torch.cat([past_v[:, past], v], dim=2)
            if kv_len > k_all.shape[2]:
                k_all = F.pad(k_all, (0, 0, 0, kv_len - k_all.shape[2]))
                v_all = F.pad(v_all, (0, 0, 0, kv_len - v_all.shape[2]))
            hidden = residual + block.self_attn.attend(q, k_all, v_all, mask_BSP)
            hidden = hidden + block.mlp(block.post_attention_layernorm(hidden))
        if self.config.norm_output:  # EAGLE 3.1: the next step (and lm_head) reads the normed state
            hidden = self.norm(hidden)
        if len(keys) == 1:
            return hidden, keys[0], values[0]
        return hidden, torch.cat(keys, dim=1), torch.cat(values, dim=1)

    def logits(self, prenorm_BSD: torch.Tensor) -> torch.Tensor:
        """Draft-vocab logits [.., W] from forward_step's output (already normed with norm_output)."""
        return self.lm_head(prenorm_BSD if self.config.norm_output else self.norm(prenorm_BSD))

    def num_trainable_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters() if p.requires_grad)
