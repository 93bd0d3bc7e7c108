"""`eyas run`'s preflight (eyas/run/preflight.py): what the config and the target's config.json allow is
checked before the first stage runs, not when the stage that needs it starts (after prepare,
regenerate or extract have spent their time): aux layer ids against the target's layers (a
multimodal wrapper's nested text config), the draft vocabulary against the target's, the draft's
heads against its kv heads, a local target path that does not exist and the evaluate bench file
(read whole); and a run directory this user may not write to."""

from __future__ import annotations

import pytest

from eyas.config import load_config
from eyas.errors import ConfigError
from tests.data import write_synthetic_chats
from tests.models import save_tiny
from tests.test_run import recipe

STAGE_DIRS = ("regenerate", "prepare", "extract", "train", "export", "evaluate")


def no_stage_ran(run) -> bool:
    return not any((run / s).exists() for s in STAGE_DIRS)


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory, smollm2_dir):
    """A tiny Llama (8 layers, 4 heads, 2 kv heads, SmolLM2's vocabulary) with the SmolLM2 tokenizer."""
    return save_tiny("llama", tmp_path_factory.mktemp("tiny") / "target", smollm2_dir)


def run_args(tmp_path):
    return ["--regenerate.enabled=false", f"--prepare.data={write_synthetic_chats(tmp_path / 'chats.jsonl', 6)}"]


@pytest.mark.parametrize("extra, match", [
    (["--extract.layer_ids=[2,99]"], r"extract\.layer_ids=\[2, 99\]: ids must lie in \[0, 7\]"),
    (["--extract.layer_ids=[2,99]", "--train.mode=online"], r"extract\.layer_ids=\[2, 99\]"),
    (["--extract.layer_ids=[5,2,3]"], r"extract\.layer_ids=\[5, 2, 3\]: list the ids in ascending order"),
    (["--prepare.draft_vocab_size=60000"], r"prepare\.draft_vocab_size=60000 is larger than the target vocabulary \(49152\)"),
    (["--train.num_attention_heads=5"], r"--train\.num_attention_heads"),
    (["--train.num_key_value_heads=3"], r"--train\.num_key_value_heads"),
    (["--target.chat_template=/no/such/template.jinja"], r"target\.chat_template='/no/such/template\.jinja': no such file"),
    (["--evaluate.bench=/no/such/bench.jsonl"], r"evaluate\.bench='/no/such/bench\.jsonl': not `mtbench` and no such file"),
    (["--train.init_from=/no/such/draft"], r"train\.init_from='/no/such/draft': no such directory"),
])
def test_what_the_target_config_refuses_is_refused_before_any_stage_runs(tmp_path, tiny_target, extra, match):
    y = str(recipe(tmp_path, tiny_target))
    from eyas.run import main as run

    with pytest.raises(ConfigError, match=match):
        run(load_config(y, [*run_args(tmp_path), *extra]))
    assert no_stage_ran(tmp_path / "run")


def test_a_missing_local_target_says_no_such_directory(tmp_path):
    """A target.model that is a path (/..., ./..., ../..., ~/..., a/b/c) and does not exist is "no such
    directory", before any stage runs and when a stage loads the target, not huggingface_hub's "Repo id
    must be in the form ..."; a hub id (namespace/name) is left to the hub."""
    from eyas.config import TargetConfig
    from eyas.run import main as run
    from eyas.target import load_config as target_config
    from eyas.target import model_path

    y = str(recipe(tmp_path, "/no/such/dir"))
    with pytest.raises(ConfigError, match=r"target\.model='/no/such/dir': no such directory"):
        run(load_config(y, run_args(tmp_path)))
    assert no_stage_ran(tmp_path / "run")
    for missing in ("/no/such/dir", "./no-such-eyas-target", "../no-such-eyas-target", "~/no-such-eyas-target",
                    "no/such/eyas-target"):
        with pytest.raises(ConfigError, match="no such directory"):
            target_config(TargetConfig(model=missing))
    assert model_path(TargetConfig(model="HuggingFaceTB/SmolLM2-135M-Instruct")) == "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_a_multimodal_wrapper_is_checked_against_its_text_config(tmp_path):
    """A wrapper's config.json nests its text model's: layer ids and heads are checked against that
    one (only config.json is read: no weights, no tokenizer)."""
    import transformers as tf

    from eyas.run.preflight import preflight

    text = tf.LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                          num_attention_heads=4, num_key_value_heads=2)
    tf.LlavaConfig(text_config=text, vision_config=tf.CLIPVisionConfig()).save_pretrained(str(tmp_path / "wrapper"))
    stages = ["prepare", "extract", "train", "export", "evaluate"]

    def check(*args):
        preflight(load_config(None, [f"--target.model={tmp_path / 'wrapper'}", "--prepare.draft_vocab_size=500", *args]),
                  stages)

    check()  # the default ids [1, 2, 3] of a 4-layer text model
    check("--extract.layer_ids=[0,1,3]")
    with pytest.raises(ConfigError, match=r"extract\.layer_ids=\[1, 4\]: ids must lie in \[0, 3\]"):
        check("--extract.layer_ids=[1,4]")
    with pytest.raises(ConfigError, match=r"prepare\.draft_vocab_size=2000 .*\(1000\)"):
        check("--prepare.draft_vocab_size=2000")
    with pytest.raises(ConfigError, match=r"--train\.num_attention_heads"):
        check("--train.num_attention_heads=3")
    # a run that stops at prepare reads no aux layers: the ids wait for the run that extracts
    preflight(load_config(None, [f"--target.model={tmp_path / 'wrapper'}", "--extract.layer_ids=[1,4]"]), ["prepare"])


def test_a_draft_to_start_from_of_another_shape_is_refused_before_extract(tmp_path, tiny_target, capsys):
    """--train.init_from with a draft of this run's vocabulary but another shape (MLP width, aux
    layers) than the one this run trains is refused before extract (with the vocabulary check: both
    need prepare's vocabulary first), not when train builds its draft after extract."""
    import json

    from safetensors.torch import load_file
    from transformers import AutoConfig

    from eyas.cli import main as cli
    from eyas.draft import DraftConfig, Eagle3Draft
    from eyas.draft_files import save_draft

    y, run = str(recipe(tmp_path, tiny_target)), tmp_path / "run"
    args = run_args(tmp_path)
    assert cli(["run", y, *args, "--stop_after=prepare"]) == 0
    v = load_file(str(run / "prepare" / "vocab.safetensors"))
    tcfg = AutoConfig.from_pretrained(str(tiny_target))
    for name, ids in (("aux", [1, 4, 7]), ("wide", [2, 4, 5])):  # the run's default ids: [2, 4, 5]
        draft = Eagle3Draft(DraftConfig.from_target(tcfg, v["d2t"].numel(), ids))
        draft.set_vocab(v["d2t"], v["t2d"])
        save_draft(draft, tmp_path / name)
    capsys.readouterr()
    assert cli(["run", y, *args, f"--train.init_from={tmp_path / 'aux'}"]) == 2
    err = capsys.readouterr().err
    assert "train: refused before extract runs" in err and "aux_layer_ids [1, 4, 7] there, [2, 4, 5] here" in err
    assert cli(["run", y, *args, f"--train.init_from={tmp_path / 'wide'}", "--train.intermediate_size=96"]) == 2
    assert "intermediate_size 128 there, 96 here" in capsys.readouterr().err
    assert not (run / "extract").exists()
    summary = json.loads((run / "summary.json").read_text())
    assert summary["failed_stage"] == "train" and summary["exit_status"] == 2


@pytest.mark.parametrize("line, match", [
    ('{"turns": ["fine"]}\n{"turns": ["cut', r"bench\.jsonl:2: malformed JSON line: .*cut short"),
    ('{"turns": ["fine"]}\n{"turns": []}', r"bench\.jsonl:2: expected \{\"turns\""),
    ('{"turns": ["caf\xe9"]}', r"bench\.jsonl:1: not valid UTF-8: byte 0xe9"),
])
def test_a_bad_evaluate_bench_file_is_refused_before_any_stage_runs(tmp_path, tiny_target, line, match):
    """evaluate.bench is read whole in the preflight, as evaluate reads it: a malformed line fails the
    run before prepare, not after training."""
    from eyas.errors import DataError
    from eyas.run import main as run

    bench = tmp_path / "bench.jsonl"
    bench.write_bytes(line.encode("latin-1"))
    with pytest.raises(DataError, match=match):
        run(load_config(str(recipe(tmp_path, tiny_target)), [*run_args(tmp_path), f"--evaluate.bench={bench}"]))
    assert no_stage_ran(tmp_path / "run")


@pytest.fixture
def read_only_dir(tmp_path):
    """An empty directory this process may not write into: mode 555, or for root (whom modes do not
    stop) the immutable attribute (chattr +i; skipped where the filesystem has none)."""
    import os
    import subprocess

    d = tmp_path / "read-only"
    d.mkdir()
    if os.geteuid() != 0:
        d.chmod(0o555)
        yield d
        d.chmod(0o755)
        return
    if subprocess.run(["chattr", "+i", str(d)], capture_output=True, check=False).returncode != 0:
        pytest.skip("root, and no chattr +i here to make a directory read-only")
    try:
        yield d
    finally:
        subprocess.run(["chattr", "-i", str(d)], check=True)


@pytest.mark.parametrize("command", ["run", "prepare"])
def test_a_read_only_run_directory_says_so_and_what_to_do(read_only_dir, command, capsys):
    from eyas.cli import main as cli

    for run_dir in (read_only_dir, read_only_dir / "run"):
        assert cli([command, f"--run_dir={run_dir}", "--prepare.max_conversations=2"]) == 2
        err = capsys.readouterr().err
        assert f"{read_only_dir}" in err and "may not write" in err and "--run_dir" in err, err
        assert "Traceback" not in err


@pytest.mark.parametrize("damage, said", [("cut", "bytes where its header says"), ("header", "its header is not valid JSON")])
def test_a_damaged_target_weight_file_is_named_before_any_stage_runs(tmp_path, tiny_target, damage, said):
    """A target model.safetensors cut short (an interrupted copy) or with a damaged header is named,
    with what to do, before prepare runs and when a stage loads the target, where safetensors says only
    "Error while deserializing header"."""
    import shutil

    from eyas.config import TargetConfig
    from eyas.errors import ArtifactError
    from eyas.run import main as run
    from eyas.target import load_model

    target = shutil.copytree(tiny_target, tmp_path / "target")
    weights = target / "model.safetensors"
    data = bytearray(weights.read_bytes())
    if damage == "cut":
        del data[len(data) // 2:]
    else:
        data[12] ^= 0xFF  # inside the JSON header
    weights.write_bytes(bytes(data))
    match = rf"{weights}: a weight file of target\.model=.* is damaged \(.*{said}.*copy or download it again"
    with pytest.raises(ArtifactError, match=match):
        run(load_config(str(recipe(tmp_path, tiny_target)), [*run_args(tmp_path), f"--target.model={target}"]))
    assert no_stage_ran(tmp_path / "run")
    with pytest.raises(ArtifactError, match=match):
        load_model(TargetConfig(model=str(target), dtype="float32"), device="cpu")


def draft_for_layers(out, tcfg, num_layers: int, ids: list[int]):
    """An eyas checkpoint (untrained) for a target of config `tcfg` but of `num_layers` layers, with aux `ids`."""
    import copy

    from eyas.draft import DraftConfig, Eagle3Draft
    from eyas.draft_files import save_draft

    tcfg = copy.deepcopy(tcfg)
    tcfg.num_hidden_layers = num_layers
    save_draft(Eagle3Draft(DraftConfig.from_target(tcfg, 500, ids)), out)
    return out


@pytest.mark.parametrize("backend", ["hf", "vllm"])
def test_a_draft_of_another_target_is_refused_by_either_evaluator_before_it_loads(tmp_path, tiny_target, backend,
                                                                                   capsys):
    """A draft trained on a 12-layer target (aux [2, 6, 11]) evaluated behind the 8-layer one: both
    backends refuse it from the configs alone (exit 2, naming the ids), before any model or engine
    loads (vLLM would load the target and stop on a shape error), and `eyas run` refuses it before
    its first stage."""
    from transformers import AutoConfig

    from eyas.cli import main as cli

    draft = draft_for_layers(tmp_path / "draft", AutoConfig.from_pretrained(str(tiny_target)), 12, [2, 6, 11])
    common = [f"--target.model={tiny_target}", f"--evaluate.draft={draft}", f"--evaluate.backend={backend}",
              f"--run_dir={tmp_path / 'run'}", "--evaluate.mode=chain"]
    assert cli(["evaluate", *common]) == 2
    err = capsys.readouterr().err
    assert "aux_layer_ids [2, 6, 11] do not fit num_aux_layers=3 and a 8-layer target" in err, err
    assert not (tmp_path / "run" / "evaluate").exists()
    y = str(recipe(tmp_path, tiny_target))
    assert cli(["run", y, *run_args(tmp_path), *common]) == 2
    assert "aux_layer_ids [2, 6, 11] do not fit" in capsys.readouterr().err
    assert no_stage_ran(tmp_path / "run")


def test_evaluate_backend_vllm_without_vllm_is_refused_before_any_stage_runs(tmp_path, tiny_target):
    """evaluate.backend=vllm where vLLM is not installed: refused before the first stage (not after training)."""
    import importlib.util

    from eyas.run import main as run

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here")
    with pytest.raises(ConfigError, match=r"evaluate\.backend=vllm needs vLLM in this Python environment"):
        run(load_config(str(recipe(tmp_path, tiny_target)), [*run_args(tmp_path), "--evaluate.backend=vllm", "--evaluate.mode=chain"]))
    assert no_stage_ran(tmp_path / "run")


def test_under_torchrun_a_rank_says_its_own_exit_status(tmp_path, capsys, monkeypatch):
    """torchrun exits 1 whatever status a rank exits with: the rank's error says its own (2: a setting
    to change) and where `eyas run` records it."""
    from eyas.cli import main as cli

    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    assert cli(["run", "--target.model=/no/such/dir", f"--run_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert "this rank exits 2 (a setting or input to change, above); torchrun reports 1 for any failed rank" in err
    assert "summary.json's exit_status" in err
