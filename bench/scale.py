"""eyas at scale: a DeepSeek-V3-shaped target over N GPUs, data-parallel extraction, FSDP2 training.

Each subcommand is one self-contained step of under 10 minutes that prints its results as one JSON
line (the last line of its output) and writes it to $OUT/scale_<step>.json when OUT is set. State
lives in --work-dir (default $EYAS_SCALE_DIR or ~/eyas-scale, outside the repository), so the steps
run as separate commands one after another on the same machine; the dsv3 step must come before
fsdp-train.

    dsv3        a DeepseekV3ForCausalLM with DeepSeek-V3's real widths (hidden 7168, 128 heads,
                q/kv LoRA ranks 1536/512, nope/rope/v head dims 128/64/128, experts of 2048, dense
                MLP 18432, vocab 129280, 8 experts per token, 1 shared; the first min(3, L-1)
                layers dense) and random bf16 weights, built on the GPUs: a meta-device skeleton,
                then each module of accelerate's balanced placement materialised and initialised
                on its GPU (no host copy of the model). --weights disk (default) saves it with
                save_pretrained (5 GB safetensors shards, DeepSeek's per-expert layout) and the
                stage loads it with `--extract.device_map=auto` as a user's run would; --weights
                gpu hands the in-memory model (same placement, accelerate's hooks) to the stage
                instead, for models larger than the disk or the 10 minutes allow. Then the extract
                stage in-process (aux layers [2, L//2, L-3] + final, parity check on with
                --extract.verify more samples) over a synthetic prepare output (no tokenizer:
                bench/extract.py's random token ids, whose meta.json names none): tokens/s (meta.json
                this_run), peak torch.cuda.max_memory_allocated/reserved and weights per GPU, parity.
                Keeps the prepare and extract outputs and a heads-only target (config, embedding,
                LM head: all the trainer reads) for fsdp-train; deletes the saved weights unless
                --keep-weights.
    llama-dp    a random Llama-3.1-8B-architecture model saved once; `eyas extract` on one GPU over
                --tokens-per-gpu tokens, then `torchrun --nproc-per-node N -m eyas extract` over N
                times that (the same work per GPU, so the fixed costs cancel): tokens/s of both,
                their ratio, per-rank rates, and the write speed of the states' directory (32 KB a
                token: 8 GPUs at ~28k tok/s each write ~7 GB/s, so the states go to /dev/shm when
                it has room; `bound_by_writes` says when the writes, not the GPUs, set the rate).
    fsdp-train  `torchrun --nproc-per-node N -m eyas train --train.parallel=fsdp` on dsv3's hidden
                states (D 7168: a draft of 1.19 B trainable parameters, fc 154 M + q/k/v 352 M + o
                59 M + MLP 396 M + LM head over 32000 tokens 229 M). Run A to --max-steps: tokens/s
                = the stage's logged rate (median of the windows after the first, which holds the
                compilation), MFU from bench/train.py's FLOP count of the same micro-batches (the
                packing is a pure function of the seed), peak memory per GPU as nvidia-smi
                memory.used sampled every 0.5 s (the stage records no memory and its ranks are other
                processes). Run B, the same command, SIGKILLed (torchrun and every rank) once its
                first checkpoint is complete; run C = B + --train.resume=auto must say it resumes
                from that checkpoint, log every later step once (metrics.jsonl), and repeat run A's
                losses (same seed, data order and restored state).

Extra --extract.*, --train.* and --target.* arguments go to the stage unchanged.

On a machine with N H200 GPUs (measured with torch 2.11 + CUDA and transformers 5.17; eyas from this
checkout), in this order; the times are estimates from docs/benchmarks.md's one-H200 rates and a
~1 GB/s disk:

    export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
    # N = 2 (2 x H200, 128 GiB disk, 256 GiB RAM)
    python3 bench/scale.py dsv3 --gpus 2                # L 15, E 64:  80 GB, 29% of 2 x 141 GB   ~5 min
    python3 bench/scale.py fsdp-train --gpus 2          # runs A, B (killed), C; 20 steps         ~7 min
    python3 bench/scale.py llama-dp --gpus 2            # 1 x 300k vs 2 x 300k tokens             ~3 min
    python3 bench/scale.py dsv3 --gpus 2 --weights gpu  # L 18, E 128: 183 GB, 65%               ~4 min
    # N = 8 (8 x H200, 235 GiB disk, 560 GiB RAM)
    python3 bench/scale.py dsv3 --gpus 8                # L 14, E 128: 136 GB, 12%                ~7 min
    python3 bench/scale.py fsdp-train --gpus 8                                                    # ~7 min
    python3 bench/scale.py llama-dp --gpus 8            # 1 x 300k vs 8 x 300k tokens             ~4 min
    python3 bench/scale.py dsv3 --gpus 8 --weights gpu  # L 34, E 256: 721 GB (360 B params), 64% ~5 min

A MoE layer of the real widths holds 0.46 GB + 88 MB per expert in bf16, a dense layer 1.17 GB,
embedding + LM head 3.7 GB. With --weights gpu the default shapes fill ~65% of N x 141 GB (the rest
is for activations and the parity reference); with --weights disk what the disk holds next to the
states, saved and loaded again within the 10 minutes. dsv3 reuses a saved target of the same shape
(re-run the command after a timeout). A CPU check of every step (tiny widths, gloo):

    python bench/scale.py dsv3 --preset tiny
    python bench/scale.py fsdp-train --preset tiny --gpus 2       # 2 CPU processes under torchrun
    python bench/scale.py llama-dp --preset tiny --gpus 2
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.extract import PRESETS as LLAMA_PRESETS  # noqa: E402
from bench.extract import disk_write_speed, sharegpt_like_lengths, write_prepare  # noqa: E402
from bench.train import MEASURED_PEAK, PEAK, count_flops  # noqa: E402
from eyas import extract  # noqa: E402
from eyas.config import load_config  # noqa: E402
from eyas.extract.backend import HFBackend, ParityError  # noqa: E402
from eyas.config.target import TargetConfig  # noqa: E402
from eyas.target import resolve_dtype  # noqa: E402
from eyas.train.target_weights import load_embed_and_head  # noqa: E402

H200_BYTES = 141e9  # the datasheet's 141 GB per GPU

DSV3_PRESETS = {
    # DeepSeek-V3's own widths; layers and experts are chosen per run (--layers, --experts)
    "real": dict(hidden_size=7168, num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1536,
                 kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, head_dim=64,
                 moe_intermediate_size=2048, intermediate_size=18432, n_shared_experts=1, num_experts_per_tok=8,
                 vocab_size=129280, max_position_embeddings=4096),
    # the same structure (MLA, dense then MoE layers, grouped routing, a shared expert) for a CPU check
    "tiny": dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16,
                 qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, head_dim=8, moe_intermediate_size=32,
                 intermediate_size=256, n_shared_experts=1, num_experts_per_tok=2, vocab_size=2048,
                 max_position_embeddings=4096),
}
# (weights, gpus) -> (layers, experts) of the real preset. gpu: ~65% of N x 141 GB. disk: what a
# disk of 64 GiB / 128 GiB / 235 GiB with 1 / 2 / 4-8 GPUs holds besides the states and checkpoints,
# written and read back at ~1 GB/s within the 10 minutes.
REAL_SHAPES = {
    ("disk", 1): (8, 64), ("gpu", 1): (16, 64),  # 38 GB; 87 GB = 61%
    ("disk", 2): (15, 64), ("gpu", 2): (18, 128),  # 80 GB; 183 GB = 65%
    ("disk", 4): (14, 128), ("gpu", 4): (18, 256),  # 136 GB; 353 GB = 62%
    ("disk", 8): (14, 128), ("gpu", 8): (34, 256),  # 136 GB; 721 GB = 64%
}
TINY_SHAPE = (6, 8)


def log(msg: str) -> None:
    print(f"[scale] {msg}", flush=True)


def emit(step: str, result: dict[str, Any]) -> None:
    """The step's results: one JSON line on stdout, and $OUT/scale_<step>.json."""
    if os.environ.get("OUT"):
        path = Path(os.environ["OUT"]) / f"scale_{step.replace('-', '_')}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2) + "\n")
        log(f"wrote {path}")
    print(json.dumps(result), flush=True)


def gb(n: float) -> float:
    return round(n / 1e9, 3)


def count(n: float) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.2f} M"


def sig(x: float) -> float:
    return float(f"{x:.4g}")


def fresh(path: Path) -> Path:
    shutil.rmtree(path, ignore_errors=True)
    return path


def check_gpus(gpus: int, exact: bool) -> bool:
    """-> whether CUDA runs this step. `exact`: the step uses every visible GPU (device_map)."""
    if not torch.cuda.is_available():
        return False
    seen = torch.cuda.device_count()
    if seen < gpus or (exact and seen != gpus):
        raise SystemExit(f"--gpus {gpus} but {seen} GPU(s) are visible: set CUDA_VISIBLE_DEVICES to {gpus} of them "
                         "or change --gpus")
    return True


# ---------------------------------------------------------------------------------------------
# subprocesses


def stage_env() -> dict[str, str]:
    """The environment of `python -m eyas ...`: eyas importable from this checkout."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1"}


def eyas_cmd(stage: str, nproc: int, args: list[str]) -> list[str]:
    """`python -m eyas STAGE ...`, under torchrun when nproc > 0 (--standalone: a free port each time)."""
    if nproc == 0:
        return [sys.executable, "-m", "eyas", stage, *args]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            "-m", "eyas", stage, *args]


class Job:
    """A subprocess whose output is echoed (prefixed with its name) and kept for checks."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str] | None = None):
        self.name, self.cmd, self.lines = name, cmd, []
        log(f"{name}: {shlex.join(cmd)}" + "".join(f" ({k}={v})" for k, v in (env or {}).items()))
        self.proc = subprocess.Popen(cmd, env={**stage_env(), **(env or {})}, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, bufsize=1)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            print(f"  [{self.name}] {line}", end="", flush=True)

    def wait(self) -> None:
        rc = self.proc.wait()
        self._reader.join()
        if rc != 0:
            raise RuntimeError(f"{self.name} exited with status {rc} (its output is above): {shlex.join(self.cmd)}")

    def kill_tree(self) -> list[int]:
        """SIGKILL torchrun and every process under it, as a crashed node would. torchrun makes
        each rank the leader of a process group of its own (setsid), so torchrun's group is not
        enough: a rank is killed with its group (by the rank's id), which takes data-loader or
        compile workers forked since the listing with it."""
        pids = process_tree(self.proc.pid)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):  # it ended between the listing and now
                if pid != self.proc.pid and os.getpgid(pid) == pid:
                    os.killpg(pid, signal.SIGKILL)
                else:
                    os.kill(pid, signal.SIGKILL)
        self.proc.wait()
        self._reader.join(timeout=60)
        if self._reader.is_alive():
            raise RuntimeError(f"{self.name}: its output stays open after SIGKILL: a process of it survived")
        wait_gone(pids)
        return pids


def process_tree(root: int) -> list[int]:
    """`root` and its descendants, from /proc (Linux)."""
    children: dict[int, list[int]] = defaultdict(list)
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:  # the process ended while /proc was listed
            continue
        ppid = int(text.rsplit(")", 1)[1].split()[1])  # after "pid (comm)": state, ppid
        children[ppid].append(int(stat.parent.name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children[pid])
    return out


def wait_gone(pids: list[int], timeout_s: float = 30.0) -> None:
    """Until every pid has exited (gone or a zombie): a killed rank frees its GPU memory on exit."""
    deadline = time.monotonic() + timeout_s
    while True:
        alive = []
        for pid in pids:
            with contextlib.suppress(OSError):  # gone
                if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                    alive.append(pid)
        if not alive:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"processes {alive} are still alive {timeout_s:.0f} s after SIGKILL")
        time.sleep(0.1)


class GpuMemory:
    """Peak `nvidia-smi` memory.used per GPU while a block runs (everything on the card: CUDA
    contexts, the caching allocators' reserves). Nothing is sampled without nvidia-smi (CPU)."""

    def __init__(self, interval_s: float = 0.5):
        self.interval_s, self.peak_mib = interval_s, {}
        self._stop, self._thread, self._error = threading.Event(), None, None

    def __enter__(self) -> "GpuMemory":
        if shutil.which("nvidia-smi"):
            self._thread = threading.Thread(target=self._poll, daemon=True)
            self._thread.start()
        return self

    def _poll(self) -> None:
        query = ["nvidia-smi", "--query-gpu=index,memory.used", "--format=csv,noheader,nounits"]
        try:
            while not self._stop.is_set():
                for line in subprocess.run(query, capture_output=True, text=True, check=True).stdout.splitlines():
                    i, mib = (int(x) for x in line.split(","))
                    self.peak_mib[i] = max(self.peak_mib.get(i, 0), mib)
                self._stop.wait(self.interval_s)
        except BaseException as e:  # re-raised by __exit__ in the main thread
            self._error = e

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self._error is not None:
            raise RuntimeError("sampling nvidia-smi failed") from self._error

    def peak_gib(self) -> dict[str, float] | None:
        return {f"gpu{i}": round(m / 1024, 2) for i, m in sorted(self.peak_mib.items())} if self.peak_mib else None


# ---------------------------------------------------------------------------------------------
# shared pieces


def write_synthetic_prepare(run: Path, vocab: int, tokens: int, seed: int) -> torch.Tensor:
    """bench/extract.py's synthetic prepare output (lognormal lengths, random ids, loss on every
    token), with a draft vocabulary the trainer can use: the first W target ids (bench/extract.py
    writes an empty t2d, which leaves no valid teacher target)."""
    from safetensors.torch import save_file

    lengths = sharegpt_like_lengths(tokens, seed)
    write_prepare(fresh(run / "prepare"), lengths, vocab, seed)
    w = min(32000, vocab)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[:w] = True
    zeros = torch.zeros(vocab, dtype=torch.int64)
    save_file({"d2t": zeros[:w].clone(), "t2d": t2d, "token_counts": zeros}, str(run / "prepare" / "vocab.safetensors"))
    return lengths


def read_extract_meta(out: Path) -> dict[str, Any]:
    meta = json.loads((out / "meta.json").read_text())
    r = meta["counts"]["this_run"]
    ranks = sorted(out.glob("progress/r*.summary.json"))
    per_rank = [json.loads(p.read_text()) for p in ranks]
    return {"tokens": r["tokens"], "seconds": r["seconds"], "tokens_per_s": r["tokens_per_s"],
            "padding_waste": r["padding_waste"], "world_size": r["world_size"],
            "parity_checked": r["parity_checked"], "parity_max_error": r["parity_max_error"],
            "states_gb": gb(meta["counts"]["bytes"]), "layer_ids": meta["layer_ids"],
            "per_rank_tokens_per_s": [round(s["tokens"] / s["seconds"], 1) if s["seconds"] else 0.0 for s in per_rank],
            "per_rank_seconds": [s["seconds"] for s in per_rank]}


def stage_args(extra: list[str]) -> list[str]:
    bad = [a for a in extra if not a.startswith(("--extract.", "--train.", "--target."))]
    if bad:
        raise SystemExit(f"unknown arguments {bad}: only --extract.*, --train.* and --target.* go to the stage")
    return extra


# ---------------------------------------------------------------------------------------------
# dsv3: the DeepSeek-V3-shaped target, extracted with device_map=auto


def routing_groups(experts: int, per_token: int) -> tuple[int, int]:
    """(n_group, topk_group) valid for `experts`: DeepSeek-V3's 8 groups / 4 chosen where the experts
    divide into groups of >= 2 (its router sums each group's top-2 scores) and the chosen groups
    hold >= per_token experts."""
    for groups in (8, 4, 2, 1):
        size = experts // groups
        if experts % groups or size < 2:
            continue
        chosen = max(1, groups // 2)
        while chosen < groups and chosen * size < per_token:
            chosen += 1
        if chosen * size >= per_token:
            return groups, chosen
    raise SystemExit(f"--experts {experts}: need at least {max(2, per_token)} experts ({per_token} per token)")


def dsv3_config(preset: str, layers: int, experts: int):
    from transformers import DeepseekV3Config

    p = DSV3_PRESETS[preset]
    if layers < 2:
        raise SystemExit(f"--layers {layers}: need >= 2 (dense layers first, then MoE)")
    groups, chosen = routing_groups(experts, p["num_experts_per_tok"])
    return DeepseekV3Config(**p, num_hidden_layers=layers, n_routed_experts=experts, n_group=groups,
                            topk_group=chosen, first_k_dense_replace=min(3, layers - 1), tie_word_embeddings=False)


def meta_model(conf, dtype: torch.dtype = torch.bfloat16):
    """The architecture on the meta device (the router's gate stays fp32, as transformers keeps it
    when loading: `_keep_in_fp32_modules_strict`)."""
    from transformers import DeepseekV3ForCausalLM

    with torch.device("meta"):
        return DeepseekV3ForCausalLM._from_config(conf, dtype=dtype)


def placement(model) -> dict[str, Any]:
    """accelerate's balanced placement over the visible GPUs (all on CPU without one): what
    from_pretrained(device_map="auto") computes, so the in-memory model sits where the stage puts it."""
    from accelerate import infer_auto_device_map
    from accelerate.utils import get_balanced_memory

    split = model._no_split_modules
    budget = get_balanced_memory(model, no_split_module_classes=split)
    device_map = infer_auto_device_map(model, max_memory=budget, no_split_module_classes=split)
    off = sorted({str(d) for d in device_map.values() if not isinstance(d, int)})
    if torch.cuda.is_available() and off:
        raise SystemExit(f"the model does not fit on the GPUs (accelerate would put part of it on {off}): "
                         "lower --layers or --experts")
    return device_map


@torch.no_grad()
def materialise(model, device_map: dict[str, Any]) -> None:
    """Each placed module: storage on its device (to_empty), then the model's own initialisation
    (normal(0, 0.02) matrices, unit norms, zero router bias, RoPE inverse frequencies recomputed).
    One module at a time on its GPU: no host copy of the weights."""
    for name, device in device_map.items():
        module = model.get_submodule(name) if name else model
        module.to_empty(device=torch.device("cuda", device) if isinstance(device, int) else device)
        module.apply(model._init_weights)
    model.eval().requires_grad_(False)
    # transformers' init functions skip tensors flagged as loaded: make sure none kept to_empty's garbage
    std = model.config.initializer_range
    for name, p in model.named_parameters():
        got = float(p.flatten()[: 1 << 16].float().std()) if p.dim() >= 2 else std
        if not 0.5 * std < got < 2 * std:
            raise RuntimeError(f"{name} has std {got:.3g} after initialisation, expected {std}: not initialised")


def weights_per_device(model) -> dict[str, float]:
    out: dict[str, float] = defaultdict(float)
    for p in model.parameters():
        out[str(p.device)] += p.numel() * p.element_size()
    return {k: gb(v) for k, v in sorted(out.items())}


def write_heads(conf, embed: torch.Tensor, head: torch.Tensor, out: Path) -> None:
    """A target directory holding only the config, the input embedding and the LM head: all that
    `eyas train` reads of a target (eyas/train/target_weights.py), and all the extract stage's
    preflight reads when the model is handed to it in memory."""
    from safetensors.torch import save_file

    fresh(out).mkdir(parents=True)
    conf.save_pretrained(str(out))
    save_file({"model.embed_tokens.weight": embed.detach().cpu().contiguous(),
               "lm_head.weight": head.detach().cpu().contiguous()}, str(out / "model.safetensors"))


def build_on_disk(conf, target: Path, shape: dict[str, Any], heads: Path) -> dict[str, float]:
    """The random model saved to `target` (reused when a complete one of this shape is there), and
    its heads-only copy."""
    marker = target / "scale-build.json"
    if marker.is_file() and json.loads(marker.read_text()) == shape:
        log(f"reusing {target} (built by an earlier run)")
        # from the saved weights: a --weights gpu run in between writes its own model's heads
        write_heads(conf, *load_embed_and_head(TargetConfig(model=str(target))), heads)
        return {}
    need = shape["bytes"] * 1.02
    free = shutil.disk_usage(target.parent).free
    if need > free:
        raise SystemExit(f"{target.parent} has {free / 1e9:.0f} GB free, the model needs {need / 1e9:.0f} GB: lower "
                         "--layers/--experts, use --weights gpu, or point --work-dir at a larger disk")
    t0 = time.perf_counter()
    model = meta_model(conf)
    materialise(model, placement(model))
    t_build = time.perf_counter() - t0
    fresh(target)
    model.save_pretrained(str(target), max_shard_size="5GB")  # a shard at a time through host memory
    t_save = time.perf_counter() - t0 - t_build
    write_heads(conf, model.get_input_embeddings().weight, model.get_output_embeddings().weight, heads)
    del model
    gc.collect()
    torch.cuda.empty_cache()
    marker.write_text(json.dumps(shape))
    log(f"built in {t_build:.1f} s, saved {shape['bytes'] / 1e9:.1f} GB in {t_save:.1f} s "
        f"({shape['bytes'] / 1e9 / t_save:.2f} GB/s)")
    return {"build_s": round(t_build, 1), "save_s": round(t_save, 1)}


def build_in_memory(conf, heads: Path):
    """The random model placed over the GPUs with accelerate's hooks, as from_pretrained would."""
    from accelerate import dispatch_model

    t0 = time.perf_counter()
    model = meta_model(conf, resolve_dtype("auto"))  # the stage's compute dtype: bf16 on GPU, fp32 on CPU
    device_map = placement(model)
    materialise(model, device_map)
    dispatch_model(model, device_map=device_map, skip_keys=getattr(model, "_skip_keys_device_placement", None))
    write_heads(conf, model.get_input_embeddings().weight, model.get_output_embeddings().weight, heads)
    log(f"built on the devices in {time.perf_counter() - t0:.1f} s")
    return model, {"build_s": round(time.perf_counter() - t0, 1)}


@contextlib.contextmanager
def stage_backend(factory):
    """extract.make_backend replaced by `factory` for the block, its backend made once and reused
    (a re-run after a parity failure loads nothing again); yields {"backend", "load_s"}."""
    made: dict[str, Any] = {}
    original = extract.make_backend

    def make(cfg, setup, device):
        if "backend" not in made:
            t0 = time.perf_counter()
            made["backend"] = factory(cfg, setup, device)
            made["load_s"] = round(time.perf_counter() - t0, 1)
        return made["backend"]

    extract.make_backend = make
    try:
        yield made
    finally:
        extract.make_backend = original


def run_extract_in_process(overrides: list[str], out: Path) -> tuple[dict[str, Any], str | None]:
    """The stage's python entry (extract.run). A parity failure is recorded and the stage re-run
    with the check reporting only, so the speed is still measured; -> (meta summary, error or None)."""
    parity_error = None
    try:
        extract.run(load_config(None, overrides))
    except ParityError as e:
        parity_error = str(e)
        log(f"PARITY CHECK FAILED: {e}\n[scale] re-running without the tolerance to time the extraction")
        fresh(out)
        extract.run(load_config(None, [*overrides, "--extract.parity_tol=1e9"]))
    return read_extract_meta(out), parity_error


def cuda_memory() -> dict[str, dict[str, float]]:
    return {f"cuda:{i}": {"peak_allocated_gb": gb(torch.cuda.max_memory_allocated(i)),
                          "peak_reserved_gb": gb(torch.cuda.max_memory_reserved(i))}
            for i in range(torch.cuda.device_count())}


def layers_per_device(model) -> dict[str, int]:
    counts: dict[str, int] = defaultdict(int)
    for layer in model.model.layers:
        counts[str(next(layer.parameters()).device)] += 1
    return dict(sorted(counts.items()))


def model_size(conf) -> tuple[int, int]:
    """-> (parameters, bytes) of the model `conf` describes, from its meta-device skeleton."""
    params = list(meta_model(conf).parameters())
    return sum(p.numel() for p in params), sum(p.numel() * p.element_size() for p in params)


def cmd_dsv3(a: argparse.Namespace) -> None:
    on_gpu = check_gpus(a.gpus, exact=True)
    if a.preset == "real" and not on_gpu:
        raise SystemExit("--preset real needs GPUs; on a CPU machine use --preset tiny")
    default = REAL_SHAPES.get((a.weights, a.gpus)) if a.preset == "real" else TINY_SHAPE
    if default is None and not (a.layers and a.experts):
        raise SystemExit(f"no default shape for --gpus {a.gpus}: pass --layers and --experts")
    layers, experts = a.layers or default[0], a.experts or default[1]
    tokens = a.tokens or (3_000 if a.preset == "tiny" else 300_000 if a.weights == "disk" else 150_000)
    conf = dsv3_config(a.preset, layers, experts)
    params, nbytes = model_size(conf)
    hbm = a.gpus * H200_BYTES
    log(f"DeepSeek-V3 widths, {layers} layers ({conf.first_k_dense_replace} dense), {experts} experts "
        f"(groups {conf.n_group}/{conf.topk_group}): {count(params)} parameters, {nbytes / 1e9:.1f} GB in bf16 = "
        f"{nbytes / hbm:.0%} of {a.gpus} x 141 GB" + ("" if on_gpu else " (CPU run: the fraction is only nominal)"))
    root = Path(a.work_dir).expanduser() / "dsv3"
    run, heads, target = root / "run", root / "heads", root / "target"
    root.mkdir(parents=True, exist_ok=True)
    lengths = write_synthetic_prepare(run, conf.vocab_size, tokens, a.seed)
    log(f"{len(lengths)} samples, {int(lengths.sum()):,} tokens")
    result: dict[str, Any] = {
        "step": "dsv3", "preset": a.preset, "gpus": a.gpus, "weights": a.weights, "layers": layers,
        "experts": experts, "routing_groups": [conf.n_group, conf.topk_group], "parameters": params,
        "weights_gb": gb(nbytes), "fraction_of_n_x_141gb": round(nbytes / hbm, 3), "tokens": int(lengths.sum()),
        "device": torch.cuda.get_device_name(0) if on_gpu else "cpu", "torch": torch.__version__,
    }
    overrides = [f"--run_dir={run}", "--extract.device_map=auto", f"--extract.verify={a.verify}",
                 "--extract.progress=false", *a.stage_args]
    if a.weights == "disk":
        shape = {"preset": a.preset, "layers": layers, "experts": experts, "bytes": nbytes}
        result.update(build_on_disk(conf, target, shape, heads))
        overrides.append(f"--target.model={target}")
        factory = extract.make_backend  # the stage's own: from_pretrained(device_map="auto")
    else:
        model, timing = build_in_memory(conf, heads)
        result.update(timing)
        overrides.append(f"--target.model={heads}")  # preflight reads the config there; the weights are in memory
        factory = lambda cfg, setup, device: HFBackend(model, setup.layer_ids, setup.capture_dtype,  # noqa: E731
                                                       compile=cfg.extract.compile)
    if on_gpu:
        for i in range(torch.cuda.device_count()):
            torch.cuda.reset_peak_memory_stats(i)
    with stage_backend(factory) as made:
        result["extract"], parity_error = run_extract_in_process(overrides, fresh(run / "extract"))
    m = made["backend"].model
    result.update(load_s=made["load_s"], weights_per_device_gb=weights_per_device(m),
                  layers_per_device=layers_per_device(m), memory_per_device=cuda_memory() if on_gpu else None,
                  parity={"ok": parity_error is None, "error": parity_error,
                          "checked": result["extract"]["parity_checked"],
                          "max_relative_error": result["extract"]["parity_max_error"]})
    del made["backend"], m
    if a.weights == "disk" and not a.keep_weights:
        shutil.rmtree(target)  # the trainer reads only `heads`; the disk is needed for states and checkpoints
    log(f"extract: {result['extract']['tokens_per_s']:,.0f} tok/s over {result['extract']['seconds']:.1f} s, "
        f"load {result['load_s']} s, parity max rel. error {result['extract']['parity_max_error']:.2e}")
    emit("dsv3", result)
    if parity_error is not None:
        raise SystemExit(f"the parity check failed (the speed above was measured without it): {parity_error}")


# ---------------------------------------------------------------------------------------------
# llama-dp: data-parallel extraction, 1 GPU vs N


def build_llama(preset: str, target: Path, on_gpu: bool) -> dict[str, float]:
    from transformers import LlamaConfig, LlamaForCausalLM

    marker = target / "scale-build.json"
    if marker.is_file() and json.loads(marker.read_text()) == {"preset": preset}:
        log(f"reusing {target}")
        return {}
    t0 = time.perf_counter()
    conf = LlamaConfig(**LLAMA_PRESETS[preset], tie_word_embeddings=False)
    with torch.device("cuda" if on_gpu else "cpu"):  # random init where it is fast; saved in bf16 like a real one
        model = LlamaForCausalLM._from_config(conf, dtype=torch.bfloat16)
    model.save_pretrained(str(fresh(target)), max_shard_size="5GB")
    del model
    torch.cuda.empty_cache()
    marker.write_text(json.dumps({"preset": preset}))
    log(f"built and saved {target} in {time.perf_counter() - t0:.1f} s")
    return {"build_and_save_s": round(time.perf_counter() - t0, 1)}


def states_dir(requested: str, default: Path, need: int) -> Path:
    """--states-dir, else /dev/shm when it holds the states with room to spare (N GPUs write ~N x
    1 GB/s of states, more than a local disk takes), else the work dir."""
    if requested:
        return Path(requested)
    shm = Path("/dev/shm")
    if shm.is_dir() and shutil.disk_usage(shm).free > 1.3 * need:
        return shm / "eyas-scale-states"
    return default


def cmd_llama_dp(a: argparse.Namespace) -> None:
    on_gpu = check_gpus(a.gpus, exact=False)
    if a.preset == "real" and not on_gpu:
        raise SystemExit("--preset real needs GPUs; on a CPU machine use --preset tiny")
    preset = "llama8b" if a.preset == "real" else "tiny"
    per_gpu = a.tokens_per_gpu or (300_000 if on_gpu else 4_000)
    root = Path(a.work_dir).expanduser() / "llama"
    run, target = root / "run", root / "target"
    root.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"step": "llama-dp", "preset": preset, "gpus": a.gpus,
                              "device": torch.cuda.get_device_name(0) if on_gpu else "cpu", "torch": torch.__version__}
    result.update(build_llama(preset, target, on_gpu))
    conf = LLAMA_PRESETS[preset]
    lengths = write_synthetic_prepare(run, conf["vocab_size"], a.gpus * per_gpu, a.seed)
    one_gpu_samples = int((lengths.cumsum(0) < per_gpu).sum()) + 1  # the first samples: ~per_gpu tokens
    bytes_per_token = 4 * conf["hidden_size"] * (2 if on_gpu else 4) + 5  # 3 aux + final, bf16 on GPU, fp32 on CPU
    states = states_dir(a.states_dir, root / "states", int(lengths.sum()) * bytes_per_token)
    states.mkdir(parents=True, exist_ok=True)
    speed = disk_write_speed(states, (2 << 30) if on_gpu else (64 << 20))
    result.update(states_dir=str(states), write_gb_s=gb(speed),
                  write_ceiling_tokens_per_s=round(speed / bytes_per_token))
    log(f"{len(lengths)} samples, {int(lengths.sum()):,} tokens; states to {states} at {speed / 1e9:.2f} GB/s "
        f"= {speed / bytes_per_token:,.0f} tok/s at most")
    common = [f"--run_dir={run}", f"--target.model={target}", "--extract.progress=false", *a.stage_args]
    runs = {"one": ["--extract.max_samples=" + str(one_gpu_samples)], "dp": []}
    for name, extra in runs.items():
        out = fresh(states / name)
        nproc = 0 if name == "one" else a.gpus
        # OMP_NUM_THREADS=1: what torchrun gives each of its ranks, so both runs' processes are alike
        # (on a small CPU host, one process with every core's threads ran 2.5x slower than with one)
        env = {"OMP_NUM_THREADS": "1"} if name == "one" else None
        Job(f"extract-{name}", eyas_cmd("extract", nproc, [*common, f"--extract.out_dir={out}", *extra]), env).wait()
        result[name] = read_extract_meta(out)
        if not a.keep_states:
            shutil.rmtree(out)
    ratio = result["dp"]["tokens_per_s"] / result["one"]["tokens_per_s"]
    result.update(speedup=round(ratio, 2), efficiency=round(ratio / a.gpus, 3),
                  bound_by_writes=result["dp"]["tokens_per_s"] > 0.8 * result["write_ceiling_tokens_per_s"])
    log(f"1 process: {result['one']['tokens_per_s']:,.0f} tok/s; {a.gpus} processes: "
        f"{result['dp']['tokens_per_s']:,.0f} tok/s = {ratio:.2f}x ({ratio / a.gpus:.0%} of linear)")
    emit("llama-dp", result)


# ---------------------------------------------------------------------------------------------
# fsdp-train: FSDP2 training of a D=7168 draft, killed and resumed


def train_records(out: Path) -> list[dict[str, Any]]:
    path = out / "metrics.jsonl"
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()] if path.is_file() else []


def steady_tokens_per_s(records: list[dict[str, Any]]) -> float:
    """Median of the logged windows after the first (which holds the compilation and warm-up)."""
    rates = [r["tokens_per_s"] for r in records if r["split"] == "train"]
    return statistics.median(rates[1:] if len(rates) > 1 else rates)


def flops_per_token(overrides: list[str], draft_config: Path, world: int, on_gpu: bool) -> dict[str, float]:
    """bench/train.py's FLOP count over the micro-batches of the run's first epoch, all ranks (the
    same packing, split and padding as the stage: eyas.train.data is a pure function of the seed)."""
    from eyas.draft import DraftConfig
    from eyas.prepared import Prepared
    from eyas.ttt import flex_row_length, resolve_attention
    from eyas.train.data import epoch_batches, pack, split_indices

    cfg = load_config(None, overrides)
    tc = cfg.train
    dcfg = DraftConfig(**json.loads(draft_config.read_text()))
    prep = Prepared(cfg.stage_dir("prepare"))
    attention = resolve_attention(tc.attention, torch.device("cuda" if on_gpu else "cpu"))
    pad = tc.pad_multiple or (flex_row_length(tc.max_tokens) if attention == "flex" else 0)
    train_idx, _ = split_indices(len(prep), tc.eval_fraction, cfg.seed)
    total: dict[str, float] = defaultdict(float)
    tokens = 0
    for rank in range(world):
        for plan in epoch_batches(train_idx, prep.lengths, tc.max_tokens, cfg.seed, 0, rank, world):
            batch = pack([prep[i] for i in plan], tc.ttt_steps, tc.max_tokens, pad)
            for k, v in count_flops(dcfg, batch, tc.ttt_steps).items():
                total[k] += v
            tokens += batch.num_tokens
    return {k: v / tokens for k, v in total.items()}


def train_job(name: str, nproc: int, args: list[str]) -> Job:
    return Job(name, eyas_cmd("train", nproc, args))


def kill_after_checkpoint(job: Job, out: Path, step: int, timeout_s: float) -> dict[str, Any]:
    """Wait for checkpoint `step` to be complete (its trainer.pt: checkpoints appear by an atomic
    rename), then SIGKILL the whole job."""
    ckpt = out / "checkpoints" / f"step_{step:07d}"
    deadline = time.monotonic() + timeout_s
    while not (ckpt / "trainer.pt").is_file():
        if job.proc.poll() is not None:
            job.wait()  # raises on a failure
            raise RuntimeError(f"{job.name} ended before writing {ckpt}: raise --max-steps above --save-every")
        if time.monotonic() > deadline:
            job.kill_tree()
            raise RuntimeError(f"{ckpt} did not appear within {timeout_s:.0f} s")
        time.sleep(0.05)
    pids = job.kill_tree()
    if (out / "final").exists():
        raise RuntimeError(f"{job.name} finished before it was killed: raise --max-steps")
    steps = [r["step"] for r in train_records(out) if r["split"] == "train"]
    log(f"killed {job.name} (pids {pids}) after {ckpt.name}; it had logged steps {steps}")
    return {"killed_pids": len(pids), "checkpoint": ckpt.name, "logged_before_kill": steps}


def check_resumed(job: Job, out: Path, a: argparse.Namespace, baseline: list[dict[str, Any]]) -> dict[str, Any]:
    """The resumed run started at the checkpoint, and metrics.jsonl holds every logged step once."""
    ckpt = f"step_{a.save_every:07d}"
    if not any("resuming from" in ln and ckpt in ln for ln in job.lines):
        raise RuntimeError(f"{job.name} did not say it resumed from {ckpt} (output above)")
    printed = [int(ln.split(" step ", 1)[1].split("/")[0]) for ln in job.lines if "[eyas:train] step " in ln]
    if not printed or printed[0] != a.save_every + a.log_every:
        raise RuntimeError(f"{job.name} logged steps {printed}: expected to continue at {a.save_every + a.log_every}")
    records = [r for r in train_records(out) if r["split"] == "train"]
    steps = [r["step"] for r in records]
    want = sorted(set(range(a.log_every, a.max_steps + 1, a.log_every)) | {a.max_steps})
    if steps != want:
        raise RuntimeError(f"{out / 'metrics.jsonl'} holds train steps {steps}, expected {want}")
    # same seed, data order and restored RNG/optimizer: the losses after the resume repeat run A's
    base = {r["step"]: r["loss"] for r in baseline if r["split"] == "train"}
    diffs = [abs(r["loss"] - base[r["step"]]) / max(abs(base[r["step"]]), 1e-12) for r in records
             if r["step"] > a.save_every and r["step"] in base]
    return {"resumed_from": ckpt, "first_logged_step": printed[0], "train_steps_logged": steps,
            "loss_rel_diff_vs_uninterrupted_max": max(diffs) if diffs else None}


def cmd_fsdp_train(a: argparse.Namespace) -> None:
    on_gpu = check_gpus(a.gpus, exact=False)
    if a.preset == "real" and not on_gpu:
        raise SystemExit("--preset real needs GPUs; on a CPU machine use --preset tiny")
    root = Path(a.work_dir).expanduser()
    run, heads = root / "dsv3" / "run", root / "dsv3" / "heads"
    if not (run / "extract" / "meta.json").is_file() or not (heads / "model.safetensors").is_file():
        raise SystemExit(f"no complete dsv3 output in {root / 'dsv3'}: run `bench/scale.py dsv3` first")
    if not 0 < a.save_every < a.max_steps or a.save_every % a.log_every:
        raise SystemExit("need 0 < --save-every < --max-steps, and --save-every a multiple of --log-every")
    common = [f"--run_dir={run}", f"--target.model={heads}", f"--train.parallel={a.parallel}",
              f"--train.max_steps={a.max_steps}", f"--train.epochs={a.max_steps}",  # epochs: enough to reach max_steps
              f"--train.max_tokens={a.max_tokens}", f"--train.log_every={a.log_every}", "--train.eval_fraction=0",
              f"--train.save_every={a.save_every}", "--train.keep_checkpoints=1", *a.stage_args]
    out_a, out_b = fresh(root / "train" / "a"), fresh(root / "train" / "b")
    result: dict[str, Any] = {"step": "fsdp-train", "gpus": a.gpus, "parallel": a.parallel,
                              "device": torch.cuda.get_device_name(0) if on_gpu else "cpu", "torch": torch.__version__,
                              "max_steps": a.max_steps, "save_every": a.save_every, "max_tokens": a.max_tokens}
    t0 = time.perf_counter()
    with GpuMemory() as mem:
        train_job("train-A", a.gpus, [*common, f"--train.out_dir={out_a}"]).wait()
    baseline = train_records(out_a)
    meta = json.loads((out_a / "meta.json").read_text())
    fpt = flops_per_token([*common, f"--train.out_dir={out_a}"], out_a / "final" / "draft_config.json", a.gpus, on_gpu)
    tok_s = steady_tokens_per_s(baseline)
    flops_s = sum(fpt.values()) * tok_s
    result["uninterrupted"] = {
        "wall_s": round(time.perf_counter() - t0, 1), "trainable_parameters": meta["counts"]["trainable_parameters"],
        "tokens_per_s": round(tok_s, 1), "tokens_per_s_per_gpu": round(tok_s / a.gpus, 1),
        "tokens_per_s_per_window": [round(r["tokens_per_s"], 1) for r in baseline],
        "tflop_per_token_fwd_bwd": sig(sum(fpt.values()) / 1e12),
        "flops_breakdown_per_token_gflop": {k: sig(v / 1e9) for k, v in fpt.items()},
        "mfu": sig(flops_s / a.gpus / PEAK), "mfu_vs_measured_790": sig(flops_s / a.gpus / MEASURED_PEAK),
        "peak_memory_used_gib": mem.peak_gib(), "memory_note": "nvidia-smi memory.used, sampled every 0.5 s",
        "final_loss": baseline[-1]["loss"],
    }
    shutil.rmtree(out_a / "checkpoints")  # ~15 GB for a D=7168 draft; the disk is needed for B's
    job = train_job("train-B", a.gpus, [*common, f"--train.out_dir={out_b}"])
    result["kill"] = kill_after_checkpoint(job, out_b, a.save_every, a.kill_timeout_s)
    job = train_job("train-C", a.gpus, [*common, f"--train.out_dir={out_b}", "--train.resume=auto"])
    job.wait()
    result["resume"] = check_resumed(job, out_b, a, baseline)
    u = result["uninterrupted"]
    log(f"{a.parallel} on {a.gpus}: {count(u['trainable_parameters'])} trainable, {u['tokens_per_s']:,.0f} tok/s, "
        f"MFU {u['mfu']:.1%} (of 989 TFLOP/s per GPU), peak memory {u['peak_memory_used_gib']}; killed after "
        f"{result['kill']['checkpoint']}, resumed: steps {result['resume']['train_steps_logged']}, loss vs "
        f"uninterrupted max rel. diff {result['resume']['loss_rel_diff_vs_uninterrupted_max']}")
    emit("fsdp-train", result)


# ---------------------------------------------------------------------------------------------


def parse() -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--gpus", type=int, default=1, help="N: GPUs (on CPU: processes under torchrun, gloo)")
    common.add_argument("--preset", choices=("real", "tiny"), default="real" if torch.cuda.is_available() else "tiny",
                        help="real widths (GPU) or a toy of the same structure (CPU check); default by machine")
    common.add_argument("--work-dir", default=os.environ.get("EYAS_SCALE_DIR", "~/eyas-scale"),
                        help="state shared by the steps (targets, runs); default $EYAS_SCALE_DIR or ~/eyas-scale")
    common.add_argument("--seed", type=int, default=0)
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("dsv3", parents=[common], help="DeepSeek-V3-shaped target, extract with device_map=auto")
    d.add_argument("--layers", type=int, default=0, help="decoder layers (0 = the default for --gpus/--weights)")
    d.add_argument("--experts", type=int, default=0, help="routed experts per MoE layer (0 = the default)")
    d.add_argument("--weights", choices=("disk", "gpu"), default="disk",
                   help="disk: save_pretrained + the stage loads it; gpu: built on the GPUs, handed to the stage")
    d.add_argument("--tokens", type=int, default=0, help="tokens to extract (default: real 300k with --weights disk, "
                   "150k with gpu (a deeper model, slower per token); tiny 3k)")
    d.add_argument("--verify", type=int, default=8, help="--extract.verify: samples checked beyond the first batch")
    d.add_argument("--keep-weights", action="store_true", help="keep the saved target after extracting")
    d.set_defaults(fn=cmd_dsv3)
    ll = sub.add_parser("llama-dp", parents=[common], help="Llama-3.1-8B extract, 1 GPU vs torchrun over N")
    ll.add_argument("--tokens-per-gpu", type=int, default=0, help="tokens per GPU (default 300k GPU, 4k CPU)")
    ll.add_argument("--states-dir", default="", help="where the states go (default /dev/shm if it has room)")
    ll.add_argument("--keep-states", action="store_true")
    ll.set_defaults(fn=cmd_llama_dp)
    t = sub.add_parser("fsdp-train", parents=[common], help="FSDP2 draft training on dsv3's states, kill, resume")
    t.add_argument("--parallel", choices=("fsdp", "ddp"), default="fsdp", help="--train.parallel")
    t.add_argument("--max-steps", type=int, default=0, help="optimizer steps (default 20 real, 12 tiny)")
    t.add_argument("--save-every", type=int, default=0, help="checkpoint interval; run B is killed after the first "
                   "(default max_steps / 2 real, 4 tiny)")
    t.add_argument("--log-every", type=int, default=0, help="default 5 real, 2 tiny")
    t.add_argument("--max-tokens", type=int, default=0,
                   help="--train.max_tokens per rank (default 8192 real, 512 tiny)")
    t.add_argument("--kill-timeout-s", type=float, default=480, help="give up waiting for run B's first checkpoint")
    t.set_defaults(fn=cmd_fsdp_train)
    a, extra = p.parse_known_args()
    if a.cmd == "fsdp-train":
        real = a.preset == "real"
        a.max_steps = a.max_steps or (20 if real else 12)
        a.save_every = a.save_every or (a.max_steps // 2 if real else 4)
        a.log_every = a.log_every or (5 if real else 2)
        a.max_tokens = a.max_tokens or (8192 if real else 512)
    return a, extra


def main() -> None:
    a, extra = parse()
    a.stage_args = stage_args(extra)
    a.fn(a)


if __name__ == "__main__":
    main()
