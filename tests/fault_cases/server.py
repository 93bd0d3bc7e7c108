"""Server cases: regenerate's server backend against a real chat server (tests/regenerate/chat_server.py,
the tiny model on 127.0.0.1) that misbehaves as servers and the proxies before them do: an HTML
page for an answer, 429 with Retry-After, empty answers, an answer that ignores max_tokens, bytes
that are not UTF-8, an error page that echoes the API key. `eyas run --stop_after=regenerate` on 4
conversations; each holds when eyas retries what a retry may mend (said as it happens), refuses
what it must not keep (never written, counted, said), and fails naming the server, the conversation
and the setting to change, with no traceback and no secret in any message or file."""

from __future__ import annotations

import json
import time
from pathlib import Path

from tests.fault_matrix import Case, _env

SMALL = ("--stop_after=regenerate", "--prepare.max_conversations=4")


def _regenerate(m, work: Path, name: str, extra: tuple[str, ...], *more: str, env=None) -> tuple[int, str, Path]:
    run = work / name
    rc, out = m.eyas(m.run_args(run, *extra, *SMALL, *more), work / f"{name}.log", timeout=300, env=env)
    return rc, out, run


def _last(out: str) -> str:
    lines = [x for x in out.strip().splitlines() if "error" in x or "refused" in x] or out.strip().splitlines() or ["-"]
    return lines[-1][:300]


def _written(run: Path) -> str:
    path = run / "regenerate" / "conversations.jsonl"
    return path.read_text(encoding="utf-8", errors="replace") if path.is_file() else ""


def _with_server(check):
    """`check(m, work, server, extra)` with the chat server up, closed after."""
    def cell(m, work: Path, rng) -> tuple[bool, str]:
        server, extra = m._server()
        try:
            return check(m, work, server, extra)
        finally:
            server.__exit__(None, None, None)

    cell.__doc__ = check.__doc__
    return cell


@_with_server
def html_answer(m, work, server, extra):
    """A 200 with an HTML error page for an answer (a proxy before the server): before, a bare
    JSONDecodeError traceback, nothing retried. Held: retried (said), the run completes when the
    page came once; when it stays, exit 2 naming the server and the conversation."""
    server.mode, server.times = "html", 1
    rc1, out1, _ = _regenerate(m, work, "once", extra)
    said = "the answer is not JSON" in out1 and "(attempt 1 of 2); retrying in" in out1
    server.times = None
    rc2, out2, run2 = _regenerate(m, work, "always", extra)
    named = f"{server.url}/v1/chat/completions" in out2 and "conversation " in out2 and "502 Bad Gateway" in out2
    held = rc1 == 0 and said and rc2 == 2 and named and "Traceback" not in out1 + out2 and not _written(run2)
    return held, f"once: exit {rc1}{', retry said' if said else ''}; always: exit {rc2}: {_last(out2)}"


@_with_server
def retry_after(m, work, server, extra):
    """429 with Retry-After: 2: before, retried after 1 s whatever it said, nothing said. Held: the
    retry waits at least 2 s and says so; a Retry-After past regenerate.max_retry_wait_s fails at
    once naming the setting."""
    server.mode, server.times, server.retry_after = "ratelimit", 1, "2"
    rc1, out1, _ = _regenerate(m, work, "once", extra)
    gap = server.arrivals[1] - server.arrivals[0] if len(server.arrivals) > 1 else 0.0
    said = "HTTP 429" in out1 and "Retry-After: 2" in out1 and "retrying in 2." in out1
    server.times, server.retry_after, asked = None, "60", server.requests
    t0 = time.monotonic()
    rc2, out2, _ = _regenerate(m, work, "capped", extra, "--regenerate.max_retry_wait_s=5")
    seconds = time.monotonic() - t0
    named = "regenerate.max_retry_wait_s=5" in out2 and "Retry-After: 60" in out2
    # concurrency 1: the request that failed, and at most the next one its worker had taken up
    held = rc1 == 0 and gap >= 2.0 and said and rc2 == 2 and named and server.requests - asked <= 2 and seconds < 60
    return held, (f"Retry-After 2: exit {rc1}, waited {gap:.2f} s{', said' if said else ''}; Retry-After 60 over "
                  f"max_retry_wait_s=5: exit {rc2} in {seconds:.0f} s, {server.requests - asked} request(s): {_last(out2)}")


@_with_server
def empty_answers(m, work, server, extra):
    """Every answer empty: before, stored as finished conversations, exit 0, the count only in
    meta.json. Held: each retried, refused and said; past regenerate.max_refused_fraction exit 2,
    nothing written, regenerate not marked complete."""
    server.mode = "empty"
    rc, out, run = _regenerate(m, work, "run", extra)
    said = out.count("refused: an empty answer (no content, no reasoning); the conversation ends before it") == 4 \
        and "(attempt 1 of 2); retrying in" in out
    named = "4 of 4 answers refused (4 empty)" in out and "regenerate.max_refused_fraction" in out
    held = rc == 2 and said and named and not _written(run) and not (run / "regenerate" / "meta.json").exists()
    return held, f"exit {rc}, {server.requests} requests, {len(_written(run))} bytes written: {_last(out)}"


@_with_server
def ignores_max_tokens(m, work, server, extra):
    """A server that ignores max_tokens (1.5 MB answers, no usage): before, kept whole. Held: read no
    further than 1 MiB + 4 KiB a token, refused and said; allowed by max_refused_fraction=1 the run
    completes with nothing over the bound written."""
    server.mode = "huge"
    rc1, out1, run1 = _regenerate(m, work, "default", extra)
    rc2, out2, run2 = _regenerate(m, work, "allowed", extra, "--regenerate.max_refused_fraction=1")
    said = out2.count("refused: longer than max_tokens: more than") == 4
    meta = run2 / "regenerate" / "meta.json"
    counted = meta.is_file() and json.loads(meta.read_text())["counts"]["counts"].get("answers_refused_over_max_tokens") == 4
    held = rc1 == 2 and not _written(run1) and rc2 == 0 and said and counted and len(_written(run2)) < 100_000
    return held, (f"default: exit {rc1}: {_last(out1)}; max_refused_fraction=1: exit {rc2}, "
                  f"{len(_written(run2)):,} bytes written, {'counted' if counted else 'NOT counted'}")


@_with_server
def non_utf8(m, work, server, extra):
    """A streamed answer with bytes that are not UTF-8: before, stored with U+FFFD in their place,
    exit 0. Held: refused (said); past max_refused_fraction (1 of 4) exit 2 with nothing written;
    allowed (max_refused_fraction=1), counted and the other conversations written, no U+FFFD."""
    server.mode, server.times, server.stream = "badbytes", 1, True
    rc1, out1, run1 = _regenerate(m, work, "default", extra)
    server.times = server.requests + 1
    rc2, out2, run2 = _regenerate(m, work, "allowed", extra, "--regenerate.max_refused_fraction=1")
    text = _written(run2)
    said = "refused: not UTF-8" in out1 and "refused: not UTF-8" in out2
    meta = run2 / "regenerate" / "meta.json"
    counted = meta.is_file() and json.loads(meta.read_text())["counts"]["counts"].get("answers_refused_not_utf8") == 1
    held = rc1 == 2 and not _written(run1) and rc2 == 0 and said and counted and "\ufffd" not in text \
        and text.count("\n") == 3
    return held, (f"default: exit {rc1}: {_last(out1)}; max_refused_fraction=1: exit {rc2}, {text.count(chr(10))} "
                  f"conversations written, U+FFFD {'found' if chr(0xfffd) in text else 'none'}")


@_with_server
def key_echoed(m, work, server, extra):
    """An error page that echoes the API key (401): before, the key in summary.json and the
    output, and a hint asking for a key already sent. Held: the key in no message and no file,
    the hint says the key was refused."""
    key = "sk-fault-matrix-3c1e0b9a77"
    server.mode = "echo401"
    env = dict(_env(), EYAS_FM_SERVER_KEY=key)
    rc, out, run = _regenerate(m, work, "run", extra, "--regenerate.server_api_key_env=EYAS_FM_SERVER_KEY", env=env)
    leaks = [str(p.relative_to(run)) for p in run.rglob("*") if p.is_file() and key.encode() in p.read_bytes()]
    leaks += ["output"] if key in out else []
    hint = "the server refused the API key in EYAS_FM_SERVER_KEY" in out
    held = rc == 2 and not leaks and hint and (run / "summary.json").is_file()
    return held, f"exit {rc}, key in: {', '.join(leaks) or 'nothing'}, hint {'says refused' if hint else 'WRONG'}"


@_with_server
def sigterm_while_held(m, work, server, extra):
    """SIGTERM while the server holds every request without a byte (regenerate.stall_s=120): before,
    the command went on until the held requests timed out (its request threads were joined at
    exit). Held: exit 143 within 15 s, summary.json marks regenerate interrupted."""
    import os
    import signal
    import subprocess

    server.mode = "stall"
    run = work / "run"
    log = work / "run.log"
    args = [m.python, "-m", "eyas", *m.run_args(run, *extra, *SMALL, "--regenerate.stall_s=120")]
    with open(log, "w") as f:
        proc = subprocess.Popen(args, stdout=f, stderr=subprocess.STDOUT, env=_env(), start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while server.requests < 1 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        t0 = time.monotonic()
        os.killpg(proc.pid, signal.SIGTERM)
        rc = proc.wait(120)
        seconds = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
        server.mode = "fail"  # the held requests end
    summary = run / "summary.json"
    status = json.loads(summary.read_text())["stages"].get("regenerate", {}).get("status") if summary.is_file() else None
    held = rc == 143 and seconds < 15 and status == "interrupted"
    return held, f"SIGTERM with {server.requests} request(s) held: exit {rc} after {seconds:.1f} s, summary: regenerate {status}"


CASES = [
    Case("server", "html-answer", html_answer, "regenerate"),
    Case("server", "429-retry-after", retry_after, "regenerate"),
    Case("server", "empty-answers", empty_answers, "regenerate"),
    Case("server", "ignores-max-tokens", ignores_max_tokens, "regenerate"),
    Case("server", "non-utf8-bytes", non_utf8, "regenerate"),
    Case("server", "api-key-echoed", key_echoed, "regenerate"),
    Case("server", "sigterm-while-requests-held", sigterm_while_held, "regenerate"),
]
