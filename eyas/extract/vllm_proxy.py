"""The vLLM backend's parity check on a proxy: for targets whose own float weights no host can hold.

The parity check compares vLLM's states with a transformers forward of the target on CPU; for a
1T-parameter target that reference does not fit, and `extract.vllm_parity=0` would leave vLLM
unchecked. Instead, before the target's engine loads, eyas builds a tiny random model of the same
architecture from the target's own config.json (`proxy_config`: the same class, attention type,
RoPE and YaRN settings, MoE routing and head sizes; few layers, small hidden and MLP widths, few
experts), runs it through the same vLLM path (the same engine arguments: tensor and expert
parallel, dtype, eyas's CPU settings), and compares it with transformers on every captured layer
and the final norm (`check_proxy`). A disagreement stops the run before the long load, naming the
proxy. What the proxy does not cover: the target's quantization (the proxy's weights are
unquantized), its trained weights, and anything in its forward that depends on sizes the proxy
shrinks.

    extract.vllm_proxy_parity = auto   # with extract.vllm_parity=0 (no direct reference), else skipped
                              = always | never
"""

from __future__ import annotations

import copy
import dataclasses
import json
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from eyas.errors import ConfigError, EyasError
from eyas.extract.plan import Batch

PROXY_DIR = "vllm-proxy"
MLA_KEY = "kv_lora_rank"


def _up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _without_remote_code(config: dict[str, Any]) -> dict[str, Any]:
    """`config` without its `auto_map` where transformers has the model type's own config class
    (Kimi-K2.5's checkpoint names Moonshot's code, which the proxy's directory does not hold)."""
    from transformers import CONFIG_MAPPING

    if "auto_map" in config and config.get("model_type") in CONFIG_MAPPING:
        return {k: v for k, v in config.items() if k != "auto_map"}
    return config


def proxy_config(config: dict[str, Any], tensor_parallel: int = 1, expert_parallel: bool = False) -> dict[str, Any]:
    """The target's config.json with small sizes: what a proxy of its architecture is built from.

    Kept: architectures, model_type, RoPE and its scaling, norms, activations, MoE routing
    (topk_method, scoring_func, groups), MLA's head sizes (vLLM's CPU MLA kernel takes only a
    576-wide latent), vocabulary. Shrunk: layers (for a MoE with dense first layers: one dense, two
    MoE), heads (2 x tensor_parallel), hidden and MLP widths, experts (two per group, a multiple of
    the expert-parallel size). Dropped: quantization_config, and auto_map where transformers has
    the model type's config class. A multimodal wrapper's config (a nested
    `text_config`) stays the wrapper, with its text config shrunk so."""
    config = _without_remote_code(config)
    if isinstance(config.get("text_config"), dict):  # a multimodal wrapper (Kimi-K2.5): the same wrapper, its text
        c = copy.deepcopy(config)                      # config shrunk; vLLM runs it without its vision tower
        c.pop("quantization_config", None)
        c["text_config"] = proxy_config(config["text_config"], tensor_parallel, expert_parallel)
        return c
    c = copy.deepcopy(config)
    c.pop("quantization_config", None)
    heads = 2 * tensor_parallel
    moe = "n_routed_experts" in c or "num_experts" in c or "num_local_experts" in c
    if "first_k_dense_replace" in c:
        c["first_k_dense_replace"] = min(int(c["first_k_dense_replace"]), 1)
        layers = c["first_k_dense_replace"] + 2
    else:
        layers = 3
    c["num_hidden_layers"] = min(int(c["num_hidden_layers"]), layers)
    if MLA_KEY in c:  # MLA: head sizes as the target's, any hidden width
        c.update(num_attention_heads=heads, num_key_value_heads=heads, hidden_size=256)
    else:
        head_dim = int(c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"])
        grouped = int(c.get("num_key_value_heads") or c["num_attention_heads"]) < int(c["num_attention_heads"])
        c.update(num_attention_heads=heads, num_key_value_heads=tensor_parallel if grouped else heads,
                 head_dim=head_dim, hidden_size=heads * head_dim)
    c["intermediate_size"] = _up(512, 64 * tensor_parallel)
    if moe:
        groups = int(c.get("n_group") or 1)
        experts = _up(max(2 * groups, 4), tensor_parallel if expert_parallel else 1)
        for key in ("n_routed_experts", "num_experts", "num_local_experts"):
            if key in c:
                c[key] = experts
        for key in ("moe_intermediate_size", "shared_expert_intermediate_size"):
            if key in c:
                c[key] = _up(256, 64 * tensor_parallel)
        per_token = "num_experts_per_tok"
        if per_token in c:
            c[per_token] = min(int(c[per_token]), 2 * int(c.get("topk_group") or groups), experts)
    return c


def text_part(config: dict[str, Any]) -> dict[str, Any]:
    """The config of the language model: a wrapper's nested text_config, else `config` itself."""
    return config["text_config"] if isinstance(config.get("text_config"), dict) else config


def build_proxy(config: dict[str, Any], out: Path, seed: int = 0, prefix: str = "") -> Path:
    """A random model of `config` saved as an HF directory in `out` (float32). Matrices are drawn from
    N(0, 0.05), routers' correction biases from N(0, 0.1) (at transformers' own 0.02 the layers
    barely change the residual stream and a wrong attention could pass); config.json is `config`
    itself, so vLLM and transformers read the target's own fields. A wrapper's (nested text_config)
    holds its text model only, its tensors under `prefix` as in the target (Kimi-K2.5: `language_model.`)."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    torch.manual_seed(seed)
    conf = AutoConfig.from_pretrained(str(out))
    wrapper = conf.get_text_config() is not conf
    if wrapper:
        conf = conf.get_text_config()
        conf.model_type = type(conf).model_type  # see eyas.target.text_model (transformers 5.19 and `kimi_k2`)
    model = AutoModelForCausalLM.from_config(conf, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "e_score_correction_bias" in name:
                p.normal_(0, 0.1)
            elif p.dim() >= 2:
                p.normal_(0, 0.05)
    model.save_pretrained(str(out), safe_serialization=True)
    if wrapper:  # the text model's tensors under the wrapper's prefix (no vision tower: vLLM runs without one)
        files = sorted(out.glob("*.safetensors"))
        assert [f.name for f in files] == ["model.safetensors"], files
        save_file({prefix + k: v for k, v in load_file(str(files[0])).items()}, str(files[0]), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def wanted(ec) -> bool:
    """Whether this run checks vLLM on a proxy (extract.vllm_proxy_parity)."""
    return ec.vllm_proxy_parity == "always" or (ec.vllm_proxy_parity == "auto" and ec.vllm_parity == 0)


def check_proxy(cfg, setup, make_backend) -> dict[str, Any]:
    """Build the proxy in the output directory, run it through `make_backend` (the vLLM backend's
    factory, with the run's engine arguments) on two random prompts, and compare with transformers;
    -> what was checked, for meta.json. ParityError (an EyasError) when vLLM disagrees."""
    from eyas.extract.backend import ParityError, check_parity, default_tolerance
    from eyas.target import model_path, text_model

    ec = cfg.extract
    source = Path(model_path(cfg.target)) / "config.json"
    if not source.is_file():
        raise ConfigError(f"extract.vllm_proxy_parity builds its proxy from the target's config.json; "
                          f"{source} is not a file (a hub id: download the checkpoint, or set "
                          "--extract.vllm_proxy_parity=never)")
    config = proxy_config(json.loads(source.read_text()), ec.vllm_tensor_parallel_size, ec.vllm_enable_expert_parallel)
    directory = build_proxy(config, setup.out / PROXY_DIR, prefix=text_model(cfg.target).prefix)
    text = text_part(config)
    layers = int(text["num_hidden_layers"])
    layer_ids = list(range(1, layers))
    proxy_cfg = copy.deepcopy(cfg)
    proxy_cfg.target.model, proxy_cfg.target.revision = str(directory), ""
    proxy_cfg.extract.vllm_parity = 2
    proxy_cfg.extract.vllm_max_model_len = 0
    g = torch.Generator().manual_seed(0)
    tokens = [torch.randint(0, int(text["vocab_size"]), (n,), generator=g) for n in (48, 29)]
    proxy_setup = dataclasses.replace(setup, layer_ids=layer_ids, num_layers=layers, hidden=int(text["hidden_size"]),
                                      prepared=SimpleNamespace(ids=["proxy-0", "proxy-1"]))
    print(f"[eyas:extract] vLLM checked on a proxy of the target first (extract.vllm_proxy_parity): "
          f"{config.get('architectures')}, {layers} layers, hidden {text['hidden_size']}, "
          f"{text['num_attention_heads']} heads" + (f", {text['n_routed_experts']} experts"
                                                    if "n_routed_experts" in text else "")
          + f"; {directory}", flush=True)
    backend = make_backend(proxy_cfg, proxy_setup, max(t.numel() for t in tokens))
    try:
        batch = Batch([0, 1], [t.numel() for t in tokens], 1, sum(t.numel() for t in tokens), True)
        states = backend.forward(batch, tokens)
        tol = ec.parity_tol or max(default_tolerance(setup.compute_dtype), default_tolerance(setup.store_dtype))
        checks, at = [], 0
        for name, t in zip(proxy_setup.prepared.ids, tokens):
            checks.append((name, states[at: at + t.numel()], t))
            at += t.numel()
        try:
            parity = check_parity(backend, checks, tol)
        except ParityError as e:
            raise EyasError(f"vLLM disagrees with transformers on a tiny random model of the target's architecture "
                            f"({directory}): {e}. The target's own run would store such states: it does not start") from e
    finally:
        backend.close()
        shutil.rmtree(directory, ignore_errors=True)  # its weights: the target's vocabulary x hidden, twice
    print(f"[eyas:extract] proxy parity: {len(parity.errors)} samples, max relative error {max(parity.errors):.2e}",
          flush=True)
    return {"dir": str(directory), "layers": layers, "hidden_size": text["hidden_size"],
            "samples": len(parity.errors), "max_relative_error": max(parity.errors)}
