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


@pytest.mark.parametrize("key", ["reasoning", "reasoning_content"])  # vLLM >= 0.11, SGLang (and vLLM before)
def test_server_reasoning_reaches_the_file_the_next_prompt_and_prepares_mask(tmp_path, data, target, key, capsys):
    """A server with a reasoning parser answers with the thinking apart: it is written as the
    message's reasoning_content, sent back with the earlier turn, and prepare (Qwen3's template)
    masks it in with its think markers on the last turn, while the first turn keeps its content only."""
    from eyas import Prepared
    from eyas.cli import main as cli
    from tests.reasoning_templates import QWEN3_TEMPLATE
    from tests.regenerate.chat_server import thinking_for
    from tests.test_prepare import masked_runs

    model, tok = target
    with ChatServer(model, tok, reasoning_key=key) as srv:
        regenerate(cfg_for(tmp_path, data, "--regenerate.backend=server", f"--regenerate.server_url={srv.url}",
                           "--regenerate.concurrency=1"))
    path = tmp_path / "regenerate" / "conversations.jsonl"
    recs = {r["id"]: r for r in read(path)}
    for conv in CONVS:  # expected: the server's thinking text and batch-1 greedy answers, turn by turn
        msgs = [m for m in conv["messages"][:1] if m["role"] == "system"]
        for m in conv["messages"]:
            if m["role"] == "user":
                msgs = msgs + [m]
                msgs = msgs + [{"role": "assistant", "content": greedy_reply(model, tok, msgs, NEW)[0],
                                "reasoning_content": f"The user wrote: {m['content']}\nI answer briefly."}]
        assert recs[conv["id"]]["messages"] == msgs
        assert all(m["content"] for m in msgs)
    second = [b["messages"] for b in srv.bodies if len(b["messages"]) == 3]  # conversation a, second turn
    assert second == [recs["a"]["messages"][:3]] and second[0][1]["reasoning_content"] == thinking_for(second[0][:1])

    template = tmp_path / "qwen3.jinja"
    template.write_text(QWEN3_TEMPLATE)
    assert cli(["prepare", f"--run_dir={tmp_path}", f"--prepare.data={path}", f"--target.chat_template={template}",
                "--prepare.draft_vocab_size=100"]) == 0
    p = Prepared(tmp_path / "prepare")
    assert p.meta["counts"]["reasons"]["reasoning_not_rendered"] == 1  # conversation a's first answer
    for i in range(len(p)):
        s = p[i]
        turns = [m for m in recs[s["id"]]["messages"] if m["role"] == "assistant"]
        want = [m["content"] + "<|im_end|>" for m in turns[:-1]]
        want.append(f"<think>\n{turns[-1]['reasoning_content']}\n</think>\n\n{turns[-1]['content']}<|im_end|>")
        assert masked_runs(tok, s["input_ids"].tolist(), s["loss_mask"].tolist()) == want, s["id"]
    # without a template that shows it, the last reasoning is an error naming the conversation and the flag
    capsys.readouterr()
    assert cli(["prepare", f"--run_dir={tmp_path / 'chatml'}", f"--prepare.data={path}", "--prepare.draft_vocab_size=100"]) == 2
    err = capsys.readouterr().err
    assert "conversation a: the chat template does not render the reasoning" in err and "--prepare.reasoning=drop" in err
    assert cli(["prepare", f"--run_dir={tmp_path / 'chatml'}", f"--prepare.data={path}", "--prepare.draft_vocab_size=100",
                "--prepare.reasoning=drop"]) == 0
    assert Prepared(tmp_path / "chatml" / "prepare").meta["counts"]["reasons"]["reasoning_dropped"] == 4


def test_hf_backend_keeps_the_thinking_block_of_special_think_tokens(tmp_path, data, target):
    """<think>/</think> as special tokens (Kimi's) vanish with skip_special_tokens; the answer keeps
    them apart as its reasoning, with or without the opener (templates whose prompt writes it)."""
    from eyas.regenerate.backends import HFBackend
    from tests.reasoning_templates import tokenizer_with

    _, tok = target
    think_tok = tokenizer_with(tok.name_or_path, tok.chat_template, [], think_special=True)
    backend = HFBackend(cfg_for(tmp_path, data), think_tok)
    eos = think_tok.eos_token_id
    first = think_tok("<think>\nLet me see.\n</think>\n\nBlue, surely.", add_special_tokens=False)["input_ids"]
    assert "think>" not in think_tok.decode(first, skip_special_tokens=True)  # what the plain decode loses
    for text, reasoning in [("<think>\nLet me see.\n</think>\n\nBlue, surely.", "Let me see."),
                            ("Let me see.</think>Blue, surely.", "Let me see."), ("Blue, surely.", "")]:
        ids = think_tok(text, add_special_tokens=False)["input_ids"]
        assert (think_tok.convert_tokens_to_ids("</think>") in ids) == bool(reasoning)
        a = backend._answer(ids + [eos, 7, 7])
        assert (a.text, a.reasoning, a.new_tokens, a.finish_reason) == ("Blue, surely.", reasoning, len(ids) + 1, "stop")
    raw = backend._answer(think_tok("Say <think>hi</think> ok", add_special_tokens=False)["input_ids"], split=False)
    assert (raw.text, raw.reasoning) == ("Say hi ok", "")  # self-written user turns: decoded as before


def test_an_answer_cut_while_thinking_is_reasoning_without_content():
    """By hand: a generation stopped at max_new_tokens inside its thinking block (opened by the text
    or by the prompt) has no answer; a finished one splits; a cut answer after `</think>` keeps its
    partial answer (the thinking ended)."""
    from eyas.regenerate.backends import thinking_answer

    def a(text, reason, opened):
        x = thinking_answer(text, 7, reason, opened)
        return x.reasoning, x.text

    assert a("<think>\nstep 1, step 2", "length", False) == ("step 1, step 2", "")
    assert a("step 1, step 2", "length", True) == ("step 1, step 2", "")  # the prompt ended with <think>
    assert a("step 1</think>The answer", "stop", True) == ("step 1", "The answer")
    assert a("<think>r</think>The ans", "length", False) == ("r", "The ans")
    assert a("A plain answer cut sho", "length", False) == ("", "A plain answer cut sho")


def test_url_credentials_go_as_basic_auth_and_are_redacted_in_files_and_messages(tmp_path, data, capsys):
    import base64
    import socket

    from eyas.config import dump_config
    from eyas.regenerate.backends import server_endpoint

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = cfg_for(tmp_path, data, "--regenerate.backend=server", f"--regenerate.server_url=http://ann:s3cr%40t@127.0.0.1:{port}",
                  "--regenerate.retries=0", "--prepare.max_conversations=1")
    url, headers = server_endpoint(cfg.regenerate)
    assert url == f"http://127.0.0.1:{port}/v1/chat/completions"
    assert headers["Authorization"] == "Basic " + base64.b64encode(b"ann:s3cr@t").decode()
    assert "s3cr" not in dump_config(cfg) and f"http://ann:***@127.0.0.1:{port}" in dump_config(cfg)
    with pytest.raises(EyasError) as e:
        regenerate(cfg)
    assert f"http://ann:***@127.0.0.1:{port}/v1/chat/completions" in str(e.value) and "s3cr" not in str(e.value)
    assert "s3cr" not in (tmp_path / "regenerate" / "config.yaml").read_text()
    from eyas.errors import redact_urls

    assert redact_urls("at https://tok3n@h.example/v1 and http://u:p@ss@h:8/x") == \
        "at https://***@h.example/v1 and http://u:***@h:8/x"  # a token alone; an @ inside the password


def test_an_api_key_comes_only_from_the_variable_the_config_names(tmp_path, data, monkeypatch):
    from eyas.regenerate.backends import server_endpoint

    cfg = cfg_for(tmp_path, data, "--regenerate.backend=server", "--regenerate.server_api_key_env=EYAS_TEST_KEY_VAR")
    monkeypatch.delenv("EYAS_TEST_KEY_VAR", raising=False)
    with pytest.raises(EyasError, match="EYAS_TEST_KEY_VAR: that environment variable is not set"):
        server_endpoint(cfg.regenerate)
    monkeypatch.setenv("EYAS_TEST_KEY_VAR", "k-eyas-test-7731")
    assert server_endpoint(cfg.regenerate)[1]["Authorization"] == "Bearer k-eyas-test-7731"
    from eyas.errors import describe_exception, redact

    assert redact("echoed: Bearer k-eyas-test-7731.") == "echoed: Bearer ***."  # a secret from then on
    try:
        raise RuntimeError("k-eyas-test-7731")
    except RuntimeError as e:
        d = describe_exception(e)
    assert d["message"] == "***" and "k-eyas-test-7731" not in d["traceback"]
    with pytest.raises(EyasError, match="names the environment variable that holds the key"):
        cfg_for(tmp_path, data, "--regenerate.server_api_key_env=sk-abc.def")


def _server_cfg(tmp_path, data, srv, *extra):
    return cfg_for(tmp_path, data, "--regenerate.backend=server", f"--regenerate.server_url={srv.url}", *extra)


def test_an_answer_that_is_not_json_is_retried_then_names_the_server_and_conversation(tmp_path, data, target, capsys):
    """An HTML error page or a cut JSON body with status 200 (a proxy before the server): retried,
    reported as it happens; when it persists, the run fails naming the server and the conversation."""
    model, tok = target
    with ChatServer(model, tok, mode="html", times=1) as srv:
        s = regenerate(_server_cfg(tmp_path / "once", data, srv, "--prepare.max_conversations=1", "--regenerate.retries=1"))
    assert s["server_retries"] == 1 and s["conversations_written"] == 1
    assert read(tmp_path / "once" / "regenerate" / "conversations.jsonl")[0]["messages"] == reference(model, tok, CONVS[0])
    err = capsys.readouterr().err
    assert "conversation a: the answer is not JSON" in err and "retrying in" in err
    assert "502 Bad Gateway" in err and "Content-Type: text/html" in err
    with ChatServer(model, tok, mode="truncated") as srv:
        with pytest.raises(EyasError) as e:
            regenerate(_server_cfg(tmp_path / "always", data, srv, "--prepare.max_conversations=1", "--regenerate.retries=1"))
    msg = str(e.value)
    assert f"conversation a failed after 2 attempts at {srv.url}/v1/chat/completions" in msg
    assert "the answer is not JSON" in msg and '{"choices"' in msg


def test_429_waits_what_retry_after_says_reports_it_and_stops_at_max_retry_wait_s(tmp_path, data, target, capsys):
    model, tok = target
    with ChatServer(model, tok, mode="ratelimit", times=1) as srv:
        srv.retry_after = "2"
        s = regenerate(_server_cfg(tmp_path / "once", data, srv, "--prepare.max_conversations=1", "--regenerate.retries=1"))
    assert s["conversations_written"] == 1 and s["server_retries"] == 1
    assert 2.0 <= srv.arrivals[1] - srv.arrivals[0] < 3.5  # Retry-After, plus at most a quarter of it as jitter
    assert 2.0 <= s["server_wait_s"] < 2.6
    err = capsys.readouterr().err
    assert "conversation a: HTTP 429" in err and "rate limit reached" in err and "Retry-After: 2" in err
    assert "retrying in 2." in err and "(attempt 1 of 2)" in err
    with ChatServer(model, tok, mode="ratelimit") as srv:  # a wait beyond the budget: fail now, say which setting
        srv.retry_after = "30"
        with pytest.raises(EyasError) as e:
            regenerate(_server_cfg(tmp_path / "always", data, srv, "--prepare.max_conversations=1", "--regenerate.retries=2",
                                   "--regenerate.max_retry_wait_s=5"))
    assert srv.requests == 1
    msg = str(e.value)
    assert "conversation a" in msg and "HTTP 429" in msg and "Retry-After: 30" in msg
    assert "regenerate.max_retry_wait_s=5" in msg


def test_retry_waits_spread_out_and_read_retry_after():
    import random
    from email.utils import formatdate

    from eyas.regenerate.backends import retry_after_s, retry_wait

    rng = random.Random(0)
    waits = [retry_wait(2, None, rng) for _ in range(50)]  # backoff 2 s, jittered by half either way
    assert all(1.0 <= w <= 3.0 for w in waits) and len(set(waits)) == 50 and max(waits) - min(waits) > 1.0
    assert all(5.0 <= retry_wait(1, 5.0, rng) <= 6.25 for _ in range(50))  # never before Retry-After
    assert retry_wait(9, None, rng) <= 45.0  # the backoff is capped at 30 s (plus jitter)
    assert retry_after_s("7") == 7.0 and retry_after_s(" 0 ") == 0.0
    assert retry_after_s(None) is None and retry_after_s("soon") is None and retry_after_s("-3") is None
    import time

    assert 8.0 <= retry_after_s(formatdate(time.time() + 10, usegmt=True)) <= 10.0  # an HTTP date


def test_empty_answers_are_retried_then_refused_counted_printed_and_fail_past_the_threshold(tmp_path, data, target, capsys):
    model, tok = target
    with ChatServer(model, tok, mode="empty", times=1) as srv:  # once: the retry answers
        s = regenerate(_server_cfg(tmp_path / "once", data, srv, "--prepare.max_conversations=1", "--regenerate.retries=1"))
    assert s["server_retries"] == 1 and s["counts"].get("answers_refused", 0) == 0
    assert read(tmp_path / "once" / "regenerate" / "conversations.jsonl")[0]["messages"] == reference(model, tok, CONVS[0])
    capsys.readouterr()
    with ChatServer(model, tok, mode="empty") as srv:  # always: refused, the stage fails before writing the chunk
        with pytest.raises(EyasError) as e:
            regenerate(_server_cfg(tmp_path / "always", data, srv, "--regenerate.retries=1"))
    msg = str(e.value)
    assert "3 of 3 answers refused" in msg and "3 empty" in msg and "regenerate.max_refused_fraction=0.01" in msg
    assert "conversation a" in msg and srv.requests == 6  # each asked twice
    assert not (tmp_path / "always" / "regenerate" / "conversations.jsonl").exists()
    assert not (tmp_path / "always" / "regenerate" / "meta.json").exists()
    err = capsys.readouterr().err
    assert all(f"conversation {c}, turn 1: refused: an empty answer" in err for c in "abc")
    with ChatServer(model, tok, mode="empty") as srv:  # accepted by the setting: counted and said, never written
        s = regenerate(_server_cfg(tmp_path / "allowed", data, srv, "--regenerate.retries=0",
                                   "--regenerate.max_refused_fraction=1"))
    assert s["conversations_written"] == 0 and s["counts"]["answers_refused_empty"] == 3
    assert s["counts"]["dropped_no_answer"] == 3
    assert "3 answers refused (3 empty)" in capsys.readouterr().out


@pytest.mark.parametrize("mode,stream", [("long", False), ("huge", True), ("huge", False)])
def test_an_answer_over_max_tokens_is_refused_and_said(tmp_path, data, target, mode, stream, capsys):
    """A server that ignores max_tokens: its own count over it (usage), or more bytes than
    max_new_tokens tokens can take (no usage): read no further, refused, counted, printed."""
    model, tok = target
    firsts = [[m for m in c["messages"] if m["role"] != "assistant"][:2 if c["messages"][0]["role"] == "system" else 1]
              for c in CONVS]
    lengths = [greedy_reply(model, tok, msgs, 16)[1] for msgs in firsts]  # what the server makes of max_tokens=16
    assert lengths[0] > NEW and min(lengths) <= NEW  # a's first answer goes over; a shorter one is kept
    refused = sum(n > NEW for n in lengths) if mode == "long" else 3
    with ChatServer(model, tok, mode=mode, stream=stream) as srv:
        srv.long_tokens = 16
        if mode == "huge":  # by default (max_refused_fraction 0.01) the stage fails, nothing written
            with pytest.raises(EyasError, match=r"3 of 3 answers refused \(3 over max_tokens\)"):
                regenerate(_server_cfg(tmp_path / "default", data, srv, "--regenerate.retries=0"))
            assert not (tmp_path / "default" / "regenerate" / "conversations.jsonl").exists()
        s = regenerate(_server_cfg(tmp_path, data, srv, "--regenerate.retries=0", "--regenerate.max_refused_fraction=1",
                                   "--regenerate.concurrency=1"))
    assert s["counts"]["answers_refused_over_max_tokens"] == refused and s["conversations_written"] == 3 - refused
    kept = read(tmp_path / "regenerate" / "conversations.jsonl")
    assert all(len(tok.encode(m["content"])) <= NEW for r in kept for m in r["messages"] if m["role"] == "assistant")
    captured = capsys.readouterr()
    assert "conversation a, turn 1: refused: longer than max_tokens" in captured.err
    assert (f"the server counted {lengths[0]} tokens for max_tokens=6" if mode == "long" else "more than 1,073,152 bytes") in captured.err
    assert f"{refused} answers refused ({refused} over max_tokens)" in captured.out


@pytest.mark.parametrize("stream", [False, True])
def test_an_answer_that_is_not_utf8_is_refused_never_stored_with_replacement_characters(tmp_path, data, target, stream, capsys):
    model, tok = target
    with ChatServer(model, tok, mode="badbytes", times=1, stream=stream) as srv:
        if stream:  # by default (max_refused_fraction 0.01) the stage fails, nothing written
            with pytest.raises(EyasError, match=r"1 of 3 answers refused \(1 not UTF-8\)"):
                regenerate(_server_cfg(tmp_path / "default", data, srv, "--regenerate.retries=0",
                                       "--regenerate.concurrency=1"))
            assert not (tmp_path / "default" / "regenerate" / "conversations.jsonl").exists()
            srv.times = srv.requests + 1
        s = regenerate(_server_cfg(tmp_path, data, srv, "--regenerate.retries=0", "--regenerate.max_refused_fraction=1",
                                   "--regenerate.concurrency=1"))
    assert s["counts"]["answers_refused_not_utf8"] == 1 and s["conversations_written"] == 2
    text = (tmp_path / "regenerate" / "conversations.jsonl").read_text(encoding="utf-8")
    assert "\ufffd" not in text and "@BAD@" not in text
    assert "conversation a, turn 1: refused: not UTF-8" in capsys.readouterr().err


def test_an_api_key_the_server_echoes_is_redacted_everywhere_and_the_hint_says_it_was_refused(tmp_path, data, target,
                                                                                               monkeypatch, capsys):
    from eyas.cli import main as cli

    model, tok = target
    key = "sk-test-9f8e7d6c5b4a"
    monkeypatch.setenv("EYAS_TEST_SERVER_KEY", key)
    with ChatServer(model, tok, mode="echo401") as srv:
        rc = cli(["run", f"--run_dir={tmp_path}", f"--prepare.data={data}", "--target.dtype=float32",
                  "--regenerate.enabled=true", "--regenerate.backend=server", f"--regenerate.server_url={srv.url}",
                  "--regenerate.server_api_key_env=EYAS_TEST_SERVER_KEY", "--stop_after=regenerate"])
    assert rc == 2
    out = capsys.readouterr()
    files = {p: p.read_text() for p in tmp_path.rglob("*") if p.is_file() and p.suffix in (".json", ".log", ".yaml", ".jsonl")}
    assert tmp_path / "summary.json" in files and tmp_path / "run.log" in files
    for where, text in [("stdout", out.out), ("stderr", out.err), *files.items()]:
        assert key not in text, where
    summary = files[tmp_path / "summary.json"]
    assert "invalid API key: Bearer ***" in summary and "invalid API key: Bearer ***" in out.err
    assert "the server refused the API key in EYAS_TEST_SERVER_KEY (regenerate.server_api_key_env)" in out.err
    assert "put it in an environment variable" not in out.err


def test_sigterm_stops_regenerate_at_once_while_the_server_holds_its_requests(tmp_path, data, smollm2_dir):
    """A server that holds its requests (no byte for up to regenerate.stall_s = 120 s here) does not
    hold a stopped command: SIGTERM ends `eyas run` within seconds with exit 143 and regenerate
    marked interrupted in summary.json (its request threads end with the process)."""
    import json
    import os
    import signal
    import subprocess
    import sys
    import time

    run = tmp_path / "run"
    log = tmp_path / "run.out"
    with ChatServer(mode="stall") as srv, open(log, "w") as f:
        proc = subprocess.Popen(
            [sys.executable, "-m", "eyas", "run", f"--run_dir={run}", f"--target.model={smollm2_dir}",
             f"--prepare.data={data}", "--regenerate.enabled=true", "--regenerate.backend=server",
             f"--regenerate.server_url={srv.url}", "--regenerate.stall_s=120", "--regenerate.concurrency=2",
             "--stop_after=regenerate"],
            stdout=f, stderr=subprocess.STDOUT, env=dict(os.environ, OMP_NUM_THREADS="1"))
        try:
            deadline = time.monotonic() + 120
            while srv.requests < 2 and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            assert proc.poll() is None and srv.requests >= 2, log.read_text()[-3000:]
            sent = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            rc = proc.wait(60)
            took = time.monotonic() - sent
        finally:
            if proc.poll() is None:
                proc.kill()
            srv.mode = "fail"  # the held requests end (into closed sockets)
    assert rc == 143 and took < 15, (rc, took, log.read_text()[-3000:])
    summary = json.loads((run / "summary.json").read_text())
    assert summary["failed_stage"] == "regenerate" and summary["stages"]["regenerate"]["status"] == "interrupted"
