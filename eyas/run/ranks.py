"""Processes and ranks: under torchrun rank 0 drives the run and sends the other ranks into the
stages they run together (extract, train); a stage in vLLM runs as one child process apart from
the ranks, without torchrun's environment."""

from __future__ import annotations

import copy
import dataclasses
import importlib
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

from eyas import artifacts
from eyas.config import EyasConfig
from eyas.errors import EyasError, describe_exception
from eyas.run.summary import teed

ALL_RANKS = ("extract", "train")  # under torchrun every rank runs these (extract with the HF backend); the rest rank 0
TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_NAME",
                 "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
"""What torchrun sets for its ranks; a stage rank 0 runs in vLLM gets none of it (run_alone)."""


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
    which recorded them); `eyas.run` checks those like any earlier output."""

    stage: str


STOP, FAILED = "stop", "failed"  # rank 0's last word to the other ranks: the run ended, or stopped with an error
CONTROL_TIMEOUT = timedelta(days=7)  # a waiting rank waits through rank 0's regenerate and evaluate, however long


def main_ranks(cfg: EyasConfig, drive: Callable[..., dict[str, Any]]) -> dict[str, Any]:
    """`eyas run` under torchrun: rank 0 runs the run (`drive(cfg, runner, banner)`: eyas.run's `_main`
    with the runner here); each stage of ALL_RANKS it reaches it first sends (stage, config) to the
    other ranks, which run that stage with it and wait for the next.
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
            record = drive(cfg, runner, banner)
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
