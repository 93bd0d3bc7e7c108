"""float8 hidden-state storage (`--extract.store_dtype=float8`) against bf16, in one run on a CPU:
bytes per token on disk, the stored states' error, and the simulated τ of a draft trained on each.

    python bench/fp8_store.py                                  # the sizes below: 13 min on a shared 2-core CPU
    python bench/fp8_store.py --conversations 12 --epochs 1 --max-steps 2 --questions 1   # a quick look
    OUT=DIR python bench/fp8_store.py                          # also DIR/bench_fp8_store.json

Target SmolLM2-135M-Instruct (`eyas.assets.smollm2_dir()`) in float32 on the CPU. One prepare
output (the first --conversations ShareGPT conversations, 256 tokens, a 4,096-token draft vocab)
is extracted twice with the default aux layers [2, 15, 27]: `--extract.store_dtype=bfloat16` and
`float8` (e4m3, a float32 scale per token for aux and one for final). The same draft (seed 0,
3 TTT steps, the CPU demo's settings but lr 1e-3) is trained the same steps on each, then evaluated with
`eyas evaluate --evaluate.mode=simulate` (the chain of 3 and a 16/4/4 EAGLE-2 tree simulated
from teacher-forced passes) on the same held-out MT-bench prompts: the bf16 draft's evaluation
decodes the target-only greedy outputs and the float8 draft's reads them
(`evaluate.target_outputs`), so both are scored on the same tokens.

Printed: bytes per token on disk (shards: states, float8's scales, ids, mask, headers), the
tokens/s of reading the states back through `HiddenStates` (one process, float8 dequantised on
the host as a training loader does), the float8 states' per-token relative RMS error against the
bf16 ones, each training's last loss and
held-out loss, and each draft's simulated τ and per-step accuracy. A draft trained for minutes on
a CPU is undertrained (τ close to 1), so a difference between the two τ is small next to what a
GPU-trained draft would show; the figures say whether float8 storage moves it at all.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from eyas import evaluate, extract, prepare, train  # noqa: E402
from eyas.assets import smollm2_dir  # noqa: E402
from eyas.config import load_config  # noqa: E402
from eyas.hidden_states import HiddenStates  # noqa: E402

DTYPES = ("bfloat16", "float8")


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--conversations", type=int, default=120, help="ShareGPT conversations prepared (and extracted)")
    p.add_argument("--epochs", type=int, default=2, help="training epochs over them, the same for both drafts")
    p.add_argument("--max-steps", type=int, default=0, help="stop training after this many steps (0 = the epochs)")
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (the CPU demo's 3e-4 barely moves a draft this short)")
    p.add_argument("--questions", type=int, default=6, help="MT-bench questions evaluated (2 turns each)")
    p.add_argument("--new-tokens", type=int, default=64, help="target-only greedy tokens per turn")
    p.add_argument("--run-dir", default="", help="where the runs go (default: a temp dir)")
    return p.parse_args()


def base(a: argparse.Namespace, root: Path, name: str) -> list[str]:
    """The overrides both runs share (the CPU demo's recipe, recipes/demo-cpu.yaml), in RUN_DIR root/name."""
    return [
        f"--run_dir={root / name}", f"--target.model={smollm2_dir()}", "--target.dtype=float32", "--seed=0",
        f"--prepare.out_dir={root / 'prepare'}", "--prepare.data=embedded:sharegpt",
        f"--prepare.max_conversations={a.conversations}", "--prepare.max_length=256", "--prepare.draft_vocab_size=4096",
        "--extract.token_budget=2048", "--extract.progress=false",
        f"--train.epochs={a.epochs}", f"--train.max_steps={a.max_steps}", "--train.ttt_steps=3", "--train.max_tokens=2048", f"--train.lr={a.lr}",
        "--train.log_every=10", "--train.eval_fraction=0.05", "--train.save_every=1000",
        "--evaluate.mode=simulate", "--evaluate.bench=mtbench", f"--evaluate.num_questions={a.questions}",
        f"--evaluate.max_new_tokens={a.new_tokens}", "--evaluate.num_draft_tokens=3",
        "--evaluate.tree_total_tokens=16", "--evaluate.tree_depth=4", "--evaluate.tree_top_k=4",
    ]


def state_error(a_dir: Path, b_dir: Path) -> dict[str, float]:
    """Per-token relative RMS error of b's states against a's (aux and final apart), mean and max over tokens."""
    a, b = HiddenStates(a_dir), HiddenStates(b_dir)
    errs: dict[str, list[torch.Tensor]] = {"aux": [], "final": []}
    for i in range(len(a)):
        x, y = a[i], b[i]
        for key, parts in errs.items():
            ref, got = x[key].float().flatten(1), y[key].float().flatten(1)
            parts.append((got - ref).norm(dim=1) / ref.norm(dim=1).clamp(min=1e-12))
    out = {}
    for key, parts in errs.items():
        e = torch.cat(parts)
        out[f"{key}_mean"], out[f"{key}_max"] = float(e.mean()), float(e.max())
    return out


def last_metrics(train_dir: Path) -> dict:
    """The last logged window's loss, τ and acc_T, and the last held-out evaluation's."""
    recs = [json.loads(x) for x in (train_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    last = {split: [x for x in recs if x["split"] == split][-1:] for split in ("train", "eval")}
    out = {}
    for split, rec in last.items():
        for k in ("loss", "tau", "acc_T"):
            out[f"{split}_{k}"] = rec[0].get(k) if rec else None
    return out


def read_speed(extract_dir: Path, passes: int = 3) -> float:
    """Tokens/s of reading every sample through HiddenStates (checksums verified first, not timed),
    the best of `passes`: what a training loader worker pays per token, float8's dequantisation included."""
    hs = HiddenStates(extract_dir)
    hs.verify()
    best = float("inf")
    for _ in range(passes):
        t0 = time.perf_counter()
        for i in range(len(hs)):
            hs[i]
        best = min(best, time.perf_counter() - t0)
    return int(hs.lengths.sum()) / best


def one_run(a: argparse.Namespace, root: Path, dtype: str, target_outputs: Path | None) -> dict:
    args = base(a, root, dtype) + [f"--extract.store_dtype={dtype}"]
    if target_outputs is not None:
        args.append(f"--evaluate.target_outputs={target_outputs}")
    cfg = load_config(None, args)
    r: dict = {"store_dtype": dtype}
    t0 = time.perf_counter()
    meta = extract.run(cfg)
    c = meta["counts"]
    r["extract"] = {"seconds": round(time.perf_counter() - t0, 1), "tokens": c["tokens"], "bytes": c["bytes"],
                    "bytes_per_token": round(c["bytes"] / c["tokens"], 2), "dtype": meta["dtype"]}
    t0 = time.perf_counter()
    tmeta = train.main(cfg)
    r["train"] = {"seconds": round(time.perf_counter() - t0, 1), "steps": tmeta["counts"]["steps"],
                  **last_metrics(cfg.stage_dir("train"))}
    t0 = time.perf_counter()
    res = evaluate.main(cfg)
    tf = res["teacher_forced"]
    r["evaluate"] = {"seconds": round(time.perf_counter() - t0, 1), "prompts": tf["num_prompts"],
                     "tau_chain_simulated": res["tau_chain_simulated"], "tau_tree_simulated": res["tau_tree_simulated"],
                     "acc_T": tf["acc"], "tau_hat": tf["tau_hat"], "positions": tf["num_positions"]}
    return r


def main() -> None:
    a = parse()
    torch.manual_seed(0)
    import tempfile

    root = Path(a.run_dir or tempfile.mkdtemp(prefix="eyas-fp8-store-"))
    t0 = time.perf_counter()
    prepare.main(load_config(None, base(a, root, "prepare-run")))
    runs = {}
    runs["bfloat16"] = one_run(a, root, "bfloat16", None)
    runs["float8"] = one_run(a, root, "float8", root / "bfloat16" / "evaluate")  # the same target-only outputs
    err = state_error(root / "bfloat16" / "extract", root / "float8" / "extract")
    for name, r in runs.items():
        r["read_tokens_per_s"] = round(read_speed(root / name / "extract"))
    result = {"date": time.strftime("%Y-%m-%d"), "cpus": os.cpu_count(), "torch": torch.__version__,
              "args": vars(a), "runs": runs, "float8_vs_bf16_state_error": err,
              "bytes_per_token_ratio": round(runs["float8"]["extract"]["bytes_per_token"]
                                             / runs["bfloat16"]["extract"]["bytes_per_token"], 4),
              "wall_s": round(time.perf_counter() - t0, 1), "run_dir": str(root)}
    print_table(result)
    if os.environ.get("OUT"):
        path = Path(os.environ["OUT"]) / "bench_fp8_store.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=1))
        print(f"wrote {path}")


def print_table(r: dict) -> None:
    print(f"\nfloat8 vs bf16 storage, SmolLM2-135M fp32 on CPU ({r['cpus']} cores), {r['wall_s']:.0f} s in all")
    print(f"{'store':<10}{'bytes/token':>13}{'read tok/s':>12}{'train loss':>12}{'eval loss':>11}{'tau chain-3':>13}"
          f"{'tau tree':>10}  acc_T (simulated prompts)")
    for name, x in r["runs"].items():
        e, t = x["evaluate"], x["train"]
        print(f"{name:<10}{x['extract']['bytes_per_token']:>13,.1f}{x['read_tokens_per_s']:>12,}{t['train_loss']:>12.4f}"
              f"{t['eval_loss'] or float('nan'):>11.4f}"
              f"{e['tau_chain_simulated']:>13.4f}{e['tau_tree_simulated'] or float('nan'):>10.4f}  "
              + " ".join(f"{v:.4f}" for v in e["acc_T"]))
    err = r["float8_vs_bf16_state_error"]
    print(f"float8 / bf16 bytes per token: {r['bytes_per_token_ratio']:.3f}; float8 states vs bf16, per-token relative "
          f"RMS error: aux mean {err['aux_mean']:.4f} max {err['aux_max']:.4f}, final mean {err['final_mean']:.4f} "
          f"max {err['final_max']:.4f}")


if __name__ == "__main__":
    main()
