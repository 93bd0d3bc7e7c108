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
