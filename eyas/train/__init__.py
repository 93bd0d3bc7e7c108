"""train: the EAGLE-3 draft and its training-time-test trainer, offline or online, 1..N GPUs.

    eyas train recipe.yaml                                   # one process (world size 1)
    torchrun --nproc-per-node 8 -m eyas.cli train recipe.yaml --train.parallel=fsdp
    eyas train recipe.yaml --resume auto                     # continue from the latest checkpoint

Offline (default) reads the extract stage's shards (RUN_DIR/extract) and the draft vocabulary of
the prepare stage; `--train.mode=online` runs the target in the same job on every batch
(`--train.target_device=cuda:1` keeps it on its own GPU) and needs only the prepare stage.

Output (RUN_DIR/train):
    metrics.jsonl               one record per log / eval: loss and accuracy per TTT step, tau,
                                lr, grad norm, tokens/s  (`eyas plot RUN_DIR/train` draws them)
    checkpoints/step_XXXXXXX/   atomic; draft + optimizer, scheduler, data position, RNG states
    final/                      draft.safetensors + draft_config.json (eyas.draft_files.open_draft)
    meta.json, config.yaml      written last: the run is complete

Modules: loss (teacher, loss, metrics), data (batches), loop (train step, evaluation, logging),
checkpoint, parallel (DDP / FSDP2), build (wiring), init_from (train.init_from), target_weights
(embedding + LM head without loading the target); the TTT unroll itself is eyas.ttt.
"""

from __future__ import annotations

import time
from typing import Any

from eyas.config import EyasConfig
from eyas.errors import EyasError


def main(cfg: EyasConfig) -> dict[str, Any]:
    return run(cfg)


def run(cfg: EyasConfig, data=None) -> dict[str, Any]:
    """Train per `cfg`. `data` (a build.TrainData) replaces reading prepare/extract from disk."""
    from eyas.distributed import barrier, compute_cleanup, compute_init

    _, rank, _, world_size, device = compute_init()
    try:
        out = _run(cfg, data, rank, world_size, device)
        barrier()  # the other ranks return while rank 0 writes the draft: tear the group down together
        return out
    finally:
        compute_cleanup()


def _run(cfg: EyasConfig, data, rank: int, world_size: int, device) -> dict[str, Any]:
    import torch

    from eyas.artifacts import atomic_write_text, file_record, write_meta
    from eyas.config import dump_config, to_dict
    from eyas.distributed import barrier
    from eyas.errors import ConfigError
    from eyas.target import describe_target
    from eyas.train import build, checkpoint, init_from, resume as resuming
    from eyas.ttt import flex_row_length
    from eyas.train.data import batch_loader, epoch_batches
    from eyas.train.loop import Schedule, fit, record_failure

    tc = cfg.train
    t_start = time.perf_counter()
    out, ckpt_root = build.stage_dirs(cfg)
    resume = checkpoint.resolve_resume(tc.resume, ckpt_root)
    if not tc.resume and ((out / "meta.json").exists() or checkpoint.checkpoints(ckpt_root)):
        raise ConfigError(f"{out} already holds a training run: pass --train.resume=auto to continue it, or a new --train.out_dir")
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out / "config.yaml", dump_config(cfg))
    barrier()
    stepping = False
    stream = None  # train.mode=stream: the engines and the store (eyas.stream.Session)
    late_s = time.time() - tc.stop_by
    if rank == 0 and tc.stop_by and late_s > 0:
        print(f"[eyas:train] warning: train.stop_by={tc.stop_by:.0f} passed {late_s:.0f} s ago: "
              "training stops at its first logging step", flush=True)
    try:
        if tc.init_from and resume is None:
            init_from.init_files(tc.init_from)
            if data is None:  # data given in memory has no prepare directory: build_trainer checks it then
                init_from.check_init_vocab(tc, cfg.stage_dir("prepare"))
        if data is None:
            data = build.load_data(cfg, device)
        build.verify_shards(data.source, rank, world_size, device)
        train_idx, eval_idx = build.splits(cfg, data, rank)
        sched = Schedule(tc, train_idx, data.lengths, cfg.seed, rank, world_size)
        identity = resuming.data_identity(data.source, data.d2t, data.t2d)
        if resume is not None:  # before the checkpoint's state is read, or a draft of this shape built
            checkpoint.check_checkpoint(resume, ("draft_config.json", resuming.IDENTITY))  # the rest: on load
            resuming.check_resume(resume, identity, build.draft_config(cfg, data).to_dict())
        if tc.mode == "stream" and data.states is None:
            from eyas.stream import open_stream

            stream = open_stream(cfg, data, rank, world_size, out)
            data.states = stream.states
        tr, dcfg = build.build_trainer(cfg, data, device, rank, world_size, sched.total, init=resume is None)
        tr.identity = identity
        pad = tc.pad_multiple or (flex_row_length(tc.max_tokens) if tr.attention == "flex" else 0)
        workers = tc.num_workers if tc.num_workers >= 0 else (2 if device.type == "cuda" else 0)
        eval_plans = epoch_batches(eval_idx, data.lengths, tc.max_tokens, cfg.seed, 0, rank, world_size, shuffle=False)
        if tc.eval_max_batches:
            eval_plans = eval_plans[: tc.eval_max_batches]
        eval_fn = (lambda: batch_loader(data.source, eval_plans, tc.ttt_steps, tc.max_tokens, pad, workers,
                                        device.type == "cuda", tc.loader_timeout_s)) if eval_plans else None
        if eval_fn is not None and stream is not None:  # the engines are asked for the held-out samples too
            eval_fn = stream.states.evaluating(eval_fn, eval_plans)
        if rank == 0:
            print(f"[eyas:train] {tc.mode}: {len(train_idx)} train / {len(eval_idx)} eval samples, {sched.total} steps, "
                  f"draft {tr.draft.num_trainable_parameters():,} parameters, {tr.attention} attention, "
                  f"world size {world_size}" + (f", resuming from {resume}" if resume else ""), flush=True)
        stepping = True  # an allocation that fails from here on: the micro-batch's size (train.max_tokens) is the knob
        metrics = fit(tr, sched, data.source, eval_fn, out, dcfg, resume, pad, workers)
        if stream is not None and not metrics["stopped_early"]:  # the whole schedule: every dealt sample trained
            stream.states.finish()
        if stream is not None:  # every rank's ledger and waits (a collective)
            from eyas.distributed import gather_objects
            from eyas.stream.source import combine_summaries

            metrics["stream"] = combine_summaries(gather_objects(stream.states.summary()))
            if stream.proxy is not None:  # rank 0's: vLLM checked on a proxy before the engines loaded
                metrics["stream"]["vllm_proxy_parity"] = stream.proxy
        if tr.init_from:
            data.inputs["init_from"] = tr.init_from
        final = out / "final"
        state = checkpoint.model_state(tr.model)
        if rank != 0:
            return metrics
        checkpoint.write_draft(state, dcfg, final)
        meta = dict(
            config=to_dict(cfg), target=describe_target(cfg.target), inputs=data.inputs, draft=dcfg.to_dict(),
            counts={"train_samples": len(train_idx), "eval_samples": len(eval_idx), "steps": metrics["steps_done"],
                    "planned_steps": sched.total, "stopped_early": metrics["stopped_early"],
                    "resumed_from_step": metrics["resumed_from_step"],
                    "world_size": world_size, "trainable_parameters": tr.draft.num_trainable_parameters()},
            changes=metrics["changes"],  # settings changed on resumes, from the step each applies (train.resume)
            metrics={
                "acc_T": metrics["train"].get("acc_T"), "tau": metrics["train"].get("tau"),
                "loss_T": metrics["train"].get("loss_T"), "tokens_per_s": metrics["tokens_per_s"],
                "tokens_per_s_after_first_window": metrics["tokens_per_s_after_first_window"],
                "tokens_per_s_last_window": metrics["train"].get("tokens_per_s"),
                "all_runs": metrics["all_runs"],  # this run and the runs it resumed, when it resumed
                "eval": metrics["eval"] or None,
                **({"stream": metrics["stream"]} if "stream" in metrics else {}),
            },
            time_s=round(time.perf_counter() - t_start, 2),
            device=str(device), torch_cuda=torch.version.cuda,
        )
        write_meta(final, "train", **meta)
        return write_meta(out, "train", **meta, files=file_record(out, [f"final/{f.name}" for f in sorted(final.iterdir())
                                                                        if f.name != "meta.json"]))
    except Exception as e:  # recorded (type, message, traceback; the step and samples) in errors.jsonl, re-raised
        record_failure(out, e, rank, **getattr(e, "eyas_context", {}))
        if out_of_memory(e) and stepping:
            raise EyasError(f"train ran out of memory in its steps ({out_of_memory(e)}): lower --train.max_tokens "
                            f"(now {tc.max_tokens}: the tokens of one micro-batch; --train.grad_accum keeps the tokens "
                            "of an optimizer step) and run again (--train.resume=auto continues from the last "
                            "checkpoint)") from e
        if out_of_memory(e):
            raise EyasError(f"train ran out of memory before its first step, loading its data or models "
                            f"({out_of_memory(e)}): free memory or run on a machine with more") from e
        raise
    finally:
        if stream is not None:
            stream.close()


def out_of_memory(e: BaseException) -> str:
    """The allocator's own words when `e` (or its cause) is an allocation that failed (Python's
    MemoryError, torch's CPU allocator, CUDA out of memory), else ""."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        text = str(e)
        if isinstance(e, MemoryError) or (isinstance(e, RuntimeError) and any(
                w in text for w in ("out of memory", "can't allocate memory", "Cannot allocate memory"))):
            return f"{type(e).__name__}: {text.strip().splitlines()[-1] if text.strip() else 'no message'}"[:300]
        e = e.__cause__ or e.__context__
    return ""
