"""hs-connectors' MooncakeHiddenStatesConnector without an accelerator: for vLLM's CPU build only.

vLLM imports this module inside its engine process when a stream engine runs on vLLM's CPU platform
(`kv_connector_module_path="eyas.stream.vllm_connector"`, chosen by eyas/stream/engines.py); on GPUs
hs-connectors' own connector is used and this file is never imported.

What it changes (hs-connectors 0.9.0): the stock connector asks `torch.accelerator` for a stream
module to run its cache -> staging copy on a side stream, and fails without one ("No accelerator is
available."). Here the hidden-state cache is host memory, so the copy runs on the writer thread with
no stream and no event: `_device()` returns a module whose Stream, Event and stream() do nothing.
Everything else -- the packed layout, the manifest vLLM returns, the put into Mooncake, the error
marker on a failed put -- is the stock connector's. The staging buffer falls back to pageable memory
(hs-connectors logs "Pinned host memory unavailable" once per buffer).
"""

from __future__ import annotations

import contextlib

from eyas.stream.transport import load_ibverbs

load_ibverbs()  # before hs-connectors imports Mooncake's store, in vLLM's engine process

from hs_connectors.mooncake_hidden_states_connector import MooncakeHiddenStatesConnector  # noqa: E402


class _Nothing:
    """A stream or event on a host without an accelerator: everything is already done."""

    def record(self, *args) -> None:
        pass

    def wait_event(self, *args) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class _Host:
    """Stands in for `torch.cuda` as the connector uses it (Stream, Event, stream(s))."""

    Stream = _Nothing
    Event = _Nothing

    @staticmethod
    def stream(_s):
        return contextlib.nullcontext()


class CPUMooncakeHiddenStatesConnector(MooncakeHiddenStatesConnector):
    """MooncakeHiddenStatesConnector whose cache -> Mooncake copy runs on the host."""

    def _device(self):
        return _Host
