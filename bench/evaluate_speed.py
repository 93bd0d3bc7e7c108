"""Per-token cost of decoding on one GPU: target-only, chain and tree speculative decoding, with the
reference path (transformers DynamicCache, eager) and with eyas's static caches + CUDA graphs.

    python bench/evaluate_speed.py --target DIR_OR_CONFIG_DIR [--random-weights] [--new 128]
    OUT=/tmp/o python bench/evaluate_speed.py ...        # also writes $OUT/bench_evaluate_speed.json

The draft is a random Eagle3Draft shaped from the target (aux layers [2, L//2, L-3], W 32000), so
tau is ~1: what this measures is the time of one verify pass and of one round of drafting, and
that both paths give the same tokens. Prompts: chat-rendered MT-bench-like questions.
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
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from eyas.spec import speculative_generate, target_generate  # noqa: E402
from eyas.spec.static import StaticEngine  # noqa: E402

QUESTIONS = [
    "Compose an engaging travel blog post about a recent trip to Hawaii.",
    "Explain the difference between a list and a tuple in Python.",
    "What are the main causes of inflation? Answer in three paragraphs.",
]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True)
    p.add_argument("--random-weights", action="store_true", help="build the target from its config, random bf16")
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--draft-vocab", type=int, default=32000)
    args = p.parse_args()
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from spec_helpers import random_draft

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # CPU: a check of the script only
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    tok = AutoTokenizer.from_pretrained(args.target)
    if args.random_weights:
        torch.manual_seed(0)
        target = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(args.target), dtype=torch.bfloat16,
                                                  attn_implementation="sdpa")
    else:
        target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.bfloat16, attn_implementation="sdpa")
    target = target.to(dev).eval().requires_grad_(False)
    n = target.config.num_hidden_layers
    draft = random_draft(target, aux_layer_ids=(2, n // 2, n - 3), draft_tokens=list(range(args.draft_vocab)), seed=0)
    draft = draft.to(dev, target.dtype)
    engine = StaticEngine(target, draft, max_len=2048)
    prompts = [torch.tensor(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                                    tokenize=True, return_dict=False), device=dev) for q in QUESTIONS]
    kw = {"chain": dict(mode="chain", num_draft_tokens=7),
          "tree": dict(mode="tree", tree_total_tokens=60, tree_depth=8, tree_top_k=10)}
    results, tokens = {}, {}
    for path, eng in (("eager", None), ("graphs", engine)):
        for name in ("target", "chain", "tree"):
            def run(ids, new):
                if name == "target":
                    return target_generate(target, ids, max_new_tokens=new, engine=eng)
                return speculative_generate(target, draft, ids, max_new_tokens=new, engine=eng, **kw[name])

            run(prompts[0], 16)  # warm-up (graph captures included)
            sync()
            t0 = time.perf_counter()
            outs = [run(ids, args.new) for ids in prompts]
            sync()
            dt = time.perf_counter() - t0
            new = sum(len(o.tokens) for o in outs)
            passes = sum(o.stats.verify_passes for o in outs) if name != "target" else new
            results[f"{path}/{name}"] = {"ms_per_token": 1000 * dt / new, "ms_per_pass": 1000 * dt / max(passes, 1),
                                         "tokens": new, "tau": new / max(passes, 1) if name != "target" else None}
            tokens[(path, name)] = [o.tokens for o in outs]
            print(f"{path:>6} {name:>6}: {1000 * dt / new:8.2f} ms/token, {1000 * dt / max(passes, 1):8.2f} ms/pass "
                  f"({new} tokens)", flush=True)
    same = {name: tokens[("eager", name)] == tokens[("graphs", name)] for name in ("target", "chain", "tree")}
    lossless = {path: all(tokens[(path, m)] == tokens[(path, "target")] for m in ("chain", "tree"))
                for path in ("eager", "graphs")}
    print(f"graphs == eager tokens: {same}; speculative == target-only: {lossless}")
    rec = {"gpu": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
           "command": " ".join(sys.argv), "results": results, "graphs_equal_eager": same, "lossless": lossless,
           "graphs_captured": len(engine.graphs.graphs)}
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "bench_evaluate_speed.json").write_text(json.dumps(rec, indent=1))


if __name__ == "__main__":
    main()
