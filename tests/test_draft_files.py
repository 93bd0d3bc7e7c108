"""eyas.draft_files: key tables, round trips, each engine's loader expectations and aux-id convention,
refusals. The drafts are real Eagle3Drafts sized for the real SmolLM2 config (W = 512,
tests/smollm2_drafts.py)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from eyas.draft import Eagle3Draft
from eyas.draft_files import (
    SGLANG_KEYS,
    SPECULATORS_KEYS,
    key_table,
    load_exported,
    sglang_aux_ids,
    vllm_aux_ids,
)
from eyas.errors import ArtifactError
from tests.smollm2_drafts import AUX, L, export, smollm2_draft


@pytest.fixture(scope="module")
def draft(tcfg):
    return smollm2_draft(tcfg, draft_vocab=512, aux_layer_ids=AUX).eval()


def draft_outputs(draft: Eagle3Draft, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Two chained draft steps on random inputs: (logits_BSW of step 1, target ids of its argmax)."""
    c = draft.config
    g = torch.Generator().manual_seed(seed)
    embed = torch.randn(c.vocab_size, c.hidden_size, generator=g)
    draft.set_embedding(embed)
    ids = torch.randint(0, c.vocab_size, (2, 7), generator=g)
    aux = torch.randn(2, 7, c.num_aux_layers, c.target_hidden_size, generator=g)
    pos = torch.arange(7).expand(2, 7)
    with torch.no_grad():
        h, k, v = draft.forward_step(ids, draft.fuse(aux), pos)
        mask = torch.ones(7, 14, dtype=torch.bool).tril(7).unsqueeze(0)
        h2, _, _ = draft.forward_step(ids.roll(1, 1), h, pos + 1, k, v, mask)
        logits = draft.logits(h2)
    return logits, logits.argmax(-1) + draft.d2t[logits.argmax(-1)]


# --- key tables ------------------------------------------------------------------------------------


def test_key_tables_cover_exactly_the_draft_state_dict(draft):
    names = set(draft.state_dict())
    assert set(SGLANG_KEYS) == names and set(SPECULATORS_KEYS) == names
    for table in (SGLANG_KEYS, SPECULATORS_KEYS):
        assert len(set(table.values())) == len(table)
        assert not any("embed" in v for v in table.values())  # the target's embedding is shared
    # speculators 0.9.0 convert/eagle/eagle3_converter.py: key.replace("midlayer.", "layers.0.")
    assert SPECULATORS_KEYS == {k: v.replace("midlayer.", "layers.0.") for k, v in SGLANG_KEYS.items()}


# --- round trips -----------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["sglang", "speculators"])
def test_round_trip_float32_is_identical(draft, tmp_path, fmt):
    out = export(draft, tmp_path, formats=(fmt,), dtype="float32")[fmt]
    back = load_exported(out)
    assert back.config == draft.config
    for name, t in draft.state_dict().items():
        if name != "embed_weight":
            assert torch.equal(back.state_dict()[name], t), name
    logits_a, ids_a = draft_outputs(draft)
    logits_b, ids_b = draft_outputs(back)
    assert torch.equal(logits_a, logits_b) and torch.equal(ids_a, ids_b)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_round_trip_low_precision_equals_the_rounded_draft(draft, tmp_path, dtype):
    out = export(draft, tmp_path, formats=("speculators",), dtype=dtype)["speculators"]
    tensors = load_file(str(out / "model.safetensors"))
    want = getattr(torch, dtype)
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    assert all(t.dtype == want for k, t in tensors.items() if k not in ("d2t", "t2d"))
    assert json.loads((out / "config.json").read_text())["transformer_layer_config"]["torch_dtype"] == dtype
    rounded = Eagle3Draft(draft.config)
    rounded.load_state_dict({k: (v.to(want).float() if v.is_floating_point() else v) for k, v in draft.state_dict().items()}, strict=False)
    back = load_exported(out)
    assert torch.equal(draft_outputs(back)[0], draft_outputs(rounded)[0])


def test_full_vocab_draft_puts_lm_head_in_target_order(tmp_path):
    """vLLM and speculators drop d2t when W == V (no draft_id_to_target_id): rows must be in target order."""
    from transformers import LlamaConfig

    tcfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=2, num_key_value_heads=1)
    d = smollm2_draft(tcfg, draft_vocab=64, aux_layer_ids=[2, 4, 5])
    perm = torch.randperm(64, generator=torch.Generator().manual_seed(1))  # a non-identity mapping
    d.d2t.copy_(perm - torch.arange(64))
    d.t2d.fill_(True)
    out = export(d, tmp_path, formats=("sglang", "speculators"), dtype="float32", num_target_layers=8)
    for path in out.values():
        tensors = load_file(str(path / "model.safetensors"))
        assert "d2t" not in tensors and "t2d" not in tensors
        assert torch.equal(tensors["lm_head.weight"][perm], d.lm_head.weight)
        back = load_exported(path)
        assert torch.equal(draft_outputs(back)[1], draft_outputs(d)[1])  # same target tokens


# --- the SGLang layout against SGLang's loader -----------------------------------------------------

# sgl-project/sglang python/sglang/srt/models/llama_eagle3.py (commits 03d5a777, d737979c):
# LlamaForCausalLMEagle3.named_parameters() for a 1-layer draft without its own embedding
# (embed_tokens comes from the target), and its load_weights name handling, verbatim in effect:
SGLANG_PARAMS = {
    "model.embed_tokens.weight",
    "model.fc.weight",
    "model.midlayer.input_layernorm.weight",
    "model.midlayer.hidden_norm.weight",
    "model.midlayer.self_attn.qkv_proj.weight",
    "model.midlayer.self_attn.o_proj.weight",
    "model.midlayer.post_attention_layernorm.weight",
    "model.midlayer.mlp.gate_up_proj.weight",
    "model.midlayer.mlp.down_proj.weight",
    "model.norm.weight",
    "lm_head.weight",
}


SGLANG_STACKED = [(".qkv_proj", ".q_proj", "q"), (".qkv_proj", ".k_proj", "k"), (".qkv_proj", ".v_proj", "v"),
                  (".gate_up_proj", ".gate_proj", 0), (".gate_up_proj", ".up_proj", 1)]  # fmt: skip


def sglang_load_weights(names):
    """SGLang's load_weights name logic: -> (param each weight lands in or None = silently skipped, hot_token_id seen)."""
    landed, hot = {}, False
    for name in names:
        if "d2t" in name:
            hot = True
            continue
        if "t2d" in name:
            continue
        for param_name, weight_name, _ in SGLANG_STACKED:
            if weight_name not in name:
                continue
            name2 = name.replace(weight_name, param_name)
            param = f"model.{name2}" if name2 not in SGLANG_PARAMS else name2
            landed[name] = param if param in SGLANG_PARAMS else None
            break
        else:
            param = name if name in SGLANG_PARAMS else f"model.{name}"
            landed[name] = param if param in SGLANG_PARAMS else None
    return landed, hot


def test_sglang_layout_matches_sglang_loader(draft, tmp_path):
    out = export(draft, tmp_path, formats=("sglang",))["sglang"]
    tensors = load_file(str(out / "model.safetensors"))
    landed, hot = sglang_load_weights(tensors)
    assert hot, "d2t must reach SGLang's hot_token_id"
    skipped = [k for k, p in landed.items() if p is None]
    assert not skipped, f"SGLang would silently skip {skipped}"
    assert set(landed.values()) == SGLANG_PARAMS - {"model.embed_tokens.weight"}
    c = draft.config
    assert tensors["fc.weight"].shape == (c.hidden_size, 3 * c.target_hidden_size)  # fc: target_hidden_size * 3
    assert tensors["midlayer.self_attn.q_proj.weight"].shape[1] == 2 * c.hidden_size  # qkv take 2D inputs
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["num_hidden_layers"] == 1
    assert cfg["tie_word_embeddings"] is False  # else SGLang makes lm_head the embedding
    assert (cfg["vocab_size"], cfg["draft_vocab_size"]) == (49152, 512)
    assert (cfg["hidden_size"], cfg["target_hidden_size"], cfg["head_dim"]) == (576, 576, 64)
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 14, 26]  # SGLang's convention
    assert cfg["norm_before_residual"] is False


def test_sglang_layout_refuses_what_sglang_cannot_serve(tcfg, tmp_path):
    with pytest.raises(ArtifactError, match="exactly one draft layer"):
        export(smollm2_draft(tcfg, num_layers=2), tmp_path, formats=("sglang",))
    with pytest.raises(ArtifactError, match="3 aux layers"):
        export(smollm2_draft(tcfg, aux_layer_ids=[2, 10, 20, 27]), tmp_path, formats=("sglang",))
    with pytest.raises(ArtifactError, match="norm_before_residual"):
        export(smollm2_draft(tcfg, norm_before_residual=True), tmp_path, formats=("sglang",))
    with pytest.raises(ArtifactError, match="HF index 0"):
        export(smollm2_draft(tcfg, aux_layer_ids=[0, 15, 27]), tmp_path, formats=("sglang",))
    export(smollm2_draft(tcfg, aux_layer_ids=[0, 15, 27]), tmp_path, formats=("speculators",))  # vLLM captures id 0


# --- the speculators layout against vLLM's reader ----------------------------------------------------


def test_speculators_layout_matches_vllm_reader(draft, tmp_path):
    out = export(draft, tmp_path, formats=("speculators",), num_speculative_tokens=5)["speculators"]
    cfg = json.loads((out / "config.json").read_text())
    # vllm/transformers_utils/config.py: only a config without model_type and with speculators_config
    # is read as a speculators model
    assert "model_type" not in cfg and "speculators_config" in cfg
    # configs/speculators/base.py validate_speculators_config + build_vllm_speculative_config
    sc = cfg["speculators_config"]
    assert sc["proposal_methods"][0]["speculative_tokens"] == 5
    assert sc["default_proposal_method"] == sc["proposal_methods"][0]["proposal_type"] == "greedy"
    assert sc["verifier"] == {"name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct", "architectures": ["LlamaForCausalLM"]}
    assert cfg["speculators_model_type"] == "eagle3" and isinstance(cfg["transformer_layer_config"], dict)
    # configs/speculators/algos.py update_eagle3 reads these; norm_before_residual defaults to True there
    assert cfg["norm_before_residual"] is False
    assert (cfg["draft_vocab_size"], cfg["target_hidden_size"]) == (512, 576)
    assert cfg["eagle_aux_hidden_state_layer_ids"] == AUX
    layer = cfg["transformer_layer_config"]
    assert layer["model_type"] == "llama" and layer["num_hidden_layers"] == 1 and layer["head_dim"] == 64
    assert (layer["vocab_size"], layer["rope_theta"], layer["tie_word_embeddings"]) == (49152, 100000.0, False)
    tensors = load_file(str(out / "model.safetensors"))
    assert {k for k in tensors if k.startswith("layers.0.")} == {v for v in SPECULATORS_KEYS.values() if v.startswith("layers.0.")}
    assert not any(k.startswith("midlayer.") for k in tensors)


# --- aux-layer-id conventions ------------------------------------------------------------------------


def test_aux_ids_each_engine_convention(draft, tmp_path):
    out = export(draft, tmp_path)
    sg = json.loads((out["sglang"] / "config.json").read_text())
    sp = json.loads((out["speculators"] / "config.json").read_text())
    # eyas id k = HF hidden_states[k] = the stream entering layer k
    # vLLM (models/llama.py): _maybe_add_hidden_state(aux, idx + 1, ...) after layer idx -> same index
    assert vllm_aux_ids(AUX) == AUX == sp["eagle_aux_hidden_state_layer_ids"] == sg["eagle_aux_hidden_state_layer_ids"]
    # SGLang (models/llama.py set_eagle3_layers_to_capture): layers_to_capture = [val + 1 ...], and
    # LlamaModel.forward captures `hidden_states + residual` before layer i: captured HF index = val + 1
    sglang_ids = sg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    assert sglang_ids == sglang_aux_ids(AUX) == [1, 14, 26]
    assert [val + 1 for val in sglang_ids] == AUX


def test_aux_ids_written_even_when_they_equal_the_engine_defaults(draft, tmp_path):
    """[2, L//2, L-3] is both engines' default for SmolLM2; eyas writes the ids anyway."""
    assert AUX == [2, L // 2, L - 3]
    out = export(draft, tmp_path)
    assert "eagle_aux_hidden_state_layer_ids" in json.loads((out["speculators"] / "config.json").read_text())
    assert "eagle_config" in json.loads((out["sglang"] / "config.json").read_text())


def test_vllm_reads_the_top_level_ids_before_sglangs_nested_ones(draft, tmp_path):
    """vLLM's _get_eagle3_aux_layers_from_config falls back to eagle_config's ids *without* the
    shift SGLang applies: the top-level field must be present so vLLM never reads the nested one."""
    cfg = json.loads((export(draft, tmp_path, formats=("sglang",))["sglang"] / "config.json").read_text())
    top = cfg.get("eagle_aux_hidden_state_layer_ids")
    vllm_sees = top if top else cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    assert vllm_sees == AUX


def test_aux_ids_outside_the_capturable_range_are_refused(tcfg, tmp_path):
    with pytest.raises(ArtifactError, match=r"\[30\] outside \[0, 29\]"):
        export(smollm2_draft(tcfg, aux_layer_ids=[2, 15, 30]), tmp_path)


def test_aux_ids_not_ascending_are_refused(tcfg, tmp_path):
    # the engines fill fc's input in layer order: a draft trained on [27, 15, 2] serves at tau~1
    with pytest.raises(ArtifactError, match="not strictly ascending"):
        export(smollm2_draft(tcfg, aux_layer_ids=[27, 15, 2]), tmp_path)


# --- multi-layer drafts (vLLM only) --------------------------------------------------------------------


def test_multi_layer_speculators_layout_round_trips_with_vllms_names(tcfg, tmp_path):
    """num_layers = 3: layer 0 keeps layers.0.* (2D-wide qkv, hidden_norm), the others are
    layers.1.* and layers.2.* with D-wide qkv and no hidden_norm (vLLM llama_eagle3.py
    `layer_idx > 0`); transformer_layer_config says 3 layers; float32 reads back exactly."""
    draft = smollm2_draft(tcfg, num_layers=3).eval()
    table = key_table("speculators", 3)
    assert set(table) == set(draft.state_dict()) and len(set(table.values())) == len(table)
    assert table["extra_layers.1.mlp.down_proj.weight"] == "layers.2.mlp.down_proj.weight"
    assert key_table("speculators", 1) == SPECULATORS_KEYS
    out = export(draft, tmp_path, formats=("speculators",), dtype="float32")["speculators"]
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["transformer_layer_config"]["num_hidden_layers"] == 3
    tensors = load_file(str(out / "model.safetensors"))
    assert tensors["layers.0.self_attn.q_proj.weight"].shape == (576, 2 * 576)
    for j in (1, 2):
        assert tensors[f"layers.{j}.self_attn.q_proj.weight"].shape == (576, 576)
        assert f"layers.{j}.hidden_norm.weight" not in tensors
    back = load_exported(out)
    assert back.config == draft.config and back.config.num_layers == 3
    logits_a, ids_a = draft_outputs(draft)
    logits_b, ids_b = draft_outputs(back)
    assert torch.equal(logits_a, logits_b) and torch.equal(ids_a, ids_b)


# --- EAGLE 3.1 norms (vLLM only) ---------------------------------------------------------------------


def test_eagle31_speculators_layout_round_trips_with_vllms_names(tcfg, tmp_path):
    """fc_norm + norm_output: config.json's top-level fc_norm / norm_output (what vLLM's
    update_eagle3 copies into the draft config), K tensors fc_norm.{k}.weight of target_hidden_size
    (vLLM llama_eagle3.py LlamaModel.fc_norm); float32 reads back to the same outputs."""
    draft = smollm2_draft(tcfg, fc_norm=True, norm_output=True).eval()
    assert key_table("speculators", 1, 3) == {**SPECULATORS_KEYS, **{f"fc_norm.{k}.weight": f"fc_norm.{k}.weight" for k in range(3)}}
    assert set(key_table("speculators", 1, 3)) == set(draft.state_dict())
    out = export(draft, tmp_path, formats=("speculators",), dtype="float32")["speculators"]
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["fc_norm"], cfg["norm_output"], cfg["norm_before_fc"]) == (True, True, False)
    tensors = load_file(str(out / "model.safetensors"))
    assert [tuple(tensors[f"fc_norm.{k}.weight"].shape) for k in range(3)] == [(576,)] * 3
    back = load_exported(out)
    assert back.config == draft.config and back.config.fc_norm and back.config.norm_output
    logits_a, ids_a = draft_outputs(draft)
    logits_b, ids_b = draft_outputs(back)
    assert torch.equal(logits_a, logits_b) and torch.equal(ids_a, ids_b)
    # each flag changes what the draft computes (so one lost on the way would show)
    for flag in ("fc_norm", "norm_output"):
        cfg_off = json.loads((out / "config.json").read_text())
        cfg_off[flag] = False
        (out / "config.json").write_text(json.dumps(cfg_off))
        if flag == "fc_norm":
            with pytest.raises(ArtifactError, match="fc_norm.0.weight"):  # vLLM too raises on unknown names
                load_exported(out)
        else:
            assert not torch.allclose(draft_outputs(load_exported(out))[0], logits_a)
        (out / "config.json").write_text(json.dumps(cfg))


def test_eagle31_norms_are_refused_for_the_sglang_layout(tcfg, tmp_path):
    for flags in ({"fc_norm": True}, {"norm_output": True}):
        with pytest.raises(ArtifactError, match="--export.format=speculators"):
            export(smollm2_draft(tcfg, **flags), tmp_path, formats=("sglang",))
    assert not (tmp_path / "sglang").exists()


def test_sliding_window_export_writes_the_keys_vllm_reads_and_reads_back(tcfg, tmp_path):
    """A windowed draft: `sliding_window` and one "sliding_attention" per layer in the layer config
    (vLLM models/llama.py windows a layer only through layer_types), read back with its window and
    the same outputs (which the window changes); SGLang, which cannot apply it, is refused."""
    from eyas.errors import ConfigError

    draft = smollm2_draft(tcfg, num_layers=2, sliding_window=3).eval()
    out = export(draft, tmp_path, formats=("speculators",), dtype="float32")["speculators"]
    layer = json.loads((out / "config.json").read_text())["transformer_layer_config"]
    assert (layer["sliding_window"], layer["layer_types"]) == (3, ["sliding_attention"] * 2)
    back = load_exported(out)
    assert back.config == draft.config and back.config.sliding_window == 3
    logits_a, _ = draft_outputs(draft)
    assert torch.equal(logits_a, draft_outputs(back)[0])
    draft.config.sliding_window = 0
    assert not torch.allclose(logits_a, draft_outputs(draft)[0])  # positions 3.. lose keys to the window
    full = json.loads((export(draft, tmp_path / "full", formats=("speculators",))["speculators"] / "config.json").read_text())
    assert not {"sliding_window", "layer_types"} & set(full["transformer_layer_config"])
    with pytest.raises(ConfigError, match="export.format=speculators"):
        export(smollm2_draft(tcfg, sliding_window=3), tmp_path / "sg", formats=("sglang",))
