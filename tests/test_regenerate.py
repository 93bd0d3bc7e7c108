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
from eyas.regenerate import batches, main as regenerate, out_of_time
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


def test_time_budget_plans_a_short_last_chunk_at_its_own_cost():
    # measured on one H200: a chunk of 4,096 conversations (4 batches of 1,024 rows) took 102.7 s; the 1,397
    # left fill 2 batches, ~51 s, which fit a 200 s budget (planned at the whole chunk's 102.7 s, they did not)
    rc = load_config(None, ["--regenerate.batch_size=1024", "--regenerate.max_seconds=200"]).regenerate
    per_batch = 102.7 / batches(4096, 1024)
    assert not out_of_time(102.7, per_batch, 1397, rc)
    assert out_of_time(102.7, per_batch, 4096, rc) and out_of_time(150.0, per_batch, 1397, rc)
    assert not out_of_time(1e9, per_batch, 4096, load_config(None, []).regenerate)  # no budget
    assert (batches(1, 1024), batches(1024, 1024), batches(1025, 1024)) == (1, 1, 2)


def test_max_turns_and_time_budget(tmp_path, data, target):
    model, tok = target
    s = regenerate(cfg_for(tmp_path, data, "--regenerate.chunk_conversations=1", "--regenerate.max_turns=1",
                           "--regenerate.max_seconds=1e-6"))
    assert (s["regenerated_now"], s["not_started"], s["stopped_early"], s["turns"]) == (1, 2, True, 1)
    meta = json.loads((tmp_path / "regenerate" / "meta.json").read_text())
    assert meta["counts"]["stopped_early"] and meta["counts"]["conversations_written"] == 1
    s = regenerate(cfg_for(tmp_path, data, "--regenerate.chunk_conversations=1", "--regenerate.max_turns=1"))
    assert (s["resumed_from"], s["regenerated_now"], s["stopped_early"]) == (1, 2, False)
    recs = read(tmp_path / "regenerate" / "conversations.jsonl")
    for rec, conv in zip(recs, CONVS):  # one answer each; conversation "a" ends after its first turn
        head = [m for m in conv["messages"][:1] if m["role"] == "system"]
        user = [m for m in conv["messages"] if m["role"] == "user"][0]
        want = greedy_reply(model, tok, head + [user], NEW)[0]
        assert rec["messages"] == head + [user, {"role": "assistant", "content": want}]


SMOL_PRE_QUERY = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
                  "<|im_start|>user\n")  # SmolLM2's template, with the system prompt it adds by itself


def test_greedy_self_prompts_equal_a_plain_generate_and_resume(tmp_path, data, target):
    """Greedy self-written user turns are all the target's own greedy continuation of the text
    before a user message (one distinct prompt, the rest counted as repeats), answered as the
    batch-1 reference answers it; a second run reads them back and redoes nothing."""
    from eyas.regenerate.self_prompts import pre_query_ids

    model, tok = target
    prefix = pre_query_ids(tok, [tok.eos_token_id])
    assert tok.decode(prefix) == SMOL_PRE_QUERY
    assert tok.decode(pre_query_ids(tok, [tok.eos_token_id], "Be brief.")) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n")
    with torch.inference_mode():  # the independent reference: HF generate from the literal text
        x = tok(SMOL_PRE_QUERY, return_tensors="pt", add_special_tokens=False)["input_ids"]
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=48, do_sample=False,
                             temperature=None, top_p=None, top_k=None, pad_token_id=tok.eos_token_id)
    new = out[0, x.shape[1]:].tolist()
    assert tok.eos_token_id in new  # SmolLM2's greedy user turn ends within 48 tokens
    user = tok.decode(new[: new.index(tok.eos_token_id)], skip_special_tokens=True).strip()
    own = ["--prepare.max_conversations=1", "--regenerate.self_prompts=3", "--regenerate.self_prompt_temperature=0",
           "--regenerate.self_prompt_max_tokens=48"]
    s = regenerate(cfg_for(tmp_path, data, *own))
    assert s["self_prompts"] == {"sampled": 3, "kept": 1, "unfinished": 0, "empty": 0, "duplicate": 2}
    assert (s["conversations_in"], s["self_written"], s["conversations_written"]) == (1, 1, 2)
    recs = read(tmp_path / "regenerate" / "conversations.jsonl")
    assert [r["id"] for r in recs] == ["a", "self-0"]
    asked = [{"role": "user", "content": user}]
    assert recs[1]["messages"] == asked + [{"role": "assistant", "content": greedy_reply(model, tok, asked, NEW)[0]}]
    s = regenerate(cfg_for(tmp_path, data, *own))
    assert (s["resumed_from"], s["regenerated_now"], s["conversations_written"]) == (2, 0, 2)
    assert read(tmp_path / "regenerate" / "conversations.jsonl") == recs
    # other sampling settings than the file's: loud, naming what to remove
    with pytest.raises(EyasError, match="was sampled with .*remove it"):
        regenerate(cfg_for(tmp_path, data, *own[:-1], "--regenerate.self_prompt_max_tokens=40"))
    assert json.loads((tmp_path / "regenerate" / "meta.json").read_text())["complete"]  # refused before any change
    # the CUDA path (eyas's BatchDecoder, here eagerly; its own max_new) samples the same turns
    from eyas.regenerate.backends import HFBackend
    from eyas.regenerate.self_prompts import sample_self_prompts

    cfg = cfg_for(tmp_path, data, *own, "--regenerate.static_widths=[32]")
    backend = HFBackend(cfg, tok)
    backend.static = True
    assert sample_self_prompts(backend, tok, cfg)["prompts"] == [user]
    assert backend.generate([prefix], None)[0].new_tokens <= NEW  # the answers' settings again: a new decoder
    # answers to self-written turns whose file is gone: loud (new samples would not match them)
    (tmp_path / "regenerate" / "self_prompts.json").unlink()
    with pytest.raises(EyasError, match="is gone: remove"):
        regenerate(cfg_for(tmp_path, data, *own))


def test_self_prompt_systems_steer_the_samples_and_stay_out_of_the_conversations(tmp_path, data, target):
    """regenerate.self_prompt_systems: greedy sample i is the target's own continuation of the text
    before a user message after the (i mod n)-th system prompt (an independent HF generate from the
    literal text), counted per system prompt; the conversations hold the user turn alone, answered
    as any self-written one; other system prompts than the stored file's are refused."""
    model, tok = target
    systems = ["You write short questions about cooking.", "You ask for help with arithmetic."]
    refs = []
    for system in systems:  # the independent reference, from the literal pre-query text
        x = tok(f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n", return_tensors="pt",
                add_special_tokens=False)["input_ids"]
        with torch.inference_mode():
            out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=48, do_sample=False,
                                 temperature=None, top_p=None, top_k=None, pad_token_id=tok.eos_token_id)
        new = out[0, x.shape[1]:].tolist()
        assert tok.eos_token_id in new  # SmolLM2's greedy user turn ends within 48 tokens
        refs.append(tok.decode(new[: new.index(tok.eos_token_id)], skip_special_tokens=True).strip())
    assert refs[0] != refs[1] and refs[0] != "" and refs[1] != ""  # the two system prompts steer apart
    own = ["--prepare.max_conversations=1", "--regenerate.self_prompts=4", "--regenerate.self_prompt_temperature=0",
           "--regenerate.self_prompt_max_tokens=48", f"--regenerate.self_prompt_systems={json.dumps(systems)}"]
    s = regenerate(cfg_for(tmp_path, data, *own))
    assert s["self_prompts"] == {"sampled": 4, "kept": 2, "unfinished": 0, "empty": 0, "duplicate": 2,
                                 "kept_per_system": [1, 1]}
    made = json.loads((tmp_path / "regenerate" / "self_prompts.json").read_text())
    assert made["prompts"] == refs and made["settings"]["systems"] == systems
    recs = read(tmp_path / "regenerate" / "conversations.jsonl")[1:]
    for rec, user in zip(recs, refs):  # no system message: answered as the plain user turn
        asked = [{"role": "user", "content": user}]
        assert rec["messages"] == asked + [{"role": "assistant", "content": greedy_reply(model, tok, asked, NEW)[0]}]
    with pytest.raises(EyasError, match="was sampled with .*remove it"):
        regenerate(cfg_for(tmp_path, data, *own[:-1], f"--regenerate.self_prompt_systems={json.dumps(systems[:1])}"))
    with pytest.raises(EyasError, match="set regenerate.self_prompts too"):
        load_config(None, [f"--regenerate.self_prompt_systems={json.dumps(systems)}"])


def test_self_prompts_refuse_a_template_whose_user_turn_does_not_end_at_a_stop_token(target):
    import copy

    from eyas.regenerate.self_prompts import pre_query_ids

    _, tok = target
    inst = copy.deepcopy(tok)  # a Mistral-like template: the user turn ends with [/INST] (not a special token here)
    inst.chat_template = "{% for m in messages %}{% if m['role'] == 'user' %}[INST]\n{{ m['content'] }}[/INST]{% endif %}{% endfor %}"
    with pytest.raises(EyasError, match="ends a user turn with '\\[/INST\\]|ends a user turn with '\\['"):
        pre_query_ids(inst, [tok.eos_token_id])
    inst.chat_template = "[INST] {{ messages[0]['content'] }}[/INST]"  # the text before cuts a token: caught too
    with pytest.raises(EyasError, match="not as the start of a templated conversation"):
        pre_query_ids(inst, [tok.eos_token_id])


def test_sampled_self_prompts_are_counted_and_answered(tmp_path, data, target):
    model, tok = target
    s = regenerate(cfg_for(tmp_path, data, "--prepare.max_conversations=1", "--regenerate.self_prompts=6",
                           "--regenerate.self_prompt_max_tokens=24", "--regenerate.batch_size=4"))
    c = s["self_prompts"]
    assert c["sampled"] == 6 and c["kept"] + c["unfinished"] + c["empty"] + c["duplicate"] == 6
    assert c["kept"] >= 2  # seeded (the run's seed): the same samples every time
    made = json.loads((tmp_path / "regenerate" / "self_prompts.json").read_text())
    assert len(made["prompts"]) == c["kept"] == s["self_written"] and len(set(made["prompts"])) == c["kept"]
    path = tmp_path / "regenerate" / "conversations.jsonl"
    recs = read(path)[1:]
    assert [r["messages"][0]["content"] for r in recs] == made["prompts"]
    for r in recs:  # each finished in at most 24 tokens, and answered greedily as the reference does
        assert 0 < len(tok(r["messages"][0]["content"])["input_ids"]) <= 24
        assert r["messages"][1]["content"] == greedy_reply(model, tok, r["messages"][:1], NEW)[0]
    # a resume answers the stored turns, not new samples: the last one, dropped, comes back as it was
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(lines[:-1]))
    s = regenerate(cfg_for(tmp_path, data, "--prepare.max_conversations=1", "--regenerate.self_prompts=6",
                           "--regenerate.self_prompt_max_tokens=24", "--regenerate.batch_size=4"))
    assert s["regenerated_now"] == 1 and read(path)[1:] == recs


def test_sampled_self_prompts_on_the_cuda_decoder_path(tmp_path, data, target):
    """eyas's BatchDecoder (here eagerly) samples the user turns with their own settings and then
    answers greedily with the answers' settings."""
    from eyas.regenerate.backends import HFBackend
    from eyas.regenerate.self_prompts import sample_self_prompts

    model, tok = target
    cfg = cfg_for(tmp_path, data, "--regenerate.self_prompts=8", "--regenerate.self_prompt_max_tokens=24",
                  "--regenerate.batch_size=8", "--regenerate.static_widths=[32,64]")
    backend = HFBackend(cfg, tok)
    backend.static = True
    made = sample_self_prompts(backend, tok, cfg)
    assert made["counts"]["sampled"] == 8 and len(made["prompts"]) >= 2  # sampled: distinct turns
    asked = [[{"role": "user", "content": p}] for p in made["prompts"]]
    ids = [tok.apply_chat_template(a, add_generation_prompt=True, tokenize=True, return_dict=False) for a in asked]
    for a, answer in zip(asked, backend.generate(ids)):
        assert answer.text == greedy_reply(model, tok, a, NEW)[0]


def test_self_prompts_need_the_hf_backend():
    with pytest.raises(EyasError, match="needs regenerate.backend=hf"):
        load_config(None, ["--regenerate.backend=server", "--regenerate.self_prompts=4"])


def test_resume_reads_records_with_unicode_line_separators(tmp_path):
    """Generated text may hold U+2028 / U+0085 (json.dumps keeps them with ensure_ascii=False);
    they are not line breaks of the JSONL file."""
    from eyas.regenerate import append_records, read_done

    path = tmp_path / "c.jsonl"
    odd = "a\u2028b\x85c\u2029d\x1ce"
    append_records(path, [{"source_index": 3, "messages": [{"role": "assistant", "content": odd}]},
                          {"source_index": 7, "messages": []}])
    assert read_done(path) == {3, 7}


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
