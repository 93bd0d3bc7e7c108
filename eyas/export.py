"""Export: an eyas draft checkpoint -> the directories SGLang and vLLM serve.

    eyas export runs/eyas/train --format both --out_dir runs/eyas/export   # single process
    eyas export recipe.yaml --export.dtype=float32 --export.checkpoint=step_2000

(Export is a few seconds of CPU work; it never runs under torchrun.)

Output: OUT/sglang/ and/or OUT/speculators/, each config.json + model.safetensors, and OUT/meta.json.

    vllm serve OUT/speculators                          # vLLM finds the verifier in the config
    vllm serve TARGET --speculative-config '{"method": "eagle3", "model": "OUT/sglang", "num_speculative_tokens": 3}'
    python -m sglang.launch_server --model TARGET --speculative-algorithm EAGLE3 --speculative-draft-model-path OUT/sglang

Every convention below was read in the engines' sources; tests/test_export.py pins each one.

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
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from eyas.artifacts import atomic_write_json, read_meta, write_meta
from eyas.draft import DRAFT_CONFIG, DRAFT_WEIGHTS, DraftConfig, Eagle3Draft, load_draft
from eyas.errors import ArtifactError, ConfigError

WEIGHTS = "model.safetensors"
CONFIG = "config.json"
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}

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


def key_table(fmt: str, num_layers: int = 1) -> dict[str, str]:
    """eyas state_dict name -> exported name for a draft of `num_layers` layers."""
    table = dict(KEY_TABLES[fmt])
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


def speculators_config(c: DraftConfig, dtype: str, verifier: str, verifier_arch: list[str], k: int) -> dict[str, Any]:
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "transformer_layer_config": _layer_fields(c, dtype),
        "draft_vocab_size": c.draft_vocab_size,
        "target_hidden_size": c.target_hidden_size,
        "norm_before_residual": c.norm_before_residual,  # vLLM's default when absent is True
        "norm_before_fc": False,
        "fc_norm": False,
        "norm_output": False,
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
        if fmt == "sglang":
            cfg = sglang_config(c, dtype)
        else:
            if not verifier:
                raise ConfigError("the speculators layout names its verifier: pass verifier= (the target's path or hub id)")
            cfg = speculators_config(c, dtype, verifier, verifier_arch or [], num_speculative_tokens)
        path = Path(out_dir) / fmt
        write_layout(path, cfg, export_tensors(model, key_table(fmt, c.num_layers), DTYPES[dtype]))
        written[fmt] = path
    return written


# --- reading back -------------------------------------------------------------------------------


def detect_layout(config: dict[str, Any]) -> str:
    if config.get("speculators_model_type") == "eagle3":
        return "speculators"
    if "LlamaForCausalLMEagle3" in (config.get("architectures") or []):
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
    return DraftConfig(
        hidden_size=layer["hidden_size"],
        num_attention_heads=layer["num_attention_heads"],
        num_key_value_heads=layer["num_key_value_heads"],
        head_dim=layer["head_dim"],
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
    )


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
    inverse = {v: k for k, v in key_table(detect_layout(config), cfg.num_layers).items()}
    tensors = load_file(str(d / WEIGHTS))
    unknown = sorted(set(tensors) - set(inverse))
    if unknown:
        raise ArtifactError(f"{d / WEIGHTS}: tensors outside the key table: {unknown}")
    sd = {inverse[k]: v for k, v in tensors.items()}
    if "d2t" not in sd:
        sd["d2t"], sd["t2d"] = whole_vocab(cfg)
    model = Eagle3Draft(cfg, embed_weight_VD)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    missing = [k for k in missing if k != "embed_weight"]
    if missing or unexpected:
        raise ArtifactError(f"{d / WEIGHTS}: missing tensors {missing}, unexpected tensors {unexpected}")
    return model


# --- consistency with the stages the draft came from --------------------------------------------


def _refuse(what: str, fix: str) -> None:
    raise ArtifactError(f"{what}: {fix}")


def check_target(c: DraftConfig, target_config: Any) -> None:
    fix = "pass the --target.model the draft was trained for"
    if c.vocab_size != target_config.vocab_size:
        _refuse(f"draft vocab_size={c.vocab_size} but the target has vocab_size={target_config.vocab_size}", fix)
    if c.target_hidden_size != target_config.hidden_size:
        _refuse(f"draft target_hidden_size={c.target_hidden_size} but the target has hidden_size={target_config.hidden_size}", fix)


def check_train_meta(c: DraftConfig, train_meta: dict[str, Any], target_model: str) -> None:
    """The checkpoint against the train stage's record of what it trained."""
    fix = "re-run `eyas train` (or export the checkpoint that meta.json describes)"
    draft = train_meta.get("draft")
    if draft is not None:
        for key, value in c.to_dict().items():
            if key in draft and draft[key] != value:
                _refuse(f"draft_config.{key}={value!r} but the train meta.json records {draft[key]!r}", fix)
    trained_for = (train_meta.get("target") or {}).get("model")
    if trained_for is not None and trained_for != target_model:
        _refuse(
            f"the draft was trained for target {trained_for!r} but --target.model={target_model!r}",
            "pass the --target.model the draft was trained for",
        )


def check_prepare(c: DraftConfig, d2t: torch.Tensor, t2d: torch.Tensor, prepare_dir: Path, meta_sha256: str | None) -> str:
    from eyas.artifacts import hash_json

    meta = read_meta(prepare_dir, "prepare")
    fix = f"re-run `eyas train` on {prepare_dir} (or point --export.prepare_dir at the prepare output the draft was trained on)"
    if meta_sha256 and hash_json(meta) != meta_sha256:
        _refuse(f"{prepare_dir}/meta.json changed after the draft was trained", fix)
    vocab = load_file(str(prepare_dir / "vocab.safetensors"))
    if vocab["d2t"].numel() != c.draft_vocab_size:
        _refuse(f"draft_vocab_size={c.draft_vocab_size} but {prepare_dir} selected {vocab['d2t'].numel()} draft tokens", fix)
    if vocab["t2d"].numel() != c.vocab_size:
        _refuse(f"vocab_size={c.vocab_size} but {prepare_dir} maps a vocabulary of {vocab['t2d'].numel()}", fix)
    if not torch.equal(vocab["d2t"], d2t):
        _refuse(f"the draft's d2t differs from {prepare_dir}/vocab.safetensors", fix)
    if not torch.equal(vocab["t2d"], t2d):
        _refuse(f"the draft's t2d differs from {prepare_dir}/vocab.safetensors", fix)
    return f"vocabulary (d2t, t2d, draft_vocab_size={c.draft_vocab_size}) matches {prepare_dir}"


def check_extract(c: DraftConfig, extract_dir: Path, meta_sha256: str | None, num_target_layers: int | None) -> str:
    from eyas.artifacts import hash_json

    meta = read_meta(extract_dir, "extract")
    fix = f"re-run `eyas train` on {extract_dir} (or point --export.extract_dir at the extract output the draft was trained on)"
    if meta_sha256 and hash_json(meta) != meta_sha256:
        _refuse(f"{extract_dir}/meta.json changed after the draft was trained", fix)
    if "layer_ids" not in meta:
        _refuse(f"{extract_dir}/meta.json records no layer_ids", "re-run `eyas extract`")
    if list(meta["layer_ids"]) != list(c.aux_layer_ids):
        _refuse(f"aux_layer_ids={c.aux_layer_ids} in the draft but {extract_dir} holds layers {list(meta['layer_ids'])}", fix)
    if "hidden_size" in meta and meta["hidden_size"] != c.target_hidden_size:
        _refuse(f"target_hidden_size={c.target_hidden_size} in the draft but {extract_dir} holds hidden_size={meta['hidden_size']}", fix)
    if num_target_layers is not None and meta.get("num_hidden_layers", num_target_layers) != num_target_layers:
        _refuse(
            f"{extract_dir} was extracted from a target with {meta['num_hidden_layers']} layers, --target.model has {num_target_layers}",
            "pass the --target.model the draft was trained for",
        )
    return f"aux layer ids {c.aux_layer_ids} match {extract_dir}"


def check_against_stages(
    c: DraftConfig,
    d2t: torch.Tensor,
    t2d: torch.Tensor,
    train_meta: dict[str, Any] | None,
    prepare_dir: Path,
    extract_dir: Path | None,
    target_config: Any | None = None,
    target_model: str = "",
) -> list[str]:
    """Refuse a draft that disagrees with its train/prepare/extract records or the target; -> notes.

    Stage outputs that do not exist are skipped with a note (a draft trained elsewhere has none).
    """
    notes = []
    inputs = (train_meta or {}).get("inputs") or {}
    if train_meta is not None:
        check_train_meta(c, train_meta, target_model)
    if target_config is not None:
        check_target(c, target_config)
    if (prepare_dir / "meta.json").is_file():
        notes.append(check_prepare(c, d2t, t2d, prepare_dir, (inputs.get("prepare") or {}).get("meta_sha256")))
    else:
        notes.append(f"no prepare output at {prepare_dir}: vocabulary not cross-checked")
    if extract_dir is None:
        notes.append("trained online (no extract stage): aux layer ids not cross-checked with an extract output")
    elif (extract_dir / "meta.json").is_file():
        num_layers = getattr(target_config, "num_hidden_layers", None)
        notes.append(check_extract(c, extract_dir, (inputs.get("extract") or {}).get("meta_sha256"), num_layers))
    else:
        notes.append(f"no extract output at {extract_dir}: aux layer ids not cross-checked")
    return notes


def checkpoint_dir(train_dir: Path, checkpoint: str) -> Path:
    """TRAIN_DIR/<checkpoint>, or TRAIN_DIR itself when it is a draft checkpoint."""
    if (train_dir / DRAFT_CONFIG).is_file() and (train_dir / DRAFT_WEIGHTS).is_file():
        return train_dir
    ckpt = train_dir / checkpoint
    if not (ckpt / DRAFT_CONFIG).is_file():
        raise ArtifactError(
            f"{ckpt} holds no draft checkpoint ({DRAFT_CONFIG}): run `eyas train` first, or pass "
            "--export.checkpoint=<subdirectory> / a checkpoint directory as TRAIN_DIR"
        )
    return ckpt


def train_meta_for(train_dir: Path, ckpt: Path) -> dict[str, Any] | None:
    """The train stage's meta.json for this checkpoint (final/ has its own copy), if any."""
    for d in (ckpt, train_dir):
        if (d / "meta.json").is_file():
            return read_meta(d, "train")
    return None


def stage_dir_for(explicit: str, train_meta: dict[str, Any] | None, stage: str, run: Path) -> Path:
    """--export.<stage>_dir, else the one the train meta.json names, else RUN_DIR/<stage>."""
    if explicit:
        return Path(explicit)
    recorded = ((train_meta or {}).get("inputs") or {}).get(stage) or {}
    return Path(recorded["dir"]) if recorded.get("dir") else run / stage


def main(cfg) -> int:
    from eyas.artifacts import atomic_write_text, hash_json
    from eyas.config import dump_config, to_dict
    from eyas.target import describe_target, load_config, model_path

    e = cfg.export
    run = Path(cfg.run_dir)
    train_dir = Path(e.train_dir) if e.train_dir else run / "train"
    ckpt = checkpoint_dir(train_dir, e.checkpoint)
    train_meta = train_meta_for(train_dir, ckpt)
    model = load_draft(ckpt)
    c = model.config
    tcfg = load_config(cfg.target)
    prepare_dir = stage_dir_for(e.prepare_dir, train_meta, "prepare", run)
    online = (((train_meta or {}).get("config") or {}).get("train") or {}).get("mode") == "online"
    # a draft trained online read no extract output: one left in RUN_DIR by an earlier run is not its data
    extract_dir = None if online and not e.extract_dir else stage_dir_for(e.extract_dir, train_meta, "extract", run)
    notes = check_against_stages(c, model.d2t, model.t2d, train_meta, prepare_dir, extract_dir, tcfg, cfg.target.model)
    averaged = average_with(model, e.average_with)
    out = cfg.stage_dir("export")
    out.mkdir(parents=True, exist_ok=True)
    (out / "meta.json").unlink(missing_ok=True)
    for fmt in ("sglang", "speculators"):
        if fmt not in e.formats and (out / fmt).is_dir():
            shutil.rmtree(out / fmt)  # a stale layout from an earlier --format must not linger
    written = export_draft(
        model,
        out,
        e.formats,
        e.dtype,
        num_target_layers=tcfg.num_hidden_layers,
        verifier=model_path(cfg.target),
        verifier_arch=list(getattr(tcfg, "architectures", None) or []),
        num_speculative_tokens=e.num_speculative_tokens,
    )
    atomic_write_text(out / "config.yaml", dump_config(cfg))
    write_meta(
        out,
        "export",
        config=to_dict(cfg),
        target=describe_target(cfg.target),
        inputs={"checkpoint": str(ckpt), "draft_config_sha256": hash_json(c.to_dict()),
                "train_meta_sha256": hash_json(train_meta) if train_meta else None, "average_with": averaged},
        formats={fmt: str(p) for fmt, p in written.items()},
        dtype=e.dtype,
        aux_layer_ids={"eyas_hf_index": c.aux_layer_ids, "vllm": vllm_aux_ids(c.aux_layer_ids),
                       "sglang": sglang_aux_ids(c.aux_layer_ids)},
        checks=notes,
    )
    for fmt, p in written.items():
        print(f"[eyas:export] {fmt:12s} -> {p}")
    for n in notes:
        print(f"[eyas:export] {n}")
    for a in averaged:
        print(f"[eyas:export] averaged with {a['dir']} (sha256 {a['weights_sha256'][:12]}; "
              f"{a['lm_head_rows_shared']:,} of {c.draft_vocab_size:,} lm_head rows shared)")
    return 0


def average_with(model: Eagle3Draft, dirs: list[str]) -> list[dict[str, Any]]:
    """export.average_with: `model` averaged in place with the exported drafts in `dirs`; what was
    averaged (directory, weights sha256, lm_head rows shared) for meta.json."""
    from eyas.assets import sha256_file
    from eyas.average import average_drafts

    if not dirs:
        return []
    others = [load_exported(d) for d in dirs]
    shared = average_drafts(model, others, dirs)
    return [{"dir": str(Path(d).resolve()), "weights_sha256": sha256_file(Path(d) / WEIGHTS), **s}
            for d, s in zip(dirs, shared, strict=True)]
