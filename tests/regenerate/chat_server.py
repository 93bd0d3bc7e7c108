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


class ChatServer:
    """mode: 'model' (real answers), 'fail' (always HTTP 503), 'flaky' (503 on the first request),
    'stall' (holds each request without a byte until the mode changes: a server that stopped
    generating but keeps its connections open).
    `reasoning_key` ('reasoning' as vLLM >= 0.11, 'reasoning_content' as SGLang): the response
    message also carries thinking_for(messages) under that key, as a server with a reasoning parser.
    Every request body is kept in `bodies`."""

    def __init__(self, model=None, tok=None, mode: str = "model", reasoning_key: str = "", port: int = 0):
        self.model, self.tok, self.mode, self.reasoning_key = model, tok, mode, reasoning_key
        self.bodies: list[dict] = []
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
                if self.path != "/v1/chat/completions":
                    return self._send(404, {"error": "not found"})
                if server.mode == "fail" or (server.mode == "flaky" and n == 1):
                    return self._send(503, {"error": "overloaded"})
                while server.mode == "stall":
                    time.sleep(0.05)
                with server.lock:  # one generate at a time: the model is shared
                    text, ntok, reason = greedy_reply(server.model, server.tok, body["messages"], body["max_tokens"])
                message = {"role": "assistant", "content": text}
                if server.reasoning_key:
                    message[server.reasoning_key] = thinking_for(body["messages"])
                self._send(200, {
                    "choices": [{"index": 0, "message": message, "finish_reason": reason}],
                    "usage": {"completion_tokens": ntok},
                })

            def _send(self, code, obj):
                data = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
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
