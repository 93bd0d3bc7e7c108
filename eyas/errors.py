"""Errors that users see, and the one way eyas records a caught exception.

User mistakes raise `EyasError` (or a subclass) whose message names the offending value, file:line
or flag and says what to change. Internal invariants use `assert`. Nothing is ever swallowed: a
caught exception is either re-raised or recorded with `describe_exception` (type, message or repr
when the message is empty, full traceback) together with stage, rank and sample ids, and the run
exits non-zero unless the user explicitly allowed failures.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import traceback
from typing import Any, Iterable


class EyasError(Exception):
    """A problem the user can fix; the message says how."""


class ConfigError(EyasError, ValueError):
    """An invalid, unknown or inconsistent configuration value."""


class DataError(EyasError, ValueError):
    """Malformed or unusable input data (the message names file:line or record id)."""


class ArtifactError(EyasError):
    """A stage output is missing, corrupt or does not match what the consumer expects."""


class DamagedArtifact(ArtifactError):
    """A stage's output file that fails its own check (checksum, size, format): `path` and the `stage`
    that wrote it, so `eyas run` can make that stage again."""

    def __init__(self, message: str, path, stage: str):
        super().__init__(message)
        self.path, self.stage = path, stage


class Terminated(KeyboardInterrupt):
    """SIGTERM (a scheduler's stop, a preemption, torchrun stopping its workers) or SIGHUP (the
    terminal or ssh session closed) raised as an interrupt, so that it unwinds as Ctrl-C does: the
    stage is marked interrupted in summary.json, engines and child processes are stopped, and the
    command exits 128 + the signal's number (143, 129)."""

    def __init__(self, name: str = "SIGTERM"):
        super().__init__(name)
        self.signum = int(getattr(signal, name, signal.SIGTERM))


TERMINATING: list = [None]
"""The name of the stopping signal once one arrived (eyas.cli), else None: `raise_if_terminated`
raises it again where a library swallowed the first Terminated (an `except BaseException` that does
not re-raise)."""


def raise_if_terminated() -> None:
    """Called between units of work (stages, chunks, batches, steps)."""
    if TERMINATING[0]:
        raise Terminated(TERMINATING[0])


_URL_CREDENTIALS = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)(?P<userinfo>[^/?#\s]*)@")


def redact_urls(text: str) -> str:
    """`text` with the credentials of every URL in it shown as *** (`https://user:***@host/...`;
    a token alone, `https://***@host`): everything up to the host's last @ is hidden but the user."""

    def hide(m: re.Match) -> str:
        user, colon, _ = m["userinfo"].partition(":")
        return f"{m['scheme']}{user}:***@" if colon and "@" not in user else f"{m['scheme']}***@"

    return _URL_CREDENTIALS.sub(hide, text)


SECRETS: set[str] = set()
"""Configured secrets (an API key, URL credentials) no message or file may show: `add_secret`."""


def add_secret(value: str) -> None:
    """From now on `redact` shows `value` as *** wherever it appears (a server that echoes the key
    it was sent in its error page, a traceback that holds it)."""
    if value:
        SECRETS.add(value)


SHORT_SECRET = 8
"""A secret shorter than this (`EMPTY`, vLLM's usual dummy key; a short password) is hidden only
where it stands alone (not inside a longer word), so that it does not garble every message."""


def redact(text: str) -> str:
    """`text` with URL credentials (redact_urls) and every secret given to add_secret shown as ***:
    what every message, log line and file eyas writes goes through."""
    text = redact_urls(text)
    for secret in sorted(SECRETS, key=len, reverse=True):  # the longest first: one may hold another
        if len(secret) >= SHORT_SECRET:
            text = text.replace(secret, "***")
        else:
            text = re.sub(rf"(?<![A-Za-z0-9]){re.escape(secret)}(?![A-Za-z0-9])", "***", text)
    return text


def stopped_by(exc: BaseException | None) -> KeyboardInterrupt | None:
    """The Ctrl-C or Terminated (SIGTERM, SIGHUP) that `exc` is, or was raised while unwinding: a
    library's cleanup that fails as the signal passes through it (torch.save's zip writer, cut in
    the middle of a file: "unexpected pos 64 vs 0") raises its own error over the stop, and the
    stop is what happened. None when no signal stopped it."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, KeyboardInterrupt):
            return exc
        exc = exc.__cause__ or exc.__context__
    return None


def exception_message(exc: BaseException) -> str:
    """str(exc), or repr(exc) when str is empty (a bare `raise RuntimeError()` prints nothing); redacted."""
    text = str(exc)
    return redact(text if text.strip() else repr(exc))


def describe_exception(exc: BaseException) -> dict[str, str]:
    """Type, message (repr when empty) and the full traceback, ready for JSON; redacted."""
    return {
        "type": f"{type(exc).__module__}.{type(exc).__qualname__}",
        "message": exception_message(exc),
        "traceback": redact("".join(traceback.format_exception(type(exc), exc, exc.__traceback__))),
    }


def record_error(
    path: str | os.PathLike | None,
    exc: BaseException,
    *,
    stage: str,
    rank: int = 0,
    sample_ids: Iterable[Any] = (),
    **context: Any,
) -> dict[str, Any]:
    """Append one failure to `path` (errors.jsonl) and print it in full to stderr; return the record."""
    rec: dict[str, Any] = {"stage": stage, "rank": rank, "sample_ids": [str(s) for s in sample_ids]}
    rec.update(context)
    rec.update(describe_exception(exc))
    if path is not None:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(rec) + "\n")
            f.flush()
            os.fsync(f.fileno())
    print(
        f"[eyas:{stage}] rank {rank} FAILED on samples {rec['sample_ids']}: "
        f"{rec['type']}: {rec['message']}\n{rec['traceback']}",
        file=sys.stderr,
        flush=True,
    )
    return rec
