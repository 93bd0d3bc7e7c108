"""The extract stage end to end on CPU: parity per architecture, batching invariance, resume after
SIGKILL, corrupt shards, failures that must not be silent, preflight errors, torchrun with 2 ranks."""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from eyas import HiddenStates, extract
from eyas.capture import capture
from eyas.config import load_config
from eyas.errors import ArtifactError, ConfigError, DataError, EyasError
from eyas.extract import plan
from eyas.extract.backend import HFBackend, ParityError, as_float32, check_parity, float32_verdict, relative_error
from eyas.prepared import Prepared
from extract_helpers import Poison, poison_backend, save_tiny, subprocess_env, tiny_model, write_chats

REPO = Path(__file__).resolve().parents[1]
NUM_CHATS = 24



@pytest.fixture(scope="session")
def prep(tmp_path_factory, smollm2_dir) -> Path:
    """One prepare output (SmolLM2 tokenizer) shared by every tiny target: they all carry that tokenizer."""
    from eyas import prepare

    root = tmp_path_factory.mktemp("prep")
    chats = write_chats(root / "chats.jsonl", NUM_CHATS, max_words=40)
    cfg = load_config(None, [f"--run_dir={root}", f"--target.model={smollm2_dir}", f"--prepare.data={chats}",
                             "--prepare.max_length=128"])
    prepare.main(cfg)
    return root / "prepare"


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory, smollm2_dir):
    made: dict[str, Path] = {}

    def get(arch: str) -> Path:
        if arch not in made:
            made[arch] = save_tiny(arch, tmp_path_factory.mktemp(arch), smollm2_dir)
        return made[arch]

    return get


def overrides(out: Path, prep: Path, model: Path | str, *extra: str) -> list[str]:
    return [f"--run_dir={out}", f"--prepare.out_dir={prep}", f"--target.model={model}",
            "--extract.token_budget=512", "--extract.progress=false", *extra]


def run_extract(out: Path, prep: Path, model, *extra: str) -> int:
    return extract.main(load_config(None, overrides(out, prep, model, *extra)))


def check_against_capture(hs: HiddenStates, model_dir: Path, samples: list[int], tol: float = 1e-5) -> None:
    """Stored states == a fresh fp32 batch-1 capture of the same sample (relative error per token <= tol)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    for i in samples:
        s = hs[i]
        aux_BSKD, final_BSD = capture(model, s["input_ids"].view(1, -1), layer_ids=hs.layer_ids)
        assert s["aux"].shape == aux_BSKD[0].shape and s["final"].shape == final_BSD[0].shape
        assert float(relative_error(s["aux"], aux_BSKD[0]).max()) <= tol, f"sample {i}: aux"
        assert float(relative_error(s["final"][:, None], final_BSD[0][:, None]).max()) <= tol, f"sample {i}: final"


# ---------------------------------------------------------------- plan (pure functions)


def test_plan_batches_respect_budget_and_cover_every_sample():
    lengths = torch.tensor([5, 40, 17, 33, 8, 40, 2, 25, 12, 30])
    for pack in (False, True):
        batches = plan.make_batches(list(range(10)), lengths, token_budget=64, max_batch_size=3, pack=pack)
        assert sorted(i for b in batches for i in b.indices) == list(range(10))
        assert all(b.padded_tokens <= 64 and len(b.indices) <= 3 for b in batches)
        assert batches[0].indices[0] in (1, 5)  # longest first: an OOM shows at once
    with pytest.raises(ConfigError, match="extract.token_budget"):
        plan.make_batches([1], lengths, token_budget=32, max_batch_size=8, pack=False)


def test_plan_rank_slices_are_disjoint_and_balanced():
    lengths = torch.randint(1, 100, (101,))
    slices = [plan.rank_slice(list(range(101)), lengths, r, 4) for r in range(4)]
    assert sorted(i for s in slices for i in s) == list(range(101))
    tokens = [int(lengths[s].sum()) for s in slices]
    assert max(tokens) - min(tokens) <= int(lengths.max())


# ---------------------------------------------------------------- batching invariance


@pytest.mark.parametrize("arch", ["llama", "deepseek_v3"])
def test_same_sample_same_states_alone_padded_or_packed(arch):
    model = tiny_model(arch)
    backend = HFBackend(model, [1, 3, 6], torch.float32)
    lengths = torch.tensor([23, 9, 17, 4])
    tokens = [torch.randint(0, 5000, (int(n),)) for n in lengths]
    alone = [backend.forward(plan.Batch([i], [int(n)], 1, int(n), False), [tokens[i]]) for i, n in enumerate(lengths)]
    for pack in (False, True):
        for order in ([0, 1, 2, 3], [3, 2, 1, 0], [1, 3]):
            lens = [int(lengths[i]) for i in order]
            batch = plan.Batch(order, lens, 1 if pack else len(order), sum(lens) if pack else max(lens), pack)
            states_TKD = backend.forward(batch, [tokens[i] for i in order])
            assert states_TKD.shape == (sum(lens), 4, 64)
            for part, i in zip(states_TKD.split(lens), order):
                torch.testing.assert_close(part, alone[i], rtol=1e-4, atol=1e-5)


def test_compiled_layers_same_states_and_eager_reference():
    """HFBackend(compile=True): hooks still see every layer, padded and packed batches give the eager
    states, the parity reference runs the eager layers, close() gives the model back untouched.
    Dynamo's `eager` backend checks the wiring on CPU in seconds; inductor is measured by the bench."""
    model = tiny_model("llama")
    eager = HFBackend(model, [1, 3, 6], torch.float32)
    lengths = [23, 9, 17, 4]
    tokens = [torch.randint(0, 5000, (n,)) for n in lengths]
    alone = [eager.forward(plan.Batch([i], [n], 1, n, False), [tokens[i]]) for i, n in enumerate(lengths)]
    compiled = HFBackend(model, [1, 3, 6], torch.float32, compile=True, compile_backend="eager")
    layers = compiled.capture.layers
    assert all("forward" in layer.__dict__ for layer in layers)
    for pack in (False, True):
        for order in ([0, 1, 2, 3], [3, 1], [2]):
            lens = [lengths[i] for i in order]
            batch = plan.Batch(order, lens, 1 if pack else len(order), sum(lens) if pack else max(lens), pack)
            for part, i in zip(compiled.forward(batch, [tokens[i] for i in order]).split(lens), order):
                torch.testing.assert_close(part, alone[i], rtol=1e-4, atol=1e-5)
    seen = []
    hook = layers[0].register_forward_pre_hook(lambda m, a: seen.append("forward" in m.__dict__))
    torch.testing.assert_close(compiled.reference(tokens[0]), alone[0], rtol=1e-4, atol=1e-5)
    hook.remove()
    assert seen == [False] and all("forward" in layer.__dict__ for layer in layers)
    compiled.close()
    assert not any("forward" in layer.__dict__ for layer in layers)


def test_parity_past_tolerance_judged_against_float32():
    """bf16 states that round differently from the plain bf16 forward (here: the float32 forward's,
    rounded to bf16) fail a tolerance below that difference, then pass against the float32 forward;
    another sample's states fail both. The float32 cast gives every weight and buffer back bit for bit."""
    model = tiny_model("llama").to(torch.bfloat16)
    model.model.rotary_emb.inv_freq.data = model.model.rotary_emb.inv_freq.data.float()  # a mixed-dtype module
    before = {n: t.clone() for n, t in [*model.named_parameters(), *model.named_buffers()]}
    backend = HFBackend(model, [1, 3, 6], torch.bfloat16)
    tokens, other = torch.randint(0, 5000, (40,)), torch.randint(0, 5000, (40,))
    plain = backend.reference(tokens)
    exact = backend.reference(tokens, float32=True)
    assert exact.dtype == torch.float32
    rounded = exact.to(torch.bfloat16)
    gap = float(relative_error(rounded, plain).amax())
    assert 0 < gap < 0.05  # rounding, not a different computation
    parity = check_parity(backend, [("s0", rounded, tokens), ("s0b", plain, tokens)], tol=gap / 4)
    assert parity.errors == [pytest.approx(gap), 0] and parity.float32_judged == 1
    with pytest.raises(ParityError, match="sample s1: .* not by rounding"):
        check_parity(backend, [("s0", rounded, tokens), ("s1", backend.reference(other), tokens)], tol=gap / 4)
    with pytest.raises(ParityError, match="sample s2"):  # shifted by one position
        check_parity(backend, [("s2", torch.cat([plain[:1], plain[:-1]]), tokens)], tol=gap / 4)
    # wrong at 10 of 40 tokens, each within the plain forward's worst token: the mean gives it away
    floor_SK = torch.full((40, 4), 1e-3)
    floor_SK[0] = 0.2
    got_SK = floor_SK.clone()
    assert float32_verdict(got_SK, floor_SK, 1e-4) == ""
    got_SK[30:] = 0.2
    assert "more than 1.5x" in float32_verdict(got_SK, floor_SK, 1e-4)
    # a plain forward far from float32 is no yardstick: even states close to it fail
    assert "no yardstick" in float32_verdict(torch.zeros(40, 4), torch.full((40, 4), 0.3), gap / 4)
    for n, t in [*model.named_parameters(), *model.named_buffers()]:
        assert t.dtype == before[n].dtype and torch.equal(t, before[n]), n
    with pytest.raises(RuntimeError), as_float32(model):  # restored also when the body fails
        raise RuntimeError("inside")
    assert model.model.layers[0].mlp.up_proj.weight.dtype == torch.bfloat16


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

    def flaky(self, states_TKD):
        calls.append(self.path.name)
        if len(calls) == 4:
            raise OSError(28, "No space left on device")
        real(self, states_TKD)

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


@pytest.fixture(scope="session")
def no_weights(tiny_dirs, tmp_path_factory) -> Path:
    """A target directory with config and tokenizer but no weights: preflight must fail before loading."""
    out = tmp_path_factory.mktemp("noweights")
    for f in tiny_dirs("llama").iterdir():
        if not f.name.endswith(".safetensors"):
            shutil.copy(f, out / f.name)
    return out


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
    fails(DataError, "no samples", prep_dir=empty)


def test_spill_dirs_take_the_shards_that_do_not_fit(tmp_path, prep, tiny_dirs, shm_dir, capsys, monkeypatch):
    """The output directory on a tmpfs with room for about a third of the shards, a spill directory
    on the disk: the first shards stay in the tmpfs, the rest go to the disk (listed by absolute
    path), and every sample reads back as a plain forward computes it. Another rank's leftover in
    the spill directory is removed first; a complete re-run keeps every shard; the spill directory
    refuses a second output directory and the output directory itself; `eyas run` keys extract
    without the spill settings, so changing them (as the no-room error advises) resumes instead of
    starting over. The tmpfs's free space is made to run out (shutil.disk_usage reports a capacity
    less what its shards/ holds) so that nothing else writing to /dev/shm moves the boundary; the
    bytes are written to the real tmpfs and disk."""
    model, out, spill = tiny_dirs("llama"), shm_dir / "extract", tmp_path / "spill"
    p = Prepared(prep)
    row = 4 * 64 * 4 + 5  # 3 aux layers + final, D=64, float32; int32 id, uint8 mask
    base = ["--extract.token_budget=128", "--extract.shard_bytes=1", f"--extract.out_dir={out}",  # a batch per shard
            f"--extract.spill_dirs=[{spill}]"]
    assert run_extract(tmp_path, prep, model, *base, "--extract.max_samples=4") == 0  # the tmpfs has room
    first = HiddenStates(out)
    assert all(not Path(s).is_absolute() for s in first.shards) and (spill / "eyas-spill.json").is_file()

    def used() -> int:
        return sum(f.stat().st_size for f in (out / "shards").iterdir())

    from eyas.extract import store

    cap = used() + store.OUT_RESERVE + int(p.offsets[-1] - p.offsets[4]) * row // 3
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda d: shutil._ntuple_diskusage(cap, used(), cap - used())
                        if Path(d).resolve() == out.resolve() else real(d))
    (spill / "shards").mkdir(exist_ok=True)
    (spill / "shards" / "r001-00007.safetensors").write_bytes(b"another rank's, left by a kill")
    assert run_extract(tmp_path, prep, model, *base) == 0
    printed = capsys.readouterr().out
    assert f"removed 1 shard file(s) no journal lists from {spill.resolve()}" in printed, printed
    assert re.search(rf"spilled +\d+ of the shards, [\d.]+ GB, to {re.escape(str(spill.resolve()))}\n", printed), printed
    assert not (spill / "shards" / "r001-00007.safetensors").exists()
    hs = HiddenStates(out)
    hs.verify()
    in_shm = [s for s in hs.shards if not Path(s).is_absolute()]
    spilled = [s for s in hs.shards if Path(s).is_absolute()]
    assert len(in_shm) >= len(first.shards) + 1 and len(spilled) >= 2, hs.shards
    assert all(Path(s).parent == spill.resolve() / "shards" and Path(s).is_file() for s in spilled)
    assert hs.indices == list(range(len(p)))
    kind = {i: Path(hs.shards[hs._shard[i]]).is_absolute() for i in range(len(p))}
    check_against_capture(hs, model, [next(i for i in kind if not kind[i]), next(i for i in kind if kind[i])])
    assert run_extract(tmp_path, prep, model, *base) == 0  # complete: nothing to do, nothing removed
    assert "removed" not in capsys.readouterr().out
    again = HiddenStates(out)
    assert again.shards == hs.shards and all(Path(s).is_file() for s in spilled)
    again.verify()
    with pytest.raises(ConfigError, match="serves the extract in"):
        run_extract(tmp_path / "other", prep, model, f"--extract.spill_dirs=[{spill}]")
    with pytest.raises(ConfigError, match="output directory itself"):
        run_extract(tmp_path, prep, model, f"--extract.out_dir={out}", f"--extract.spill_dirs=[{out}]")
    from eyas.run import run_keys, stage_plan

    def extract_key(*extra):
        return run_keys(*stage_plan(load_config(None, overrides(tmp_path, prep, model, *extra))))["extract"]

    plain = [a for a in base if "spill_dirs" not in a]
    assert extract_key(*base, "--extract.min_free_gb=3") == extract_key(*plain) != extract_key(*plain, "--extract.shard_bytes=7")


def test_clean_spill_keeps_listed_shards_by_identity_and_refuses_a_moved_spill_directory(tmp_path):
    """A journal that names a spilled shard through a symlinked path keeps it (same file); a shard
    the journal lists at a path that is gone is not deleted from where it is now (ConfigError)."""
    from eyas.extract import store

    out, real = tmp_path / "out", tmp_path / "real"
    (out / "progress").mkdir(parents=True)
    (real / "shards").mkdir(parents=True)
    (tmp_path / "link").symlink_to(real)
    kept = real / "shards" / "r000-00000.safetensors"
    kept.write_bytes(b"x" * 10)
    store.append_journal(out, 0, {"shard": str(tmp_path / "link" / "shards" / kept.name), "bytes": 10, "rank": 0})
    entries = store.read_journals(out)
    assert len(entries) == 1 and store.clean_spill(out, [real.resolve()], entries) == 0 and kept.is_file()
    moved = real / "shards" / "r000-00001.safetensors"
    moved.write_bytes(b"y" * 10)
    store.append_journal(out, 0, {"shard": str(tmp_path / "gone" / "shards" / moved.name), "bytes": 10, "rank": 0})
    with pytest.raises(ConfigError, match="was the spill directory moved"):
        store.clean_spill(out, [real.resolve()], store.read_journals(out))
    assert moved.is_file() and kept.is_file()


def test_shard_placer_counts_the_shards_being_written(tmp_path, shm_dir, monkeypatch):
    """Shards open at once (two writer threads): each sees the others' unwritten bytes as taken, so
    the third goes to the spill directory; with no room anywhere the error names the fix; a closed
    shard's bytes are no longer counted. The output directory (disk) and the spill directory
    (tmpfs) are real filesystems; their free space is set through shutil.disk_usage, because the
    accounting, not the filesystems, is under test."""
    from eyas.extract import store

    out, spill = tmp_path / "out", (shm_dir / "spill").resolve()
    out.mkdir()
    spill.mkdir()
    free = {out: 10**9 + 300_000_000, spill: 10**9 + 150_000_000}
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage",
                        lambda d: shutil._ntuple_diskusage(0, 0, free[Path(d)]) if Path(d) in free else real(d))
    placer = store.ShardPlacer(out, [spill], min_free=10**9, check=True)

    def make(name):
        return store.ShardWriter(out, name, 1, 1000, torch.float32, torch.zeros(25_000, dtype=torch.int32),
                                 torch.zeros(25_000, dtype=torch.uint8))  # 100.1 MB planned

    a = placer.open_shard(0, 0, 25_000, 4000, make)  # out keeps 1 GB: 300 MB of room
    b = placer.open_shard(0, 1, 25_000, 4000, make)  # 200 MB of it left: still out
    c = placer.open_shard(0, 2, 25_000, 4000, make)  # 100 MB left, less than the shard: spill
    assert a.name == "shards/r000-00000.safetensors" == store.shard_name(0, 0) and b.name == store.shard_name(0, 1)
    assert c.name == str(spill / "shards" / "r000-00002.safetensors") and c.path == Path(c.name)
    with pytest.raises(ArtifactError, match=r"no room for shard shards/r000-00003.*extract.spill_dirs.*run the stage again"):
        placer.open_shard(0, 3, 25_000, 4000, make)  # spill's 150 MB of room less c's 100 MB
    for w in (a, c):
        w.abort()
        placer.closed(w)
    d = placer.open_shard(0, 3, 25_000, 4000, make)
    assert d.name == store.shard_name(0, 3)
    for w in (b, d):
        w.abort()


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
