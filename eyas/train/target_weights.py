"""The two target tensors the draft trainer needs: the input embedding and the LM head.

    embed_VD, lm_head_VD = load_embed_and_head(cfg.target)

Without loading the model where possible: the module names come from the architecture built on
the meta device (`get_input_embeddings()` / `get_output_embeddings()`, no per-family table), the
tensors are read from the safetensors file that holds them (through `model.safetensors.index.json`
for sharded checkpoints). Tied embeddings (`tie_word_embeddings`, or no LM-head tensor in the
checkpoint) give the same tensor twice. A multimodal wrapper (Kimi-K2.5: config.json nests the
text model's config as `text_config`, its tensors lie under `language_model.`) is read the same way
through its text model (eyas.target.text_model), and never loaded whole: when its text model's
tensors are not found by name, the error names those looked for. Anything else (no safetensors,
renamed keys) falls back to loading the whole model on CPU.
"""

from __future__ import annotations

import torch

from eyas import target as tgt
from eyas.config.target import TargetConfig


def _tied(conf) -> bool:
    text = conf.get_text_config() if hasattr(conf, "get_text_config") else conf
    return bool(getattr(conf, "tie_word_embeddings", False) or getattr(text, "tie_word_embeddings", False))


def load_embed_and_head(cfg: TargetConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (embed_VD, lm_head_VD) in the checkpoint's dtype, on CPU."""
    files = tgt.weight_map(cfg)
    text = tgt.text_model(cfg)
    if text.config is not None:  # a multimodal wrapper's text model
        names = tgt.text_tensor_names(tgt.meta_model(text.config))
        keys = {k: text.prefix + n for k, n in names.items() if n and k != "norm"}
        found = tgt.read_tensors(cfg, files, list(keys.values()))
        return found[keys["embed"]], found[keys.get("head", keys["embed"])]
    if files is not None:
        conf = tgt.load_hf_config(cfg)
        meta = tgt.target_meta_model(cfg, text, "its text model's embedding and LM head")
        emb_key = tgt.param_name(meta, meta.get_input_embeddings())
        if emb_key in files:
            head_key = None if _tied(conf) else tgt.param_name(meta, meta.get_output_embeddings())
            if head_key is None or head_key not in files:
                (embed,) = tgt.read_tensors(cfg, files, [emb_key]).values()
                return embed, embed
            found = tgt.read_tensors(cfg, files, [emb_key, head_key])
            return found[emb_key], found[head_key]
    return _from_full_model(cfg)


def _from_full_model(cfg: TargetConfig) -> tuple[torch.Tensor, torch.Tensor]:
    from eyas.target import load_model

    model = load_model(cfg, device="cpu")
    embed = model.get_input_embeddings().weight.detach()
    out = model.get_output_embeddings()
    head = out.weight.detach() if out is not None else embed
    return embed, head
