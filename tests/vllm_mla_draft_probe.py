"""Runs in the vLLM venv (scripts/vllm-venv.sh): `eyas run` in this process, with a look inside the
engine evaluate.backend=vllm serves the draft in.

    .venv-vllm/bin/python tests/vllm_mla_draft_probe.py OUT.pt EYAS_RUN_ARGS...

Runs `eyas run EYAS_RUN_ARGS` (eyas.cli.main, as `python -m eyas run` does) with vLLM in this process
(VLLM_ENABLE_V1_MULTIPROCESSING=0), so that once evaluate has built its engine with the draft a
forward hook can read the draft layer. OUT.pt: {"rc": eyas's exit code, "draft": the directory vLLM
loaded the draft from, "drafter": the class vLLM built, "weights": {exported name: max abs
difference from the parameter vLLM serves it as (stacked rows sliced out), or for a linear layer the
CPU build repacked, the max relative difference of its output from x @ W^T}, "attention": the draft
layer's attention in its first call (the draft's prefill over evaluate's warm-up prompt):
{"positions", "input" [S, 2D], "output" [S, D]}}. Nothing else is changed: the engine, the
generation and the report are evaluate's own.
"""

from __future__ import annotations

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
SERVED: dict = {}


def install_hook(worker) -> None:
    attn = worker.model_runner.drafter.model.model.layers[0].self_attn

    def hook(module, args, kwargs, output):
        if not CAPTURED:
            CAPTURED.append({"positions": kwargs["positions"].detach().clone(),
                             "input": kwargs["hidden_states"].detach().float().clone(),
                             "output": (output[0] if isinstance(output, tuple) else output).detach().float().clone()})

    attn.register_forward_hook(hook, with_kwargs=True)


def observed(engine):
    """eyas.evaluate.vllm.engine, reading the engine it returns when it serves a draft."""

    def build(cfg, draft, max_len, cpu):
        llm = engine(cfg, draft, max_len, cpu)
        if draft is not None and "drafter" not in SERVED:
            SERVED.update(llm.collective_rpc(served_weights, args=(os.path.join(draft, "model.safetensors"),))[0],
                          draft=str(draft))
            llm.collective_rpc(install_hook)
        return llm

    return build



def main() -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import eyas.evaluate.vllm as evaluate_vllm
    from eyas.cli import main as eyas

    evaluate_vllm.engine = observed(evaluate_vllm.engine)
    rc = eyas(["run", *sys.argv[2:]])
    torch.save({"rc": rc, **SERVED, "attention": CAPTURED[0] if CAPTURED else None}, sys.argv[1])


if __name__ == "__main__":
    main()
