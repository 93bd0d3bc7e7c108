"""Every on-disk form of an EAGLE-3 draft, and `open_draft(dir)` for any of them.

    draft = open_draft("runs/eyas/train/final")          # eyas's checkpoint
    draft = open_draft("runs/eyas/export")               # an export root: its speculators/ (or sglang/) layout
    draft = open_draft("runs/eyas/export/sglang", embed_weight_VD=target.get_input_embeddings().weight)

Forms (`locate` tells which a directory holds):
  checkpoint    DIR/draft.safetensors + DIR/draft_config.json: the state_dict with eyas.draft's names
                (d2t, t2d included; never the embedding) and the DraftConfig fields. The trainer
                writes it (train's final/, checkpoints/step_*/); export reads it.
  sglang        DIR/config.json + DIR/model.safetensors: the EAGLE-3 reference layout SGLang loads
                (vLLM serves it too, through --speculative-config).
  speculators   DIR/config.json + DIR/model.safetensors: the layout `vllm serve DIR` recognises.
  export root   DIR/speculators/ and/or DIR/sglang/, as `eyas export` writes them (speculators first).

Every convention below was read in the engines' sources; tests/test_draft_files.py pins each one.

Tensor names (the literal tables SGLANG_KEYS / SPECULATORS_KEYS)
  * eyas's state_dict already uses the EAGLE-3 reference names (`midlayer.*`), which is what SGLang
    loads: python/sglang/srt/models/llama_eagle3.py `LlamaForCausalLMEagle3.load_weights` stacks
    q/k/v into `qkv_proj`, gate/up into `gate_up_proj`, prefixes `model.` and **silently skips any
    name it does not know** (so a wrong name is a draft that serves at tau ~ 1, never an error);
    `d2t` becomes `hot_token_id = d2t + arange(W)`, `t2d` is skipped.
  * speculators 0.9.0 (`speculators/convert/eagle/eagle3_converter.py`) renames `midlayer.` ->
    `layers.0.`; vLLM 0.32 (`vllm/model_executor/models/llama_eagle3.py`) accepts both through
    `WeightsMapper({"midlayer.": "layers.0."})`, maps `d2t` -> `draft_id_to_target_id`, skips `t2d`
    and, unlike SGLang, raises on unknown names.
  * no `embed_tokens`: vLLM then shares the target's embedding (`llm_base_proposer.py`
    `_maybe_share_embeddings`: "without its own embed_tokens"), SGLang's eagle worker does the same.
  * draft vocab == target vocab: vLLM (llama_eagle3.py) and speculators (`DraftVocabMixin`) then
    drop the mapping entirely (no `draft_id_to_target_id` parameter), so a non-identity d2t would
    be ignored in silence. eyas therefore permutes lm_head rows into target order and writes no
    d2t/t2d in that case (an exact re-indexing).

Config fields
  * sglang layout: a LlamaConfig with `architectures: ["LlamaForCausalLMEagle3"]` (vLLM's registry
    maps the same name to `Eagle3LlamaForCausalLM`), `num_hidden_layers: 1`, `vocab_size` = target
    vocab, `draft_vocab_size`, `target_hidden_size` (both engines read it for fc's input width),
    explicit `head_dim`, `tie_word_embeddings: false` (SGLang would otherwise make lm_head the
    embedding). SGLang's fc is `Linear(target_hidden_size * 3, ...)`: exactly 3 aux layers, and its
    decoder layer always uses the un-normed residual, so `norm_before_residual=True` drafts and
    K != 3 are refused for this layout.
  * speculators layout (`speculators/models/eagle3/config.py` Eagle3SpeculatorConfig): no top-level
    `model_type` (vLLM `transformers_utils/config.py` only routes a config with `speculators_config`
    and *no* model_type to its SpeculatorsConfig), `speculators_model_type: "eagle3"`,
    `architectures: ["Eagle3Speculator"]`, `transformer_layer_config` (LlamaConfig dict, explicit
    head_dim: speculators builds its rotary from a copy with hidden_size doubled),
    `draft_vocab_size`, `target_hidden_size`, `eagle_aux_hidden_state_layer_ids`,
    `speculators_config: {algorithm, proposal_methods: [{proposal_type: greedy,
    speculative_tokens}], default_proposal_method, verifier: {name_or_path, architectures}}`.
    `norm_before_residual` is always written: vLLM's `configs/speculators/algos.py update_eagle3`
    defaults it to **True** when absent, speculators and eyas to False.
  * EAGLE 3.1 (train.norms=eagle3.1): top-level `fc_norm` and `norm_output` (speculators
    `models/eagle3/config.py`; vLLM's `update_eagle3` copies both into the draft config, default
    False), weights `fc_norm.{k}.weight` (speculators `core.py` ModuleList `fc_norm`; vLLM
    llama_eagle3.py `LlamaModel.fc_norm`, K RMSNorm(target_hidden_size), each on its chunk of the
    aux concat before fc; with `norm_output` the state fed back is `norm`'s output). vLLM's
    `norm_before_fc` (one norm over the whole concat) is another design and always written False.
    SGLang's llama_eagle3.py reads neither field and skips the `fc_norm` weights in silence, so
    such a draft is refused for the sglang layout.
  * a sliding-window draft (DraftConfig.sliding_window = W): `sliding_window: W` and `layer_types:
    ["sliding_attention"] * num_layers` in the layer config. vLLM 0.32 models/llama.py
    `LlamaAttention` windows layer i only when `config.layer_types[i] == "sliding_attention"`
    (index relative to the draft: llama_eagle3.py sets `target_layer_count`) and passes
    `per_layer_sliding_window=config.sliding_window` to its Attention; a bare `sliding_window`
    is ignored. SGLang's llama.py builds RadixAttention with no window at all: that layout is
    refused for such a draft.

Aux-layer ids (eyas's convention: index into HF `output_hidden_states`; 0 = embeddings, k = output of
decoder layer k-1 = the residual stream entering layer k)
  * vLLM: `models/llama.py` calls `_maybe_add_hidden_state(aux, idx + 1, ...)` after layer idx (and
    with start_layer before the first), so id k is the stream entering layer k = HF index k: written
    unchanged. Read from the draft config's top-level `eagle_aux_hidden_state_layer_ids` first, then
    `eagle_config.eagle_aux_hidden_state_layer_ids` (v1 `gpu_model_runner.py
    _get_eagle3_aux_layers_from_config`, no shift); default (2, L//2, L-3) from
    `interfaces.py get_eagle3_default_aux_hidden_state_layers`. HF index L (after the final norm in
    HF) has no vLLM equivalent (vLLM's id L is before the norm) and is refused.
  * SGLang: `model_runner.py` reads only `eagle_config["eagle_aux_hidden_state_layer_ids"]` from the
    draft config and `models/llama.py set_eagle3_layers_to_capture` captures `[val + 1 for val in
    layer_ids]` ("for the ith layer, it takes the output of the (i-1)th layer"), the stream entering
    layer val+1: SGLang id = HF index - 1. Without ids it captures [2, L//2, L-3] directly (= HF
    indices, the same layers as vLLM's default).
  * Both keys sit in the sglang layout's config.json, each in its engine's convention; the vLLM
    field is top-level so vLLM never reaches the SGLang-convention nested one. Ids are always
    written, even when they equal the defaults (the defaults are code, not a contract).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from eyas.artifacts import atomic_write_json, read_safetensors
from eyas.draft import DraftConfig, Eagle3Draft
from eyas.errors import ArtifactError, ConfigError, DamagedArtifact

DRAFT_WEIGHTS = "draft.safetensors"
"""A checkpoint's weights (eyas.draft names)."""
DRAFT_CONFIG = "draft_config.json"
"""A checkpoint's DraftConfig fields."""
WEIGHTS = "model.safetensors"
"""An exported layout's weights (the engine's names)."""
CONFIG = "config.json"
"""An exported layout's config (the engine's fields)."""
LAYOUTS = ("speculators", "sglang")
"""The exported layouts, in the order `locate` looks for them under an export root."""
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


# --- eyas's checkpoint -------------------------------------------------------------------------


def save_draft(model: Eagle3Draft, out_dir: str | Path, dtype: torch.dtype | None = None) -> None:
    """DIR/draft.safetensors (atomic) and DIR/draft_config.json; floats cast to `dtype` when given."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    sd = {}
    for k, v in model.state_dict().items():
        v = v.detach().cpu()
        if dtype is not None and v.is_floating_point():
            v = v.to(dtype)
        sd[k] = v.contiguous()
    tmp = out / (DRAFT_WEIGHTS + ".tmp")
    save_file(sd, str(tmp))
    tmp.replace(out / DRAFT_WEIGHTS)
    atomic_write_json(out / DRAFT_CONFIG, model.config.to_dict())


def load_state(model: Eagle3Draft, sd: dict[str, torch.Tensor], source: Path) -> Eagle3Draft:
    """`sd` into `model`: every tensor but the (never saved) embedding, nothing else."""
    missing, unexpected = model.load_state_dict(sd, strict=False)
    missing = [k for k in missing if k != "embed_weight"]
    if missing or unexpected:
        raise ArtifactError(f"{source}: missing tensors {missing}, unexpected tensors {unexpected}")
    return model


def load_draft(draft_dir: str | Path, embed_weight_VD: torch.Tensor | None = None, device="cpu",
               dtype: torch.dtype | None = None) -> Eagle3Draft:
    """An eyas checkpoint directory -> the draft (its stored dtype unless `dtype`), on `device`."""
    d = Path(draft_dir)
    if not (d / DRAFT_CONFIG).is_file() or not (d / DRAFT_WEIGHTS).is_file():
        raise ArtifactError(f"{d} is not an eyas draft checkpoint (needs {DRAFT_CONFIG} and {DRAFT_WEIGHTS})")
    model = Eagle3Draft(DraftConfig(**json.loads((d / DRAFT_CONFIG).read_text())), embed_weight_VD)
    weights = read_safetensors(d / DRAFT_WEIGHTS, "train", "train again (--train.resume=auto continues from its last "
                               "checkpoint), or use another checkpoint or draft")
    load_state(model, weights, d / DRAFT_WEIGHTS)
    return model.to(device=device, dtype=dtype) if dtype is not None else model.to(device)



# eyas state_dict name -> name in the exported file. d2t/t2d are dropped when W == V (see above).
SGLANG_KEYS = {
    "fc.weight": "fc.weight",
    "midlayer.input_layernorm.weight": "midlayer.input_layernorm.weight",
    "midlayer.hidden_norm.weight": "midlayer.hidden_norm.weight",
    "midlayer.self_attn.q_proj.weight": "midlayer.self_attn.q_proj.weight",
    "midlayer.self_attn.k_proj.weight": "midlayer.self_attn.k_proj.weight",
    "midlayer.self_attn.v_proj.weight": "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight": "midlayer.self_attn.o_proj.weight",
    "midlayer.post_attention_layernorm.weight": "midlayer.post_attention_layernorm.weight",
    "midlayer.mlp.gate_proj.weight": "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight": "midlayer.mlp.up_proj.weight",
    "midlayer.mlp.down_proj.weight": "midlayer.mlp.down_proj.weight",
    "norm.weight": "norm.weight",
    "lm_head.weight": "lm_head.weight",
    "d2t": "d2t",
    "t2d": "t2d",
}
SPECULATORS_KEYS = {
    "fc.weight": "fc.weight",
    "midlayer.input_layernorm.weight": "layers.0.input_layernorm.weight",
    "midlayer.hidden_norm.weight": "layers.0.hidden_norm.weight",
    "midlayer.self_attn.q_proj.weight": "layers.0.self_attn.q_proj.weight",
    "midlayer.self_attn.k_proj.weight": "layers.0.self_attn.k_proj.weight",
    "midlayer.self_attn.v_proj.weight": "layers.0.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight": "layers.0.self_attn.o_proj.weight",
    "midlayer.post_attention_layernorm.weight": "layers.0.post_attention_layernorm.weight",
    "midlayer.mlp.gate_proj.weight": "layers.0.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight": "layers.0.mlp.up_proj.weight",
    "midlayer.mlp.down_proj.weight": "layers.0.mlp.down_proj.weight",
    "norm.weight": "norm.weight",
    "lm_head.weight": "lm_head.weight",
    "d2t": "d2t",
    "t2d": "t2d",
}
# draft layers 1.. (num_layers > 1; vLLM's multi-layer EAGLE-3 only): eyas `extra_layers.{i}` is
# the exported `layers.{i+1}` (vLLM llama_eagle3.py builds layer j > 0 with a D-wide qkv_proj; it
# creates a hidden_norm there too but only layer 0 uses one, and its load_weights does not ask for
# the unused ones, so none is written)
SPECULATORS_EXTRA_LAYER_KEYS = {
    "extra_layers.{}.input_layernorm.weight": "layers.{}.input_layernorm.weight",
    "extra_layers.{}.self_attn.q_proj.weight": "layers.{}.self_attn.q_proj.weight",
    "extra_layers.{}.self_attn.k_proj.weight": "layers.{}.self_attn.k_proj.weight",
    "extra_layers.{}.self_attn.v_proj.weight": "layers.{}.self_attn.v_proj.weight",
    "extra_layers.{}.self_attn.o_proj.weight": "layers.{}.self_attn.o_proj.weight",
    "extra_layers.{}.post_attention_layernorm.weight": "layers.{}.post_attention_layernorm.weight",
    "extra_layers.{}.mlp.gate_proj.weight": "layers.{}.mlp.gate_proj.weight",
    "extra_layers.{}.mlp.up_proj.weight": "layers.{}.mlp.up_proj.weight",
    "extra_layers.{}.mlp.down_proj.weight": "layers.{}.mlp.down_proj.weight",
}
KEY_TABLES = {"sglang": SGLANG_KEYS, "speculators": SPECULATORS_KEYS}
# EAGLE 3.1's per-aux-state norms (fc_norm=True): the same name in vLLM and speculators
FC_NORM_KEY = "fc_norm.{}.weight"


# an MLA draft (attention=mla) in the sglang layout: DeepSeek's attention names, which vLLM's
# deepseek_eagle3.py maps (`midlayer.` -> `layers.0.`, q_a_proj + kv_a_proj_with_mqa stacked into
# fused_qkv_a_proj when q_lora_rank is set, gate/up into gate_up_proj) and SGLang's deepseek_eagle3.py
# loads as they are; q_proj only without q_lora_rank, q_a_* / q_b_proj only with it
SGLANG_MLA_KEYS = {
    **{k: v for k, v in SGLANG_KEYS.items() if ".self_attn." not in k},
    **{f"midlayer.self_attn.{n}.weight": f"midlayer.self_attn.{n}.weight"
       for n in ("q_proj", "q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj",
                 "o_proj")},
}


def key_table(fmt: str, num_layers: int = 1, num_fc_norms: int = 0, attention: str = "gqa") -> dict[str, str]:
    """eyas state_dict name -> exported name for a draft of `num_layers` layers (and `num_fc_norms`
    fc_norm modules: K with fc_norm, else 0; `attention` mla: the MLA draft's sglang names)."""
    if attention == "mla":
        if fmt != "sglang":
            raise ArtifactError(f"a {fmt} layout of an MLA draft: only the sglang layout holds one")
        return dict(SGLANG_MLA_KEYS)
    table = dict(KEY_TABLES[fmt])
    table.update({FC_NORM_KEY.format(k): FC_NORM_KEY.format(k) for k in range(num_fc_norms)})
    if num_layers > 1:
        if fmt != "speculators":
            raise ArtifactError(f"a {fmt} layout with {num_layers} draft layers: only the speculators layout holds more than one")
        for i in range(num_layers - 1):
            table.update({k.format(i): v.format(i + 1) for k, v in SPECULATORS_EXTRA_LAYER_KEYS.items()})
    return table


# --- aux-layer-id conventions -------------------------------------------------------------------


def vllm_aux_ids(hf_ids: list[int]) -> list[int]:
    """vLLM id k captures the stream entering layer k: the HF hidden_states index itself."""
    return [int(k) for k in hf_ids]


def sglang_aux_ids(hf_ids: list[int]) -> list[int]:
    """SGLang captures layer `id + 1`'s input for an explicit id: id = HF index - 1."""
    return [int(k) - 1 for k in hf_ids]


def hf_ids_from_sglang(sglang_ids: list[int]) -> list[int]:
    return [int(j) + 1 for j in sglang_ids]


def default_aux_ids(num_target_layers: int) -> list[int]:
    """(2, L//2, L-3): vLLM's and SGLang's default capture points, as HF hidden_states indices."""
    return [2, num_target_layers // 2, num_target_layers - 3]


def check_aux_ids(hf_ids: list[int], num_target_layers: int, formats: tuple[str, ...]) -> None:
    """Refuse ids an engine cannot capture exactly (message names the offending id and engine)."""
    if not hf_ids:
        raise ArtifactError("the draft config has no aux_layer_ids: re-run `eyas train` (draft_config.json is incomplete)")
    bad = [k for k in hf_ids if not 0 <= k < num_target_layers]
    if bad:
        raise ArtifactError(
            f"aux_layer_ids {hf_ids}: {bad} outside [0, {num_target_layers - 1}] for a target with "
            f"{num_target_layers} layers (HF index {num_target_layers} is after the final norm, which no "
            "engine captures): re-run `eyas extract` with --extract.layer_ids inside that range, then train"
        )
    if list(hf_ids) != sorted(set(hf_ids)):
        raise ArtifactError(
            f"aux_layer_ids {hf_ids} are not strictly ascending: vLLM and SGLang collect the aux states "
            "while walking the layers, so the served fc input is always in ascending layer order and this "
            "draft would serve at tau~1; re-run `eyas extract` and `eyas train` with ascending --extract.layer_ids"
        )
    if "sglang" in formats and min(hf_ids) < 1:
        raise ArtifactError(
            f"aux_layer_ids {hf_ids}: SGLang cannot capture HF index 0 (the embeddings; its id would be -1): "
            "export with --export.format=speculators, or re-extract without layer 0"
        )


# --- configs ------------------------------------------------------------------------------------


def _layer_fields(c: DraftConfig, dtype: str) -> dict[str, Any]:
    """The LlamaConfig fields of the decoder layers (one, or num_layers), shared by both layouts."""
    out: dict[str, Any] = {
        "model_type": "llama",
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "hidden_act": c.hidden_act,
        "max_position_embeddings": c.max_position_embeddings,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "vocab_size": c.vocab_size,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
    }
    if c.rope_scaling:
        out["rope_scaling"] = dict(c.rope_scaling)
    if c.sliding_window:  # vLLM models/llama.py LlamaAttention: config.sliding_window for each
        out["sliding_window"] = c.sliding_window  # layer whose layer_types entry is "sliding_attention"
        out["layer_types"] = ["sliding_attention"] * c.num_layers
    return out


def sglang_config(c: DraftConfig, dtype: str) -> dict[str, Any]:
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], **_layer_fields(c, dtype)}
    cfg.update(
        draft_vocab_size=c.draft_vocab_size,
        target_hidden_size=c.target_hidden_size,
        norm_before_residual=c.norm_before_residual,
        eagle_aux_hidden_state_layer_ids=vllm_aux_ids(c.aux_layer_ids),  # read by vLLM (top level first)
        eagle_config={  # read by SGLang only (model_runner.py), in its own convention
            "use_aux_hidden_state": True,
            "eagle_aux_hidden_state_layer_ids": sglang_aux_ids(c.aux_layer_ids),
        },
    )
    return cfg


def mla_config(c: DraftConfig, dtype: str) -> dict[str, Any]:
    """The sglang layout of an MLA draft: a DeepSeek config that vLLM's registry maps to
    deepseek_eagle3.py (Eagle3DeepseekV3ForCausalLM; its layer reads the MLA sizes and builds a dense
    MLP of intermediate_size) and SGLang's deepseek_eagle3.py serves (its one layer is dense below
    first_k_dense_replace). model_type is deepseek_v2 (the same MLA fields): vLLM 0.32 turns every
    draft config of model_type deepseek_v3 into a DeepSeek MTP one (SpeculativeConfig.hf_config_override),
    which no EAGLE-3 class serves. The EAGLE-3 fields are sglang_config's."""
    cfg = sglang_config(c, dtype)
    for key in ("head_dim", "mlp_bias"):
        del cfg[key]
    cfg.update(
        architectures=["Eagle3DeepseekV3ForCausalLM"],
        model_type="deepseek_v2",
        q_lora_rank=c.q_lora_rank or None,
        kv_lora_rank=c.kv_lora_rank,
        qk_nope_head_dim=c.qk_nope_head_dim,
        qk_rope_head_dim=c.qk_rope_head_dim,
        v_head_dim=c.v_head_dim,
        rope_interleave=True,  # pairs (x_2i, x_2i+1), as vLLM's MLA always turns them
        first_k_dense_replace=1,
    )
    return cfg


def speculators_config(c: DraftConfig, dtype: str, verifier: str, verifier_arch: list[str], k: int) -> dict[str, Any]:
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "transformer_layer_config": _layer_fields(c, dtype),
        "draft_vocab_size": c.draft_vocab_size,
        "target_hidden_size": c.target_hidden_size,
        "norm_before_residual": c.norm_before_residual,  # vLLM's default when absent is True
        "norm_before_fc": False,
        "fc_norm": c.fc_norm,
        "norm_output": c.norm_output,
        "eagle_aux_hidden_state_layer_ids": vllm_aux_ids(c.aux_layer_ids),
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": k}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": list(verifier_arch)},
        },
        "torch_dtype": dtype,
    }


def check_layout_supported(c: DraftConfig, fmt: str) -> None:
    if c.attention == "mla" and fmt != "sglang":
        raise ConfigError(
            "an MLA draft (--train.draft_attention=mla) in the speculators layout: vLLM's speculators config builds "
            "only Llama / Qwen3 draft layers; export it with --export.format=sglang (Eagle3DeepseekV3ForCausalLM, which "
            "vLLM's deepseek_eagle3.py and SGLang load; serve it with --speculative-config)"
        )
    if fmt != "sglang":
        return
    if c.num_layers != 1:
        raise ArtifactError(
            f"SGLang's llama_eagle3.py builds exactly one draft layer; this draft has {c.num_layers}: "
            "export with --export.format=speculators (vLLM serves multi-layer EAGLE-3 drafts)"
        )
    if c.num_aux_layers != 3:
        raise ArtifactError(
            f"SGLang's llama_eagle3.py hard-codes 3 aux layers (fc input = 3 * target_hidden_size); this draft "
            f"fuses {c.num_aux_layers}: export with --export.format=speculators"
        )
    if c.norm_before_residual:
        raise ArtifactError(
            "SGLang's llama_eagle3.py always uses the un-normed residual; this draft was trained with "
            "norm_before_residual=True: export with --export.format=speculators"
        )
    if c.fc_norm or c.norm_output:
        raise ArtifactError(
            f"this draft has EAGLE 3.1's norms (fc_norm={c.fc_norm}, norm_output={c.norm_output}, from "
            "train.norms=eagle3.1), which SGLang's llama_eagle3.py cannot express: it builds no fc_norm (the "
            "weights would be skipped in silence) and feeds back the pre-norm state; export with "
            "--export.format=speculators (vLLM serves it)"
        )
    if c.sliding_window:
        raise ConfigError(
            f"this draft attends through a sliding window of {c.sliding_window} positions, which SGLang cannot "
            "apply from a draft's config (its llama.py LlamaAttention builds RadixAttention without "
            "sliding_window_size: it would serve the draft with full attention): export with "
            "--export.format=speculators (vLLM reads sliding_window and layer_types)"
        )


# --- tensors ------------------------------------------------------------------------------------


def export_tensors(model: Eagle3Draft, table: dict[str, str], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The state_dict renamed through `table`, floats cast to `dtype`; W == V made explicit-free."""
    sd = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    unknown = sorted(set(sd) - set(table))
    assert not unknown, f"state_dict names missing from the key table: {unknown}"
    c = model.config
    if c.draft_vocab_size == c.vocab_size:
        # vLLM and speculators ignore d2t when W == V: put lm_head rows in target order instead.
        target_ids = torch.arange(c.draft_vocab_size) + sd["d2t"]
        if not torch.equal(torch.sort(target_ids).values, torch.arange(c.vocab_size)):
            raise ArtifactError("d2t is not a permutation although draft_vocab_size == vocab_size: re-run `eyas prepare`")
        head = torch.empty_like(sd["lm_head.weight"])
        head[target_ids] = sd["lm_head.weight"]
        sd["lm_head.weight"] = head
        del sd["d2t"], sd["t2d"]
    out = {}
    for name, tensor in sd.items():
        if tensor.is_floating_point():
            tensor = tensor.to(dtype)
        out[table[name]] = tensor.contiguous()
    return out


def write_layout(out: Path, config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / (WEIGHTS + ".tmp")
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    tmp.replace(out / WEIGHTS)
    atomic_write_json(out / CONFIG, config)


def export_draft(
    model: Eagle3Draft,
    out_dir: str | Path,
    formats: tuple[str, ...] = ("sglang", "speculators"),
    dtype: str = "bfloat16",
    num_target_layers: int | None = None,
    verifier: str = "",
    verifier_arch: list[str] | None = None,
    num_speculative_tokens: int = 3,
) -> dict[str, Path]:
    """Write each layout under out_dir/<format>/; returns {format: directory}."""
    c = model.config
    if num_target_layers is not None:
        check_aux_ids(c.aux_layer_ids, num_target_layers, formats)
    if len(c.aux_layer_ids) != c.num_aux_layers:
        raise ArtifactError(f"draft config: {len(c.aux_layer_ids)} aux_layer_ids but num_aux_layers={c.num_aux_layers}")
    for fmt in formats:
        check_layout_supported(c, fmt)
    written = {}
    for fmt in formats:
        if fmt == "sglang" and c.attention == "mla":
            cfg = mla_config(c, dtype)
        elif fmt == "sglang":
            cfg = sglang_config(c, dtype)
        else:
            if not verifier:
                raise ConfigError("the speculators layout names its verifier: pass verifier= (the target's path or hub id)")
            cfg = speculators_config(c, dtype, verifier, verifier_arch or [], num_speculative_tokens)
        path = Path(out_dir) / fmt
        write_layout(path, cfg, export_tensors(model, key_table(fmt, c.num_layers, num_fc_norms(c), c.attention),
                                                DTYPES[dtype]))
        written[fmt] = path
    return written


# --- reading back -------------------------------------------------------------------------------


def detect_layout(config: dict[str, Any]) -> str:
    if config.get("speculators_model_type") == "eagle3":
        return "speculators"
    if {"LlamaForCausalLMEagle3", "Eagle3DeepseekV3ForCausalLM"} & set(config.get("architectures") or []):
        return "sglang"
    raise ArtifactError(f"config.json is neither an EAGLE-3 speculators nor an SGLang EAGLE-3 config: {config.get('architectures')}")


def exported_draft_config(config: dict[str, Any]) -> DraftConfig:
    """DraftConfig from an exported config.json, aux ids converted back from the engine conventions."""
    layout = detect_layout(config)
    layer = config["transformer_layer_config"] if layout == "speculators" else config
    hf_ids = list(config["eagle_aux_hidden_state_layer_ids"])
    if layout == "sglang":
        from_sglang = hf_ids_from_sglang(config["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
        if from_sglang != hf_ids:
            raise ArtifactError(f"config.json: SGLang ids {from_sglang} (as HF indices) disagree with vLLM ids {hf_ids}")
    mla = {}
    if layer.get("kv_lora_rank"):
        mla = dict(attention="mla", q_lora_rank=layer.get("q_lora_rank") or 0, kv_lora_rank=layer["kv_lora_rank"],
                   qk_nope_head_dim=layer["qk_nope_head_dim"], qk_rope_head_dim=layer["qk_rope_head_dim"],
                   v_head_dim=layer["v_head_dim"])
    head_dim = mla["qk_nope_head_dim"] + mla["qk_rope_head_dim"] if mla else layer["head_dim"]  # MLA: the key head
    return DraftConfig(
        hidden_size=layer["hidden_size"],
        num_attention_heads=layer["num_attention_heads"],
        num_key_value_heads=layer["num_key_value_heads"],
        head_dim=head_dim,
        intermediate_size=layer["intermediate_size"],
        target_hidden_size=config["target_hidden_size"],
        num_aux_layers=len(hf_ids),
        draft_vocab_size=config["draft_vocab_size"],
        vocab_size=layer["vocab_size"],
        rms_norm_eps=layer["rms_norm_eps"],
        rope_theta=layer["rope_theta"],
        rope_scaling=layer.get("rope_scaling"),
        max_position_embeddings=layer["max_position_embeddings"],
        hidden_act=layer["hidden_act"],
        norm_before_residual=config["norm_before_residual"],
        aux_layer_ids=hf_ids,
        num_layers=layer.get("num_hidden_layers", 1),
        fc_norm=bool(config.get("fc_norm", False)),  # vLLM's defaults (update_eagle3, llama_eagle3.py)
        norm_output=bool(config.get("norm_output", False)),
        sliding_window=exported_window(layer),
        **mla,
    )


def num_fc_norms(cfg: DraftConfig) -> int:
    """How many fc_norm modules the draft holds (one per aux state with EAGLE 3.1's fc_norm)."""
    return cfg.num_aux_layers if cfg.fc_norm else 0


def exported_window(layer: dict[str, Any]) -> int:
    """The sliding window vLLM applies to a layer config: its `sliding_window` where every entry of
    `layer_types` is "sliding_attention" (no layer_types: none; vLLM ignores a bare sliding_window)."""
    types = layer.get("layer_types") or []
    if not types or not layer.get("sliding_window"):
        return 0
    if set(types) != {"sliding_attention"}:
        raise ArtifactError(f"config.json: layer_types {types} mix windowed and full layers; an eyas draft "
                            "windows all of its layers or none")
    return int(layer["sliding_window"])


def whole_vocab(cfg: DraftConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """d2t, t2d of an export that holds none (W == V: its lm_head rows are in target order)."""
    return torch.zeros(cfg.draft_vocab_size, dtype=torch.int64), torch.ones(cfg.vocab_size, dtype=torch.bool)


def load_exported(directory: str | Path, embed_weight_VD: torch.Tensor | None = None) -> Eagle3Draft:
    """An exported directory (either layout) back as an eyas draft (float32 parameters)."""
    d = Path(directory)
    if not (d / CONFIG).is_file() or not (d / WEIGHTS).is_file():
        raise ArtifactError(f"{d} is not an exported draft (needs {CONFIG} and {WEIGHTS}): run `eyas export`")
    config = json.loads((d / CONFIG).read_text())
    cfg = exported_draft_config(config)
    inverse = {v: k for k, v in key_table(detect_layout(config), cfg.num_layers, num_fc_norms(cfg), cfg.attention).items()}
    tensors = read_safetensors(d / WEIGHTS, "export", "run `eyas export` again, or use another draft")
    unknown = sorted(set(tensors) - set(inverse))
    if unknown:
        raise ArtifactError(f"{d / WEIGHTS}: tensors outside the key table: {unknown}")
    sd = {inverse[k]: v for k, v in tensors.items()}
    if "d2t" not in sd:
        sd["d2t"], sd["t2d"] = whole_vocab(cfg)
    return load_state(Eagle3Draft(cfg, embed_weight_VD), sd, d / WEIGHTS)


# --- any form ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class DraftFiles:
    """Where a draft lies: `kind` checkpoint, sglang or speculators; its directory, weights and config."""

    kind: str
    dir: Path
    weights: Path
    config: Path


def find(directory: str | Path) -> DraftFiles | None:
    """The draft a directory holds (an export root: the layout inside it, speculators first), or None."""
    d = Path(directory)
    if (d / DRAFT_CONFIG).is_file() and (d / DRAFT_WEIGHTS).is_file():
        return DraftFiles("checkpoint", d, d / DRAFT_WEIGHTS, d / DRAFT_CONFIG)
    if (d / CONFIG).is_file() and (d / WEIGHTS).is_file():
        return DraftFiles(detect_layout(json.loads((d / CONFIG).read_text())), d, d / WEIGHTS, d / CONFIG)
    for layout in LAYOUTS:
        if (d / layout / CONFIG).is_file() and (d / layout / WEIGHTS).is_file():
            return find(d / layout)
    return None


def locate(directory: str | Path, what: str = "the draft", error: type[Exception] = ArtifactError) -> DraftFiles:
    """`find`, or an `error` that says what a draft directory holds; `what` names the flag."""
    files = find(directory)
    if files is None:
        state = "no such directory" if not Path(directory).is_dir() else "not a draft directory"
        raise error(
            f"{what}={str(directory)!r}: {state} (an eyas checkpoint holds {DRAFT_CONFIG} + {DRAFT_WEIGHTS}, as "
            f"train's final/; an export holds {CONFIG} + {WEIGHTS}, as `eyas export`'s speculators/ and sglang/)"
        )
    return files


def read_config(files: DraftFiles) -> DraftConfig:
    """The DraftConfig of a located draft, without reading its weights."""
    config = json.loads(files.config.read_text())
    return DraftConfig(**config) if files.kind == "checkpoint" else exported_draft_config(config)


def read_vocab(files: DraftFiles) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t, t2d) of a located draft without building it (its embedding would be the target's V x D).
    An export whose draft vocabulary is the whole vocabulary holds none: the identity then."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(files.weights), "pt") as f:
            if "d2t" in f.keys():
                return f.get_tensor("d2t"), f.get_tensor("t2d")
    except SafetensorError as e:
        stage = "train" if files.kind == "checkpoint" else "export"
        raise DamagedArtifact(f"{files.weights} is not a readable safetensors file (SafetensorError: {e}): it is "
                              f"truncated or damaged; run {stage} again, or use another draft", files.weights, stage) from e
    return whole_vocab(read_config(files))


def open_draft(directory: str | Path, embed_weight_VD: torch.Tensor | None = None, what: str = "the draft") -> Eagle3Draft:
    """Any form -> an eyas draft on the CPU: a checkpoint in its stored dtype, an export in float32."""
    files = locate(directory, what)
    if files.kind == "checkpoint":
        return load_draft(files.dir, embed_weight_VD)
    return load_exported(files.dir, embed_weight_VD)
