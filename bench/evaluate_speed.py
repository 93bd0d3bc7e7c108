"""Per-token cost of decoding on one GPU: target-only, chain and tree speculative decoding, with the
reference path (transformers DynamicCache, eager) and with eyas's static caches + CUDA graphs.

    python bench/evaluate_speed.py --target DIR_OR_CONFIG_DIR [--random-weights] [--new 128]
    OUT=DIR python bench/evaluate_speed.py ...           # also writes DIR/bench_evaluate_speed.json

The draft is a random Eagle3Draft shaped from the target (aux layers [2, L//2, L-3], W 32000), so
tau is ~1: what this measures is the time of one verify pass and of one round of drafting, and
that both paths give the same tokens. Prompts: chat-rendered MT-bench-like questions. Output per
path and mode: ms per token and per verify pass; then whether graphs and eager, and speculative and
target-only decoding, gave the same tokens. Without a GPU it runs on the CPU: a check of the script
only, e.g. with the embedded SmolLM2-135M's config:

    python bench/evaluate_speed.py --random-weights --new 8 \\
        --target $(python -c "from eyas.assets import smollm2_dir; print(smollm2_dir())")
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from eyas.draft import DraftConfig, Eagle3Draft  # noqa: E402
from eyas.spec import speculative_generate, target_generate  # noqa: E402
from eyas.spec.static import StaticEngine  # noqa: E402

QUESTIONS = [
    "Compose an engaging travel blog post about a recent trip to Hawaii.",
    "Explain the difference between a list and a tuple in Python.",
    "What are the main causes of inflation? Answer in three paragraphs.",
]


def random_draft(target, aux_layer_ids: list[int], draft_vocab_size: int) -> Eagle3Draft:
    """An untrained draft shaped from the target, its vocabulary the first `draft_vocab_size` ids."""
    from eyas.vocab import d2t_t2d

    torch.manual_seed(0)
    cfg = DraftConfig.from_target(target.config, draft_vocab_size=draft_vocab_size, aux_layer_ids=aux_layer_ids)
    draft = Eagle3Draft(cfg, target.get_input_embeddings().weight)
    draft.set_vocab(*d2t_t2d(np.arange(draft_vocab_size), target.config.vocab_size))
    return draft.eval().requires_grad_(False)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True, help="the target's directory (its config and tokenizer at least)")
    p.add_argument("--random-weights", action="store_true", help="build the target from its config, random bf16")
    p.add_argument("--new", type=int, default=128, help="tokens decoded per prompt")
    p.add_argument("--draft-vocab", type=int, default=32000, help="the random draft's vocabulary size W")
    args = p.parse_args()
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

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
    draft = random_draft(target, [2, n // 2, n - 3], args.draft_vocab).to(dev, target.dtype)
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
