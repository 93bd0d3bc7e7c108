"""Self-describing stage outputs: atomic writes and `meta.json`.

Every stage directory holds `meta.json` (written last: its presence marks a complete output) with
the schema version, the stage, the resolved config, input hashes, counts and library versions, and
`config.yaml` (the whole resolved config). Consumers call `read_meta`, which names the stage to
re-run when something is missing or mismatched.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import platform
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from eyas.assets import sha256_file
from eyas.errors import ArtifactError, DamagedArtifact, EyasError, redact

SCHEMA_VERSION = 1


def library_versions() -> dict[str, str]:
    import importlib.metadata as md

    out = {"python": platform.python_version()}
    for name in ("eyas", "torch", "transformers", "safetensors", "tokenizers", "numpy"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = "not installed"
    return out


def fsync_dir(path: str | Path) -> None:
    """fsync a directory, so a rename into it survives a crash."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write to a temp file in the same directory, fsync, rename: the file is whole or absent."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".tmp-", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


NO_FOLLOW_MODES = {"a": os.O_WRONLY | os.O_APPEND | os.O_CREAT, "ab": os.O_WRONLY | os.O_APPEND | os.O_CREAT,
                   "r+b": os.O_RDWR}


def open_no_follow(path: str | Path, mode: str, fix: str = "point the stage's out_dir elsewhere"):
    """open(path, mode) for appending to or cutting a file eyas writes in place ("a", "ab", "r+b"),
    refused when `path` is a symbolic link: eyas makes none, so one there would send its writes
    (or a truncation) to a file outside its directory. `fix` says what to change."""
    import errno

    try:
        fd = os.open(path, NO_FOLLOW_MODES[mode] | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o644)
    except OSError as e:
        if e.errno != errno.ELOOP:
            raise
        raise ArtifactError(f"{path} is a symbolic link (to {os.readlink(path)}), which eyas did not make: it never "
                            f"writes through one. Nothing was written; remove the link (what it points to stays) or "
                            f"{fix}") from None
    return os.fdopen(fd, mode, **({} if "b" in mode else {"encoding": "utf-8"}))


def atomic_save_safetensors(tensors: dict[str, Any], path: str | Path) -> None:
    """safetensors.torch.save_file through a temp file, fsync and rename: the file is whole or absent."""
    from safetensors.torch import save_file

    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".tmp-", dir=path.parent)
    os.close(fd)
    try:
        save_file(tensors, tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_json(path: str | Path, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=False) + "\n").encode("utf-8"))


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def hash_json(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def write_meta(out_dir: str | Path, stage: str, **fields: Any) -> dict[str, Any]:
    meta = {"schema_version": SCHEMA_VERSION, "stage": stage, "complete": True}
    meta.update(fields)
    meta.setdefault("versions", library_versions())
    atomic_write_json(Path(out_dir) / "meta.json", meta)
    return meta


def read_meta(out_dir: str | Path, stage: str) -> dict[str, Any]:
    """The meta.json of a complete `stage` output, or an ArtifactError saying what to run."""
    path = Path(out_dir) / "meta.json"
    if not path.is_file():
        raise ArtifactError(f"{out_dir} holds no complete {stage} output (no meta.json): run `eyas {stage}` first")
    try:
        meta = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ArtifactError(f"{path} is not valid JSON ({e.msg}): re-run `eyas {stage}`") from None
    if meta.get("stage") != stage:
        raise ArtifactError(f"{path} describes stage {meta.get('stage')!r}, expected {stage!r}")
    if meta.get("schema_version") != SCHEMA_VERSION:
        raise ArtifactError(
            f"{path} has schema version {meta.get('schema_version')}, this eyas reads {SCHEMA_VERSION}: re-run `eyas {stage}`"
        )
    return meta


def file_record(out_dir: str | Path, names: list[str]) -> dict[str, dict[str, Any]]:
    """{name: {sha256, bytes}} of files in `out_dir`, for meta.json (`check_files` verifies them)."""
    out_dir = Path(out_dir)
    return {n: {"sha256": sha256_file(out_dir / n), "bytes": (out_dir / n).stat().st_size} for n in names}


def check_files(out_dir: str | Path, stage: str, files: dict[str, dict[str, Any]]) -> None:
    """DamagedArtifact naming the first file of `files` (meta.json's record) that is missing, of
    another size or another sha256."""
    for name, want in files.items():
        path = Path(out_dir) / name
        why = ("is missing" if not path.is_file() else
               f"has {path.stat().st_size:,} bytes, not the {want['bytes']:,} {stage} wrote"
               if path.stat().st_size != want["bytes"] else
               "is damaged: its sha256 differs from the one in meta.json" if sha256_file(path) != want["sha256"] else "")
        if why:
            raise DamagedArtifact(f"{path} {why}; run {stage} again (the same `eyas run` does it by itself, and keeps "
                                  "the stages after it when the file comes out as it was)", path, stage)


def read_safetensors(path: str | Path, stage: str, hint: str = "") -> dict[str, Any]:
    """safetensors.torch.load_file, a file that is not whole or not safetensors named as such."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except (SafetensorError, OSError) as e:
        raise DamagedArtifact(f"{path} is not a readable safetensors file ({type(e).__name__}: {e}): it is truncated or "
                              f"damaged; {hint or f'run {stage} again'}", path, stage) from e


LOCK_FILE = ".eyas.lock"
LOCK_HELD = "EYAS_RUN_DIR_LOCKED"
"""Set for a child process that runs inside its parent's locks (`eyas run` apart from the ranks):
the directories they hold, joined by os.pathsep."""


@contextlib.contextmanager
def run_dir_lock(run_dir: str | Path, command: str, what: str = "run directory"):
    """Hold RUN_DIR/.eyas.lock (an exclusive flock) while a command writes into the run directory: a
    second eyas command on the same directory stops at once, naming the process that holds it (pid,
    host, command, start), instead of deleting the other's stage outputs. The kernel releases the
    lock when its holder exits, however it exits (kill -9 too): a lock never outlives its process.
    Children that run inside this lock get LOCK_HELD in their environment. flock holds across
    processes of one host; on a network filesystem it depends on the filesystem. (A stage's
    output directory is locked the same way: eyas.claims.dir_locks, `what` names it.)"""
    run_dir = Path(run_dir).resolve()
    held = [d for d in os.environ.get(LOCK_HELD, "").split(os.pathsep) if d]
    if str(run_dir) in held:
        yield
        return
    made = not run_dir.exists()
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    locked = False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            flag = "--run_dir" if what == "run directory" else "--run_dir or the stage's out_dir"
            raise EyasError(f"{what} {run_dir} is in use by another eyas command ({_holder(path)}): two "
                            "commands in one directory replace each other's stage outputs. Wait for it to "
                            f"finish or stop it, or give this one another {flag} (lock: {path})") from None
        locked = True
        holder = {"pid": os.getpid(), "host": socket.gethostname(), "command": f"eyas {command}",
                  "argv": [redact(a) for a in sys.argv], "started": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(holder).encode(), 0)
        os.environ[LOCK_HELD] = os.pathsep.join([*held, str(run_dir)])
        _LOCK_FDS.add(fd)
        try:
            yield
        finally:
            os.environ[LOCK_HELD] = os.pathsep.join(held)
            if not held:
                os.environ.pop(LOCK_HELD, None)
            _LOCK_FDS.discard(fd)
    finally:
        if locked and made:  # a directory this lock made that nothing was written into (a refusal) is not left behind
            with contextlib.suppress(OSError):
                if [p.name for p in run_dir.iterdir()] == [LOCK_FILE]:
                    path.unlink()  # while still locked: a second command on it stops, it does not lock it too
                    run_dir.rmdir()
        os.close(fd)  # releases the flock


_LOCK_FDS: set[int] = set()
"""The directory locks this process holds: a forked child (a loader worker) closes its copies, so an
orphaned child never keeps a lock (a lock lives while any copy of its descriptor is open)."""


def _close_lock_in_child() -> None:
    for fd in list(_LOCK_FDS):
        with contextlib.suppress(OSError):
            os.close(fd)
    _LOCK_FDS.clear()


os.register_at_fork(after_in_child=_close_lock_in_child)


def _holder(path: Path) -> str:
    """The lock holder's pid, host, command and start, in words."""
    try:
        h = json.loads(path.read_text())
        return f"pid {h['pid']} on {h['host']}, `{' '.join(h['argv'])}`, since {h['started']}"
    except (OSError, ValueError, KeyError) as e:  # written between its flock and its write: say what was read
        return f"its description in {path} is unreadable: {type(e).__name__}: {e}"
