"""Case cells of the large-target path as a user reads the docs (tests/fault_matrix.py, `Case`):
what the vLLM evaluator, the proxy check and the 8-GPU recipe's CPU-sized run refuse, and say,
before they spend a load or a training. Cells that need vLLM run in its venv (scripts/vllm-venv.sh,
tests/vllm_serving.py) and say so where it is missing."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

from tests.fault_matrix import Case

STAGE_DIRS = ("regenerate", "prepare", "extract", "train", "export", "evaluate")


def _in_vllm(args: list[str], log: Path, timeout: float = 900) -> tuple[int, str] | None:
    """`python -m eyas ARGS` in the vLLM venv (this checkout's eyas) -> (exit status, output); None without one."""
    from tests.vllm_serving import vllm_env, vllm_python

    py = vllm_python()
    if py is None:
        return None
    with open(log, "w") as f:
        proc = subprocess.run([str(py), "-m", "eyas", *args], stdout=f, stderr=subprocess.STDOUT, timeout=timeout,
                              env=vllm_env(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
                                           VLLM_CPU_KVCACHE_SPACE="1"), check=False, start_new_session=True)
    return proc.returncode, log.read_text(errors="replace")


NO_VLLM = (False, "needs the vLLM venv (scripts/vllm-venv.sh, or EYAS_VLLM_VENV)")


def _no_stage_ran(run: Path) -> bool:
    return not any((run / s).exists() for s in STAGE_DIRS)


def draft_of_another_target(m, work: Path, rng) -> tuple[bool, str]:
    """The finished run's draft (aux ids of an 8-layer target) evaluated in vLLM behind a 5-layer
    one: refused from the configs with exit 2, naming the ids, before an engine loads; and by
    `eyas run` before its first stage."""
    from eyas.assets import smollm2_dir
    from tests.models import save_tiny

    done = m.finished_run(work)
    short = save_tiny("llama", work / "five-layers", smollm2_dir(), layers=5)
    common = [f"--target.model={short}", f"--evaluate.draft={done / 'train' / 'final'}", "--evaluate.backend=vllm",
              "--evaluate.mode=chain"]
    rc, out = m.eyas(["evaluate", f"--run_dir={work / 'eval'}", *common], work / "evaluate.log")
    named = rc == 2 and "do not fit num_aux_layers=3 and a 5-layer target" in out
    rc2, out2 = m.eyas([*m.run_args(work / "run2"), *common], work / "run.log")
    before = rc2 == 2 and "do not fit" in out2 and _no_stage_ran(work / "run2")
    return named and before, (f"eyas evaluate exit {rc}, {'names' if named else 'does not name'} the misfit; eyas run "
                              f"exit {rc2}, {'refused before any stage' if before else 'not refused up front'}")


def vllm_eval_behind_mla(m, work: Path, rng) -> tuple[bool, str]:
    """`eyas run --evaluate.backend=vllm` with an MLA target on vLLM's CPU build: exit 2 naming
    --evaluate.backend=hf before the first stage (it failed after training, exit 1, and summary.json
    blamed a missing evaluate output)."""
    from eyas.assets import smollm2_dir
    from tests.models import save_deepseek_v3

    target = save_deepseek_v3(work / "dsv3", smollm2_dir())
    args = [*m.run_args(work / "run", f"--target.model={target}", "--evaluate.backend=vllm")]
    res = _in_vllm(args, work / "run.log")
    if res is None:
        return NO_VLLM
    rc, out = res
    held = rc == 2 and "with an MLA target" in out and "--evaluate.backend=hf" in out and _no_stage_ran(work / "run")
    return held, f"exit {rc}; " + ("refused before any stage, naming --evaluate.backend=hf" if held else out[-300:])


def bf16_proxy(m, work: Path, rng) -> tuple[bool, str]:
    """The 8-GPU recipe's bfloat16 on a tiny DeepSeek-V3 at tensor parallel 2: the proxy check judges
    vLLM against its reference's own bf16 rounding and the extraction goes on (a fixed 0.25 limit
    on that rounding refused it)."""
    from eyas.assets import smollm2_dir
    from tests.data import run_prepare, write_synthetic_chats
    from tests.models import save_deepseek_v3

    target = save_deepseek_v3(work / "dsv3", smollm2_dir(), q_lora_rank=64, yarn=True)
    chats = write_synthetic_chats(work / "chats.jsonl", 4, max_words=20)
    run_prepare(work / "run", chats, max_length=64, draft_vocab=500, model=str(target))
    res = _in_vllm(["extract", f"--run_dir={work / 'run'}", f"--target.model={target}", "--target.dtype=bfloat16",
                    "--extract.backend=vllm", "--extract.layer_ids=[1,2,3]", "--extract.vllm_parity=0",
                    "--extract.vllm_tensor_parallel_size=2"], work / "extract.log")
    if res is None:
        return NO_VLLM
    rc, out = res
    meta = work / "run" / "extract" / "meta.json"
    proxy = json.loads(meta.read_text())["counts"]["this_run"].get("vllm_proxy_parity") if meta.is_file() else None
    held = rc == 0 and proxy is not None
    return held, f"exit {rc}; " + (f"proxy checked ({proxy['samples']} samples)" if held else out[-400:])


def cpu_workers_name_their_flag(m, work: Path, rng) -> tuple[bool, str]:
    """The 8-GPU recipe's tensor parallel on a host with fewer cores: extract's error names
    --extract.vllm_tensor_parallel_size, and evaluate's is refused by `eyas run` before its first
    stage naming --evaluate.vllm_tensor_parallel_size (it named no flag, after training)."""
    done = m.finished_run(work)
    too_many = len(os.sched_getaffinity(0)) + 1
    res = _in_vllm(["extract", f"--run_dir={done}", f"--target.model={m.target}", "--extract.backend=vllm",
                    f"--extract.vllm_tensor_parallel_size={too_many}", f"--extract.out_dir={work / 'x'}"],
                   work / "extract.log")
    if res is None:
        return NO_VLLM
    rc, out = res
    extract_ok = rc == 2 and "set --extract.vllm_tensor_parallel_size" in out
    res = _in_vllm([*m.run_args(work / "run2", "--evaluate.backend=vllm",
                                       f"--evaluate.vllm_tensor_parallel_size={too_many}")], work / "run.log")
    rc2, out2 = res
    evaluate_ok = rc2 == 2 and "set --evaluate.vllm_tensor_parallel_size" in out2 and _no_stage_ran(work / "run2")
    return extract_ok and evaluate_ok, f"extract exit {rc} {'names' if extract_ok else 'does not name'} its flag; " \
        f"eyas run exit {rc2} {'refused up front naming' if evaluate_ok else 'not refused naming'} evaluate's"


def messages(m, work: Path, rng) -> tuple[bool, str]:
    """What the run says: a stage directory holding only its claim runs ("running", not
    "resuming"); under torchrun a failed rank says its own exit status (torchrun reports 1) and
    summary.json records it; embedded:smollm2 resolves in the vLLM venv."""
    done = m.finished_run(work)
    for p in (done / "regenerate").iterdir():  # as a parent `eyas run` leaves a stage it runs apart: claimed only
        if p.name != "run_key.txt":
            shutil.rmtree(p) if p.is_dir() else p.unlink()
    rc, out = m.eyas([*m.run_args(done)], work / "run.log")
    running = rc == 0 and "[eyas:run] regenerate: running" in out and "regenerate: resuming" not in out
    env = dict(os.environ, TORCHELASTIC_RUN_ID="none", OMP_NUM_THREADS="1")
    rc2, out2 = m.eyas([*m.run_args(done, f"--train.init_from={work / 'no-such-draft'}")], work / "bad.log",
                       env=env)
    own = rc2 == 2 and "this rank exits 2" in out2
    res = _in_vllm(["prepare", f"--run_dir={work / 'p'}", "--target.model=embedded:smollm2",
                    f"--prepare.data={m.chats}", "--prepare.max_conversations=4"], work / "assets.log")
    resolved = res is None or res[0] == 0
    held = running and own and resolved
    return held, (f"claimed-only stage {'runs' if running else 'resumes or fails'}; torchrun note "
                  f"{'given' if own else 'missing'}; embedded:smollm2 in the vLLM venv "
                  f"{'not tried (no venv)' if res is None else 'resolves' if resolved else 'fails'}")


CASES = [
    Case("large_target", "vllm-draft-of-another-target", draft_of_another_target, "evaluate"),
    Case("large_target", "vllm-eval-behind-mla", vllm_eval_behind_mla, "evaluate"),
    Case("large_target", "bf16-proxy-rounding", bf16_proxy, "extract"),
    Case("large_target", "cpu-workers-name-their-flag", cpu_workers_name_their_flag, "extract"),
    Case("large_target", "messages", messages, "run"),
]
