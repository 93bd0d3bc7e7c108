"""eyas run RECIPE.yaml: every stage in order, in one run directory, skipping what is up to date.

    eyas run recipes/demo-cpu.yaml
    eyas run recipes/smollm2-sharegpt.yaml --train.epochs=3     # re-runs train, export, evaluate
    torchrun --nproc-per-node 8 -m eyas run RECIPE.yaml          # extract and train on 8 GPUs

Stages: regenerate (only with `regenerate.enabled`; prepare then reads its conversations) ->
prepare -> extract (not with `train.mode=online`: the target then runs inside training, and no
hidden states are written) -> train -> export -> evaluate. Each stage has a *run key*: the hash of the config
sections that define its output and of the key of the stage before it. A stage whose `meta.json`
carries the same key is skipped (a line says so); a changed key re-runs that stage, and since the
keys chain, every stage after it. A stage that stopped early at its time budget (regenerate,
train: `max_seconds`, which is not part of the key) continues where it stopped when the run is
repeated, unless `accept_partial` names it (its output is then used as it is); a stage that ran
makes every stage after it run again on the new output (each meta.json records the hash of the
meta.json of the output it was made from, so this holds across runs). RUN_DIR holds one
subdirectory per stage, `run.log` (everything printed) and `summary.json` (per-stage wall time and
throughput, tau_chain, tau_tree, tau_chain_simulated, tau_tree_simulated,
acceptance_per_position, lossless, speedup).

Under torchrun (`torchrun --nproc-per-node N -m eyas run RECIPE.yaml`) rank 0 runs the run: its
plan, skips, run keys, log and summary, and the stages of one process (regenerate, prepare,
export, evaluate) on its own device while the other ranks wait; extract and train run on every
rank, data parallel, exactly as `torchrun ... -m eyas extract` / `eyas train` would (one
process group for the whole run; rank 0 tells the others which stage to run, with its config).

Here the run itself (`_run`, `_stages`); beside it plan.py (stages, configs, run keys, the state of
an output), repair.py (damaged outputs made again), ranks.py (torchrun's ranks, stages run apart
in vLLM), preflight.py (checks before the first stage), summary.py (run.log, summary.json); which
directories a stage may replace: eyas.claims.
"""

from __future__ import annotations

import copy
import json
import os
import time
from pathlib import Path
from typing import Any

from eyas import artifacts, claims
from eyas.claims import INPUTS_CHANGED, claim_stage_dir
from eyas.config import RESUMABLE, EyasConfig
from eyas.errors import ConfigError, EyasError, raise_if_terminated
from eyas.run.plan import is_partial, partial_progress, run_keys, source_fingerprint, stage_plan, stage_state
from eyas.run.preflight import check_inputs_outside, check_train_start, preflight
from eyas.run.ranks import APART, RanThrough, main_ranks, run_stage
from eyas.run.repair import RESUMED_REPAIR, move_aside, output_damage, same_output
from eyas.run.summary import RECORDED, evaluation, plot_training, print_summary, record_failure, teed, throughput


def main(cfg: EyasConfig) -> dict[str, Any]:
    from eyas import distributed

    if distributed.is_ddp():
        return main_ranks(cfg, _main)
    return _main(cfg, run_stage)


def _main(cfg: EyasConfig, runner, banner: str = "") -> dict[str, Any]:
    run_dir = Path(cfg.run_dir)
    from eyas import vllm_engine

    with teed(run_dir / "run.log"), vllm_engine.chained_stages(), claims.dir_locks([], "run"):  # stage dirs: _run
        if banner:
            print(banner, flush=True)
        return _run(cfg, run_dir, runner)


def _run(cfg: EyasConfig, run_dir: Path, runner) -> dict[str, Any]:
    configs, stages = stage_plan(cfg)
    if cfg.stop_after and cfg.stop_after not in stages:
        raise ConfigError(f"--stop_after={cfg.stop_after}: this run has no {cfg.stop_after} stage (its stages: "
                          f"{', '.join(stages)}; regenerate needs regenerate.enabled, extract train.mode=offline)")
    keys = run_keys(configs, stages)
    cfg = configs[stages[-1]]
    claims.check_run(cfg, stages, keys)  # overlapping stage directories, another run's or a foreign one
    check_inputs_outside(cfg, stages)  # an input inside a stage directory this run replaces
    preflight(cfg, stages[: stages.index(cfg.stop_after) + 1] if cfg.stop_after else stages)
    print(f"[eyas:run] {run_dir}: stages {' -> '.join(stages)}", flush=True)
    (run_dir / "summary.json").unlink(missing_ok=True)  # an earlier run's: this run writes its own at the end or on failure
    record: dict[str, Any] = {"run_dir": str(run_dir), "stages": {}}
    # the hash of the previous stage's meta.json as this run leaves it; the first stage's input is
    # the data file itself, so an edited file (same path) re-runs it
    upstream = source_fingerprint(configs[stages[0]].prepare.data)
    current: list[Any] = [stages[0], time.perf_counter(), time.time()]  # the stage in hand, for an interruption
    try:
        return _stages(cfg, run_dir, runner, configs, stages, keys, upstream, record, current)
    except BaseException as e:  # Ctrl-C or SIGTERM between a stage's own steps (its meta, the plots): said too
        if not getattr(e, RECORDED, False):
            stage = current[0]
            record_failure(cfg, run_dir, record, stage, cfg.stage_dir(stage), e, time.perf_counter() - current[1],
                           current[2])
        raise


def _stages(cfg: EyasConfig, run_dir: Path, runner, configs: dict[str, EyasConfig], stages: list[str],
            keys: dict[str, str], upstream: str, record: dict[str, Any], current: list[Any]) -> dict[str, Any]:
    from eyas import vllm_engine

    changed = False  # a stage ran in this invocation: every later stage's output is out of date
    ran_apart: set[str] = set()  # stages a child `eyas run` ran (RanThrough), checked as outputs here
    for s in stages:
        raise_if_terminated()
        current[:] = [s, time.perf_counter(), time.time()]
        out = cfg.stage_dir(s)
        state, meta = ("stale", {}) if changed else stage_state(out, s, keys[s], upstream)
        damage, damaged = output_damage(s, out, meta) if state in ("done", "partial") else ("", [])
        repair = None  # (meta.json and index.json as they were) while a damaged output is made again
        if damage:
            print(f"[eyas:run] {s}: {damage}: making {'those' if s in RESUMED_REPAIR else 'it'} again", flush=True)
            repair = {"meta.json": (out / "meta.json").read_bytes()}
            move_aside(s, out, damaged)
            if s in RESUMED_REPAIR:  # resumed, it completes again (extract: the missing shards, then its index)
                (out / "meta.json").unlink()
            state = "damaged"
        if state == "partial" and s in RESUMABLE and s not in cfg.accept_partial_stages():
            print(f"[eyas:run] {s}: partial ({partial_progress(s, meta)}, stopped at its time budget): continuing; "
                  f"--accept_partial={s} uses it as it is", flush=True)
        elif state == "done" and s == "extract" and (meta.get("counts") or {}).get("failed") \
                and not configs[s].extract.allow_failures:
            print(f"[eyas:run] extract: {len(meta['counts']['failed'])} sample(s) failed last time: retrying them; "
                  "--extract.allow_failures=true goes on without them", flush=True)
        elif state in ("done", "partial"):
            if state == "partial":
                print(f"[eyas:run] {s}: partial output accepted ({partial_progress(s, meta)})", flush=True)
            if s not in ran_apart:
                print(f"[eyas:run] {s}: up to date in {out}, skipped", flush=True)
            record["stages"][s] = {"status": "ran" if s in ran_apart else "skipped", "dir": str(out),
                                   **throughput(s, meta), "wall_s": meta.get("run_wall_s"), "partial": is_partial(meta)}
            upstream = artifacts.hash_json(meta)
            if s == cfg.stop_after:
                return record
            continue
        if s == "extract":
            check_train_start(cfg, configs, stages, run_dir, record)
        edited = s == stages[0] and state == "inputs"  # the data file, not an earlier stage
        resuming = claim_stage_dir(s, out, keys[s], fresh=changed or state == "inputs" or (repair is not None and s not in RESUMED_REPAIR),
                                   why_fresh="its output is damaged" if repair is not None else (
            f"its inputs changed: {configs[s].prepare.data} is not the file it was made from" if edited
            else INPUTS_CHANGED), run_dir=run_dir)
        changed = True
        print(f"[eyas:run] {s}: {'resuming' if resuming else 'running'} -> {out}", flush=True)
        stage_cfg = configs[s]
        if s == "train" and resuming and not stage_cfg.train.resume:
            stage_cfg = copy.deepcopy(stage_cfg)
            stage_cfg.train.resume = "auto"
        if s not in ("prepare", "extract"):  # an engine regenerate left for extract frees the GPUs first
            vllm_engine.release()
        t0, started = time.perf_counter(), time.time()
        try:
            rc = runner(s, stage_cfg)
        except BaseException as e:  # Ctrl-C too: the summary says where the run stopped
            record_failure(cfg, run_dir, record, s, out, e, time.perf_counter() - t0, started)
            raise
        wall = time.perf_counter() - t0
        meta = artifacts.read_meta(out, s)  # a stage that wrote no complete meta.json is an error
        if isinstance(rc, RanThrough):  # `eyas run` in a child recorded this stage and the next ones
            upstream = artifacts.hash_json(meta)
            record["stages"][s] = {"status": "ran", "dir": str(out), "wall_s": meta.get("run_wall_s"),
                                   **throughput(s, meta), "partial": is_partial(meta)}
            ran_apart.update(stages[stages.index(s) + 1 : stages.index(rc.stage) + 1])
            changed = False  # checked below like any earlier output: done, unless the child's run was cut short
            continue
        meta["run_key"] = keys[s]
        meta["upstream"] = upstream
        meta["run_wall_s"] = round(wall, 2)
        artifacts.atomic_write_json(out / "meta.json", meta)
        if isinstance(rc, int) and rc != 0:  # complete, but it skipped what it was not allowed to (extract)
            e = EyasError(f"{s} exited with status {rc} (its reasons are printed above); the stages after it do not run")
            record_failure(cfg, run_dir, record, s, out, e, wall, started)
            raise e
        if repair and same_output(s, json.loads(repair["meta.json"]), meta):  # the stages after it stand
            for name, data in repair.items():
                artifacts.atomic_write_bytes(out / name, data)
            meta = json.loads(repair["meta.json"])
            changed = False
            print(f"[eyas:run] {s}: made again bit for bit as it was (every {'shard' if s == 'extract' else 'file'}'s "
                  "sha256 as recorded): the stages after it keep their outputs", flush=True)
        upstream = artifacts.hash_json(meta)
        record["stages"][s] = {"status": "ran", "dir": str(out), "wall_s": round(wall, 2), **throughput(s, meta),
                               "partial": is_partial(meta)}
        if is_partial(meta) and s != cfg.stop_after and s != stages[-1]:
            print(f"[eyas:run] {s}: stopped at its time budget ({partial_progress(s, meta)}); the stages after it "
                  f"run on this partial output, and the next run continues {s} (unless --accept_partial={s})", flush=True)
        if s == "train":
            plot_training(cfg)
        if s == cfg.stop_after and s != stages[-1]:
            print(f"[eyas:run] {s}: done in this process apart; the run goes on in the ranks' `eyas run`"
                  if os.environ.get(APART) == s else
                  f"[eyas:run] stop_after={s}: stopping here; run the same command without it to continue", flush=True)
            return record
    raise_if_terminated()
    record.update(evaluation(cfg.stage_dir("evaluate")) if "evaluate" in stages else {})
    artifacts.atomic_write_json(run_dir / "summary.json", record)
    print_summary(record)
    if cfg.note:
        print(f"[eyas:run] note: {cfg.note}", flush=True)
    return record
