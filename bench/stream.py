"""Streamed against offline training, in one run: tokens per second end to end and the stream's accounting.

    VLLM_CPU_KVCACHE_SPACE=1 .venv-vllm/bin/python bench/stream.py --conversations 24
    .venv-vllm/bin/python bench/stream.py --target /models/Llama-3.1-8B-Instruct --dtype bfloat16 ...

On the same prepared samples, with the same training settings, one epoch (every sample extracted is
trained, so the offline side extracts no more than it trains; --steps N stops both earlier):
  offline   `eyas extract --extract.backend=vllm` (states to disk) then `eyas train`
  stream    `eyas train --train.mode=stream` (one vLLM engine, states through Mooncake's store)
Reported: each side's wall seconds and trained tokens per second (the offline side with and without
its extraction), the stream's inference capacity I (the engine's prefill tokens per busy second),
training capacity T (tokens per second not spent waiting for states), the achieved rate and
achieved / min(I, T) (goal >= 0.9 on hardware where neither side idles the other by design), the
seconds the trainer waited, the bytes of hidden states the offline side wrote, and whether the two
drafts are equal, and how far apart they are when not: vLLM computes a sample bit for bit the same
only when it prefills it in the same pieces; a long prompt that its scheduler splits (chunked
prefill) at another point in the two runs gets states that differ in the last bits.
-> results/stream/<name>.json
Every engine start (about 20 s on 2 CPU cores) is inside the walls; the trained tokens/s are train's
own (meta.json), which leave the start out.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def eyas(args: list[str], log: Path) -> float:
    """`python -m eyas ARGS` (this interpreter: the vLLM venv), logged; -> wall seconds. Raises on failure."""
    t0 = time.perf_counter()
    with open(log, "w") as f:
        rc = subprocess.run([sys.executable, "-m", "eyas", *args], stdout=f, stderr=subprocess.STDOUT,
                            env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")},
                            cwd=log.parent).returncode
    if rc != 0:
        raise SystemExit(f"eyas {args[0]} failed ({rc}); its log: {log}\n" + log.read_text()[-3000:])
    return time.perf_counter() - t0


def last_loss(run: Path) -> float:
    recs = [json.loads(x) for x in (run / "train" / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return [r for r in recs if r.get("split") == "train"][-1]["loss"]


def disk_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="embedded:smollm2")
    ap.add_argument("--data", default="embedded:sharegpt")
    ap.add_argument("--conversations", type=int, default=200)
    ap.add_argument("--max-length", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=0, help="optimizer steps (0: one epoch)")
    ap.add_argument("--max-tokens", type=int, default=2048)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--work", default="/tmp/eyas-bench-stream")
    ap.add_argument("--name", default="cpu")
    a = ap.parse_args()

    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    stream_run, offline_run = work / "stream", work / "offline"
    for d in (stream_run, offline_run):
        subprocess.run(["rm", "-rf", str(d)], check=True)
    common = [f"--target.model={a.target}", f"--target.dtype={a.dtype}", f"--train.max_steps={a.steps}", "--train.epochs=1",
              f"--train.max_tokens={a.max_tokens}", "--train.log_every=10", "--train.eval_fraction=0",
              "--train.save_every=0"]
    eyas(["prepare", f"--run_dir={stream_run}", f"--target.model={a.target}", f"--prepare.data={a.data}",
          f"--prepare.max_conversations={a.conversations}", f"--prepare.max_length={a.max_length}"], work / "prepare.log")
    prepared = [f"--prepare.out_dir={stream_run / 'prepare'}"]

    extract_s = eyas(["extract", f"--run_dir={offline_run}", *common, *prepared, "--extract.backend=vllm",
                      "--extract.vllm_parity=0", "--extract.verify=0", "--extract.progress=false"], work / "extract.log")
    offline_s = eyas(["train", f"--run_dir={offline_run}", *common, *prepared], work / "offline.log")
    stream_s = eyas(["train", f"--run_dir={stream_run}", *common, "--train.mode=stream", "--train.stream.parity=0"],
                    work / "stream.log")

    off = json.loads((offline_run / "train" / "meta.json").read_text())
    st = json.loads((stream_run / "train" / "meta.json").read_text())
    tokens = off["metrics"]["all_runs"]["tokens"]
    (rank,) = st["metrics"]["stream"]["ranks"]
    from safetensors.torch import load_file
    import torch

    a_draft = load_file(stream_run / "train" / "final" / "draft.safetensors")
    b_draft = load_file(offline_run / "train" / "final" / "draft.safetensors")
    result = {
        "name": a.name, "date": time.strftime("%Y-%m-%d"), "machine": platform.machine(),
        "cpus": len(os.sched_getaffinity(0)), "command": " ".join(sys.argv), "target": a.target, "dtype": a.dtype,
        "conversations": a.conversations, "steps": a.steps, "max_tokens": a.max_tokens,
        "trained_tokens": {"offline": tokens, "stream": st["metrics"]["all_runs"]["tokens"]},
        "offline": {"extract_s": extract_s, "train_s": offline_s,
                    "train_tok_s": off["metrics"]["tokens_per_s"],
                    "end_to_end_tok_s": tokens / (extract_s + offline_s),
                    "states_bytes_on_disk": disk_bytes(offline_run / "extract")},
        "stream": {"train_s": stream_s, "train_tok_s": st["metrics"]["tokens_per_s"],
                   "end_to_end_tok_s": st["metrics"]["all_runs"]["tokens"] / stream_s,
                   "engine_capacity_tok_s": rank.get("engine_tok_s"), "train_capacity_tok_s": rank["train_tok_s"],
                   "achieved_tok_s": rank["achieved_tok_s"], "achieved_over_min": rank.get("efficiency"),
                   "wait_s": rank["wait_s"], "held_s": rank["held_s"], "retries": rank["retries"],
                   "ledger": st["metrics"]["stream"]["epochs"]},
        "drafts_equal": sorted(a_draft) == sorted(b_draft) and all(torch.equal(a_draft[k], b_draft[k]) for k in a_draft),
        "drafts_max_relative_difference": max(float((a_draft[k].double() - b_draft[k].double()).abs().max()
                                                    / b_draft[k].double().abs().max().clamp_min(1e-30))
                                              for k in b_draft if b_draft[k].is_floating_point()),
        "last_train_loss": {"offline": last_loss(offline_run), "stream": last_loss(stream_run)},
    }
    out = REPO / "results" / "stream" / f"{a.name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
