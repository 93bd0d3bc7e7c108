"""vLLM engines that capture the target's hidden states for streaming, one Ray actor each.

Each engine is a `vllm.LLM` (vLLM's own `mp` executor for its TP x PP workers) inside a Ray actor
placed in a placement group of one bundle holding its GPUs (TP x PP of one node; Ray's
CUDA_VISIBLE_DEVICES gives vLLM exactly those). N engines give N-way data parallelism. The engine
runs prefill only (`max_tokens=1`) under vLLM's `extract_hidden_states` method with the aux layer ids
eyas trains on plus id L (the last layer before the final norm, as extract's vLLM backend), and its
KV connector (hs-connectors' Mooncake connector; eyas/stream/vllm_connector.py on vLLM's CPU build)
puts each finished request's states into Mooncake's store. `Engine.extract` returns, per request, the
manifest vLLM hands back: the trainer fetches the bytes from the store, never through Ray.

vLLM is imported only inside the actor; Ray only where engines start (eyas/stream/source.py).
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

from eyas.errors import exception_message

CALLS_PER_RANK = 2  # eyas.stream.source.DEPTH: extract calls a trainer rank keeps waiting per engine
ANSWER_S = 5  # a live engine answers ready() within milliseconds, even while it prefills
CPU_CONNECTOR = ("eyas.stream.vllm_connector", "CPUMooncakeHiddenStatesConnector")
STOCK_CONNECTOR = ("hs_connectors.mooncake_hidden_states_connector", "MooncakeHiddenStatesConnector")


def engine_kwargs(base: dict[str, Any], store: dict[str, Any], cpu: bool) -> dict[str, Any]:
    """`vllm.LLM(**kwargs)` for a stream engine: extract's vLLM arguments (`base`, from
    eyas.extract.vllm_backend.engine_kwargs) with the Mooncake connector and its store settings."""
    module, name = CPU_CONNECTOR if cpu else STOCK_CONNECTOR
    kw = dict(base)
    kw["kv_transfer_config"] = {"kv_connector": name, "kv_connector_module_path": module, "kv_role": "kv_producer",
                                "kv_connector_extra_config": {"mooncake": dict(store)}}
    return kw


# Watches the actor (argv[1]) from outside it and kills the actor's process group once the actor is
# gone: vLLM's EngineCore and workers are the actor's children, in its process group, and a vLLM
# still loading when its actor dies (the trainer killed, Ray's cluster stopped) outlives it otherwise,
# holding its memory and GPUs. It forks away from the actor first: Ray kills a dead worker's direct
# children (the watchdog among them, and EngineCore) but not theirs, so vLLM's workers were left.
# The actor is followed by its start time in /proc (a reused pid is not the actor).
WATCHDOG = (
    "import os, signal, sys, time\n"
    "actor = int(sys.argv[1]); group = os.getpgid(actor)\n"
    "if os.fork(): os._exit(0)\n"
    "def born():\n"
    "    try:\n"
    "        with open(f'/proc/{actor}/stat') as f: fields = f.read().rsplit(')', 1)[1].split()\n"
    "    except OSError: return None\n"
    "    return None if fields[0] == 'Z' else fields[19]\n"
    "first = born()\n"
    "while first is not None and born() == first: time.sleep(0.5)\n"
    "try: os.killpg(group, signal.SIGKILL)\n"
    "except ProcessLookupError: pass\n"
)


def reap_with_me() -> None:
    """Start WATCHDOG for this process (the engine actor), which leads its own process group."""
    import subprocess
    import sys

    if os.getpgid(0) != os.getpid():  # a group of its own, so that the watchdog kills only the engine's processes
        os.setpgid(0, 0)
    subprocess.run([sys.executable, "-c", WATCHDOG, str(os.getpid())], start_new_session=True, check=True,
                   stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # returns once forked


class Engine:
    """The body of one engine actor (ray.remote(Engine) in eyas/stream/source.py)."""

    def __init__(self, kwargs: dict[str, Any], name: str, env: dict[str, str] | None = None):
        os.environ.update(env or {})  # VLLM_CPU_OMP_THREADS_BIND, VLLM_CPU_KVCACHE_SPACE ...
        reap_with_me()
        from vllm import LLM, SamplingParams
        from vllm.sampling_params import RequestOutputKind

        from eyas.stream.transport import load_ibverbs

        load_ibverbs()
        self.name, self.started = name, time.time()
        mooncake = kwargs["kv_transfer_config"]["kv_connector_extra_config"]["mooncake"]
        if mooncake.get("local_hostname") == "auto":  # a cluster: this node's address, as Ray knows it
            import ray

            mooncake["local_hostname"] = ray.util.get_node_ip_address()
        self.llm = LLM(**kwargs)
        self.engine = self.llm.llm_engine
        self.params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False,
                                     output_kind=RequestOutputKind.FINAL_ONLY)
        self.tokens = 0  # prompt tokens prefilled, for the inference rate
        self.busy_s = 0.0
        self.lock = threading.Lock()  # the actor answers ready() while extract() runs; one extract at a time

    def ready(self) -> dict[str, Any]:
        import vllm

        return {"name": self.name, "pid": os.getpid(), "vllm": vllm.__version__, "load_s": time.time() - self.started}

    def extract(self, requests: list[tuple[str, list[int]]]) -> list[dict[str, Any]]:
        """Prefill every (request id, token ids); -> per request {rid, manifest} (kv_transfer_params),
        or {rid, error} when vLLM refused the prompt or finished it otherwise than after its one token."""
        with self.lock:
            try:
                return self._extract(requests)
            except Exception as e:
                if type(e).__name__ == "EngineDeadError":  # vLLM's EngineCore is gone while this actor lives:
                    print(f"[eyas:stream] {self.name}: vLLM's engine died ({exception_message(e)}); exiting so that "
                          "Ray restarts this engine", flush=True)
                    os._exit(1)  # die, so that Ray restarts the actor (and the watchdog reaps vLLM's processes)
                raise

    def _extract(self, requests: list[tuple[str, list[int]]]) -> list[dict[str, Any]]:
        from vllm.inputs import TokensPrompt

        t0 = time.perf_counter()
        results: dict[str, dict[str, Any]] = {}
        added = []
        for rid, ids in requests:
            try:
                self.engine.add_request(rid, TokensPrompt(prompt_token_ids=list(ids)), self.params)
                added.append(rid)
            except Exception as e:  # a prompt vLLM refuses (too long ...): that sample's error, not the engine's
                results[rid] = {"rid": rid, "error": f"vLLM refused the prompt: {type(e).__name__}: {exception_message(e)}"}
        waiting = set(added)
        while waiting:
            if not self.engine.has_unfinished_requests():
                for rid in waiting:
                    results[rid] = {"rid": rid, "error": "neither running nor finished in the engine"}
                break
            for out in self.engine.step():
                if not out.finished or out.request_id not in waiting:
                    continue
                waiting.discard(out.request_id)
                reason = out.outputs[0].finish_reason if out.outputs else None
                manifest = out.kv_transfer_params
                if reason not in ("length", "stop") or not manifest:
                    results[out.request_id] = {"rid": out.request_id, "error": f"finished with reason {reason!r} and "
                                               f"{'a' if manifest else 'no'} transfer manifest"}
                else:
                    results[out.request_id] = {"rid": out.request_id, "manifest": manifest,
                                               "prompt_ids": list(out.prompt_token_ids or [])}
                    self.tokens += len(out.prompt_token_ids or [])
        self.busy_s += time.perf_counter() - t0
        return [results[rid] for rid, _ in requests]

    def stats(self) -> dict[str, float]:
        return {"tokens": self.tokens, "busy_s": self.busy_s}

    def shutdown(self) -> None:
        from eyas.vllm_engine import shutdown

        llm, self.llm = self.llm, None
        if llm is not None:
            shutdown(llm)


def start_engines(kwargs: dict[str, Any], names: list[str], namespace: str, sc, cpu: bool, gpus: int,
                  ranks: int = 1, started: list | None = None) -> list:
    """One named Ray actor per engine, each restarted by Ray up to train.stream.engine_restarts times
    (eyas re-sends the samples a dead engine held; Ray retries no call itself). On GPUs each engine
    is placed in a placement group of one bundle of `gpus` GPUs (TP x PP, one node: vLLM's own
    workers share the bundle); on vLLM's CPU build the engines take no Ray CPU slot (vLLM binds its
    own threads). -> the actor handles once every engine has loaded the target."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from eyas.vllm_engine import check_cpu_workers

    env = {k: v for k, v in os.environ.items() if k.startswith("VLLM_")}
    handles = []
    for name in names:
        options: dict[str, Any] = {"name": name, "namespace": namespace, "max_restarts": sc.engine_restarts,
                                   # every rank keeps DEPTH calls waiting, each a thread on the engine's lock;
                                   # two more so that ready() and stats() answer while they wait
                                   "max_task_retries": 0, "max_concurrency": CALLS_PER_RANK * ranks + 2}
        if cpu:
            options["num_cpus"] = 0
            binding = check_cpu_workers(gpus, "extract")
            if binding is not None:
                env["VLLM_CPU_OMP_THREADS_BIND"] = binding
                print(f"[eyas:train] stream: {name}: VLLM_CPU_OMP_THREADS_BIND={binding} (one core group per vLLM "
                      "CPU worker; set it yourself to choose others)", flush=True)
        else:
            pg = ray.util.placement_group([{"GPU": gpus, "CPU": 1}], strategy="STRICT_PACK", name=f"{namespace}-{name}")
            ray.get(pg.ready())
            options.update(num_gpus=gpus, num_cpus=1,
                           scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0))
        handles.append(ray.remote(Engine).options(**options).remote(kwargs, name, env))
        if started is not None:  # the caller stops them should a later one fail to start
            started.append(handles[-1])
    t0 = time.perf_counter()
    for name, h in zip(names, handles):
        try:
            info = ray.get(h.ready.remote())
        except Exception as e:
            from eyas.errors import EyasError

            raise EyasError(f"stream engine {name} could not start: {type(e).__name__}: {exception_message(e)} "
                            "(engine arguments: extract.vllm_*; vLLM's log above)") from e
        print(f"[eyas:train] stream: {name} ready (vLLM {info['vllm']}, pid {info['pid']}, target loaded in "
              f"{info['load_s']:.0f} s; {time.perf_counter() - t0:.0f} s since the first engine was asked for)", flush=True)
    return handles


def stop_engine(handle, name: str) -> None:
    """Shut an engine actor down (vLLM's processes), then kill it; one that does not answer at once
    (stopped, hung: what may have stopped the run) is killed, not waited on for a minute."""
    import contextlib

    import ray

    try:
        ray.get(handle.ready.remote(), timeout=ANSWER_S)
        ray.get(handle.shutdown.remote(), timeout=60)
    except Exception as err:  # an engine already gone: nothing to shut down
        print(f"[eyas:train] stream: {name} did not shut down cleanly ({type(err).__name__}: "
              f"{exception_message(err)}); killed", flush=True)
    with contextlib.suppress(Exception):
        ray.kill(handle)


def release_gpus(namespace: str, name: str) -> None:
    """Remove the placement group `start_engines` made for engine `name` (GPUs only), once the engine
    is stopped: its GPUs go to the engines started next."""
    import ray

    try:
        pg = ray.util.get_placement_group(f"{namespace}-{name}")
    except ValueError:  # none (vLLM's CPU build places no group)
        return
    ray.util.remove_placement_group(pg)


class ServedEngine:
    """A running vLLM server as an engine (train.stream.engine_urls), with the same interface as
    `Engine`: the server was started with the extract_hidden_states method and hs-connectors'
    Mooncake connector on eyas's master (`served_command` prints its arguments); each sample is one
    /v1/completions request (prompt = its token ids, max_tokens = 1), whose response carries the
    manifest (`kv_transfer_params`). The server is the user's: eyas neither starts nor stops it."""

    def __init__(self, url: str, name: str, model: str = "", timeout_s: float = 600.0, threads: int = 8):
        self.url, self.name, self.timeout_s, self.threads = url.rstrip("/"), name, timeout_s, threads
        self.model = model
        self.tokens, self.busy_s, self.started = 0, 0.0, time.time()

    def _get(self, path: str) -> dict[str, Any]:
        import json
        import urllib.request

        with urllib.request.urlopen(self.url + path, timeout=30) as r:
            return json.loads(r.read())

    def _post(self, body: dict[str, Any]) -> dict[str, Any]:
        import json
        import urllib.request

        req = urllib.request.Request(self.url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=self.timeout_s) as r:
            return json.loads(r.read())

    def ready(self) -> dict[str, Any]:
        """-> as Engine.ready, or {"error": why} when the server does not answer (said by start_served)."""
        try:
            self.model = self.model or self._get("/v1/models")["data"][0]["id"]
            version = self._get("/version").get("version", "?")
        except Exception as e:  # connection refused, not a vLLM server
            return {"error": f"{type(e).__name__}: {exception_message(e)}"}
        return {"name": self.name, "pid": os.getpid(), "vllm": version, "load_s": 0.0, "served": self.url}

    def _one(self, rid: str, ids: list[int]) -> dict[str, Any]:
        try:
            out = self._post({"model": self.model, "prompt": list(ids), "max_tokens": 1, "temperature": 0.0})
        except Exception as e:  # refused, cut off, timed out: that sample's error (the controller asks again)
            return {"rid": rid, "error": f"{self.url}: {type(e).__name__}: {exception_message(e)}"}
        manifest = out.get("kv_transfer_params")
        reason = (out.get("choices") or [{}])[0].get("finish_reason")
        if not manifest or reason not in ("length", "stop"):
            return {"rid": rid, "error": f"{self.url} answered with finish_reason {reason!r} and "
                                         f"{'a' if manifest else 'no'} transfer manifest: was the server started with "
                                         "the arguments `eyas.stream.engines.served_command` gives?"}
        return {"rid": rid, "manifest": manifest}

    def extract(self, requests: list[tuple[str, list[int]]]) -> list[dict[str, Any]]:
        from concurrent.futures import ThreadPoolExecutor

        t0 = time.perf_counter()
        with ThreadPoolExecutor(self.threads) as pool:
            results = list(pool.map(lambda r: self._one(*r), requests))
        self.busy_s += time.perf_counter() - t0
        self.tokens += sum(len(ids) for (_, ids), res in zip(requests, results) if "manifest" in res)
        return results

    def stats(self) -> dict[str, float]:
        return {"tokens": self.tokens, "busy_s": self.busy_s}

    def shutdown(self) -> None:
        pass


def served_command(kwargs: dict[str, Any]) -> str:
    """The `vllm serve` arguments of an engine eyas would start (`engine_kwargs`' result), for a server
    given by URL (train.stream.engine_urls)."""
    import json
    import shlex

    skip = {"model", "skip_tokenizer_init", "seed"}
    args = ["vllm", "serve", shlex.quote(str(kwargs["model"]))]
    for k, v in kwargs.items():
        flag = "--" + k.replace("_", "-")
        if k == "enable_prefix_caching" and v is False:  # vLLM's server turns it on by default
            args.append("--no-enable-prefix-caching")
            continue
        if k in skip or v is None or v is False:
            continue
        if v is True:
            args.append(flag)
        elif isinstance(v, dict):
            args += [flag, shlex.quote(json.dumps(v))]
        else:
            args += [flag, shlex.quote(str(v))]
    return " ".join(args)


def start_served(urls: list[str], names: list[str], namespace: str, model: str = "", ranks: int = 1) -> list:
    """A ServedEngine actor per URL (no CPU slot: it waits on HTTP), once each server answers."""
    import ray

    handles = [ray.remote(ServedEngine).options(name=n, namespace=namespace, num_cpus=0,
                                                max_concurrency=CALLS_PER_RANK * ranks + 2)
               .remote(u, n, model) for u, n in zip(urls, names)]
    from eyas.errors import EyasError

    for url, h in zip(urls, handles):
        info = ray.get(h.ready.remote(), timeout=120)
        if "error" in info:
            raise EyasError(f"train.stream.engine_urls: {url} does not answer as a vLLM server ({info['error']}); "
                            "start it with the arguments printed above, or fix the URL")
        print(f"[eyas:train] stream: engine {url} (vLLM {info['vllm']}) ready", flush=True)
    return handles
