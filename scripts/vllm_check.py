"""Serve exported EAGLE-3 drafts in real vLLM (CPU build) and report what it did.

    .venv-vllm/bin/python scripts/vllm_check.py JOB.json RESULT.json

Runs in the vLLM venv (scripts/vllm-venv.sh), never imports eyas. JOB.json:

    {"target": DIR, "dtype": "float32", "max_model_len": 512, "max_tokens": 24,
     "prompts": [[token ids], ...],
     "runs": [{"name": "target"},                                  # target only
              {"name": "sglang", "draft": DIR, "k": 3}, ...],       # target + EAGLE-3 draft
     "engine_args": {...}}                                          # optional: more vllm.LLM arguments

RESULT.json, per run: greedy `outputs` (token ids per prompt), the spec-decode counters
(`num_drafts`, `num_draft_tokens`, `num_accepted_tokens`, `accepted_per_pos`; deltas over this
run's generate call), and for draft runs `inspect`: what vLLM actually built, read inside the
worker: the target's aux layers, the drafter class, its residual-norm variant, RoPE base, the
d2t it loaded, whether it shares the target's embedding, its number of draft layers, EAGLE 3.1's
fc_norm count and norm_output, and each
exported tensor (every layer's) checked against the layer that serves it (functional checks: vLLM's
CPU linears repack their weights).

All engines run in this one process one after another (VLLM_ENABLE_V1_MULTIPROCESSING=0), so
imports are paid once. The code sits under `if __name__ == "__main__":` because vLLM may start
worker processes with spawn.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time

# exported tensor name (SGLang layout; speculators uses layers.0. for midlayer.) -> how vLLM holds it:
# (module path inside Eagle3LlamaForCausalLM, kind, shard). kind "linear": module(x) == x @ W.T for
# the rows of `shard` in the fused output; "weight": a plain parameter compared directly.
VLLM_SERVING = {
    "fc.weight": ("model.fc", "linear", None),
    "midlayer.self_attn.q_proj.weight": ("model.layers.0.self_attn.qkv_proj", "linear", "q"),
    "midlayer.self_attn.k_proj.weight": ("model.layers.0.self_attn.qkv_proj", "linear", "k"),
    "midlayer.self_attn.v_proj.weight": ("model.layers.0.self_attn.qkv_proj", "linear", "v"),
    "midlayer.self_attn.o_proj.weight": ("model.layers.0.self_attn.o_proj", "linear", None),
    "midlayer.mlp.gate_proj.weight": ("model.layers.0.mlp.gate_up_proj", "linear", "gate"),
    "midlayer.mlp.up_proj.weight": ("model.layers.0.mlp.gate_up_proj", "linear", "up"),
    "midlayer.mlp.down_proj.weight": ("model.layers.0.mlp.down_proj", "linear", None),
    "midlayer.input_layernorm.weight": ("model.layers.0.input_layernorm.weight", "weight", None),
    "midlayer.hidden_norm.weight": ("model.layers.0.hidden_norm.weight", "weight", None),
    "midlayer.post_attention_layernorm.weight": ("model.layers.0.post_attention_layernorm.weight", "weight", None),
    "norm.weight": ("model.norm.weight", "weight", None),
    "lm_head.weight": ("lm_head.weight", "weight", None),
}


def serving_table(names) -> dict:
    """VLLM_SERVING plus, for each further draft layer j of a multi-layer export (`layers.j.*`,
    j >= 1), the same entries at model.layers.j (no hidden_norm is exported for them: vLLM uses
    only layer 0's), and EAGLE 3.1's per-aux-state norms `fc_norm.k.weight` at model.fc_norm.k."""
    table = dict(VLLM_SERVING)
    for name in names:
        parts = name.split(".")
        if parts[0] == "fc_norm":
            table[name] = (f"model.{name}", "weight", None)
        if parts[0] == "layers" and parts[1] != "0":
            path, kind, shard = VLLM_SERVING["midlayer." + ".".join(parts[2:])]
            table[name] = (path.replace("model.layers.0.", f"model.layers.{parts[1]}."), kind, shard)
    return table


SPEC_METRICS = {
    "vllm:spec_decode_num_drafts": "num_drafts",
    "vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "num_accepted_tokens",
    "vllm:spec_decode_num_accepted_tokens_per_pos": "accepted_per_pos",
}


def spec_counters(llm) -> dict:
    out = {}
    for m in llm.get_metrics():
        if m.name in SPEC_METRICS:
            out[SPEC_METRICS[m.name]] = list(m.values) if hasattr(m, "values") else int(m.value)
    return out


def delta(after: dict, before: dict) -> dict:
    out = {}
    for k, v in after.items():
        b = before.get(k, [0] * len(v) if isinstance(v, list) else 0)
        out[k] = [x - y for x, y in zip(v, b)] if isinstance(v, list) else v - b
    return out


def _shard_rows(layer, shard: str | None, n_rows: int):
    """Row range of one shard inside a fused (qkv / gate_up) output."""
    if shard is None:
        return 0, n_rows
    if shard in ("q", "k", "v"):
        q = layer.num_heads * layer.head_size
        kv = layer.num_kv_heads * layer.head_size
        start = {"q": 0, "k": q, "v": q + kv}[shard]
        return start, start + n_rows
    half = layer.output_size_per_partition // 2
    start = {"gate": 0, "up": half}[shard]
    return start, start + n_rows


def inspect_worker(worker, exported_path: str) -> dict:
    """Runs inside the vLLM worker: what was built and whether it serves the exported tensors."""
    import torch
    from safetensors.torch import load_file

    runner = worker.model_runner
    drafter = runner.drafter.model
    target = runner.model
    layer = drafter.model.layers[0]
    tensors = {k.replace("layers.0.", "midlayer."): v for k, v in load_file(exported_path).items()}
    gen = torch.Generator().manual_seed(0)
    dtype = drafter.model.norm.weight.dtype
    checks = {}
    with torch.no_grad():
        for name, (path, kind, shard) in serving_table(tensors).items():
            w = tensors[name].float()
            obj = drafter
            for part in path.split("."):
                obj = obj[int(part)] if part.isdigit() else getattr(obj, part)
            if kind == "weight":
                got = obj.detach().float()
                checks[name] = float((got - w).abs().max()) if got.shape == w.shape else f"shape {tuple(got.shape)} != {tuple(w.shape)}"
                continue
            x = torch.randn(3, w.shape[1], generator=gen).to(dtype)
            y = obj(x)
            y = (y[0] if isinstance(y, tuple) else y).float()
            a, b = _shard_rows(obj, shard, w.shape[0])
            want = x.float() @ w.T
            got = y[:, a:b]
            scale = float(want.abs().max()) or 1.0
            checks[name] = float((got - want).abs().max()) / scale if got.shape == want.shape else f"shape {tuple(got.shape)} != {tuple(want.shape)}"
    d2t = getattr(drafter, "draft_id_to_target_id", None)
    rope = layer.self_attn.rotary_emb
    return {
        "drafter": type(drafter).__name__,
        "num_draft_layers": len(drafter.model.layers),
        "num_fc_norms": len(drafter.model.fc_norm) if getattr(drafter.model, "fc_norm", None) is not None else 0,
        "norm_output": bool(getattr(drafter.model, "norm_output", False)),
        "target_aux_layers": [int(i) for i in getattr(target.model, "aux_hidden_state_layers", [])],
        "residual_norm": layer._residual_norm.__name__,
        "rope_base": float(getattr(rope, "base", float("nan"))),
        "head_size": int(getattr(rope, "head_size", -1)),
        "d2t_equal": None if d2t is None or "d2t" not in tensors else bool(torch.equal(d2t.cpu(), tensors["d2t"])),
        "d2t_loaded": d2t is not None,
        "embed_shared": drafter.model.embed_tokens is target.model.embed_tokens,
        "sliding_window": [getattr(lyr.self_attn.attn, "sliding_window", None) for lyr in drafter.model.layers],
        "impl_sliding_window": [getattr(lyr.self_attn.attn.impl, "sliding_window", None) for lyr in drafter.model.layers],
        "tensor_errors": checks,
    }


def run_one(job: dict, run: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kw = dict(
        model=job["target"], dtype=job.get("dtype", "float32"), enforce_eager=True, seed=0,
        max_model_len=job.get("max_model_len", 512), disable_log_stats=False, skip_tokenizer_init=True,
    )  # fmt: skip
    if run.get("draft"):
        kw["speculative_config"] = {"method": "eagle3", "model": run["draft"], "num_speculative_tokens": run.get("k", 3)}
    kw.update(job.get("engine_args", {}))
    t0 = time.perf_counter()
    llm = LLM(**kw)
    t1 = time.perf_counter()
    res: dict = {"load_s": round(t1 - t0, 1)}
    if run.get("draft"):
        weights = os.path.join(run["draft"], "model.safetensors")
        res["inspect"] = llm.collective_rpc(inspect_worker, args=(weights,))[0]
    params = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"], ignore_eos=True, detokenize=False)
    before = spec_counters(llm)
    t2 = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in job["prompts"]], params, use_tqdm=False)
    res["generate_s"] = round(time.perf_counter() - t2, 1)
    res["outputs"] = [list(o.outputs[0].token_ids) for o in outs]
    res["spec"] = delta(spec_counters(llm), before)
    del llm
    gc.collect()
    return res


def main(job_path: str, result_path: str) -> None:
    import vllm

    job = json.loads(open(job_path).read())
    result = {"vllm": vllm.__version__, "runs": {}}
    for run in job["runs"]:
        print(f"[vllm_check] {run['name']}: {run.get('draft') or 'target only'}", flush=True)
        result["runs"][run["name"]] = run_one(job, run)
        with open(result_path, "w") as f:  # partial results survive a later failure
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if sys.argv[1:] in (["-h"], ["--help"]):
        print(__doc__)
        sys.exit(0)
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2])
