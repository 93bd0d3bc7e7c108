"""Runs in the vLLM venv (scripts/vllm-venv.sh): an exported MLA draft served behind an MLA target.

    .venv-vllm/bin/python tests/vllm_mla_draft_probe.py JOB.json OUT.pt

JOB.json: {"target": DIR, "draft": DIR (an exported sglang layout of an MLA draft), "prompts": [[ids]],
"max_tokens": n, "k": draft tokens, "engine_args": {...extra vllm.LLM kwargs}}.
OUT.pt: {"drafter": the class vLLM built, "weights": {exported name: max abs difference from the
parameter vLLM serves it as (stacked rows sliced out), or for a linear layer the CPU build repacked,
the max relative difference of its output from x @ W^T}, "attention": the draft layer's attention in its
first call (the draft's prefill over the first prompt): {"positions", "input" [S, 2D], "output"
[S, D]}, "outputs": {"draft": greedy ids with the draft, "target": without}, "spec": vLLM's
speculative counters of the draft run}. vLLM runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0)
so a forward hook can read the layer.
"""

from __future__ import annotations

import gc
import json
import os
import sys

import torch

# exported name -> (vLLM parameter under drafter.model, row slice of a stacked parameter or None)
FUSED = {"q_a_proj": ("fused_qkv_a_proj", 0), "kv_a_proj_with_mqa": ("fused_qkv_a_proj", 1),
         "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


def served_weights(worker, exported_path: str) -> dict:
    from safetensors.torch import load_file

    drafter = worker.model_runner.drafter.model
    params = dict(drafter.named_parameters())
    tensors = load_file(exported_path)
    out = {"drafter": type(drafter).__name__, "weights": {}}
    for name, w in tensors.items():
        if name == "t2d":
            continue
        if name == "d2t":
            out["weights"][name] = float((drafter.draft_id_to_target_id.cpu() - w).abs().max())
            continue
        vname = name if name.startswith("lm_head") else "model." + name.replace("midlayer.", "layers.0.")
        module, leaf = vname.rsplit(".", 2)[1], vname.rsplit(".", 1)[1]
        shard = None
        if module in FUSED:
            fused, shard = FUSED[module]
            vname = vname.replace(f".{module}.", f".{fused}.")
        assert leaf == "weight", name
        param = params[vname].detach().float()
        if param.shape[1:] == w.shape[1:]:  # held as loaded; the second of two stacked parts is the last rows
            start = param.shape[0] - w.shape[0] if shard == 1 else 0
            got = param[start: start + w.shape[0]]
            out["weights"][name] = float((got - w.float()).abs().max())
            continue
        # the CPU build repacks linear weights for its kernels (the parameter is left empty): compare
        # what the layer computes on random inputs with x @ W^T instead, relative to its largest value
        module = drafter
        for part in vname.rsplit(".", 1)[0].split("."):
            module = module[int(part)] if part.isdigit() else getattr(module, part)
        x = torch.randn(3, w.shape[1], generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            y = module(x)
        y = (y[0] if isinstance(y, tuple) else y).float()
        start = y.shape[1] - w.shape[0] if shard == 1 else 0
        y = y[:, start: start + w.shape[0]]
        want = x @ w.float().T
        out["weights"][name] = float((y - want).abs().max() / want.abs().max())
    return out


CAPTURED: list = []


def install_hook(worker) -> None:
    attn = worker.model_runner.drafter.model.model.layers[0].self_attn

    def hook(module, args, kwargs, output):
        if not CAPTURED:
            CAPTURED.append({"positions": kwargs["positions"].detach().clone(),
                             "input": kwargs["hidden_states"].detach().float().clone(),
                             "output": (output[0] if isinstance(output, tuple) else output).detach().float().clone()})

    attn.register_forward_hook(hook, with_kwargs=True)


def generate(job: dict, draft: bool) -> tuple[dict, list]:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kw = dict(model=job["target"], dtype="float32", enforce_eager=True, seed=0, max_model_len=256,
              disable_log_stats=False, skip_tokenizer_init=True, **job.get("engine_args", {}))
    if draft:
        kw["speculative_config"] = {"method": "eagle3", "model": job["draft"], "num_speculative_tokens": job["k"]}
    llm = LLM(**kw)
    res: dict = {}
    if draft:
        res = llm.collective_rpc(served_weights, args=(os.path.join(job["draft"], "model.safetensors"),))[0]
        llm.collective_rpc(install_hook)
    params = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"], ignore_eos=True, detokenize=False)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in job["prompts"]], params, use_tqdm=False)
    if draft:
        res["spec"] = {m.name: (list(m.values) if hasattr(m, "values") else int(m.value)) for m in llm.get_metrics()
                       if m.name.startswith("vllm:spec_decode_num")}
    del llm
    gc.collect()
    return res, [list(o.outputs[0].token_ids) for o in outs]


def main() -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    job = json.loads(open(sys.argv[1]).read())
    res, with_draft = generate(job, draft=True)
    _, target_only = generate(job, draft=False)
    res.update(attention=CAPTURED[0], outputs={"draft": with_draft, "target": target_only})
    torch.save(res, sys.argv[2])


if __name__ == "__main__":
    main()
