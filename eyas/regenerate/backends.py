"""Regenerate's backends: who writes the target's answers.

  HFBackend      the target in this process: prompts sorted by length, left-padded, batched. On
                 CUDA (`regenerate.static_cache`, default) eyas's BatchDecoder (eyas/spec/static.py):
                 fixed-size KV buffers and the decode step of all rows as one CUDA graph (captured
                 in a forward's time, no compilation), rows filled up to a power of two, prompt
                 widths bucketed (`static_widths`). Elsewhere transformers `generate`.
                 `generate(token prompts, sampling) -> [Answer]`. An answer's thinking block is
                 split off into `Answer.reasoning` (eyas.chat.split_think); `<think>`/`</think>`
                 are kept through decoding also where they are special tokens.
  ServerBackend  an OpenAI-compatible /v1/chat/completions endpoint (vllm serve, SGLang) with
                 bounded concurrency, answers streamed: connection errors, HTTP 429 and 5xx, an
                 answer that is not JSON or cut off, an empty one, and a stall (nothing received
                 for `stall_s`) are retried `retries` times, each said when it happens, after
                 jittered waits that honour Retry-After and end at `max_retry_wait_s` in all; then
                 the run fails naming the conversation, the attempts and the last error. An answer
                 still empty, over max_tokens or not UTF-8 is refused (Answer.refused): the stage
                 ends its conversation there and counts it. An API key comes from the environment
                 variable `server_api_key_env`; URL credentials go as basic auth; both are hidden
                 (eyas.errors.redact) from every message and file. `generate_messages(chats, ids)
                 -> [Answer]`. The response
                 message's `reasoning_content` (SGLang, vLLM before 0.11) or `reasoning` (vLLM)
                 is the answer's reasoning; without either, a thinking block inline in `content`
                 is split off as the HF backend does.
"""

from __future__ import annotations

import base64
import email.utils
import http.client
import json
import os
import queue
import random
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any

from eyas.chat import REASONING, THINK_END, THINK_START, split_think
from eyas.config import EyasConfig
from eyas.errors import ConfigError, EyasError, add_secret, exception_message, redact


@dataclass
class Answer:
    text: str
    new_tokens: int
    finish_reason: str  # "stop" | "length"
    reasoning: str = ""  # the thinking block, without its <think> markers ("" when none)
    refused: str = ""  # server backend: why it is not kept (a key of REFUSED; "" = kept)
    why: str = ""  # the refusal's particulars


@dataclass(frozen=True)
class Sampling:
    temperature: float
    top_p: float
    max_new_tokens: int


class HFBackend:
    """Batched in-process generation with the target (greedy or sampled)."""

    def __init__(self, cfg: EyasConfig, tok):
        import torch

        from eyas.target import load_model

        rc = cfg.regenerate
        self.rc, self.tok = rc, tok
        self.device = rc.device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.model = load_model(cfg.target, device=self.device)
        self.eos = eos_ids(self.model.generation_config.eos_token_id, tok)
        self.pad = tok.pad_token_id if tok.pad_token_id is not None else self.eos[0]
        self.think_ids = marker_ids(tok)
        self.static = rc.static_cache and self.device.startswith("cuda")
        self.widths = sorted(rc.static_widths or {512, rc.max_prompt_tokens})
        self.decoder = None
        self.generator = torch.Generator(self.device).manual_seed(cfg.seed)  # eyas's decoder samples with it
        torch.manual_seed(cfg.seed)  # transformers' generate samples from the global generator
        self.answers = Sampling(rc.temperature, rc.top_p, rc.max_new_tokens)

    def generate(self, prompts_ids: list[list[int]], sampling: Sampling | None = None) -> list[Answer]:
        """Continuations of the token prompts; `sampling` defaults to the answers' settings."""
        s = sampling or self.answers
        order = sorted(range(len(prompts_ids)), key=lambda i: len(prompts_ids[i]))
        out: list[Answer | None] = [None] * len(prompts_ids)
        for b in range(0, len(order), self.rc.batch_size):
            idx = order[b : b + self.rc.batch_size]
            batch = [prompts_ids[i] for i in idx]
            if self.static:
                new = self._static_batch(batch, s)
            else:
                new = self._hf_batch(batch, s)
            for row, i in enumerate(idx):
                out[i] = self._answer(new[row], split=s is self.answers, opened=opens_thinking(self.tok, batch[row]))
        return out  # type: ignore[return-value]

    def _pick(self, logits_BV, s: Sampling):
        import torch

        if s.temperature == 0:
            return logits_BV.argmax(-1)
        from eyas.spec.sampling import logits_to_probs

        probs = logits_to_probs(logits_BV.float(), s.temperature)
        if s.top_p < 1.0:
            p_sorted, idx = probs.sort(-1, descending=True)
            drop = p_sorted.cumsum(-1) - p_sorted > s.top_p
            probs = probs.scatter(-1, idx, p_sorted.masked_fill(drop, 0.0))
        return torch.multinomial(probs, 1, generator=self.generator).view(-1)

    def _static_batch(self, batch: list[list[int]], s: Sampling) -> list[list[int]]:
        """eyas's batched decoder (SlotCache + one CUDA graph per decode shape); rows and width bucketed."""
        from eyas.spec.static import BatchDecoder

        width = static_width(max(len(p) for p in batch), self.widths)
        # rows: the batch size, or the next power of two for a short batch (a width bucket's few
        # prompts, a round's last ones): graphs need no compilation, so a new shape costs one
        # capture, while filler rows would cost a whole batch of decode steps
        rows = min(self.rc.batch_size, max(8, 1 << (len(batch) - 1).bit_length()))
        if self.decoder is None or (self.decoder.rows, self.decoder.width, self.decoder.max_new) != (rows, width, s.max_new_tokens):
            self.decoder = None  # one decoder's caches at a time
            if self.device.startswith("cuda"):
                import torch

                torch.cuda.empty_cache()
            self.decoder = BatchDecoder(self.model, rows, width, s.max_new_tokens)
        return self.decoder.generate(batch, set(self.eos), self.pad, lambda logits_BV: self._pick(logits_BV, s))

    def _hf_batch(self, batch: list[list[int]], s: Sampling) -> list[list[int]]:
        import torch

        width = max(len(p) for p in batch)
        ids = torch.full((len(batch), width), self.pad, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, p in enumerate(batch):  # left padding: generation continues from the right edge
            ids[row, width - len(p) :] = torch.tensor(p)
            mask[row, width - len(p) :] = 1
        kw: dict[str, Any] = dict(
            max_new_tokens=s.max_new_tokens,
            do_sample=s.temperature > 0,
            eos_token_id=self.eos,
            pad_token_id=self.pad,
        )
        if s.temperature > 0:
            kw.update(temperature=s.temperature, top_p=s.top_p, top_k=0)
        else:
            kw.update(temperature=None, top_p=None, top_k=None)
        with torch.inference_mode():
            gen = self.model.generate(input_ids=ids.to(self.device), attention_mask=mask.to(self.device), **kw)
        return gen[:, width:].cpu().tolist()  # one host sync per batch

    def _answer(self, new: list[int], split: bool = True, opened: bool = False) -> Answer:
        """The answer in `new` (cut after the first eos); with `split`, its thinking block apart."""
        n, reason = len(new), "length"
        for j, t in enumerate(new):
            if t in self.eos:
                n, reason = j + 1, "stop"
                break
        if not split:
            return Answer(self.tok.decode(new[:n], skip_special_tokens=True).strip(), n, reason)
        return thinking_answer(decode_keeping(self.tok, new[:n], self.think_ids), n, reason, opened)


def thinking_answer(text: str, new_tokens: int, finish_reason: str, opened: bool) -> Answer:
    """The answer in a generated `text`, its thinking block apart (`split_think`). A generation cut
    at max_new_tokens inside its thinking block (opened by the text, or by the prompt: `opened`) has
    no answer: all of it is reasoning, and the content stays empty (regenerate ends the conversation
    there), never partial thinking stored as an answer."""
    if finish_reason == "length" and THINK_END not in text and (opened or text.lstrip().startswith(THINK_START)):
        return Answer("", new_tokens, finish_reason, text.strip().removeprefix(THINK_START).strip())
    reasoning, content = split_think(text)
    return Answer(content.strip(), new_tokens, finish_reason, reasoning.strip())


def opens_thinking(tok, prompt_ids: list[int]) -> bool:
    """Whether a prompt ends inside a thinking block (a generation prompt that ends with `<think>`)."""
    return tok.decode(prompt_ids[-4:], skip_special_tokens=False).rstrip().endswith(THINK_START)


def marker_ids(tok) -> dict[int, str]:
    """{token id: text} of `<think>` and `</think>` where each is one token of its own (Qwen3,
    Kimi, DeepSeek-R1): decoding with skip_special_tokens drops those that are special."""
    out = {}
    for marker in (THINK_START, THINK_END):
        ids = tok.encode(marker, add_special_tokens=False)
        if len(ids) == 1:
            out[ids[0]] = marker
    return out


def decode_keeping(tok, ids: list[int], markers: dict[int, str]) -> str:
    """`ids` decoded without special tokens, except the `markers`, which are written as their text."""
    if not any(t in markers for t in ids):
        return tok.decode(ids, skip_special_tokens=True)
    parts, run = [], []
    for t in ids:
        if t in markers:
            parts += [tok.decode(run, skip_special_tokens=True), markers[t]]
            run = []
        else:
            run.append(t)
    return "".join(parts) + tok.decode(run, skip_special_tokens=True)


def static_width(width: int, widths: list[int]) -> int:
    """The smallest compiled width that holds a prompt batch of `width` tokens."""
    for w in widths:
        if width <= w:
            return w
    raise EyasError(f"regenerate: a prompt of {width} tokens is wider than every regenerate.static_widths {widths}")


def eos_ids(eos, tok) -> list[int]:
    """The ids that end an answer: the generation config's eos_token_id (`eos`: an id, a list or None)
    and the tokenizer's."""
    ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tok.eos_token_id is not None:
        ids.add(tok.eos_token_id)
    if not ids:
        raise EyasError("the target defines no eos token (generation_config.eos_token_id / tokenizer.eos_token)")
    return sorted(ids)


REFUSED = {
    "empty": "an empty answer (no content, no reasoning)",
    "over_max_tokens": "longer than max_tokens",
    "not_utf8": "not UTF-8",
}
"""Why the server backend refuses an answer (Answer.refused): it is never written."""


class ServerBackend:
    """An OpenAI-compatible /v1/chat/completions endpoint (vllm serve, SGLang, ...), answers streamed.
    Every answer is checked before it is kept (JSON, UTF-8, within max_tokens, not empty) and every
    wait is bounded (stall_s, timeout_s, retries, max_retry_wait_s)."""

    def __init__(self, cfg: EyasConfig):
        self.rc = cfg.regenerate
        self.url, self.headers = server_endpoint(self.rc)
        self.shown = redact(self.rc.server_url.rstrip("/") + "/v1/chat/completions")  # in messages
        self.model = self.rc.server_model or cfg.target.model
        self.retried, self.stalls, self.waited_s = 0, 0, 0.0
        self.lock = threading.Lock()  # the counters above, from the pool's threads
        self.random = random.Random()  # the retries' jitter
        # an answer of max_new_tokens tokens takes far less: a server past this ignores max_tokens
        self.max_bytes = (1 << 20) + 4096 * self.rc.max_new_tokens
        # a streamed answer starts (its headers) at once and then sends an event per token: silence for
        # stall_s is a stall; an answer asked in one piece (extra_body stream: false) comes at its end
        self.timeout = self.rc.timeout_s if self.rc.extra_body.get("stream") is False else self.rc.stall_s

    def generate_messages(self, prompts: list[list[dict[str, str]]], ids: list[str]) -> list[Answer]:
        """Answers to the chats (earlier assistant turns carry their `reasoning_content`: the
        server's chat template decides whether to show it, as for any client)."""
        stop = threading.Event()  # this call's own: a request left over from a failed call stays stopped
        return in_daemon_threads([lambda p=p, i=i: self._one(p, i, stop) for p, i in zip(prompts, ids)],
                                 self.rc.concurrency, stop)

    def _one(self, messages: list[dict[str, str]], conv_id: str, stop: threading.Event) -> Answer:
        """One answer, retried (connection errors, 429/5xx, stalls, not JSON, cut off, empty) with
        jittered waits that honour Retry-After, each failure said when it happens."""
        body = {
            "model": self.model,
            "messages": messages,
            "max_tokens": self.rc.max_new_tokens,
            "temperature": self.rc.temperature,
            "top_p": self.rc.top_p,
            "stream": True,
            "stream_options": {"include_usage": True},
            **self.rc.extra_body,
        }
        data = json.dumps(body).encode()
        attempts, waited = self.rc.retries + 1, 0.0
        for attempt in range(1, attempts + 1):
            if stop.is_set():  # another conversation failed the chunk: its error is the one raised
                raise EyasError(f"regenerate: conversation {conv_id}: stopped, another conversation failed")
            try:
                answer = self._ask(data, conv_id)
                if answer.refused != "empty" or attempt == attempts:
                    return answer
                failure = _Retry(REFUSED["empty"])
            except _Retry as e:
                failure = e
            said = f"[eyas:regenerate] conversation {conv_id}: {failure} (attempt {attempt} of {attempts})"
            if attempt == attempts:
                print(f"{said}; {self.shown}", file=sys.stderr, flush=True)
                break
            wait = retry_wait(attempt, failure.retry_after, self.random)
            if waited + wait > self.rc.max_retry_wait_s:
                raise EyasError(f"regenerate: conversation {conv_id} at {self.shown}: {failure}; the next attempt would "
                                f"wait {wait:.1f} s more after {waited:.1f} s, past regenerate.max_retry_wait_s="
                                f"{self.rc.max_retry_wait_s:g}: raise it to wait longer, or lower "
                                "regenerate.concurrency to ask the server for less at once")
            print(f"{said}; retrying in {wait:.1f} s; {self.shown}", file=sys.stderr, flush=True)
            stop.wait(wait)
            waited += wait
            with self.lock:
                self.retried += 1
                self.waited_s += wait
        raise EyasError(f"regenerate: conversation {conv_id} failed after {attempts} attempts at {self.shown}; "
                        f"last error: {failure}")

    def _ask(self, data: bytes, conv_id: str) -> Answer:
        """One request -> its checked answer (refused ones included); _Retry for what a retry may mend."""
        req = urllib.request.Request(self.url, data=data, headers=self.headers)
        try:  # the socket timeout bounds each read: with one event per token, silence means a stall
            with _OPENER.open(req, timeout=self.timeout) as resp:
                if resp.headers.get_content_type() == "text/event-stream":
                    got = self._read_stream(resp, time.monotonic() + self.rc.timeout_s)
                else:  # a server that answers in one piece
                    got = self._read_whole(resp)
        except _Refused as e:
            return Answer("", 0, "stop", refused=e.kind, why=e.why)
        except urllib.error.HTTPError as e:
            last = f"HTTP {e.code} {e.reason}: {redact(e.read(2000).decode(errors='replace'))}"
            if e.code == 429 or e.code >= 500:
                header = e.headers.get("Retry-After")
                after = retry_after_s(header)
                raise _Retry(last + (f" (Retry-After: {header.strip()})" if after is not None else ""), after) from None
            raise EyasError(f"regenerate: {self.shown} refused conversation {conv_id}: {last}{self._hint(e.code)}") from None
        except TimeoutError as e:  # socket.timeout too
            with self.lock:
                self.stalls += 1
            raise _Retry(exception_message(e) if "timeout_s" in str(e) else
                         f"no data for {self.rc.stall_s:g} s: the server stalled (regenerate.stall_s)") from None
        except (urllib.error.URLError, ConnectionError, http.client.HTTPException) as e:
            raise _Retry(redact(f"{type(e).__name__}: {exception_message(e)}")) from None
        return self._checked(*got)

    def _hint(self, code: int) -> str:
        """What to do about a 401/403: the key or credentials sent were refused, or none was sent."""
        if code not in (401, 403):
            return ""
        if self.rc.server_api_key_env:
            return (f" (the server refused the API key in {self.rc.server_api_key_env} (regenerate.server_api_key_env): "
                    "check that it is this server's key)")
        if "Authorization" in self.headers:
            return " (the server refused the credentials in regenerate.server_url)"
        return (" (the server wants an API key: put it in an environment variable and name that variable in "
                "--regenerate.server_api_key_env)" if code == 401 else "")

    def _checked(self, text: str, reasoning: str, n: int, reason: str) -> Answer:
        """The answer kept, or refused: over max_tokens by the server's own count, text that cannot be
        UTF-8 (an escaped lone surrogate), or empty."""
        if n > self.rc.max_new_tokens:
            return _refused("over_max_tokens", f"the server counted {n} tokens for max_tokens={self.rc.max_new_tokens}: "
                            "it ignores max_tokens")
        for part in (text, reasoning):
            try:
                part.encode("utf-8")
            except UnicodeEncodeError as e:
                return _refused("not_utf8", f"{part[e.start:e.end]!r} (a lone surrogate) at character {e.start:,}")
        if not text.strip() and not reasoning.strip():
            return _refused("empty", "")
        if not reasoning:  # a server without a reasoning parser: the thinking block is in the content
            reasoning, text = split_think(text)
        return Answer(text.strip(), n, "length" if reason == "length" else "stop", reasoning.strip())

    def _too_long(self) -> _Refused:
        return _Refused("over_max_tokens", f"more than {self.max_bytes:,} bytes for max_tokens={self.rc.max_new_tokens} "
                        "(1 MiB + 4 KiB a token): the server ignores max_tokens; read no further")

    def _read_stream(self, resp, deadline: float) -> tuple[str, str, int, str]:
        """(content, reasoning, completion tokens, finish reason) from server-sent events."""
        text, reasoning, n, reason, size = [], [], 0, "stop", 0
        while raw := resp.readline(self.max_bytes + 1 - size):
            size += len(raw)
            if size > self.max_bytes:
                raise self._too_long()
            if time.monotonic() > deadline:
                raise TimeoutError(f"the answer took longer than regenerate.timeout_s={self.rc.timeout_s:g} s")
            line = _utf8(raw, size - len(raw)).strip()
            if not line.startswith("data:"):
                continue
            event = line[5:].strip()
            if event == "[DONE]":
                return "".join(text), "".join(reasoning), n, reason
            try:
                chunk = json.loads(event)
                if "error" in chunk:
                    raise _Retry(f"the server reported an error mid-answer: {redact(str(chunk['error'])[:500])}")
                usage = chunk.get("usage") or {}
                n = int(usage.get("completion_tokens") or n)
                for choice in chunk.get("choices") or []:
                    delta = choice.get("delta") or {}
                    text.append(delta.get("content") or "")
                    reasoning.append(delta.get(REASONING) or delta.get("reasoning") or "")
                    reason = choice.get("finish_reason") or reason
            except (ValueError, TypeError, AttributeError) as e:
                raise _Retry(f"a malformed event: {redact(event[:500])!r} ({type(e).__name__}: "
                             f"{exception_message(e)})") from None
            if not all(isinstance(x, str) for x in (text[-1:] + reasoning[-1:])):
                raise _Retry(f"a malformed event: {redact(event[:500])!r} (content and reasoning must be strings)")
        raise _Retry("the connection closed before the answer's end ([DONE])")

    def _read_whole(self, resp) -> tuple[str, str, int, str]:
        """(content, reasoning, completion tokens, finish reason) from an answer in one piece."""
        raw = resp.read(self.max_bytes + 1)
        if len(raw) > self.max_bytes:
            raise self._too_long()
        body = _utf8(raw, 0)
        try:
            payload = json.loads(body)
        except ValueError:
            raise _Retry(f"the answer is not JSON (Content-Type: {resp.headers.get('Content-Type')}, {len(raw):,} "
                         f"bytes): {redact(body[:500])!r}") from None
        try:
            choice = payload["choices"][0]
            message = choice["message"]
            text = message["content"] or ""
            reasoning = message.get(REASONING) or message.get("reasoning") or ""
            n = int((payload.get("usage") or {}).get("completion_tokens", 0))
            if not (isinstance(text, str) and isinstance(reasoning, str)):
                raise TypeError("content and reasoning must be strings")
        except (KeyError, IndexError, TypeError, AttributeError, ValueError) as e:
            raise _Retry(f"a malformed answer: {redact(str(payload)[:500])} ({type(e).__name__}: "
                         f"{exception_message(e)})") from None
        return text, reasoning, n, choice.get("finish_reason") or "stop"


def in_daemon_threads(calls: list, n: int, stop: threading.Event) -> list:
    """[call() for call in calls], `n` at a time in daemon threads; the first error is raised as soon
    as it happens, with `stop` set (no further call starts; the retry loops of those in flight end).
    Daemon threads, not a ThreadPoolExecutor: its workers are joined when Python exits, so a request
    held by a server (up to regenerate.stall_s) would keep a stopped command (SIGTERM, Ctrl-C, an
    error) from exiting; a daemon thread ends with the process."""
    results: list = [None] * len(calls)
    todo = iter(enumerate(calls))
    lock, ended = threading.Lock(), queue.Queue()

    def worker() -> None:
        try:
            while not stop.is_set():
                with lock:
                    item = next(todo, None)
                if item is None:
                    break
                results[item[0]] = item[1]()
        except BaseException as e:  # handed to the caller's thread, which raises it
            ended.put(e)  # before `stop`: the others' "stopped, another conversation failed" come after it
            stop.set()
            return
        ended.put(None)

    threads = [threading.Thread(target=worker, daemon=True, name=f"eyas-request-{k}") for k in range(min(n, len(calls)))]
    for t in threads:
        t.start()
    try:
        for _ in threads:  # Queue.get is interrupted by a signal's exception (SIGTERM, Ctrl-C)
            failure = ended.get()
            if failure is not None:
                raise failure
    except BaseException:
        stop.set()
        raise
    return results


def retry_wait(attempt: int, retry_after: float | None, rng: random.Random) -> float:
    """Seconds before attempt `attempt` + 1: the server's Retry-After plus up to a quarter of it (never
    sooner than it asked), else 1, 2, 4, ... (at most 30) times 0.5 to 1.5: requests turned away
    together spread out instead of coming back together."""
    if retry_after is not None:
        return retry_after * (1 + 0.25 * rng.random())
    return min(2.0 ** (attempt - 1), 30.0) * (0.5 + rng.random())


def retry_after_s(header: str | None) -> float | None:
    """The seconds a Retry-After header asks for (a number of seconds or an HTTP date); None when
    absent or unreadable."""
    value = (header or "").strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if when is None or when.tzinfo is None:
        return None
    return max(0.0, when.timestamp() - time.time())


def _utf8(raw: bytes, offset: int) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _Refused("not_utf8", f"the bytes {raw[e.start:e.end]!r} at byte {offset + e.start:,} of the "
                       "response") from None


def _refused(kind: str, why: str) -> Answer:
    return Answer("", 0, "stop", refused=kind, why=why)


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    """A redirect is an error (HTTPError 30x): urllib would send the Authorization header on to another host."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        return None


_OPENER = urllib.request.build_opener(_NoRedirects)


class _Retry(Exception):
    """A failed attempt a retry may mend (connection error, 429/5xx, stall, an answer not JSON or cut
    off): its message, and the seconds the server asked to wait (Retry-After) or None."""

    def __init__(self, message: str, retry_after: float | None = None):
        super().__init__(message)
        self.retry_after = retry_after


class _Refused(Exception):
    """An answer read no further (over the byte bound, not UTF-8): refused as REFUSED[kind]."""

    def __init__(self, kind: str, why: str):
        super().__init__(why)
        self.kind, self.why = kind, why


def server_endpoint(rc) -> tuple[str, dict[str, str]]:
    """(the chat-completions URL without credentials, the request headers): credentials in
    regenerate.server_url become basic auth, the key in the environment variable
    regenerate.server_api_key_env a bearer token; both are secrets eyas.errors.redact hides from
    then on. ConfigError when that variable is unset."""
    parts = urllib.parse.urlsplit(rc.server_url.rstrip("/") + "/v1/chat/completions")
    headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
    if parts.username is not None:
        user = urllib.parse.unquote(parts.username) + ":" + urllib.parse.unquote(parts.password or "")
        headers["Authorization"] = "Basic " + base64.b64encode(user.encode()).decode()
        for secret in (parts.password or "", urllib.parse.unquote(parts.password or ""), headers["Authorization"][6:]):
            add_secret(secret)  # a server or proxy that echoes what it was sent shows ***
        parts = parts._replace(netloc=parts.hostname + (f":{parts.port}" if parts.port else ""))
    if rc.server_api_key_env:
        key = os.environ.get(rc.server_api_key_env, "")
        if not key:
            raise ConfigError(f"regenerate.server_api_key_env={rc.server_api_key_env}: that environment variable is "
                              "not set or empty; export the server's API key in it")
        if "Authorization" in headers:
            raise ConfigError("regenerate.server_url carries credentials and regenerate.server_api_key_env names a key: "
                              "give one of them")
        headers["Authorization"] = f"Bearer {key}"
        add_secret(key)
    return urllib.parse.urlunsplit(parts), headers
