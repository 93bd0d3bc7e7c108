"""Runs in the vLLM venv (scripts/vllm-venv.sh): what vLLM computes for an MLA target's first layer.

    .venv-vllm/bin/python tests/extract/vllm_mla_probe.py JOB.json OUT.pt

JOB.json: {"model": DIR, "ids": [token ids], "engine_args": {...extra vllm.LLM kwargs}, "rope_op": bool}.
OUT.pt: {"attention": layer 0's attention output [S, D] (after o_proj) in the prefill of `ids`,
"rope_op": (with rope_op) the CPU rotary op against vLLM's own PyTorch rope on the shapes MLA passes
it: max abs differences for a 3-D query, a 2-D query and a key sliced out of the latent}.
vLLM runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so a forward hook can read the layer.
"""

from __future__ import annotations

import json
import os
import sys

import torch


def rope_op_differences() -> dict[str, float]:
    """torch.ops._C.rotary_embedding (RotaryEmbedding.forward_cpu) against forward_native."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    with set_current_vllm_config(VllmConfig()):
        rope = get_rope(64, max_position=4096, is_neox_style=False,
                        rope_parameters={"rope_theta": 10000.0, "rope_type": "default"}, dtype=torch.float32)
    torch.manual_seed(0)
    pos = torch.arange(8)
    q = torch.randn(8, 2, 64)  # [tokens, heads, rope dim]: DeepSeek's MLA passes q_pe so
    k = torch.randn(8, 1, 64)
    latent = torch.randn(8, 576)  # [kv_lora_rank 512 | k_pe 64]; MLA passes k_pe as a slice of it
    q_ref, k_ref = rope.forward_native(pos, q.clone(), k.clone())
    q_op, _ = rope.forward_cpu(pos, q.clone(), k.clone())
    q_2d, _ = rope.forward_cpu(pos, q.clone().reshape(8, 128), k.clone().reshape(8, 64))
    k_slice_ref = rope.forward_native(pos, q.clone(), latent[:, 512:].unsqueeze(1).clone())[1]
    k_slice_op = rope.forward_cpu(pos, q.clone().reshape(8, 128), latent.clone()[:, 512:].unsqueeze(1))[1]
    return {"query_3d": float((q_op - q_ref).abs().max()), "query_2d": float((q_2d.view(8, 2, 64) - q_ref).abs().max()),
            "key_slice": float((k_slice_op - k_slice_ref).abs().max())}


def first_layer_attention(model_dir: str, ids: list[int], engine_args: dict) -> torch.Tensor:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=model_dir, skip_tokenizer_init=True, dtype="float32", max_model_len=len(ids) + 8,
              enforce_eager=True, enable_prefix_caching=False, seed=0, **engine_args)
    captured: list[torch.Tensor] = []

    def install(model) -> None:
        model.model.layers[0].self_attn.register_forward_hook(
            lambda module, args, out: captured.append((out[0] if isinstance(out, tuple) else out).detach().clone()))

    llm.apply_model(install)
    llm.generate([TokensPrompt(prompt_token_ids=ids)], SamplingParams(max_tokens=1, temperature=0.0, detokenize=False))
    return captured[0].float()  # the prefill's call: every prompt token


def main() -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    job = json.loads(open(sys.argv[1]).read())
    out = {"attention": first_layer_attention(job["model"], job["ids"], job.get("engine_args", {}))}
    if job.get("rope_op"):
        out["rope_op"] = rope_op_differences()
    torch.save(out, sys.argv[2])


if __name__ == "__main__":
    main()
