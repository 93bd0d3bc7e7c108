"""What GRIFFIN's mask (`train.align_top_k`) costs per TTT step, and what a cheaper test would cost:
is the target's token among the draft's k best logits?

    python bench/align_mask.py                      # on the GPU: rows 16384 (the recipe's micro-batch), W 32000, k 3
    python bench/align_mask.py --rows 2048 --device cpu

Three forms of the same question on one step's logits (bf16, as the draft's lm_head gives them under
autocast), timed with CUDA events after warm-up:

* topk: `(logits.topk(k).indices == top1[:, None]).any(-1)`, the form eyas.train.loss.step_terms uses;
* rank: `(logits > logits.gather(1, top1[:, None])).sum(-1) < k`, fewer than k logits strictly above
  the target's (one pass over the logits instead of a selection);
* rank, compiled: the same under torch.compile (the compare and the sum fused).

The forms differ only where logits tie at the k-th place (topk keeps some of the tied tokens, rank
counts the target's token in whenever fewer than k lie strictly above it); the script prints how
many rows disagree on these logits. Session 27 trained ~12% slower per window with the mask
(k = 3) than session 26 without it (BENCHMARKS.md): this tells how much of that the selection is.
`OUT=/tmp/o` also writes $OUT/bench_align_mask.json.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch


def in_top_topk(logits_MW: torch.Tensor, top1_M: torch.Tensor, k: int) -> torch.Tensor:
    return (logits_MW.topk(k, -1).indices == top1_M[:, None]).any(-1)


def in_top_rank(logits_MW: torch.Tensor, top1_M: torch.Tensor, k: int) -> torch.Tensor:
    target_M1 = logits_MW.gather(1, top1_M.clamp(min=0)[:, None])
    return ((logits_MW > target_M1).sum(-1) < k) & (top1_M >= 0)  # top1 -1: outside the draft vocab


def time_ms(fn, device: torch.device, repeat: int) -> float:
    for _ in range(3):
        fn()
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(repeat):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / repeat
    t0 = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - t0) * 1e3 / repeat


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=16384, help="rows of one TTT step (train.max_tokens)")
    p.add_argument("--vocab", type=int, default=32000, help="draft vocabulary W")
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--repeat", type=int, default=20)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--no-compile", action="store_true", help="skip the compiled form")
    a = p.parse_args()
    device = torch.device(a.device)
    g = torch.Generator(device=device).manual_seed(0)
    # logits at a trained draft's scale (a few units apart at the top), the target's token mostly
    # near the top: its draft rank is what the mask reads
    logits_MW = (torch.randn(a.rows, a.vocab, generator=g, device=device) * 3).bfloat16()
    near_M = logits_MW.float().topk(8, -1).indices[torch.arange(a.rows, device=device),
                                                    torch.randint(0, 8, (a.rows,), generator=g, device=device)]
    top1_M = torch.where(torch.rand(a.rows, generator=g, device=device) < 0.9, near_M,
                         torch.randint(0, a.vocab, (a.rows,), generator=g, device=device))
    top1_M[:: 100] = -1  # a token outside the draft vocabulary
    forms = {"topk": lambda: in_top_topk(logits_MW, top1_M, a.k), "rank": lambda: in_top_rank(logits_MW, top1_M, a.k)}
    if not a.no_compile:
        compiled = torch.compile(in_top_rank)
        forms["rank, compiled"] = lambda: compiled(logits_MW, top1_M, a.k)
    ref_M = forms["topk"]()
    res = {"rows": a.rows, "vocab": a.vocab, "k": a.k, "device": torch.cuda.get_device_name() if device.type == "cuda"
           else "cpu", "torch": torch.__version__, "forms": {}}
    t0 = time.perf_counter()
    for name, fn in forms.items():
        ms = time_ms(fn, device, a.repeat)
        differ = int((fn() != ref_M).sum())
        res["forms"][name] = {"ms_per_ttt_step": ms, "rows_differing_from_topk": differ}
        print(f"{name:15s} {ms:8.3f} ms per TTT step ({ms * 7:7.2f} ms per 7-step micro-batch); "
              f"rows differing from topk: {differ} of {a.rows} (ties at the k-th place)", flush=True)
    print(f"({a.rows} x {a.vocab} bf16 logits, k {a.k}, {res['device']}, {time.perf_counter() - t0:.1f} s in all, "
          f"compilation included)")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "bench_align_mask.json"), "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
