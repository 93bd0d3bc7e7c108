"""Tiny models and drafts for the tests: real transformers and eyas classes, random weights, no mocks.

* `tiny_config` / `tiny_model`: a small random causal LM of one of ARCHS (fp32, eval mode). The
  defaults are the extract/capture tests' target: SmolLM2's vocabulary (so SmolLM2's tokenizer fits
  it), non-embedding matrices redrawn at std 0.08 (HF's 0.02 leaves the residual stream tiny;
  larger weights make the layers matter). Other tests pick other sizes and initialisations.
* `save_tiny`: `tiny_model` + the real SmolLM2 tokenizer and chat template as an HF model directory,
  so `eyas prepare`, `eyas extract`, `eyas train` ... run on it like on any local model.
* `save_deepseek_v3`: a DeepSeek-V3 with the real MLA head sizes and YaRN as DeepSeek ships it,
  everything else tiny, its config.json in DeepSeek's own form.
* `tiny_llama`: the spec/evaluate tests' target: a Llama with HF's own initialisation, frozen.
* `random_draft`: a real, untrained Eagle3Draft sized from a target (a model or an HF config).
* `load_target`, `greedy_sequences`, `fitted_draft`: a real target, its greedy continuations, and a
  draft fitted in seconds to them (eyas's TTT code), so that its acceptance is well above 1.

Every builder seeds torch itself: the same arguments give the same weights in any test.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from eyas.draft import DraftConfig, Eagle3Draft
from eyas.vocab import d2t_t2d, target_to_draft

VOCAB = 49152  # SmolLM2's
ARCHS = ("llama", "qwen2", "qwen3", "mistral", "gemma", "gemma2", "deepseek_v3")


def tiny_config(arch: str = "llama", vocab: int = VOCAB, hidden: int = 64, layers: int = 8, heads: int = 4,
                kv_heads: int = 2, max_positions: int = 4096):
    """A small HF config of `arch` (MLP 2 x hidden, untied LM head; per-arch extras below)."""
    import transformers as tf

    common = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=False,
    )
    if arch == "llama":
        return tf.LlamaConfig(**common)
    if arch == "qwen2":
        return tf.Qwen2Config(**common)
    if arch == "qwen3":
        return tf.Qwen3Config(head_dim=16, **common)
    if arch == "mistral":
        return tf.MistralConfig(sliding_window=32, **common)
    if arch == "gemma":
        return tf.GemmaConfig(head_dim=16, **common)
    if arch == "gemma2":
        return tf.Gemma2Config(head_dim=16, sliding_window=32, query_pre_attn_scalar=16, **common)
    if arch == "deepseek_v3":  # MLA (low-rank q/kv, split rope/nope heads) + MoE after the first dense layer
        common.update(num_key_value_heads=heads)
        return tf.DeepseekV3Config(
            moe_intermediate_size=32,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_shared_experts=1,
            n_group=1,
            topk_group=1,
            first_k_dense_replace=1,
            q_lora_rank=32,
            kv_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=8,
            **common,
        )
    raise ValueError(arch)


def tiny_model(
    arch: str = "llama", *, vocab: int = VOCAB, hidden: int = 64, layers: int = 8, heads: int = 4, kv_heads: int = 2,
    max_positions: int = 4096, seed: int = 0, attn: str | None = None, std: float | None = 0.08,
    embed_std: float | None = None, lm_head_scale: float = 1.0, frozen: bool = False,
):  # fmt: skip
    """A random `tiny_config` model in fp32, eval mode.

    After torch.manual_seed(seed) and HF's own initialisation, every matrix is redrawn from
    N(0, embed_std) if its name holds "embed", else from N(0, std) (None: HF's initialisation kept),
    in parameter order; then the LM head is scaled by lm_head_scale (peakier distributions).
    attn: the attention implementation (None: transformers' default). frozen: no gradients.
    """
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = tiny_config(arch, vocab, hidden, layers, heads, kv_heads, max_positions)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, **({"attn_implementation": attn} if attn else {}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            sd = embed_std if "embed" in name else std
            if p.dim() >= 2 and sd is not None:
                p.normal_(0, sd)
        if lm_head_scale != 1.0:
            model.lm_head.weight.mul_(lm_head_scale)
    model.eval()
    return model.requires_grad_(False) if frozen else model


def save_tiny(arch: str, out: str | Path, tokenizer_dir: str | Path, **kw) -> Path:
    """A `tiny_model(arch, **kw)` + the SmolLM2 tokenizer and chat template in `out` (an HF model dir)."""
    from transformers import AutoTokenizer

    out = Path(out)
    model = tiny_model(arch, **kw)
    model.save_pretrained(str(out), safe_serialization=True)
    AutoTokenizer.from_pretrained(str(tokenizer_dir)).save_pretrained(str(out))
    return out


DEEPSEEK_V3_YARN = {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                    "original_max_position_embeddings": 4096, "type": "yarn"}
"""YaRN as DeepSeek-V3's config.json ships it."""


def save_deepseek_v3(out: str | Path, tokenizer_dir: str | Path | None, q_lora_rank: int | None = None,
                     yarn: bool = True, seed: int = 0, vocab: int = VOCAB) -> Path:
    """A DeepSeek-V3 with the real MLA head sizes (kv_lora_rank 512, qk_rope 64, qk_nope 128, v 128:
    vLLM's CPU MLA kernel takes only a 576-wide latent) and everything else tiny (hidden 256, 2
    heads, 4 layers, the first dense, 4 routed experts + 1 shared, 2 per token), random weights
    (non-embedding matrices N(0, 0.08), the routers' correction bias N(0, 0.1)), saved with the
    SmolLM2 tokenizer (none when `tokenizer_dir` is None). config.json is written in DeepSeek's own
    form: topk_method noaux_tc, scoring_func sigmoid, rope_theta and rope_scaling (YaRN as DeepSeek
    ships it when `yarn`)."""
    import json

    import transformers as tf

    out = Path(out)
    torch.manual_seed(seed)
    cfg = tf.DeepseekV3Config(
        vocab_size=vocab, hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
        n_group=1, topk_group=1, first_k_dense_replace=1, q_lora_rank=q_lora_rank, kv_lora_rank=512,
        qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, tie_word_embeddings=False,
        max_position_embeddings=163840 if yarn else 4096,
        rope_scaling=dict(DEEPSEEK_V3_YARN) if yarn else None,
    )  # fmt: skip
    model = tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "e_score_correction_bias" in name:
                p.normal_(0, 0.1)
            elif p.dim() >= 2 and "embed" not in name:
                p.normal_(0, 0.08)
    model.save_pretrained(str(out), safe_serialization=True)
    if tokenizer_dir is not None:
        tf.AutoTokenizer.from_pretrained(str(tokenizer_dir)).save_pretrained(str(out))
    config = json.loads((out / "config.json").read_text())
    rope = config.pop("rope_parameters", None) or {}
    config["rope_theta"] = rope.get("rope_theta", 10000.0)
    config["rope_scaling"] = dict(DEEPSEEK_V3_YARN) if yarn else None
    config.update(topk_method="noaux_tc", scoring_func="sigmoid")
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def tiny_llama(vocab=16, hidden=32, layers=4, seed=0, attn="sdpa", logit_scale=1.0):
    """The decoding tests' random Llama (context-dependent, real attention and KV cache): HF's own
    initialisation, lm_head scaled by logit_scale, 512 positions, frozen."""
    return tiny_model("llama", vocab=vocab, hidden=hidden, layers=layers, max_positions=512, seed=seed, attn=attn,
                      std=None, lm_head_scale=logit_scale, frozen=True)  # fmt: skip


def random_draft(
    target, draft_tokens=None, aux_layer_ids=(0, 1, 2), seed: int = 0, *, draft_vocab: int | None = None,
    std: float | None = None, norm_range: tuple[float, float] | None = None, logit_scale: float = 1.0,
    frozen: bool = True, **overrides,
) -> Eagle3Draft:  # fmt: skip
    """An untrained Eagle3Draft sized from `target`: a model (its input embedding is installed) or
    an HF config (a zero embedding). `overrides` go to DraftConfig.from_target (num_layers,
    intermediate_size, norm_before_residual, ...).

    Draft vocabulary: the target ids `draft_tokens`; else `draft_vocab` ids drawn at random (numpy,
    seeded by `seed`); else the whole vocabulary (W = V, d2t all zeros).
    Weights: Eagle3Draft's own initialisation after torch.manual_seed(seed); then, in parameter
    order, every matrix redrawn from N(0, std) when std is given, and every vector (the norm
    weights) from U(norm_range) when that is given (not all ones: a swapped norm tensor shows);
    the lm_head scaled by logit_scale. frozen: eval mode, no gradients.
    """
    torch.manual_seed(seed)
    tcfg = getattr(target, "config", target)
    v = tcfg.vocab_size
    if draft_tokens is not None:
        sel = np.sort(np.asarray(draft_tokens))
    elif draft_vocab is not None:
        sel = np.sort(np.random.default_rng(seed).choice(v, size=draft_vocab, replace=False))
    else:
        sel = np.arange(v)
    cfg = DraftConfig.from_target(tcfg, draft_vocab_size=len(sel), aux_layer_ids=list(aux_layer_ids), **overrides)
    embed = target.get_input_embeddings().weight if hasattr(target, "get_input_embeddings") else None
    draft = Eagle3Draft(cfg, embed)
    draft.set_vocab(*d2t_t2d(sel, v))
    with torch.no_grad():
        for p in draft.parameters():
            if p.dim() >= 2 and std is not None:
                p.normal_(0, std)
            elif p.dim() < 2 and norm_range is not None:
                p.uniform_(*norm_range)
        if logit_scale != 1.0:
            draft.lm_head.weight.mul_(logit_scale)
    return draft.eval().requires_grad_(False) if frozen else draft


# --- a real target and a draft fitted to it -------------------------------------------------------


def load_target(model_dir, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).eval().requires_grad_(False)


@torch.no_grad()
def greedy_sequences(target, prompts_ids: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    from eyas.spec.generate import target_generate

    return [p + target_generate(target, torch.tensor(p), max_new_tokens=max_new_tokens).tokens for p in prompts_ids]


def fitted_draft(
    target, sequences: list[list[int]], aux_layer_ids=(2, 15, 27), draft_vocab: int = 512,
    steps: int = 50, ttt_steps: int = 3, lr: float = 3e-3, seed: int = 0, intermediate_size: int = 512,
    decoy_shifts: tuple[int, ...] = (-1, 1), num_layers: int = 1, norms: str = "eagle3",
    sliding_window: int = 0,
) -> Eagle3Draft:  # fmt: skip
    """Fit a draft to the target's greedy predictions on `sequences` (packed, 3-step TTT).

    Its acceptance on exactly those sequences is well above 1 and depends on every part of the
    draft (fc over the right aux layers, attention, norms, lm_head, d2t).
    With decoy_shifts, step 0 is also taught to propose a decoy token (never a right answer) when
    its aux states come from the layers `aux_layer_ids + shift`: served with an off-by-one layer
    convention it then accepts almost nothing, so such a mistake shows as a collapse of tau instead
    of the few-percent drop of an ordinary draft (adjacent residual streams are much alike).
    norms: as train.norms (eagle3.1: fc_norm and norm_output).
    """
    from eyas.capture import capture
    from eyas.ttt import sdpa_masks, ttt_forward

    tcfg = target.config
    ids = torch.tensor([t for s in sequences for t in s])[None]
    doc = torch.tensor([i for i, s in enumerate(sequences) for _ in s])[None]
    pos = torch.tensor([j for s in sequences for j in range(len(s))])[None]
    sets = [list(aux_layer_ids)] + [[k + d for k in aux_layer_ids] for d in decoy_shifts]
    union = sorted({k for ks in sets for k in ks})
    aux, labels = [], []
    for s in sequences:  # one plain forward per sequence: aux states and the teacher's argmax
        x = torch.tensor(s)[None]
        a, _ = capture(target, x, layer_ids=union)
        aux.append(a[0])
        labels.append(target(x).logits[0].argmax(-1))
    aux_all = torch.cat(aux)[None].float()
    aux_sets = [aux_all[:, :, [union.index(k) for k in ks]] for ks in sets]
    aux_BSKD = aux_sets[0]
    teacher_S = torch.cat(labels)
    rng = np.random.default_rng(seed)
    used = np.unique(teacher_S.numpy())
    assert used.size <= draft_vocab, (used.size, draft_vocab)
    rest = np.setdiff1d(np.arange(tcfg.vocab_size), used)
    sel = np.sort(np.concatenate([used, rng.choice(rest, size=draft_vocab - used.size, replace=False)]))
    d2t, t2d = d2t_t2d(sel, tcfg.vocab_size)
    torch.manual_seed(seed)
    cfg = DraftConfig.from_target(tcfg, draft_vocab_size=draft_vocab, aux_layer_ids=list(aux_layer_ids),
                                  intermediate_size=intermediate_size, num_layers=num_layers,
                                  fc_norm=norms == "eagle3.1", norm_output=norms == "eagle3.1", sliding_window=sliding_window)
    draft = Eagle3Draft(cfg, target.get_input_embeddings().weight.float())
    draft.set_vocab(d2t, t2d)
    # step i at row t reads token t+1+i and predicts the target's argmax after it
    n = ids.shape[1]
    rows = torch.arange(n)
    targets_T = []
    for i in range(ttt_steps):
        src = rows + 1 + i
        ok = (src < n) & (doc[0, src.clamp(max=n - 1)] == doc[0])
        lab = target_to_draft(teacher_S[src.clamp(max=n - 1)], t2d)
        targets_T.append(torch.where(ok, lab, torch.full_like(lab, -100)))
    decoy = torch.full_like(targets_T[0], int(np.flatnonzero(~np.isin(sel, used))[0]))
    masks = sdpa_masks(doc, ttt_steps, pos, sliding_window)  # sliding_window > 0: trained with that window
    opt = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
    for _ in range(steps):
        outs = ttt_forward(draft, aux_BSKD, ids, pos, masks)
        loss = sum(F.cross_entropy(draft.logits(o[0]).float(), t, ignore_index=-100) for o, t in zip(outs, targets_T))
        for wrong in aux_sets[1:]:
            (h,) = ttt_forward(draft, wrong, ids, pos, masks[:1])
            loss = loss + F.cross_entropy(draft.logits(h[0]).float(), decoy)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return draft.eval().requires_grad_(False)


KIMI_K25_VISION = {  # Kimi-K2.5's vision_config in its own (remote code's) field names, sizes shrunk
    "init_pos_emb_height": 4, "init_pos_emb_time": 2, "init_pos_emb_width": 4, "merge_kernel_size": [2, 2],
    "merge_type": "sd2_tpool", "mm_hidden_size": 16, "mm_projector_type": "patchmerger", "model_type": "",
    "patch_size": 14, "pos_emb_type": "divided_fixed", "projector_hidden_act": "gelu", "projector_ln_eps": 1e-05,
    "text_hidden_size": 256, "video_attn_type": "spatial_temporal", "vt_hidden_size": 16, "vt_intermediate_size": 32,
    "vt_num_attention_heads": 2, "vt_num_hidden_layers": 1,
}  # fmt: skip


def save_kimi_k25(out: str | Path, tokenizer_dir: str | Path | None, q_lora_rank: int | None = 64, yarn: bool = True,
                  seed: int = 0, vocab: int = VOCAB) -> Path:
    """A Kimi-K2.5-shaped checkpoint: `save_deepseek_v3`'s tiny DeepSeek-V3 (the same weights for the
    same arguments) inside Kimi-K2.5's multimodal wrapper, as moonshotai/Kimi-K2.5 ships it.

    config.json has the wrapper's top-level fields (`architectures: ["KimiK25ForConditionalGeneration"]`,
    `model_type: "kimi_k25"`, the media token ids, untied embeddings), the DeepSeek-V3 config nested
    as `text_config` with the hub's `model_type: "kimi_k2"` (transformers' and vLLM's Kimi_K25Config
    read it as deepseek_v3), and `vision_config` in the hub's vt_* names, shrunk. Field names and values
    follow the real config.json as dumped with its weight list in a public model report (found through
    the code index: a "KimiK25Config" dump of /nfs/.../moonshotai/Kimi-K2.5, 64 safetensors shards);
    no auto_map: the remote code is not shipped here. Weights: the text model's under
    `language_model.` (`language_model.model.embed_tokens.weight`, `language_model.lm_head.weight`,
    ...), a few tiny vision-tower and projector tensors under `vision_tower.` / `mm_projector.` (not a
    working tower: nothing here runs one), in three shards with a model.safetensors.index.json, the
    vision ones in the last shard as in the real checkpoint. The real experts are INT4
    (compressed-tensors pack-quantized, group 32); these stay float32."""
    import json
    import shutil
    import tempfile

    from safetensors import safe_open
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        text_dir = save_deepseek_v3(Path(tmp) / "text", tokenizer_dir, q_lora_rank=q_lora_rank, yarn=yarn, seed=seed,
                                    vocab=vocab)
        text_config = json.loads((text_dir / "config.json").read_text())
        with safe_open(str(text_dir / "model.safetensors"), "pt") as f:
            names = f.keys()
            text = {f"language_model.{k}": f.get_tensor(k) for k in names}
        for name in os.listdir(text_dir):
            if name.startswith(("tokenizer", "chat_template", "special_tokens")):
                shutil.copy(text_dir / name, out / name)
    text_config["model_type"] = "kimi_k2"
    text_config.pop("dtype", None)
    v = KIMI_K25_VISION
    g = torch.Generator().manual_seed(seed + 1)
    vision = {
        "vision_tower.patch_embed.proj.weight": torch.randn(v["vt_hidden_size"], 3, 14, 14, generator=g),
        "vision_tower.patch_embed.proj.bias": torch.zeros(v["vt_hidden_size"]),
        "vision_tower.encoder.blocks.0.wqkv.weight": torch.randn(3 * v["vt_hidden_size"], v["vt_hidden_size"], generator=g),
        "vision_tower.encoder.final_layernorm.weight": torch.ones(v["vt_hidden_size"]),
        "mm_projector.pre_norm.weight": torch.ones(v["vt_hidden_size"]),
        "mm_projector.proj.2.weight": torch.randn(text_config["hidden_size"], 4 * v["vt_hidden_size"], generator=g),
    }
    layers = sorted({k for k in text if ".layers." in k})
    shards = [{k: text[k] for k in layers[: len(layers) // 2]},
              {k: text[k] for k in text if k not in layers[: len(layers) // 2]}, vision]
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file({k: t.contiguous() for k, t in shard.items()}, str(out / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
    total = sum(t.numel() * t.element_size() for s in shards for t in s.values())
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=2))
    config = {
        "architectures": ["KimiK25ForConditionalGeneration"], "bos_token_id": 163584, "dtype": "float32",
        "eos_token_id": 163585, "ignore_index": -100, "media_placeholder_token_id": 163605, "model_type": "kimi_k25",
        "pad_token_id": 163839, "text_config": text_config, "tie_word_embeddings": False,
        "use_unified_vision_chunk": True, "video_placeholder": "<|kimi_k25_video_placeholder|>",
        "vision_config": dict(v),
    }  # fmt: skip
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out
