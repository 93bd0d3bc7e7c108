"""eyas.extract, the stage: stored states equal a plain forward per architecture and for SmolLM2;
resume after kill -9, corrupt shards, a failing writer thread; failures never silent; preflight
before any weight is loaded; torchrun with 2 ranks over gloo."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from eyas import HiddenStates, extract
from eyas.errors import ArtifactError, ConfigError, DataError, EyasError
from eyas.prepared import Prepared
from tests.extract.runs import check_against_capture, overrides, run_extract
from tests.faults import Poison, poison_backend


REPO = Path(__file__).resolve().parents[2]


def subprocess_env() -> dict[str, str]:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"  # see one_thread in the tests
    env["TOKENIZERS_PARALLELISM"] = "false"
    return env


# ---------------------------------------------------------------- end to end, parity per architecture


@pytest.mark.parametrize("arch", ["llama", "qwen3", "deepseek_v3", "gemma2"])
def test_extract_matches_plain_forward(tmp_path, prep, tiny_dirs, arch):
    model_dir = tiny_dirs(arch)
    assert run_extract(tmp_path, prep, model_dir, "--extract.verify=3", "--extract.layer_ids=[0,3,5]",
                       "--extract.shard_bytes=100000") == 0
    hs = HiddenStates(tmp_path / "extract")
    p = Prepared(prep)
    assert len(hs) == len(p) and hs.meta["layer_ids"] == [0, 3, 5] and hs.meta["hidden_size"] == 64
    assert hs.meta["prepare_dir"] == str(prep.resolve()) and hs.meta["dtype"] == "float32"
    assert hs.meta["counts"]["this_run"]["parity_checked"] >= 3 and len(hs.shards) > 1
    for i in (0, 5, len(p) - 1):  # prepare's order, whatever order the batches ran in
        s = hs[i]
        assert s["index"] == i and s["id"] == p.ids[i]
        assert torch.equal(s["input_ids"], p[i]["input_ids"]) and torch.equal(s["loss_mask"], p[i]["loss_mask"])
        assert s["aux"].shape == (p.length(i), 3, 64) and s["final"].shape == (p.length(i), 64)
    assert torch.equal(hs.lengths, p.lengths)
    check_against_capture(hs, model_dir, [0, len(p) // 2])


def test_extract_packed(tmp_path, prep, tiny_dirs):
    assert run_extract(tmp_path, prep, tiny_dirs("qwen3"), "--extract.pack=true", "--extract.max_samples=10") == 0
    hs = HiddenStates(tmp_path / "extract")
    assert len(hs) == 10
    check_against_capture(hs, tiny_dirs("qwen3"), [1, 9])


def test_extract_smollm2(tmp_path, prep, smollm2_dir):
    assert run_extract(tmp_path, prep, smollm2_dir, "--extract.max_samples=3", "--extract.store_dtype=bfloat16") == 0
    hs = HiddenStates(tmp_path / "extract")
    assert hs.meta["layer_ids"] == [2, 15, 27] and hs.meta["hidden_size"] == 576 and hs.meta["dtype"] == "bfloat16"
    s = hs[2]
    assert s["aux"].dtype == torch.bfloat16 and s["aux"].shape[1:] == (3, 576)
    check_against_capture(hs, smollm2_dir, [2], tol=0.01)  # bf16 rounding


def test_float8_store_is_within_e4m3_rounding_of_float32_at_a_quarter_of_its_bytes(tmp_path, prep, tiny_dirs):
    """The same samples stored as float32 and as float8 (e4m3, float32 scales per token for aux and
    final). Bound: |x8 - x32| <= max(2^-4 |x32|, 2^-10 scale), scale = the token's amax / 448
    (eyas/fp8.py: 3 mantissa bits, subnormals below 2^-6 scale). Bytes per token, by hand, for 3 aux
    layers + final at D=64: float32 4 x 64 x 4 + 5 = 1029; bfloat16 517; float8 4 x 64 + 8 + 5 = 269."""
    import struct

    model = tiny_dirs("llama")
    args = ("--extract.max_samples=12", "--extract.shard_bytes=20000")
    assert run_extract(tmp_path / "f32", prep, model, *args) == 0
    assert run_extract(tmp_path / "f8", prep, model, "--extract.store_dtype=float8", *args) == 0
    ref, hs = HiddenStates(tmp_path / "f32" / "extract"), HiddenStates(tmp_path / "f8" / "extract")
    assert hs.meta["dtype"] == "float8_e4m3fn" and hs.dtype == torch.float32 and len(hs.shards) > 1
    for i in range(len(ref)):
        a, b = ref[i], hs[i]
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["loss_mask"], b["loss_mask"])
        for key in ("aux", "final"):
            x = a[key].double()
            scale = x.abs().flatten(1).amax(1).view(-1, *[1] * (x.dim() - 1)) / 448
            assert b[key].dtype == torch.float32 and b[key].shape == x.shape
            bound = torch.maximum(x.abs() / 16, scale / 1024) * (1 + 1e-6)
            assert bool(((b[key].double() - x).abs() <= bound).all()), (i, key)
            assert not torch.equal(b[key], a[key])  # rounded: not float32 states under a float8 name
    tokens = hs.meta["counts"]["tokens"]
    for run, per_token in ((ref, 1029), (hs, 269)):
        headers = sum(8 + struct.unpack("<Q", (run.dir / n).read_bytes()[:8])[0] for n in run.shards)
        assert run.meta["counts"]["bytes"] - headers == tokens * per_token
    hs.verify()  # checksums as for any dtype; resume: a lost shard is extracted again, bit for bit
    before = hs[5]
    (hs.dir / hs.shards[hs._shard[5]]).unlink()
    assert run_extract(tmp_path / "f8", prep, model, "--extract.store_dtype=float8", *args) == 0
    again = HiddenStates(tmp_path / "f8" / "extract")
    again.verify()
    assert torch.equal(again[5]["aux"], before["aux"]) and torch.equal(again[5]["final"], before["final"])
    with pytest.raises(ConfigError, match="store_dtype"):  # never mixed with other dtypes in one directory
        run_extract(tmp_path / "f8", prep, model, "--extract.store_dtype=bfloat16", "--extract.max_samples=13")


def test_device_map_auto_places_with_accelerate(tmp_path, prep, tiny_dirs):
    pytest.importorskip("accelerate")
    assert run_extract(tmp_path, prep, tiny_dirs("llama"), "--extract.device_map=auto", "--extract.max_samples=4") == 0
    check_against_capture(HiddenStates(tmp_path / "extract"), tiny_dirs("llama"), [3])


# ---------------------------------------------------------------- resume, corruption


def cli(out: Path, prep: Path, model, *extra: str) -> list[str]:
    return [sys.executable, "-m", "eyas.cli", "extract", *overrides(out, prep, model, *extra)]


@pytest.mark.slow
def test_sigkill_then_resume_loses_and_duplicates_nothing(tmp_path, prep, tiny_dirs):
    model = tiny_dirs("llama")
    args = cli(tmp_path, prep, model, "--extract.token_budget=128", "--extract.shard_bytes=1")  # one batch per shard
    journal = tmp_path / "extract" / "progress" / "r000.jsonl"
    proc = subprocess.Popen(args, env=subprocess_env(), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        if journal.is_file() and len(journal.read_text().splitlines()) >= 3:
            break
        time.sleep(0.02)
    assert proc.poll() is None, proc.stdout.read().decode()
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done_before = 0
    for line in journal.read_text().splitlines():
        try:
            done_before += len(json.loads(line)["samples"])
        except json.JSONDecodeError:
            pass  # a line torn by the kill: its shard is redone
    assert not (tmp_path / "extract" / "meta.json").exists()
    res = subprocess.run(args, env=subprocess_env(), cwd=REPO, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    p = Prepared(prep)
    assert 0 < done_before < len(p) and f"{len(p) - done_before} of {len(p)} samples to extract" in res.stdout
    hs = HiddenStates(tmp_path / "extract")
    assert hs.indices == list(range(len(p))) and len(set(hs.indices)) == len(p)
    entries = [json.loads(x) for x in journal.read_text().splitlines()]
    stored = [i for e in entries for i in e["samples"]]
    assert sorted(stored) == list(range(len(p)))  # no sample stored twice, none lost
    assert not list((tmp_path / "extract" / "shards").glob("*.tmp"))
    check_against_capture(hs, model, [0, len(p) - 1])


def test_corrupt_shard_is_named_and_reextracted(tmp_path, prep, tiny_dirs):
    model = tiny_dirs("llama")
    assert run_extract(tmp_path, prep, model, "--extract.shard_bytes=100000", "--extract.max_samples=12") == 0
    hs = HiddenStates(tmp_path / "extract")
    victim = tmp_path / "extract" / hs.shards[hs._shard[5]]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match=victim.name):
        HiddenStates(tmp_path / "extract")[5]
    with pytest.raises(ArtifactError, match=victim.name):  # all shards at once, in threads
        HiddenStates(tmp_path / "extract").verify(threads=3)
    others = [s for s in range(len(hs.shards)) if s != hs._shard[5]]
    fresh = HiddenStates(tmp_path / "extract")
    assert fresh.verify(others, threads=3) == sum((tmp_path / "extract" / hs.shards[s]).stat().st_size for s in others)
    fresh.mark_verified([hs._shard[5]])  # checked elsewhere (another rank): not hashed again on read
    assert fresh[5]["input_ids"].numel() == int(hs.lengths[5])  # read without a checksum error
    victim.unlink()  # the message says: delete it and re-run the same command
    assert run_extract(tmp_path, prep, model, "--extract.shard_bytes=100000", "--extract.max_samples=12") == 0
    hs = HiddenStates(tmp_path / "extract")
    hs.verify()
    assert hs.indices == list(range(12))
    check_against_capture(hs, model, [5])


def test_disk_error_in_one_writer_thread_stops_the_run_and_resume_completes(tmp_path, prep, tiny_dirs, monkeypatch):
    """Two writer threads, one shard each at a time: a write failing on one of them stops the run with
    that error, leaves no temp file, and the same command then extracts exactly what is missing."""
    from eyas.extract import store

    model = tiny_dirs("llama")
    real, calls = store.ShardWriter.write_states, []

    def flaky(self, states_TKD, scales_T2=None):
        calls.append(self.path.name)
        if len(calls) == 4:
            raise OSError(28, "No space left on device")
        real(self, states_TKD, scales_T2)

    monkeypatch.setattr(store.ShardWriter, "write_states", flaky)
    args = ("--extract.token_budget=128", "--extract.shard_bytes=1")  # one batch per shard
    with pytest.raises(EyasError, match="No space left on device"):
        run_extract(tmp_path, prep, model, *args)
    assert len(set(calls)) >= 2  # shards were being written by both threads
    assert not list((tmp_path / "extract" / "shards").glob("*.tmp"))
    assert not (tmp_path / "extract" / "meta.json").exists()
    monkeypatch.undo()
    assert run_extract(tmp_path, prep, model, *args) == 0
    hs = HiddenStates(tmp_path / "extract")
    hs.verify()
    assert hs.indices == list(range(len(Prepared(prep))))
    check_against_capture(hs, model, [0, len(hs) - 1])


def test_phase_timer_times_the_loop_on_cpu(tmp_path, prep, tiny_dirs, monkeypatch):
    from functools import partial

    from eyas.extract.profile import PhaseTimer

    timer = PhaseTimer(torch.device("cpu"))
    monkeypatch.setattr(extract, "extract_rank", partial(extract.extract_rank, timer=timer))
    assert run_extract(tmp_path, prep, tiny_dirs("llama"), "--extract.max_samples=6") == 0
    prof = timer.summary()
    for phase in ("smoke test", "forward", "capture (stack, gather, cast)", "parity check", "writers: hash + write",
                  "writers: close (tail, fsync, rename, journal)"):
        assert prof[phase]["n"] >= 1 and prof[phase]["s"] >= 0, phase


# ---------------------------------------------------------------- failures are never silent


@pytest.mark.parametrize("where", ["smoke test", "batch"])
def test_empty_message_exception_surfaces_type_and_traceback(tmp_path, prep, tiny_dirs, monkeypatch, capsys, where):
    from eyas import cli

    poison_backend(monkeypatch, Poison(RuntimeError(), after=0 if where == "smoke test" else 1))
    rc = cli.main(["extract", *overrides(tmp_path, prep, tiny_dirs("llama"), "--extract.max_samples=4")])
    err = capsys.readouterr().err
    assert rc != 0
    assert "RuntimeError()" in err and "Traceback (most recent call last)" in err
    rec = json.loads((tmp_path / "extract" / "errors.jsonl").read_text().splitlines()[0])
    assert rec["type"] == "builtins.RuntimeError" and rec["message"] == "RuntimeError()"
    assert rec["stage"] == "extract" and rec["rank"] == 0 and rec["sample_ids"] and "Traceback" in rec["traceback"]
    assert not (tmp_path / "extract" / "meta.json").exists()


def test_max_failures_skips_bad_sample_lists_it_and_exits_nonzero(tmp_path, prep, tiny_dirs, monkeypatch, capsys):
    p = Prepared(prep)
    bad = 7
    poison_backend(monkeypatch, Poison(ValueError("poisoned sample"), p[bad]["input_ids"]))
    model = tiny_dirs("llama")
    assert run_extract(tmp_path, prep, model, "--extract.max_failures=2") == 1
    out = capsys.readouterr()
    assert p.ids[bad] in out.out and "poisoned sample" in out.err
    hs = HiddenStates(tmp_path / "extract")
    assert len(hs) == len(p) - 1 and bad not in hs.indices
    assert hs.meta["counts"]["failed"] == [p.ids[bad]]
    monkeypatch.undo()  # the cause is fixed: the same command extracts just the failed sample
    assert run_extract(tmp_path, prep, model, "--extract.max_failures=2") == 0
    hs = HiddenStates(tmp_path / "extract")
    assert hs.indices == list(range(len(p)))
    check_against_capture(hs, model, [bad])


def test_allow_failures_exits_zero(tmp_path, prep, tiny_dirs, monkeypatch):
    p = Prepared(prep)
    poison_backend(monkeypatch, Poison(ValueError("x"), p[3]["input_ids"]))
    args = ("--extract.max_failures=1", "--extract.allow_failures=true", "--extract.max_samples=6")
    assert run_extract(tmp_path, prep, tiny_dirs("llama"), *args) == 0


# ---------------------------------------------------------------- preflight, before any weight is loaded


def test_preflight_failures(tmp_path, prep, no_weights, smollm2_dir, monkeypatch):
    def fails(exc, match, *extra, prep_dir=prep, model=no_weights):
        with pytest.raises(exc, match=match):
            run_extract(tmp_path, prep_dir, model, *extra)

    fails(ConfigError, r"extract.layer_ids=\[2, 99\].*\[0, 7\]", "--extract.layer_ids=[2,99]")
    fails(ArtifactError, "eyas prepare", prep_dir=tmp_path / "nothing")
    fails(ConfigError, "extract.token_budget", "--extract.token_budget=16")
    (tmp_path / "file").write_text("")
    fails(EyasError, "extract.out_dir", f"--extract.out_dir={tmp_path / 'file' / 'sub'}")
    monkeypatch.setattr(extract.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**9, 10**9, 1000))
    fails(EyasError, "not enough disk")
    monkeypatch.undo()
    # a prepare output made with another chat template
    other = tmp_path / "other"
    shutil.copytree(no_weights, other)
    cfgj = json.loads((other / "tokenizer_config.json").read_text())
    cfgj["chat_template"] = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    (other / "tokenizer_config.json").write_text(json.dumps(cfgj))
    (other / "chat_template.jinja").unlink(missing_ok=True)
    fails(ConfigError, "re-run `eyas prepare`", model=other)
    # an empty prepare output
    empty = tmp_path / "empty"
    shutil.copytree(prep, empty)
    from safetensors.torch import save_file

    save_file({"input_ids": torch.zeros(0, dtype=torch.int32), "loss_mask": torch.zeros(0, dtype=torch.uint8),
               "offsets": torch.zeros(1, dtype=torch.int64)}, str(empty / "tokens.safetensors"))
    (empty / "sample_ids.json").write_text("[]")
    from eyas import artifacts

    meta = json.loads((empty / "meta.json").read_text())  # as prepare records an output it wrote so
    meta["files"] = artifacts.file_record(empty, list(meta["files"]))
    (empty / "meta.json").write_text(json.dumps(meta))
    fails(DataError, "no samples", prep_dir=empty)


def test_preflight_counts_every_filesystem_less_min_free(tmp_path, prep, tiny_dirs, shm_dir):
    """The whole extract must fit the free space of the output and spill filesystems, less
    extract.min_free_gb on each, before any weight is loaded: the error names each filesystem."""
    model = tiny_dirs("llama")
    # 100 kB of room on the filesystem with the most free space, none on the other: 2.4 MB needed
    keep = max(shutil.disk_usage(shm_dir).free, shutil.disk_usage(tmp_path).free) / 1e9 - 0.0001
    with pytest.raises(EyasError, match=r"not enough disk.*GB free at .*extract.*GB free at .*spill.*extract.spill_dirs"):
        run_extract(tmp_path, prep, model, f"--extract.out_dir={shm_dir / 'extract'}",
                    f"--extract.spill_dirs=[{tmp_path / 'spill'}]", f"--extract.min_free_gb={keep}")


def test_changed_settings_refuse_to_mix(tmp_path, prep, tiny_dirs):
    model = tiny_dirs("llama")
    assert run_extract(tmp_path, prep, model, "--extract.max_samples=2") == 0
    with pytest.raises(ConfigError, match="layer_ids"):
        run_extract(tmp_path, prep, model, "--extract.max_samples=4", "--extract.layer_ids=[1,2]")


# ---------------------------------------------------------------- torchrun, 2 ranks over gloo


@pytest.mark.slow
def test_torchrun_two_ranks_one_index(tmp_path, prep, tiny_dirs):
    model = tiny_dirs("llama")
    args = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
            "-m", "eyas", "extract", *overrides(tmp_path, prep, model, "--extract.verify=1")]
    res = subprocess.run(args, env=subprocess_env(), cwd=REPO, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-4000:]
    hs = HiddenStates(tmp_path / "extract")
    assert hs.indices == list(range(len(Prepared(prep)))) and hs.meta["counts"]["this_run"]["world_size"] == 2
    assert {s.split("/")[-1][:4] for s in hs.shards} == {"r000", "r001"}
    check_against_capture(hs, model, [0, 1, len(hs) - 1])
