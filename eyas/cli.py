"""`eyas <stage> [config.yaml] [--section.key=value ...]`: a thin dispatcher to each stage's main."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from pathlib import Path

from eyas.config import STAGES
from eyas.errors import TERMINATING, EyasError, Terminated, describe_exception, exception_message, stopped_by

USAGE = """usage: eyas <command> [config.yaml] [--section.key=value ...]

commands:
  run         every stage below in order in one run directory, skipping what is up to date
  regenerate  the target rewrites the assistant answers (HF generate or an OpenAI-compatible server)
  prepare     chat data -> tokens, assistant-only loss masks, draft vocabulary
  extract     target hidden states (3 aux layers + final) -> sharded safetensors
  train       the EAGLE-3 draft with training-time test (offline from extract, or online)
  export      the draft in SGLang / vLLM-speculators layouts:  eyas export TRAIN_DIR --format both
  evaluate    speculative decoding: acceptance length (chain, tree), lossless check, speedup
  plot        training curves as PNG:  eyas plot TRAIN_DIR
  assets      materialise the embedded assets (SmolLM2-135M-Instruct, ShareGPT, MT-bench)
  config      print every config key with its default and meaning (or the resolved config)

Precedence: defaults < YAML file < --section.key=value. Example:
  eyas prepare recipes/demo-cpu.yaml --prepare.max_conversations=200 --run_dir=runs/try
"""


# the commands with a module eyas.<command> exposing main(cfg): the stages, `run` and `plot`
COMMANDS = ("run", *STAGES, "plot")
# the config key a bare positional directory argument sets, for the commands that take one
POSITIONAL = {"export": "export.train_dir", "plot": "plot.run_dir"}


def _split(argv: list[str], positional: str | None = None) -> tuple[str | None, list[str]]:
    """-> (config.yaml or None, overrides). A bare directory argument becomes --<positional>=DIR."""
    path, out = None, []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg.startswith("--"):
            out.append(arg)
            if "=" not in arg and i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                out.append(argv[i + 1])
                i += 1
        elif Path(arg).suffix in (".yaml", ".yml") and path is None:
            path = arg
        elif positional is not None:
            out.append(f"--{positional}={arg}")
            positional = None
        else:
            raise EyasError(f"expected a .yaml config file or --section.key=value overrides, got {arg!r}")
        i += 1
    return path, out


def _own_section(command: str, overrides: list[str]) -> list[str]:
    """`eyas extract --verify 4` means --extract.verify=4: a bare key of the command's own section."""
    import dataclasses

    from eyas.config import EyasConfig

    top = {f.name for f in dataclasses.fields(EyasConfig)}
    out = []
    for arg in overrides:
        if arg.startswith("--"):
            key = arg[2:].split("=", 1)[0]
            if "." not in key and key.replace("-", "_") not in top:
                arg = f"--{command}.{arg[2:]}"
        out.append(arg)
    return out


STOPPING_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
"""Signals that stop a command as Ctrl-C does (Terminated): a scheduler's or torchrun's SIGTERM, and
SIGHUP from a closed terminal or ssh session."""


@contextlib.contextmanager
def sigterm_as_interrupt():
    """SIGTERM or SIGHUP (unless ignored, as under nohup) raises Terminated (a KeyboardInterrupt) in this process, once: the run
    unwinds as on Ctrl-C (summary.json, engines stopped) and exits 128 + the signal (143, 129); the
    same signal again kills as by default. Processes forked from this one (worker pools) keep the
    default: they just stop. Where Python ignores the exception (a signal that lands in an at-fork
    hook, as when a DataLoader starts its workers, is "Exception ignored in ..."), the signal is
    raised again at once."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pid = os.getpid()

    def handler(signum, frame):
        signal.signal(signum, signal.SIG_DFL)
        if os.getpid() != pid:  # a forked child that inherited this handler: die as by default
            os.kill(os.getpid(), signum)
            return
        TERMINATING[0] = signal.Signals(signum).name  # raised again between units of work if this one is swallowed
        # the signal reached the process group too: torch's DataLoader SIGCHLD handler would raise "worker
        # killed" over the unwinding (summary.json half written); its workers' deaths are now expected
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        raise Terminated(TERMINATING[0])

    def unraisable(u) -> None:  # raised where Python ignores exceptions (an at-fork hook): raised again
        if isinstance(u.exc_value, Terminated) and os.getpid() == pid:  # from outside that hook, a moment later
            signal.signal(u.exc_value.signum, handler)
            threading.Timer(0.05, os.kill, (pid, u.exc_value.signum)).start()
            return
        hook(u)

    # a signal ignored when eyas starts stays ignored: `nohup eyas run ...` outlives its terminal
    previous = {sig: signal.signal(sig, handler) for sig in STOPPING_SIGNALS if signal.getsignal(sig) != signal.SIG_IGN}
    hook = sys.unraisablehook
    sys.unraisablehook = unraisable
    try:
        yield
    finally:
        for sig, before in previous.items():
            signal.signal(sig, before)
        sys.unraisablehook = hook
        TERMINATING[0] = None


def _locked_dir(command: str, cfg) -> Path | None:
    """The run directory a command writes into, to lock (artifacts.run_dir_lock): `eyas run`'s, and a
    stage's whose output lies in it; on rank 0 only under torchrun (the ranks of one command share it).
    The stage directories themselves are locked too (eyas.claims.dir_locks)."""
    if os.environ.get("RANK", "0") != "0" or command not in ("run", *STAGES):
        return None
    run_dir = Path(cfg.run_dir).resolve()
    if command == "run" or cfg.stage_dir(command).resolve().is_relative_to(run_dir):
        return run_dir
    return None


def _disk_hint(e: BaseException) -> str:
    """For a failure caused by a full disk or a file-size limit (ENOSPC, EDQUOT, EFBIG anywhere in
    its cause chain): what happened and what to do, as a last line."""
    import errno

    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        text = str(e)  # a library's own I/O error (safetensors: "I/O error: File too large (os error 27)")
        if (isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)) or any(
                f"(os error {n})" in text for n in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)):
            where = f" writing {e.filename}" if getattr(e, "filename", None) else ""
            return (f"\neyas: out of disk space or over a file-size limit{where} ({getattr(e, 'strerror', None) or text}): "
                    "free space there (or "
                    "point --run_dir / the stage's out_dir at a larger disk) and run the same command again; it "
                    "continues from what was written whole")
        e = e.__cause__ or e.__context__
    return ""


def _stopped(command: str, e: BaseException) -> int:
    """A run a signal stopped, though an error raised over it is what came out (errors.stopped_by):
    said as stopped, with that error named, and the signal's exit status."""
    stop = stopped_by(e)
    what = signal.Signals(stop.signum).name if isinstance(stop, Terminated) else "Ctrl-C"
    print(f"eyas {command}: terminated ({what}); as it unwound, {type(e).__name__}: {exception_message(e)}",
          file=sys.stderr)
    return exit_status(e)


def write_roots(cfg) -> list[Path]:
    """Where a command's outputs go: the run directory and every stage's directory."""
    return [Path(cfg.run_dir).resolve(), *(cfg.stage_dir(s).resolve() for s in STAGES)]


def _not_permitted(e: BaseException, roots: list[Path]) -> str:
    """For a failure to write or read a path under `roots` (write_roots) this user may not (EACCES,
    EPERM) or on a read-only filesystem (EROFS), anywhere in its cause chain: the path and what to
    do; "" for anything else (a cache or /dev/shm of another user's is no --run_dir to change)."""
    import errno

    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in (errno.EACCES, errno.EPERM, errno.EROFS) and e.filename \
                and any(Path(os.fsdecode(e.filename)).resolve().is_relative_to(r) for r in roots):
            return (f"{e.strerror}: {e.filename}: a directory or file this user may not write (or read), or a "
                    "read-only filesystem; give a --run_dir (or the stage's out_dir) where you can write, or change "
                    "its permissions, and run the same command again")
        e = e.__cause__ or e.__context__
    return ""


def exit_status(e: BaseException, roots: list[Path] = ()) -> int:
    """The exit status `eyas` gives an exception: 2 a user error (EyasError, or a path under `roots`
    it may not write: _not_permitted), 128 + the signal for SIGTERM or SIGHUP (143, 129), 130
    Ctrl-C, 1 else."""
    stop = stopped_by(e)
    if stop is not None:
        return 128 + stop.signum if isinstance(stop, Terminated) else 130
    return 2 if isinstance(e, EyasError) or _not_permitted(e, roots) else 1


def _torchrun_note(rc: int) -> str:
    """Under torchrun, a last line: torchrun exits 1 whichever status a rank exits with."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return ""
    return (f"\neyas: this rank exits {rc}{' (a setting or input to change, above)' if rc == 2 else ''}; torchrun "
            "reports 1 for any failed rank (`eyas run` records its own in summary.json's exit_status once a stage ran)")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0
    command, rest = argv[0], argv[1:]
    cfg = None
    try:
        if command == "assets":
            from eyas import assets

            return assets.main(rest)
        from eyas.config import describe, dump_config, load_config

        if command == "config":
            if rest and rest[0] in ("-h", "--help"):
                print("\n".join(describe()))
                return 0
            path, overrides = _split(rest)
            print(dump_config(load_config(path, overrides)), end="")
            return 0
        if command not in COMMANDS:
            raise EyasError(f"unknown command {command!r}\n\n{USAGE}")
        if rest and rest[0] in ("-h", "--help"):
            print("\n".join(describe()))
            return 0
        path, overrides = _split(rest, POSITIONAL.get(command))
        cfg = load_config(path, _own_section(command, overrides))
        import importlib

        from eyas.artifacts import run_dir_lock
        from eyas.claims import check_alone, dir_locks, written_dirs

        locked = _locked_dir(command, cfg)
        with sigterm_as_interrupt(), run_dir_lock(locked, command) if locked else contextlib.nullcontext():
            check_alone(command, cfg)  # a stage run alone into another stage's directory, or a foreign one
            with dir_locks(written_dirs(command, cfg), command, make=True):
                result = importlib.import_module(f"eyas.{command}").main(cfg)
        return int(result) if isinstance(result, int) else 0
    except EyasError as e:
        if stopped_by(e):  # raised while a signal unwound the run: the signal is what stopped it
            return _stopped(command, e)
        print(f"eyas {command}: error: {exception_message(e)}{_disk_hint(e)}{_torchrun_note(2)}", file=sys.stderr)
        return 2
    except Terminated as e:
        print(f"eyas {command}: terminated ({signal.Signals(e.signum).name})", file=sys.stderr)
        return 128 + e.signum
    except KeyboardInterrupt:
        print(f"eyas {command}: interrupted", file=sys.stderr)
        return 130
    except BaseException as e:  # anything unexpected: type, message and the full traceback, exit 1
        if stopped_by(e):  # a library's cleanup that failed as the signal unwound it: the signal stopped the run
            return _stopped(command, e)
        said = _not_permitted(e, write_roots(cfg)) if cfg is not None else ""
        if said:  # a permission of the user's machine, not a fault of eyas: exit 2, as an EyasError
            print(f"eyas {command}: error: {said}", file=sys.stderr)
            return 2
        d = describe_exception(e)
        print(f"eyas {command}: {d['type']}: {d['message']}\n{d['traceback']}{_disk_hint(e)}{_torchrun_note(1)}",
              file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
