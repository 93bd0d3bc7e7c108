"""The EAGLE-3 draft against the reference layout and an independent hand-written decoder step.

Reference layout: the tensors of the EAGLE-3 reference checkpoint for Llama-3.1-8B-Instruct
(yuhuili/EAGLE3-LLaMA3.1-Instruct-8B), the names SGLang's LlamaForCausalLMEagle3 loads.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from eyas.draft import DraftConfig, Eagle3Draft
from eyas.draft_files import load_draft, save_draft

LLAMA31_8B = dict(
    hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336, vocab_size=128256,
    num_hidden_layers=32, rope_theta=500000.0, max_position_embeddings=131072, rms_norm_eps=1e-5,
    rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192},
)

# name -> shape in the reference checkpoint (D 4096, W 32000, V 128256, 3 aux layers)
REFERENCE_8B = {
    "d2t": (32000,),
    "t2d": (128256,),
    "fc.weight": (4096, 3 * 4096),
    "midlayer.input_layernorm.weight": (4096,),
    "midlayer.hidden_norm.weight": (4096,),
    "midlayer.self_attn.q_proj.weight": (4096, 2 * 4096),
    "midlayer.self_attn.k_proj.weight": (1024, 2 * 4096),
    "midlayer.self_attn.v_proj.weight": (1024, 2 * 4096),
    "midlayer.self_attn.o_proj.weight": (4096, 4096),
    "midlayer.post_attention_layernorm.weight": (4096,),
    "midlayer.mlp.gate_proj.weight": (14336, 4096),
    "midlayer.mlp.up_proj.weight": (14336, 4096),
    "midlayer.mlp.down_proj.weight": (4096, 14336),
    "norm.weight": (4096,),
    "lm_head.weight": (32000, 4096),
}


def small_cfg(**kw) -> DraftConfig:
    base = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=48,
                target_hidden_size=24, num_aux_layers=3, draft_vocab_size=20, vocab_size=40, rope_theta=10000.0,
                rms_norm_eps=1e-6)
    base.update(kw)
    return DraftConfig(**base)


def random_draft(cfg: DraftConfig, seed: int = 0) -> Eagle3Draft:
    torch.manual_seed(seed)
    m = Eagle3Draft(cfg, torch.randn(cfg.vocab_size, cfg.hidden_size)).double()
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return m


def test_layout_matches_the_reference_checkpoint():
    tcfg = LlamaConfig(**LLAMA31_8B)
    cfg = DraftConfig.from_target(tcfg, 32000, [2, 16, 29])
    with torch.device("meta"):
        m = Eagle3Draft(cfg)
    sd = m.state_dict()
    assert {k: tuple(v.shape) for k, v in sd.items()} == REFERENCE_8B
    assert "embed_weight" not in sd and not any("rotary" in k for k in sd)
    assert set(dict(m.named_parameters())) == set(REFERENCE_8B) - {"d2t", "t2d"}  # the vocab maps are buffers
    n_ref = sum(math.prod(s) for k, s in REFERENCE_8B.items() if k not in ("d2t", "t2d"))
    assert m.num_trainable_parameters() == n_ref
    assert sd["d2t"].dtype == torch.int64 and sd["t2d"].dtype == torch.bool
    assert all(mod.bias is None for mod in m.modules() if isinstance(mod, torch.nn.Linear))


def test_sizes_default_from_the_target_and_are_overridable():
    tcfg = LlamaConfig(**LLAMA31_8B)
    cfg = DraftConfig.from_target(tcfg, 32000, [2, 16, 29])
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.intermediate_size) == (
        4096, 32, 8, 128, 14336)
    assert cfg.rope_theta == 500000.0 and cfg.rope_scaling["rope_type"] == "llama3" and cfg.rms_norm_eps == 1e-5
    assert cfg.target_hidden_size == 4096 and cfg.num_aux_layers == 3 and cfg.aux_layer_ids == [2, 16, 29]
    assert not cfg.norm_before_residual
    o = DraftConfig.from_target(tcfg, 32000, [2, 16, 29], num_attention_heads=16, num_key_value_heads=4,
                                intermediate_size=8192, rope_theta=1e6, norm_before_residual=True)
    assert (o.num_attention_heads, o.num_key_value_heads, o.intermediate_size, o.rope_theta) == (16, 4, 8192, 1e6)
    assert o.head_dim == 128 and o.norm_before_residual


def test_rope_is_the_targets():
    tcfg = LlamaConfig(**LLAMA31_8B)
    m_cfg = DraftConfig.from_target(tcfg, 32000, [2, 16, 29])
    from eyas.draft import Rotary

    pos = torch.tensor([[0, 1, 7, 4095, 9000, 100000]])
    x = torch.zeros(1, 6, 8)
    cos, sin = Rotary(m_cfg)(x, pos)
    cos_ref, sin_ref = LlamaRotaryEmbedding(tcfg)(x, pos)
    assert torch.equal(cos, cos_ref) and torch.equal(sin, sin_ref)


def test_fc_fuses_aux_states_in_layer_id_order():
    cfg = small_cfg()
    m = random_draft(cfg)
    aux = torch.randn(2, 5, 3, 24, dtype=torch.float64)
    want = torch.cat([aux[:, :, 0], aux[:, :, 1], aux[:, :, 2]], dim=-1) @ m.fc.weight.T
    torch.testing.assert_close(m.fuse(aux), want)


def rms(x, w, eps):
    return w * (x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def reference_step(m: Eagle3Draft, ids_S, h_SD, pos_S, norm_before_residual: bool):
    """One decoder step written out from the EAGLE-3 description, batch 1, causal."""
    c = m.config
    L = m.midlayer
    emb = m.embed_weight[ids_S]
    x = torch.cat([rms(emb, L.input_layernorm.weight, c.rms_norm_eps), rms(h_SD, L.hidden_norm.weight, c.rms_norm_eps)], -1)
    assert x.shape[-1] == 2 * c.hidden_size
    a = L.self_attn
    s = ids_S.shape[0]
    q = (x @ a.q_proj.weight.T).view(s, c.num_attention_heads, c.head_dim).transpose(0, 1)
    k = (x @ a.k_proj.weight.T).view(s, c.num_key_value_heads, c.head_dim).transpose(0, 1)
    v = (x @ a.v_proj.weight.T).view(s, c.num_key_value_heads, c.head_dim).transpose(0, 1)
    lcfg = LlamaConfig(hidden_size=c.num_attention_heads * c.head_dim, num_attention_heads=c.num_attention_heads,
                       head_dim=c.head_dim, rope_theta=c.rope_theta)
    cos, sin = LlamaRotaryEmbedding(lcfg)(x.float(), pos_S[None])
    q, k = apply_rotary_pos_emb(q[None], k[None], cos.double(), sin.double())
    rep = c.num_attention_heads // c.num_key_value_heads
    k, v = k[0].repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)
    scores = q[0] @ k.transpose(-1, -2) / math.sqrt(c.head_dim)
    scores = scores.masked_fill(~torch.ones(s, s, dtype=torch.bool).tril(), float("-inf"))
    o = (scores.softmax(-1) @ v).transpose(0, 1).reshape(s, -1) @ a.o_proj.weight.T
    residual = rms(h_SD, L.hidden_norm.weight, c.rms_norm_eps) if norm_before_residual else h_SD
    h = residual + o
    y = rms(h, L.post_attention_layernorm.weight, c.rms_norm_eps)
    mlp = L.mlp
    h = h + (F.silu(y @ mlp.gate_proj.weight.T) * (y @ mlp.up_proj.weight.T)) @ mlp.down_proj.weight.T
    return h


@pytest.mark.parametrize("nbr", [False, True])
def test_decoder_step_matches_a_hand_written_reference(nbr):
    cfg = small_cfg(norm_before_residual=nbr)
    m = random_draft(cfg)
    ids = torch.randint(0, cfg.vocab_size, (6,))
    h = torch.randn(6, cfg.hidden_size, dtype=torch.float64) * 3
    pos = torch.tensor([3, 4, 5, 6, 7, 8])
    out, k, v = m.forward_step(ids[None], h[None], pos[None])
    # (RMSNorm computes in fp32 as the reference and transformers do, hence not fp64-tight)
    torch.testing.assert_close(out[0], reference_step(m, ids, h, pos, nbr), rtol=1e-5, atol=1e-5)
    assert k.shape == v.shape == (1, cfg.num_key_value_heads, 6, cfg.head_dim)
    logits = m.logits(out)
    want = rms(out[0], m.norm.weight, cfg.rms_norm_eps) @ m.lm_head.weight.T
    torch.testing.assert_close(logits[0], want, rtol=1e-5, atol=1e-5)
    assert logits.shape[-1] == cfg.draft_vocab_size


def test_eagle31_norms_match_a_hand_written_reference():
    """fc_norm: each aux state through its own RMSNorm before fc (vLLM llama_eagle3.py
    combine_hidden_states); norm_output: the state fed back is norm(h), and lm_head reads it as is."""
    cfg = small_cfg(fc_norm=True, norm_output=True)
    m = random_draft(cfg)
    assert [n.weight.shape for n in m.fc_norm] == [(24,)] * 3
    aux = torch.randn(1, 6, 3, 24, dtype=torch.float64) * 4
    normed = [rms(aux[0, :, k], m.fc_norm[k].weight, cfg.rms_norm_eps) for k in range(3)]
    h = torch.cat(normed, dim=-1) @ m.fc.weight.T
    torch.testing.assert_close(m.fuse(aux)[0], h, rtol=1e-5, atol=1e-5)
    ids, pos = torch.randint(0, cfg.vocab_size, (6,)), torch.arange(6)
    out, _, _ = m.forward_step(ids[None], h[None], pos[None])
    want = rms(reference_step(m, ids, h, pos, False), m.norm.weight, cfg.rms_norm_eps)
    torch.testing.assert_close(out[0], want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(m.logits(out)[0], want @ m.lm_head.weight.T, rtol=1e-5, atol=1e-5)


def test_norm_before_residual_changes_the_output_and_is_recorded(tmp_path):
    a, b = random_draft(small_cfg()), random_draft(small_cfg(norm_before_residual=True))
    ids, h, pos = torch.randint(0, 40, (1, 4)), torch.randn(1, 4, 32, dtype=torch.float64) * 5, torch.arange(4)[None]
    assert not torch.allclose(a.forward_step(ids, h, pos)[0], b.forward_step(ids, h, pos)[0])
    save_draft(b, tmp_path)
    assert json.loads((tmp_path / "draft_config.json").read_text())["norm_before_residual"] is True


def test_embedding_is_frozen_and_never_saved(tmp_path):
    cfg = small_cfg()
    m = random_draft(cfg).float()
    assert "embed_weight" not in dict(m.named_parameters())
    ids, h, pos = torch.randint(0, 40, (1, 5)), torch.randn(1, 5, 32), torch.arange(5)[None]
    m.forward_step(ids, h, pos)[0].sum().backward()
    assert m.embed_weight.grad is None and m.fc.weight.grad is None and m.midlayer.hidden_norm.weight.grad is not None
    save_draft(m, tmp_path)
    from safetensors.torch import load_file

    assert "embed_weight" not in load_file(str(tmp_path / "draft.safetensors"))
    back = load_draft(tmp_path, m.embed_weight.clone())
    torch.testing.assert_close(back.forward_step(ids, h, pos)[0], m.forward_step(ids, h, pos)[0])


def test_extra_layers_are_hf_llama_decoder_layers():
    """num_layers = 3: layer 0 as above, then each further layer must be transformers' own
    LlamaDecoderLayer (the layer vLLM's multi-layer EAGLE-3 stacks after the first) with the same
    weights, causal, on the residual stream; the keys/values of all layers come stacked by head."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    cfg = small_cfg(num_layers=3)
    m = random_draft(cfg)
    assert len(m.extra_layers) == 2 and m.extra_layers[0].self_attn.q_proj.in_features == cfg.hidden_size
    assert not hasattr(m.extra_layers[0], "hidden_norm")
    s = 6
    ids = torch.randint(0, cfg.vocab_size, (s,))
    h = torch.randn(s, cfg.hidden_size, dtype=torch.float64) * 3
    pos = torch.tensor([3, 4, 5, 6, 7, 8])
    out, k, v = m.forward_step(ids[None], h[None], pos[None])
    lcfg = LlamaConfig(hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                       num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_key_value_heads,
                       head_dim=cfg.head_dim, rope_theta=cfg.rope_theta, rms_norm_eps=cfg.rms_norm_eps,
                       attention_bias=False, mlp_bias=False)
    lcfg._attn_implementation = "eager"
    cos, sin = LlamaRotaryEmbedding(lcfg)(h.float()[None], pos[None])
    causal = torch.zeros(s, s, dtype=torch.float64).masked_fill(~torch.ones(s, s, dtype=torch.bool).tril(), float("-inf"))
    want = reference_step(m, ids, h, pos, False)[None]
    hkv = cfg.num_key_value_heads
    assert k.shape == v.shape == (1, 3 * hkv, s, cfg.head_dim)
    for i, extra in enumerate(m.extra_layers):
        hf = LlamaDecoderLayer(lcfg, layer_idx=i + 1).double()
        hf.load_state_dict(extra.state_dict(), strict=True)
        # this layer's keys/values (after RoPE) are head block i+1 of the returned ones
        x = hf.input_layernorm(want)
        k_ref = hf.self_attn.k_proj(x).view(1, s, hkv, cfg.head_dim).transpose(1, 2)
        v_ref = hf.self_attn.v_proj(x).view(1, s, hkv, cfg.head_dim).transpose(1, 2)
        k_ref, _ = apply_rotary_pos_emb(k_ref, k_ref, cos.double(), sin.double())
        torch.testing.assert_close(k[:, (i + 1) * hkv : (i + 2) * hkv], k_ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(v[:, (i + 1) * hkv : (i + 2) * hkv], v_ref, rtol=1e-5, atol=1e-5)
        want = hf(want, attention_mask=causal[None, None], position_ids=pos[None],
                  position_embeddings=(cos.double(), sin.double()))
        want = want[0] if isinstance(want, tuple) else want
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    one = Eagle3Draft(small_cfg(), m.embed_weight).double()  # layer 0 alone: its keys come first
    one.load_state_dict({k: t for k, t in m.state_dict().items() if not k.startswith("extra_layers.")})
    _, k1, v1 = one.forward_step(ids[None], h[None], pos[None])
    torch.testing.assert_close(k[:, : cfg.num_key_value_heads], k1)
    torch.testing.assert_close(v[:, : cfg.num_key_value_heads], v1)


def test_multi_layer_decoding_with_a_cache_matches_the_full_forward(tmp_path):
    """Token by token with the stacked per-layer caches = one causal pass over all tokens; the
    layer count survives save/load and old checkpoints (no num_layers) read as one layer."""
    cfg = small_cfg(num_layers=2)
    m = random_draft(cfg)
    s = 7
    ids, h, pos = torch.randint(0, 40, (1, s)), torch.randn(1, s, 32, dtype=torch.float64), torch.arange(s)[None]
    full, k_all, v_all = m.forward_step(ids, h, pos)
    out, kc, vc = m.forward_step(ids[:, :3], h[:, :3], pos[:, :3])
    for t in range(3, s):
        mask = torch.ones(1, 1, t + 1, dtype=torch.bool)
        o, k, v = m.forward_step(ids[:, t : t + 1], h[:, t : t + 1], pos[:, t : t + 1], kc, vc, mask)
        kc, vc = torch.cat([kc, k], 2), torch.cat([vc, v], 2)
        out = torch.cat([out, o], 1)
    torch.testing.assert_close(out, full, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(kc, k_all, rtol=1e-10, atol=1e-10)
    save_draft(m, tmp_path)
    assert json.loads((tmp_path / "draft_config.json").read_text())["num_layers"] == 2
    back = load_draft(tmp_path, m.embed_weight.clone()).double()
    torch.testing.assert_close(back.forward_step(ids, h, pos)[0], full)
    old = json.loads((tmp_path / "draft_config.json").read_text())
    del old["num_layers"]
    save_draft(random_draft(small_cfg()), tmp_path)
    (tmp_path / "draft_config.json").write_text(json.dumps(old))
    assert load_draft(tmp_path).config.num_layers == 1


def test_sliding_window_is_transformers_convention():
    """in_window on a causal mask is transformers' own sliding-window mask (masking_utils'
    causal_mask_function and sliding_window_overlay: kv_idx > q_idx - W): a query sees its own key
    and W - 1 before it, never the key W positions back."""
    from transformers.masking_utils import and_masks, causal_mask_function, sliding_window_overlay

    from eyas.draft import in_window

    q, k = torch.arange(20), torch.arange(20)
    for w in (1, 3, 8):
        want = and_masks(causal_mask_function, sliding_window_overlay(w))(0, 0, q[:, None], k[None, :])
        assert torch.equal(in_window(q, k, w) & (k[None] <= q[:, None]), want)
        assert int(want[10].sum()) == w and not want[10, 10 - w]
