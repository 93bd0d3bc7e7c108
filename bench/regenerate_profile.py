"""Where the batched decoder's time goes on one GPU: prefill vs one decode step (graph replay),
for a random-weight model built from a config directory.

    python bench/regenerate_profile.py CONFIG_DIR [--rows 1024 256] [--width 512] [--new 64]
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
    args = p.parse_args()
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(args.config), dtype=torch.bfloat16,
                                             attn_implementation=args.attn).cuda().eval()
    for rows in args.rows:
        for graphs in (True, False):
            dec = BatchDecoder(model, rows, args.width, args.new, graphs=graphs, check_every=10**9)
            prompts = [torch.randint(0, 1000, (args.width - (i % 200),)).tolist() for i in range(rows)]
            pick = lambda logits: logits.argmax(-1)  # noqa: E731
            dec.max_new = 2
            dec.generate(prompts, {-1}, 0, pick)  # warm-up + capture
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
            print(f"rows {rows:5d} width {args.width} graphs {graphs!s:5}: prefill ~{t_pre:.2f} s, decode {1000 * step:.1f} ms/step "
                  f"= {rows / step:,.0f} tok/s in steady decoding; peak mem {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB",
                  flush=True)
            del dec
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
