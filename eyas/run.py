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
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import importlib
import importlib.util
import json
import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from eyas import artifacts, claims
from eyas.config import RESUMABLE, STAGES, EyasConfig, to_dict
from eyas.errors import (SECRETS, ArtifactError, ConfigError, DamagedArtifact, EyasError, describe_exception,
                         raise_if_terminated, redact, stopped_by)

# The config sections whose values define each stage's output (besides the stage before it).
SECTIONS = {
    "regenerate": ("target", "prepare", "regenerate"),
    "prepare": ("target", "prepare"),
    "extract": ("target", "extract"),
    "train": ("target", "train", "seed"),
    "export": ("export",),
    "evaluate": ("target", "evaluate", "seed"),
}


# Keys that bound how long one invocation works on a stage or how it runs, not what the stage
# produces: changing them neither invalidates an output nor re-runs a stage (so `--train.resume
# auto` or a new budget never deletes a partial training; `--extract.allow_failures=true` accepts
# an extraction's skipped samples without extracting again). evaluate.max_seconds stays in the key:
# evaluation does not resume, so a larger budget has to re-run it.
BUDGET_KEYS = {
    "regenerate": ("max_seconds", "stall_s", "timeout_s", "retries", "concurrency", "server_api_key_env",
                   "max_retry_wait_s", "max_refused_fraction"),
    "prepare": ("num_workers",),
    "extract": ("allow_failures", "progress", "spill_dirs", "min_free_gb"),  # where shards go, not what they hold
    "train": ("max_seconds", "stop_by", "resume", "num_workers", "loader_timeout_s", "collapse_steps", "tensorboard",
              "keep_checkpoints", "loss_kernel", "target_group_tokens"),
}
ALL_RANKS = ("extract", "train")  # under torchrun every rank runs these (extract with the HF backend); the rest rank 0
TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_NAME",
                 "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
"""What torchrun sets for its ranks; a stage rank 0 runs in vLLM gets none of it (run_alone)."""


INPUTS_OUTSIDE = (("train", "init_from"), ("evaluate", "target_outputs"))
"""Paths a stage reads that must not lie in that stage's own directory (`eyas run` checks first)."""


def stage_plan(cfg: EyasConfig) -> tuple[dict[str, EyasConfig], list[str]]:
    """The stages to run and the config each sees: with regenerate enabled, regenerate reads
    `prepare.data` and every later stage sees prepare reading regenerate's conversations; online
    training needs no extract stage."""
    stages = [s for s in STAGES if (s != "regenerate" or cfg.regenerate.enabled)
              and (s != "extract" or cfg.train.mode != "online")]
    later = copy.deepcopy(cfg)
    if cfg.regenerate.enabled:
        later.prepare.data = str(cfg.stage_dir("regenerate") / "conversations.jsonl")
        later.prepare.format = "openai"
    return {s: cfg if s == "regenerate" else later for s in stages}, stages


def run_keys(configs: dict[str, EyasConfig], stages: list[str]) -> dict[str, str]:
    keys, prev = {}, ""
    for s in stages:
        sections = {name: changed_fields(getattr(configs[s], name)) for name in SECTIONS[s]}
        if s == "regenerate":  # regenerate reads only the data fields of prepare
            p = sections["prepare"]
            sections["prepare"] = {k: p[k] for k in ("data", "format", "max_conversations", "system_prompt") if k in p}
        if s == "train" and "extract" not in stages:  # online: train captures the aux layers itself
            sections["extract"] = {"layer_ids": configs[s].extract.layer_ids}
        for name, budget in BUDGET_KEYS.items():
            if name in sections:
                sections[name] = {k: v for k, v in sections[name].items() if k not in budget}
        keys[s] = prev = f"{KEY_SCHEME}:" + artifacts.hash_json({"stage": s, "sections": sections, "previous": prev})
    return keys


def changed_fields(section) -> dict[str, Any]:
    """A config section's fields whose values differ from their defaults: what a run key hashes, so
    that a field a later eyas adds (at its default) leaves the keys of earlier runs alone."""
    values = to_dict(section)
    if not dataclasses.is_dataclass(section):  # a top-level value (seed, ...)
        return values
    out = {}
    for f in dataclasses.fields(section):
        if f.name not in values:
            continue
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            out[f.name] = values[f.name]
            continue
        if values[f.name] != to_dict(default):
            out[f.name] = values[f.name]
    return out


KEY_SCHEME = "v3"
"""Run keys name the scheme they were made by; a stage directory whose key is of another scheme
(an earlier eyas) is never removed as "made with other settings": it may hold a training."""
MARKER = claims.MARKER
INPUTS_CHANGED = "its inputs changed: an earlier stage ran again"


def claim_stage_dir(stage: str, out: Path, key: str, fresh: bool = False,
                    why_fresh: str = INPUTS_CHANGED, run_dir: Path | None = None) -> bool:
    """Make `out` ready for a run of `stage` with `key`; True when an interrupted or partial run
    with the same key is there to resume. A complete or partial output made by `eyas run` with
    other settings, or (`fresh`) from inputs that have changed since, is removed; a non-empty
    directory `eyas run` did not make, made with another KEY_SCHEME, or (given `run_dir`, the run
    claiming it) made by another run with other settings, is never touched (eyas.claims)."""
    claims.lock_also(out)  # held until the run ends (eyas.claims.dir_locks)
    if not claims.is_empty(out):
        marker = claims.read_marker(out)
        claims.refuse_foreign(stage, out, key if marker and marker["key"] == key and not fresh else "", run_dir)
        same = marker["key"] == key
        if same and not fresh:  # resumed when there is something to resume: a claim alone (by a parent
            return any(p.name not in (MARKER, claims.LOCK_FILE) for p in out.iterdir())  # `eyas run`) starts afresh
        why = why_fresh if same else "made with other settings"
        print(f"[eyas:run] {stage}: removing {out} ({why})", flush=True)
        claims.clear(out)
    out.mkdir(parents=True, exist_ok=True)
    artifacts.atomic_write_text(out / MARKER, claims.marker_text(key, run_dir, stage, out))
    return False


def source_fingerprint(data: str) -> str:
    """What the first stage reads: the data file's content (sha256; a `datasets` directory by its
    files' names and sizes), as prepare records it."""
    from eyas.prepare import data_hash

    if data != "embedded:sharegpt" and not Path(data).exists():
        raise ConfigError(f"prepare.data={data!r}: no such file or directory")
    return "data:" + data_hash(data)


def stage_state(stage_dir: Path, stage: str, key: str, upstream: str) -> tuple[str, dict[str, Any]]:
    """("done" | "partial" | "inputs" | "stale", meta): a complete output of this key made from the
    previous stage's current output (`upstream`: the hash of its meta.json; for the first stage the
    data file's `source_fingerprint`), one that stopped early at its time budget, one made from an
    earlier state of its input (continued or edited since), or anything else (missing, interrupted,
    other settings)."""
    try:
        meta = artifacts.read_meta(stage_dir, stage)
    except ArtifactError:
        return "stale", {}
    if meta.get("run_key") != key:
        return "stale", meta
    if meta.get("upstream") != upstream:
        return "inputs", meta
    return ("partial" if is_partial(meta) else "done"), meta


RESUMED_REPAIR = ("extract", "train")
"""Stages whose damaged output is made again by resuming (extract: the missing shards' samples;
train: its final draft from the last checkpoint); the others start afresh."""


def output_damage(stage: str, out: Path, meta: dict[str, Any]) -> tuple[str, list[Path]]:
    """What a finished stage's output has lost, in words, and the files to delete before it is made
    again ("" when whole): the files its meta.json records with their sha256 (prepare's outputs,
    regenerate's conversations, extract's index, train's final draft, the exports, evaluate's
    results), and extract's shards with their recorded sizes and sha256."""
    bad: list[tuple[Path, str]] = []
    for name, rec in (meta.get("files") or {}).items():
        try:
            artifacts.check_files(out, stage, {name: rec})
        except DamagedArtifact as e:
            bad.append((Path(e.path), str(e).split(";")[0].removeprefix(str(e.path)).strip()))
    if stage == "extract":
        bad += _damaged_shards(out, meta)
    if not bad:
        return "", []
    shown = ", ".join(f"{p.relative_to(out) if p.is_relative_to(out) else p} ({why})" for p, why in bad[:5])
    return f"{len(bad)} damaged file(s): {shown}" + (" ..." if len(bad) > 5 else ""), [p for p, _ in bad]


def _move_aside(stage: str, out: Path, damaged: list[Path]) -> None:
    """Keep the damaged files, out of the way of the stage made again: extract's renamed in place
    (`damaged-NAME`: a shard may be large, or on a spill disk; extract neither lists nor cleans such
    names), the others' moved to OUT.damaged/ beside the stage directory (which is replaced)."""
    moved = []
    for f in damaged:
        if not f.exists():
            continue
        dest = f.with_name("damaged-" + f.name) if stage == "extract" else out.parent / f"{out.name}.damaged" / f.relative_to(out)
        dest.parent.mkdir(parents=True, exist_ok=True)
        os.replace(f, dest)
        moved.append(dest)
    if moved:
        print(f"[eyas:run] {stage}: the damaged file(s) kept as {', '.join(map(str, moved[:3]))}"
              + (" ..." if len(moved) > 3 else "") + " (delete them when no longer needed)", flush=True)


def _damaged_shards(out: Path, meta: dict[str, Any]) -> list[tuple[Path, str]]:
    """Extract's shards that are missing, of another size or another sha256 (hashed in threads; for
    a few TB, minutes of the run's hours). When all are whole, train in this process skips its own
    check of them (hidden_states.VERIFIED)."""
    from concurrent.futures import ThreadPoolExecutor

    from eyas.assets import sha256_file
    from eyas.hidden_states import VERIFIED, verified_mark

    gone = sorted({(out / name).parent for name in meta.get("shards") or {} if not (out / name).parent.is_dir()})
    if gone:  # a spill disk not mounted: not damage to repair by extracting terabytes again
        raise ArtifactError(f"extract's shards in {', '.join(map(str, gone))} are gone with their directory (a spill "
                            "directory not mounted?): mount it and run again; or create the directory empty to have "
                            "eyas extract those shards again")

    def check(item) -> tuple[Path, str] | None:
        name, rec = item
        path = out / name  # an absolute (spilled) name stays itself
        size = path.stat().st_size if path.is_file() else None
        if size != rec["bytes"]:
            return path, "missing" if size is None else f"{size:,} of {rec['bytes']:,} bytes"
        return (path, "its sha256 differs from meta.json") if sha256_file(path) != rec["sha256"] else None

    shards = list((meta.get("shards") or {}).items())
    with ThreadPoolExecutor(min(8, os.cpu_count() or 1)) as pool:
        bad = [b for b in pool.map(check, shards) if b]
    if not bad and shards:
        os.environ[VERIFIED] = verified_mark(out, meta)
    return bad


def same_output(stage: str, old: dict[str, Any], new: dict[str, Any]) -> bool:
    """Whether a stage made again wrote what it had written before (so what follows it stands)."""
    return bool(old.get("files")) and old.get("files") == new.get("files") and old.get("shards") == new.get("shards")


def is_partial(meta: dict[str, Any]) -> bool:
    return bool((meta.get("counts") or {}).get("stopped_early"))


def partial_progress(stage: str, meta: dict[str, Any]) -> str:
    c = meta.get("counts") or {}
    if stage == "regenerate":
        return f"{c.get('conversations_written')} of {(c.get('conversations_in') or 0) + (c.get('self_written') or 0)} conversations"
    if stage == "train":
        return f"{c.get('steps')} of {c.get('planned_steps')} steps"
    return "stopped early"


class Tee:
    """Copy everything written to a stream into the run log too."""

    def __init__(self, stream, log):
        self.stream, self.log = stream, log

    def write(self, text):
        shown = redact(text) if SECRETS else text  # a configured secret reaches neither the console nor run.log
        self.stream.write(shown)
        self.log.write(shown)
        return len(text)

    def flush(self):
        self.stream.flush()
        self.log.flush()

    def __getattr__(self, name):
        return getattr(self.stream, name)


def run_stage(stage: str, stage_cfg: EyasConfig) -> Any:
    return importlib.import_module(f"eyas.{stage}").main(stage_cfg)


def on_every_rank(stage: str, stage_cfg: EyasConfig) -> bool:
    """Under torchrun: train, and extract with the HF backend, run on every rank (data parallel)."""
    return stage == "train" or (stage == "extract" and stage_cfg.extract.backend == "hf")


def in_vllm(stage: str, stage_cfg: EyasConfig) -> bool:
    """A stage vLLM runs (regenerate, extract or evaluate with backend vllm): one process that spreads
    the target over the GPUs itself."""
    return getattr(stage_cfg, stage, None) is not None and getattr(getattr(stage_cfg, stage), "backend", "") == "vllm" \
        and stage in ("regenerate", "extract", "evaluate")


def one_engine(stage: str, stage_cfg: EyasConfig) -> bool:
    """regenerate and extract both in vLLM, extract in this run: one process runs regenerate, prepare
    and extract, so that the target loads once (regenerate leaves its engine to extract)."""
    return stage == "regenerate" and stage_cfg.regenerate.backend == "vllm" and stage_cfg.extract.backend == "vllm" \
        and stage_cfg.train.mode == "offline" and stage_cfg.stop_after not in ("regenerate", "prepare")


# `python -m eyas` that first asks Linux for SIGTERM when its parent dies (prctl PR_SET_PDEATHSIG = 1),
# so that a rank killed by torchrun or a scheduler leaves no vLLM engine holding the GPUs; it stops at
# once when the parent is already gone. (In the child itself: Popen's preexec_fn is unsafe in a
# process with threads.)
DIE_WITH_PARENT = (
    "import ctypes, os, signal, sys\n"
    "if sys.platform.startswith('linux'):\n"
    "    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)\n"
    "    if os.getppid() != int(sys.argv[1]): sys.exit(143)\n"
)
CHILD_MAIN = DIE_WITH_PARENT + "from eyas.cli import main\nsys.exit(main(sys.argv[2:]))\n"


def _stop(child: subprocess.Popen, grace_s: float = 30.0) -> None:
    """SIGTERM, then SIGKILL after `grace_s`: a vLLM engine gets the time to free its workers."""
    if child.poll() is None:
        child.terminate()
        try:
            child.wait(grace_s)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


def run_alone(stage: str, stage_cfg: EyasConfig, through: str = "") -> int | RanThrough:
    """`python -m eyas STAGE` with this stage's config, in a child process without torchrun's
    environment: under torchrun rank 0 runs a vLLM stage this way, so that vLLM's own workers see no
    trace of the ranks' process group and every GPU byte the engine took is freed when it exits,
    before the ranks train. Its output comes through this process (run.log keeps it).

    With `through` (a later stage), the child is `eyas run` from this stage to that one (with
    stage_cfg the run's own config), e.g. regenerate, prepare and extract on one vLLM engine; it
    writes run.log itself. -> RanThrough(through) when it succeeded."""
    from eyas.config import dump_config

    command = "run" if through else stage
    config = stage_cfg.stage_dir(stage).parent / f".{stage}-alone.yaml"
    config.parent.mkdir(parents=True, exist_ok=True)
    if through:
        stage_cfg = copy.deepcopy(stage_cfg)
        stage_cfg.stop_after = through
    artifacts.atomic_write_text(config, dump_config(stage_cfg, secrets=True))  # read by the child, then deleted
    config.chmod(0o600)
    env = apart_env(through)
    what = f"{stage} to {through}" if through else stage
    print(f"[eyas:run] {what}: in vLLM, one process apart from the ranks: {sys.executable} -m eyas {command} {config}",
          flush=True)
    out = sys.__stdout__ if through else sys.stdout  # `eyas run` in the child writes run.log itself
    try:
        with subprocess.Popen([sys.executable, "-c", CHILD_MAIN, str(os.getpid()), command, str(config)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True, bufsize=1) as child:
            try:
                for line in child.stdout:
                    out.write(line)
                out.flush()
                rc = child.wait()
            except BaseException:  # Ctrl-C or an error here: the engine must not outlive this rank
                _stop(child)
                raise
    finally:
        config.unlink(missing_ok=True)
    if through and rc != 0:  # `eyas run` in the child wrote summary.json, naming the stage that failed
        raise ApartRunFailed(f"{what} in vLLM stopped with exit status {rc} (its error is printed above; the stage "
                             f"that failed: {stage_cfg.run_dir}/summary.json)")
    # extract's 1: complete, but it skipped samples (judged like the stage's own return); any other stage's: a crash
    if rc != 0 and not (rc == 1 and stage == "extract"):
        raise EyasError(f"{what} in vLLM stopped with exit status {rc} (its error is printed above)")
    return RanThrough(through) if through else rc


APART = "EYAS_RUN_THROUGH"
"""Set for the child `eyas run` that runs stages apart up to a stage (run_alone's `through`): its
stop_after is the parent's doing, and the run goes on there."""


def apart_env(through: str = "") -> dict[str, str]:
    """The environment of a stage run apart: this one without torchrun's variables (and with APART
    naming the last stage when the child is `eyas run` up to it)."""
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARS and not k.startswith("TORCHELASTIC_")}
    if through:
        env[APART] = through
    return env


class ApartRunFailed(EyasError):
    """`eyas run` in a child process failed; its own summary.json says where and stays as it wrote it."""


@dataclasses.dataclass(frozen=True)
class RanThrough:
    """A runner's answer: this stage and the ones after it up to `stage` ran (in one child process,
    which recorded them); `_run` checks those like any earlier output."""

    stage: str


def main(cfg: EyasConfig) -> dict[str, Any]:
    from eyas import distributed

    if distributed.is_ddp():
        return _main_ranks(cfg)
    return _main(cfg, run_stage)


@contextlib.contextmanager
def teed(path: Path):
    """Everything printed to stdout and stderr inside also goes to `path` (appended)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with artifacts.open_no_follow(path, "a", "give another --run_dir") as log:
        out, err = sys.stdout, sys.stderr
        sys.stdout, sys.stderr = Tee(out, log), Tee(err, log)
        try:
            yield
        finally:
            sys.stdout, sys.stderr = out, err


def _main(cfg: EyasConfig, runner, banner: str = "") -> dict[str, Any]:
    run_dir = Path(cfg.run_dir)
    from eyas import vllm_engine

    with teed(run_dir / "run.log"), vllm_engine.chained_stages(), claims.dir_locks([], "run"):  # stage dirs: _run
        if banner:
            print(banner, flush=True)
        return _run(cfg, run_dir, runner)


STOP, FAILED = "stop", "failed"  # rank 0's last word to the other ranks: the run ended, or stopped with an error
CONTROL_TIMEOUT = timedelta(days=7)  # a waiting rank waits through rank 0's regenerate and evaluate, however long


def _main_ranks(cfg: EyasConfig) -> dict[str, Any]:
    """`eyas run` under torchrun: rank 0 runs `_main`; each stage of ALL_RANKS it reaches it first
    sends (stage, config) to the other ranks, which run that stage with it and wait for the next.
    The messages go over a gloo group beside the stages' own (NCCL on GPUs), so a waiting rank
    holds no GPU collective while rank 0 prepares or evaluates. A rank that fails exits non-zero
    and torchrun stops the others; rank 0 stopping with an error between those stages tells the
    others (they exit non-zero too, saying so). Rank r > 0 writes what it prints to RUN_DIR/run.rank{r}.log."""
    from eyas import distributed

    _, rank, _, world_size, _ = distributed.compute_init()
    try:
        distributed.hold_group()
        control = distributed.host_group(CONTROL_TIMEOUT)

        def send(msg) -> None:
            distributed.broadcast_object(msg, control)

        if rank != 0:
            return _follow(cfg, rank, control)
        inside = False  # rank 0 is in a stage every rank runs: a failure there reaches the others through torchrun

        def runner(stage: str, stage_cfg: EyasConfig) -> Any:
            nonlocal inside
            if one_engine(stage, stage_cfg):  # regenerate, prepare and extract on one vLLM engine
                return run_alone(stage, cfg, through="extract")
            if in_vllm(stage, stage_cfg):
                return run_alone(stage, stage_cfg)
            if not on_every_rank(stage, stage_cfg):
                return run_stage(stage, stage_cfg)
            send((stage, stage_cfg))
            inside = True
            rc = run_stage(stage, stage_cfg)
            inside = False
            return rc

        banner = (f"[eyas:run] torchrun: {world_size} ranks; {' and '.join(ALL_RANKS)} on every rank (extract in vLLM: "
                  f"rank 0 alone), the other stages on rank 0")
        try:
            record = _main(cfg, runner, banner)
        except BaseException:
            if not inside:
                try:
                    send(FAILED)
                except Exception as e:  # the run's own error is the one raised; this one is said, not hidden
                    d = describe_exception(e)
                    print(f"[eyas:run] rank 0 could not tell the other ranks that the run stopped: {d['type']}: "
                          f"{d['message']}\n{d['traceback']}", file=sys.stderr, flush=True)
            raise
        send(STOP)
        return record
    finally:
        distributed.release_group()


def _follow(cfg: EyasConfig, rank: int, control) -> dict[str, Any]:
    """Rank r > 0 under torchrun: run the stages rank 0 sends until it says the run ended."""
    from eyas import distributed

    run_dir = Path(cfg.run_dir)
    with teed(run_dir / f"run.rank{rank}.log"):
        while True:
            msg = distributed.broadcast_object(None, control)
            if msg == STOP:
                return {}
            if msg == FAILED:
                raise EyasError(f"rank {rank}: rank 0's run stopped with an error after the last stage the ranks "
                                f"ran together (its error is in rank 0's output and in {run_dir / 'run.log'})")
            stage, stage_cfg = msg
            print(f"[eyas:run] rank {rank}: {stage}", flush=True)
            run_stage(stage, stage_cfg)


def _run(cfg: EyasConfig, run_dir: Path, runner) -> dict[str, Any]:
    configs, stages = stage_plan(cfg)
    if cfg.stop_after and cfg.stop_after not in stages:
        raise ConfigError(f"--stop_after={cfg.stop_after}: this run has no {cfg.stop_after} stage (its stages: "
                          f"{', '.join(stages)}; regenerate needs regenerate.enabled, extract train.mode=offline)")
    keys = run_keys(configs, stages)
    cfg = configs[stages[-1]]
    claims.check_run(cfg, stages, keys)  # overlapping stage directories, another run's or a foreign one
    for stage, key in INPUTS_OUTSIDE:  # a stage that runs replaces its directory, and an input there with it
        given = getattr(getattr(cfg, stage), key)
        if stage in stages and given and Path(given).resolve().is_relative_to(cfg.stage_dir(stage).resolve()):
            raise ConfigError(f"--{stage}.{key}={given} lies inside this run's {stage} directory "
                              f"{cfg.stage_dir(stage).resolve()}, which the {stage} stage replaces when it runs: copy "
                              f"it elsewhere first, or give a new --run_dir")
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
            _record_failure(cfg, run_dir, record, stage, cfg.stage_dir(stage), e, time.perf_counter() - current[1],
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
            _move_aside(s, out, damaged)
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
                                   **_throughput(s, meta), "wall_s": meta.get("run_wall_s"), "partial": is_partial(meta)}
            upstream = artifacts.hash_json(meta)
            if s == cfg.stop_after:
                return record
            continue
        if s == "extract":
            _check_train_start(cfg, configs, stages, run_dir, record)
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
            _record_failure(cfg, run_dir, record, s, out, e, time.perf_counter() - t0, started)
            raise
        wall = time.perf_counter() - t0
        meta = artifacts.read_meta(out, s)  # a stage that wrote no complete meta.json is an error
        if isinstance(rc, RanThrough):  # `eyas run` in a child recorded this stage and the next ones
            upstream = artifacts.hash_json(meta)
            record["stages"][s] = {"status": "ran", "dir": str(out), "wall_s": meta.get("run_wall_s"),
                                   **_throughput(s, meta), "partial": is_partial(meta)}
            ran_apart.update(stages[stages.index(s) + 1 : stages.index(rc.stage) + 1])
            changed = False  # checked below like any earlier output: done, unless the child's run was cut short
            continue
        meta["run_key"] = keys[s]
        meta["upstream"] = upstream
        meta["run_wall_s"] = round(wall, 2)
        artifacts.atomic_write_json(out / "meta.json", meta)
        if isinstance(rc, int) and rc != 0:  # complete, but it skipped what it was not allowed to (extract)
            e = EyasError(f"{s} exited with status {rc} (its reasons are printed above); the stages after it do not run")
            _record_failure(cfg, run_dir, record, s, out, e, wall, started)
            raise e
        if repair and same_output(s, json.loads(repair["meta.json"]), meta):  # the stages after it stand
            for name, data in repair.items():
                artifacts.atomic_write_bytes(out / name, data)
            meta = json.loads(repair["meta.json"])
            changed = False
            print(f"[eyas:run] {s}: made again bit for bit as it was (every {'shard' if s == 'extract' else 'file'}'s "
                  "sha256 as recorded): the stages after it keep their outputs", flush=True)
        upstream = artifacts.hash_json(meta)
        record["stages"][s] = {"status": "ran", "dir": str(out), "wall_s": round(wall, 2), **_throughput(s, meta),
                               "partial": is_partial(meta)}
        if is_partial(meta) and s != cfg.stop_after and s != stages[-1]:
            print(f"[eyas:run] {s}: stopped at its time budget ({partial_progress(s, meta)}); the stages after it "
                  f"run on this partial output, and the next run continues {s} (unless --accept_partial={s})", flush=True)
        if s == "train":
            _plot(cfg)
        if s == cfg.stop_after and s != stages[-1]:
            print(f"[eyas:run] {s}: done in this process apart; the run goes on in the ranks' `eyas run`"
                  if os.environ.get(APART) == s else
                  f"[eyas:run] stop_after={s}: stopping here; run the same command without it to continue", flush=True)
            return record
    raise_if_terminated()
    record.update(_evaluation(cfg.stage_dir("evaluate")) if "evaluate" in stages else {})
    artifacts.atomic_write_json(run_dir / "summary.json", record)
    print_summary(record)
    if cfg.note:
        print(f"[eyas:run] note: {cfg.note}", flush=True)
    return record


def preflight(cfg: EyasConfig, stages: list[str]) -> None:
    """Before the first stage of `eyas run`: every check of the stages to run (`stages`) that needs
    only the config, the target's config.json (a multimodal wrapper's text config) and files the
    config names, so that a setting a later stage refuses at its start fails the run before the
    earlier stages have spent their time. A ConfigError naming the flag to change."""
    from eyas.capture import check_layer_ids, default_layer_ids
    from eyas.target import load_config as target_config

    _check_evaluate_bench(cfg, stages)
    _check_target_weights(cfg, stages)
    tc = cfg.target
    if tc.chat_template.endswith(".jinja") and not Path(tc.chat_template).is_file():  # as load_tokenizer says
        raise ConfigError(f"target.chat_template={tc.chat_template!r}: no such file")
    conf = target_config(tc)  # a local target.model that does not exist: "no such directory"
    vocab_size = int(conf.vocab_size)
    if "prepare" in stages and cfg.prepare.draft_vocab_size > vocab_size:
        raise ConfigError(f"prepare.draft_vocab_size={cfg.prepare.draft_vocab_size} is larger than the target "
                          f"vocabulary ({vocab_size}); use <= {vocab_size}")
    _check_evaluate_draft(cfg, stages)
    _check_vllm_evaluate(cfg, stages)
    if "extract" not in stages and "train" not in stages:
        return
    n = int(conf.num_hidden_layers)
    layer_ids = check_layer_ids(list(cfg.extract.layer_ids) or default_layer_ids(n), n)
    if "extract" in stages and cfg.extract.device_map and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ConfigError("extract.device_map splits one target over the GPUs of one process; run it without torchrun")
    if "train" in stages:
        _check_draft_shape(cfg, conf, layer_ids)


def _check_evaluate_bench(cfg: EyasConfig, stages: list[str]) -> None:
    """evaluate.bench read whole as evaluate reads it (each line a prompt, valid UTF-8), so that a
    missing file or a malformed line fails the run before prepare, extract and train, not after."""
    if "evaluate" in stages:
        from eyas.evaluate.inputs import load_bench

        load_bench(cfg.evaluate.bench, cfg.evaluate.num_questions)


def _check_target_weights(cfg: EyasConfig, stages: list[str]) -> None:
    """The target's weight files (their headers and sizes), where a stage of this run loads the
    target: a file cut short is named before prepare, not when extract loads it."""
    if any(s in stages for s in ("regenerate", "extract", "train", "evaluate")):
        from eyas.target import check_weight_files

        check_weight_files(cfg.target)


def _check_evaluate_draft(cfg: EyasConfig, stages: list[str]) -> None:
    """A draft named in evaluate.draft that is already there must fit the target (as evaluate checks
    at its start, whichever backend), before the stages ahead of evaluate run."""
    from eyas.draft_files import find
    from eyas.evaluate.decoding import check_draft_files_fit

    files = find(cfg.evaluate.draft) if "evaluate" in stages and cfg.evaluate.draft else None
    if files is not None:
        check_draft_files_fit(cfg, files)


def _check_vllm_evaluate(cfg: EyasConfig, stages: list[str]) -> None:
    """evaluate.backend=vllm: what that evaluator refuses at its start (no vLLM, an MLA target on
    vLLM's CPU build), refused before training, not after it."""
    if "evaluate" in stages and cfg.evaluate.backend == "vllm":
        from eyas.evaluate.vllm import check_supported

        check_supported(cfg)


def draft_shape(cfg: EyasConfig, target_conf, layer_ids: list[int]):
    """The DraftConfig train builds (eyas.train.build.draft_config) from the target's config and the
    train.* shape keys (its draft vocabulary size as prepare will choose it at most)."""
    from eyas.draft import DraftConfig

    vocab = cfg.prepare.draft_vocab_size or int(target_conf.vocab_size)
    return DraftConfig.from_target(target_conf, vocab, layer_ids, **cfg.train.draft_shape())


def _check_draft_shape(cfg: EyasConfig, target_conf, layer_ids: list[int]) -> None:
    """The draft's heads against its kv heads; train.init_from names a draft (its shape and vocabulary
    wait for prepare's vocabulary: `_check_train_start`)."""
    tc = cfg.train
    dcfg = draft_shape(cfg, target_conf, layer_ids)
    if dcfg.num_attention_heads % dcfg.num_key_value_heads:
        raise ConfigError(
            f"draft heads {dcfg.num_attention_heads} are not a multiple of its kv heads {dcfg.num_key_value_heads} "
            f"(0 = the target's): change --train.num_attention_heads={tc.num_attention_heads} or "
            f"--train.num_key_value_heads={tc.num_key_value_heads}"
        )
    if tc.init_from and tc.resume in ("", "auto"):
        from eyas.train.init_from import init_files

        init_files(tc.init_from)  # "no such directory" / "not a draft directory"


def check_init_shape(cfg: EyasConfig) -> None:
    """train.init_from's draft against the shape this run trains (what train refuses only when it
    builds its draft, after extract); the draft vocabulary is `check_init_vocab`'s."""
    from eyas.capture import check_layer_ids, default_layer_ids
    from eyas.draft import SHAPE_FIELDS
    from eyas.draft_files import read_config
    from eyas.target import load_config as target_config
    from eyas.train.init_from import init_files

    tc = cfg.train
    conf = target_config(cfg.target)
    n = int(conf.num_hidden_layers)
    want = draft_shape(cfg, conf, check_layer_ids(list(cfg.extract.layer_ids) or default_layer_ids(n), n)).to_dict()
    have = read_config(init_files(tc.init_from)).to_dict()
    fields = [k for k in SHAPE_FIELDS if k != "draft_vocab_size"]
    diff = ", ".join(f"{k} {have[k]} there, {want[k]} here" for k in fields if have[k] != want[k])
    if diff:
        raise ConfigError(f"train.init_from={tc.init_from!r} is another draft shape ({diff}): set the --train.* shape "
                          "keys (intermediate_size, num_layers, heads) and --extract.layer_ids to the draft's, or "
                          "start without it")


def _check_train_start(cfg: EyasConfig, configs: dict[str, EyasConfig], stages: list[str], run_dir: Path,
                       record: dict[str, Any]) -> None:
    """Before extract runs: what train would refuse only after it (its init_from draft's vocabulary
    against prepare's, then its shape), recorded as train's failure. Not when train does not run next, or resumes
    from a checkpoint the user named (init_from then goes unused)."""
    from eyas.train.init_from import check_init_vocab

    tc = configs["train"].train if "train" in stages else None
    if tc is None or tc.resume not in ("", "auto"):  # (also with --stop_after=extract: train follows later)
        return
    try:
        check_init_vocab(tc, configs["train"].stage_dir("prepare"))
        if tc.init_from:
            check_init_shape(configs["train"])
    except BaseException as e:
        print("[eyas:run] train: refused before extract runs", file=sys.stderr, flush=True)
        _record_failure(cfg, run_dir, record, "train", cfg.stage_dir("train"), e, 0.0, time.time())
        raise


RECORDED = "_eyas_recorded_in_summary"


def _record_failure(cfg: EyasConfig, run_dir: Path, record: dict[str, Any], stage: str, out: Path,
                    exc: Exception, wall: float, started: float) -> None:
    """summary.json for a run a stage failed: the stages so far, the failure (type, message,
    traceback), and the evaluation's numbers when evaluate wrote its results before failing (a
    lossless-check failure does). A failure to write it is reported, never raised over `exc`."""
    with contextlib.suppress(AttributeError):  # recorded once, however many handlers it passes through
        setattr(exc, RECORDED, True)
    if isinstance(exc, ApartRunFailed) and (run_dir / "summary.json").is_file():
        print(f"[eyas:run] {stage} and the stages after it ran in one process apart, which stopped; what it did: "
              f"{run_dir / 'summary.json'}", file=sys.stderr, flush=True)
        return
    from eyas.cli import exit_status, write_roots

    status = "interrupted" if stopped_by(exc) else "failed"  # also an error raised over the signal as it unwound
    record["stages"][stage] = {"status": status, "dir": str(out), "wall_s": round(wall, 2),
                               "error": describe_exception(exc)}
    record["failed_stage"] = stage
    record["exit_status"] = exit_status(exc, write_roots(cfg))  # eyas's own (torchrun reports 1 for any failed rank)
    try:
        results = cfg.stage_dir("evaluate") / "results.json"
        if stage == "evaluate" and results.is_file() and results.stat().st_mtime >= started:
            record.update(_evaluation(results.parent))
        artifacts.atomic_write_json(run_dir / "summary.json", record)
        print(f"[eyas:run] {stage} {status}; what the run did so far: {run_dir / 'summary.json'}", file=sys.stderr, flush=True)
    except Exception as e:  # reported in full; the stage's own exception is the one re-raised
        d = describe_exception(e)
        print(f"[eyas:run] {stage} {status}, and writing summary.json failed too: {d['type']}: {d['message']}\n"
              f"{d['traceback']}", file=sys.stderr, flush=True)


def _throughput(stage: str, meta: dict[str, Any]) -> dict[str, Any]:
    """The tokens/s a stage measured itself (model loading excluded), where it reports one; for a
    training resumed over several runs also what all of them did (wall_s and tokens_per_s are the last run's)."""
    counts = meta.get("counts") or {}
    tps = {
        "regenerate": counts.get("tokens_per_s"),
        "extract": (counts.get("this_run") or {}).get("tokens_per_s"),
        "train": (meta.get("metrics") or {}).get("tokens_per_s"),
    }.get(stage)
    out: dict[str, Any] = {"tokens_per_s": tps} if tps else {}
    total = (meta.get("metrics") or {}).get("all_runs") if stage == "train" else None
    if total and total["runs"] > 1:
        out["all_runs"] = total
    return out


def _plot(cfg: EyasConfig) -> None:
    if importlib.util.find_spec("matplotlib") is None:  # an optional extra (eyas[plot]): the run goes on without
        print("[eyas:run] training plots not drawn: no matplotlib here (`pip install matplotlib`, then "
              f"`eyas plot {cfg.stage_dir('train')}`)", flush=True)
        return
    plot = importlib.import_module("eyas.plot")
    c = copy.deepcopy(cfg)
    c.plot.run_dir = str(cfg.stage_dir("train"))
    plot.main(c)


def _evaluation(eval_dir: Path) -> dict[str, Any]:
    path = eval_dir / "results.json"
    if not path.is_file():
        raise ArtifactError(f"{path} is missing: the evaluate stage wrote no results")
    res = json.loads(path.read_text())
    keys = ("tau_chain", "tau_tree", "tau_chain_simulated", "tau_tree_simulated", "acceptance_per_position", "lossless",
            "lossless_up_to_ties", "num_divergent", "num_divergent_near_tie", "speedup")
    out = {k: res.get(k) for k in keys}  # the un-suffixed ones: the tree's when it ran (results.json's primary mode)
    tf = res.get("teacher_forced") or {}
    out["acceptance_per_position_chain_simulated"] = tf.get("acceptance_per_position")
    out["acceptance_per_position_tree_simulated"] = (tf.get("tree") or {}).get("acceptance_per_position")
    for mode, m in (res.get("modes") or {}).items():
        out[f"acceptance_per_position_{mode}"] = m.get("acceptance_per_position")
        out[f"speedup_{mode}"] = m.get("speedup")
    return out


def print_summary(rec: dict[str, Any]) -> None:
    lines = [f"[eyas:run] summary ({rec['run_dir']}/summary.json)"]
    for s, r in rec["stages"].items():
        tps = f"{r['tokens_per_s']:,.0f} tok/s" if r.get("tokens_per_s") else ""
        wall = f"{r['wall_s']:.1f} s" if r.get("wall_s") is not None else ""
        status = r["status"] + (" partial" if r.get("partial") else "")
        lines.append(f"  {s:<11} {status:<16} {wall:>10} {tps:>16}  {r['dir']}")
        if r.get("all_runs"):
            a = r["all_runs"]
            lines.append(f"  {'':<11} over {a['runs']} runs: {a['steps']:,} steps, {a['seconds']:.1f} s of training"
                         + (f", {a['tokens_per_s']:,.0f} tok/s" if a.get("tokens_per_s") else ""))
    for mode in ("chain", "tree"):
        if rec.get(f"tau_{mode}") is None:
            continue
        acc = [a["conditional"] for a in rec.get(f"acceptance_per_position_{mode}") or []]
        speedup = rec.get(f"speedup_{mode}")
        lines.append(f"  {mode:<11} tau {rec[f'tau_{mode}']:.3f}  speedup " + (f"{speedup:.2f}x" if speedup else "-")
                     + "  P(accept | reached) per draft position: " + " ".join(f"{a:.2f}" for a in acc))
    if rec.get("tau_chain_simulated") is not None and rec.get("tau_chain") is None:  # evaluate.mode=simulate
        acc = [a["conditional"] for a in rec.get("acceptance_per_position_chain_simulated") or []]
        lines.append(f"  {'chain':<11} tau {rec['tau_chain_simulated']:.3f} simulated from the teacher-forced draft "
                     "(evaluate.mode=simulate)  P(accept | reached) per draft position: " + " ".join(f"{a:.2f}" for a in acc))
    if rec.get("tau_tree_simulated") is not None and rec.get("tau_tree") is None:
        acc = [a["conditional"] for a in rec.get("acceptance_per_position_tree_simulated") or []]
        lines.append(f"  {'tree':<11} tau {rec['tau_tree_simulated']:.3f} simulated pass by pass on the target's "
                     "outputs (evaluate.mode=simulate)  P(accept | reached) per tree depth: "
                     + " ".join(f"{a:.2f}" for a in acc))
    decoded = rec.get("tau_chain") is not None or rec.get("tau_tree") is not None  # not evaluate.mode=simulate
    if "lossless" in rec and (decoded or rec.get("tau_chain_simulated") is None):
        lines.append(f"  lossless    {rec['lossless']}" + (
            f" ({rec['num_divergent']} outputs differ, {rec['num_divergent_near_tie']} first at a near-tie: lossless up to "
            f"numerics {rec['lossless_up_to_ties']})" if rec.get("num_divergent") else ""))
    print("\n".join(lines), flush=True)
