"""Sampling and the acceptance rules of speculative decoding: pure functions, no models.

Legend: K draft tokens of a chain, V target vocab, W draft vocab.

Greedy (temperature 0). Draft token i is accepted iff it equals the target's argmax at its
position and every earlier draft token was accepted; at the first mismatch the target's argmax is
emitted instead (the "bonus" token; after K accepted tokens it is the argmax after the last one).
Every emitted token is the target's argmax given the tokens before it, so the output equals the
target-only greedy output token for token.

Sampling (temperature T > 0), the rule of Leviathan et al. 2023 / Chen et al. 2023:
    the draft proposes x ~ q(. | prefix), the target scores p(. | prefix)
    accept x with probability min(1, p(x) / q(x))
    on rejection emit y ~ norm(max(0, p - q))            (the residual distribution)
    after K accepted draft tokens emit a bonus y ~ p(. | prefix + the K drafts)
so that P(emit y) = q(y) min(1, p(y)/q(y)) + (1 - sum_x min(p(x), q(x))) norm(max(0, p - q))(y)
                  = min(p(y), q(y)) + max(0, p(y) - q(y)) = p(y):
the output distribution is exactly the target's. The draft's q lives on its W tokens; on the
target vocab it is q(d + d2t[d]) = q_W(d) and 0 elsewhere, so a target token outside the draft
vocab can only be emitted from the residual (or as the bonus).
"""

from __future__ import annotations

import torch


def logits_to_probs(logits_xV: torch.Tensor, temperature: float) -> torch.Tensor:
    """softmax(logits / T) in float32 (T > 0)."""
    assert temperature > 0, temperature
    return torch.softmax(logits_xV.float() / temperature, dim=-1)


def sample(probs_V: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token id (0-d int64 tensor) drawn from `probs_V`."""
    return torch.multinomial(probs_V, 1, generator=generator)[0]


def next_token(logits_V: torch.Tensor, temperature: float, generator: torch.Generator | None) -> torch.Tensor:
    """The target's choice after a prefix: argmax (T = 0) or a sample from softmax(logits / T)."""
    if temperature == 0:
        return logits_V.argmax(-1)
    return sample(logits_to_probs(logits_V, temperature), generator)


def draft_probs_on_target_vocab(q_xW: torch.Tensor, d2t_W: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """q over the draft vocab -> q over the target vocab: q_V[d + d2t[d]] = q_W[d], 0 elsewhere."""
    q_xV = q_xW.new_zeros(*q_xW.shape[:-1], vocab_size)
    target_ids_W = torch.arange(q_xW.shape[-1], device=q_xW.device) + d2t_W
    return q_xV.index_copy_(-1, target_ids_W, q_xW)


def residual_probs(p_V: torch.Tensor, q_V: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)); p itself when p <= q everywhere (a rejection then has probability 0,
    but rounding can still draw one)."""
    r_V = (p_V - q_V).clamp_min(0)
    total = r_V.sum()
    return torch.where(total > 0, r_V / total.clamp_min(torch.finfo(r_V.dtype).tiny), p_V)


def accept_greedy_chain(draft_K: torch.Tensor, target_argmax_K1: torch.Tensor) -> tuple[int, int]:
    """-> (number of accepted draft tokens n, the token emitted after them).

    target_argmax_K1[i] is the target's argmax after the prefix and draft tokens 0..i-1, so draft
    token i is accepted iff it equals target_argmax_K1[i] and all earlier ones were; the emitted
    token after n accepted ones is target_argmax_K1[n] (the correction, or the bonus when n = K).
    """
    k = draft_K.shape[0]
    matches_K = (draft_K == target_argmax_K1[:k]).to(torch.int64)
    n = int(matches_K.cumprod(0).sum().item())  # .item(): one host sync per verify pass, needed to branch
    return n, int(target_argmax_K1[n].item())


def accept_sampling_chain(
    draft_K: torch.Tensor, p_K1V: torch.Tensor, q_KV: torch.Tensor, generator: torch.Generator | None
) -> tuple[int, int]:
    """Speculative sampling over a chain -> (number of accepted draft tokens n, emitted token).

    p_K1V[i] = target probs after the prefix and draft tokens 0..i-1 (K+1 rows);
    q_KV[i] = the draft probs draft token i was sampled from (on the target vocab).
    Draft token i is accepted with probability min(1, p_i(x_i) / q_i(x_i)), tested as
    u_i < p_i(x_i) / q_i(x_i) with u_i ~ U[0, 1) (q_i(x_i) > 0: x_i was drawn from q_i).
    """
    k = draft_K.shape[0]
    rows = torch.arange(k, device=draft_K.device)
    p_x_K = p_K1V[rows, draft_K]
    q_x_K = q_KV[rows, draft_K]
    u_K = torch.rand(k, generator=generator, device=draft_K.device)
    accepted_K = (u_K * q_x_K < p_x_K).to(torch.int64)
    n = int(accepted_K.cumprod(0).sum().item())  # host sync: the branch below needs it
    if n == k:
        token = sample(p_K1V[k], generator)  # every draft accepted: bonus from p after all K
    else:
        token = sample(residual_probs(p_K1V[n], q_KV[n]), generator)  # first rejection at n
    return n, int(token.item())
