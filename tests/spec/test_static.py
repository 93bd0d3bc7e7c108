"""eyas.spec.static: fixed-size caches (and CUDA graphs on GPUs) give exactly what the reference
path gives: the same tokens and the same per-pass acceptance, on hand-built drafts with known tau,
random tiny targets with partial acceptance and the real SmolLM2 target, one engine reused across
prompts. The graph test runs where CUDA is (a GPU machine); on CPU the same code runs eagerly.
"""

from __future__ import annotations

import pytest
import torch

from eyas.errors import EyasError
from eyas.spec import speculative_generate, target_generate
from eyas.spec.static import StaticEngine
from tests.models import random_draft, tiny_llama
from tests.spec.known_drafts import OracleDraft, markov_draft, markov_target

K = 4


def same_stats(a, b) -> None:
    assert (a.verify_passes, a.new_tokens, a.accept_counts, a.reached, a.accepted) == (
        b.verify_passes, b.new_tokens, b.accept_counts, b.reached, b.accepted)


@pytest.mark.parametrize("mode", ["chain", "tree"])
@pytest.mark.parametrize("kind,tau", [("copy", K + 1), ("wrong", 1), ("first", 2)])
def test_markov_drafts_give_exact_tau(mode, kind, tau):
    target = markov_target()
    draft = markov_draft(target, kind)
    engine = StaticEngine(target, draft, max_len=64)
    prompt = torch.tensor([3, 5, 7])
    ref = target_generate(target, prompt, max_new_tokens=21)
    for _ in range(2):  # the second generation reuses the engine's caches
        out = speculative_generate(target, draft, prompt, max_new_tokens=21, mode=mode, num_draft_tokens=K,
                                   tree_depth=K, tree_top_k=3, tree_total_tokens=10, engine=engine)
        assert out.tokens == ref.tokens and out.stats.tau == tau


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_oracle_with_known_accept_pattern(mode):
    target = tiny_llama(vocab=16, seed=1)
    prompt = torch.tensor([1, 4, 9, 2])
    ref = target_generate(target, prompt, max_new_tokens=13)
    oracle = OracleDraft(target, prompt[0], 2)
    engine = StaticEngine(target, oracle, max_len=48)
    out = speculative_generate(target, oracle, prompt, max_new_tokens=13, mode=mode, num_draft_tokens=K,
                               tree_depth=K, tree_top_k=2, tree_total_tokens=6, engine=engine)
    assert out.tokens == ref.tokens and out.stats.tau == 3


@pytest.mark.parametrize("mode,num_layers,window", [("chain", 1, 0), ("tree", 1, 0), ("chain", 2, 0), ("tree", 2, 0),
                                                    ("chain", 1, 3), ("tree", 2, 3)])
def test_partial_acceptance_equals_the_reference_path(mode, num_layers, window):
    """Random tiny targets (V = 8) and drafts (W = 6; one or two draft layers; full attention or a
    3-position sliding window): tokens and every acceptance count equal the DynamicCache path's;
    target-only decoding through the engine equals it too."""
    accepted = rejected = 0
    for seed in range(3):
        target = tiny_llama(vocab=8, seed=10 + seed)
        draft = random_draft(target, draft_tokens=[0, 1, 2, 4, 5, 7], seed=seed, num_layers=num_layers,
                             sliding_window=window)
        engine = StaticEngine(target, draft, max_len=96)
        for p in range(2):
            prompt = torch.randint(0, 8, (9 + p,), generator=torch.Generator().manual_seed(seed * 10 + p))
            kw = dict(max_new_tokens=30, mode=mode, num_draft_tokens=K, tree_depth=3, tree_top_k=3, tree_total_tokens=8)
            ref = speculative_generate(target, draft, prompt, **kw)
            out = speculative_generate(target, draft, prompt, **kw, engine=engine)
            assert out.tokens == ref.tokens == target_generate(target, prompt, max_new_tokens=30).tokens
            assert target_generate(target, prompt, max_new_tokens=30, engine=engine).tokens == ref.tokens
            same_stats(out.stats, ref.stats)
            accepted += sum(out.stats.accepted)
            rejected += out.stats.verify_passes * K - sum(out.stats.accepted)
    assert accepted > 0 and rejected > 0


def test_sampling_runs_on_the_static_caches():
    target = tiny_llama(vocab=8, seed=3)
    draft = random_draft(target, draft_tokens=[0, 1, 2, 4, 5, 7], seed=1)
    engine = StaticEngine(target, draft, max_len=64)
    prompt = torch.tensor([1, 2, 3])
    a = speculative_generate(target, draft, prompt, max_new_tokens=20, temperature=0.8,
                             generator=torch.Generator().manual_seed(0))
    b = speculative_generate(target, draft, prompt, max_new_tokens=20, temperature=0.8,
                             generator=torch.Generator().manual_seed(0), engine=engine)
    assert a.tokens == b.tokens
    same_stats(a.stats, b.stats)


def test_too_small_a_cache_is_a_clear_error():
    target = markov_target()
    draft = markov_draft(target, "copy")
    engine = StaticEngine(target, draft, max_len=16)
    with pytest.raises(EyasError, match="max_context"):
        speculative_generate(target, draft, torch.tensor([3, 5, 7]), max_new_tokens=21, num_draft_tokens=K,
                             engine=engine)


@pytest.mark.slow
def test_smollm2_static_equals_reference(smollm2_dir, smollm2_tokenizer):
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32, attn_implementation="sdpa")
    target.eval().requires_grad_(False)
    tok = smollm2_tokenizer
    draft = random_draft(target, aux_layer_ids=(2, 15, 27), draft_tokens=list(range(2048)), seed=0)
    engine = StaticEngine(target, draft, max_len=256)
    for text in ("What is the capital of France?", "Write a haiku about the sea."):
        chat = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
        prompt = torch.tensor(tok(chat, add_special_tokens=False)["input_ids"])
        ref = target_generate(target, prompt, max_new_tokens=10)
        for mode in ("chain", "tree"):
            kw = dict(max_new_tokens=10, mode=mode, num_draft_tokens=3, tree_depth=3, tree_top_k=4, tree_total_tokens=10)
            out = speculative_generate(target, draft, prompt, **kw, engine=engine)
            assert out.tokens == ref.tokens, (text, mode)
            same_stats(out.stats, speculative_generate(target, draft, prompt, **kw).stats)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("mode,num_layers,window", [("chain", 1, 0), ("tree", 1, 0), ("chain", 2, 0), ("tree", 2, 0),
                                                    ("chain", 1, 6), ("tree", 1, 6)])
def test_cuda_graphs_equal_the_eager_static_path(mode, num_layers, window):
    """fp32 on the GPU: graph replays (target forwards, draft extensions, the greedy chain) give the
    tokens and acceptance of the same caches run eagerly, across prompts of several lengths (one-
    and two-layer drafts, full attention or a 6-position sliding window)."""
    torch.manual_seed(0)
    target = tiny_llama(vocab=64, hidden=64, layers=4, seed=5).cuda()
    draft = random_draft(target, draft_tokens=list(range(0, 64, 2)), seed=2, num_layers=num_layers,
                         sliding_window=window).cuda()
    graphed = StaticEngine(target, draft, max_len=256, graphs=True)
    eager = StaticEngine(target, draft, max_len=256, graphs=False)
    kw = dict(max_new_tokens=40, mode=mode, num_draft_tokens=K, tree_depth=3, tree_top_k=3, tree_total_tokens=8)
    for n in (5, 9, 17):
        prompt = torch.randint(0, 64, (n,), generator=torch.Generator().manual_seed(n)).cuda()
        ref = speculative_generate(target, draft, prompt, **kw, engine=eager)
        out = speculative_generate(target, draft, prompt, **kw, engine=graphed)
        assert out.tokens == ref.tokens == target_generate(target, prompt, max_new_tokens=40).tokens
        assert target_generate(target, prompt, max_new_tokens=40, engine=graphed).tokens == ref.tokens
        same_stats(out.stats, ref.stats)
    assert graphed.graphs.graphs, "no graph was captured"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_batch_decoder_graphs_equal_per_prompt_decoding():
    """The regenerate stage's BatchDecoder with its decode step as a CUDA graph (fp32): every
    prompt's tokens equal target-only decoding of that prompt alone, filler rows included."""
    from eyas.spec.static import BatchDecoder

    target = tiny_llama(vocab=64, hidden=64, layers=4, seed=7).cuda()
    prompts = [torch.randint(0, 64, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (3, 11, 7)]
    dec = BatchDecoder(target, rows=4, width=16, max_new=24, check_every=4, kv_block=8)  # windows 24, 32, 40
    eos = {63}
    got = dec.generate(prompts, eos, 0, lambda logits: logits.argmax(-1))
    for p, new in zip(prompts, got):
        ref = target_generate(target, torch.tensor(p).cuda(), max_new_tokens=24, stop_ids=eos).tokens
        assert new == ref
    assert len(dec.graphs.graphs) >= 2, "one graph per window was expected"


@pytest.mark.slow
def test_smollm2_fitted_draft_deep_acceptance_is_lossless(smollm2_dir, smollm2_tokenizer):
    """A draft fitted to SmolLM2's own greedy answers accepts long runs (tau > 3): every accepted
    tree path, its cache compaction and the next round's positions are exercised on the real
    model, and the output is still the target's greedy output, static caches and eager alike."""
    from tests.data import chat_prompt_ids
    from tests.models import fitted_draft, greedy_sequences, load_target

    target = load_target(smollm2_dir)
    prompts = chat_prompt_ids(smollm2_tokenizer, ("The capital of France is", "def fibonacci(n):"))
    n = 24
    seqs = greedy_sequences(target, prompts, n + 8)
    draft = fitted_draft(target, seqs, aux_layer_ids=(2, 15, 27), steps=40).eval()
    engine = StaticEngine(target, draft, max_len=256)
    kw = dict(max_new_tokens=n, num_draft_tokens=7, tree_total_tokens=24, tree_depth=6, tree_top_k=4)
    for mode in ("chain", "tree"):
        for p, s in zip(prompts, seqs):
            out = speculative_generate(target, draft, torch.tensor(p), mode=mode, **kw, engine=engine)
            assert out.tokens == s[len(p) : len(p) + n], mode
            assert out.stats.tau > 3, (mode, out.stats.tau)
            if mode == "tree":
                same_stats(out.stats, speculative_generate(target, draft, torch.tensor(p), mode=mode, **kw).stats)
