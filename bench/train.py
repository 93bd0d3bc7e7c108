"""Draft-training throughput and MFU of eyas's trainer on one GPU (no hidden-state files needed).

    python bench/train.py                          # Llama-3.1-8B dims: D 4096, V 128256, W 32000,
                                                   #   seq 2048, TTT 7, flex attention, bf16 autocast
    python bench/train.py --compile --pack 2       # torch.compile the decoder step; 2 x 2048 per row
    python bench/train.py --loss-kernel compiled   # the TTT loss under torch.compile (default: eager, as eyas)
    python bench/train.py --loss lk                # train.loss: -log acceptance, against --loss kl
    python bench/train.py --align-top-k 3 --align-norm kept   # GRIFFIN's mask: its cost against --align-top-k 0
    python bench/train.py --grad-accum 4           # 4 micro-batches per optimizer step: tokens/s and
                                                   #   peak memory against --grad-accum 1
    OUT=DIR python bench/train.py                  # also writes DIR/bench_train.json

It builds the draft with random weights and random-but-realistic inputs directly on the GPU
(aux/final states at the scale of a real target's, loss masks as runs of assistant tokens), then
times `eyas.train.loop.train_step` (teacher, TTT forward, loss, backward, clip, AdamW) with CUDA
events after warm-up. FLOPs are counted here, explicitly, from the shapes the step really runs:

    fc            2*S*(K*Dt)*D forward, x2 (weight grad only: aux needs no grad)
    per TTT step  q/k/v 2*S*2D*(H+2Hkv)*d, o 2*S*H*d*D, mlp 2*S*3*D*I  (x3: forward + backward)
                  attention 4*H*d per allowed (query, key) pair of the TTT mask (causal pairs
                  inside each sample + the i diagonal keys), x3
                  each further draft layer (--num-layers) the same with D-wide q/k/v
                  lm_head 2*M_i*D*W on the M_i loss rows only (x3)
    teacher       2*N*Dt*V on the N rows that need a teacher (forward only, no grad)

MFU = counted FLOPs / step time / 989 TFLOP/s (H100/H200 dense bf16 peak); also printed against
790 TFLOP/s, the measured bf16 matmul ceiling of an H200.
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

from eyas.config import load_config  # noqa: E402
from eyas.train import build  # noqa: E402
from eyas.train.data import pack  # noqa: E402
from eyas.train.loop import train_step  # noqa: E402

PEAK = 989e12
MEASURED_PEAK = 790e12


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--intermediate", type=int, default=14336)
    p.add_argument("--num-layers", type=int, default=1, help="draft decoder layers (train.num_layers)")
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--draft-vocab", type=int, default=32000)
    p.add_argument("--target-layers", type=int, default=32)
    p.add_argument("--seq", type=int, default=2048, help="tokens per sample")
    p.add_argument("--pack", type=int, default=1, help="samples packed into one micro-batch row")
    p.add_argument("--ttt", type=int, default=7)
    p.add_argument("--grad-accum", type=int, default=1,
                   help="micro-batches per optimizer step (with > 1 each teacher matmul runs twice; counted)")
    p.add_argument("--loss-fraction", type=float, default=1.0, help="fraction of tokens with loss mask 1")
    p.add_argument("--attention", default="flex", choices=["auto", "flex", "sdpa"])
    p.add_argument("--compile", action="store_true", help="torch.compile the draft's decoder step")
    p.add_argument("--loss-kernel", default="eager", choices=["auto", "eager", "compiled"],
                   help="train.loss_kernel: each TTT step's loss eager (eyas's default) or under torch.compile "
                        "(auto: compiled on CUDA)")
    p.add_argument("--loss", default="kl", choices=["kl", "tv", "lk"],
                   help="train.loss: the soft loss (kl, eyas's default; tv and lk target the acceptance probability)")
    p.add_argument("--align-top-k", type=int, default=0,
                   help="train.align_top_k: GRIFFIN's mask (the recipe's continuations use 3); 0 = off")
    p.add_argument("--align-norm", default="valid", choices=["valid", "kept"],
                   help="train.align_norm (kept needs --align-top-k > 0)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--device", default="cuda")
    return p.parse_args()


class Synthetic:
    """Samples shaped like an extract output: aux/final at a real target's scale (RMS ~1 after
    the final norm, growing with depth for the aux layers), loss masks as assistant-turn runs."""

    def __init__(self, n: int, seq: int, k: int, dt: int, vocab: int, loss_fraction: float, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.samples = []
        for j in range(n):
            mask = torch.zeros(seq, dtype=torch.long)
            if loss_fraction >= 1:
                mask[:] = 1
            else:  # alternating user / assistant turns of ~128 tokens
                turn = 128
                for a in range(0, seq, turn):
                    mask[a : a + turn] = int(torch.rand((), generator=g) < loss_fraction)
            scale = torch.tensor([1.0, 4.0, 12.0]).view(1, k, 1) if k == 3 else 1.0
            self.samples.append(dict(
                input_ids=torch.randint(0, vocab, (seq,), generator=g), loss_mask=mask,
                aux=(torch.randn(seq, k, dt, generator=g) * scale).bfloat16(),
                final=torch.randn(seq, dt, generator=g).bfloat16(), id=f"synthetic-{j}", index=j,
            ))
        self.lengths = torch.tensor([seq] * n)

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        return self.samples[i]


def count_flops(dcfg, batch, num_steps: int) -> dict[str, float]:
    """Training FLOPs of one micro-batch, term by term (see the module docstring)."""
    D, Dt, K, I, W, V = (dcfg.hidden_size, dcfg.target_hidden_size, dcfg.num_aux_layers, dcfg.intermediate_size,
                         dcfg.draft_vocab_size, dcfg.vocab_size)
    H, Hkv, d = dcfg.num_attention_heads, dcfg.num_key_value_heads, dcfg.head_dim
    S = batch.input_ids_BS.numel()
    causal_pairs = sum(L * (L + 1) // 2 for L in batch.lengths) + (S - sum(batch.lengths)) ** 2 // 2  # padding too
    L = dcfg.num_layers
    f = {"fc": 2 * 2 * S * K * Dt * D}
    f["qkv"] = 3 * num_steps * 2 * S * (2 + L - 1) * D * (H + 2 * Hkv) * d  # layer 0 reads 2D, the others D
    f["o"] = 3 * num_steps * 2 * S * H * d * D * L
    f["mlp"] = 3 * num_steps * 2 * S * 3 * D * I * L
    f["attention"] = 3 * L * sum(4 * H * d * (causal_pairs + i * S) for i in range(num_steps))
    f["lm_head"] = 3 * sum(2 * len(r) * D * W for r in batch.rows_T)
    f["teacher"] = 2 * batch.teacher_rows_N.numel() * Dt * V
    return f


def main() -> int:
    a = parse()
    device = torch.device(a.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    from transformers import LlamaConfig

    tcfg = LlamaConfig(hidden_size=a.hidden, num_attention_heads=a.heads, num_key_value_heads=a.kv_heads,
                       intermediate_size=a.intermediate, vocab_size=a.vocab, num_hidden_layers=a.target_layers,
                       rope_theta=500000.0, max_position_embeddings=131072)
    g = torch.Generator().manual_seed(0)
    chosen = torch.randperm(a.vocab, generator=g)[: a.draft_vocab].sort().values
    d2t = chosen - torch.arange(a.draft_vocab)
    t2d = torch.zeros(a.vocab, dtype=torch.bool)
    t2d[chosen] = True
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    embed = (torch.randn(a.vocab, a.hidden, generator=g) * 0.02).to(dtype)
    head = (torch.randn(a.vocab, a.hidden, generator=g) * 0.02).to(dtype)
    layer_ids = [2, a.target_layers // 2, a.target_layers - 3]
    source = Synthetic(a.pack * a.grad_accum, a.seq, 3, a.hidden, a.vocab, a.loss_fraction)
    data = build.TrainData(source, d2t, t2d, layer_ids, embed, head, tcfg)
    cfg = load_config(None, [
        "--run_dir=/tmp/eyas-bench", f"--train.ttt_steps={a.ttt}", f"--train.max_tokens={a.seq * a.pack}",
        f"--train.attention={a.attention}", f"--train.compile={str(a.compile).lower()}", "--train.num_workers=0",
        "--train.warmup_steps=1", f"--train.num_layers={a.num_layers}", "--export.format=speculators",
        f"--train.loss_kernel={a.loss_kernel}", f"--train.align_top_k={a.align_top_k}",
        f"--train.align_norm={a.align_norm}", f"--train.loss={a.loss}",
    ])
    tr, dcfg = build.build_trainer(cfg, data, device, total_steps=10_000)
    pad = 128 if tr.attention == "flex" else 0
    batches = [pack([source[j * a.pack + i] for i in range(a.pack)], a.ttt, a.seq * a.pack, pad).to(device)
               for j in range(a.grad_accum)]
    flops: dict[str, float] = {}
    for b in batches:
        for k, v in count_flops(dcfg, b, a.ttt).items():
            flops[k] = flops.get(k, 0.0) + v * (2 if k == "teacher" and a.grad_accum > 1 else 1)
    total = sum(flops.values())
    tokens = sum(b.num_tokens for b in batches)
    print(f"draft {tr.draft.num_trainable_parameters() / 1e6:.1f}M trainable parameters; D {a.hidden}, V {a.vocab}, "
          f"W {a.draft_vocab}, {a.num_layers} draft layer(s), {a.grad_accum} x {a.pack} x {a.seq} tokens per step, TTT {a.ttt}, {tr.attention} attention, "
          f"compile {a.compile}, loss {a.loss}, loss kernel {a.loss_kernel}, align_top_k {a.align_top_k} ({a.align_norm})", flush=True)
    t0 = time.perf_counter()
    for s in range(a.warmup):
        train_step(tr, batches, s)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    print(f"warm-up ({a.warmup} steps, compilation included): {time.perf_counter() - t0:.1f} s", flush=True)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    w0 = time.perf_counter()
    for s in range(a.steps):
        train_step(tr, batches, a.warmup + s)
    if device.type == "cuda":
        end.record()
        sync()
        step_s = start.elapsed_time(end) / 1e3 / a.steps
    else:
        step_s = (time.perf_counter() - w0) / a.steps
    res = {
        "config": vars(a), "attention": tr.attention, "tokens_per_step": tokens, "step_s": step_s,
        "tokens_per_s": tokens / step_s, "tflops_per_step": total / 1e12,
        "flops_breakdown_tflop": {k: v / 1e12 for k, v in flops.items()},
        "achieved_tflop_s": total / step_s / 1e12, "mfu": total / step_s / PEAK,
        "mfu_vs_measured_790": total / step_s / MEASURED_PEAK,
        "mfu_without_teacher": (total - flops["teacher"]) / step_s / PEAK,
        "trainable_parameters": tr.draft.num_trainable_parameters(),
        "max_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
    }
    print(f"step {step_s * 1e3:.1f} ms | {res['tokens_per_s']:,.0f} tokens/s | {res['achieved_tflop_s']:.0f} TFLOP/s | "
          f"MFU {res['mfu']:.1%} of 989 ({res['mfu_vs_measured_790']:.1%} of 790 measured) | "
          f"without teacher {res['mfu_without_teacher']:.1%}")
    print("FLOPs per step (TFLOP): " + ", ".join(f"{k} {v / 1e12:.2f}" for k, v in flops.items()))
    if res["max_memory_gib"] is not None:
        print(f"peak memory {res['max_memory_gib']:.1f} GiB")
    if os.environ.get("OUT"):
        out = Path(os.environ["OUT"]) / "bench_train.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(res, indent=2))
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
