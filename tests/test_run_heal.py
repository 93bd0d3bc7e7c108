"""The same `eyas run` heals what it finds damaged, makes again only the damaged part, and keeps the
stages after it when that part comes out as it was:

* an extract shard deleted, or cut short: only its samples are extracted again, under its own name,
  bit for bit as before; train, export and evaluate stay skipped;
* a byte flipped inside a shard (its size unchanged): the sha256 check finds it, and it is made again
  as the deleted ones;
* a token id flipped in prepare's tokens.safetensors: its sha256 in meta.json finds it before
  anything reads it; `eyas extract` alone refuses it naming the file;
* a truncated draft.safetensors: the error names the file and what to run, not a raw SafetensorError.
"""

from __future__ import annotations

import json

import pytest

from eyas.cli import main as cli
from eyas.errors import DamagedArtifact
from tests.data import write_synthetic_chats
from tests.models import save_tiny


@pytest.fixture(scope="module")
def made(tmp_path_factory, smollm2_dir):
    root = tmp_path_factory.mktemp("heal")
    target = save_tiny("llama", root / "tiny", smollm2_dir)
    chats = write_synthetic_chats(root / "chats.jsonl", 24, max_words=60)
    return root, target, chats


def args(run, target, chats, *extra):
    return ["run", f"--run_dir={run}", f"--target.model={target}", "--target.dtype=float32", f"--prepare.data={chats}",
            "--prepare.max_length=128", "--prepare.draft_vocab_size=500", "--extract.shard_bytes=1000000",
            "--extract.token_budget=256", "--train.ttt_steps=2", "--train.max_tokens=512", "--train.max_steps=10",
            "--train.eval_fraction=0.0", "--stop_after=train", *extra]


def status(out: str) -> dict[str, str]:
    got = {}
    for line in out.splitlines():
        for stage in ("prepare", "extract", "train"):
            if line.startswith(f"[eyas:run] {stage}: "):
                rest = line.split(": ", 1)[1]
                got[stage] = "skipped" if "skipped" in rest else "ran" if rest.startswith(("running", "resuming")) \
                    else got.get(stage, "")
    return got


def shards(run) -> dict:
    return json.loads((run / "extract" / "meta.json").read_text())["shards"]


@pytest.mark.slow
def test_extract_shards_deleted_cut_or_flipped_are_made_again_and_what_follows_stands(made, tmp_path, capsys):
    root, target, chats = made
    run = tmp_path / "run"
    assert cli(args(run, target, chats)) == 0
    capsys.readouterr()
    before, draft = shards(run), (run / "train" / "final" / "draft.safetensors").read_bytes()
    names = sorted(before)
    assert len(names) >= 4
    (run / "extract" / names[1]).unlink()
    with open(run / "extract" / names[3], "r+b") as f:
        f.truncate(1000)
    assert cli(args(run, target, chats)) == 0
    out = capsys.readouterr().out
    assert f"extract: 2 damaged file(s): {names[1]} (missing), {names[3]} (1,000 of " in out
    assert "made again bit for bit as it was" in out
    assert status(out) == {"prepare": "skipped", "extract": "ran", "train": "skipped"}
    assert shards(run) == before and (run / "train" / "final" / "draft.safetensors").read_bytes() == draft

    with open(run / "extract" / names[2], "r+b") as f:  # same size, other bytes: only a sha256 check sees it
        f.seek(-100, 2)
        byte = f.read(1)
        f.seek(-100, 2)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert cli(args(run, target, chats)) == 0
    out = capsys.readouterr().out
    assert f"extract: 1 damaged file(s): {names[2]} (its sha256 differs from meta.json)" in out
    kept = run / "extract" / names[2].replace("r000-", "damaged-r000-")
    assert kept.is_file() and f"kept as {kept}" in out  # kept, out of extract's way
    assert status(out) == {"prepare": "skipped", "extract": "ran", "train": "skipped"} and shards(run) == before


@pytest.mark.slow
def test_a_flipped_token_id_in_prepares_output_is_caught_and_made_again(made, tmp_path, capsys):
    root, target, chats = made
    run = tmp_path / "run"
    assert cli(args(run, target, chats, "--stop_after=extract")) == 0
    capsys.readouterr()
    tokens = run / "prepare" / "tokens.safetensors"
    whole = tokens.read_bytes()
    flipped = bytearray(whole)
    flipped[-8] ^= 0x01  # a token id near the end
    tokens.write_bytes(bytes(flipped))
    assert cli(["extract", f"--run_dir={run}", f"--target.model={target}", "--target.dtype=float32",
                "--extract.out_dir=" + str(tmp_path / "alone")]) == 2
    err = capsys.readouterr().err
    assert f"{tokens} is damaged: its sha256 differs from the one in meta.json; run prepare again" in err
    assert cli(args(run, target, chats, "--stop_after=extract")) == 0
    out = capsys.readouterr().out
    assert "prepare: 1 damaged file(s): tokens.safetensors (is damaged: its sha256 differs" in out
    assert "made again bit for bit as it was" in out
    assert status(out) == {"prepare": "ran", "extract": "skipped"} and tokens.read_bytes() == whole
    assert (run / "prepare.damaged" / "tokens.safetensors").read_bytes() == bytes(flipped)


def test_a_truncated_draft_names_the_file_and_what_to_run(tmp_path, smollm2_dir):
    from eyas.draft_files import load_draft, save_draft
    from tests.models import random_draft, tiny_model

    target = tiny_model(layers=4)
    save_draft(random_draft(target, list(range(0, 300, 3)), (0, 1, 3)), tmp_path / "d")
    weights = tmp_path / "d" / "draft.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(DamagedArtifact, match=r"draft.safetensors is not a readable safetensors file .*truncated or "
                                              r"damaged; train again \(--train.resume=auto"):
        load_draft(tmp_path / "d")
