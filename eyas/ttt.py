"""Training-time test (TTT): the draft unrolled on its own outputs, all positions at once.

Legend: B batch rows, S packed sequence, D hidden, K aux layers, H heads, d head dim, T TTT steps,
P keys, M selected (loss) positions, W draft vocab.

Alignment (t = a position of the packed row; every index below stays inside t's own sample):

    step 0, row t:  h = fc(aux_t),                 token = ids[t+1], RoPE position pos_t
    step i, row t:  h = prenorm output of step i-1 at row t,
                    token = ids[t+1+i],                             RoPE position pos_t + i
    output of step i at row t predicts token t+2+i; its teacher is lm_head(final[t+1+i]) (the
    target's next-token distribution after seeing tokens ..t+1+i), its loss mask loss_mask[t+2+i].

    keys seen by step i at row t: the step-0 keys of rows t' <= t of the same sample (positions
    pos_t'), and the step-j keys of row t itself for 1 <= j <= i (positions pos_t + j) — the
    "diagonal" of EAGLE-3's Figure 6. With a sliding window W (draft.config.sliding_window) the
    step-i query at position pos_t + i sees only those keys less than W positions back:
    pos_t + i - pos_t' < W for step-0 keys, i - j < W on the diagonal (eyas.draft.in_window).

This is what serving does: vLLM and SGLang run the draft once over the verified tokens (row t
consumes aux_t and token t+1 at the position of t), then each further draft token at the next
position, attending to that prefix and to the draft's own earlier tokens. It is the EAGLE-3
reference trainer (SafeAILab/EAGLE eagle/traineagle3/cnets.py: RoPE at `position_ids + lck`,
step-0 keys through the causal mask plus one diagonal key per earlier step; SpecForge's
specforge/core/eagle3.py follows it for ids/teacher/hidden-state shifts). One deliberate
difference: the reference shifts the loss mask together with the input ids, so its step-i mask
is loss_mask[t+i]; eyas masks the token actually predicted, loss_mask[t+2+i].

`ttt_forward` computes each step for all rows at once: one attention call over
cat(step-0 keys, step-1 keys, ..., step-i keys) with a mask that is causal (and same-sample) on
the first block and the identity on the others, as an explicit boolean mask for SDPA or a
FlexAttention block mask (which skips the empty tiles). `naive_ttt` is the independent
reference: for every row it literally runs the draft autoregressively with an ordinary KV cache.
"""

from __future__ import annotations

import torch
from torch import nn

from eyas.draft import Eagle3Draft, in_window
from eyas.errors import ConfigError


def shift_left(x_BS: torch.Tensor, k: int, fill) -> torch.Tensor:
    """out[:, t] = x[:, t+k], `fill` past the end of the row."""
    if k == 0:
        return x_BS
    pad = torch.full_like(x_BS[:, :k], fill)
    return torch.cat([x_BS[:, k:], pad], dim=1)


def sdpa_masks(doc_BS: torch.Tensor, num_steps: int, pos_BS: torch.Tensor | None = None,
               window: int = 0) -> list[torch.Tensor]:
    """Boolean masks [B, S, (i+1)*S] for steps i = 0..T-1 (True = may attend); with `window` > 0
    (needs pos_BS) step i's query at pos_t + i keeps the keys less than `window` positions back."""
    s = doc_BS.shape[1]
    idx = torch.arange(s, device=doc_BS.device)
    causal_SS = idx[None, :] <= idx[:, None]
    block0_BSS = causal_SS[None] & (doc_BS[:, :, None] == doc_BS[:, None, :])
    eye_BSS = torch.eye(s, dtype=torch.bool, device=doc_BS.device)[None].expand_as(block0_BSS)
    masks = [torch.cat([block0_BSS] + [eye_BSS] * i, dim=-1) for i in range(num_steps)]
    if window <= 0:
        return masks
    assert pos_BS is not None, "a sliding window needs the positions"
    # keys of step j at row t' sit at position pos_t' + j
    key_pos_BK = torch.cat([pos_BS + j for j in range(num_steps)], dim=-1)
    return [m & in_window(pos_BS + i, key_pos_BK[:, : (i + 1) * s], window) for i, m in enumerate(masks)]


def ttt_mask_mod(doc_BS: torch.Tensor, s: int, step: torch.Tensor | None = None,
                 pos_BS: torch.Tensor | None = None, window: int = 0):
    """FlexAttention mask_mod over keys cat(step 0, ..., step i), each block S long. With `step`
    (a 0-d tensor = i) the keys may run on past block i (padding up to T blocks): blocks after
    step i are masked. With `window` > 0 (needs `step` and pos_BS): the query at row q sits at
    position pos_q + step and keeps the keys at pos_r + blk less than `window` back."""
    assert window <= 0 or (step is not None and pos_BS is not None), "a sliding window needs the step and positions"

    def mask_mod(b, h, q, kv):
        blk, r = kv // s, kv % s
        first = (r <= q) & (doc_BS[b, q] == doc_BS[b, r])
        later = r == q if step is None else (r == q) & (blk <= step)
        keep = torch.where(blk == 0, first, later)
        if window > 0:
            keep = keep & ((pos_BS[b, q] + step) - (pos_BS[b, r] + blk) < window)
        return keep

    return mask_mod


_block_mask_compiled = None


def flex_masks(doc_BS: torch.Tensor, num_steps: int, compile: bool = True, pos_BS: torch.Tensor | None = None,
               window: int = 0) -> list:
    """FlexAttention BlockMasks with the semantics of `sdpa_masks` (S a multiple of 128), every
    step over the same key length T*S: step i's keys are padded past block i (`ttt_forward` does
    it), the padding is masked, and its tiles are skipped. One shape for all steps compiles the
    attention kernels once (forward and backward) instead of once per step length.

    create_block_mask is compiled once; the mask_mod closes over this batch's `doc_BS` and a 0-d
    step tensor, which do not recompile (dynamo guards the closure's code and tensor metadata)."""
    global _block_mask_compiled
    from torch.nn.attention.flex_attention import create_block_mask

    if compile and _block_mask_compiled is None:
        _block_mask_compiled = torch.compile(create_block_mask)
    make = _block_mask_compiled if compile else create_block_mask
    b, s = doc_BS.shape
    out = []
    for i in range(num_steps):
        mod = ttt_mask_mod(doc_BS, s, torch.tensor(i, device=doc_BS.device), pos_BS, window)
        out.append(make(mod, b, None, s, num_steps * s, device=doc_BS.device) if compile
                   else make(mod, b, None, s, num_steps * s, device=doc_BS.device, _compile=False))
    return out


def ttt_forward(
    draft: Eagle3Draft,
    aux_BSKD: torch.Tensor,
    input_ids_BS: torch.Tensor,
    pos_BS: torch.Tensor,
    masks: list,
) -> list[torch.Tensor]:
    """-> [prenorm_BSD of step i for i < T], T = len(masks) (from `sdpa_masks` or `flex_masks`)."""
    h_BSD = draft.fuse(aux_BSKD)
    keys, values, outs = [], [], []
    kv_len = len(masks) * input_ids_BS.shape[1] if type(masks[0]).__name__ == "BlockMask" else 0
    for i, mask in enumerate(masks):
        ids_BS = shift_left(input_ids_BS, 1 + i, 0)
        past_k = torch.cat(keys, dim=2) if keys else None
        past_v = torch.cat(values, dim=2) if values else None
        h_BSD, k_BHSd, v_BHSd = draft.forward_step(ids_BS, h_BSD, pos_BS + i, past_k, past_v, mask, kv_len)
        keys.append(k_BHSd)
        values.append(v_BHSd)
        outs.append(h_BSD)
    return outs


class TTTDraft(nn.Module):
    """The draft as one module whose forward runs the whole unroll and the draft head on the
    selected rows, so DDP / FSDP2 (which hook `forward`) can wrap it."""

    def __init__(self, draft: Eagle3Draft):
        super().__init__()
        self.draft = draft

    def forward(self, aux_BSKD, input_ids_BS, pos_BS, masks: list, rows_T: list[torch.Tensor]) -> list[torch.Tensor]:
        """-> [logits_MW of step i at the flat rows rows_T[i]] (in the autocast dtype: the loss reads
        them in float32)."""
        outs = ttt_forward(self.draft, aux_BSKD, input_ids_BS, pos_BS, masks)
        logits = []
        for prenorm_BSD, rows_M in zip(outs, rows_T):
            logits.append(self.draft.logits(prenorm_BSD.flatten(0, 1)[rows_M]))
        return logits


@torch.no_grad()
def naive_ttt(
    draft: Eagle3Draft,
    aux_SKD: torch.Tensor,
    input_ids_S: torch.Tensor,
    num_steps: int,
) -> torch.Tensor:
    """Reference for one sample: from every row t, run the draft the way it is served.

    Prefill rows 0..t (h = fc(aux_j), token j+1, position j) with a causal mask; then draft step
    i >= 1 feeds the previous output back with token t+1+i at position t+i, attending to the
    KV cache (prefill + earlier steps). With a sliding window W every query sees only the cached
    keys whose positions lie less than W back (the cache's positions are tracked here, as a
    serving engine's cache slots are). -> prenorm [T, S, D]; rows whose tokens run past the
    sample are zero.
    """
    s = input_ids_S.shape[0]
    w = draft.config.sliding_window or s + num_steps  # no window: every key is near enough

    def seen(q_pos: list[int], k_pos: list[int]) -> torch.Tensor:
        return torch.tensor([[p >= kp and p - kp < w for kp in k_pos] for p in q_pos])[None]

    h_SD = draft.fuse(aux_SKD[None])[0]
    out_TSD = torch.zeros(num_steps, s, h_SD.shape[-1], dtype=h_SD.dtype)
    for t in range(s - 1):
        ids = input_ids_S[1 : t + 2][None]
        cache_pos = list(range(t + 1))
        h, k_cache, v_cache = draft.forward_step(ids, h_SD[: t + 1][None], torch.tensor([cache_pos]),
                                                 mask_BSP=seen(cache_pos, cache_pos))
        h = h[:, -1:]
        out_TSD[0, t] = h[0, 0]
        for i in range(1, num_steps):
            if t + 1 + i >= s:
                break
            ids = input_ids_S[t + 1 + i].view(1, 1)
            cache_pos.append(t + i)
            mask = seen([t + i], cache_pos)
            h, k, v = draft.forward_step(ids, h, torch.tensor([[t + i]]), k_cache, v_cache, mask)
            k_cache, v_cache = torch.cat([k_cache, k], 2), torch.cat([v_cache, v], 2)
            out_TSD[i, t] = h[0, 0]
    return out_TSD


def resolve_attention(kind: str, device: torch.device) -> str:
    """auto -> flex on CUDA (block-sparse, every micro-batch padded to one fixed length so the
    kernels compile once), sdpa on CPU (FlexAttention needs a GPU here)."""
    if kind == "auto":
        return "flex" if device.type == "cuda" else "sdpa"
    if kind == "flex" and device.type != "cuda":
        raise ConfigError("--train.attention=flex needs a CUDA device; use sdpa (or auto) on CPU")
    return kind


def flex_row_length(max_tokens: int) -> int:
    """The one row length of every micro-batch under flex attention: max_tokens rounded up to a
    multiple of 128 (FlexAttention's block). A fixed shape compiles the TTT kernels once; rows of
    varying length recompiled them for every new length (on one H200 the first step of a SmolLM2
    draft on packed ShareGPT rows had not finished after 200 s)."""
    return -(-max_tokens // 128) * 128
