"""Shared by the regenerate tests: the conversations, the stage's config, the independent reference
(turn by turn, batch-1 greedy generate) and the output reader."""

from __future__ import annotations

import json

from eyas.config import load_config
from tests.regenerate.chat_server import greedy_reply


CONVS = [
    {"id": "a", "messages": [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."},
                             {"role": "user", "content": "Another one?"}, {"role": "assistant", "content": "Red."}]},
    {"id": "b", "messages": [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "5"}]},
    {"id": "c", "messages": [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Hello!"},
                             {"role": "assistant", "content": "Hi"}]},
]
NEW = 6


def cfg_for(tmp_path, data, *extra):
    return load_config(None, [f"--run_dir={tmp_path}", f"--prepare.data={data}", "--target.dtype=float32",
                              f"--regenerate.max_new_tokens={NEW}", *extra])


def reference(model, tok, conv):
    """Turn by turn, each answer generated from the conversation so far with the new answers."""
    msgs = [m for m in conv["messages"][:1] if m["role"] == "system"]
    for m in conv["messages"]:
        if m["role"] == "user":
            msgs = msgs + [m]
            msgs = msgs + [{"role": "assistant", "content": greedy_reply(model, tok, msgs, NEW)[0]}]
    return msgs


def read(path):
    return [json.loads(line) for line in path.read_text().splitlines()]
