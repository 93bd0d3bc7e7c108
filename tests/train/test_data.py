"""eyas.train.data: online states (right-padded rows in groups, under their SDPA kernels) equal plain
forwards, offline states (in memory, from extract's shards, spilled or not) train as online ones do,
row groups, the held-out split."""

from __future__ import annotations

import pytest
import torch

from eyas.train import build, run
from tests.train.runs import InMemoryStates, first_step, read_metrics, tiny_cfg, train_config


@pytest.mark.parametrize("group_tokens", [0, 40])
def test_offline_equals_online_for_one_step(tmp_path, smol_prep, tiny_target, group_tokens):
    """One optimizer step on states the target captures per batch (one forward per batch, or in
    groups of similar length: train.target_group_tokens) equals one on states captured beforehand."""
    from transformers import AutoModelForCausalLM

    from eyas.prepared import Prepared
    from eyas.train.target_weights import load_embed_and_head

    cfg = tiny_cfg(tmp_path, smol_prep, tiny_target, "--train.mode=online", "--train.grad_accum=2", "--train.max_steps=1",
                   f"--train.target_group_tokens={group_tokens}")
    online = build.load_data(cfg, torch.device("cpu"))  # the target captures states per batch
    assert online.states.group_overhead_tokens == (group_tokens or None)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_target), dtype=torch.float32).eval()
    prep = Prepared(smol_prep)
    emb, head = load_embed_and_head(cfg.target)
    offline = build.TrainData(InMemoryStates(prep, model, online.layer_ids), prep.d2t, prep.t2d, online.layer_ids,
                              emb, head, online.target_config)
    out_on, ids_on, params_on = first_step(cfg, online)
    out_off, ids_off, params_off = first_step(cfg, offline)
    assert ids_on == ids_off and len(ids_on) == 2
    assert out_on["valid_T"].sum() > 50
    for key in ("loss_sum_T", "grad_norm"):
        torch.testing.assert_close(out_on[key], out_off[key], rtol=1e-5, atol=1e-5)
    assert torch.equal(out_on["correct_T"], out_off["correct_T"])
    torch.testing.assert_close(params_on, params_off, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("overhead, forwards", [(0, 6), (40, 3), (None, 1)])
def test_online_states_of_right_padded_rows_equal_plain_forwards(smol_prep, tiny_target, overhead, forwards):
    """OnlineStates runs samples of different lengths as right-padded rows without an attention
    mask, in groups of similar length: six prefixes of 128, 30, 97, 12, 64 and 101 tokens go
    through the target one per forward (overhead 0), as {128} {101, 97, 64} {30, 12} (40 tokens
    per extra forward: padded rows inside groups) or all in one (the default: no overhead given).
    Each sample's states must equal a plain output_hidden_states forward of it alone (a prefix's
    states are the prefix of the whole sample's: attention is causal), and the packed row's tail up
    to pad_multiple stays zero."""
    from transformers import AutoModelForCausalLM

    from eyas.prepared import Prepared
    from eyas.train.data import OnlineStates, pack

    model = AutoModelForCausalLM.from_pretrained(str(tiny_target), dtype=torch.float32).eval()
    prep = Prepared(smol_prep)
    ref = InMemoryStates(prep, model, [1, 2, 3], max_samples=6)
    cuts = [128, 30, 97, 12, 64, 101]
    samples = [{k: (v[:n] if isinstance(v, torch.Tensor) else v) for k, v in prep[i].items()} for i, n in enumerate(cuts)]
    assert [int(x["input_ids"].numel()) for x in samples] == cuts
    grouping = {} if overhead is None else dict(group_overhead_tokens=overhead, group_quantum=1)
    states = OnlineStates(model, [1, 2, 3], "cpu", **grouping)
    batch = states(pack(samples, 3, max_tokens=8192, pad_multiple=64))
    assert states.num_forwards == forwards
    assert batch.input_ids_BS.shape[1] == 448  # 432 tokens, padded up to a multiple of 64
    start = 0
    for smp, n in zip(ref.samples, cuts):
        torch.testing.assert_close(batch.aux_BSKD[0, start : start + n], smp["aux"][:n], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(batch.final_BSD[0, start : start + n], smp["final"][:n], rtol=1e-5, atol=1e-5)
        start += n
    assert not batch.aux_BSKD[0, start:].any() and not batch.final_BSD[0, start:].any()


def test_online_states_forward_runs_under_its_sdpa_kernels(smol_prep, tiny_target, monkeypatch):
    """The target's attention runs with only the SDPA kernels OnlineStates names: by default
    ONLINE_SDPA (cuDNN's off, flash, memory-efficient and math on), read from PyTorch's flags inside
    every attention call; None leaves PyTorch's own flags; the flags come back afterwards, also
    when the forward fails. Naming only the memory-efficient kernel, which this CPU build lacks,
    must fail the forward: the restriction reaches the attention."""
    from torch.nn.attention import SDPBackend
    from transformers import AutoModelForCausalLM

    from eyas.prepared import Prepared
    from eyas.train.data import ONLINE_SDPA, OnlineStates, pack

    cuda = torch.backends.cuda
    flags = lambda: (cuda.cudnn_sdp_enabled(), cuda.flash_sdp_enabled(), cuda.mem_efficient_sdp_enabled(),  # noqa: E731
                     cuda.math_sdp_enabled())
    seen, sdpa = [], torch.nn.functional.scaled_dot_product_attention

    def recording(*args, **kwargs):
        seen.append(flags())
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_target), dtype=torch.float32).eval()
    batch = lambda: pack([Prepared(smol_prep)[0]], 3, 8192)  # noqa: E731
    before = flags()
    assert before[0], "PyTorch allows cuDNN attention by default"
    assert SDPBackend.CUDNN_ATTENTION not in ONLINE_SDPA
    out = OnlineStates(model, [1, 2, 3], "cpu")(batch())
    assert seen and set(seen) == {(False, True, True, True)} and flags() == before
    assert out.final_BSD.abs().sum() > 0
    seen.clear()
    OnlineStates(model, [1, 2, 3], "cpu", sdpa_backends=None)(batch())
    assert seen and set(seen) == {before}
    with pytest.raises(RuntimeError, match="No viable backend"):
        OnlineStates(model, [1, 2, 3], "cpu", sdpa_backends=SDPBackend.EFFICIENT_ATTENTION)(batch())
    assert flags() == before


def test_row_groups_trade_padding_against_forwards():
    """Hand-counted: lengths 2000, 100, 90, 1900, 80 at 2,048 tokens per extra forward. One group
    costs 5 x 2000 + 2048 = 12,048; {2000, 1900} {100, 90, 80} 2 x 2000 + 3 x 100 + 2 x 2048 =
    8,396; three groups {2000} {1900} {...} 2000 + 1900 + 300 + 3 x 2048 = 10,344: two it is.
    Without overhead every 64-token bucket is its own group; with a huge one, a single group."""
    from eyas.train.data import row_groups

    lengths = [2000, 100, 90, 1900, 80]
    assert row_groups(lengths, 2048) == [[0, 3], [1, 2, 4]]
    assert row_groups(lengths, 0) == [[0], [3], [1, 2, 4]]  # 100, 90 and 80 share the bucket (64, 128]
    assert row_groups(lengths, 0, quantum=1) == [[0], [3], [1], [2], [4]]
    assert row_groups(lengths, 10**9) == [[0, 3, 1, 2, 4]]
    assert row_groups([], 2048) == []
    many = [(7 * k) % 500 + 1 for k in range(3000)]  # thousands of samples: buckets bound the search
    groups = row_groups(many, 2048)
    assert sorted(j for g in groups for j in g) == list(range(3000))
    assert all(many[g[0]] == max(many[j] for j in g) for g in groups)


def test_offline_from_extract_shards_equals_online(tmp_path, smol_prep, tiny_target):
    """The whole offline path (`eyas extract` shards read through HiddenStates) against online."""
    from eyas.extract import main as extract

    extract(train_config(tmp_path, f"--prepare.out_dir={smol_prep}", f"--target.model={tiny_target}",
                         "--extract.progress=false"))
    losses = {}
    for mode in ("offline", "online"):
        cfg = tiny_cfg(tmp_path, smol_prep, tiny_target, f"--train.mode={mode}", f"--train.out_dir={tmp_path / mode}",
                       "--train.max_steps=2", "--train.max_tokens=256")
        meta = run(cfg)
        assert meta["config"]["train"]["mode"] == mode and ("extract" in meta["inputs"]) == (mode == "offline")
        losses[mode] = [r["loss"] for r in read_metrics(tmp_path / mode)]
    assert len(losses["offline"]) == 2
    assert losses["offline"] == pytest.approx(losses["online"], rel=1e-5)


def test_offline_from_float8_shards_trains_near_online(tmp_path, smol_prep, tiny_target):
    """float8 shards (e4m3 + per-token scales) read back through HiddenStates as float32: two
    offline steps land near the online run's losses (states within ~2^-4 relative, not equal)."""
    from eyas.extract import main as extract

    extract(train_config(tmp_path, f"--prepare.out_dir={smol_prep}", f"--target.model={tiny_target}",
                         "--extract.progress=false", "--extract.store_dtype=float8"))
    losses = {}
    for mode in ("offline", "online"):
        cfg = tiny_cfg(tmp_path, smol_prep, tiny_target, f"--train.mode={mode}", f"--train.out_dir={tmp_path / mode}",
                       "--train.max_steps=2", "--train.max_tokens=256")
        run(cfg)
        losses[mode] = [r["loss"] for r in read_metrics(tmp_path / mode)]
    assert len(losses["offline"]) == 2
    assert losses["offline"] == pytest.approx(losses["online"], rel=1e-3) and losses["offline"] != losses["online"]


def test_offline_from_spilled_shards_equals_online(tmp_path, smol_prep, tiny_target, shm_dir, monkeypatch):
    """Shards split over a tmpfs output directory and a spill directory on the disk
    (extract.spill_dirs): the trainer's checksum pass and reads find both kinds, and two offline
    steps give the online losses. The tmpfs reports room for about half the shards (shutil.disk_usage:
    a capacity less what its shards/ holds); the bytes go to the real tmpfs and disk."""
    import shutil
    from pathlib import Path

    from eyas.extract import main as extract
    from eyas.hidden_states import HiddenStates
    from eyas.prepared import Prepared

    out = shm_dir / "extract"
    row = 4 * 64 * 4 + 5  # the tiny target: 3 aux layers + final, D=64, float32; id, mask
    from eyas.extract import store

    cap = store.OUT_RESERVE + int(Prepared(smol_prep).offsets[-1]) * row // 2

    def used() -> int:
        total = 0
        for f in (out / "shards").iterdir() if (out / "shards").is_dir() else []:
            try:
                total += f.stat().st_size
            except FileNotFoundError:  # the writer renamed a .tmp shard between the listing and the stat
                pass
        return total

    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda d: shutil._ntuple_diskusage(cap, used(), cap - used())
                        if Path(d).resolve() == out.resolve() else real(d))
    place = [f"--extract.out_dir={out}", f"--extract.spill_dirs=[{tmp_path / 'spill'}]"]
    extract(train_config(tmp_path, f"--prepare.out_dir={smol_prep}", f"--target.model={tiny_target}",
                         "--extract.progress=false", "--extract.token_budget=128", "--extract.shard_bytes=1", *place))
    monkeypatch.undo()
    names = HiddenStates(out).shards
    assert any(Path(n).is_absolute() for n in names) and not all(Path(n).is_absolute() for n in names), names
    losses = {}
    for mode in ("offline", "online"):
        cfg = tiny_cfg(tmp_path, smol_prep, tiny_target, f"--train.mode={mode}", f"--train.out_dir={tmp_path / mode}",
                       "--train.max_steps=2", "--train.max_tokens=256", *place)
        run(cfg)
        losses[mode] = [r["loss"] for r in read_metrics(tmp_path / mode)]
    assert len(losses["offline"]) == 2
    assert losses["offline"] == pytest.approx(losses["online"], rel=1e-5)


def test_held_out_split_keeps_conversation_pieces_and_identical_prompts_together(smol_prep):
    import hashlib

    from eyas.assets import iter_json_array, sharegpt_path
    from eyas.prepared import Prepared
    from eyas.train.data import split_groups, split_indices

    p = Prepared(smol_prep)
    keys = p.prompt_keys()
    for i in range(len(p)):
        s = p[i]
        first = int(s["loss_mask"].nonzero()[0])
        prompt = s["input_ids"][:first].to(p._ids.dtype).numpy().tobytes()
        assert keys[i] == hashlib.blake2b(prompt, digest_size=16).digest()
    g = split_groups(["a_0", "a_1", "b_0", "c"], [b"p", b"q", b"r", b"p"])  # c asks what a_0 asks
    assert g[0] == g[1] == g[3] != g[2]
    assert len(set(split_groups(["x", "y", "z"], [None, None, None]))) == 3  # no prompt: not "the same prompt"
    for seed in range(10):  # {a_0, a_1, c} would triple the one held-out sample asked for: it stays in training
        assert split_indices(4, 0.25, seed, g) == ([0, 1, 3], [2])
    big = [0] * 60 + list(range(1, 41))  # one source whose ids all share a stem, and 40 other samples
    for seed in range(10):
        tr, ev = split_indices(100, 0.1, seed, big)
        assert 10 <= len(ev) <= 15 and not set(ev) & set(range(60)) and sorted(tr + ev) == list(range(100))
    tr, ev = split_indices(3, 0.34, 0, [7, 7, 7])  # one group holds everything: per sample, said so
    assert len(tr) == 2 and len(ev) == 1
    # real ShareGPT ids: its long conversations are stored as pieces X_0, X_1, ...
    ids, prompts = [], []
    for i, rec in iter_json_array(sharegpt_path()):
        if i >= 2000:
            break
        ids.append(rec["id"])
        prompts.append(next((t["value"] for t in rec["conversations"] if t["from"] == "human"), "").encode())
    g = split_groups(ids, prompts)
    stems = [x.rsplit("_", 1)[0] for x in ids]
    leaks = []
    for groups in (None, g):
        tr, ev = split_indices(len(ids), 0.05, 0, groups)
        assert len(ev) >= 100 and len(tr) + len(ev) == len(ids)
        seen = {stems[i] for i in tr} | {prompts[i] for i in tr}
        leaks.append(sum(stems[i] in seen or prompts[i] in seen for i in ev))
    assert leaks[0] > 20 and leaks[1] == 0, leaks  # per-sample split leaks; grouped does not


class _SilentWorkerSource:
    """A data source whose items never come out of a loader worker (as when the worker cannot hand
    its batch over and multiprocessing's feeder thread only prints why)."""

    def __getitem__(self, i):
        import time

        time.sleep(3600)


def test_a_loader_worker_that_never_delivers_stops_training_naming_the_cause():
    import time

    from eyas.train.data import LoaderStalled, batch_loader

    t0 = time.monotonic()
    with pytest.raises(LoaderStalled, match=r"no batch in train.loader_timeout_s=1 s: a loader worker died"):
        next(iter(batch_loader(_SilentWorkerSource(), [[0]], 2, 64, 0, num_workers=1, pin=False, timeout_s=1)))
    assert time.monotonic() - t0 < 30
