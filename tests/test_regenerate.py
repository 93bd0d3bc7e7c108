"""regenerate: turn-by-turn answers from the real SmolLM2, equal to an independent batch-1 greedy
`generate`; resume never redoes a finished conversation; the server backend against a real
OpenAI-compatible server on loopback, with retries that never hide an error."""

from __future__ import annotations

import json

import pytest
import torch

from eyas.cli import main as cli
from eyas.config import load_config
from eyas.errors import EyasError
from eyas.regenerate import main as regenerate
from regenerate_helpers import ChatServer, greedy_reply

CONVS = [
    {"id": "a", "messages": [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."},
                             {"role": "user", "content": "Another one?"}, {"role": "assistant", "content": "Red."}]},
    {"id": "b", "messages": [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "5"}]},
    {"id": "c", "messages": [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Hello!"},
                             {"role": "assistant", "content": "Hi"}]},
]
NEW = 6


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    p = tmp_path_factory.mktemp("data") / "chats.jsonl"
    p.write_text("\n".join(json.dumps(c) for c in CONVS) + "\n")
    return p


@pytest.fixture(scope="module")
def target(smollm2_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(str(smollm2_dir))


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


def test_hf_backend_equals_batch1_greedy_and_resumes(tmp_path, data, target):
    model, tok = target
    s = regenerate(cfg_for(tmp_path, data, "--prepare.max_conversations=2", "--regenerate.chunk_conversations=1"))
    assert s["regenerated_now"] == 2 and s["turns"] == 3
    first = read(tmp_path / "regenerate" / "conversations.jsonl")
    # resume: the third conversation only; the two finished ones are not redone
    s = regenerate(cfg_for(tmp_path, data, "--regenerate.chunk_conversations=1"))
    assert s["resumed_from"] == 2 and s["regenerated_now"] == 1 and s["conversations_written"] == 3
    recs = read(tmp_path / "regenerate" / "conversations.jsonl")
    assert recs[:2] == first
    for rec, conv in zip(recs, CONVS):
        assert rec["id"] == conv["id"]
        assert rec["messages"] == reference(model, tok, conv)
        first_answer = [m["content"] for m in rec["messages"] if m["role"] == "assistant"][0]
        assert first_answer != [m["content"] for m in conv["messages"] if m["role"] == "assistant"][0]  # really regenerated
    # a torn last line (killed mid-write) is cut and that conversation redone
    path = tmp_path / "regenerate" / "conversations.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(lines[:2]) + lines[2][:15])
    s = regenerate(cfg_for(tmp_path, data))
    assert s["regenerated_now"] == 1 and read(path) == recs
    # prepare reads the regenerated conversations
    rc = cli(["prepare", f"--run_dir={tmp_path}", f"--prepare.data={path}", "--prepare.draft_vocab_size=100"])
    assert rc == 0


def test_server_backend_real_model_on_loopback(tmp_path, data, target):
    model, tok = target
    with ChatServer(model, tok) as srv:
        s = regenerate(cfg_for(tmp_path, data, "--regenerate.backend=server", f"--regenerate.server_url={srv.url}",
                               "--regenerate.concurrency=2"))
    assert s["conversations_written"] == 3 and s["server_retries"] == 0
    recs = read(tmp_path / "regenerate" / "conversations.jsonl")
    for rec, conv in zip(recs, CONVS):
        assert rec["messages"] == reference(model, tok, conv)


def test_server_retries_then_succeeds(tmp_path, data, target):
    model, tok = target
    with ChatServer(model, tok, mode="flaky") as srv:
        s = regenerate(cfg_for(tmp_path, data, "--prepare.max_conversations=1", "--regenerate.backend=server",
                               f"--regenerate.server_url={srv.url}", "--regenerate.retries=2", "--regenerate.concurrency=1"))
    assert s["server_retries"] == 1 and s["conversations_written"] == 1


def test_server_that_keeps_failing_fails_the_run_loudly(tmp_path, data, capsys):
    with ChatServer(mode="fail") as srv:
        with pytest.raises(EyasError) as e:
            regenerate(cfg_for(tmp_path, data, "--prepare.max_conversations=1", "--regenerate.backend=server",
                               f"--regenerate.server_url={srv.url}", "--regenerate.retries=1"))
    msg = str(e.value)
    assert "conversation a" in msg and "after 2 attempts" in msg and "HTTP 503" in msg and "overloaded" in msg
    assert not (tmp_path / "regenerate" / "meta.json").exists()  # never marked complete
