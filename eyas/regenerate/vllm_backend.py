"""Regenerate's vLLM backend: the target in vLLM's offline engine, in this process.

    .venv-vllm/bin/eyas regenerate recipe.yaml --regenerate.backend=vllm
    eyas run recipe.yaml --regenerate.backend=vllm --extract.backend=vllm    # one engine load for both

For targets only vLLM runs fast enough (tensor / expert parallel over the GPUs of one host): the
engine takes extract's vLLM settings (extract.vllm_tensor_parallel_size, vllm_engine_args, ...).
Prompts are the token ids eyas renders with the target's chat template (the same prompts as the hf
backend), so the chat template, not the engine, decides what the target sees; answers are decoded
with the target's tokenizer, their thinking block kept apart (as the hf backend does).

With extract.backend=vllm the engine is the one extraction needs (the hidden-states method and its
connector, extract's arguments): under `eyas run` regenerate leaves it to extract, so a target whose
load takes many minutes loads once. The connector then writes each request's prompt states; they
are deleted as each batch returns. extract.vllm_proxy_parity's check runs here first, before the
target loads, as extract would run it.
"""

from __future__ import annotations

import shutil

from eyas.config import EyasConfig
from eyas.errors import EyasError, exception_message
from eyas.regenerate.backends import (
    Answer,
    Sampling,
    decode_keeping,
    eos_ids,
    marker_ids,
    opens_thinking,
    thinking_answer,
)
from eyas.target import load_config


class VLLMBackend:
    """`generate(token prompts, sampling) -> [Answer]` on a vLLM engine."""

    def __init__(self, cfg: EyasConfig, tok):
        from vllm.platforms import current_platform

        from eyas import vllm_engine
        from eyas.target import model_path

        rc = cfg.regenerate
        self.rc, self.tok, self.seed = rc, tok, cfg.seed
        self.eos = eos_ids(generation_eos(model_path(cfg.target)), tok)
        self.think_ids = marker_ids(tok)
        self.answers = Sampling(rc.temperature, rc.top_p, rc.max_new_tokens)
        # extract's engine only where extract runs next in this process (`eyas run`, offline training)
        self.shared = cfg.extract.backend == "vllm" and vllm_engine.chained() and cfg.train.mode == "offline" \
            and cfg.stop_after not in ("regenerate", "prepare")
        cpu = current_platform.is_cpu()
        self.kwargs, self.scratch, proxy = engine_for(cfg, cpu, self.shared)
        # bytes the connector writes per prompt token (aux layers + the last, hidden size, the engine's dtype)
        conf = load_config(cfg.target)
        ids = self.kwargs.get("speculative_config", {}).get("draft_model_config", {}).get("hf_config", {}) \
            .get("eagle_aux_hidden_state_layer_ids", [])
        self.state_bytes = len(ids) * int(conf.hidden_size) * (4 if self.kwargs["dtype"] == "float32" else 2)
        if cpu:
            vllm_engine.bind_cpu_threads(int(self.kwargs["tensor_parallel_size"])
                                         * int(self.kwargs["pipeline_parallel_size"]), "regenerate")
        taken = vllm_engine.take(self.kwargs)
        if taken is not None:
            self.llm = taken[0]
        else:
            from eyas.extract.vllm_backend import start_engine, vllm_version

            print(f"[eyas:regenerate] vLLM {vllm_version()}: starting the engine (TP "
                  f"{self.kwargs['tensor_parallel_size']}, {self.kwargs['dtype']}, max_model_len "
                  f"{self.kwargs['max_model_len']}{', with extraction' if self.shared else ''})", flush=True)
            self.llm = start_engine(cfg, self.kwargs)
        self.note = {"made_by": "regenerate", "proxy": proxy}
        self._sent = 0

    def generate(self, prompts_ids: list[list[int]], sampling: Sampling | None = None) -> list[Answer]:
        """Continuations of the token prompts; `sampling` defaults to the answers' settings."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        s = sampling or self.answers
        params = []
        for _ in prompts_ids:  # a seed per request: sampled answers repeat whatever the batching
            params.append(SamplingParams(max_tokens=s.max_new_tokens, temperature=s.temperature,
                                         top_p=s.top_p if s.temperature > 0 else 1.0, stop_token_ids=list(self.eos),
                                         seed=self.seed + self._sent, detokenize=False))
            self._sent += 1
        outs = []
        for group in self._groups(prompts_ids):
            try:
                got = self.llm.generate([TokensPrompt(prompt_token_ids=list(prompts_ids[i])) for i in group],
                                        [params[i] for i in group], use_tqdm=False)
            except Exception as e:  # the engine's own traceback is in vLLM's log; this names the stage and batch
                raise EyasError(f"regenerate: the vLLM engine failed on a batch of {len(group)} prompts: "
                                f"{type(e).__name__}: {exception_message(e)} (vLLM's log above)") from e
            for out in got:
                self._drop_states(out)
            outs += got
        answers = []
        for prompt, out in zip(prompts_ids, outs):
            o = out.outputs[0]
            ids = list(o.token_ids)
            reason = "stop" if o.finish_reason == "stop" else "length"
            if sampling is not None and sampling is not self.answers:
                answers.append(Answer(self.tok.decode(ids, skip_special_tokens=True).strip(), len(ids), reason))
                continue
            answers.append(thinking_answer(decode_keeping(self.tok, ids, self.think_ids), len(ids), reason,
                                           opens_thinking(self.tok, list(prompt))))
        return answers

    def _groups(self, prompts_ids: list[list[int]]) -> list[list[int]]:
        """The prompts in groups handed to the engine at once: all of them, or, on extract's engine,
        as many as keep the prompt states its connector writes meanwhile under SCRATCH_BYTES."""
        if not self.shared:
            return [list(range(len(prompts_ids)))]
        groups, used = [[]], 0
        for i, p in enumerate(prompts_ids):
            size = len(p) * self.state_bytes
            if groups[-1] and used + size > SCRATCH_BYTES:
                groups.append([])
                used = 0
            groups[-1].append(i)
            used += size
        return groups

    def _drop_states(self, out) -> None:
        """The prompt states the extraction connector wrote for a request (shared engine): not needed here."""
        from eyas.extract.vllm_backend import discard_request

        path = (getattr(out, "kv_transfer_params", None) or {}).get("hidden_states_path")
        if path:
            discard_request(path)

    def close(self, failed: bool = False) -> None:
        """Park the engine for extract when `eyas run` runs it next in this process, else (or after a
        failure) shut it down."""
        from eyas import vllm_engine

        llm, self.llm = self.llm, None
        if llm is None:
            return
        if self.shared and not failed:
            vllm_engine.park(llm, self.kwargs, self.note)
        else:
            vllm_engine.shutdown(llm)
        if self.scratch is not None:
            shutil.rmtree(self.scratch, ignore_errors=True)


SCRATCH_BYTES = 16 * 10**9
"""On extract's engine: the most prompt-state bytes (in the scratch directory) one generate call may
leave before they are deleted (DeepSeek-V3: ~57 KB per token, so ~280,000 prompt tokens at once)."""


def engine_for(cfg: EyasConfig, cpu: bool, shared: bool):
    """-> (engine arguments, scratch dir or None, the proxy check's record or None). Shared: extract's
    engine for this target, with room for the longest prompt and answer regenerate makes and for
    prepare's longest sample; else the same arguments without the hidden-states method."""
    from eyas.capture import check_layer_ids, default_layer_ids
    from eyas.extract import Setup, store_dtype, vllm_proxy
    from eyas.extract.vllm_backend import engine_kwargs, make_vllm_backend, scratch_dir
    from eyas.target import load_hf_config, resolve_dtype

    ec, rc = cfg.extract, cfg.regenerate
    conf = load_config(cfg.target)
    num_layers = int(conf.num_hidden_layers)
    layer_ids = check_layer_ids(ec.layer_ids or default_layer_ids(num_layers), num_layers)
    dtype = resolve_dtype(cfg.target.dtype)
    # extract's engine holds prepare's longest sample + 1 (or extract.vllm_max_model_len): at least that
    need = max(rc.max_prompt_tokens + rc.max_new_tokens, ec.vllm_max_model_len or cfg.prepare.max_length + 1)
    out = cfg.stage_dir("extract")
    proxy = None
    if shared and vllm_proxy.wanted(ec):  # before the target's own load, as extract would
        stored = store_dtype(ec.store_dtype, dtype)
        setup = Setup(out, None, layer_ids, num_layers, int(conf.hidden_size), dtype, stored, {}, [], [], [])
        proxy = vllm_proxy.check_proxy(cfg, setup, make_vllm_backend)
    scratch = scratch_dir(cfg, out) if shared else None
    kw = engine_kwargs(cfg, layer_ids, num_layers, need, dtype, scratch or out, cpu=cpu,
                       hf_config=load_hf_config(cfg.target).to_dict())
    if not shared:
        kw.pop("speculative_config")
        kw.pop("kv_transfer_config")
    return kw, scratch, proxy


def generation_eos(path: str):
    """generation_config.json's eos_token_id (None without the file)."""
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(path).eos_token_id
    except OSError:  # no generation_config.json: the tokenizer's eos alone
        return None
