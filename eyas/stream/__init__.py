"""Streaming (train.mode=stream): vLLM engines feed the trainer ranks directly, no hidden state on disk.

    eyas run recipe.yaml --train.mode=stream                      # one node: eyas starts everything
    ray start --head --node-ip-address=HEAD                       # a cluster: on the head node,
    ray start --address=HEAD:6379                                 #   on every other node, then
    eyas run recipe.yaml --train.mode=stream --train.stream.ray_address=HEAD:6379 ...

Roles (one module each):
  engines.py    vLLM engine actors on Ray (`extract_hidden_states`, hs-connectors' Mooncake connector)
  transport.py  Mooncake's store: the master (eviction off), the trainer ranks' client; the only
                place bytes move
  ledger.py     every sample's state (queued, in flight, delivered, trained), saved with checkpoints
  source.py     what the train loop reads: a batch's states, asked for ahead in training order

`open_stream` (here) sets a run's streaming up: rank 0 starts (or joins) the Mooncake master, the Ray
cluster and the engines, and every rank connects its own store client and controller.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from eyas.errors import ConfigError, EyasError, exception_message  # noqa: F401

NAMESPACE_PREFIX = "eyas-stream"
LOCAL_OBJECT_STORE = 512 << 20  # Ray's object store carries only token ids and manifests; the states go through Mooncake


@dataclass
class Session:
    """What rank 0 started (and stops in `close`), and what every rank holds."""

    states: Any  # StreamStates (None until it exists)
    engines: list = field(default_factory=list)
    master: Any = None  # transport.Master when eyas started it
    started_ray: bool = False
    proxy: dict | None = None  # rank 0: the vLLM proxy check's record (eyas/stream/proxy.py), when it was wanted

    names: list = field(default_factory=list)

    def close(self) -> None:
        ray = sys.modules.get("ray")  # not imported: nothing of Ray's was started
        try:
            if self.states is not None:
                self.states.close()
            if self.engines:
                from eyas.stream.engines import stop_engine

                for name, e in zip(self.names or [f"engine-{k}" for k in range(len(self.engines))], self.engines):
                    stop_engine(e, name)
            if ray is not None and ray.is_initialized():
                ray.shutdown()
        finally:
            if self.master is not None:
                self.master.stop()


def check_stream(cfg, layer_ids: list[int], hidden: int, world: int, model_type: str = "") -> int:
    """What train.mode=stream needs, checked before anything starts: vLLM, Ray, hs-connectors and
    Mooncake's store (with libibverbs) importable here, and a window that holds two optimizer steps'
    states. -> the window in bytes. ConfigError naming what to install or which flag to change."""
    from eyas import vllm_engine
    from eyas.stream.transport import load_ibverbs

    vllm_engine.on_cpu("train.mode=stream")  # ConfigError when vLLM is missing
    import importlib.util

    # found, not imported: Ray reads its authentication settings on import, and open_stream sets them first
    missing = [package for module, package in (("ray", "ray"), ("hs_connectors", "hs-connectors"))
               if importlib.util.find_spec(module) is None]
    if missing:
        raise ConfigError(f"train.mode=stream needs {', '.join(missing)} in this Python environment: `pip install "
                          "ray hs-connectors mooncake-transfer-engine` (GPUs) or scripts/vllm-venv.sh (CPU)")
    try:
        load_ibverbs()
        import mooncake.store  # noqa: F401  (loads: libibverbs found)
    except (ImportError, OSError, EyasError) as e:
        raise ConfigError(f"train.mode=stream needs Mooncake's store: {type(e).__name__}: {exception_message(e)} "
                          "(`pip install mooncake-transfer-engine`, or -non-cuda on CPU; it links libibverbs: "
                          "`apt install libibverbs1`, or scripts/vllm-venv.sh)") from e
    sc, tc = cfg.train.stream, cfg.train
    if cfg.extract.store_dtype == "float8":
        raise ConfigError("extract.store_dtype=float8 is how extract stores states on disk; train.mode=stream keeps "
                          "them in memory and trains on the engine's own dtype: leave extract.store_dtype at auto "
                          "(or a float dtype to cast to)")
    cpu = vllm_engine.on_cpu("train.mode=stream")
    from eyas.extract.vllm_backend import check_supported

    check_supported(cfg.extract, model_type, layer_ids, cpu)  # what vLLM cannot capture, as for extract
    compute = resolve_dtype_name(cfg.target.dtype, cpu)
    per_token = (len(layer_ids) + 1) * hidden * torch.empty((), dtype=compute).element_size() + 8
    engines = len(sc.engine_urls) or sc.engines
    window = int(sc.window_gb * 1e9) if sc.window_gb else int(0.8 * sc.store_gb * 1e9 * engines / world)
    need = 2 * tc.grad_accum * tc.max_tokens * per_token  # the window in training and the next one
    if window < need:
        raise ConfigError(f"train.stream.window_gb={window / 1e9:.3g} GB per rank holds less than two optimizer steps' "
                          f"states ({need / 1e9:.3g} GB: 2 x train.grad_accum x train.max_tokens x {per_token} "
                          "bytes per token): raise train.stream.window_gb or train.stream.store_gb, or lower "
                          "train.max_tokens")
    return window


def resolve_dtype_name(name: str, cpu: bool) -> torch.dtype:
    from eyas.target import resolve_dtype

    return resolve_dtype(name, "cpu" if cpu else "cuda")


def open_stream(cfg, data, rank: int, world: int, out: Path) -> Session:
    """Start (rank 0) or join (other ranks) the engines and the store; -> this rank's Session. What
    was started before a failure (the master, Ray, engines) is stopped again."""
    session = Session(None)
    try:
        return _open(cfg, data, rank, world, out, session)
    except BaseException:
        try:
            session.close()
        except Exception as e:  # the start's own error is the one raised; this one is said, not hidden
            print(f"[eyas:train] stream: stopping what had started failed too: {type(e).__name__}: "
                  f"{exception_message(e)}", flush=True)
        raise


def _open(cfg, data, rank: int, world: int, out: Path, session: Session) -> Session:
    from eyas import vllm_engine
    from eyas.distributed import rank0_object
    from eyas.extract import vllm_backend
    from eyas.stream import engines as eng
    from eyas.stream import proxy
    from eyas.stream.source import StreamStates
    from eyas.stream.transport import Master, Transport, store_config
    from eyas.target import load_hf_config, resolve_dtype

    sc, tc = cfg.train.stream, cfg.train
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # a local cluster on 127.0.0.1
    # (ray is imported once its authentication token is in the environment: Ray reads it on import)
    cpu = vllm_engine.on_cpu("train.mode=stream")
    hf = load_hf_config(cfg.target).to_dict()
    text = hf.get("text_config") if isinstance(hf.get("text_config"), dict) else hf
    num_layers, hidden = int(text["num_hidden_layers"]), int(text["hidden_size"])
    window = check_stream(cfg, data.layer_ids, hidden, world, str(text.get("model_type", "")))
    compute = resolve_dtype(cfg.target.dtype, "cpu" if cpu else "cuda")
    stored = compute if cfg.extract.store_dtype == "auto" else getattr(torch, cfg.extract.store_dtype)
    bytes_per_token = (len(data.layer_ids) + 1) * hidden * torch.empty((), dtype=compute).element_size() + 8
    longest = min(int(max(data.source.lengths)), tc.max_tokens)
    master = None
    info = None
    if rank == 0:
        if sc.master:
            master_address = sc.master
        else:
            master = session.master = Master(out / "stream" / "mooncake_master.log",
                                             host=_node_address() if sc.host == "auto" else sc.host)
            master_address = master.address
            print(f"[eyas:train] stream: mooncake_master on {master_address} (eviction off; log {master.log})", flush=True)
        if not sc.ray_address:  # Ray's token authentication: the other ranks join this run's cluster with it
            os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(32))
            os.environ.setdefault("RAY_AUTH_MODE", "token")
        import ray

        started = _init_ray(sc)
        namespace = f"{NAMESPACE_PREFIX}-{os.getpid()}-{int(time.time())}"
        info = {"master": master_address, "gcs": ray.get_runtime_context().gcs_address, "namespace": namespace,
                "started_ray": started, "token": os.environ.get("RAY_AUTH_TOKEN")}
    info = rank0_object(info)
    if rank != 0:
        if info["token"]:  # before ray is imported: it reads both then
            os.environ["RAY_AUTH_TOKEN"] = info["token"]
            os.environ["RAY_AUTH_MODE"] = "token"
        import ray

        ray.init(address=info["gcs"], namespace=info["namespace"], log_to_driver=False)
    base = vllm_backend.engine_kwargs(cfg, data.layer_ids, num_layers, longest + 1, compute, Path("/nonexistent"),
                                      cpu=cpu, hf_config=hf)
    served = list(sc.engine_urls)
    names = [f"served-{k}" for k in range(len(served))] if served else [f"engine-{k}" for k in range(sc.engines)]
    handles: list = []
    transport = None  # rank 0's, made early when the proxy check fetches through it
    if rank == 0:
        store = store_config(info["master"], int(sc.store_gb * 1e9), host=sc.host, protocol=sc.protocol,
                             device=sc.device)
        kw = eng.engine_kwargs(base, store, cpu)
        if proxy.wanted(cfg):  # vLLM on a tiny model of the target's architecture, before the target's long load
            if served:
                session.proxy = proxy.skipped_by_url(cfg)
            else:
                host = ray.util.get_node_ip_address() if sc.host == "auto" else sc.host
                transport = Transport(store_config(info["master"], 0, host=host, protocol=sc.protocol,
                                                   device=sc.device))
                session.proxy = proxy.check(cfg, out / "stream" / proxy.NAME, info["master"], info["namespace"],
                                            transport, cpu, compute, stored)
        if served:  # the user's servers: what they must run with, then a client actor per URL
            print(f"[eyas:train] stream: engines given by URL ({', '.join(served)}); each must run as\n  "
                  f"{eng.served_command(kw)}", flush=True)
            handles = eng.start_served(served, names, info["namespace"], ranks=world)
        else:
            handles = eng.start_engines(kw, names, info["namespace"], sc, cpu, int(kw["tensor_parallel_size"]) *
                                        int(kw["pipeline_parallel_size"]), ranks=world, started=session.engines)
    info = rank0_object(info)  # every rank waits here until the engines are up
    if rank != 0:
        handles = [ray.get_actor(n, namespace=info["namespace"]) for n in names]
    if transport is None:
        host = ray.util.get_node_ip_address() if sc.host == "auto" else sc.host  # this rank's node
        transport = Transport(store_config(info["master"], 0, host=host, protocol=sc.protocol, device=sc.device))
    norm = vllm_backend.load_final_norm(cfg.target, compute)
    def reference():  # transformers on CPU, loaded at the first parity check (rank 0)
        from eyas.extract.backend import HFBackend
        from eyas.target import load_model

        print("[eyas:train] stream: loading the target through transformers on CPU for the parity check "
              "(train.stream.parity)", flush=True)
        return HFBackend(load_model(cfg.target, device="cpu"), data.layer_ids, stored)

    states = StreamStates(handles, names, transport, data.source, data.layer_ids, hidden, norm, compute, stored, sc,
                          tc.max_tokens, bytes_per_token, window, rank=rank, world=world,
                          reference=reference if sc.parity else None)
    if rank == 0:
        print(f"[eyas:train] stream: {len(handles)} engine(s) ready; window {window / 1e9:.2f} GB per rank "
              f"({bytes_per_token} bytes per token)", flush=True)
    session.states, session.names = states, names if rank == 0 else []
    session.engines = handles if rank == 0 else []
    session.started_ray = bool(info.get("started_ray")) and rank == 0
    return session


def _node_address() -> str:
    """This node's address as other nodes reach it (the one a UDP socket towards a public address
    would leave from; nothing is sent)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(("10.255.255.255", 1))
        return s.getsockname()[0]


@contextlib.contextmanager
def engine_gpus():
    """A local cluster on a GPU node sees only the GPUs the trainer ranks of this node do not use (the
    ranks take the first LOCAL_WORLD_SIZE visible ones): Ray starts with CUDA_VISIBLE_DEVICES set to
    the rest, and places the engines there. ConfigError when none is left."""
    import torch

    if not torch.cuda.is_available():
        yield
        return
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = before.split(",") if before else [str(i) for i in range(torch.cuda.device_count())]
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    free = ids[ranks:]
    if not free:
        raise ConfigError(f"train.mode=stream on one node: the {ranks} trainer rank(s) take all {len(ids)} GPUs and none "
                          "is left for the engines; run fewer ranks (torchrun --nproc-per-node) or put the engines "
                          "on other nodes (--train.stream.ray_address, recipes/deepseek-v3-stream.yaml)")
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(free)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = before


def _init_ray(sc) -> bool:
    """Connect to train.stream.ray_address, or start a local cluster; -> whether eyas started it."""
    import ray

    try:
        if sc.ray_address:
            ray.init(address=sc.ray_address, log_to_driver=True)
            return False
        # address="local": always a new cluster of this run's own, never one a RAY_ADDRESS or an earlier
        # `ray start` left as the default (it dies with this process, even killed with SIGKILL)
        with engine_gpus():
            ray.init(address="local", include_dashboard=False, log_to_driver=True,
                     object_store_memory=LOCAL_OBJECT_STORE)
        return True
    except Exception as e:
        where = f"train.stream.ray_address={sc.ray_address!r}" if sc.ray_address else "a local Ray cluster"
        raise EyasError(f"could not connect to {where}: {type(e).__name__}: {exception_message(e)}") from e
