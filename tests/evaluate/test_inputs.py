"""eyas.evaluate.inputs: the benchmark questions (MT-bench, JSONL) and their errors."""

from __future__ import annotations

import pytest

from eyas.errors import ConfigError, DataError
from eyas.evaluate.inputs import load_bench


def test_load_bench_mtbench_and_jsonl(tmp_path):
    mt = load_bench("mtbench")
    assert len(mt) == 80 and all(len(q["turns"]) == 2 for q in mt)
    assert len(load_bench("mtbench", 3)) == 3
    f = tmp_path / "p.jsonl"
    f.write_text('{"turns": ["a", "b"], "question_id": 7}\n\n{"prompt": "c"}\n"d"\n')
    expected = [{"id": "7", "turns": ["a", "b"]}, {"id": "3", "turns": ["c"]}, {"id": "4", "turns": ["d"]}]
    assert load_bench(str(f)) == expected  # ids: question_id, else the line number
    f.write_text('{"turns": ["a"]}\n{"turns": []}\n')
    with pytest.raises(DataError, match=r"p.jsonl:2"):
        load_bench(str(f))
    f.write_text("{oops\n")
    with pytest.raises(DataError, match=r"p.jsonl:1: malformed"):
        load_bench(str(f))
    with pytest.raises(ConfigError, match="no such file"):
        load_bench(str(tmp_path / "missing.jsonl"))


def test_context_tokens_prefix_real_earlier_turns(smollm2_tokenizer):
    """evaluate.context_tokens: each first prompt renders to >= N tokens through earlier ShareGPT
    user/assistant pairs (read here from the file itself, in order, none used twice), the
    question's own turns unchanged; 0 leaves the questions as they are."""
    import itertools
    import json

    from eyas.assets import sharegpt_path
    from eyas.evaluate.inputs import render, with_context

    questions = [{"id": "a", "turns": ["Name a colour.", "Another?"]}, {"id": "b", "turns": ["Hi."]}]
    assert with_context(questions, smollm2_tokenizer, 0) is questions
    got = with_context(questions, smollm2_tokenizer, 600)
    assert [q["turns"] for q in got] == [q["turns"] for q in questions]
    used = []
    for q in got:
        h = q["history"]
        assert h and [m["role"] for m in h] == ["user", "assistant"] * (len(h) // 2)
        assert len(render(smollm2_tokenizer, h + [{"role": "user", "content": q["turns"][0]}])) >= 600
        assert len(render(smollm2_tokenizer, h[:-2] + [{"role": "user", "content": q["turns"][0]}])) < 600  # no more
        used += [(h[i]["content"], h[i + 1]["content"]) for i in range(0, len(h), 2)]
    with open(sharegpt_path()) as f:  # the file's first conversations, read with the json module
        text = f.read(2_000_000)
    dec, pos, head = json.JSONDecoder(), text.index("{"), []
    while len(head) < 40:
        obj, end = dec.raw_decode(text, pos)
        head.append(obj)
        pos = text.index("{", end)
    want = [(a["value"], b["value"]) for c in head for a, b in zip(c["conversations"], c["conversations"][1:])
            if (a["from"], b["from"]) == ("human", "gpt") and a["value"].strip() and b["value"].strip()]
    assert used == list(itertools.islice(want, len(used)))
