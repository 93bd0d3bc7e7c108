"""A small OpenAI-compatible /v1/chat/completions server around a real HF model, on loopback."""

from __future__ import annotations

import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch


def greedy_reply(model, tok, messages, max_new_tokens: int) -> tuple[str, int, str]:
    """The independent reference: batch-1 greedy `generate` on the chat-templated prompt."""
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    with torch.inference_mode():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
            temperature=None, top_p=None, top_k=None, pad_token_id=tok.eos_token_id,
        )
    new = out[0, ids.shape[1]:].tolist()
    reason = "length"
    if tok.eos_token_id in new:
        new = new[: new.index(tok.eos_token_id) + 1]
        reason = "stop"
    return tok.decode(new, skip_special_tokens=True).strip(), len(new), reason


def thinking_for(messages) -> str:
    """The reasoning the server reports in 'reasoning' mode: a fixed text about the last user turn
    (SmolLM2 does not think), so tests know it without the code under test."""
    return f"The user wrote: {messages[-1]['content']}\nI answer briefly."


BAD_BYTES = b"\xff\xfe"
"""What 'badbytes' puts into an answer: never valid UTF-8."""
HTML = b"<html><head><title>502 Bad Gateway</title></head><body><h1>502 Bad Gateway</h1></body></html>"


class ChatServer:
    """mode: 'model' (real answers), 'fail' (always HTTP 503), 'flaky' (503 on the first request),
    'stall' (holds each request without a byte until the mode changes: a server that stopped
    generating but keeps its connections open), and what misbehaving servers and the proxies before
    them send: 'html' (200 with an HTML page), 'truncated' (200 with the answer's JSON cut in half),
    'ratelimit' (429 with `Retry-After: retry_after`), 'empty' (an empty answer), 'long' (the real
    model ignoring max_tokens: `long_tokens` tokens, reported in usage), 'huge' (`huge_bytes` of
    text, no usage), 'badbytes' (BAD_BYTES inside the answer), 'echo401' (401 whose body echoes the
    Authorization header). `times`: the mode holds for that many requests, then 'model'.
    `stream`: answers as server-sent events (one per word, then usage and [DONE]), as vllm serve.
    `reasoning_key` ('reasoning' as vLLM >= 0.11, 'reasoning_content' as SGLang): the response
    message also carries thinking_for(messages) under that key, as a server with a reasoning parser.
    Every request body is kept in `bodies`, its arrival (time.monotonic()) in `arrivals`."""

    def __init__(self, model=None, tok=None, mode: str = "model", reasoning_key: str = "", port: int = 0,
                 times: int | None = None, stream: bool = False):
        self.model, self.tok, self.mode, self.reasoning_key = model, tok, mode, reasoning_key
        self.times, self.stream = times, stream
        self.retry_after, self.long_tokens, self.huge_bytes = "1", 40, 1_500_000
        self.bodies: list[dict] = []
        self.arrivals: list[float] = []
        self.requests = 0
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep test output clean
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with server.lock:
                    server.requests += 1
                    n = server.requests
                    server.bodies.append(body)
                    server.arrivals.append(time.monotonic())
                mode = server.mode if server.times is None or n <= server.times else "model"
                if self.path != "/v1/chat/completions":
                    return self._send(404, {"error": "not found"})
                if mode == "fail" or (mode == "flaky" and n == 1):
                    return self._send(503, {"error": "overloaded"})
                if mode == "ratelimit":
                    return self._send(429, {"error": "rate limit reached"}, {"Retry-After": server.retry_after})
                if mode == "echo401":
                    return self._send(401, {"error": f"invalid API key: {self.headers.get('Authorization')}"})
                if mode == "html":
                    return self._raw(200, "text/html", HTML)
                while server.mode == "stall":
                    time.sleep(0.05)
                text, ntok, reason = self._reply(mode, body)
                message = {"role": "assistant", "content": text}
                if server.reasoning_key:
                    message[server.reasoning_key] = thinking_for(body["messages"])
                usage = {} if mode == "huge" else {"usage": {"completion_tokens": ntok}}
                if server.stream and body.get("stream"):
                    return self._events(message, reason, usage)
                data = json.dumps({"choices": [{"index": 0, "message": message, "finish_reason": reason}], **usage}).encode()
                if mode == "truncated":
                    data = data[: len(data) // 2]
                self._raw(200, "application/json", data.replace(b"@BAD@", BAD_BYTES))

            def _reply(self, mode, body) -> tuple[str, int, str]:
                if mode == "empty":
                    return "", 1, "stop"
                if mode == "huge":
                    return "word " * (server.huge_bytes // 5), server.huge_bytes // 5, "stop"
                max_new = server.long_tokens if mode == "long" else body["max_tokens"]
                with server.lock:  # one generate at a time: the model is shared
                    text, ntok, reason = greedy_reply(server.model, server.tok, body["messages"], max_new)
                return (text + " @BAD@ end" if mode == "badbytes" else text), ntok, reason

            def _events(self, message, reason, usage):
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                text = message["content"]
                step = max(1, len(text) // 1000)  # a word an event; a huge answer in a thousand events
                pieces = text.split(" ") if step == 1 else [text[i:i + step] for i in range(0, len(text), step)]
                deltas = [{"role": "assistant", "content": p if i == 0 or step > 1 else " " + p} for i, p in enumerate(pieces)]
                if server.reasoning_key:
                    deltas.insert(0, {server.reasoning_key: message[server.reasoning_key]})
                chunks = [{"choices": [{"index": 0, "delta": d, "finish_reason": None}]} for d in deltas]
                chunks += [{"choices": [{"index": 0, "delta": {}, "finish_reason": reason}]}, {"choices": [], **usage}]
                for c in chunks:
                    self.wfile.write(b"data: " + json.dumps(c).encode().replace(b"@BAD@", BAD_BYTES) + b"\n\n")
                self.wfile.write(b"data: [DONE]\n\n")

            def _send(self, code, obj, headers=None):
                self._raw(code, "application/json", json.dumps(obj).encode(), headers)

            def _raw(self, code, content_type, data, headers=None):
                self.send_response(code)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(data)))
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(data)

        class Server(ThreadingHTTPServer):
            def handle_error(self, request, client_address):  # a client that gave up (a stall test): not news
                if not isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):
                    super().handle_error(request, client_address)

        self.httpd = Server(("127.0.0.1", port), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()
