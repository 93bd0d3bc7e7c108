"""vLLM checked on a proxy of the target before the stream engines load (extract.vllm_proxy_parity).

train.stream.parity compares an engine's first samples with transformers running the target on CPU;
for a target no host holds in float (DeepSeek-V3, Kimi-K2.5) it is 0, and vLLM would go unchecked.
Instead rank 0, once Mooncake's master and Ray are up and before the target's engines start, builds
the tiny random model of the target's architecture that extract's check uses (eyas/extract/vllm_proxy.py)
and runs it through one stream engine with the target's engine arguments (tensor and expert parallel,
dtype, eyas's CPU settings, hs-connectors' Mooncake connector on the same master): its two prompts go
through `Engine.extract`, their states are fetched from the store by the trainer's own `Transport`,
the proxy's final norm applied, and compared with transformers on every captured layer. So the whole
stream path is checked (engine -> connector -> Mooncake -> transport), not vLLM alone. A
disagreement stops the run before the target's engines load; the proxy's engine is stopped (its GPUs
given back to Ray) before they start.

The proxy's engine adds PROXY_STORE_BYTES to the store; once it is gone the master drops that segment
within its client TTL (10 s), long before the target's engines (a load of minutes) put anything.

    auto    when train.stream.parity=0 (no sample compared with the target itself)
    always, never
Engines given by URL (train.stream.engine_urls) are the user's servers of the target: the check is
skipped, and said so.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import torch

from eyas.errors import EyasError

NAME = "vllm-proxy"
PROXY_STORE_BYTES = 64 << 20
"""The proxy engine's share of Mooncake's store: its two prompts' states take well under a megabyte."""


def wanted(cfg) -> bool:
    """Whether a stream run checks vLLM on a proxy first: extract.vllm_proxy_parity, whose auto follows
    train.stream.parity here (extract.vllm_parity is extract's)."""
    from eyas.extract.vllm_proxy import wanted as proxy_wanted

    return proxy_wanted(cfg.extract, cfg.train.stream.parity)


def skipped_by_url(cfg) -> dict[str, Any]:
    """The record (and the printed line) of a wanted check that engines given by URL rule out."""
    why = ("engines given by URL (train.stream.engine_urls) are the user's servers of the target: vLLM is not "
           "checked on a proxy; check it with `eyas extract --extract.backend=vllm --extract.vllm_parity=0` on the "
           "same target and settings, or compare samples with train.stream.parity where the target fits in memory")
    print(f"[eyas:train] stream: {why}", flush=True)
    return {"skipped": why}


def check(cfg, out: Path, master: str, namespace: str, transport, cpu: bool, compute: torch.dtype,
          stored: torch.dtype) -> dict[str, Any]:
    """Build the proxy in `out`, run it through one stream engine on `master` (Ray namespace
    `namespace`), fetch its states through `transport` and compare them with transformers; -> what was
    checked (with its seconds), for the train stage's records. EyasError when vLLM disagrees or the
    engine fails."""
    from eyas.extract import vllm_backend
    from eyas.extract.backend import default_tolerance
    from eyas.extract.vllm_proxy import build
    from eyas.stream import engines as eng
    from eyas.stream.transport import store_config

    sc, ec = cfg.train.stream, cfg.extract
    t0 = time.perf_counter()
    proxy = build(cfg, out, "train")
    proxy_cfg = proxy.target(cfg)
    longest = max(t.numel() for t in proxy.tokens)
    started: list = []
    try:
        try:
            base = vllm_backend.engine_kwargs(proxy_cfg, proxy.layer_ids, proxy.layers, longest + 1, compute,
                                              Path("/nonexistent"), cpu=cpu, hf_config=proxy.config)
            store = store_config(master, PROXY_STORE_BYTES, host=sc.host, protocol=sc.protocol, device=sc.device)
            kw = eng.engine_kwargs(base, store, cpu)
            try:  # no restart: a proxy engine that dies says so at once
                eng.start_engines(kw, [NAME], namespace, dataclasses.replace(sc, engine_restarts=0), cpu,
                                  int(kw["tensor_parallel_size"]) * int(kw["pipeline_parallel_size"]), started=started)
            except EyasError as e:
                instead = proxy.start_failed(e)
                if instead is None:
                    raise
                raise instead from e
            norm = vllm_backend.load_final_norm(proxy_cfg.target, compute)
            states = _fetch(started[0], transport, proxy, norm, compute, stored, sc.fetch_timeout_s)
        finally:  # before the reference loads, and before the target's engines start (its GPUs back to Ray)
            for handle in started:
                eng.stop_engine(handle, NAME)
            if not cpu:
                eng.release_gpus(namespace, NAME)
        tol = ec.parity_tol or max(default_tolerance(compute), default_tolerance(stored))
        record = proxy.judge(proxy.reference_model(cfg, proxy.layer_ids, stored), states, tol, ec, "train")
        return {**record, "seconds": round(time.perf_counter() - t0, 1)}  # the engine's start, mostly
    finally:
        proxy.remove()


def _fetch(engine, transport, proxy, norm, compute: torch.dtype, stored: torch.dtype,
           timeout_s: float) -> list[torch.Tensor]:
    """The proxy's prompts through `engine` and the store -> states_SKD per prompt, as StreamStates
    makes them for training (the last state through the final norm, all in `stored`)."""
    import ray

    from eyas.stream.source import split_states

    requests = [(f"vllm-proxy-{k}", t.tolist()) for k, t in enumerate(proxy.tokens)]
    try:
        results = ray.get(engine.extract.remote(requests))
    except Exception as e:  # the engine died or raised (RayActorError, RayTaskError)
        raise EyasError(f"the proxy's stream engine failed on its prompts ({type(e).__name__}: {e}); vLLM's log is "
                        "above (or in Ray's session directory). --extract.vllm_proxy_parity=never skips this "
                        "check") from e
    out = []
    for (rid, ids), res in zip(requests, results):
        if "error" in res:
            raise EyasError(f"the proxy's stream engine did not capture request {rid}: {res['error']}")
        key = res["manifest"].get("handle", "")
        try:
            tensors = transport.fetch(res["manifest"], timeout_s)
        finally:
            transport.discard(key)
        got = tensors["token_ids"].tolist()
        if got != ids:
            raise EyasError(f"the proxy's object {key} holds token ids other than those sent")
        aux, final = split_states(tensors["hidden_states"], norm, compute, stored)  # as training reads them
        out.append(torch.cat([aux, final[:, None]], dim=1))
    return out
