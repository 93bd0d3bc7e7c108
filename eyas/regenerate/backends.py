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
                 answer cut off, and a stall (nothing received for `stall_s`, reported when it
                 happens) are retried `retries` times with backoff, then the run fails naming the
                 conversation, the attempts and the last error. An API key comes from the
                 environment variable `server_api_key_env`; URL credentials go as basic auth and
                 are shown redacted. `generate_messages(chats, ids) -> [Answer]`. The response
                 message's `reasoning_content` (SGLang, vLLM before 0.11) or `reasoning` (vLLM)
                 is the answer's reasoning; without either, a thinking block inline in `content`
                 is split off as the HF backend does.
"""

from __future__ import annotations

import base64
import http.client
import json
import os
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from eyas.chat import REASONING, THINK_END, THINK_START, split_think
from eyas.config import EyasConfig
from eyas.errors import ConfigError, EyasError, exception_message, redact_urls


@dataclass
class Answer:
    text: str
    new_tokens: int
    finish_reason: str  # "stop" | "length"
    reasoning: str = ""  # the thinking block, without its <think> markers ("" when none)


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


class ServerBackend:
    """An OpenAI-compatible /v1/chat/completions endpoint (vllm serve, SGLang, ...), answers streamed."""

    def __init__(self, cfg: EyasConfig):
        self.rc = cfg.regenerate
        self.url, self.headers = server_endpoint(self.rc)
        self.shown = redact_urls(self.rc.server_url.rstrip("/") + "/v1/chat/completions")  # in messages
        self.model = self.rc.server_model or cfg.target.model
        self.retried = 0
        self.stalls = 0
        # a streamed answer starts (its headers) at once and then sends an event per token: silence for
        # stall_s is a stall; an answer asked in one piece (extra_body stream: false) comes at its end
        self.timeout = self.rc.timeout_s if self.rc.extra_body.get("stream") is False else self.rc.stall_s

    def generate_messages(self, prompts: list[list[dict[str, str]]], ids: list[str]) -> list[Answer]:
        """Answers to the chats (earlier assistant turns carry their `reasoning_content`: the
        server's chat template decides whether to show it, as for any client)."""
        with ThreadPoolExecutor(max_workers=self.rc.concurrency) as pool:
            return list(pool.map(self._one, prompts, ids))

    def _one(self, messages: list[dict[str, str]], conv_id: str) -> Answer:
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
        last = ""
        attempts = self.rc.retries + 1
        for attempt in range(attempts):
            if attempt:
                self.retried += 1
                time.sleep(min(2.0 ** (attempt - 1), 30.0))
            req = urllib.request.Request(self.url, data=data, headers=self.headers)
            try:  # the socket timeout bounds each read: with one event per token, silence means a stall
                with _OPENER.open(req, timeout=self.timeout) as resp:
                    if resp.headers.get_content_type() == "text/event-stream":
                        text, reasoning, n, reason = self._read_stream(resp, conv_id, time.monotonic() + self.rc.timeout_s)
                    else:  # a server that answers in one piece
                        text, reasoning, n, reason = self._read_whole(json.loads(resp.read()), conv_id)
            except urllib.error.HTTPError as e:
                detail = redact_urls(e.read().decode(errors="replace")[:2000])
                last = f"HTTP {e.code} {e.reason}: {detail}"
                if e.code == 429 or e.code >= 500:
                    continue
                hint = (" (the server wants an API key: put it in an environment variable and name that variable in "
                        "--regenerate.server_api_key_env)" if e.code == 401 else "")
                raise EyasError(f"regenerate: {self.shown} refused conversation {conv_id}: {last}{hint}") from None
            except TimeoutError as e:  # socket.timeout too
                self.stalls += 1
                last = (exception_message(e) if "timeout_s" in str(e) else
                        f"no data for {self.rc.stall_s:g} s: the server stalled (regenerate.stall_s)")
                print(f"[eyas:regenerate] conversation {conv_id}: {last}; {self.shown}, attempt {attempt + 1} of "
                      f"{attempts}", file=sys.stderr, flush=True)
                continue
            except (urllib.error.URLError, ConnectionError, http.client.HTTPException) as e:
                last = redact_urls(f"{type(e).__name__}: {exception_message(e)}")
                continue
            except _RetryableStreamError as e:
                last = str(e)
                continue
            if not reasoning:  # a server without a reasoning parser: the thinking block is in the content
                reasoning, text = split_think(text)
            return Answer(text.strip(), n, "length" if reason == "length" else "stop", reasoning.strip())
        raise EyasError(f"regenerate: conversation {conv_id} failed after {attempts} attempts at {self.shown}; "
                        f"last error: {last}")

    def _read_stream(self, resp, conv_id: str, deadline: float) -> tuple[str, str, int, str]:
        """(content, reasoning, completion tokens, finish reason) from server-sent events."""
        text, reasoning, n, reason = [], [], 0, "stop"
        for raw in resp:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the answer took longer than regenerate.timeout_s={self.rc.timeout_s:g} s")
            line = raw.decode(errors="replace").strip()
            if not line.startswith("data:"):
                continue
            event = line[5:].strip()
            if event == "[DONE]":
                return "".join(text), "".join(reasoning), n, reason
            try:
                chunk = json.loads(event)
                if "error" in chunk:
                    raise _RetryableStreamError(f"the server reported an error mid-answer: {str(chunk['error'])[:500]}")
                usage = chunk.get("usage") or {}
                n = int(usage.get("completion_tokens") or n)
                for choice in chunk.get("choices") or []:
                    delta = choice.get("delta") or {}
                    text.append(delta.get("content") or "")
                    reasoning.append(delta.get(REASONING) or delta.get("reasoning") or "")
                    reason = choice.get("finish_reason") or reason
            except (ValueError, TypeError, AttributeError) as e:
                raise EyasError(f"regenerate: malformed event from {self.shown} for conversation {conv_id}: "
                                f"{event[:500]!r} ({type(e).__name__}: {exception_message(e)})") from e
            if not all(isinstance(x, str) for x in (text[-1:] + reasoning[-1:])):
                raise EyasError(f"regenerate: malformed event from {self.shown} for conversation {conv_id}: "
                                f"{event[:500]!r} (content and reasoning must be strings)")
        raise _RetryableStreamError("the connection closed before the answer's end ([DONE])")

    def _read_whole(self, payload: dict[str, Any], conv_id: str) -> tuple[str, str, int, str]:
        try:
            choice = payload["choices"][0]
            message = choice["message"]
            text = message["content"] or ""
            reasoning = message.get(REASONING) or message.get("reasoning") or ""
            n = int((payload.get("usage") or {}).get("completion_tokens", 0))
            if not (isinstance(text, str) and isinstance(reasoning, str)):
                raise TypeError("content and reasoning must be strings")
        except (KeyError, IndexError, TypeError, AttributeError) as e:
            raise EyasError(f"regenerate: malformed response from {self.shown} for conversation {conv_id}: "
                            f"{str(payload)[:500]}") from e
        return text, reasoning, n, choice.get("finish_reason") or "stop"


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    """A redirect is an error (HTTPError 30x): urllib would send the Authorization header on to another host."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        return None


_OPENER = urllib.request.build_opener(_NoRedirects)


class _RetryableStreamError(Exception):
    """A streamed answer that broke off (closed early, an error event): retried like a 5xx."""


def server_endpoint(rc) -> tuple[str, dict[str, str]]:
    """(the chat-completions URL without credentials, the request headers): credentials in
    regenerate.server_url become basic auth, the key in the environment variable
    regenerate.server_api_key_env a bearer token. ConfigError when that variable is unset."""
    parts = urllib.parse.urlsplit(rc.server_url.rstrip("/") + "/v1/chat/completions")
    headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
    if parts.username is not None:
        user = urllib.parse.unquote(parts.username) + ":" + urllib.parse.unquote(parts.password or "")
        headers["Authorization"] = "Basic " + base64.b64encode(user.encode()).decode()
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
    return urllib.parse.urlunsplit(parts), headers
