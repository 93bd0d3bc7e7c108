"""Fixed-size KV caches and CUDA graphs for speculative decoding: the fast path on GPUs.

Legend: S query tokens, M cache slots, K aux layers / chain length (by context), D hidden,
Hkv kv heads, d head dim.

Decoding one sequence issues hundreds of small kernels per token; on a GPU the launches, not the
arithmetic, set the pace (on an H200 an eager SmolLM2-135M forward took 30-80 ms for one token). A CUDA graph replays a whole forward as one launch, but it needs fixed shapes and
no host synchronisation inside. So this path keeps the same round logic (eyas.spec.generate) and
changes only where keys and values live:

* target: `SlotCache`, one buffer [1, Hkv, M, d] per layer behind transformers' cache interface
  (`update` writes the new keys/values at given slots and returns the whole buffer). Every
  forward gets an explicit 4-D mask over the M slots (transformers passes a 4-D mask to the
  attention as is): the kept prefix, then the new tokens among themselves (causal, or a tree's
  ancestor mask). Slots past the kept length hold stale entries that no mask lets through, so
  rejecting tokens is free; a tree's accepted path is copied down to contiguous slots.
* draft: `StaticDraftCache`, the same idea for the draft's layers (one buffer whose heads are all
  its layers' kv heads, as eyas.draft stacks them), with DraftCache's interface (views of the used
  slots), so every eager propose function runs on it unchanged.

Graphs (CUDA only; `graphs=False` or a CPU runs the same code eagerly, which is how the tests
compare this path with the reference DynamicCache path token for token):
* target forwards of S <= GRAPH_MAX_TOKENS tokens after the prefill, one graph per S (1 for
  target-only decoding, K+1 for a chain, tree nodes + root for a tree);
* the draft's step 0 over S <= GRAPH_MAX_TOKENS new positions, one graph per S;
* the greedy chain of K draft tokens, all K steps in one graph (argmax and d2t stay on the GPU);
* the EAGLE-2 tree's drafting (every level; the final node selection runs on the host).
Sampling chains draft eagerly (over the static draft cache). A graph is captured the first
time its shape occurs: warm-up run on a side stream (it computes the real result, so the cache
writes it makes are the right ones), capture, replay. All graphs share one memory pool.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

import torch

from eyas.capture import HiddenStateCapture
from eyas.errors import EyasError
from eyas.spec.cache import _check_full_attention
from eyas.spec.propose import to_target_ids, window_kw
from eyas.spec.verify import _cache_kwarg, new_cache

GRAPH_MAX_TOKENS = 128
"""Target forwards and draft step-0 extensions of at most this many tokens run as CUDA graphs."""

SLOT_ATTENTION = "eyas_slots"
"""The attention implementation the static paths switch their target to (transformers'
AttentionInterface, the public extension point; not a rewritten forward)."""


def slot_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """Short queries (decode, verify) over many cached slots with grouped key/value heads: the g
    query heads that share a key/value head ride along the query axis ([B, Hkv, g*S, d]), so the
    keys and values are read once instead of being repeated g times per head first (what the
    stock SDPA path does whenever a mask is given). Anything else goes to transformers' SDPA."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    b, h, s, d = query.shape
    hkv = key.shape[1]
    if attention_mask is None or s > GRAPH_MAX_TOKENS or h == hkv or h % hkv or dropout or kwargs.get("softcap"):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    g = h // hkv
    q = query.reshape(b, hkv, g * s, d)  # head a*g + j, token t -> row j*s + t of kv head a
    mask = attention_mask.repeat(1, 1, g, 1)
    out = torch.nn.functional.scaled_dot_product_attention(q, key, value, attn_mask=mask, scale=scaling)
    return out.reshape(b, h, s, value.shape[-1]).transpose(1, 2).contiguous(), None


def use_slot_attention(model) -> None:
    """Register `slot_attention` (once) and switch `model` to it."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(SLOT_ATTENTION, slot_attention)
    AttentionMaskInterface.register(SLOT_ATTENTION, sdpa_mask)
    if getattr(model.config, "_attn_implementation", None) != SLOT_ATTENTION:
        model.set_attn_implementation(SLOT_ATTENTION)


class SlotCache:
    """A KV cache of fixed buffers behind transformers' cache interface (`update`, `get_seq_length`).

    Before each forward the caller sets `slots` (long [S]: where the S new entries go) and passes
    a 4-D mask over all M slots; `update` writes there and hands the attention the whole buffer,
    or its first `view` slots when the caller sets `view` (and masks that many keys).
    Buffers are allocated at the first update of each layer (shapes from the model itself, so MLA
    latents work as well as ordinary keys/values).
    """

    def __init__(self, max_len: int):
        self.max_len = max_len
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.slots: torch.Tensor | None = None
        self.view = 0  # > 0: attention reads only slots [0, view)
        self.length = 0  # kept entries (host-side bookkeeping)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        if layer_idx == len(self.keys):
            if key_states.is_cuda and torch.cuda.is_current_stream_capturing():
                raise EyasError("SlotCache: buffers must exist before a CUDA graph is captured")
            shape_k = (*key_states.shape[:2], self.max_len, *key_states.shape[3:])
            shape_v = (*value_states.shape[:2], self.max_len, *value_states.shape[3:])
            self.keys.append(key_states.new_zeros(shape_k))
            self.values.append(value_states.new_zeros(shape_v))
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        keys.index_copy_(2, self.slots, key_states)
        values.index_copy_(2, self.slots, value_states)
        if self.view:
            return keys[:, :, : self.view], values[:, :, : self.view]
        return keys, values

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length


@dataclass
class _Graph:
    graph: Any
    inputs: dict[str, torch.Tensor]
    outputs: Any


class _Graphs:
    """CUDA graphs by key, captured on first use, one shared memory pool; disabled off CUDA."""

    def __init__(self, device: torch.device, enabled: bool):
        self.enabled = enabled and device.type == "cuda"
        self.device = device
        self.pool = torch.cuda.graph_pool_handle() if self.enabled else None
        self.graphs: dict[Any, _Graph] = {}

    def run(self, key, inputs: dict[str, torch.Tensor], fn: Callable[[dict[str, torch.Tensor]], Any]):
        """fn(static inputs) -> outputs; `inputs` are copied into the graph's static buffers."""
        if not self.enabled:
            return fn(inputs)
        g = self.graphs.get(key)
        if g is None:
            static = {k: v.clone() for k, v in inputs.items()}
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                fn(static)  # warm-up: lazy inits outside the capture; computes the real result
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                outputs = fn(static)
            g = self.graphs[key] = _Graph(graph, static, outputs)
        else:
            for k, v in inputs.items():
                g.inputs[k].copy_(v)
        g.graph.replay()
        return g.outputs


def additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)


class StaticTarget:
    """The target over a SlotCache; same `forward` / `keep` as eyas.spec.generate.EagerTarget."""

    def __init__(self, target, layer_ids: list[int], max_len: int, graphs: _Graphs):
        for layer in new_cache(target).layers:  # sliding-window / linear-attention layers: refuse
            _check_full_attention(layer)
        use_slot_attention(target)
        self.target, self.graphs, self.max_len = target, graphs, max_len
        self.device = target.get_input_embeddings().weight.device
        self.dtype = target.get_input_embeddings().weight.dtype
        self.capture = HiddenStateCapture(target, layer_ids)
        self.cache = SlotCache(max_len)
        self.arange_M = torch.arange(max_len, device=self.device)
        self.cache_kw = _cache_kwarg(type(target))

    def reset(self) -> None:
        self.cache.length = 0

    def _run(self, x: dict[str, torch.Tensor], logits_to_keep: int = 0):
        self.cache.slots = x["slots"]
        kwargs: dict[str, Any] = {
            "input_ids": x["ids"],
            "position_ids": x["pos"],
            "attention_mask": additive(x["mask"], self.dtype),
            self.cache_kw: self.cache,
            "use_cache": True,
        }
        if logits_to_keep:
            kwargs["logits_to_keep"] = logits_to_keep
        with self.capture:
            logits = self.target(**kwargs).logits[0]
            aux_SKD = self.capture.result()[0][0]
        self.capture.clear()
        return logits, aux_SKD

    def forward(self, ids_S: torch.Tensor, pos_S: torch.Tensor, mask_SS: torch.Tensor | None = None,
                logits_to_keep: int = 0):
        """Append S tokens at slots length..length+S-1 (see EagerTarget.forward)."""
        s, n = ids_S.shape[0], self.cache.length
        if n + s > self.max_len:
            raise EyasError(f"sequence of {n + s} tokens exceeds the static cache of {self.max_len} slots")
        if mask_SS is None:
            mask_SS = torch.ones(s, s, dtype=torch.bool, device=self.device).tril()
        mask_SM = (self.arange_M < n).expand(s, self.max_len).clone()
        mask_SM[:, n : n + s] = mask_SS
        x = {
            "ids": ids_S.view(1, s),
            "pos": pos_S.view(1, s),
            "slots": torch.arange(n, n + s, device=self.device),
            "mask": mask_SM.view(1, 1, s, self.max_len),
        }
        if n and s <= GRAPH_MAX_TOKENS and not logits_to_keep:
            logits, aux_SKD = self.graphs.run(("target", s), x, self._run)
            logits, aux_SKD = logits, aux_SKD.clone()  # the next replay overwrites the graph's outputs
        else:
            logits, aux_SKD = self._run(x, logits_to_keep)
        self.cache.length = n + s
        return logits, aux_SKD

    def keep(self, prefix: int, kept: list[int] | None, n: int) -> None:
        """Keep slots 0..prefix-1 and the appended entries `kept` (None = the first n), moved down
        to slots prefix, prefix+1, ..."""
        if kept is not None and kept != list(range(len(kept))):
            src = prefix + torch.tensor(kept, device=self.device)
            dst = torch.arange(prefix, prefix + len(kept), device=self.device)
            for buf in self.cache.keys + self.cache.values:
                buf.index_copy_(2, dst, buf.index_select(2, src))
        self.cache.length = prefix + (n if kept is None else len(kept))


class StaticDraftCache:
    """DraftCache's interface (k, v, committed, append, commit, rollback) over fixed buffers
    [1, L*Hkv, M, d] (L draft layers): `k` / `v` are views of the used slots, so eager code runs on
    it unchanged."""

    def __init__(self, max_len: int):
        self.max_len = max_len
        self.kbuf: torch.Tensor | None = None
        self.vbuf: torch.Tensor | None = None
        self.n = 0
        self.committed = 0

    def reset(self) -> None:
        self.n = self.committed = 0

    def __len__(self) -> int:
        return self.n

    @property
    def k(self) -> torch.Tensor | None:
        return None if self.kbuf is None else self.kbuf[:, :, : self.n]

    @property
    def v(self) -> torch.Tensor | None:
        return None if self.vbuf is None else self.vbuf[:, :, : self.n]

    def append(self, k_BHSd: torch.Tensor, v_BHSd: torch.Tensor) -> None:
        s = k_BHSd.shape[2]
        if self.kbuf is None:
            self.kbuf = k_BHSd.new_zeros((*k_BHSd.shape[:2], self.max_len, k_BHSd.shape[3]))
            self.vbuf = v_BHSd.new_zeros((*v_BHSd.shape[:2], self.max_len, v_BHSd.shape[3]))
        if self.n + s > self.max_len:
            raise EyasError(f"draft cache: {self.n + s} entries exceed the static cache of {self.max_len} slots")
        self.kbuf[:, :, self.n : self.n + s] = k_BHSd
        self.vbuf[:, :, self.n : self.n + s] = v_BHSd
        self.n += s

    def commit(self) -> None:
        self.committed = self.n

    def rollback(self) -> None:
        self.n = self.committed


class StaticDrafter:
    """eyas.spec.generate.EagerDrafter's interface over a StaticDraftCache, with graphs for the
    step-0 extension and the greedy chain."""

    def __init__(self, draft, max_len: int, graphs: _Graphs):
        from eyas.spec.generate import EagerDrafter

        self.draft, self.graphs = draft, graphs
        self.dcache = StaticDraftCache(max_len)
        self.eager = EagerDrafter(draft, self.dcache)
        self.device = draft.d2t.device
        self.arange_M = torch.arange(max_len, device=self.device)

    def reset(self) -> None:
        self.dcache.reset()

    def _all_past(self):
        return self.dcache.kbuf, self.dcache.vbuf

    def _extend(self, x: dict[str, torch.Tensor]) -> torch.Tensor:
        c, s = x["c"], x["tokens"].shape[1]
        ar_s = torch.arange(s, device=self.device)
        h_1SD = self.draft.fuse(x["aux"].unsqueeze(0))
        mask_1SP = torch.cat(
            [(self.arange_M < c).expand(s, -1), torch.ones(s, s, dtype=torch.bool, device=self.device).tril()], 1
        ).unsqueeze(0)
        kbuf, vbuf = self._all_past()
        key_pos = torch.cat([self.arange_M, c + ar_s])  # a committed slot's position is its index
        pre_1SD, k, v = self.draft.forward_step(x["tokens"], h_1SD, (c + ar_s).unsqueeze(0), kbuf, vbuf, mask_1SP,
                                                **window_kw(self.draft, key_pos))
        kbuf.index_copy_(2, c + ar_s, k)
        vbuf.index_copy_(2, c + ar_s, v)
        return pre_1SD[:, -1:]

    def extend(self, next_tokens_S: torch.Tensor, aux_SKD: torch.Tensor, start_pos: int) -> torch.Tensor:
        s, dc = next_tokens_S.shape[0], self.dcache
        if dc.kbuf is None or s > GRAPH_MAX_TOKENS:  # the prefill's positions: eager, allocates the buffers
            return self.eager.extend(next_tokens_S, aux_SKD, start_pos)
        assert start_pos == dc.committed == dc.n, (start_pos, dc.committed, dc.n)
        if dc.n + s > dc.max_len:
            raise EyasError(f"draft cache: {dc.n + s} entries exceed the static cache of {dc.max_len} slots")
        x = {"tokens": next_tokens_S.view(1, s), "aux": aux_SKD, "c": torch.tensor(dc.n, device=self.device)}
        h_11D = self.graphs.run(("extend", s), x, self._extend).clone()
        dc.n += s
        dc.commit()
        return h_11D

    def _chain(self, x: dict[str, torch.Tensor], k: int) -> torch.Tensor:
        c, h = x["c"], x["h"]
        kbuf, vbuf = self._all_past()
        logits_W = self.draft.logits(h)[0, 0]
        tokens = []
        for i in range(k):
            tok = to_target_ids(self.draft, logits_W.argmax(-1))
            tokens.append(tok)
            if i + 1 == k:
                break
            slot = (c + i).view(1)
            mask_11P = torch.cat([self.arange_M < c + i, torch.ones(1, dtype=torch.bool, device=self.device)]).view(1, 1, -1)
            h, kn, vn = self.draft.forward_step(tok.view(1, 1), h, slot.view(1, 1), kbuf, vbuf, mask_11P,
                                                **window_kw(self.draft, torch.cat([self.arange_M, slot])))
            kbuf.index_copy_(2, slot, kn)
            vbuf.index_copy_(2, slot, vn)
            logits_W = self.draft.logits(h)[0, 0]
        return torch.stack(tokens)

    def chain(self, h_11D: torch.Tensor, last_pos: int, params, generator):
        dc = self.dcache
        assert last_pos + 1 == dc.committed == dc.n, (last_pos, dc.committed, dc.n)
        if params.temperature > 0:
            return self.eager.chain(h_11D, last_pos, params, generator)
        k = params.num_draft_tokens
        if dc.n + k > dc.max_len:
            raise EyasError(f"draft cache: {dc.n + k} entries exceed the static cache of {dc.max_len} slots")
        x = {"h": h_11D, "c": torch.tensor(dc.n, device=self.device)}
        drafts_K = self.graphs.run(("chain", k), x, lambda x: self._chain(x, k)).clone()
        return drafts_K, None  # scratch slots past `committed` are simply overwritten later

    def _tree(self, x: dict[str, torch.Tensor], k: int, depth: int):
        """eyas.spec.propose.draft_tree on the static buffers, every shape fixed: the frontier is
        always k nodes; level l's k scratch entries go to slots c + (l-1)k ..; a node's
        visibility is a row over all M slots (the committed prefix, then its ancestors' slots).
        -> the candidate tensors select_nodes takes (tokens, parents, scores, depths)."""
        c, h, dev = x["c"], x["h"], self.device
        kbuf, vbuf = self._all_past()
        lp_W = torch.log_softmax(self.draft.logits(h)[0, 0].float(), dim=-1)
        top = lp_W.topk(k)
        f_scores, f_tokens = top.values, to_target_ids(self.draft, top.indices)
        f_cands = torch.arange(k, device=dev)
        f_h = h.expand(1, k, h.shape[-1])
        anc_FM = (self.arange_M < c).expand(k, -1)
        # slot positions: committed slots their index; level l's scratch slots c + (l-1)k .. at c - 1 + l
        slot_pos_M = torch.where(self.arange_M < c, self.arange_M, c + (self.arange_M - c).div(k, rounding_mode="floor"))
        eye = torch.eye(k, dtype=torch.bool, device=dev)
        ar_k = torch.arange(k, device=dev)
        tokens, parents = [f_tokens], [torch.full((k,), -1, device=dev)]
        scores, depths = [f_scores], [torch.full((k,), 1, device=dev)]
        num = k
        for level in range(1, depth):
            base = c + (level - 1) * k
            mask_1FP = torch.cat([anc_FM, eye], 1).unsqueeze(0)
            pos_1F = (c - 1 + level).expand(1, k)
            pre_1FD, kn, vn = self.draft.forward_step(f_tokens.unsqueeze(0), f_h, pos_1F, kbuf, vbuf, mask_1FP,
                                                      **window_kw(self.draft, torch.cat([slot_pos_M, pos_1F[0]])))
            kbuf.index_copy_(2, base + ar_k, kn)
            vbuf.index_copy_(2, base + ar_k, vn)
            top = torch.log_softmax(self.draft.logits(pre_1FD)[0].float(), dim=-1).topk(k)
            cum_Fk = f_scores[:, None] + top.values
            child_Fk = to_target_ids(self.draft, top.indices)
            tokens.append(child_Fk.flatten())
            parents.append(f_cands.repeat_interleave(k))
            scores.append(cum_Fk.flatten())
            depths.append(torch.full((k * k,), level + 1, device=dev))
            if level + 1 == depth:
                break
            best = cum_Fk.flatten().topk(k)
            rows = best.indices // k
            f_cands, num = num + best.indices, num + k * k
            f_scores, f_tokens = best.values, child_Fk.flatten()[best.indices]
            f_h = pre_1FD[:, rows]
            anc_FM = anc_FM[rows] | (self.arange_M[None] == (base + rows)[:, None])
        return torch.cat(tokens), torch.cat(parents), torch.cat(scores), torch.cat(depths)

    def tree(self, h_11D: torch.Tensor, root: int, last_pos: int, params):
        from eyas.spec.tree import select_nodes

        dc = self.dcache
        assert last_pos + 1 == dc.committed == dc.n, (last_pos, dc.committed, dc.n)
        k, depth = min(params.tree_top_k, self.draft.d2t.numel()), params.tree_depth
        if dc.n + (depth - 1) * k > dc.max_len:
            raise EyasError(f"draft cache: {dc.n + (depth - 1) * k} entries exceed the static cache of {dc.max_len} slots")
        x = {"h": h_11D, "c": torch.tensor(dc.n, device=self.device)}
        t, p, s, d = self.graphs.run(("tree", k, depth), x, lambda x: self._tree(x, k, depth))
        # one host sync for the whole tree, as in draft_tree; scratch slots are overwritten later
        return select_nodes(root, t.tolist(), p.tolist(), s.clone(), d.tolist(), params.tree_total_tokens)


class StaticEngine:
    """Static caches (and, on CUDA, graphs) for one target and draft, reused across prompts.

        engine = StaticEngine(target, draft, max_len=4096)
        speculative_generate(target, draft, ids, ..., engine=engine)
        target_generate(target, ids, ..., engine=engine)
    """

    def __init__(self, target, draft, max_len: int, graphs: bool = True):
        device = target.get_input_embeddings().weight.device
        self.max_len = max_len
        self.graphs = _Graphs(device, graphs)
        self.target = StaticTarget(target, list(draft.config.aux_layer_ids), max_len, self.graphs)
        self.drafter = StaticDrafter(draft, max_len, self.graphs)

    def start(self, needed: int):
        """Fresh caches for a new sequence of up to `needed` tokens -> (target, drafter)."""
        if needed > self.max_len:
            raise EyasError(
                f"this generation needs up to {needed} cache slots, the static caches hold {self.max_len}: "
                "raise --evaluate.max_context"
            )
        self.target.reset()
        self.drafter.reset()
        return self.target, self.drafter


class BatchDecoder:
    """Batched generation for the regenerate stage: `rows` left-padded prompts of one width W,
    a SlotCache of M = W + max_new slots, the decode step (one token for every row) as one CUDA
    graph. Row b's prompt sits at slots pad_b..W-1; its token t at slot t, RoPE position t - pad_b;
    its queries see slots pad_b..t. Finished rows keep running (fixed shapes) and are cut on the
    host; the host checks for "all finished" every `check_every` steps. Decoding is bound by
    reading the cache (1024 rows x 2048 slots of SmolLM2 are 48 GB per step), so a step reads only
    the slots written so far, rounded up to `kv_block`: one graph per such window.
    """

    def __init__(self, model, rows: int, width: int, max_new: int, graphs: bool = True, check_every: int = 16,
                 kv_block: int = 256):
        for layer in new_cache(model).layers:  # sliding-window / linear-attention layers: refuse
            _check_full_attention(layer)
        use_slot_attention(model)
        self.model, self.rows, self.width, self.max_new = model, rows, width, max_new
        self.device = model.get_input_embeddings().weight.device
        self.dtype = model.get_input_embeddings().weight.dtype
        self.max_len = width + max_new
        self.cache = SlotCache(self.max_len)
        self.graphs = _Graphs(self.device, graphs)
        self.arange_M = torch.arange(self.max_len, device=self.device)
        self.cache_kw = _cache_kwarg(type(model))
        self.check_every = check_every
        self.kv_block = kv_block

    def _forward(self, ids_BS, pos_BS, slots_S, mask_BSM, logits_to_keep: int = 0) -> torch.Tensor:
        """mask [B, S, L]: the first L slots are read (L <= M)."""
        self.cache.slots = slots_S
        self.cache.view = mask_BSM.shape[-1]
        kwargs: dict[str, Any] = {
            "input_ids": ids_BS,
            "position_ids": pos_BS,
            "attention_mask": additive(mask_BSM.unsqueeze(1), self.dtype),
            self.cache_kw: self.cache,
            "use_cache": True,
        }
        if logits_to_keep:
            kwargs["logits_to_keep"] = logits_to_keep
        return self.model(**kwargs).logits[:, -1]

    def window(self, slot: int) -> int:
        """Slots a step writing `slot` reads: up to it, rounded up to kv_block (at most M)."""
        return min(self.max_len, -(-(slot + 1) // self.kv_block) * self.kv_block)

    def _step(self, x: dict[str, torch.Tensor], view: int) -> torch.Tensor:
        t, pad_B = x["t"], x["pad"]
        keys_L = self.arange_M[:view]
        mask_B1L = ((keys_L[None] >= pad_B[:, None]) & (keys_L[None] <= t)).unsqueeze(1)
        return self._forward(x["tok"].view(-1, 1), (t - pad_B).view(-1, 1), t.view(1), mask_B1L)

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], eos: set[int], pad_id: int, pick) -> list[list[int]]:
        """prompts (<= rows, each <= width tokens) -> new tokens per prompt, up to and including
        the first eos, at most max_new. pick(logits [rows, V]) -> token ids [rows]."""
        n = len(prompts)
        if not 0 < n <= self.rows or max(len(p) for p in prompts) > self.width:
            raise EyasError(f"BatchDecoder: {n} prompts of up to {max(map(len, prompts))} tokens for {self.rows} rows x {self.width}")
        rows, w, dev = self.rows, self.width, self.device
        filled = prompts + [prompts[-1]] * (rows - n)  # fixed shapes: filler rows repeat the last prompt
        ids = torch.full((rows, w), pad_id, dtype=torch.long)
        pad = torch.tensor([w - len(p) for p in filled])
        for b, p in enumerate(filled):
            ids[b, w - len(p):] = torch.tensor(p)
        ids, pad = ids.to(dev), pad.to(dev)
        j = torch.arange(w, device=dev)
        pos_BW = (j[None] - pad[:, None]).clamp(min=0)
        keys = j[None, None]  # the prompt's slots: nothing later exists yet
        # prompt queries see their own prompt causally; a padding query sees only itself (no empty rows)
        mask_BWW = ((keys >= pad[:, None, None]) & (keys <= j[None, :, None])) | (keys == j[None, :, None])
        logits = self._forward(ids, pos_BW, j, mask_BWW, logits_to_keep=1)
        eos_t = torch.tensor(sorted(eos), device=dev)
        out = torch.empty(rows, self.max_new, dtype=torch.long, device=dev)
        done = torch.zeros(rows, dtype=torch.bool, device=dev)
        # each step's column as a device scalar: torch.tensor(w + i, device=...) would be a pageable
        # host->device copy per step, which waits for the queued replays (a host sync per token)
        cols = torch.arange(w, w + self.max_new, device=dev)
        steps = 0
        for i in range(self.max_new):
            tok = pick(logits)
            out[:, i] = tok
            done |= torch.isin(tok, eos_t)
            steps = i + 1
            if steps == self.max_new or (steps % self.check_every == 0 and bool(done[:n].all())):
                break
            x = {"tok": tok, "t": cols[i], "pad": pad}
            view = self.window(w + i)
            logits = self.graphs.run(("decode", rows, self.max_len, view), x, functools.partial(self._step, view=view))
        new = out[:n, :steps].tolist()
        result = []
        for row in new:
            cut = next((k + 1 for k, t in enumerate(row) if t in eos), len(row))
            result.append(row[:cut])
        return result
