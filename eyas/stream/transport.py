"""The only place streamed hidden states move: Mooncake's store, through hs-connectors.

An engine's KV connector (hs-connectors' MooncakeHiddenStatesConnector; on vLLM's CPU build eyas's
eyas/stream/vllm_connector.py) puts each finished request's states [S, K+1, D] and token ids into the
store as one packed object and returns a *manifest* (key, shapes, dtypes, byte offsets) through vLLM;
the trainer rank that asked for the sample fetches the object by its manifest (`Transport.fetch`) and
deletes it (`Transport.discard`). Nothing is written to disk.

The store is a cache, not a queue: with the master's default flags a put into a full store succeeds
and evicts an object nobody has read yet. `Master` therefore always starts `mooncake_master` with
eviction off (`--eviction_high_watermark_ratio=1.0 --eviction_ratio=0.0`): a put that does not fit
fails, the connector publishes an error marker instead, and the sample is asked for again. eyas keeps
the bytes in the store under `train.stream.window_gb` (eyas/stream/source.py), below the store's size.

Mooncake's wheel links libibverbs even for TCP; `load_ibverbs` loads it (and its libnl deps) from
the environment's lib/ibverbs (scripts/vllm-venv.sh unpacks Debian's libibverbs1 there) when the
system has none.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from eyas.errors import EyasError

# exec's `argv[2:]` after asking Linux for SIGTERM when the parent (argv[1]) dies (prctl PR_SET_PDEATHSIG,
# kept across exec); exits at once when the parent is already gone
DIES_WITH_US = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)\n"
    "if os.getppid() != int(sys.argv[1]): sys.exit(143)\n"
    "os.execv(sys.argv[2], sys.argv[2:])\n"
)
IBVERBS = ("libnl-3.so.200", "libnl-route-3.so.200", "libibverbs.so.1")  # in load order
LOCAL = "127.0.0.1"


class TransportError(EyasError):
    """A streamed sample could not be fetched: missing, timed out, damaged, or the engine's put failed."""


def ibverbs_dir() -> Path:
    return Path(sys.prefix) / "lib" / "ibverbs"


def load_ibverbs() -> None:
    """Make libibverbs.so.1 loadable for Mooncake: the system's, else the environment's lib/ibverbs
    (loaded RTLD_GLOBAL: the dynamic linker then resolves Mooncake's dependency by its soname)."""
    if ctypes.util.find_library("ibverbs"):
        return
    here = ibverbs_dir()
    if not (here / IBVERBS[-1]).is_file():
        raise EyasError(f"Mooncake needs libibverbs.so.1 (even for TCP) and neither the system nor {here} has it: "
                        "`apt install libibverbs1`, or run scripts/vllm-venv.sh, which unpacks it into the venv")
    for name in IBVERBS:
        ctypes.CDLL(str(here / name), mode=ctypes.RTLD_GLOBAL)


def library_env() -> dict[str, str]:
    """The environment for Mooncake's own executables (mooncake_master) when libibverbs is the venv's."""
    env = dict(os.environ)
    if not ctypes.util.find_library("ibverbs"):
        env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (str(ibverbs_dir()), env.get("LD_LIBRARY_PATH", "")) if p)
    return env


def free_port(host: str = LOCAL) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def master_binary() -> Path:
    try:
        import mooncake
    except ImportError as e:
        raise EyasError("train.mode=stream needs Mooncake's store: `pip install mooncake-transfer-engine` "
                        "(GPU) or mooncake-transfer-engine-non-cuda (CPU; scripts/vllm-venv.sh installs it)") from e
    path = Path(mooncake.__file__).parent / "mooncake_master"
    if not path.is_file():
        raise EyasError(f"{path} is missing: this Mooncake wheel ships no master; start one yourself and pass "
                        "--train.stream.master=HOST:PORT")
    return path


class Master:
    """A mooncake_master process (eviction off) bound to `host`, logging to `log`; `stop()` ends it."""

    def __init__(self, log: Path, host: str = LOCAL, timeout_s: float = 30.0):
        self.host, self.port, self.log = host, free_port(host), log
        log.parent.mkdir(parents=True, exist_ok=True)
        args = [str(master_binary()), f"-rpc_address={host}", f"-rpc_port={self.port}", f"-metrics_host={host}",
                f"-metrics_port={free_port(host)}", "-eviction_high_watermark_ratio=1.0", "-eviction_ratio=0.0",
                "-enable_metric_reporting=false"]
        with open(log, "ab") as f:  # through DIES_WITH_US: a trainer killed with SIGKILL leaves no master behind
            self.proc = subprocess.Popen([sys.executable, "-c", DIES_WITH_US, str(os.getpid()), *args], stdout=f,
                                         stderr=subprocess.STDOUT, env=library_env(), start_new_session=True)
        self._wait(timeout_s)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def _wait(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise EyasError(f"mooncake_master exited with {self.proc.returncode} at start; its log: {self.log}")
            with socket.socket() as s:
                if s.connect_ex((self.host, self.port)) == 0:
                    return
            time.sleep(0.1)
        self.stop()
        raise EyasError(f"mooncake_master did not listen on {self.address} within {timeout_s:g} s; its log: {self.log}")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def store_config(master: str, segment_bytes: int, buffer_bytes: int = 64 << 20, host: str = LOCAL,
                 protocol: str = "tcp", device: str = "") -> dict[str, Any]:
    """hs-connectors' MooncakeStoreConfig fields (P2PHANDSHAKE: no etcd). `segment_bytes` is the
    memory this client adds to the store (engines add it; trainer ranks read only)."""
    return {"local_hostname": host, "metadata_server": "P2PHANDSHAKE", "master_server_address": master,
            "global_segment_size": int(segment_bytes), "local_buffer_size": int(buffer_bytes),
            "protocol": protocol, "device_name": device, "num_writer_threads": 2}


class Transport:
    """A trainer rank's client of the store: fetch a sample by its manifest, then discard it."""

    def __init__(self, config: dict[str, Any]):
        load_ibverbs()
        from hs_connectors.mooncake_store import MooncakeHiddenStatesStore, MooncakeStoreConfig

        self.config = config
        self.store = MooncakeHiddenStatesStore(MooncakeStoreConfig.from_dict(config)).setup()

    def fetch(self, manifest: dict[str, Any], timeout_s: float) -> dict[str, torch.Tensor]:
        """The sample's tensors; TransportError (naming the key) when the engine's put failed (its
        error marker), the object never came within `timeout_s`, or it does not match its manifest."""
        key = manifest.get("handle", "?")
        try:
            return self.store.get_sample(manifest, timeout=timeout_s)
        except TimeoutError as e:
            raise TransportError(f"object {key} did not reach the store within {timeout_s:g} s "
                                 "(train.stream.fetch_timeout_s)") from e
        except Exception as e:  # hs-connectors' MooncakeIntegrityError and Mooncake status errors
            raise TransportError(f"object {key}: {type(e).__name__}: {e}{self._unreachable(e)}") from e

    def discard(self, key: str) -> None:
        """Remove a sample's object and its error marker (absent ones are fine); TransportError when
        the store does not answer."""
        try:
            self.store.delete_sample(key)
        except Exception as e:  # Mooncake status errors: the master gone (-900), ...
            raise TransportError(f"object {key} could not be removed from Mooncake's store: {type(e).__name__}: "
                                 f"{e}{self._unreachable(e)}") from e

    def _unreachable(self, e: BaseException) -> str:
        """What a Mooncake RPC failure (status -900) means and what to do; "" for other errors."""
        if "status=-900" not in str(e):
            return ""
        return (f" (status -900: Mooncake's master at {self.config['master_server_address']} did not answer; "
                "mooncake_master stopped? Every state in the store is lost: start it again if it is yours "
                "(train.stream.master) and run the same command to resume from the last checkpoint)")

    def exists(self, key: str) -> bool:
        return self.store._require_store().is_exist(key) == 1
