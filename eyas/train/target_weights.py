"""The two target tensors the draft trainer needs: the input embedding and the LM head.

    embed_VD, lm_head_VD = load_embed_and_head(cfg.target)

Without loading the model where possible: the module names come from the architecture built on
the meta device (`get_input_embeddings()` / `get_output_embeddings()`, no per-family table), the
tensors are read from the safetensors file that holds them (through `model.safetensors.index.json`
for sharded checkpoints). Tied embeddings (`tie_word_embeddings`, or no LM-head tensor in the
checkpoint) give the same tensor twice. Anything else (no safetensors, renamed keys) falls back
to loading the whole model on CPU.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from eyas.config.target import TargetConfig
from eyas.target import model_path


def _param_name(model: torch.nn.Module, module: torch.nn.Module | None) -> str | None:
    if module is None or getattr(module, "weight", None) is None:
        return None
    for name, p in model.named_parameters(remove_duplicate=False):
        if p is module.weight:
            return name
    return None


def _weight_files(path: Path) -> dict[str, Path] | None:
    """checkpoint key -> safetensors file, or None when the checkpoint is not safetensors."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return {k: path / f for k, f in json.loads(index.read_text())["weight_map"].items()}
    single = path / "model.safetensors"
    if single.is_file():
        from safetensors import safe_open

        with safe_open(str(single), framework="pt") as f:
            return {k: single for k in f.keys()}
    return None


def _meta_model(cfg: TargetConfig):
    from transformers import AutoConfig, AutoModelForCausalLM

    kw = {"trust_remote_code": cfg.trust_remote_code}
    if cfg.revision:
        kw["revision"] = cfg.revision
    conf = AutoConfig.from_pretrained(model_path(cfg), **kw)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(conf, trust_remote_code=cfg.trust_remote_code)
    return conf, model


def _tied(conf) -> bool:
    text = conf.get_text_config() if hasattr(conf, "get_text_config") else conf
    return bool(getattr(conf, "tie_word_embeddings", False) or getattr(text, "tie_word_embeddings", False))


def load_embed_and_head(cfg: TargetConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (embed_VD, lm_head_VD) in the checkpoint's dtype, on CPU."""
    path = Path(model_path(cfg))
    files = _weight_files(path) if path.is_dir() else None
    if files is not None:
        conf, meta = _meta_model(cfg)
        emb_key = _param_name(meta, meta.get_input_embeddings())
        head_key = _param_name(meta, meta.get_output_embeddings())
        if emb_key in files:
            from safetensors import safe_open

            def read(key: str) -> torch.Tensor:
                with safe_open(str(files[key]), framework="pt") as f:
                    return f.get_tensor(key)

            embed = read(emb_key)
            if _tied(conf) or head_key is None or head_key not in files:
                return embed, embed
            return embed, read(head_key)
    return _from_full_model(cfg)


def _from_full_model(cfg: TargetConfig) -> tuple[torch.Tensor, torch.Tensor]:
    from eyas.target import load_model

    model = load_model(cfg, device="cpu")
    embed = model.get_input_embeddings().weight.detach()
    out = model.get_output_embeddings()
    head = out.weight.detach() if out is not None else embed
    return embed, head
