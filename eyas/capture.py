"""Capture a target's hidden states with forward hooks, for any Hugging Face decoder-only LM.

    with HiddenStateCapture(model, layer_ids=[2, 15, 27]) as cap:
        model.model(input_ids=ids_BS, use_cache=False)      # or model(...), with a KV cache, ...
    aux_BSKD, final_BSD = cap.result()

    aux_BSKD, final_BSD = capture(model, ids_BS, layer_ids=[2, 15, 27])  # the same, no grad

Semantics (the EAGLE-3 reference and vLLM use the same convention):

* **Aux layer id k** is the hidden state *entering* decoder layer k, i.e. HF's
  `output_hidden_states[k]`: id 0 is the embedding output (after any embedding scale such as
  Gemma's sqrt(D)), id k >= 1 is the output of layer k-1. Valid ids are 0..L-1 for L layers.
  It is captured with a forward *pre*-hook on layer k (its first positional argument, or the
  `hidden_states` keyword), so nothing depends on what a layer returns (tensor or tuple).
* **Final** is the output of the model's final norm, what the LM head sees. It is captured with a
  forward hook on that norm module. In transformers 4.56-5.x, HF's `output_hidden_states[L]` is
  this same post-norm state for Llama, Qwen2/3, Mistral, Gemma/Gemma2 and DeepSeek-V3 (5.x ties
  `hidden_states[-1]` to `last_hidden_state`; 4.x appends after the norm): tests/test_capture.py
  checks both that and `final == norm(output of the last layer)` per architecture.

No per-architecture code: the decoder layers are the `nn.ModuleList` whose length is the config's
`num_hidden_layers` (the outermost one; `get_decoder().layers` first when it fits), the final norm
is the norm-like direct child of the module that owns that list. Hooks see only the tokens of the
current call, so with a KV cache (`past_key_values=...`) the result covers the new tokens only.
Calling the module that owns the layers (`base_model(model)`) instead of the LM head skips the
V-wide logits; the final norm output is still captured.

Shapes: B batch, S sequence, K aux layers, D hidden size.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from eyas.errors import ConfigError, EyasError

FINAL_NORM_NAMES = ("norm", "final_layernorm", "final_layer_norm", "ln_f", "final_norm", "norm_f")


def text_config(model: nn.Module):
    conf = model.config
    return conf.get_text_config() if hasattr(conf, "get_text_config") else conf


def num_layers(model: nn.Module) -> int:
    return int(text_config(model).num_hidden_layers)


def default_layer_ids(num_layers: int) -> list[int]:
    """[2, L//2, L-3], the EAGLE-3 reference choice and vLLM's default (Llama-3.1-8B: 2, 16, 29;
    SmolLM2-135M: 2, 15, 27). Targets with fewer than 8 layers (test models) would repeat an id
    there, so they get three distinct ids spread over [1, L-1] instead: write them into the draft
    config (eyas export always does), since the engines' default would differ."""
    ids = [2, num_layers // 2, num_layers - 3]
    if ids == sorted(set(ids)) and min(ids) >= 0:
        return ids
    if num_layers < 3:
        raise ConfigError(f"a target with {num_layers} layers has no 3 distinct aux layers; set --extract.layer_ids")
    return [1, num_layers // 2, num_layers - 1] if num_layers >= 4 else [0, 1, 2]


def check_layer_ids(layer_ids: list[int], num_layers: int) -> list[int]:
    bad = [k for k in layer_ids if not 0 <= k < num_layers]
    if bad or not layer_ids:
        raise ConfigError(
            f"extract.layer_ids={list(layer_ids)}: ids must lie in [0, {num_layers - 1}] for a target with "
            f"{num_layers} layers (id k = the hidden state entering layer k; the final-norm state is always stored)"
        )
    if list(layer_ids) != sorted(set(layer_ids)):
        # vLLM and SGLang collect the aux states while walking the layers, so the draft's fc always
        # sees them in ascending layer order whatever order the config lists: train in that order
        raise ConfigError(
            f"extract.layer_ids={list(layer_ids)}: list the ids in ascending order without repeats "
            f"({sorted(set(layer_ids))}); serving engines feed the draft its aux states in layer order"
        )
    return list(layer_ids)


def _layer_lists(model: nn.Module, n: int) -> list[tuple[str, nn.ModuleList]]:
    return [(name, m) for name, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m) == n]


def find_decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The model's list of decoder layers (`get_decoder().layers` when it fits, else the outermost
    ModuleList with `num_hidden_layers` entries)."""
    n = num_layers(model)
    get_decoder = getattr(model, "get_decoder", None)
    if callable(get_decoder):
        try:
            layers = getattr(get_decoder(), "layers", None)
        except (AttributeError, ValueError, NotImplementedError):
            layers = None
        if isinstance(layers, nn.ModuleList) and len(layers) == n:
            return layers
    found = _layer_lists(model, n)
    if not found:
        raise EyasError(
            f"{type(model).__name__}: no nn.ModuleList of {n} (= num_hidden_layers) modules found; "
            "eyas cannot locate the decoder layers of this architecture"
        )
    # outermost first; among equals, the one holding the most parameters (not e.g. an experts list)
    found.sort(key=lambda nm: (nm[0].count("."), -sum(p.numel() for p in nm[1].parameters())))
    return found[0][1]


def _owner(model: nn.Module, child: nn.Module) -> tuple[nn.Module, str]:
    for parent in model.modules():
        for name, m in parent.named_children():
            if m is child:
                return parent, name
    raise EyasError(f"{type(model).__name__}: the decoder layer list is not part of the model")


def base_model(model: nn.Module) -> nn.Module:
    """The module that owns the decoder layers (e.g. `model.model`): calling it skips the LM head."""
    owner, _ = _owner(model, find_decoder_layers(model))
    params = inspect.signature(owner.forward).parameters
    return owner if "input_ids" in params else model


def find_final_norm(model: nn.Module) -> nn.Module:
    """The norm applied after the last decoder layer: the norm-like sibling of the layer list."""
    layers = find_decoder_layers(model)
    owner, layers_name = _owner(model, layers)
    cands = [
        (name, m)
        for name, m in owner.named_children()
        if name != layers_name and ("norm" in name.lower() or "norm" in type(m).__name__.lower() or name == "ln_f")
    ]
    if len(cands) > 1:
        named = [c for c in cands if c[0] in FINAL_NORM_NAMES]
        cands = named if len(named) == 1 else cands
    if len(cands) != 1:
        raise EyasError(
            f"{type(model).__name__}: cannot tell the final norm among the children of {type(owner).__name__} "
            f"({[c[0] for c in cands] or 'none is norm-like'})"
        )
    return cands[0][1]


class HiddenStateCapture:
    """Context manager: forward pre-hooks on the aux layers and a forward hook on the final norm.

    Each forward call made inside overwrites the captured states; `result()` returns those of the
    last call. Hooks are removed on exit, also when the body raises.
    """

    def __init__(self, model: nn.Module, layer_ids: list[int] | None = None):
        self.model = model
        self.layers = find_decoder_layers(model)
        self.norm = find_final_norm(model)
        n = len(self.layers)
        self.layer_ids = check_layer_ids(list(layer_ids) if layer_ids else default_layer_ids(n), n)
        self._aux: dict[int, torch.Tensor] = {}
        self._final: torch.Tensor | None = None
        self._handles: list[Any] = []

    def _pre_hook(self, k: int):
        def hook(module, args, kwargs):
            self._aux[k] = args[0] if args else kwargs["hidden_states"]

        return hook

    def _norm_hook(self, module, args, output):
        self._final = output[0] if isinstance(output, tuple) else output

    def __enter__(self) -> "HiddenStateCapture":
        self.clear()
        try:
            for k in sorted(set(self.layer_ids)):
                self._handles.append(self.layers[k].register_forward_pre_hook(self._pre_hook(k), with_kwargs=True))
            self._handles.append(self.norm.register_forward_hook(self._norm_hook))
        except BaseException:
            self.remove()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def clear(self) -> None:
        self._aux, self._final = {}, None

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (aux_BSKD in layer-id order, final_BSD), on the device of the final state."""
        missing = [k for k in self.layer_ids if k not in self._aux]
        if missing or self._final is None:
            raise EyasError(
                f"no hidden states captured for layers {missing}{' and the final norm' if self._final is None else ''}: "
                "run a forward pass inside the `with HiddenStateCapture(...)` block"
            )
        final_BSD = self._final
        aux_BSKD = torch.stack([self._aux[k].to(final_BSD.device) for k in self.layer_ids], dim=2)
        return aux_BSKD, final_BSD

    def states(self) -> torch.Tensor:
        """-> states_BSKD with K+1 entries on the layer axis: the aux states, then the final one
        (one stack, no second copy; what the extract stage stores)."""
        final_BSD = self._final
        if final_BSD is None or any(k not in self._aux for k in self.layer_ids):
            self.result()  # raises naming what is missing
        return torch.stack([self._aux[k].to(final_BSD.device) for k in self.layer_ids] + [final_BSD], dim=2)


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor (token ids, positions) onto the target's device; on CUDA through pinned memory
    with non_blocking, so the copy is queued instead of waiting for the GPU's stream."""
    if device.type == "cuda":
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


@torch.no_grad()
def capture(
    model: nn.Module,
    input_ids_BS: torch.Tensor,
    attention_mask_BS: torch.Tensor | None = None,
    position_ids_BS: torch.Tensor | None = None,
    layer_ids: list[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One no-grad forward of the base model (no LM head, no KV cache) -> (aux_BSKD, final_BSD)."""
    kwargs: dict[str, Any] = {"input_ids": input_ids_BS, "use_cache": False}
    if attention_mask_BS is not None:
        kwargs["attention_mask"] = attention_mask_BS
    if position_ids_BS is not None:
        kwargs["position_ids"] = position_ids_BS
    with HiddenStateCapture(model, layer_ids) as cap:
        base_model(model)(**kwargs)
        return cap.result()
