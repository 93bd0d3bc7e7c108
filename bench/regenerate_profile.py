"""Where the batched decoder's time goes on one GPU: prefill vs one decode step (graph replay),
for a random-weight model built from a config directory.

    python bench/regenerate_profile.py CONFIG_DIR [--rows 1024 256] [--width 512] [--new 64]
    python bench/regenerate_profile.py CONFIG_DIR --rows 1024 --width 1536 --new 512 --kv-block 256 4096 --no-eager

--kv-block: the decode step reads the cache slots written so far rounded up to this (one graph
per window); a block at least width + new reads the whole cache every step (the old behaviour).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from eyas.spec.static import BatchDecoder  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("config")
    p.add_argument("--rows", type=int, nargs="+", default=[1024, 256])
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--attn", default="sdpa")
    p.add_argument("--kv-block", type=int, nargs="+", default=[256])
    p.add_argument("--no-eager", action="store_true", help="graphs only")
    args = p.parse_args()
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(args.config), dtype=torch.bfloat16,
                                             attn_implementation=args.attn).cuda().eval()
    runs = [(r, k, g) for r in args.rows for k in args.kv_block for g in ((True,) if args.no_eager else (True, False))]
    for rows, kv_block, graphs in runs:
        dec = BatchDecoder(model, rows, args.width, args.new, graphs=graphs, check_every=10**9, kv_block=kv_block)
        prompts = [torch.randint(0, 1000, (args.width - (i % 200),)).tolist() for i in range(rows)]
        pick = lambda logits: logits.argmax(-1)  # noqa: E731
        dec.generate(prompts, {-1}, 0, pick)  # warm-up + a capture per window
        dec.max_new = 2
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dec.generate(prompts, {-1}, 0, pick)
        torch.cuda.synchronize()
        t_pre = time.perf_counter() - t0  # prefill + 1 decode step
        dec.max_new = args.new
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dec.generate(prompts, {-1}, 0, pick)
        torch.cuda.synchronize()
        t_all = time.perf_counter() - t0
        step = (t_all - t_pre) / (args.new - 2)
        print(f"rows {rows:5d} width {args.width} new {args.new} kv_block {kv_block} graphs {graphs!s:5}: prefill ~{t_pre:.2f} s, decode {1000 * step:.1f} ms/step "
              f"= {rows / step:,.0f} tok/s in steady decoding; peak mem {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB",
              flush=True)
        del dec
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
