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
