"""The regenerate stage's batched decoder on one GPU (eyas.spec.static.BatchDecoder, what
`regenerate.static_cache` uses): where its time goes, prefill against one decode step (a CUDA graph
replay), for a random-weight model built from a config directory (config.json of the target; no
weights are read).

    python bench/regenerate.py CONFIG_DIR [--rows 1024 256] [--width 512] [--new 64]
    python bench/regenerate.py CONFIG_DIR --rows 1024 --width 1536 --new 512 --kv-block 256 4096 --no-eager

Each run (rows x kv-block x graphs or eager) decodes `--rows` prompts of about `--width` tokens
(random ids) for `--new` tokens, after a warm-up that captures the graphs. Output, one line per run:
the prefill time, the decode step in ms, the steady decoding rate in tokens/s and the peak GPU
memory. For example, with the config of the embedded SmolLM2-135M:

    python bench/regenerate.py $(python -c "from eyas.assets import smollm2_dir; print(smollm2_dir())") \\
        --rows 1024 --width 1536 --new 256 --kv-block 256 2048 --no-eager

--kv-block: the decode step reads the cache slots written so far rounded up to this (one graph
per window); a block of at least width + new reads the whole cache every step.
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
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", help="a directory with the target's config.json")
    p.add_argument("--rows", type=int, nargs="+", default=[1024, 256], help="batch rows; one run per value")
    p.add_argument("--width", type=int, default=512, help="the prompts' padded width in tokens")
    p.add_argument("--new", type=int, default=64, help="tokens decoded per row")
    p.add_argument("--attn", default="sdpa", help="the model's attn_implementation")
    p.add_argument("--kv-block", type=int, nargs="+", default=[256], help="cache window rounding; one run per value")
    p.add_argument("--no-eager", action="store_true", help="graphs only (default: graphs and eager)")
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
