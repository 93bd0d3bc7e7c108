"""eyas.chat: the conversation loaders on real data (the embedded ShareGPT file, OpenAI and
ShareGPT JSONL, compressed files, an HF dataset saved to disk) and their errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eyas import Prepared
from eyas.chat import load_conversations
from eyas.cli import main as cli
from eyas.errors import DataError


def test_sharegpt_loader_real_truncated_file():
    from eyas import assets

    recs = assets.load_sharegpt()
    assert len(recs) == 17671
    assert recs[0]["id"] == "QWJhYvA_0"
    convs, counts = load_conversations("embedded:sharegpt")
    assert counts["records"] == 17671
    assert counts["dropped_empty_record"] > 0 and counts["removed_leading_assistant_turn"] > 0
    dropped = sum(n for r, n in counts.items() if r.startswith("dropped"))
    assert len(convs) == 17671 - dropped
    for c in convs[:500]:
        roles = [m["role"] for m in c.messages if m["role"] != "system"]
        assert roles[0] == "user" and roles[-1] == "assistant"
        assert all(a != b for a, b in zip(roles, roles[1:]))


def test_openai_jsonl_and_role_normalisation(tmp_path):
    p = tmp_path / "chats.jsonl"
    recs = [
        {"id": "a", "messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "u"}, {"role": "assistant", "content": "x"}]},
        {"id": "b", "messages": [{"role": "assistant", "content": "lead"}, {"role": "user", "content": "u"}, {"role": "assistant", "content": "y"}]},
        {"id": "c", "messages": []},
        {"id": "d", "conversations": [{"from": "human", "value": "q"}, {"from": "bard", "value": "r"}]},
    ]
    p.write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    convs, counts = load_conversations(str(p))
    assert [c.id for c in convs] == ["a", "b", "d"]
    assert convs[1].messages[0] == {"role": "user", "content": "u"}
    assert convs[2].messages[1]["role"] == "assistant"
    assert counts["removed_leading_assistant_turn"] == 1 and counts["dropped_empty_record"] == 1


@pytest.mark.parametrize("name", ["chats.jsonl.xz", "chats.jsonl.gz", "chats.json.bz2", "array.json.xz"])
def test_compressed_data_reads_as_the_plain_file(tmp_path, name):
    import bz2, gzip, lzma

    recs = [{"id": f"r{i}", "conversations": [{"from": "human", "value": f"q{i} \u2028 é"}, {"from": "gpt", "value": f"a{i}"}]}
            for i in range(5)]
    plain = tmp_path / "chats.jsonl"
    plain.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in recs), encoding="utf-8")
    text = json.dumps(recs, ensure_ascii=False) if name.startswith("array") else plain.read_text(encoding="utf-8")
    opener = {".xz": lzma.open, ".gz": gzip.open, ".bz2": bz2.open}[Path(name).suffix]
    packed = tmp_path / name
    with opener(packed, "wt", encoding="utf-8") as f:
        f.write(text)
    assert packed.read_bytes()[:64] != text.encode()[:64]  # really compressed
    want, _ = load_conversations(str(plain))
    got, counts = load_conversations(str(packed))
    assert counts["records"] == 5
    assert [(c.id, c.messages) for c in got] == [(c.id, c.messages) for c in want]


def test_compressed_data_errors_name_file_and_line(tmp_path):
    import lzma

    p = tmp_path / "bad.jsonl.xz"
    with lzma.open(p, "wt", encoding="utf-8") as f:
        f.write('{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}\n{"messages": [\n')
    with pytest.raises(DataError, match=r"bad\.jsonl\.xz:2: malformed JSON"):
        load_conversations(str(p))


@pytest.mark.parametrize("name", ["cut.jsonl.xz", "cut.json.gz", "plain.jsonl.xz", "plain.json.bz2"])
def test_compressed_data_cut_short_or_not_compressed_names_the_file(tmp_path, name):
    import bz2, gzip, lzma

    text = "".join(json.dumps({"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "a" * 500}]})
                   + "\n" for i in range(200))
    p = tmp_path / name
    if name.startswith("cut"):  # the file as a lost last part of a split leaves it
        opener = {".xz": lzma.compress, ".gz": gzip.compress, ".bz2": bz2.compress}[p.suffix]
        blob = opener(text.encode())
        p.write_bytes(blob[: len(blob) // 2])
    else:
        p.write_text(text)
    with pytest.raises(DataError, match=rf"{p.name}: cannot decompress it as {p.suffix} \(\w+"):
        load_conversations(str(p))


def test_hf_dataset_saved_to_disk(tmp_path, capsys):
    datasets = pytest.importorskip("datasets")
    recs = [  # mixed forms in one table: the absent column of each row reads as None
        {"id": "h1", "conversations": None,
         "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]},
        {"id": "h2", "messages": None,
         "conversations": [{"from": "human", "value": "2+2?"}, {"from": "gpt", "value": "4"}]},
    ]
    path = tmp_path / "ds"
    datasets.Dataset.from_list(recs).save_to_disk(str(path))
    convs, counts = load_conversations(str(path))
    assert [c.id for c in convs] == ["h1", "h2"] and convs[1].messages[-1] == {"role": "assistant", "content": "4"}
    assert cli(["prepare", f"--run_dir={tmp_path}", f"--prepare.data={path}", "--prepare.draft_vocab_size=50"]) == 0
    assert len(Prepared(tmp_path / "prepare")) == 2


# ---- reasoning ---------------------------------------------------------------------------------


def test_reasoning_kept_from_fields_and_inline_think_blocks(tmp_path):
    recs = [
        {"id": "field", "messages": [{"role": "user", "content": "q"},
                                     {"role": "assistant", "content": " a ", "reasoning_content": "\nthink\n"}]},
        {"id": "vllm", "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "reasoning": "r"}]},
        {"id": "inline", "messages": [{"role": "user", "content": "q"},
                                      {"role": "assistant", "content": "<think>\nstep 1\nstep 2\n</think>\n\nthe answer"}]},
        {"id": "no-opener", "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "hmm</think>ok"}]},
        {"id": "about-tags", "messages": [{"role": "user", "content": "q"},
                                          {"role": "assistant", "content": "Write <think> to open it and </think> to close it."}]},
        {"id": "sharegpt", "conversations": [{"from": "human", "value": "q"},
                                             {"from": "gpt", "value": "a", "reasoning_content": "r"}]},
        {"id": "merged", "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a1", "reasoning": "r1"},
                                      {"role": "assistant", "content": "a2"}, {"role": "assistant", "content": "<think>r3</think>a3"}]},
        {"id": "cut", "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
                                   {"role": "user", "content": "q2"}, {"role": "assistant", "content": None, "reasoning": "thinking..."}]},
        {"id": "null", "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "reasoning_content": None}]},
    ]
    p = tmp_path / "r.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in recs))
    convs, counts = load_conversations(str(p))
    got = {c.id: c.messages[-1] for c in convs}
    assert got == {
        "field": {"role": "assistant", "content": "a", "reasoning_content": "think"},
        "vllm": {"role": "assistant", "content": "a", "reasoning_content": "r"},
        "inline": {"role": "assistant", "content": "the answer", "reasoning_content": "step 1\nstep 2"},
        "no-opener": {"role": "assistant", "content": "hmm</think>ok"},  # data: a block only where the answer opens one
        "about-tags": {"role": "assistant", "content": "Write <think> to open it and </think> to close it."},
        "sharegpt": {"role": "assistant", "content": "a", "reasoning_content": "r"},
        "merged": {"role": "assistant", "content": "a1\n\na2\n\na3", "reasoning_content": "r1\n\nr3"},
        "cut": {"role": "assistant", "content": "a"},  # the answer cut off while thinking is removed, counted
        "null": {"role": "assistant", "content": "a"},
    }
    assert counts["reasoning_split_from_content"] == 2 and counts["removed_reasoning_without_answer"] == 1
    assert counts["merged_consecutive_turns"] == 2 and counts["removed_trailing_user_turn"] == 1


def test_inline_think_block_split_as_qwen3s_template_splits_it(smollm2_tokenizer):
    """The split content and reasoning render through Qwen3's template exactly as the inline text does
    (the template splits it itself when there is no reasoning_content)."""
    from eyas.chat import split_think
    from tests.reasoning_templates import QWEN3_TEMPLATE

    tok = smollm2_tokenizer
    old = tok.chat_template
    try:
        tok.chat_template = QWEN3_TEMPLATE
        for inline in ["<think>\nplan\n\n</think>\n\nanswer", "plan</think>answer", "\n<think>a</think>b</think>\nc",
                       "x<think>\n\nplan</think>\n\n\nanswer\n"]:
            reasoning, content = split_think(inline)
            as_is = tok.apply_chat_template([{"role": "user", "content": "q"}, {"role": "assistant", "content": inline}], tokenize=False)
            split = tok.apply_chat_template([{"role": "user", "content": "q"},
                                             {"role": "assistant", "content": content, "reasoning_content": reasoning}], tokenize=False)
            assert split == as_is, inline
    finally:
        tok.chat_template = old


def test_reasoning_that_is_not_a_string_names_the_record(tmp_path):
    p = tmp_path / "r.jsonl"
    p.write_text(json.dumps({"id": "rec3", "messages": [{"role": "user", "content": "q"},
                                                        {"role": "assistant", "content": "a", "reasoning_content": ["x"]}]}) + "\n")
    with pytest.raises(DataError, match=r"r\.jsonl:1 \(id rec3\): turn 1: 'reasoning_content' must be a string, got list"):
        load_conversations(str(p))
