"""The regenerated conversations committed under data/ are what data/README.md says they are."""

import hashlib
import json
import lzma
from pathlib import Path

import pytest

DATA = Path(__file__).parent.parent / "data"


@pytest.mark.parametrize("name,count,self_prefix", [("smollm2-sharegpt-regenerated.jsonl.xz", 16813, None),
                                                    ("smollm2-self-written-regenerated.jsonl.xz", 7436, "self-"),
                                                    ("smollm2-self-written-seed1-regenerated.jsonl.xz", 14866, "self1-"),
                                                    ("smollm2-self-written-seed2-regenerated.jsonl.xz", 11157, "self2-"),
                                                    ("smollm2-self-written-seed3-regenerated.jsonl.xz", 29697, "self3-"),
                                                    ("smollm2-self-written-steered-seed5-regenerated.jsonl.xz", 21118, "self5-")])
def test_committed_regenerated_data_is_what_data_readme_says(name, count, self_prefix):
    """The sha256 and the count in the file's row of data/README.md's table, distinct ids, every
    assistant turn non-empty with a finish reason; the self-written ones single-turn, with ids
    <prefix>k and source indices -1-k."""
    path = DATA / name
    readme = (DATA / "README.md").read_text()
    row = next(line for line in readme.splitlines() if line.startswith(f"| `{name}` |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[-1] == f"`{hashlib.sha256(path.read_bytes()).hexdigest()}`"
    assert cells[1].split()[0] == f"{count:,}"
    recs = [json.loads(line) for line in lzma.open(path, "rt", encoding="utf-8")]
    assert len(recs) == count and len({r["id"] for r in recs}) == count
    for r in recs:
        answers = [m for m in r["messages"] if m["role"] == "assistant"]
        assert answers and all(m["content"] for m in answers), r["id"]
        assert len(r["finish_reasons"]) == len(answers) and set(r["finish_reasons"]) <= {"stop", "length"}, r["id"]
        assert r["id"].startswith("self") == (self_prefix is not None), r["id"]
        if self_prefix:
            assert r["id"].startswith(self_prefix), r["id"]
            k = int(r["id"].removeprefix(self_prefix))
            assert r["source_index"] == -1 - k and [m["role"] for m in r["messages"]] == ["user", "assistant"]


def test_committed_regenerated_files_share_no_id():
    """A training set joins several of the files (data/README.md): an id in two of them would
    put two conversations in one held-out group and name two samples alike in errors."""
    seen: dict[str, str] = {}
    for path in sorted(DATA.glob("*.jsonl.xz")):
        for line in lzma.open(path, "rt", encoding="utf-8"):
            i = json.loads(line)["id"]
            assert i not in seen, f"{i} is in both {seen[i]} and {path.name}"
            seen[i] = path.name
    assert len(seen) == 16813 + 7436 + 14866 + 11157 + 29697 + 21118
