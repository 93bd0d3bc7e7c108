"""prepare: loss masks on real chat templates, end to end, workers, bad input.

The loss-mask reference is independent of the implementation (which works on character offsets):
it decodes each maximal run of masked tokens and requires the runs to be exactly the assistant
contents, in order, each followed by the template's end-of-turn token — nothing else.
"""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

import pytest
import torch

from eyas import Prepared
from eyas.chat import Conversation, load_conversations
from eyas.cli import main as cli
from eyas.config import load_config
from eyas.prepare import tokenize_conversations


# Meta-Llama-3-8B-Instruct's chat template (verbatim).
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + "
    "'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)


# Qwen2.5-Instruct's chat template without the tool-calling branches.
QWEN25_TEMPLATE = """{%- if messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- else %}
    {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant") %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""


# Qwen3's chat template without the tool-calling branches: the last assistant turn after the last
# user query gets an (empty) <think> block that is *not* assistant content and must stay unmasked.
QWEN3_TEMPLATE = """{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if message.role == "user" and ns.last_query_index == messages|length - 1 %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- set content = message.content %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if '</think>' in content %}
            {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""


HANDMADE = [
    Conversation("multi", [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "2+2 = 4."},
        {"role": "user", "content": "And times 3?"},
        {"role": "assistant", "content": "(2+2)*3 = 12.\nDone!  "},
    ]),
    Conversation("system", [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "Say hi"},
        {"role": "assistant", "content": "Hi"},
    ]),
    Conversation("unicode", [
        {"role": "user", "content": "Übersetze: cat"},
        {"role": "assistant", "content": "Katze 🐈 — «die Katze»"},
    ]),
    Conversation("code", [
        {"role": "user", "content": "python hello world"},
        {"role": "assistant", "content": "```python\nprint('hello')\n```\n\nRun it with `python x.py`."},
    ]),
]


def masked_runs(tok, ids: list[int], mask: list[int]) -> list[str]:
    runs, cur = [], []
    for t, m in zip(ids, mask):
        if m:
            cur.append(t)
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    return [tok.decode(r) for r in runs]


def as_rendered(content: str, text: str) -> str:
    """The assistant content as the template wrote it: verbatim, or trimmed (Llama-3 trims)."""
    return content if content in text else content.strip()


def check_masks(tok, convs, eot: str, max_length: int = 100_000):
    counts = Counter()
    ids, masks, kept = tokenize_conversations(tok, convs, max_length, 64, counts)
    assert kept == [c.id for c in convs]
    for conv, x, m in zip(convs, ids, masks):
        text = tok.apply_chat_template(conv.messages, tokenize=False)
        expected = [as_rendered(msg["content"], text) + eot for msg in conv.messages if msg["role"] == "assistant"]
        assert masked_runs(tok, x, m) == expected, conv.id
        # and the tokens are exactly what the template tokenises to
        assert x == tok.apply_chat_template(conv.messages, tokenize=True, return_dict=False) or x == list(
            tok(tok.apply_chat_template(conv.messages, tokenize=False), add_special_tokens=False)["input_ids"]
        )


@pytest.fixture(scope="module")
def sharegpt_convs():
    convs, _ = load_conversations("embedded:sharegpt", limit=40)
    return convs


def test_mask_chatml_smollm2(smollm2_tokenizer, sharegpt_convs):
    check_masks(smollm2_tokenizer, HANDMADE + sharegpt_convs, "<|im_end|>")


def test_mask_qwen25_template(smollm2_tokenizer, sharegpt_convs):
    tok = smollm2_tokenizer
    old = tok.chat_template
    try:
        tok.chat_template = QWEN25_TEMPLATE
        check_masks(tok, HANDMADE + sharegpt_convs[:15], "<|im_end|>")
    finally:
        tok.chat_template = old


def test_mask_qwen3_template_think_block_is_not_masked(smollm2_tokenizer):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_tokenizer.name_or_path)
    tok.add_special_tokens({"additional_special_tokens": ["<think>", "</think>"]}, replace_extra_special_tokens=False) \
        if "replace_extra_special_tokens" in tok.add_special_tokens.__code__.co_varnames else \
        tok.add_special_tokens({"additional_special_tokens": ["<think>", "</think>"]})
    tok.chat_template = QWEN3_TEMPLATE
    text = tok.apply_chat_template(HANDMADE[0].messages, tokenize=False)
    assert "<think>\n\n</think>\n\n(2+2)*3" in text  # the template really inserted a think block
    check_masks(tok, HANDMADE, "<|im_end|>")


def test_mask_llama3_template(smollm2_tokenizer, sharegpt_convs):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_tokenizer.name_or_path)
    tok.add_special_tokens(
        {"bos_token": "<|begin_of_text|>", "additional_special_tokens": ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]}
    )
    tok.chat_template = LLAMA3_TEMPLATE
    text = tok.apply_chat_template(HANDMADE[1].messages, tokenize=False)
    assert text.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe terse.<|eot_id|>")
    check_masks(tok, HANDMADE + sharegpt_convs[:15], "<|eot_id|>")


def test_truncation_keeps_prefix_and_counts(smollm2_tokenizer):
    counts = Counter()
    conv = Conversation("long", [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "word " * 200}])
    ids, masks, kept = tokenize_conversations(smollm2_tokenizer, [conv], 64, 8, counts)
    assert len(ids[0]) == 64 and counts["truncated"] == 1 and sum(masks[0]) > 0
    # a conversation whose only assistant turn lies past max_length is dropped and counted
    conv2 = Conversation("late", [{"role": "user", "content": "x " * 300}, {"role": "assistant", "content": "y"}])
    ids, masks, kept = tokenize_conversations(smollm2_tokenizer, [conv2], 64, 8, counts)
    assert kept == [] and counts["dropped_no_loss_tokens_after_truncation"] == 1


# ---- end to end ---------------------------------------------------------------------------------


def test_prepare_end_to_end_200_sharegpt(tmp_path, smollm2_tokenizer, capsys):
    rc = cli(["prepare", f"--run_dir={tmp_path}", "--prepare.max_conversations=200", "--prepare.max_length=1024"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "kept of 200 records" in out and "draft vocab" in out
    p = Prepared(tmp_path / "prepare")
    meta = p.meta
    assert meta["counts"]["records"] == 200
    assert len(p) == meta["counts"]["conversations_kept"] > 150
    assert p.d2t.numel() == 32000 and p.t2d.numel() == 49152 and int(p.t2d.sum()) == 32000
    assert torch.equal(torch.nonzero(p.t2d).flatten(), torch.arange(32000) + p.d2t)
    assert meta["hashes"]["tokenizer"] and meta["hashes"]["data"] and meta["versions"]["torch"]
    assert (tmp_path / "prepare" / "config.yaml").is_file()
    assert load_config(tmp_path / "prepare" / "config.yaml").prepare.max_length == 1024
    # independent check of a few samples: masked runs decode to assistant contents + <|im_end|>
    convs, _ = load_conversations("embedded:sharegpt", limit=200)
    by_id = {c.id: c for c in convs}
    for i in range(0, len(p), 37):
        s = p[i]
        assert s["input_ids"].numel() <= 1024 and s["input_ids"].shape == s["loss_mask"].shape
        runs = masked_runs(smollm2_tokenizer, s["input_ids"].tolist(), s["loss_mask"].tolist())
        expected = [m["content"].strip() + "<|im_end|>" for m in by_id[s["id"]].messages if m["role"] == "assistant"]
        assert runs[:-1] == expected[: len(runs) - 1]  # the last run may be cut by truncation
        assert expected[len(runs) - 1].startswith(runs[-1].removesuffix("<|im_end|>"))
    # coverage is consistent with the stored counts
    cov = float(p.token_counts[p.t2d].sum() / p.token_counts.sum())
    assert cov == pytest.approx(meta["counts"]["draft_vocab_coverage"])


def test_config_precedence_yaml_then_cli(tmp_path):
    y = tmp_path / "r.yaml"
    y.write_text("run_dir: /tmp/a\nprepare:\n  max_length: 512\n  draft_vocab_size: 100\n")
    cfg = load_config(y, ["--prepare.max_length=256"])
    assert cfg.prepare.max_length == 256 and cfg.prepare.draft_vocab_size == 100 and cfg.run_dir == "/tmp/a"


def test_workers_make_the_one_process_output(tmp_path, capsys):
    """prepare.num_workers cuts the conversations into chunks for spawned processes: the files are
    the one process's, byte for byte (600 real ShareGPT records, chunks of 64 across 3 workers)."""
    common = ["prepare", "--prepare.max_conversations=600", "--prepare.max_length=512", "--prepare.batch_size=64"]
    assert cli([*common, f"--run_dir={tmp_path / 'one'}"]) == 0
    assert cli([*common, f"--run_dir={tmp_path / 'three'}", "--prepare.num_workers=3"]) == 0
    capsys.readouterr()
    for name in ("tokens.safetensors", "vocab.safetensors", "sample_ids.json"):
        assert (tmp_path / "one" / "prepare" / name).read_bytes() == (tmp_path / "three" / "prepare" / name).read_bytes(), name
    one, three = (json.loads((tmp_path / d / "prepare" / "meta.json").read_text())["counts"] for d in ("one", "three"))
    assert {k: v for k, v in one.items() if k != "seconds"} == {k: v for k, v in three.items() if k != "seconds"}
    assert one["reasons"]["truncated"] > 0  # the counts merged from the workers include the truncations


def test_a_workers_error_names_the_conversation(tmp_path, capsys):
    p = tmp_path / "chats.jsonl"
    rows = [{"id": f"rec{i}", "messages": [{"role": "user", "content": f"question {i}" + (" BOOM" if i == 250 else "")},
                                           {"role": "assistant", "content": f"answer {i}"}]} for i in range(300)]
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    template = ("{% for m in messages %}{% if 'BOOM' in m['content'] %}{{ raise_exception('no bombs') }}{% endif %}"
                "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}")
    err = run_err(capsys, "prepare", f"--run_dir={tmp_path}", f"--prepare.data={p}", "--prepare.batch_size=16",
                  "--prepare.num_workers=2", f"--target.chat_template={template}")
    assert "conversation rec250: the chat template failed" in err and "no bombs" in err


# ---- bad input: a clear error, nothing silent --------------------------------------------------


def run_err(capsys, *args):
    rc = cli(list(args))
    err = capsys.readouterr().err
    assert rc == 2, err
    return err


def test_error_malformed_json_line(tmp_path, capsys):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}\n{"messages": [\n')
    err = run_err(capsys, "prepare", f"--run_dir={tmp_path}", f"--prepare.data={p}")
    assert "bad.jsonl:2" in err and "malformed JSON" in err


GOOD = json.dumps({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]})


def test_error_malformed_json_says_where_on_the_line(tmp_path, capsys):
    p = tmp_path / "bad.jsonl"
    p.write_text(GOOD + '\n{"messages": [{"role": "user" "content": "q"}]}\n{"messages": [\n')
    err = run_err(capsys, "prepare", f"--run_dir={tmp_path}", f"--prepare.data={p}")
    assert "bad.jsonl:2" in err and "at column 31, after" in err and '"role": "user" ' in err
    p.write_text(GOOD + '\n{"messages": [\n')  # a cut line: its end, not "column 1" of the next
    err = run_err(capsys, "prepare", f"--run_dir={tmp_path}", f"--prepare.data={p}")
    assert "bad.jsonl:2" in err and "the line ends (column 15)" in err and "column 1)" not in err


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_error_invalid_utf8_byte_names_line_and_column(tmp_path, capsys, suffix):
    rec = '{"messages": [{"role": "user", "content": "caf\xe9"}, {"role": "assistant", "content": "a"}]}'
    p = tmp_path / f"latin1{suffix}"
    body = f"{GOOD}\n{GOOD}\n{rec}\n" if suffix == ".jsonl" else f"[{GOOD},\n{GOOD},\n{rec}]"
    p.write_bytes(body.encode("latin-1"))
    err = run_err(capsys, "prepare", f"--run_dir={tmp_path}", f"--prepare.data={p}")
    assert f"latin1{suffix}:3: not valid UTF-8: byte 0xe9 at column" in err and "iconv" in err, err
    assert "Traceback" not in err


def test_error_lone_surrogate_names_the_turn(tmp_path, capsys):
    p = tmp_path / "s.jsonl"
    p.write_text(GOOD + "\n" + json.dumps({"id": "r2", "messages": [{"role": "user", "content": "q"},
                 {"role": "assistant", "content": "half \ud800 pair"}]}) + "\n")
    assert "\\ud800" in p.read_text()  # json.dumps escapes it, as a real file would hold it
    err = run_err(capsys, "prepare", f"--run_dir={tmp_path}", f"--prepare.data={p}")
    assert "s.jsonl:2 (id r2): turn 1 'content': a lone surrogate \\ud800 at character 6" in err, err


@pytest.mark.parametrize("content, said", [
    ([{"type": "text", "text": 5}], "turn 0 'content' part 0: the text must be a string, got int '5'"),
    (42, "turn 0 'content': expected text (a string or a list of text parts), got int '42'"),
    ({"text": "q"}, "turn 0 'content': expected text (a string or a list of text parts), got dict"),
])
def test_error_content_that_is_not_text_is_named_not_counted_empty(tmp_path, capsys, content, said):
    p = tmp_path / "n.jsonl"
    rows = [GOOD] * 3 + [json.dumps({"id": "r4", "messages": [{"role": "user", "content": content},
                                                              {"role": "assistant", "content": "a"}]})]
    p.write_text("\n".join(rows) + "\n")
    err = run_err(capsys, "prepare", f"--run_dir={tmp_path}", f"--prepare.data={p}")
    assert f"n.jsonl:4 (id r4): {said}" in err, err


def test_null_content_and_image_parts_stay_empty_turns(tmp_path):
    convs, counts = load_conversations(str(_write(tmp_path / "ok.jsonl", [
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}},
                                                   {"type": "text", "text": "what is it?"}]},
                      {"role": "assistant", "content": None}, {"role": "assistant", "content": "a cat"}]}])))
    assert [m["content"] for m in convs[0].messages] == ["what is it?", "a cat"]
    assert counts["removed_empty_turn"] == 1


def test_skip_bad_records_drops_and_counts_what_cannot_be_read(tmp_path, capsys):
    """prepare.skip_bad_records: a byte that is not UTF-8, content that is a number and a cut line are
    dropped and counted (dropped_bad_record, toward max_drop_fraction), the first named; off, the
    first of them fails the stage (the tests above)."""
    p = tmp_path / "mixed.jsonl"
    bad = [b'{"messages": [{"role": "user", "content": "caf\xe9"}]}', _record_bytes(42), b'{"messages": [']
    p.write_bytes(b"\n".join([GOOD.encode()] * 6 + bad) + b"\n")
    run = tmp_path / "run"
    assert cli(["prepare", f"--run_dir={run}", f"--prepare.data={p}", "--prepare.skip_bad_records=true",
                "--prepare.draft_vocab_size=100"]) == 0
    err = capsys.readouterr().err
    assert "dropped 3 record(s) that cannot be read" in err and "mixed.jsonl:7: not valid UTF-8" in err
    assert "mixed.jsonl:8 (id mixed.jsonl:8): turn 0 'content': expected text" in err and "mixed.jsonl:9: malformed" in err
    counts = json.loads((run / "prepare" / "meta.json").read_text())["counts"]
    assert counts["records"] == 9 and counts["conversations_kept"] == 6 and counts["reasons"]["dropped_bad_record"] == 3
    err = run_err(capsys, "prepare", f"--run_dir={tmp_path / 'strict'}", f"--prepare.data={p}",
                  "--prepare.skip_bad_records=true", "--prepare.max_drop_fraction=0.2")
    assert "dropped 3 of 9" in err and "dropped_bad_record" in err


def _record_bytes(content) -> bytes:
    return json.dumps({"messages": [{"role": "user", "content": content}, {"role": "assistant", "content": "a"}]}).encode()


def _write(p: Path, rows: list) -> Path:
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return p


def test_error_unknown_role(tmp_path, capsys):
    p = tmp_path / "r.jsonl"
    p.write_text(json.dumps({"id": "rec7", "messages": [{"role": "narrator", "content": "a"}]}) + "\n")
    err = run_err(capsys, "prepare", f"--run_dir={tmp_path}", f"--prepare.data={p}")
    assert "'narrator'" in err and "rec7" in err and "r.jsonl:1" in err


def test_error_no_user_assistant_turn(tmp_path, capsys):
    p = tmp_path / "r.jsonl"
    p.write_text(json.dumps({"messages": [{"role": "user", "content": "only a question"}]}) + "\n")
    err = run_err(capsys, "prepare", f"--run_dir={tmp_path}", f"--prepare.data={p}")
    assert "none of 1 records has a user turn followed by an assistant turn" in err


def test_error_tokenizer_without_chat_template(tmp_path, capsys, smollm2_dir):
    model = tmp_path / "notemplate"
    model.mkdir()
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(smollm2_dir) / f, model / f)
    cfgj = json.loads((model / "tokenizer_config.json").read_text())
    cfgj.pop("chat_template", None)
    (model / "tokenizer_config.json").write_text(json.dumps(cfgj))
    err = run_err(capsys, "prepare", f"--run_dir={tmp_path}", f"--target.model={model}", "--prepare.max_conversations=3")
    assert "no chat template" in err and "--target.chat_template" in err


def test_error_draft_vocab_larger_than_target_vocab(tmp_path, capsys):
    err = run_err(capsys, "prepare", f"--run_dir={tmp_path}", "--prepare.draft_vocab_size=50000", "--prepare.max_conversations=3")
    assert "draft_vocab_size=50000" in err and "49152" in err


def test_error_unknown_config_key(tmp_path, capsys):
    err = run_err(capsys, "prepare", f"--run_dir={tmp_path}", "--prepare.max_lenght=5")
    assert "unknown config key 'prepare.max_lenght'" in err and "prepare.max_length" in err


def test_error_missing_file(tmp_path, capsys):
    err = run_err(capsys, "prepare", f"--run_dir={tmp_path}", f"--prepare.data={tmp_path}/nope.jsonl")
    assert "no such file" in err and "nope.jsonl" in err
    err = run_err(capsys, "prepare", str(tmp_path / "missing.yaml"))
    assert "config file not found" in err


def test_error_too_many_dropped(tmp_path, capsys):
    p = tmp_path / "r.jsonl"
    good = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    p.write_text("\n".join([json.dumps(good)] + [json.dumps({"messages": []})] * 3) + "\n")
    err = run_err(capsys, "prepare", f"--run_dir={tmp_path}", f"--prepare.data={p}", "--prepare.max_drop_fraction=0.5")
    assert "dropped 3 of 4" in err and "dropped_empty_record" in err
