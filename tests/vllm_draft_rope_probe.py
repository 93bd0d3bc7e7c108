"""Runs in the vLLM venv (scripts/vllm-venv.sh): the RoPE table vLLM's EAGLE-3 draft serves with.

    .venv-vllm/bin/python tests/vllm_draft_rope_probe.py JOB.json OUT.pt

JOB.json: {"target": DIR, "draft": DIR (an exported sglang layout), "positions": [...]}. vLLM loads
the target with the draft as its EAGLE-3 speculator (in this process), and OUT.pt holds the draft
layer's rotary table at `positions`: {"cos": [P, d/2], "sin": [P, d/2], "class": its rotary class,
"max_position": the table's length}. The table is read from the drafter vLLM built, so it is
whatever vLLM's config handling and get_rope made of the exported config.
"""

from __future__ import annotations

import json
import os
import sys

import torch


def main() -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM

    job = json.loads(open(sys.argv[1]).read())
    llm = LLM(model=job["target"], skip_tokenizer_init=True, dtype="float32", max_model_len=256, enforce_eager=True,
              seed=0, speculative_config={"method": "eagle3", "model": job["draft"], "num_speculative_tokens": 2})

    def read(worker):
        rope = worker.model_runner.drafter.model.model.layers[0].self_attn.rotary_emb
        return type(rope).__name__, rope.cos_sin_cache.detach().float().cpu().clone()

    name, cache = llm.collective_rpc(read)[0]
    cos, sin = cache[torch.tensor(job["positions"])].chunk(2, dim=-1)
    torch.save({"cos": cos, "sin": sin, "class": name, "max_position": cache.shape[0]}, sys.argv[2])


if __name__ == "__main__":
    main()
