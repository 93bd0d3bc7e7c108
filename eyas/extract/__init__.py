"""extract: the target's hidden states for every prepared sample -> sharded safetensors.

    eyas extract [recipe.yaml] [--extract.verify=8 --extract.token_budget=32768]
    torchrun --nproc-per-node 8 -m eyas extract [recipe.yaml]       # data parallel, same flags
    torchrun --nproc-per-node 8 --no-python eyas extract [...]      # the same, via the console script

What is stored per sample (read it back with `eyas.HiddenStates`): `input_ids`, `loss_mask`, the
aux states `aux` [S, K, D] and the final state `final` [S, D]. Aux id k is the hidden state
**entering** decoder layer k, HF `output_hidden_states[k]` (the EAGLE-3 reference and vLLM
convention), default [2, L//2, L-3]; `final` is the output of the final norm, what the LM head
sees, so training recomputes teacher logits as `lm_head(final)` instead of storing V-wide logits.
Capture is a set of forward hooks found generically (eyas/capture.py), never a rewritten forward.

How it runs:
* **Preflight** before any weight is loaded: target config, layer ids vs num_hidden_layers, the
  prepare output (readable, non-empty, made for this target), out dir writable, free disk >= the
  estimate `tokens x (K+1) x D x bytes`, which is printed. With `extract.spill_dirs` the free
  space of every filesystem counts (less `extract.min_free_gb` each), and each shard goes to the
  first directory with room for it (store.py `ShardPlacer`): a tmpfs, then a disk, for example.
  A **smoke test** right after loading sends one sample through the whole capture path (shape,
  dtype, finiteness).
* **Batches** by token budget over the longest-first order (plan.py), right-padded without a mask
  or packed (backend.py says why that is exact). Device->host copies go to a pool of pinned buffers
  on a side stream and two background threads hash and write the shards, fsyncs overlapping the
  next writes (writer.py): the GPU waits only on a slow disk. `HFBackend(compile=True)` compiles
  the decoder layers (backend.py).
  Weights and activations in bf16 on GPU, fp32 on CPU (`target.dtype`), stored as `extract.store_dtype`;
  `float8` quantises each batch on the device after the parity check (e4m3, one float32 scale per
  token for aux and one for final, eyas/fp8.py), so half of bf16's bytes cross to the host and disk.
* **Parity**: every sample of the first batch, and `extract.verify` more spread over the run, is
  compared with a plain batch-1 `model.model(..., output_hidden_states=True)` (no hooks); a
  relative error past `extract.parity_tol` that is not bf16/fp16 rounding (judged against a float32
  forward: at most 1.5x the plain forward's own error) stops the run naming the sample, layer and error.
* **Failures**: a failing batch is recorded (stage, rank, sample ids, type, message or repr,
  traceback) in errors.jsonl and on stderr. By default the run stops and exits non-zero; with
  `extract.max_failures=N` the batch is retried sample by sample, failing samples are skipped and
  listed in the summary and meta.json, and the exit code stays non-zero unless
  `extract.allow_failures=true`.
* **Resume**: shards are atomic and journalled (store.py); re-running the same command skips every
  sample already stored, whatever happened to the previous run (kill -9 included).
* **Backends**: `extract.backend=hf` (transformers, above) or `vllm`: vLLM's offline engine with its
  own tensor/pipeline/expert parallelism, one process, for targets only vLLM runs fast enough
  (extract/vllm_backend.py). Both hand the loop the same states per batch; the writer, index,
  checksums, meta and resume code are shared, so the trainer cannot tell them apart.
* **Scale**: under torchrun each rank extracts a disjoint, length-balanced share into its own
  shards; rank 0 merges one index at the end. A target too large for one GPU is split over the
  process's visible GPUs with `extract.device_map=auto` (accelerate's big-model placement; one
  process, layers run in sequence, no tensor parallelism).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from eyas import artifacts, distributed, fp8, vllm_engine
from eyas.capture import check_layer_ids, default_layer_ids
from eyas.config import EyasConfig, dump_config, to_dict
from eyas.errors import ConfigError, DataError, EyasError, exception_message, record_error, raise_if_terminated
from eyas.extract import plan, store, vllm_backend, vllm_proxy  # vLLM is imported only when an engine starts
from eyas.extract.backend import HFBackend, Parity, check_parity, default_tolerance
from eyas.extract.profile import NULL_TIMER, NullTimer
from eyas.extract.writer import Failures, HostCopier, Writer
from eyas.prepared import Prepared
from eyas.target import (describe_target, load_config, load_model, load_tokenizer, model_path, resolve_dtype,
                         tokenizer_hash)


@dataclass
class Setup:
    """Everything preflight learned without loading weights."""

    out: Path
    prepared: Prepared
    layer_ids: list[int]
    num_layers: int
    hidden: int
    compute_dtype: torch.dtype
    store_dtype: torch.dtype
    fingerprint: dict[str, Any]
    indices: list[int]
    entries: list[dict[str, Any]]
    remaining: list[int]
    spill: list[Path] = field(default_factory=list)
    """extract.spill_dirs, resolved and claimed for `out`."""
    min_free: int = 0
    """extract.min_free_gb in bytes."""
    proxy: dict[str, Any] | None = None
    """The vLLM backend's proxy parity check of this run (extract.vllm_proxy_parity), when it ran."""

    @property
    def bytes_per_token(self) -> int:
        """States (and float8's scales) of one token on disk."""
        return ((len(self.layer_ids) + 1) * self.hidden * torch.empty((), dtype=self.store_dtype).element_size()
                + store.scale_bytes(self.store_dtype))

    @property
    def quantised(self) -> bool:
        """float8 storage: the backend captures in capture_dtype, the loop quantises before the copy."""
        return store.scale_bytes(self.store_dtype) > 0

    @property
    def capture_dtype(self) -> torch.dtype:
        """The dtype the backend hands the loop (and the parity check judges): the store dtype, or
        the compute dtype for float8, quantised afterwards."""
        return self.compute_dtype if self.quantised else self.store_dtype


def store_dtype(name: str, compute: torch.dtype) -> torch.dtype:
    """extract.store_dtype -> the dtype of the stored states (float8 = float8_e4m3fn, with scales)."""
    if name == "auto":
        return compute
    return store.FLOAT8 if name == "float8" else getattr(torch, name)


def _log(rank: int, msg: str) -> None:
    if rank == 0:
        print(f"[eyas:extract] {msg}", flush=True)


def preflight(cfg: EyasConfig, device: torch.device, world_size: int, rank: int = 0) -> Setup:
    ec = cfg.extract
    prepared = Prepared(cfg.stage_dir("prepare"))  # ArtifactError naming `eyas prepare` when absent
    if len(prepared) == 0:
        raise DataError(f"{prepared.dir} holds no samples: re-run `eyas prepare` with more data")
    conf = load_config(cfg.target)
    num_layers, hidden = int(conf.num_hidden_layers), int(conf.hidden_size)
    layer_ids = check_layer_ids(ec.layer_ids or default_layer_ids(num_layers), num_layers)
    made_with = prepared.meta.get("hashes", {}).get("tokenizer")
    if made_with and made_with != tokenizer_hash(load_tokenizer(cfg.target, require_chat_template=False)):
        raise ConfigError(
            f"{prepared.dir} was prepared with another tokenizer or chat template (target "
            f"{prepared.meta.get('target', {}).get('model')!r}) than target.model={cfg.target.model!r}: "
            "re-run `eyas prepare` for this target, or set --target.model to the prepared one"
        )
    if int(prepared._ids.max()) >= int(conf.vocab_size):
        raise DataError(f"{prepared.dir} holds token ids >= the target vocab size {conf.vocab_size}: re-run `eyas prepare`")
    if ec.device_map and world_size > 1:
        raise ConfigError("extract.device_map splits one target over the GPUs of one process; run it without torchrun")
    if ec.backend == "vllm" and world_size > 1:
        raise ConfigError("extract.backend=vllm runs one process that spreads the target over the GPUs itself "
                          "(--extract.vllm_tensor_parallel_size, _pipeline_parallel_size): run it without torchrun")
    longest = int(prepared.lengths.max())
    if ec.backend == "vllm":
        vllm_backend.max_model_len(ec, longest)  # ConfigError when too short, before any engine starts
        vllm_backend.check_supported(ec, conf.model_type, layer_ids, cpu=vllm_engine.on_cpu("extract.backend"))
        vllm_backend.check_reference_memory(cfg)
    if longest > ec.token_budget:
        raise ConfigError(f"the longest sample has {longest} tokens, more than extract.token_budget={ec.token_budget}: "
                          f"raise it to >= {longest}")
    compute = resolve_dtype(cfg.target.dtype, "cuda" if ec.device_map and torch.cuda.is_available() else str(device))
    stored = store_dtype(ec.store_dtype, compute)
    out = cfg.stage_dir("extract")
    _check_writable(out)
    spill = store.claim_spill_dirs(out, ec.spill_dirs)
    fingerprint = {
        "target": str(Path(model_path(cfg.target)).resolve()) if Path(model_path(cfg.target)).exists() else cfg.target.model,
        "revision": cfg.target.revision,
        "compute_dtype": str(compute).removeprefix("torch."),
        "store_dtype": str(stored).removeprefix("torch."),
        "layer_ids": layer_ids,
        "hidden_size": hidden,
        "prepare_hashes": prepared.meta.get("hashes", {}),
        "prepare_tokens": int(prepared.offsets[-1]),
        "backend": ec.backend,
    }
    store.check_run(out, fingerprint)
    n = min(len(prepared), ec.max_samples) if ec.max_samples else len(prepared)
    entries = store.read_journals(out)
    if spill:  # before the free space is measured (every rank: no rank writes before the barrier)
        removed = store.clean_spill(out, spill, entries)
        if removed:
            _log(rank, f"removed {removed} shard file(s) no journal lists from {', '.join(map(str, spill))}")
    done = store.done_samples(entries)
    remaining = [i for i in range(n) if i not in done]
    setup = Setup(out, prepared, layer_ids, num_layers, hidden, compute, stored, fingerprint, list(range(n)),
                  entries, remaining, spill, int(ec.min_free_gb * 1e9))
    _check_disk(setup, rank, world_size, n)
    return setup


def _check_writable(out: Path) -> None:
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as e:
        raise EyasError(
            f"cannot write to the output directory {out} ({e.strerror}): choose another with --extract.out_dir"
        ) from None


def room(dirs: list[tuple[Path, int]]) -> tuple[int, list[str]]:
    """Bytes the shards may take in (directory, bytes to keep free) pairs, each filesystem counted
    once (with the first pair's keep); -> (bytes, one 'N GB free at DIR' line per filesystem)."""
    total, lines, seen = 0, [], set()
    for d, keep in dirs:
        dev = os.stat(d).st_dev
        if dev in seen:
            continue
        seen.add(dev)
        free = shutil.disk_usage(d).free
        total += max(0, free - keep)
        lines.append(f"{free / 1e9:.1f} GB free at {d}")
    return total, lines


def _check_disk(s: Setup, rank: int, world_size: int, n: int) -> None:
    tokens = int(s.prepared.lengths[s.remaining].sum()) if s.remaining else 0
    need = tokens * (s.bytes_per_token + 5)  # + int32 ids and uint8 mask per token
    free, lines = room(store.free_to_keep(s.out, s.spill, s.min_free))
    k = len(s.layer_ids)
    _log(rank, f"{len(s.remaining):,} of {n:,} samples to extract ({tokens:,} tokens) on {world_size} rank(s); "
               f"layers {s.layer_ids} + final, D={s.hidden}, {str(s.store_dtype).removeprefix('torch.')}")
    keep = f" (keeping extract.min_free_gb={s.min_free / 1e9:g} free on each)" if s.min_free else ""
    scales = f" + {store.scale_bytes(s.store_dtype)} bytes of scales" if s.quantised else ""
    _log(rank, f"will write ~{need / 1e9:.2f} GB (= {tokens:,} tokens x (({k}+1) x {s.hidden} x "
               f"{s.bytes_per_token // ((k + 1) * s.hidden)} bytes{scales} + 5)); {', '.join(lines)}{keep}")
    if need > free:
        raise EyasError(
            f"not enough disk: the extract needs ~{need / 1e9:.2f} GB, {free / 1e9:.2f} GB may be used "
            f"({', '.join(lines)}{keep}); use --extract.out_dir on a larger disk, add directories on other "
            "filesystems to --extract.spill_dirs, --extract.store_dtype=bfloat16 (or float8, half of that), or "
            "--extract.max_samples"
        )


def make_backend(cfg: EyasConfig, setup: Setup, device: torch.device):
    if cfg.extract.backend == "vllm":
        parked = vllm_engine.parked_note()  # regenerate's engine, when it ran in this process (its proxy check too)
        if parked and parked.get("proxy"):
            setup.proxy = parked["proxy"]
        elif vllm_proxy.wanted(cfg.extract):  # before the target's own load, which may take many minutes
            vllm_engine.release()
            setup.proxy = vllm_proxy.check_proxy(cfg, setup, vllm_backend.make_vllm_backend)
        return vllm_backend.make_vllm_backend(cfg, setup, int(setup.prepared.lengths.max()))
    model = load_model(cfg.target, device=None if cfg.extract.device_map else device,
                       device_map=cfg.extract.device_map or None,
                       attn_implementation=cfg.extract.attn_implementation or None)
    return HFBackend(model, setup.layer_ids, setup.capture_dtype, compile=cfg.extract.compile)


def smoke_test(backend, setup: Setup, index: int, rank: int) -> None:
    """One sample through the whole capture path before the long run."""
    tokens = setup.prepared[index]["input_ids"]
    n = tokens.numel()
    try:
        states = backend.forward(plan.Batch([index], [n], 1, n, False), [tokens])
    except Exception as e:  # recorded with type, message, traceback, then re-raised as a user-facing error
        record_error(setup.out / "errors.jsonl", e, stage="extract", rank=rank, sample_ids=[setup.prepared.ids[index]],
                     phase="smoke test")
        raise EyasError(f"smoke test: the first forward of the target failed with {type(e).__name__}: "
                        f"{exception_message(e)} (traceback above and in {setup.out / 'errors.jsonl'})") from e
    want = (n, len(setup.layer_ids) + 1, setup.hidden)
    problem = (f"shape {tuple(states.shape)} != {want}" if tuple(states.shape) != want else
               f"dtype {states.dtype} != {setup.capture_dtype}" if states.dtype != setup.capture_dtype else
               "inf/NaN values" if not bool(torch.isfinite(states).all()) else "")
    if problem:
        raise EyasError(f"smoke test on sample {setup.prepared.ids[index]}: the captured states have {problem}; "
                        "the target or its dtype (--target.dtype) is not usable as is")


def forward_batch(backend, batch: plan.Batch, tokens: list[torch.Tensor], failures: Failures,
                  timer: NullTimer = NULL_TIMER):
    """-> (states_TKD, failed indices). A failing batch is recorded; with failures allowed it is
    retried sample by sample and the samples that fail again get zero rows (left out of the index)."""
    try:
        return backend.forward(batch, tokens, timer=timer), []
    except vllm_backend.EngineDied as e:  # no engine left to retry on: recorded, then the run stops
        failures.record(e, batch.indices, count=False, phase="vllm engine")
        raise
    except Exception as e:  # recorded with type, message, traceback; raised on unless failures are allowed
        failures.record(e, batch.indices, count=failures.limit == 0, retry="per sample")
    parts, failed = [], []
    for i, t in zip(batch.indices, tokens):
        n = t.numel()
        try:
            parts.append(backend.forward(plan.Batch([i], [n], 1, n, False), [t]))
        except Exception as e:  # the same: recorded, counted against extract.max_failures
            failures.record(e, [i])
            failed.append(i)
            parts.append(None)
    like = next((p for p in parts if p is not None), None)
    shape = (len(backend.layer_ids) + 1, backend.hidden_size)
    dev = like.device if like is not None else backend.device
    parts = [p if p is not None else torch.zeros((n, *shape), dtype=backend.dtype, device=dev)
             for p, n in zip(parts, batch.lengths)]
    return torch.cat(parts), failed


def extract_rank(cfg: EyasConfig, setup: Setup, backend, rank: int, world_size: int,
                 timer: NullTimer = NULL_TIMER) -> dict[str, Any]:
    """This rank's share of the remaining samples -> shards; -> its summary. `timer` (bench/extract.py
    --profile) times each phase; the stage runs with NULL_TIMER."""
    ec, lengths = cfg.extract, setup.prepared.lengths
    mine = plan.rank_slice(setup.remaining, lengths, rank, world_size)
    # vLLM schedules its own batches: a "batch" is one submission of <= token_budget real tokens (packed)
    batches = plan.make_batches(mine, lengths, ec.token_budget, ec.max_batch_size, ec.pack or ec.backend == "vllm")
    shards = plan.group_shards(batches, setup.bytes_per_token, ec.shard_bytes)
    summary = {"rank": rank, "samples": len(mine), "tokens": sum(b.num_tokens for b in batches),
               "padded_tokens": sum(b.padded_tokens for b in batches), "batches": len(batches),
               "parity_checked": 0, "parity_max_error": 0.0, "parity_float32_judged": 0, "failed": [], "seconds": 0.0, "bytes": 0}
    if not batches:
        return summary
    t0 = time.perf_counter()
    numbers = [int(Path(e["shard"]).name.split("-")[1].split(".")[0]) for e in setup.entries if e["rank"] == rank]
    failures = Failures(ec.max_failures, setup.out / "errors.jsonl", rank, setup.prepared.ids)
    copier = HostCopier(max(b.num_tokens for b in batches), len(setup.layer_ids) + 1, setup.hidden,
                        setup.store_dtype, ec.writer_queue, check=lambda: writer.check())  # float8: + scales
    placer = store.ShardPlacer(setup.out, setup.spill, setup.min_free, check=bool(setup.spill or setup.min_free))
    writer = Writer(setup.out, rank, free_numbers(numbers, len(shards)), shards, setup.prepared,
                    len(setup.layer_ids) + 1, setup.hidden, setup.store_dtype, copier, failures, placer=placer)
    if backend.device.type == "cuda":
        copier.start()  # pins the host buffers while the smoke test and the first batch run
    with timer.gpu("smoke test"):
        smoke_test(backend, setup, mine[-1], rank)
    tol = ec.parity_tol or max(default_tolerance(setup.compute_dtype), default_tolerance(setup.capture_dtype))
    later = [i for b in batches[1:] for i in b.indices]
    first = batches[0].indices if ec.backend == "hf" else batches[0].indices[: ec.vllm_parity]  # vs a CPU reference
    verify = set(first) | {later[round(j * (len(later) - 1) / max(ec.verify - 1, 1))]
                           for j in range(min(ec.verify, len(later)))}
    bar = _progress(ec.progress and rank == 0, summary["tokens"])
    writer.start()
    done = 0
    try:
        with timer.gpu("batches (all phases of the main stream)"):
            ahead = backend.submit if ec.backend == "vllm" else None  # the engine runs batch j+1 while j is read
            if ahead is not None:
                ahead(batches[0], [setup.prepared[i]["input_ids"] for i in batches[0].indices])
            for j, batch in enumerate(batches):
                raise_if_terminated()
                tokens = [setup.prepared[i]["input_ids"] for i in batch.indices]
                if ahead is not None and j + 1 < len(batches):
                    ahead(batches[j + 1], [setup.prepared[i]["input_ids"] for i in batches[j + 1].indices])
                states_TKD, failed = forward_batch(backend, batch, tokens, failures, timer)
                check = verify.intersection(batch.indices) - set(failed)
                if check:
                    with timer.gpu("parity check"):
                        parity = verify_batch(backend, batch, tokens, states_TKD, check, tol, setup.prepared.ids)
                    summary["parity_checked"] += len(parity.errors)
                    summary["parity_max_error"] = max([summary["parity_max_error"], *parity.errors])
                    summary["parity_float32_judged"] += parity.float32_judged
                with timer.gpu("isfinite"):
                    finite_T = torch.isfinite(states_TKD).flatten(1).all(1)
                scales_T2 = None
                if setup.quantised:  # after parity and isfinite: both judge the captured states
                    with timer.gpu("quantise to float8"):
                        states_TKD, scales_T2 = fp8.quantise_states(states_TKD, len(setup.layer_ids))
                pending = copier.copy(states_TKD, finite_T, scales_T2, timer)
                with timer.host("wait for the writer queue"):
                    writer.submit(batch, pending, failed)
                if bar is not None:
                    bar.update(batch.num_tokens)
                    done += len(batch.indices)
                    bar.set_postfix_str(f"{done:,}/{len(mine):,} samples, {writer.bytes_written / 1e9:.2f} GB written",
                                        refresh=False)
        with timer.host("wait for the writers to finish"):
            writer.finish()
    except BaseException:
        writer.abort()
        raise
    finally:
        if bar is not None:
            bar.close()
    for name, seconds in writer.stats().items():
        timer.add(f"writers: {name}", seconds)
    summary.update(failed=sorted(failures.samples), seconds=round(time.perf_counter() - t0, 3),
                   bytes=writer.bytes_written)
    if ec.backend == "vllm":
        summary["vllm"] = {k: round(v, 3) for k, v in backend.stats.items()}
    return summary


def verify_batch(backend, batch: plan.Batch, tokens: list[torch.Tensor], states_TKD: torch.Tensor,
                 verify: set[int], tol: float, ids: list[str]) -> Parity:
    """Parity of the batch's samples that are in `verify` (ParityError past tol and not rounding)."""
    checks, start = [], 0
    for i, n, t in zip(batch.indices, batch.lengths, tokens):
        if i in verify:
            checks.append((ids[i], states_TKD[start : start + n], t))
        start += n
    return check_parity(backend, checks, tol)


def _progress(enabled: bool, total: int):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, unit="tok", unit_scale=True, dynamic_ncols=True, mininterval=1.0,
                desc="extract", file=sys.stderr)


def finalize(cfg: EyasConfig, setup: Setup, summaries: list[dict[str, Any]]) -> dict[str, Any]:
    """Rank 0, after every rank is done: index.json, then meta.json (its presence marks completion)."""
    out = setup.out
    entries = store.read_journals(out)
    index = store.build_index(out, entries, setup.prepared.ids)
    stored = set(index["index"])
    failed = sorted({i for e in entries for i in e["failed"]} - stored)
    missing = sorted(set(setup.indices) - stored - set(failed))
    if missing:
        raise EyasError(f"{len(missing)} samples are neither stored nor failed (e.g. {missing[:5]}): "
                        "re-run the same `eyas extract` command to extract them")
    artifacts.atomic_write_json(out / "index.json", index)
    artifacts.atomic_write_text(out / "config.yaml", dump_config(cfg))
    shards = {e["shard"]: {"sha256": e["sha256"], "bytes": e["bytes"], "tokens": sum(e["lengths"]),
                           "samples": len(e["samples"]), "rank": e["rank"]} for e in entries}
    run_tokens = sum(s["tokens"] for s in summaries)
    seconds = max((s["seconds"] for s in summaries), default=0.0)
    padded = sum(s["padded_tokens"] for s in summaries)
    counts = {
        "samples": len(stored),
        "tokens": int(sum(index["length"])),
        "bytes": sum(v["bytes"] for v in shards.values()),
        "shards": len(shards),
        "failed": [setup.prepared.ids[i] for i in failed],
        "failed_indices": failed,
        "this_run": {"tokens": run_tokens, "seconds": seconds, "tokens_per_s": round(run_tokens / seconds, 1) if seconds else 0.0,
                     "padding_waste": round(1 - run_tokens / padded, 4) if padded else 0.0,
                     "world_size": len(summaries),
                     "parity_checked": sum(s["parity_checked"] for s in summaries),
                     "parity_max_error": max((s["parity_max_error"] for s in summaries), default=0.0),
                     "parity_float32_judged": sum(s.get("parity_float32_judged", 0) for s in summaries)},
    }
    extra: dict[str, Any] = {}
    if cfg.extract.backend == "vllm":
        counts["this_run"]["vllm"] = summaries[0].get("vllm", {})
        counts["this_run"]["vllm_proxy_parity"] = setup.proxy
        extra["versions"] = {**artifacts.library_versions(), "vllm": vllm_backend.vllm_version()}
    meta = artifacts.write_meta(
        out, "extract",
        files=artifacts.file_record(out, ["index.json"]),
        config={"target": to_dict(cfg.target), "extract": to_dict(cfg.extract)},
        target=describe_target(cfg.target),
        dtype=setup.fingerprint["store_dtype"],
        compute_dtype=setup.fingerprint["compute_dtype"],
        layer_ids=setup.layer_ids,
        hidden_size=setup.hidden,
        num_hidden_layers=setup.num_layers,
        layout="states [T, K+1, D]: aux in layer_ids order, then the final-norm output"
               + ("; scales [T, 2] float32: states[:, :K] * scales[:, 0], states[:, K] * scales[:, 1]"
                  if setup.quantised else ""),
        prepare_dir=str(setup.prepared.dir.resolve()),
        prepare_hashes=setup.prepared.meta.get("hashes", {}),
        shards=shards,
        counts=counts,
        backend=cfg.extract.backend,
        **extra,
    )
    return meta


def parity_line(r: dict[str, Any]) -> str:
    """The summary's parity line: what was compared, or that nothing was (never "0 samples ... 0.00e+00",
    which reads as a pass), with the proxy's check where it ran instead."""
    proxy = r.get("vllm_proxy_parity")
    if not r["parity_checked"]:
        line = "  parity         not checked against a plain forward (extract.vllm_parity=0, extract.verify=0)"
        if proxy:
            line += (f"; vLLM on a proxy of the target: {proxy['samples']} samples, max relative error "
                     f"{proxy['max_relative_error']:.2e}")
        return line
    return (f"  parity         {r['parity_checked']:>12,} samples vs a plain forward, max relative error "
            f"{r['parity_max_error']:.2e}"
            + (f" ({r['parity_float32_judged']} past the tolerance, rounding by a float32 forward)"
               if r.get("parity_float32_judged") else ""))


def print_summary(out: Path, meta: dict[str, Any]) -> None:
    c, r = meta["counts"], meta["counts"]["this_run"]
    lines = [
        f"[eyas:extract] wrote {out}",
        f"  samples        {c['samples']:>12,} stored, {len(c['failed']):,} failed",
        f"  tokens         {c['tokens']:>12,} ({r['tokens']:,} this run, padding waste {r['padding_waste']:.1%})",
        f"  hidden states  {c['bytes'] / 1e9:>12.3f} GB in {c['shards']} shards; layers {meta['layer_ids']} + final, "
        f"D={meta['hidden_size']}, {meta['dtype']}",
        f"  speed          {r['tokens_per_s']:>12,.0f} tok/s over {r['seconds']:.1f} s on {r['world_size']} rank(s)",
        parity_line(r),
    ]
    spilled = [name for name in meta["shards"] if Path(name).is_absolute()]
    if spilled:
        dirs = sorted({str(Path(name).parent.parent) for name in spilled})
        lines.append(f"  spilled        {len(spilled):>12,} of the shards, {sum(meta['shards'][n]['bytes'] for n in spilled) / 1e9:.3f} GB, "
                     f"to {', '.join(dirs)}")
    if c["failed"]:
        lines.append(f"  FAILED         {', '.join(c['failed'][:20])}{' ...' if len(c['failed']) > 20 else ''} (see errors.jsonl)")
    print("\n".join(lines), flush=True)


def free_numbers(taken: list[int], n: int) -> list[int]:
    """`n` shard numbers for this run: first those below the highest taken that are free (shards that
    were deleted, lost or damaged: re-extracting their samples, planned the same way, rewrites them
    under their own names), then the ones after it."""
    top = max(taken, default=-1)
    gaps = sorted(set(range(top + 1)) - set(taken))
    return (gaps + list(range(top + 1, top + 1 + n)))[:n]


def prepare_resume(setup: Setup, rank: int, world_size: int) -> None:
    """After every rank has read the journals: repair this rank's journal, delete leftovers."""
    ranks = [rank] + (sorted({e["rank"] for e in setup.entries} - set(range(world_size))) if rank == 0 else [])
    for r in ranks:
        store.rewrite_journal(setup.out, r, setup.entries)
    removed = store.clean_unlisted(setup.out, ranks, {e["shard"] for e in setup.entries})
    if removed:
        print(f"[eyas:extract] rank {rank}: removed {removed} incomplete shard file(s) of an interrupted run", flush=True)
    if rank == 0:
        artifacts.atomic_write_json(setup.out / store.PROGRESS_DIR / "run.json", setup.fingerprint)
        if setup.remaining:
            (setup.out / "meta.json").unlink(missing_ok=True)  # no longer complete until finalize


def run(cfg: EyasConfig) -> dict[str, Any]:
    ddp, rank, _local_rank, world_size, device = distributed.compute_init(cfg.extract.device)
    try:
        return _run(cfg, rank, world_size, device)
    except EyasError:
        raise
    except Exception as e:  # recorded (type, message or repr, traceback) in errors.jsonl, then re-raised
        out = cfg.stage_dir("extract")
        record_error(out / "errors.jsonl" if out.is_dir() else None, e, stage="extract", rank=rank)
        raise EyasError(f"extract failed on rank {rank} with {type(e).__name__}: {exception_message(e)} "
                        "(traceback above and in errors.jsonl)") from e
    finally:
        distributed.compute_cleanup()


def _run(cfg: EyasConfig, rank: int, world_size: int, device: torch.device) -> dict[str, Any]:
    setup = preflight(cfg, device, world_size, rank)
    distributed.barrier()  # every rank has read the journals before anyone writes
    if not setup.remaining and (setup.out / "meta.json").is_file():
        meta = artifacts.read_meta(setup.out, "extract")
        _log(rank, f"{setup.out} is already complete ({meta['counts']['samples']:,} samples); nothing to do")
        return meta
    (setup.out / store.PROGRESS_DIR).mkdir(parents=True, exist_ok=True)
    prepare_resume(setup, rank, world_size)
    distributed.barrier()
    backend = make_backend(cfg, setup, device) if setup.remaining else None
    try:
        summary = extract_rank(cfg, setup, backend, rank, world_size)
    finally:
        if backend is not None and cfg.extract.backend == "vllm":
            backend.close()  # the engine's worker processes
    artifacts.atomic_write_json(setup.out / store.PROGRESS_DIR / f"r{rank:03d}.summary.json", summary)
    distributed.barrier()
    if rank != 0:
        return {"counts": {"failed": summary["failed"]}}
    summaries = [json.loads((setup.out / store.PROGRESS_DIR / f"r{r:03d}.summary.json").read_text())
                 for r in range(world_size)]
    meta = finalize(cfg, setup, summaries)
    print_summary(setup.out, meta)
    return meta


def main(cfg: EyasConfig) -> int:
    meta = run(cfg)
    failed = meta["counts"]["failed"]
    if failed and not cfg.extract.allow_failures:
        print(f"eyas extract: {len(failed)} sample(s) failed and were skipped (listed above and in errors.jsonl); "
              "exit status 1 (pass --extract.allow_failures=true to accept them)", file=sys.stderr)
        return 1
    return 0
