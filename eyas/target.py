"""Loading the target's tokenizer, config and model from a TargetConfig (no per-architecture code)."""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eyas.assets import resolve_model
from eyas.config.target import TargetConfig
from eyas.errors import ArtifactError, ConfigError, EyasError, exception_message


def looks_local(name: str) -> bool:
    """Whether target.model names a local path rather than a hub id (`namespace/name`: one slash)."""
    return name.startswith(("/", "./", "../", "~")) or name in (".", "..") or name.count("/") > 1 \
        or (os.sep != "/" and os.sep in name)


def model_path(cfg: TargetConfig) -> str:
    """The target's directory (embedded models resolved, `~` expanded) or its hub id; a local path
    that does not exist is a ConfigError saying so (transformers would take it for a malformed hub id)."""
    path = resolve_model(cfg.model)
    if looks_local(path):
        path = os.path.expanduser(path)
        if not Path(path).is_dir():
            what = "not a directory" if Path(path).exists() else "no such directory"
            raise ConfigError(f"target.model={cfg.model!r}: {what} (give a local HF model directory, a hub id "
                              "namespace/name, or embedded:smollm2)")
    return path


def _hf_kwargs(cfg: TargetConfig) -> dict[str, Any]:
    kw: dict[str, Any] = {"trust_remote_code": cfg.trust_remote_code}
    if cfg.revision:
        kw["revision"] = cfg.revision
    return kw


def load_tokenizer(cfg: TargetConfig, require_chat_template: bool = True):
    """The target tokenizer (fast, or a slow byte-level BPE such as Kimi's tiktoken one), with the chat
    template override applied."""
    from transformers import AutoTokenizer

    path = model_path(cfg)
    try:
        tok = AutoTokenizer.from_pretrained(path, **_hf_kwargs(cfg))
    except OSError as e:
        raise EyasError(f"cannot load the tokenizer of target.model={cfg.model!r} ({path}): {e}") from e
    except ValueError as e:
        if "trust_remote_code" not in str(e) or cfg.trust_remote_code:
            raise
        raise ConfigError(f"the tokenizer of target.model={cfg.model!r} ({path}) is code shipped with the model "
                          "(tokenizer_config.json's auto_map): read that code, then pass "
                          "--target.trust_remote_code=true to run it") from e
    except ImportError as e:  # remote tokenizer code needing a package (e.g. Kimi's needs tiktoken)
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
    return tok


def tokenizer_hash(tok) -> str:
    """Hash of the tokenizer's vocabulary, added tokens and chat template (and, for a slow tokenizer
    shipped as code with the model, of that code: its pre-tokenisation lives there)."""
    h = hashlib.sha256()
    if tok.is_fast:
        h.update(tok.backend_tokenizer.to_str().encode())
    else:
        h.update(type(tok).__qualname__.encode())
        h.update(json.dumps(sorted(tok.get_vocab().items()), ensure_ascii=False).encode())
        added = sorted((int(i), t.content, bool(t.special)) for i, t in tok.added_tokens_decoder.items())
        h.update(json.dumps(added, ensure_ascii=False).encode())
        if type(tok).__module__.startswith("transformers_modules"):
            h.update(Path(inspect.getfile(type(tok))).read_bytes())
    h.update((tok.chat_template or "").encode())
    return h.hexdigest()


def load_hf_config(cfg: TargetConfig, trust_remote_code: bool | None = None):
    """The target's config as its config.json describes it: a multimodal wrapper's own config (its
    text config nested inside). `trust_remote_code` overrides target.trust_remote_code."""
    from transformers import AutoConfig

    path = model_path(cfg)
    kw = _hf_kwargs(cfg)
    if trust_remote_code is not None:
        kw["trust_remote_code"] = trust_remote_code
    try:
        return AutoConfig.from_pretrained(path, **kw)
    except OSError as e:
        raise EyasError(f"cannot load the config of target.model={cfg.model!r} ({path}): {e}") from e


def load_config(cfg: TargetConfig):
    """The target's text config (no weights): a multimodal wrapper's nested text config."""
    conf = load_hf_config(cfg)
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
    check_weight_files(cfg)
    text = text_model(cfg)
    if text.config is not None:  # the text model alone, its tensors read from under the wrapper's prefix
        kw.update(config=text.config, output_loading_info=True, trust_remote_code=False)
        if text.prefix:
            kw["key_mapping"] = {f"^{re.escape(text.prefix)}": ""}
    try:
        # transformers >= 4.56 takes `dtype=` (`torch_dtype=` is its deprecated alias)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kw)
    except OSError as e:
        raise EyasError(f"cannot load the weights of target.model={cfg.model!r} ({path}): {e}") from e
    if text.config is not None:
        model, info = model
        if info["missing_keys"]:
            missing = sorted(info["missing_keys"])
            raise EyasError(f"target.model={cfg.model!r} is a {text.wrapper} wrapper; its text model "
                            f"({type(model).__name__}) found no tensor in the checkpoint for {missing[:6]}"
                            f"{' ...' if len(missing) > 6 else ''} ({len(missing)} in all) under the prefix "
                            f"{text.prefix!r}")
    if not device_map:
        model.to(device)
    model.eval()
    model.requires_grad_(False)
    return model


def check_weight_files(cfg: TargetConfig) -> None:
    """Every safetensors file of a local target directory, its header read and its size checked against
    the header: a file cut short (an interrupted download or copy) or with a damaged header is an
    ArtifactError naming it and what to do, where safetensors says only "Error while deserializing
    header" of no file. Headers only: a second per hundred shards. (A flipped bit in the tensors'
    bytes is not seen: the checkpoint carries no checksum.)"""
    path = Path(model_path(cfg))
    if not path.is_dir():
        return
    for file in sorted(path.glob("*.safetensors")):
        why = safetensors_damage(file)
        if why:
            raise ArtifactError(f"{file}: a weight file of target.model={cfg.model!r} is damaged ({why}); copy or "
                                "download it again (a hub model: remove it from the cache and run `hf download` "
                                "for it), then run the same command again")


def safetensors_damage(file: Path) -> str:
    """What is wrong with a safetensors file's layout, in words ("" when its header parses and the file
    is as long as the header says)."""
    size = file.stat().st_size
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return f"{size} bytes: shorter than a safetensors header"
        n = int.from_bytes(head, "little")
        if n > min(size - 8, 100_000_000):
            return f"its header claims {n:,} bytes of a {size:,}-byte file"
        try:
            header = json.loads(f.read(n))
            end = max((int(t["data_offsets"][1]) for k, t in header.items() if k != "__metadata__"), default=0)
        except (ValueError, TypeError, KeyError, IndexError, AttributeError) as e:
            return f"its header is not valid JSON metadata: {exception_message(e)}"
    if size != 8 + n + end:
        return f"{size:,} bytes where its header says {8 + n + end:,}: {'cut short' if size < 8 + n + end else 'too long'}"
    return ""


# ---------------------------------------------------------------- the checkpoint's tensors, by name


def checkpoint_file(cfg: TargetConfig, name: str) -> Path | None:
    """A file of the target checkpoint (local directory or hub id), None when it has none."""
    path = model_path(cfg)
    local = Path(path)
    if local.is_dir():
        return local / name if (local / name).is_file() else None
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError

    try:
        return Path(hf_hub_download(path, name, revision=cfg.revision or None))
    except EntryNotFoundError:
        return None


def weight_map(cfg: TargetConfig) -> dict[str, str] | None:
    """Checkpoint tensor name -> safetensors file name (`model.safetensors.index.json`'s weight_map,
    or every key of a single `model.safetensors`); None when the checkpoint is not safetensors."""
    index = checkpoint_file(cfg, "model.safetensors.index.json")
    if index is not None:
        return json.loads(index.read_text())["weight_map"]
    single = checkpoint_file(cfg, "model.safetensors")
    if single is None:
        return None
    from safetensors import safe_open

    with safe_open(str(single), "pt") as f:
        keys = f.keys()
    return dict.fromkeys(keys, "model.safetensors")


def read_tensors(cfg: TargetConfig, files: dict[str, str], keys: list[str]) -> dict[str, Any]:
    """The checkpoint tensors `keys` (names in `files`, a `weight_map`), as stored, on CPU."""
    from safetensors import safe_open

    out: dict[str, Any] = {}
    for name in sorted({files[k] for k in keys}):
        with safe_open(str(checkpoint_file(cfg, name)), "pt") as f:
            out.update({k: f.get_tensor(k) for k in keys if files[k] == name})
    return out


# ---------------------------------------------------------------- multimodal wrappers


@dataclass(frozen=True)
class TextModel:
    """What eyas runs of the target. `config` None: the checkpoint as AutoModelForCausalLM loads it.
    Else the causal LM transformers builds from `config`, its tensors under `prefix` in the checkpoint:
    for a multimodal wrapper (`wrapper`: its model_type, e.g. Kimi-K2.5's `kimi_k25`) the nested text
    model alone (prompts are token ids without media: the vision tower never runs, its weights are
    never read). `looked_for`: the text model's tensor names searched for under any prefix when none
    held them all (the wrapper then runs only through transformers' class for it, if it has one)."""

    config: Any = None
    prefix: str = ""
    wrapper: str = ""
    looked_for: tuple[str, ...] = ()

    def missing(self) -> str:
        """Why a wrapper has no text model here (for error messages)."""
        if self.looked_for:
            return (f"no one prefix in its safetensors index holds all of {list(self.looked_for)} (the text model's "
                    "input embedding, final norm and LM head as transformers names them)")
        return "transformers builds no causal LM from its text_config (or the checkpoint is not safetensors)"


def meta_model(config, trust_remote_code: bool = False):
    """The causal LM of `config` on the meta device (no memory, no weights): its module names."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)


def param_name(model, module) -> str | None:
    weight = getattr(module, "weight", None) if module is not None else None
    return next((n for n, p in model.named_parameters(remove_duplicate=False) if p is weight), None) if weight is not None else None


def target_meta_model(cfg: TargetConfig, text: TextModel, what: str):
    """The causal LM eyas runs for the target (`text`: `text_model(cfg)`) on the meta device; for a
    wrapper without a text model here that transformers cannot build either, an EyasError saying why,
    naming `what` eyas reads of it."""
    if text.config is not None:
        return meta_model(text.config)
    try:
        return meta_model(load_hf_config(cfg), trust_remote_code=cfg.trust_remote_code)
    except ValueError as e:
        if not text.wrapper:
            raise
        raise EyasError(f"target.model={cfg.model!r} is a {text.wrapper} wrapper (config.json nests a text_config) "
                        f"and eyas reads {what} by name: {text.missing()}; transformers has no causal LM for the "
                        f"wrapper either ({exception_message(e).splitlines()[0]})") from e


def text_tensor_names(model) -> dict[str, str | None]:
    """{"embed", "norm", "head"} -> the parameter names of a causal LM's input embedding, final norm
    weight and LM head (None for a head tied to the embedding)."""
    from eyas.capture import find_final_norm

    norm = find_final_norm(model)
    tied = bool(getattr(model.config.get_text_config(), "tie_word_embeddings", False))
    return {"embed": param_name(model, model.get_input_embeddings()), "norm": param_name(model, norm),
            "head": None if tied else param_name(model, model.get_output_embeddings())}


def find_prefix(keys, names: list[str]) -> str | None:
    """The one prefix under which a checkpoint with tensors `keys` holds every one of `names` ('' when
    they are there as they are), None when there is none."""
    keys = set(keys)
    first = names[0]
    prefixes = {k[: len(k) - len(first)] for k in keys if k.endswith(first)}
    found = sorted(p for p in prefixes if (p == "" or p.endswith(".")) and all(p + n in keys for n in names))
    return found[0] if len(found) == 1 else None


def text_model(cfg: TargetConfig) -> TextModel:
    """How eyas runs the target. A checkpoint whose config.json nests a `text_config` that transformers
    builds as a causal LM, with that model's tensors under one prefix (Kimi-K2.5: `language_model.`,
    found by name in the safetensors index), is run as that text model; any other checkpoint as
    AutoModelForCausalLM loads it."""
    config_json = checkpoint_file(cfg, "config.json")
    raw = json.loads(config_json.read_text()) if config_json is not None else {}
    if not isinstance(raw.get("text_config"), dict):
        return TextModel()
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    wrapper = str(raw.get("model_type") or raw.get("architectures") or "multimodal")
    try:  # transformers' own class for the wrapper's config, whatever target.trust_remote_code says
        text = load_hf_config(cfg, trust_remote_code=False).get_text_config()
    except (ValueError, KeyError, EyasError):
        return TextModel(wrapper=wrapper)  # a config only remote code reads
    files = weight_map(cfg)
    # transformers 5.19 reads the hub's `kimi_k2` text config as a DeepseekV3Config whose instance keeps
    # model_type "kimi_k2": its class's own, or from_pretrained finds no key conversions (fused experts) for it
    text.model_type = type(text).model_type
    if text.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or files is None:
        return TextModel(wrapper=wrapper)
    names = [n for n in text_tensor_names(meta_model(text)).values() if n]
    prefix = find_prefix(files, names)
    if prefix is None:
        return TextModel(wrapper=wrapper, looked_for=tuple(names))
    return TextModel(text, prefix, wrapper)
