"""Extract throughput: eyas vs the naive HF loop, in the same run, on the same samples' distribution.

    python bench/extract.py                        # Llama-3.1-8B architecture, random bf16 weights, 1 GPU
    OUT=/tmp/o python bench/extract.py             # also writes $OUT/bench_extract.json
    python bench/extract.py --preset tiny          # a CPU smoke run of this script (tiny Llama)

It builds the target from a config in GPU memory (no download, no weights on disk), writes a
synthetic prepare output (lengths lognormal with mean ~870, clipped to 64..2048; random token ids),
and measures, each with writes to --out-dir included:

    eyas       `eyas.extract.run` end to end (batching, hooks, pinned copies, background writer,
               parity check of the first batch, fsync of every shard): tokens / its own seconds
    naive      batch 1, `model(ids, output_hidden_states=True)`, torch.save of aux+final per sample
    forward    the same batches as eyas through the base model with nothing captured or copied
               (the compute ceiling of this batching; skip with --no-forward)

It also prints the disk's sequential write speed (a 2 GB file): eyas can only be faster than the
disk when the disk keeps up with tokens x (K+1) x D x 2 bytes/s.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from eyas import artifacts, extract  # noqa: E402
from eyas.capture import base_model, default_layer_ids  # noqa: E402
from eyas.config import load_config  # noqa: E402
from eyas.extract import plan  # noqa: E402
from eyas.extract.backend import HFBackend, ParityError  # noqa: E402

PRESETS = {
    # Llama-3.1-8B: 32 layers, D 4096, 32 heads / 8 kv heads, MLP 14336, vocab 128256
    "llama8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                    num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, max_position_embeddings=8192),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=1000, max_position_embeddings=4096),
}


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="llama8b", choices=sorted(PRESETS))
    p.add_argument("--tokens", type=int, default=0, help="tokens eyas extracts (default 700k on GPU, 20k on CPU)")
    p.add_argument("--naive-tokens", type=int, default=0, help="tokens of the naive loop (default 120k GPU, 5k CPU)")
    p.add_argument("--token-budget", type=int, default=16384)
    p.add_argument("--writer-queue", type=int, default=3)
    p.add_argument("--pack", action="store_true", help="eyas with packed rows instead of padded buckets")
    p.add_argument("--out-dir", default="", help="where the states are written (default: a temp dir); emptied after each part")
    p.add_argument("--no-forward", action="store_true", help="skip the forward-only ceiling")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def sharegpt_like_lengths(n_tokens: int, seed: int) -> torch.Tensor:
    """Lognormal lengths, mean ~870 before clipping to 64..2048, until n_tokens are reached."""
    g = torch.Generator().manual_seed(seed)
    sigma = 0.8
    mu = math.log(870) - sigma**2 / 2
    out, total = [], 0
    while total < n_tokens:
        n = int(torch.empty(1).log_normal_(mu, sigma, generator=g).clamp(64, 2048))
        out.append(n)
        total += n
    return torch.tensor(out)


def write_prepare(out: Path, lengths: torch.Tensor, vocab: int, seed: int) -> None:
    """A prepare output (the format eyas.Prepared reads) holding random token ids."""
    from safetensors.torch import save_file

    out.mkdir(parents=True)
    g = torch.Generator().manual_seed(seed)
    total = int(lengths.sum())
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    offsets[1:] = lengths.cumsum(0)
    save_file({"input_ids": torch.randint(0, vocab, (total,), generator=g, dtype=torch.int32),
               "loss_mask": torch.ones(total, dtype=torch.uint8), "offsets": offsets}, str(out / "tokens.safetensors"))
    save_file({"d2t": torch.zeros(min(32000, vocab), dtype=torch.int64), "t2d": torch.zeros(vocab, dtype=torch.bool),
               "token_counts": torch.zeros(vocab, dtype=torch.int64)}, str(out / "vocab.safetensors"))
    artifacts.atomic_write_json(out / "sample_ids.json", [f"s{i}" for i in range(len(lengths))])
    artifacts.write_meta(out, "prepare", counts={"tokens": total}, hashes={}, target={"model": "bench"})


def build_model(preset: str, device: torch.device):
    from transformers import LlamaConfig, LlamaForCausalLM

    conf = LlamaConfig(**PRESETS[preset], tie_word_embeddings=False)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    t0 = time.perf_counter()
    with torch.device(device):  # random init directly in GPU memory: seconds, not minutes
        model = LlamaForCausalLM._from_config(conf, dtype=dtype)
    model.to(device).eval().requires_grad_(False)
    print(f"[bench] built {preset} ({sum(p.numel() for p in model.parameters()) / 1e9:.2f} B params, {dtype}) "
          f"in {time.perf_counter() - t0:.1f} s", flush=True)
    return conf, model


def disk_write_speed(d: Path, size: int) -> float:
    buf = torch.empty(64 << 20, dtype=torch.uint8).numpy()
    path = d / "ddtest"
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(max(1, size // buf.nbytes)):
            f.write(buf)
        f.flush()
        os.fsync(f.fileno())
    dt = time.perf_counter() - t0
    path.unlink()
    return max(1, size // buf.nbytes) * buf.nbytes / dt


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_eyas(args, root: Path, conf_dir: Path, model, out: Path, extra: list[str]) -> dict:
    overrides = [f"--run_dir={root}", f"--prepare.out_dir={root / 'prepare'}", f"--target.model={conf_dir}",
                 f"--extract.out_dir={out}", f"--extract.token_budget={args.token_budget}",
                 f"--extract.writer_queue={args.writer_queue}", f"--extract.pack={str(args.pack).lower()}", *extra]
    cfg = load_config(None, overrides)
    # the model is already in memory: hand it to the stage instead of loading weights from disk
    extract.make_backend = lambda cfg, setup, device: HFBackend(model, setup.layer_ids, setup.store_dtype)
    t0 = time.perf_counter()
    meta = extract.run(cfg)
    wall = time.perf_counter() - t0
    r = meta["counts"]["this_run"]
    return {"tokens": r["tokens"], "seconds": r["seconds"], "tok_s": r["tokens_per_s"], "wall_s_with_preflight": wall,
            "padding_waste": r["padding_waste"], "gb_written": meta["counts"]["bytes"] / 1e9,
            "parity_max_error": r["parity_max_error"], "parity_checked": r["parity_checked"]}


@torch.no_grad()
def run_naive(model, lengths: torch.Tensor, ids: torch.Tensor, layer_ids: list[int], out: Path,
              device: torch.device) -> dict:
    """batch 1, output_hidden_states=True, torch.save per sample: what a first script does."""
    out.mkdir(parents=True, exist_ok=True)
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.long)
    offsets[1:] = lengths.cumsum(0)
    model(input_ids=ids[:64].view(1, -1).to(device))  # warm-up
    sync(device)
    t0 = time.perf_counter()
    for i in range(len(lengths)):
        x = ids[offsets[i] : offsets[i + 1]].view(1, -1).to(device)
        hs = model(input_ids=x, output_hidden_states=True).hidden_states
        aux = torch.stack([hs[k][0] for k in layer_ids], dim=1).cpu()
        torch.save({"input_ids": x[0].cpu(), "aux": aux, "final": hs[-1][0].cpu()}, out / f"{i}.pt")
    os.sync()  # eyas fsyncs its shards; flush these too so both include the disk
    dt = time.perf_counter() - t0
    return {"tokens": int(lengths.sum()), "seconds": dt, "tok_s": int(lengths.sum()) / dt}


@torch.no_grad()
def run_forward(model, lengths: torch.Tensor, ids: torch.Tensor, budget: int, device: torch.device) -> dict:
    """The eyas batches through the base model, nothing captured, copied or written."""
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.long)
    offsets[1:] = lengths.cumsum(0)
    batches = plan.make_batches(list(range(len(lengths))), lengths, budget, 512, False)
    base = base_model(model)
    inputs = [b.input_ids([ids[offsets[i] : offsets[i + 1]] for i in b.indices]).to(device) for b in batches]
    base(input_ids=inputs[-1], use_cache=False)  # warm-up
    sync(device)
    t0 = time.perf_counter()
    for x in inputs:
        base(input_ids=x, use_cache=False)
    sync(device)
    dt = time.perf_counter() - t0
    return {"tokens": int(lengths.sum()), "seconds": dt, "tok_s": int(lengths.sum()) / dt,
            "padding_waste": plan.padding_waste(batches)}


def main() -> None:
    args = parse()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gpu = device.type == "cuda"
    tokens = args.tokens or (700_000 if gpu else 20_000)
    naive_tokens = args.naive_tokens or (120_000 if gpu else 5_000)
    root = Path(tempfile.mkdtemp(prefix="eyas-bench-"))
    out = Path(args.out_dir) if args.out_dir else root / "out"
    out.mkdir(parents=True, exist_ok=True)
    result: dict = {"preset": args.preset, "device": torch.cuda.get_device_name(device) if gpu else "cpu",
                    "torch": torch.__version__, "token_budget": args.token_budget, "pack": args.pack}
    try:
        import transformers

        result["transformers"] = transformers.__version__
        conf, model = build_model(args.preset, device)
        conf_dir = root / "target"
        conf.save_pretrained(str(conf_dir))  # preflight reads the config; the weights stay in memory
        layer_ids = default_layer_ids(conf.num_hidden_layers)
        lengths = sharegpt_like_lengths(tokens, args.seed)
        write_prepare(root / "prepare", lengths, conf.vocab_size, args.seed)
        result["samples"], result["mean_length"] = len(lengths), round(float(lengths.float().mean()), 1)
        bpt = (len(layer_ids) + 1) * conf.hidden_size * (2 if gpu else 4)
        print(f"[bench] {len(lengths)} samples, {int(lengths.sum()):,} tokens, mean length {result['mean_length']}; "
              f"{bpt} bytes/token", flush=True)
        speed = disk_write_speed(out, (2 << 30) if gpu else (64 << 20))
        result["disk_write_gb_s"] = round(speed / 1e9, 3)
        print(f"[bench] disk {out}: {speed / 1e9:.2f} GB/s sequential write = {speed / bpt:,.0f} tokens/s at most", flush=True)

        try:
            result["eyas"] = run_eyas(args, root, conf_dir, model, out / "eyas", [])
        except ParityError as e:
            result["parity_error"] = str(e)
            print(f"[bench] PARITY CHECK FAILED (re-running without it to time the rest): {e}", flush=True)
            shutil.rmtree(out / "eyas", ignore_errors=True)
            result["eyas"] = run_eyas(args, root, conf_dir, model, out / "eyas", ["--extract.parity_tol=1e9"])
        shutil.rmtree(out / "eyas", ignore_errors=True)
        if gpu:
            torch.cuda.empty_cache()

        from eyas.prepared import Prepared

        prep = Prepared(root / "prepare")
        n = int((prep.lengths.cumsum(0) < naive_tokens).sum()) + 1
        sub = prep.lengths[:n]  # the first n samples: same distribution, drawn in the same order
        result["naive"] = run_naive(model, sub, prep._ids.long(), layer_ids, out / "naive", device)
        shutil.rmtree(out / "naive", ignore_errors=True)
        if not args.no_forward:
            result["forward_only"] = run_forward(model, prep.lengths, prep._ids.long(), args.token_budget, device)
        result["ratio_eyas_over_naive"] = round(result["eyas"]["tok_s"] / result["naive"]["tok_s"], 2)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    e, nv = result["eyas"], result["naive"]
    print("\n[bench] extract throughput (writes included)")
    print(f"  eyas     {e['tok_s']:>10,.0f} tok/s  ({e['tokens']:,} tokens in {e['seconds']:.1f} s, padding waste "
          f"{e['padding_waste']:.1%}, {e['gb_written']:.1f} GB, parity max rel err {e['parity_max_error']:.2e})")
    print(f"  naive    {nv['tok_s']:>10,.0f} tok/s  ({nv['tokens']:,} tokens in {nv['seconds']:.1f} s)")
    if "forward_only" in result:
        f = result["forward_only"]
        print(f"  forward  {f['tok_s']:>10,.0f} tok/s  (same batches, nothing captured/copied/written)")
    print(f"  ratio    {result['ratio_eyas_over_naive']:>10.2f} x  eyas / naive")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"]).mkdir(parents=True, exist_ok=True)
        path = Path(os.environ["OUT"]) / "bench_extract.json"
        path.write_text(json.dumps(result, indent=2) + "\n")
        print(f"[bench] wrote {path}")


if __name__ == "__main__":
    main()
