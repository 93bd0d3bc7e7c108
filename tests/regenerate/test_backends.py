"""eyas.regenerate.backends: the HF backend's static path (eyas's BatchDecoder, eagerly on CPU) equal to
batch-1 greedy; the server backend against a real OpenAI-compatible server on loopback, with
retries that never hide an error."""

from __future__ import annotations

import pytest

from eyas.errors import EyasError
from eyas.regenerate import main as regenerate
from tests.regenerate.chat_server import ChatServer, greedy_reply
from tests.regenerate.runs import CONVS, NEW, cfg_for, read, reference


def test_batch_decoder_equals_batch1_greedy(target):
    """eyas's static-cache batched decoder (eagerly on CPU; as CUDA graphs on GPUs): left-padded
    prompts of several lengths plus filler rows give each prompt's batch-1 greedy answer, cut
    after the first eos, also when each step reads only the slots written so far (small kv_block)."""
    from eyas.spec.static import BatchDecoder

    model, tok = target
    chats = [[{"role": "user", "content": "Name a colour."}],
             [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Hello there, friend!"}],
             [{"role": "user", "content": "What is 2+2? Answer with one number."}]]
    prompts = [tok.apply_chat_template(c, add_generation_prompt=True, tokenize=True, return_dict=False) for c in chats]
    width = max(map(len, prompts)) + 3
    dec = BatchDecoder(model, rows=5, width=width, max_new=12, check_every=4, kv_block=4)
    assert {dec.window(width + i) for i in range(12)} == {min(width + 12, -(-(width + i + 1) // 4) * 4) for i in range(12)}
    assert len({dec.window(width + i) for i in range(12)}) >= 3  # the steps read growing windows
    got = dec.generate(prompts, {tok.eos_token_id}, tok.eos_token_id, lambda logits: logits.argmax(-1))
    for chat, new in zip(chats, got):
        text, n, reason = greedy_reply(model, tok, chat, 12)
        assert len(new) == n and tok.decode(new, skip_special_tokens=True).strip() == text
        assert (new[-1] == tok.eos_token_id) == (reason == "stop")
    assert any(new[-1] == tok.eos_token_id for new in got) and any(len(new) == 12 for new in got)


def test_hf_backend_static_path_on_cpu(tmp_path, data, target):
    """The CUDA default (BatchDecoder, rows and widths bucketed), run eagerly on CPU through the
    backend's own batching: 3 prompts in batches of 2 (the last one filled up with a filler row) and
    two width buckets, each answer equal to batch-1 greedy."""
    from eyas.regenerate.backends import HFBackend

    model, tok = target
    cfg = cfg_for(tmp_path, data, "--regenerate.batch_size=2", "--regenerate.static_widths=[32,64]")
    backend = HFBackend(cfg, tok)
    backend.static = True  # what CUDA selects; the same code runs eagerly here
    chats = [[{"role": "user", "content": "Hi!"}], [{"role": "user", "content": "Name a colour."}],
             [{"role": "system", "content": "Answer in French, briefly and politely, please."},
              {"role": "user", "content": "Hello there, my good friend!"}]]
    prompts = [tok.apply_chat_template(c, add_generation_prompt=True, tokenize=True, return_dict=False) for c in chats]
    assert sorted(len(p) <= 32 for p in prompts) == [False, True, True]
    answers = backend.generate(prompts)
    for chat, a in zip(chats, answers):
        text, n, reason = greedy_reply(model, tok, chat, NEW)
        assert (a.text, a.new_tokens, a.finish_reason) == (text, n, reason)
    assert (backend.decoder.rows, backend.decoder.width) == (2, 64)  # the last batch: 1 prompt + 1 filler


def test_static_width_buckets():
    from eyas.regenerate.backends import static_width

    assert [static_width(w, [512, 1536]) for w in (1, 512, 513, 1536)] == [512, 512, 1536, 1536]
    with pytest.raises(EyasError, match="wider than every"):
        static_width(1537, [512, 1536])


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
