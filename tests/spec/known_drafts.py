"""Targets and drafts with known behaviour for the speculative-decoding tests (no mocks of HF models),
built on tests/models.py's tiny_llama and random_draft.

* `markov_target` + `markov_draft`: a real Llama whose layers are switched off (o_proj = down_proj
  = 0, so every hidden state is the token's one-hot embedding) and whose lm_head makes it predict
  f(x) = x + 1 mod V after token x, with near-certainty; and real Eagle3Drafts with hand-set
  weights on top of it (see `markov_draft`) that copy the target, are always wrong, or are right
  exactly at the first draft position — so tau is known exactly.
* `OracleDraft`: a control draft object with Eagle3Draft's interface that proposes the target's
  own greedy token (wrong at a chosen draft position). Its "KV cache" holds (token, position)
  pairs, so it sees exactly the context the decoding loop's draft cache and masks give it, and it
  asserts that this context is the contiguous committed sequence: a test of eyas.spec's draft-cache
  bookkeeping, not only of the acceptance arithmetic.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from tests.models import random_draft, tiny_llama

SHARP = 30.0  # logit gap of the hand-built models: the runner-up has probability ~e^-30


# --- a Markov target and drafts whose acceptance is known exactly ---------------------------------


def succ(x, v: int, n: int = 1):
    """f^n(x) with f(x) = x + 1 mod V: what the Markov target predicts."""
    return (x + n) % v


def markov_target(vocab: int = 12, hidden: int = 16, layers: int = 2):
    """Hidden states stay the one-hot embedding e_x (every layer adds 0); logits after token x are
    SHARP at f(x) and 0 elsewhere. Greedy continuation of ... x is f(x), f(f(x)), ..."""
    assert vocab <= hidden
    model = tiny_llama(vocab, hidden, layers, seed=0)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight.zero_()
        model.model.embed_tokens.weight[:, :vocab] = torch.eye(vocab)
        model.model.norm.weight.fill_(1.0)
        # final norm maps e_x to sqrt(D) e_x; lm_head row f(x) = e_x * SHARP / sqrt(D)
        model.lm_head.weight.zero_()
        for x in range(vocab):
            model.lm_head.weight[succ(x, vocab), x] = SHARP / hidden**0.5
    return model


def markov_draft(target, kind: str):
    """A real Eagle3Draft on `markov_target`, aux layers [0, 1] (both e_t there), W = V:

    fc = [I, 0], so step 0's h = e_t; attention contributes 0 (o_proj = 0);
    the MLP is a lookup table: e_x -> e_g(x) - e_x (gate/up rows pick out x, down writes the
    difference), so the pre-norm output is e_g(x); lm_head reads token predictions off e_y.
      "copy":  g = f, lm_head +f(y)        -> step i outputs f^(i+2)(t): always right, tau = K + 1
      "wrong": g = f, lm_head +(f(y)+1), -f(y) -> always wrong (the right token is the lowest logit)
      "first": MLP off (g = id), lm_head +f^2(y), -f^3(y) -> h stays e_t: step 0 right, step 1 wrong
               (and its right token is the lowest logit), so exactly 1 accepted per pass: tau = 2
    """
    v, d = target.config.vocab_size, target.config.hidden_size
    draft = random_draft(target, aux_layer_ids=(0, 1))
    sq = d**0.5
    with torch.no_grad():
        for p in draft.parameters():
            p.zero_()
        layer = draft.midlayer
        for norm in (layer.input_layernorm, layer.hidden_norm, layer.post_attention_layernorm, draft.norm):
            norm.weight.fill_(1.0)
        draft.fc.weight[:, :d] = torch.eye(d)
        g = (lambda x: succ(x, v)) if kind in ("copy", "wrong") else None
        if g is not None:
            # post_attention_layernorm(e_x) = sqrt(D) e_x; gate_x = up_x = c sqrt(D) only for row x
            c = 1.0
            a = c * sq
            act = a * torch.nn.functional.silu(torch.tensor(a)).item()
            mlp = draft.midlayer.mlp
            for x in range(v):
                mlp.gate_proj.weight[x, x] = c
                mlp.up_proj.weight[x, x] = c
                mlp.down_proj.weight[g(x), x] += 1.0 / act
                mlp.down_proj.weight[x, x] -= 1.0 / act
        plus = {"copy": 1, "wrong": 1, "first": 2}[kind]
        for y in range(v):  # norm(e_y) = sqrt(D) e_y
            draft.lm_head.weight[(succ(y, v, plus) + (1 if kind == "wrong" else 0)) % v, y] += SHARP / sq
            if kind == "wrong":
                draft.lm_head.weight[succ(y, v), y] -= SHARP / sq
            if kind == "first":
                draft.lm_head.weight[succ(y, v, 3), y] -= SHARP / sq
    return draft


# --- the oracle control draft ----------------------------------------------------------------------


class OracleDraft(torch.nn.Module):
    """Proposes the target's greedy next token given the context its cache and mask expose.

    Interface of Eagle3Draft as eyas.spec uses it: config.aux_layer_ids, d2t (W = V, zeros), fuse,
    forward_step, logits. Hidden state layout [depth, logits(V)]: fuse() marks depth -1, and a step
    fed h with depth s-1 is draft step s (0 = the step that predicts the first draft token).
    Keys/values are (token id, position) pairs. Draft step `wrong_at` (None = never, "all" =
    always) proposes f = greedy+1 with the true greedy token as its lowest logit; others put SHARP
    on the greedy token.
    """

    def __init__(self, target, first_token: int, wrong_at: int | str | None = None):
        super().__init__()
        self.target = target
        self.first_token = int(first_token)
        self.wrong_at = wrong_at
        self.vocab = target.config.vocab_size
        self.config = SimpleNamespace(aux_layer_ids=[0])
        self.register_buffer("d2t", torch.zeros(self.vocab, dtype=torch.int64))
        self.calls = 0

    def fuse(self, aux_BSKD: torch.Tensor) -> torch.Tensor:
        h = aux_BSKD.new_zeros(*aux_BSKD.shape[:2], 1 + self.vocab)
        h[..., 0] = -1
        return h

    def logits(self, prenorm: torch.Tensor) -> torch.Tensor:
        return prenorm[..., 1:]

    @torch.no_grad()
    def forward_step(self, input_ids_BS, h_BSD, position_ids_BS, past_k=None, past_v=None, mask_BSP=None):
        self.calls += 1
        s = input_ids_BS.shape[1]
        new_kv = torch.stack([input_ids_BS[0], position_ids_BS[0]], dim=-1).float().view(1, 1, s, 2)
        kv_P2 = (new_kv if past_k is None else torch.cat([past_k, new_kv], dim=2))[0, 0]
        out = h_BSD.new_zeros(1, s, 1 + self.vocab)
        for i in range(s):
            seen = kv_P2[mask_BSP[0, i]]
            seen = seen[seen[:, 1].argsort()]
            pos = seen[:, 1].long()
            # draft input at position p is token p+1: the visible context must be positions 0..p
            assert torch.equal(pos, torch.arange(len(pos))), f"draft context has holes/duplicates: {pos.tolist()}"
            ctx = torch.tensor([self.first_token] + seen[:, 0].long().tolist())
            greedy = int(self.target(ctx[None]).logits[0, -1].argmax())
            step = int(h_BSD[0, i, 0].item()) + 1
            wrong = self.wrong_at == "all" or step == self.wrong_at
            out[0, i, 0] = step
            if wrong:
                out[0, i, 1 + (greedy + 1) % self.vocab] = SHARP
                out[0, i, 1 + greedy] = -SHARP
            else:
                out[0, i, 1 + greedy] = SHARP
        return out, new_kv, new_kv
