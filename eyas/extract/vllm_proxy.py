"""The vLLM backend's parity check on a proxy: for targets whose own float weights no host can hold.

The parity check compares vLLM's states with a transformers forward of the target on CPU; for a
1T-parameter target that reference does not fit, and `extract.vllm_parity=0` would leave vLLM
unchecked. Instead, before the target's engine loads, eyas builds a tiny random model of the same
architecture from the target's own config.json (`proxy_config`: the same class, attention type,
RoPE and YaRN settings, MoE routing and head sizes; few layers, small hidden and MLP widths, few
experts), runs it through the same vLLM path (the same engine arguments: tensor and expert
parallel, dtype, eyas's CPU settings), and compares it with transformers on every captured layer
and the final norm (`check_proxy`). A disagreement stops the run before the long load, naming the
proxy.

The target's quantization goes into the proxy where eyas can write it: compressed-tensors
weight-only integer schemes (`pack-quantized`, symmetric, 4 or 8 bits, per group or per channel;
Kimi-K2.5 ships its routed experts so, INT4 in groups of 32). The proxy's Linear weights that the
target's `quantization_config` covers (its `targets`, less its `ignore`) are quantized and packed
as that config says, and vLLM loads them through its own kernels for that scheme; transformers, the
reference, runs the same weights dequantized (`quantize_proxy`). Where vLLM has no kernel for the
scheme on this machine the proxy's engine fails to start, as the target's would after its load.
Other methods (DeepSeek-V3's block fp8) leave the proxy unquantized, and the check says so. What
the proxy never covers: the target's trained weights, and anything in its forward that depends on
sizes the proxy shrinks.

In train.mode=stream the same proxy runs through one stream engine (eyas/stream/proxy.py: the
target's engine arguments, Mooncake connector and store) before the target's engines start, its
states fetched from Mooncake's store as the trainer's are; there `auto` follows train.stream.parity.

    extract.vllm_proxy_parity = auto   # with extract.vllm_parity=0 (train.mode=stream: train.stream.parity=0),
                                       # i.e. no direct reference; else skipped
                              = always | never
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import re
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from eyas.errors import ConfigError, EyasError
from eyas.extract.plan import Batch

PROXY_DIR = "vllm-proxy"
REFERENCE_DIR = "vllm-proxy-reference"
"""The quantized proxy's weights dequantized, in float: what transformers loads as its reference."""
MLA_KEY = "kv_lora_rank"
ROUTERS = (".gate", ".router")
"""Linear layers of MoE routers: unquantized in vLLM's MoE models whatever the checkpoint's config says."""


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
    the expert-parallel size). Kept where the proxy can be quantized so (`writable_quantization`),
    else dropped: quantization_config. Dropped: auto_map where transformers has the model type's
    config class. A multimodal wrapper's config (a nested `text_config`) stays the wrapper, with its
    text config shrunk so."""
    config = _without_remote_code(config)
    if isinstance(config.get("text_config"), dict):  # a multimodal wrapper (Kimi-K2.5): the same wrapper, its text
        c = copy.deepcopy(config)                      # config shrunk; vLLM runs it without its vision tower
        _keep_writable_quantization(c)
        c["text_config"] = proxy_config(config["text_config"], tensor_parallel, expert_parallel)
        return c
    c = copy.deepcopy(config)
    _keep_writable_quantization(c)
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
    # a quantized proxy: each rank's slice of an MLP's input a whole number of the target's groups
    unit = math.lcm(64, _group_size(c.get("quantization_config"))) * tensor_parallel
    c["intermediate_size"] = _up(512, unit)
    if moe:
        groups = int(c.get("n_group") or 1)
        experts = _up(max(2 * groups, 4), tensor_parallel if expert_parallel else 1)
        for key in ("n_routed_experts", "num_experts", "num_local_experts"):
            if key in c:
                c[key] = experts
        for key in ("moe_intermediate_size", "shared_expert_intermediate_size"):
            if key in c:
                c[key] = _up(256, unit)
        per_token = "num_experts_per_tok"
        if per_token in c:
            c[per_token] = min(int(c[per_token]), 2 * int(c.get("topk_group") or groups), experts)
    return c


def writable_quantization(qc: dict[str, Any] | None) -> str | None:
    """None when the proxy can be quantized as `qc` (a config.json's quantization_config) says, else why
    not. Written: compressed-tensors `pack-quantized`, weight-only, symmetric integers of 4 or 8 bits
    per group or per channel, on Linear layers."""
    if not qc:
        return "the target is not quantized"
    method, fmt = qc.get("quant_method"), qc.get("format")
    if method != "compressed-tensors" or fmt != "pack-quantized":
        return f"quant_method {method!r}" + (f", format {fmt!r}" if fmt else "") + " is not one the proxy writes"
    for name, group in (qc.get("config_groups") or {}).items():
        w = group.get("weights") or {}
        scheme = (f"{w.get('type')} {w.get('num_bits')}-bit, symmetric={w.get('symmetric')}, strategy "
                  f"{w.get('strategy')}, actorder {w.get('actorder')}")
        if (group.get("input_activations") or group.get("targets") != ["Linear"] or w.get("type") != "int"
                or w.get("num_bits") not in (4, 8) or w.get("symmetric") is not True or w.get("actorder")
                or w.get("strategy") not in ("group", "channel") or w.get("dynamic")):
            return f"config group {name!r} ({scheme}, targets {group.get('targets')}) is not one the proxy writes"
    return None if qc.get("config_groups") else "its quantization_config has no config_groups"


def _group_size(qc: dict[str, Any] | None) -> int:
    """The largest weight group of a quantization_config (1 when none or per channel)."""
    sizes = [(g.get("weights") or {}).get("group_size") for g in ((qc or {}).get("config_groups") or {}).values()]
    return max([int(n) for n in sizes if n and int(n) > 0] or [1])


def _keep_writable_quantization(c: dict[str, Any]) -> None:
    if writable_quantization(c.get("quantization_config")) is not None:
        c.pop("quantization_config", None)


def quantized_names(names: list[str], qc: dict[str, Any]) -> list[str]:
    """Of a checkpoint's 2-D weight names, those of the Linear layers `qc` quantizes: not embeddings
    or MoE routers, not in `qc["ignore"]` (an exact module name, a dotted suffix of one, or `re:` a
    regular expression matched from the start, as compressed-tensors matches)."""
    ignore = qc.get("ignore") or []

    def ignored(module: str) -> bool:
        return any(re.match(t[3:], module) if t.startswith("re:") else module == t or module.endswith("." + t)
                   for t in ignore)

    out = []
    for name in names:
        module = name.removesuffix(".weight")
        if (name.endswith(".weight") and "embed" not in module.rsplit(".", 1)[-1]
                and not module.endswith(ROUTERS) and not ignored(module)):
            out.append(name)
    return out


def pack_int(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Signed integers `q` [rows, cols] (in [-2^(bits-1), 2^(bits-1))) packed along the last dim into
    int32, 32/bits per word, the first value in the lowest bits, each offset by 2^(bits-1): the
    compressed-tensors `pack-quantized` layout."""
    per = 32 // bits
    rows, cols = q.shape
    assert cols % per == 0, (q.shape, bits)
    u = (q.to(torch.int64) + (1 << (bits - 1))).view(rows, cols // per, per)
    word = (u << (torch.arange(per, dtype=torch.int64) * bits)).sum(-1)
    return torch.where(word >= 1 << 31, word - (1 << 32), word).to(torch.int32)


def quantize_proxy(tensors: dict[str, torch.Tensor], qc: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(the checkpoint vLLM loads, the float checkpoint transformers loads): each weight of
    `quantized_names` becomes weight_packed (int32), weight_scale (bf16) and weight_shape, and in
    the reference its exact dequantized value (q x scale in float32). Scales are each group's
    largest |w| over the largest integer, so the values keep the proxy's magnitudes."""
    group = next(iter(qc["config_groups"].values()))["weights"]
    bits, size = int(group["num_bits"]), group.get("group_size")
    top = (1 << (bits - 1)) - 1
    chosen = set(quantized_names([k for k, v in tensors.items() if v.dim() == 2], qc))
    if not chosen:
        raise EyasError(f"the target's quantization_config ({qc.get('format')}, ignore {qc.get('ignore')}) quantizes "
                        "none of the proxy's weights; set --extract.vllm_proxy_parity=never if that is right")
    packed, reference = {}, {}
    for name, w in tensors.items():
        if name not in chosen:
            packed[name] = reference[name] = w
            continue
        rows, cols = w.shape
        g = cols if group["strategy"] == "channel" else int(size)
        if cols % g:
            raise EyasError(f"proxy weight {name} {tuple(w.shape)}: {cols} columns are not a multiple of the "
                            f"target's group size {g}")
        grouped = w.float().view(rows, cols // g, g)
        scale = (grouped.abs().amax(-1) / top).clamp_min(1e-8).to(torch.bfloat16)
        q = (grouped / scale.float()[..., None]).round().clamp(-top - 1, top).to(torch.int8)
        module = name.removesuffix(".weight")
        packed[module + ".weight_packed"] = pack_int(q.view(rows, cols), bits)
        packed[module + ".weight_scale"] = scale
        packed[module + ".weight_shape"] = torch.tensor([rows, cols], dtype=torch.int64)
        reference[name] = (q.float() * scale.float()[..., None]).view(rows, cols)
    return packed, reference


def text_part(config: dict[str, Any]) -> dict[str, Any]:
    """The config of the language model: a wrapper's nested text_config, else `config` itself."""
    return config["text_config"] if isinstance(config.get("text_config"), dict) else config


def build_proxy(config: dict[str, Any], out: Path, seed: int = 0, prefix: str = "") -> tuple[Path, Path]:
    """A random model of `config` saved as an HF directory in `out` (float32) -> (the directory vLLM
    loads, the one transformers loads): both `out` unless `config` is quantized (`quantize_proxy`;
    the float one is then the sibling REFERENCE_DIR). Matrices are drawn from N(0, 0.05), routers'
    correction biases from N(0, 0.1) (at transformers' own 0.02 the layers barely change the
    residual stream and a wrong attention could pass); config.json is `config` itself, so vLLM and
    transformers read the target's own fields. A wrapper's (nested text_config) holds its text model
    only, its tensors under `prefix` as in the target (Kimi-K2.5: `language_model.`)."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    qc = config.get("quantization_config") or text_part(config).get("quantization_config")
    plain = {k: v for k, v in config.items() if k != "quantization_config"}
    if isinstance(plain.get("text_config"), dict):
        plain["text_config"] = {k: v for k, v in text_part(config).items() if k != "quantization_config"}
    reference_dir = out.with_name(REFERENCE_DIR) if qc else out
    for d in {out, reference_dir}:
        if d.exists():
            shutil.rmtree(d)
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps(plain, indent=2))
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
    files = sorted(out.glob("*.safetensors"))
    assert [f.name for f in files] == ["model.safetensors"], files
    if wrapper or qc:  # a wrapper's text model under its prefix (no vision tower: vLLM runs without one)
        tensors = {prefix + k: v for k, v in load_file(str(files[0])).items()}
        if qc:
            tensors, reference = quantize_proxy(tensors, qc)
            reference_dir.mkdir(parents=True)
            save_file(reference, str(reference_dir / files[0].name), metadata={"format": "pt"})
            (reference_dir / "config.json").write_text(json.dumps(plain, indent=2))
        save_file(tensors, str(files[0]), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out, reference_dir


def wanted(ec, direct: int | None = None) -> bool:
    """Whether this run checks vLLM on a proxy (extract.vllm_proxy_parity): always, or (auto) when no
    sample is compared with the target itself. `direct`: the samples so compared, extract.vllm_parity
    unless given (train.mode=stream passes train.stream.parity)."""
    direct = ec.vllm_parity if direct is None else direct
    return ec.vllm_proxy_parity == "always" or (ec.vllm_proxy_parity == "auto" and direct == 0)


@dataclasses.dataclass
class Proxy:
    """A proxy built for a run (`build`): what vLLM loads, what transformers loads, and the prompts."""

    config: dict[str, Any]  # its config.json
    directory: Path  # what vLLM loads
    reference_dir: Path  # what transformers loads (`directory` unless quantized)
    quantization: str  # what the check covers of the target's quantization, in words
    tokens: list[torch.Tensor]  # the two random prompts

    @property
    def text(self) -> dict[str, Any]:
        return text_part(self.config)

    @property
    def layers(self) -> int:
        return int(self.text["num_hidden_layers"])

    @property
    def layer_ids(self) -> list[int]:
        """Every layer but the embeddings' (a DeepSeek model's vLLM captures no layer 0)."""
        return list(range(1, self.layers))

    @property
    def quantized(self) -> bool:
        return "quantization_config" in self.config or "quantization_config" in self.text

    def target(self, cfg):
        """A copy of `cfg` whose target is the proxy (vLLM's directory)."""
        proxy_cfg = copy.deepcopy(cfg)
        proxy_cfg.target.model, proxy_cfg.target.revision = str(self.directory), ""
        return proxy_cfg

    def reference_model(self, cfg, layer_ids: list[int], dtype: torch.dtype):
        """transformers on the proxy's float weights, on CPU: the HF backend the parity check compares with."""
        from eyas.extract.backend import HFBackend
        from eyas.target import load_model

        target = dataclasses.replace(cfg.target, model=str(self.reference_dir), revision="")
        return HFBackend(load_model(target, device="cpu"), layer_ids, dtype)

    def remove(self) -> None:
        """Delete its weights: the target's vocabulary x hidden, twice when quantized."""
        shutil.rmtree(self.directory, ignore_errors=True)
        shutil.rmtree(self.reference_dir, ignore_errors=True)

    def start_failed(self, e: EyasError) -> EyasError | None:
        """What to raise instead of `e` (vLLM could not start the proxy's engine), or None for `e` itself:
        for a quantized proxy, where the scheme is the likely cause and the target's would fail so too."""
        if not self.quantized:
            return None
        return EyasError(f"vLLM could not run a tiny model of the target's architecture quantized as the target is "
                         f"({self.quantization}). Where vLLM's log above names the quantization (no kernel for this "
                         f"scheme here), the target's own engine would fail the same way, after its load; otherwise "
                         f"--extract.vllm_proxy_parity=never goes on without this check. {e}")

    def judge(self, backend, states: list[torch.Tensor], tol: float, ec, where: str) -> dict[str, Any]:
        """vLLM's `states` of the prompts (states_SKD each, final norm applied) against `backend` (the
        transformers reference) -> what was checked, for the records. EyasError (naming the proxy, the
        layer and the error, and how to skip the check) when they disagree."""
        from eyas.extract.backend import ParityError, check_parity

        checks = [(f"proxy-{k}", s, t) for k, (s, t) in enumerate(zip(states, self.tokens))]
        try:
            parity = check_parity(backend, checks, tol, proxy=True)
        except ParityError as e:
            raise EyasError(f"vLLM disagrees with transformers on a tiny random model of the target's architecture "
                            f"({self.directory}): {e}.{_rope_note(ec, self.text)} The target's own run would capture "
                            "such states: it does not start (--extract.vllm_proxy_parity=never skips this check)") from e
        print(f"[eyas:{where}] proxy parity: {len(parity.errors)} samples, max relative error {max(parity.errors):.2e}",
              flush=True)
        return {"dir": str(self.directory), "layers": self.layers, "hidden_size": self.text["hidden_size"],
                "quantization": self.quantization, "samples": len(parity.errors),
                "max_relative_error": max(parity.errors)}


def build(cfg, out: Path, where: str) -> Proxy:
    """The proxy of cfg.target, built in `out` from the target's config.json for the run's tensor and
    expert parallelism (said in one line, `where` its prefix). ConfigError when the target is no local
    directory."""
    from eyas.target import model_path, text_model

    ec = cfg.extract
    source = Path(model_path(cfg.target)) / "config.json"
    if not source.is_file():
        raise ConfigError(f"extract.vllm_proxy_parity builds its proxy from the target's config.json; "
                          f"{source} is not a file (a hub id: download the checkpoint, or set "
                          "--extract.vllm_proxy_parity=never)")
    target_config = json.loads(source.read_text())
    config = proxy_config(target_config, ec.vllm_tensor_parallel_size, ec.vllm_enable_expert_parallel)
    quantization = _quantization_note(target_config, config)
    directory, reference_dir = build_proxy(config, out, prefix=text_model(cfg.target).prefix)
    text = text_part(config)
    g = torch.Generator().manual_seed(0)
    tokens = [torch.randint(0, int(text["vocab_size"]), (n,), generator=g) for n in (48, 29)]
    print(f"[eyas:{where}] vLLM checked on a proxy of the target first (extract.vllm_proxy_parity): "
          f"{config.get('architectures')}, {text['num_hidden_layers']} layers, hidden {text['hidden_size']}, "
          f"{text['num_attention_heads']} heads" + (f", {text['n_routed_experts']} experts"
                                                    if "n_routed_experts" in text else "")
          + f"; quantization: {quantization}; {directory}", flush=True)
    return Proxy(config, directory, reference_dir, quantization, tokens)


def check_proxy(cfg, setup, make_backend) -> dict[str, Any]:
    """Build the proxy in the output directory, run it through `make_backend` (the vLLM backend's
    factory, with the run's engine arguments) on two random prompts, and compare with transformers;
    -> what was checked, for meta.json. EyasError when vLLM disagrees."""
    from eyas.extract.backend import default_tolerance

    ec = cfg.extract
    proxy = build(cfg, setup.out / PROXY_DIR, "extract")
    proxy_cfg = proxy.target(cfg)
    proxy_cfg.extract.vllm_parity = 2
    proxy_cfg.extract.vllm_max_model_len = 0
    proxy_setup = dataclasses.replace(setup, layer_ids=proxy.layer_ids, num_layers=proxy.layers,
                                      hidden=int(proxy.text["hidden_size"]),
                                      prepared=SimpleNamespace(ids=["proxy-0", "proxy-1"]))
    tokens = proxy.tokens
    try:
        backend = make_backend(proxy_cfg, proxy_setup, max(t.numel() for t in tokens),
                               reference_model=str(proxy.reference_dir))
    except EyasError as e:
        proxy.remove()
        instead = proxy.start_failed(e)
        if instead is None:
            raise
        raise instead from e
    try:
        batch = Batch([0, 1], [t.numel() for t in tokens], 1, sum(t.numel() for t in tokens), True)
        states = backend.forward(batch, tokens)
        tol = ec.parity_tol or max(default_tolerance(setup.compute_dtype), default_tolerance(setup.capture_dtype))
        ends = torch.tensor([t.numel() for t in tokens]).cumsum(0).tolist()
        return proxy.judge(backend, [states[end - t.numel(): end] for t, end in zip(tokens, ends)], tol, ec, "extract")
    finally:
        backend.close()
        proxy.remove()


def _rope_note(ec, text: dict[str, Any]) -> str:
    """For an MLA proxy on vLLM's CPU build, the known cause: the CPU rotary op, which eyas turns off
    and a compilation_config in extract.vllm_engine_args turns back on."""
    from eyas import vllm_engine

    if MLA_KEY not in text or not vllm_engine.on_cpu("extract.backend"):
        return ""
    note = (" On vLLM's CPU build eyas runs MLA's rotary embedding in PyTorch (compilation_config.custom_ops "
            "['all', '-rotary_embedding']): vLLM's CPU rotary op rotates MLA's query and key wrongly (docs/vllm.md).")
    if "compilation_config" in ec.vllm_engine_args:
        note += (f" --extract.vllm_engine_args.compilation_config={ec.vllm_engine_args['compilation_config']!r} "
                 "replaced that setting: keep '-rotary_embedding' in its custom_ops.")
    return note


def _quantization_note(target: dict[str, Any], proxy: dict[str, Any]) -> str:
    """What the proxy checks of the target's quantization, in words."""
    qc = target.get("quantization_config") or text_part(target).get("quantization_config")
    if not qc:
        return "none (the target is not quantized)"
    if "quantization_config" in proxy or "quantization_config" in text_part(proxy):
        w = next(iter(qc["config_groups"].values()))["weights"]
        size = f" in groups of {w['group_size']}" if w["strategy"] == "group" else " per channel"
        return f"{qc['quant_method']} {qc['format']} int{w['num_bits']}{size}, as the target's"
    return f"not checked: the proxy is unquantized ({writable_quantization(qc)})"
