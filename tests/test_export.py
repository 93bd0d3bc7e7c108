"""eyas.export, the stage: its refusals against the stages the draft came from (prepare's vocabulary,
extract's layers, train's meta.json, the target), its config and CLI, and averaging drafts by target
token. The drafts are real Eagle3Drafts sized for the real SmolLM2 config (tests/smollm2_drafts.py)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from eyas.draft_files import load_exported, save_draft
from eyas.errors import ArtifactError, ConfigError
from eyas.export import check_against_stages
from tests.data import run_prepare
from tests.smollm2_drafts import AUX, L, export, smollm2_draft


# --- refusals against the stages the draft came from ---------------------------------------------


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, smollm2_dir):
    """A real prepare output (8 short chats, W = 64)."""
    run = tmp_path_factory.mktemp("prep")
    chats = run / "chats.jsonl"
    with open(chats, "w") as f:
        for i in range(8):
            f.write(json.dumps({"conversations": [{"from": "human", "value": f"Count to {i + 3}, please."},
                                                  {"from": "gpt", "value": ", ".join(str(j) for j in range(1, i + 4))}]}) + "\n")  # fmt: skip
    return run_prepare(run, chats, draft_vocab=64)


def prepared_draft(tcfg, prepare_dir, **kw):
    vocab = load_file(str(prepare_dir / "vocab.safetensors"))
    d = smollm2_draft(tcfg, draft_vocab=vocab["d2t"].numel(), **kw)
    d.set_vocab(vocab["d2t"], vocab["t2d"])
    return d


def extract_meta(path, layer_ids, hidden=576, layers=L):
    from eyas.artifacts import write_meta

    path.mkdir(parents=True, exist_ok=True)
    write_meta(path, "extract", layer_ids=layer_ids, hidden_size=hidden, num_hidden_layers=layers)
    return path


def test_consistent_stages_pass_with_notes(tcfg, prepared, tmp_path):
    d = prepared_draft(tcfg, prepared)
    notes = check_against_stages(d.config, d.d2t, d.t2d, None, prepared, extract_meta(tmp_path / "ex", AUX), tcfg)
    assert any("matches" in n for n in notes) and any("aux layer ids" in n for n in notes)
    notes = check_against_stages(d.config, d.d2t, d.t2d, None, tmp_path / "nope", tmp_path / "nope", tcfg)
    assert all("not cross-checked" in n for n in notes)


def test_refuses_a_vocabulary_that_disagrees_with_prepare(tcfg, prepared):
    d = prepared_draft(tcfg, prepared)
    wrong = d.d2t.clone()
    wrong[-1] += 1
    with pytest.raises(ArtifactError, match="d2t differs.*re-run `eyas train`"):
        check_against_stages(d.config, wrong, d.t2d, None, prepared, prepared / "x", tcfg)
    other = smollm2_draft(tcfg, draft_vocab=128)
    with pytest.raises(ArtifactError, match="draft_vocab_size=128 but .* selected 64"):
        check_against_stages(other.config, other.d2t, other.t2d, None, prepared, prepared / "x", tcfg)


def test_refuses_layer_ids_that_disagree_with_extract(tcfg, prepared, tmp_path):
    d = prepared_draft(tcfg, prepared)
    with pytest.raises(ArtifactError, match=r"aux_layer_ids=\[2, 15, 27\] in the draft but .* holds layers \[3, 15, 27\]"):
        check_against_stages(d.config, d.d2t, d.t2d, None, prepared, extract_meta(tmp_path / "a", [3, 15, 27]), tcfg)
    with pytest.raises(ArtifactError, match="hidden_size=960"):
        check_against_stages(d.config, d.d2t, d.t2d, None, prepared, extract_meta(tmp_path / "b", AUX, hidden=960), tcfg)


def test_refuses_a_checkpoint_the_train_meta_does_not_describe(tcfg, prepared):
    d = prepared_draft(tcfg, prepared)
    meta = {"draft": dict(d.config.to_dict(), aux_layer_ids=[1, 2, 3]), "target": {"model": "embedded:smollm2"}, "inputs": {}}
    with pytest.raises(ArtifactError, match=r"draft_config.aux_layer_ids=\[2, 15, 27\] but the train meta.json records \[1, 2, 3\]"):
        check_against_stages(d.config, d.d2t, d.t2d, meta, prepared, prepared / "x", tcfg, "embedded:smollm2")
    meta = {"draft": d.config.to_dict(), "target": {"model": "other/model"}, "inputs": {"prepare": {"meta_sha256": "0" * 64}}}
    with pytest.raises(ArtifactError, match="trained for target 'other/model'"):
        check_against_stages(d.config, d.d2t, d.t2d, meta, prepared, prepared / "x", tcfg, "embedded:smollm2")
    meta["target"]["model"] = "embedded:smollm2"
    with pytest.raises(ArtifactError, match="changed after the draft was trained"):
        check_against_stages(d.config, d.d2t, d.t2d, meta, prepared, prepared / "x", tcfg, "embedded:smollm2")


def test_refuses_a_draft_for_another_target(tcfg, prepared):
    from transformers import LlamaConfig

    d = prepared_draft(tcfg, prepared)
    with pytest.raises(ArtifactError, match="vocab_size=49152 but the target has vocab_size=32000"):
        check_against_stages(d.config, d.d2t, d.t2d, None, prepared, prepared / "x", LlamaConfig(vocab_size=32000, hidden_size=576))


# --- the stage: config and CLI ---------------------------------------------------------------------


def test_export_config_validates():
    from eyas.config import load_config

    with pytest.raises(ConfigError, match="export.dtype='fp8'"):
        load_config(None, ["--export.dtype=fp8"])
    with pytest.raises(ConfigError, match="export.format='gguf'"):
        load_config(None, ["--export.format=gguf"])
    assert load_config(None, []).export.dtype == "bfloat16"


def test_cli_export_writes_both_layouts_and_refuses_a_mismatch(tcfg, prepared, tmp_path, capsys):
    from eyas.cli import main as cli

    run = prepared.parent
    train = tmp_path / "train"
    save_draft(prepared_draft(tcfg, prepared), train / "final")
    out = tmp_path / "export"
    args = [f"--run_dir={run}", f"--out_dir={out}"]
    assert cli(["export", str(train), *args]) == 0, capsys.readouterr().err
    meta = json.loads((out / "meta.json").read_text())
    assert meta["stage"] == "export" and set(meta["formats"]) == {"sglang", "speculators"}
    assert meta["aux_layer_ids"] == {"eyas_hf_index": AUX, "vllm": AUX, "sglang": [1, 14, 26]}
    assert any("vocabulary" in n and "matches" in n for n in meta["checks"])
    assert load_file(str(out / "sglang" / "model.safetensors"))["fc.weight"].dtype == torch.bfloat16
    # --format narrows the output and removes the stale layout
    assert cli(["export", str(train), *args, "--format", "speculators", "--dtype", "float32"]) == 0
    assert not (out / "sglang").exists() and (out / "speculators" / "config.json").is_file()
    assert load_file(str(out / "speculators" / "model.safetensors"))["fc.weight"].dtype == torch.float32
    # a draft whose vocabulary is not the prepare output's: exit 2, the message names the fix
    bad = prepared_draft(tcfg, prepared)
    bad.d2t[-1] += 1
    save_draft(bad, tmp_path / "bad" / "final")
    capsys.readouterr()
    assert cli(["export", str(tmp_path / "bad"), *args]) == 2
    assert "re-run `eyas train`" in capsys.readouterr().err


def test_export_averages_drafts_by_target_token(tcfg, prepared, tmp_path, capsys):
    """--export.average_with: every tensor becomes the mean of the trained draft (W = 64) and the
    others; each lm_head row (one target token) the mean over the drafts whose vocabulary holds that
    token, checked row by row against a naive loop over the other drafts' rows as read back. The
    others: a whole-vocabulary draft in bf16 (its file has no d2t: rows in target order) and a
    W = 512 draft sharing 20 of the trained draft's tokens; averaged with the second alone, the 44
    rows it lacks stay the trained draft's. The result keeps the trained draft's vocabulary;
    meta.json names what was averaged; another architecture is refused."""
    import numpy as np

    from eyas.cli import main as cli
    from eyas.vocab import d2t_t2d

    run = prepared.parent
    trained = prepared_draft(tcfg, prepared)
    save_draft(trained, tmp_path / "train" / "final")
    whole = smollm2_draft(tcfg, draft_vocab=tcfg.vocab_size, seed=1)
    whole.set_vocab(*d2t_t2d(np.random.default_rng(1).permutation(tcfg.vocab_size), tcfg.vocab_size))
    export(whole, tmp_path / "whole", formats=("speculators",), dtype="bfloat16")
    assert "d2t" not in load_file(str(tmp_path / "whole" / "speculators" / "model.safetensors"))
    part = smollm2_draft(tcfg, draft_vocab=512, seed=2)
    mine = (torch.arange(64) + trained.d2t).numpy()
    rest = np.setdiff1d(np.arange(tcfg.vocab_size), mine)
    part.set_vocab(*d2t_t2d(np.sort(np.concatenate([mine[::3][:20], np.random.default_rng(2).choice(rest, 492, replace=False)])),
                            tcfg.vocab_size))
    export(part, tmp_path / "part", formats=("speculators",), dtype="float32")

    def averaged(names):
        out = tmp_path / ("averaged-" + "-".join(names))  # not into a draft it reads: that one is not its to replace
        dirs = ",".join(str(tmp_path / n / "speculators") for n in names)
        args = [f"--run_dir={run}", f"--out_dir={out}", "--format", "speculators", "--dtype", "float32"]
        assert cli(["export", str(tmp_path / "train"), *args, f"--average_with=[{dirs}]"]) == 0, capsys.readouterr().err
        return load_exported(out / "speculators"), json.loads((out / "meta.json").read_text())

    def check(got, others):
        assert torch.equal(got.d2t, trained.d2t) and torch.equal(got.t2d, trained.t2d)
        sds = [trained.state_dict()] + [o.state_dict() for o in others]
        for k in sds[0]:
            if k not in ("d2t", "t2d", "lm_head.weight"):
                torch.testing.assert_close(got.state_dict()[k], sum(sd[k].float() for sd in sds) / len(sds), rtol=0, atol=1e-6)
        counts = []
        row_of = [{j + int(t): j for j, t in enumerate(o.d2t.tolist())} for o in others]  # target token -> row
        for r in range(64):
            token = r + int(trained.d2t[r])
            rows = [trained.lm_head.weight[r]] + [o.lm_head.weight[index[token]].float()
                                                  for o, index in zip(others, row_of) if token in index]
            counts.append(len(rows))
            torch.testing.assert_close(got.lm_head.weight[r], torch.stack(rows).mean(0), rtol=0, atol=1e-6)
        return counts

    read = {n: load_exported(tmp_path / n / "speculators") for n in ("whole", "part")}  # bf16-rounded as averaged
    got, meta = averaged(["whole", "part"])
    counts = check(got, [read["whole"], read["part"]])
    assert counts.count(3) == 20 and counts.count(2) == 44
    assert [a["lm_head_rows_shared"] for a in meta["inputs"]["average_with"]] == [64, 20]
    assert all(len(a["weights_sha256"]) == 64 for a in meta["inputs"]["average_with"])
    got, _ = averaged(["part"])
    assert check(got, [read["part"]]).count(1) == 44
    lacking = [r for r in range(64) if r % 3 or r >= 60]
    assert torch.equal(got.lm_head.weight[lacking], trained.lm_head.weight[lacking])
    # another architecture: refused with the field that differs
    export(smollm2_draft(tcfg, draft_vocab=64, intermediate_size=256), tmp_path / "wide", formats=("speculators",))
    capsys.readouterr()
    args = [f"--run_dir={run}", f"--out_dir={tmp_path / 'x'}", f"--average_with=[{tmp_path / 'wide' / 'speculators'}]"]
    assert cli(["export", str(tmp_path / "train"), *args]) == 2
    assert "intermediate_size 256" in capsys.readouterr().err
    # EAGLE 3.1's norms are architecture too: refused against an EAGLE-3 draft, averaged with one of their own
    export(smollm2_draft(tcfg, draft_vocab=64, fc_norm=True, norm_output=True), tmp_path / "e31", formats=("speculators",))
    args = [f"--run_dir={run}", f"--out_dir={tmp_path / 'y'}", f"--average_with=[{tmp_path / 'e31' / 'speculators'}]"]
    assert cli(["export", str(tmp_path / "train"), *args]) == 2
    assert "fc_norm True (trained draft: False)" in capsys.readouterr().err
    from eyas.average import average_drafts

    a, b = (smollm2_draft(tcfg, draft_vocab=64, seed=s, fc_norm=True, norm_output=True) for s in (3, 4))
    want = (a.fc_norm[2].weight + b.fc_norm[2].weight) / 2
    average_drafts(a, [b], ["b"])
    torch.testing.assert_close(a.fc_norm[2].weight, want)


def test_export_removes_and_overwrites_only_the_files_its_records_say_it_wrote(tcfg, prepared, tmp_path, capsys):
    """`eyas export --out_dir W` into a folder that holds someone else's sglang/ tree, config.yaml
    and meta.json: exit 2 naming them, every byte kept. Into its own earlier export: --format
    narrows it (its own layout removed), but a file added to a layout it would remove is refused;
    an export cut short (no meta.json) still owns what it wrote (its ledger); a symlinked layout
    folder is refused (eyas makes none)."""
    from eyas.cli import main as cli

    run = prepared.parent
    train = tmp_path / "train"
    save_draft(prepared_draft(tcfg, prepared), train / "final")

    def export_to(out, *more):
        capsys.readouterr()
        rc = cli(["export", str(train), f"--run_dir={run}", f"--out_dir={out}", *more])
        return rc, capsys.readouterr().err

    def files(root):
        return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
                and p.name != ".eyas.lock"}

    theirs = tmp_path / "theirs"
    (theirs / "sglang" / "notes").mkdir(parents=True)
    (theirs / "sglang" / "notes" / "plan.txt").write_text("an unrelated tree")
    (theirs / "config.yaml").write_text("theirs: 1\n")
    (theirs / "meta.json").write_text('{"theirs": true}\n')
    before = files(theirs)
    rc, err = export_to(theirs, "--format", "speculators")
    assert rc == 2 and f"{theirs / 'meta.json'}, {theirs / 'config.yaml'}, {theirs / 'sglang' / 'notes' / 'plan.txt'}" \
        in err and "not written by `eyas export`" in err and "--export.out_dir" in err, err
    assert files(theirs) == before

    mine = tmp_path / "mine"
    assert export_to(mine)[0] == 0
    (mine / "speculators" / "README.md").write_text("my notes on this draft")
    rc, err = export_to(mine, "--format", "sglang")
    assert rc == 2 and str(mine / "speculators" / "README.md") in err, err
    assert (mine / "speculators" / "model.safetensors").is_file() and (mine / "meta.json").is_file()
    (mine / "speculators" / "README.md").unlink()
    (mine / "meta.json").unlink()  # as an export cut short leaves it: its ledger still names its files
    assert export_to(mine, "--format", "sglang")[0] == 0
    assert not (mine / "speculators").exists() and (mine / "sglang" / "model.safetensors").is_file()

    linked = tmp_path / "linked"
    linked.mkdir()
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "model.safetensors").write_bytes(b"not a draft of ours")
    (linked / "sglang").symlink_to(tmp_path / "elsewhere")
    rc, err = export_to(linked)
    assert rc == 2 and str(linked / "sglang") in err, err
    assert (tmp_path / "elsewhere" / "model.safetensors").read_bytes() == b"not a draft of ours"

    (tmp_path / "outside.txt").write_text("not export's")  # a record edited by hand to name a file outside
    assert export_to(mine)[0] == 0  # both layouts again: speculators/ is there to be walked out of
    ledger = mine / ".eyas-export-files.json"
    ledger.write_text(json.dumps([*json.loads(ledger.read_text()), "speculators/../../outside.txt"]))
    assert export_to(mine, "--format", "sglang")[0] == 0
    assert (tmp_path / "outside.txt").read_text() == "not export's"  # only its layouts' own file names are removed


def test_a_streamed_draft_is_checked_against_the_layers_its_training_streamed(tcfg, prepared):
    """train.mode=stream has no extract output: export checks the aux layers train recorded as streamed."""
    d = prepared_draft(tcfg, prepared)
    streamed = {"inputs": {"stream": {"layer_ids": list(AUX), "engines": 1}}}
    notes = check_against_stages(d.config, d.d2t, d.t2d, streamed, prepared, None, tcfg)
    assert any(f"streamed states of layers {list(AUX)}: aux layer ids match" in n for n in notes)
    other = {"inputs": {"stream": {"layer_ids": [3, 15, 27], "engines": 1}}}
    with pytest.raises(ArtifactError, match=r"reads aux layers \[2, 15, 27\], its training streamed layers \[3, 15, 27\]"):
        check_against_stages(d.config, d.d2t, d.t2d, other, prepared, None, tcfg)
