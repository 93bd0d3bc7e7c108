"""Extract throughput: eyas variants vs the bare forward and the naive HF loop, in one run, one model.

    python bench/extract.py                              # Llama-3.1-8B arch, random bf16 weights, 1 GPU
    OUT=DIR python bench/extract.py --profile            # + where the time goes; writes DIR/bench_extract.json
    python bench/extract.py --variants default,compile+budget32k --tokens 700000
    python bench/extract.py --preset tiny --variants default,pack,budget4k   # a CPU smoke run of this script

It builds the target from a config in GPU memory (no download, no weights on disk), writes a
synthetic prepare output (lengths lognormal with mean ~870, clipped to 64..2048; random token ids)
and runs every variant on that model (compile variants on a fresh one, see below). A variant is `+`-joined changes to the stage
defaults: `default` (none), `pack` (--extract.pack=true), `budget32k` / `budgetN`
(--extract.token_budget), `qN` (--extract.writer_queue), `compile` (torch.compile of the decoder
layers, `HFBackend(compile=True)`), `shm` (write to /dev/shm instead of --out-dir). Per variant:

    forward   the variant's batches through the base model with nothing captured, copied or written
              (the compute ceiling of that batching; run first, it also warms the allocator and
              cuBLAS up for those shapes, as a long run would be; skip with --no-forward)
    eyas      `eyas.extract.run` end to end (batching, hooks, pinned copies, background writers,
              parity check of the first batch, fsync of every shard): tokens / the stage's seconds;
              with --profile also `steady`, the same without the smoke test and the parity check

and once: naive (batch 1, `model(ids, output_hidden_states=True)`, torch.save of aux+final per
sample), the disk's sequential write speed (2 GB, fsync) and sha256 speed on 1 and 2 threads:
eyas cannot beat the disk, nor twice one core's sha256 (two shards are hashed at once).

Compile variants run after the others, on a freshly built model: as in a new `eyas extract`
process, the layers are compiled before transformers installs its output-capturing hooks (on the
first parity reference). Their compile time (warm-up forwards of the shapes the runs use) is
reported apart and not counted in tok/s; the table flags a graph compiled during a timed run. --profile times each phase of the extract loop (CUDA events, no added syncs) and the
writer threads. Variants that would end past --deadline-s are skipped, and the JSON is rewritten
after each variant, so a slow compile still leaves a table.

--discard measures runs longer than the disk holds (a 64 GB disk holds ~1.8M tokens of Llama-3.1-8B
states): as soon as a shard is complete (written, fsynced, renamed, journaled) a
thread replaces it with a sparse file of the same size, so its bytes have reached the disk and are
counted but stop occupying it; the stage's free-disk check then asks for room for the shards in
flight only. The states are unreadable afterwards (the bench deletes them anyway).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import hashlib
import io
import json
import math
import os
import re
import shutil
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from eyas import artifacts, extract  # noqa: E402
from eyas.capture import base_model, default_layer_ids  # noqa: E402
from eyas.config import load_config  # noqa: E402
from eyas.extract import plan  # noqa: E402
from eyas.extract.backend import HFBackend, ParityError  # noqa: E402
from eyas.extract.profile import PhaseTimer  # noqa: E402

PRESETS = {
    # Llama-3.1-8B: 32 layers, D 4096, 32 heads / 8 kv heads, MLP 14336, vocab 128256
    "llama8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                    num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, max_position_embeddings=8192),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=1000, max_position_embeddings=4096),
}
EXTRACT_RANK = extract.extract_rank
MAKE_BACKEND = extract.make_backend


@dataclass
class Variant:
    name: str
    token_budget: int
    writer_queue: int
    pack: bool = False
    compile: bool = False
    shm: bool = False


def parse_variant(name: str, budget: int, queue: int) -> Variant:
    v = Variant(name, budget, queue)
    for part in name.split("+"):
        if m := re.fullmatch(r"budget(\d+)(k?)", part):
            v.token_budget = int(m[1]) * (1024 if m[2] else 1)
        elif m := re.fullmatch(r"q(\d+)", part):
            v.writer_queue = int(m[1])
        elif part in ("pack", "compile", "shm"):
            setattr(v, part, True)
        elif part != "default":
            raise SystemExit(f"--variants: unknown part {part!r} in {name!r} "
                             "(default, pack, compile, shm, budget<N>[k], q<N>, joined by +)")
    return v


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="llama8b", choices=sorted(PRESETS))
    p.add_argument("--variants", default="default,budget32k,default+shm,pack,compile+budget32k,compile",
                   help="comma-separated variants (see above); compile variants run last")
    p.add_argument("--tokens", type=int, default=0, help="tokens per variant (default 400k on GPU, 4k on CPU)")
    p.add_argument("--naive-tokens", type=int, default=0, help="tokens of the naive loop (default 60k GPU, 2k CPU)")
    p.add_argument("--token-budget", type=int, default=16384, help="the budget of variants without budgetN")
    p.add_argument("--writer-queue", type=int, default=3, help="the writer queue of variants without qN")
    p.add_argument("--out-dir", default="", help="where the states are written (default: a temp dir); emptied after each part")
    p.add_argument("--compile-backend", default="inductor", help="torch.compile backend of the compile variants")
    p.add_argument("--profile", action="store_true", help="per-phase breakdown of each variant")
    p.add_argument("--no-forward", action="store_true", help="skip the forward-only ceilings")
    p.add_argument("--no-naive", action="store_true", help="skip the naive loop")
    p.add_argument("--deadline-s", type=float, default=400, help="skip variants that would end later than this")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--discard", action="store_true",
                   help="free each shard's disk blocks once it is complete: runs longer than the disk (see above)")
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
    log(f"built {preset} ({sum(p.numel() for p in model.parameters()) / 1e9:.2f} B params, {dtype}) "
        f"in {time.perf_counter() - t0:.1f} s")
    return conf, model


def log(msg: str) -> None:
    print(f"[bench] {msg}", flush=True)


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


def sha256_speed(size: int, threads: int) -> float:
    """Bytes/s of sha256 over `threads` independent streams at once (hashlib releases the GIL)."""
    buf = memoryview(torch.randint(0, 255, (size,), dtype=torch.uint8).numpy())
    work = [threading.Thread(target=lambda: hashlib.sha256(buf)) for _ in range(threads)]
    t0 = time.perf_counter()
    for t in work:
        t.start()
    for t in work:
        t.join()
    return threads * size / (time.perf_counter() - t0)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class ShardDiscarder(threading.Thread):
    """--discard: each shard the journals list is replaced by a sparse file of its listed size (the
    stage's completion check compares sizes only), so a run can write more than the disk holds."""

    def __init__(self, out: Path):
        super().__init__(daemon=True, name="eyas-bench-discard")
        self.out, self.done, self.stop, self.error = out, set(), threading.Event(), None

    def sweep(self) -> None:
        for journal in sorted((self.out / extract.store.PROGRESS_DIR).glob("r*.jsonl")):
            for line in journal.read_text(encoding="utf-8").split("\n"):
                try:
                    entry = json.loads(line)
                except json.JSONDecodeError:
                    continue  # empty, or being appended right now: the next sweep sees it whole
                if entry["shard"] not in self.done:  # a sparse twin replaces it: its size never changes
                    path = self.out / entry["shard"]
                    twin = path.with_name(path.name + ".discard")
                    with open(twin, "wb") as f:
                        f.truncate(entry["bytes"])
                    os.replace(twin, path)
                    self.done.add(entry["shard"])

    def run(self) -> None:
        try:
            while not self.stop.wait(0.1):
                self.sweep()
            self.sweep()
        except BaseException as e:  # re-raised by the main thread in finish()
            self.error = e

    def finish(self) -> int:
        self.stop.set()
        self.join()
        if self.error is not None:
            raise RuntimeError(f"--discard: freeing a finished shard failed: {self.error!r}") from self.error
        return len(self.done)


def check_disk_in_flight(s, rank: int, world_size: int, n: int) -> None:
    """--discard's free-disk check: room for the shards being written at once (two writers, ~1 GB each
    by default, with a wide margin), not for the whole run."""
    need = 8 << 30
    free = shutil.disk_usage(s.out).free
    print(f"[bench] --discard: {len(s.remaining):,} samples; each shard is freed once complete; {free / 1e9:.1f} GB free "
          f"(needs {need / 1e9:.1f} GB for the shards in flight)", file=sys.stderr, flush=True)
    if need > free:
        raise RuntimeError(f"--discard: {free / 1e9:.2f} GB free at {s.out}, the shards in flight need {need / 1e9:.2f} GB")


CHECK_DISK = extract._check_disk


def run_eyas(root: Path, conf_dir: Path, backend, out: Path, v: Variant, timer, extra: tuple[str, ...] = (),
             discard: bool = False) -> dict:
    overrides = [f"--run_dir={root}", f"--prepare.out_dir={root / 'prepare'}", f"--target.model={conf_dir}",
                 f"--extract.out_dir={out}", f"--extract.token_budget={v.token_budget}",
                 f"--extract.writer_queue={v.writer_queue}", f"--extract.pack={str(v.pack).lower()}",
                 "--extract.progress=false", *extra]
    cfg = load_config(None, overrides)
    # the model is already in memory: hand the stage this backend instead of loading weights from disk
    extract.make_backend = lambda cfg, setup, device: backend
    extract.extract_rank = functools.partial(EXTRACT_RANK, timer=timer) if timer is not None else EXTRACT_RANK
    discarder = ShardDiscarder(out) if discard else None
    if discarder is not None:
        extract._check_disk = check_disk_in_flight
        discarder.start()
    stage_log = io.StringIO()  # the stage's own summary: the table says the same; shown if it fails
    try:
        t0 = time.perf_counter()
        with contextlib.redirect_stdout(stage_log):
            meta = extract.run(cfg)
        wall = time.perf_counter() - t0
        freed = discarder.finish() if discarder is not None else 0
    except BaseException:
        print(stage_log.getvalue(), end="", flush=True)
        if discarder is not None:
            discarder.stop.set()
            discarder.join()
            if discarder.error is not None:  # e.g. the disk filled because shards were no longer freed
                log(f"--discard had failed before: {discarder.error!r}")
        raise
    finally:
        extract.make_backend, extract.extract_rank, extract._check_disk = MAKE_BACKEND, EXTRACT_RANK, CHECK_DISK
    if discarder is not None and freed != meta["counts"]["shards"]:
        raise RuntimeError(f"--discard freed {freed} shards of the {meta['counts']['shards']} written")
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


def plan_inputs(lengths: torch.Tensor, ids: torch.Tensor, v: Variant, device: torch.device) -> tuple[list, list]:
    """The batches eyas makes for this variant -> (batches, [(input_ids, position_ids or None) on device])."""
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.long)
    offsets[1:] = lengths.cumsum(0)
    batches = plan.make_batches(list(range(len(lengths))), lengths, v.token_budget, 512, v.pack)
    inputs = []
    for b in batches:
        pos = b.position_ids()
        inputs.append((b.input_ids([ids[offsets[i] : offsets[i + 1]] for i in b.indices]).to(device),
                       pos.to(device) if pos is not None else None))
    return batches, inputs


@torch.no_grad()
def run_forward(model, lengths: torch.Tensor, ids: torch.Tensor, v: Variant, device: torch.device) -> dict:
    """The eyas batches through the base model, nothing captured, copied or written."""
    batches, inputs = plan_inputs(lengths, ids, v, device)
    base = base_model(model)

    def fwd(x, pos):
        base(input_ids=x, use_cache=False, **({"position_ids": pos} if pos is not None else {}))

    fwd(*inputs[0])  # warm-up: the largest and the smallest shapes
    fwd(*inputs[-1])
    sync(device)
    t0 = time.perf_counter()
    for x, pos in inputs:
        fwd(x, pos)
    sync(device)
    dt = time.perf_counter() - t0
    return {"tokens": int(lengths.sum()), "seconds": dt, "tok_s": int(lengths.sum()) / dt,
            "padding_waste": plan.padding_waste(batches)}


def compile_backend(model, layer_ids: list[int], dtype: torch.dtype, lengths: torch.Tensor, ids: torch.Tensor,
                    variants: list[Variant], device: torch.device, backend_name: str) -> tuple[HFBackend, float]:
    """HFBackend(compile=True), warmed up on the shapes the compile variants will see: the smoke
    test's sample (the shortest, alone), then per variant two batches of distinct lengths of each
    kind (one row or several): torch specializes a first shape and makes the sizes symbolic on the
    second, after which every batch of that kind takes the same graph."""
    t0 = time.perf_counter()
    backend = HFBackend(model, layer_ids, dtype, compile=True, compile_backend=backend_name)
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.long)
    offsets[1:] = lengths.cumsum(0)

    def tokens(b: plan.Batch) -> list[torch.Tensor]:
        return [ids[offsets[i] : offsets[i + 1]] for i in b.indices]

    try:
        i = plan.sort_longest_first(list(range(len(lengths))), lengths)[-1]  # what smoke_test() runs
        n = int(lengths[i])
        backend.forward(plan.Batch([i], [n], 1, n, False), [ids[offsets[i] : offsets[i + 1]]])
        for v in variants:
            seen: dict[bool, set[int]] = {True: {n}, False: set()}
            for b in plan.make_batches(list(range(len(lengths))), lengths, v.token_budget, 512, v.pack):
                kind = seen[b.rows == 1]
                if len(kind) < 2 and b.seq_len not in kind:
                    kind.add(b.seq_len)
                    backend.forward(b, tokens(b))
        sync(device)
    except BaseException:
        backend.close()  # the model gets its eager layers back
        raise
    return backend, time.perf_counter() - t0


def print_profile(name: str, prof: dict[str, dict[str, float]], seconds: float) -> None:
    span = prof.get("gpu batches (all phases of the main stream)", {}).get("s", 0.0)
    main = sum(prof.get(f"gpu {k}", {}).get("s", 0.0) for k in
               ("forward", "capture (stack, gather, cast)", "isfinite", "parity check"))
    log(f"profile of {name}: {seconds:.2f} s in the stage (gpu: CUDA events; host: main thread waits; "
        "writers: summed over the writer threads)")
    for k, d in sorted(prof.items(), key=lambda kv: -kv[1]["s"]):
        print(f"  {k:<46}{d['s']:>7.2f} s {int(d['n']):>5}x {1e3 * d['s'] / max(d['n'], 1):>8.1f} ms"
              f" (max {1e3 * d['max']:.0f})")
    if span:
        print(f"  {'gpu idle/H2D between phases (span - phases)':<46}{span - main:>7.2f} s")


def steady_tok_s(r: dict) -> float | None:
    """Tokens / (stage seconds - smoke test - parity check): the rate of a long run, where those fixed
    costs (one batch-1 plain forward per sample of the first batch) vanish."""
    prof, e = r.get("profile"), r.get("eyas")
    if not prof or not e:
        return None
    fixed = sum(prof.get(k, {}).get("s", 0.0) for k in ("gpu smoke test", "gpu parity check", "smoke test", "parity check"))
    return e["tokens"] / max(e["seconds"] - fixed, 1e-9)


def print_table(result: dict) -> None:
    log(f"extract throughput, {result['preset']} on {result['device']}, {result['tokens']:,} tokens per variant "
        f"(mean length {result['mean_length']}), writes to {result['out_dir']} (disk {result['disk_write_gb_s']} GB/s, "
        f"sha256 {result['sha256_gb_s_1thread']} GB/s x1, {result['sha256_gb_s_2threads']} GB/s x2)")
    print(f"  {'variant':<26} {'eyas tok/s':>11} {'steady':>8} {'forward tok/s':>14} {'eyas/fwd':>9} {'padding':>8} "
          f"{'GB':>6} {'parity err':>11}  notes")
    for name, r in result["variants"].items():
        e, f, steady = r.get("eyas"), r.get("forward_only"), steady_tok_s(r)
        notes = "; ".join(x for x in (
            f"compile {r['compile_s']:.0f} s ({r.get('dynamo_graphs', '?')} graphs)" if "compile_s" in r else "",
            f"peak GPU {r['peak_gpu_gb']:.0f} GB" if "peak_gpu_gb" in r else "",
            f"{r['graphs_compiled_in_run']} graph(s) compiled during the eyas run" if r.get("graphs_compiled_in_run") else "",
            "PARITY FAILED (timed with the check off)" if "parity_error" in r else "",
            r.get("error", "")) if x)
        cols = (f"{e['tok_s']:>11,.0f}" if e else f"{'-':>11}",
                f"{steady:>8,.0f}" if steady else f"{'-':>8}",
                f"{f['tok_s']:>14,.0f}" if f else f"{'-':>14}",
                f"{e['tok_s'] / f['tok_s']:>9.2f}" if e and f else f"{'-':>9}",
                f"{e['padding_waste']:>8.1%}" if e else f"{'-':>8}",
                f"{e['gb_written']:>6.1f}" if e else f"{'-':>6}",
                f"{e['parity_max_error']:>11.2e}" if e else f"{'-':>11}")
        print(f"  {name:<26} {' '.join(cols)}  {notes}")
    if "naive" in result:
        nv = result["naive"]
        print(f"  {'naive (batch 1, torch.save)':<26} {nv['tok_s']:>11,.0f}   ({nv['tokens']:,} tokens in {nv['seconds']:.1f} s)")
    print("  steady = tokens / (stage seconds - smoke test - first-batch parity check), with --profile: a long run's rate")


def setup_compiled(ctx: dict, variants: list[Variant], r: dict) -> None:
    """A fresh model with compiled layers, warmed up. Fresh, as in a new `eyas extract` process:
    transformers installs its output-capturing hooks on the first forward with output_hidden_states
    (the parity reference, the naive loop), and a compile after that traces them (a graph break per
    layer); compiled first, the graphs ignore hooks added later, as in the stage."""
    args, device = ctx["args"], ctx["device"]
    left = args.deadline_s - (time.perf_counter() - ctx["t_start"])
    if left < 120:
        raise TimeoutError(f"skipped: {left:.0f} s left before --deadline-s, too few to compile")
    ctx["model"] = None
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    ctx["model"] = build_model(args.preset, device)[1]
    log("compiling the decoder layers (torch.compile, dynamic shapes) ...")
    ctx["compiled"], r["compile_s"] = compile_backend(
        ctx["model"], ctx["layer_ids"], ctx["dtype"], ctx["lengths"], ctx["ids"], [x for x in variants if x.compile],
        device, args.compile_backend)
    from torch._dynamo.utils import counters

    r["dynamo_graphs"] = counters["stats"]["unique_graphs"]
    log(f"compiled and warmed up in {r['compile_s']:.1f} s ({r['dynamo_graphs']} graphs)")


def run_one(v: Variant, ctx: dict, variants: list[Variant], r: dict) -> None:
    t0 = time.perf_counter()
    if v.compile and "compile_error" in ctx:
        raise RuntimeError(f"not run: compiling failed ({ctx['compile_error']})")
    if v.compile and ctx["compiled"] is None:
        setup_compiled(ctx, variants, r)
    if time.perf_counter() - ctx["t_start"] + 1.2 * ctx["longest"] > ctx["args"].deadline_s:
        raise TimeoutError(f"skipped: would end past --deadline-s={ctx['args'].deadline_s:.0f}")
    t1 = time.perf_counter()
    r.update(run_variant(v, ctx))
    ctx["longest"] = max(ctx["longest"], time.perf_counter() - t1)
    e, f = r["eyas"], r.get("forward_only")
    log(f"{v.name}: eyas {e['tok_s']:,.0f} tok/s" + (f", forward only {f['tok_s']:,.0f} tok/s" if f else "")
        + f" ({time.perf_counter() - t0:.0f} s)")


def write_json(result: dict) -> None:
    if os.environ.get("OUT"):
        Path(os.environ["OUT"]).mkdir(parents=True, exist_ok=True)
        (Path(os.environ["OUT"]) / "bench_extract.json").write_text(json.dumps(result, indent=2) + "\n")


def run_variant(v: Variant, ctx: dict) -> dict:
    """One variant: the forward-only ceiling of its batches (first: it also warms the allocator and
    cuBLAS up for these shapes, as a long run would be), then eyas end to end (+ profile)."""
    args, device, model = ctx["args"], ctx["device"], ctx["model"]
    r: dict = {"settings": asdict(v)}
    key = (v.token_budget, v.pack, v.compile)
    if not args.no_forward:
        if key not in ctx["forward"]:
            ctx["forward"][key] = run_forward(model, ctx["lengths"], ctx["ids"], v, device)
        r["forward_only"] = ctx["forward"][key]
    backend = ctx["compiled"] if v.compile else HFBackend(model, ctx["layer_ids"], ctx["dtype"])
    out = (Path(tempfile.mkdtemp(prefix="eyas-bench-", dir="/dev/shm")) if v.shm else ctx["out"]) / "eyas"
    timer = PhaseTimer(device) if args.profile else None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    from torch._dynamo.utils import counters

    graphs = counters["stats"]["unique_graphs"]
    try:
        try:
            r["eyas"] = run_eyas(ctx["root"], ctx["conf_dir"], backend, out, v, timer, discard=args.discard)
        except ParityError as e:
            r["parity_error"] = str(e)
            log(f"PARITY CHECK FAILED in {v.name} (re-running without it to time the rest): {e}")
            shutil.rmtree(out, ignore_errors=True)
            timer = PhaseTimer(device) if args.profile else None
            r["eyas"] = run_eyas(ctx["root"], ctx["conf_dir"], backend, out, v, timer, ("--extract.parity_tol=1e9",),
                                 discard=args.discard)
        r["graphs_compiled_in_run"] = counters["stats"]["unique_graphs"] - graphs  # > 0: a compile was timed
        if device.type == "cuda":
            r["peak_gpu_gb"] = torch.cuda.max_memory_allocated(device) / 1e9
        if timer is not None:
            r["profile"] = timer.summary()
            print_profile(v.name, r["profile"], r["eyas"]["seconds"])
    finally:
        shutil.rmtree(out.parent if v.shm else out, ignore_errors=True)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return r


def main() -> None:
    args = parse()
    t_start = time.perf_counter()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gpu = device.type == "cuda"
    tokens = args.tokens or (400_000 if gpu else 4_000)
    naive_tokens = args.naive_tokens or (60_000 if gpu else 2_000)
    names = [n.strip() for n in args.variants.split(",") if n.strip()]
    variants = sorted((parse_variant(n, args.token_budget, args.writer_queue) for n in names), key=lambda v: v.compile)
    root = Path(tempfile.mkdtemp(prefix="eyas-bench-"))
    out = Path(args.out_dir) if args.out_dir else root / "out"
    out.mkdir(parents=True, exist_ok=True)
    import transformers

    result: dict = {"preset": args.preset, "device": torch.cuda.get_device_name(device) if gpu else "cpu",
                    "torch": torch.__version__, "transformers": transformers.__version__, "tokens": tokens,
                    "out_dir": str(out), "variants": {}}
    try:
        conf, model = build_model(args.preset, device)
        conf_dir = root / "target"
        conf.save_pretrained(str(conf_dir))  # preflight reads the config; the weights stay in memory
        layer_ids = default_layer_ids(conf.num_hidden_layers)
        lengths = sharegpt_like_lengths(tokens, args.seed)
        write_prepare(root / "prepare", lengths, conf.vocab_size, args.seed)
        result["samples"], result["mean_length"] = len(lengths), round(float(lengths.float().mean()), 1)
        dtype = torch.bfloat16 if gpu else torch.float32
        bpt = (len(layer_ids) + 1) * conf.hidden_size * dtype.itemsize
        log(f"{len(lengths)} samples, {int(lengths.sum()):,} tokens, mean length {result['mean_length']}; {bpt} bytes/token")
        speed = disk_write_speed(out, (2 << 30) if gpu else (64 << 20))
        result["disk_write_gb_s"] = round(speed / 1e9, 3)
        log(f"disk {out}: {speed / 1e9:.2f} GB/s sequential write (+fsync) = {speed / bpt:,.0f} tokens/s")
        for threads in (1, 2):
            sha = sha256_speed((512 << 20) if gpu else (32 << 20), threads)
            result[f"sha256_gb_s_{threads}thread{'s' if threads > 1 else ''}"] = round(sha / 1e9, 3)
            log(f"sha256 on {threads} thread(s): {sha / 1e9:.2f} GB/s = {sha / bpt:,.0f} tokens/s")

        from eyas.prepared import Prepared

        prep = Prepared(root / "prepare")
        ids = prep._ids.long()
        if not args.no_naive:
            n = int((prep.lengths.cumsum(0) < naive_tokens).sum()) + 1
            sub = prep.lengths[:n]  # the first n samples: same distribution, drawn in the same order
            result["naive"] = run_naive(model, sub, ids, layer_ids, out / "naive", device)
            shutil.rmtree(out / "naive", ignore_errors=True)
            log(f"naive: {result['naive']['tok_s']:,.0f} tok/s")
        ctx = {"args": args, "device": device, "model": model, "root": root, "conf_dir": conf_dir, "out": out,
               "layer_ids": layer_ids, "dtype": dtype, "lengths": prep.lengths, "ids": ids, "forward": {},
               "compiled": None, "t_start": t_start, "longest": 0.0}
        del model  # ctx holds it: a compile variant swaps in a fresh one
        for v in variants:
            r: dict = {}
            try:
                run_one(v, ctx, variants, r)
            except Exception as exc:  # one broken variant must not cost the others: recorded and shown in the table
                if not isinstance(exc, TimeoutError):
                    traceback.print_exc()
                r["error"] = f"{type(exc).__name__}: {exc}"[:300]
                log(f"{v.name}: {r['error']}")
                if v.compile and ctx["compiled"] is None:
                    ctx["compile_error"] = r["error"]
            result["variants"][v.name] = r
            write_json(result)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    print()
    print_table(result)
    write_json(result)
    if os.environ.get("OUT"):
        log(f"wrote {Path(os.environ['OUT']) / 'bench_extract.json'}")


if __name__ == "__main__":
    main()
