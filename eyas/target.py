"""Loading the target's tokenizer, config and model from a TargetConfig (no per-architecture code)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from eyas.assets import resolve_model
from eyas.config.target import TargetConfig
from eyas.errors import ConfigError, EyasError


def model_path(cfg: TargetConfig) -> str:
    return resolve_model(cfg.model)


def _hf_kwargs(cfg: TargetConfig) -> dict[str, Any]:
    kw: dict[str, Any] = {"trust_remote_code": cfg.trust_remote_code}
    if cfg.revision:
        kw["revision"] = cfg.revision
    return kw


def load_tokenizer(cfg: TargetConfig, require_chat_template: bool = True):
    """The target tokenizer (fast), with the chat template override applied."""
    from transformers import AutoTokenizer

    path = model_path(cfg)
    try:
        tok = AutoTokenizer.from_pretrained(path, **_hf_kwargs(cfg))
    except OSError as e:
        raise EyasError(f"cannot load the tokenizer of target.model={cfg.model!r} ({path}): {e}") from e
    if cfg.chat_template:
        p = Path(cfg.chat_template)
        if p.suffix == ".jinja" and not p.is_file():
            raise ConfigError(f"target.chat_template={cfg.chat_template!r}: no such file")
        tok.chat_template = p.read_text(encoding="utf-8") if p.is_file() else cfg.chat_template
    if require_chat_template and not tok.chat_template:
        raise ConfigError(
            f"the tokenizer of {cfg.model!r} has no chat template; pass one with "
            "--target.chat_template=path/to/template.jinja (or the template text itself)"
        )
    if not tok.is_fast:
        raise ConfigError(f"the tokenizer of {cfg.model!r} is not a fast (Rust) tokenizer: eyas needs its character "
                          "offsets to build the loss masks; give target.model a directory whose tokenizer.json "
                          "transformers loads as a fast tokenizer")
    return tok


def tokenizer_hash(tok) -> str:
    """Hash of the tokenizer's vocabulary, added tokens and chat template."""
    h = hashlib.sha256()
    h.update(tok.backend_tokenizer.to_str().encode())
    h.update((tok.chat_template or "").encode())
    return h.hexdigest()


def load_config(cfg: TargetConfig):
    """The target's text config (no weights)."""
    from transformers import AutoConfig

    path = model_path(cfg)
    try:
        conf = AutoConfig.from_pretrained(path, **_hf_kwargs(cfg))
    except OSError as e:
        raise EyasError(f"cannot load the config of target.model={cfg.model!r} ({path}): {e}") from e
    return conf.get_text_config() if hasattr(conf, "get_text_config") else conf


def target_vocab_size(cfg: TargetConfig) -> int:
    return int(load_config(cfg).vocab_size)


def describe_target(cfg: TargetConfig) -> dict[str, Any]:
    """What every meta.json records about the target."""
    path = model_path(cfg)
    info = {"model": cfg.model, "path": path, "revision": cfg.revision, "dtype": cfg.dtype}
    asset = Path(path) / "eyas-asset.json"
    if asset.is_file():
        info["asset"] = json.loads(asset.read_text())
    return info


def resolve_dtype(name: str, device: str | None = None):
    """`auto` -> bfloat16 on CUDA, float32 elsewhere; other names -> that torch dtype."""
    import torch

    if name == "auto":
        on_cuda = str(device or "").startswith("cuda") or (device is None and torch.cuda.is_available())
        return torch.bfloat16 if on_cuda else torch.float32
    return getattr(torch, name)


def load_model(cfg: TargetConfig, device=None, device_map=None, attn_implementation: str | None = None):
    """The target causal LM in eval mode, dtype per `cfg.dtype` (auto: bf16 on CUDA, fp32 on CPU).

    `device_map` (e.g. "auto") places the layers over the visible GPUs with accelerate; otherwise
    the whole model goes to `device` (default: cuda when available, else cpu).
    """
    import torch
    from transformers import AutoModelForCausalLM

    if device is None and not device_map:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = resolve_dtype(cfg.dtype, "cuda" if device_map and torch.cuda.is_available() else str(device))
    kw = _hf_kwargs(cfg)
    if attn_implementation:
        kw["attn_implementation"] = attn_implementation
    if device_map:
        kw["device_map"] = device_map
    path = model_path(cfg)
    try:
        # transformers >= 4.56 takes `dtype=` (`torch_dtype=` is its deprecated alias)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kw)
    except OSError as e:
        raise EyasError(f"cannot load the weights of target.model={cfg.model!r} ({path}): {e}") from e
    if not device_map:
        model.to(device)
    model.eval()
    model.requires_grad_(False)
    return model
