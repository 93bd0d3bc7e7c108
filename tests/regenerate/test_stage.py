"""eyas.regenerate, the stage: turn-by-turn answers from the real SmolLM2, equal to an independent
batch-1 greedy `generate`; resume never redoes a finished conversation; turn and time budgets."""

from __future__ import annotations

import json

from eyas.cli import main as cli
from eyas.config import load_config
from eyas.regenerate import batches, main as regenerate, out_of_time
from tests.regenerate.chat_server import greedy_reply
from tests.regenerate.runs import CONVS, NEW, cfg_for, read, reference


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


def test_resume_reads_records_with_unicode_line_separators(tmp_path):
    """Generated text may hold U+2028 / U+0085 (json.dumps keeps them with ensure_ascii=False);
    they are not line breaks of the JSONL file."""
    from eyas.regenerate import append_records, read_done

    path = tmp_path / "c.jsonl"
    odd = "a\u2028b\x85c\u2029d\x1ce"
    append_records(path, [{"source_index": 3, "messages": [{"role": "assistant", "content": odd}]},
                          {"source_index": 7, "messages": []}])
    assert read_done(path) == {3, 7}


def test_the_conversations_file_is_never_written_through_a_symlink(tmp_path):
    """conversations.jsonl as a symbolic link out of the stage directory (eyas makes none): resuming
    neither cuts its target's torn last line nor appends to it; the error names the link."""
    import pytest

    from eyas.errors import ArtifactError
    from eyas.regenerate import append_records, read_done

    outside = tmp_path / "someone-elses.jsonl"
    outside.write_text('{"source_index": 1, "messages": []}\n{"unfinished')
    link = tmp_path / "regenerate" / "conversations.jsonl"
    link.parent.mkdir()
    link.symlink_to(outside)
    with pytest.raises(ArtifactError, match=f"{link} is a symbolic link .*never writes through one.*--regenerate.out_dir"):
        read_done(link)
    with pytest.raises(ArtifactError, match="symbolic link"):
        append_records(link, [{"source_index": 2, "messages": []}])
    assert outside.read_text() == '{"source_index": 1, "messages": []}\n{"unfinished'


def test_a_resume_under_other_inputs_is_refused_naming_what_changed(tmp_path, data):
    """Answers of one data file, target or sampling setting are never continued under another: the
    second run stops before loading anything, naming each changed setting, and leaves the file and
    its records as they were. The same data under another path, a budget or a larger
    max_conversations continue it."""
    import pytest

    from eyas.errors import ConfigError

    out = tmp_path / "regenerate"
    s = regenerate(cfg_for(tmp_path, data, "--prepare.max_conversations=1"))
    assert s["conversations_written"] == 1
    before = {f: (out / f).read_bytes() for f in ("conversations.jsonl", "meta.json", "config.yaml")}
    other = tmp_path / "other.jsonl"
    other.write_text("\n".join(json.dumps(c) for c in CONVS[::-1]) + "\n")
    for extra, named in [((f"--prepare.data={other}",), [f"prepare.data: {data} ", f"-> {other}"]),
                         (("--regenerate.temperature=0.7",), ["regenerate.temperature: 0.0 -> 0.7"]),
                         (("--regenerate.top_p=0.5", "--regenerate.max_new_tokens=9"),
                          ["regenerate.top_p: 1.0 -> 0.5", f"regenerate.max_new_tokens: {NEW} -> 9"])]:
        with pytest.raises(ConfigError) as e:
            regenerate(load_config(None, [f"--run_dir={tmp_path}", f"--prepare.data={data}", "--target.dtype=float32",
                                          f"--regenerate.max_new_tokens={NEW}", *extra]))
        assert all(n in str(e.value) for n in named) and "--regenerate.out_dir" in str(e.value), str(e.value)
        assert {f: (out / f).read_bytes() for f in before} == before
    moved = tmp_path / "moved.jsonl"
    moved.write_bytes(data.read_bytes())
    s = regenerate(cfg_for(tmp_path, moved, "--prepare.max_conversations=2", "--regenerate.max_seconds=600",
                           "--regenerate.chunk_conversations=7"))
    assert (s["resumed_from"], s["regenerated_now"]) == (1, 1)
    meta = json.loads((out / "meta.json").read_text())
    assert meta["inputs"]["data"] == {"path": str(moved), "sha256": __import__("hashlib").sha256(data.read_bytes()).hexdigest()}


def test_answers_of_an_earlier_eyas_continue_and_a_moved_server_is_the_same_inputs(tmp_path, data, capsys):
    """Answers an earlier eyas wrote (no inputs.json) continue, said so, with this run's inputs
    recorded; a server at another address (same server_model), or the hf backend's batch size with
    the server backend, is no other input."""
    import json

    from eyas.regenerate import INPUTS, answer_inputs, check_inputs

    out = tmp_path / "regenerate"
    out.mkdir()
    server = ["--regenerate.backend=server", "--regenerate.server_model=m"]
    now = answer_inputs(cfg_for(tmp_path, data, *server, "--regenerate.server_url=http://127.0.0.1:8000"))
    check_inputs(out, now, done={1, 2})
    assert "answered by an earlier eyas, which recorded no inputs: continued" in capsys.readouterr().out
    assert json.loads((out / INPUTS).read_text()) == now
    moved = answer_inputs(cfg_for(tmp_path, data, *server, "--regenerate.server_url=http://127.0.0.1:9000",
                                  "--regenerate.batch_size=8"))
    check_inputs(out, moved, done={1, 2})  # not refused
