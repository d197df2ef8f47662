"""How a decode step's body becomes a graph (`kvtier.sparse.decode_graph`): CUDA's graphs, and on
the CPU a stand-in that replays the recorded body the way a graph replays its kernels, for tests
and operator counts."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from typing import Any, Protocol

import torch

from kvtier.kv.graph_capture import capture
from kvtier.sparse.opcount import unseen as uncounted


class Recorder(Protocol):
    """Makes a body a graph: `record(device, body)` -> (graph, its output), the graph's
    `replay()` running the body's work again on the tensors it recorded."""

    def record(self, device: torch.device, body: Callable[[], Any]) -> tuple[Any, Any]: ...


class CudaRecorder:
    """`Recorder` of CUDA graphs, all in one memory pool, captured by `kvtier.kv.graph_capture`
    (which keeps the pinned host cache that `torch.cuda.graph` empties)."""

    def __init__(self) -> None:
        self._pool: Any = None  # the graphs' one memory pool (after the first capture)

    def record(self, device: torch.device, body: Callable[[], Any]) -> tuple[Any, Any]:
        """Warm up on a side stream, then capture body() on it. The warm-up writes what the replay
        writes again (the same values from the same inputs), so it changes nothing a later step
        reads; its output is dropped."""
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            body()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # NOTE: thread-local: a server's other threads (a host-tier allocation, say) may call
        # CUDA while a request's layer captures, which the global mode would count against it.
        # One pool for all: another graph may reuse a graph's temporaries, and its outputs only
        # live until the model reads them, before the next graph replays (a rerun's selections,
        # which the decode states keep, are copied out of the pool: `_Graph.kept`).
        out = capture(graph, body, side, self._pool, error_mode="thread_local")
        self._pool = graph.pool()
        return graph, out


class ReplayRecorder:
    """A `Recorder` on the CPU, for tests and operator counts: recording runs the body once (as
    a CUDA graph's warm-up does) and keeps it; a replay runs that same body again and writes its
    outputs into the recorded ones, so every value the body took from the host stays that of its
    recording, as in a graph's replay. `unseen`: no `OpCounter` sees either, a replay counted as
    the one launch a graph's is (`opcount.unseen`)."""

    def __init__(self, unseen: bool = False) -> None:
        self.unseen = unseen

    def record(self, device: torch.device, body: Callable[[], Any]) -> tuple[Any, Any]:
        graph = _Replayed(body, self.unseen)
        return graph, graph.out


class _Replayed:
    def __init__(self, body: Callable[[], Any], unseen: bool) -> None:
        self.body, self.unseen = body, unseen
        with uncounted() if self.unseen else nullcontext():
            self.out = body()

    def replay(self) -> None:
        with uncounted("graph replay") if self.unseen else nullcontext():
            _copy_into(self.out, self.body())


def _copy_into(to: Any, new: Any) -> None:
    """A replay's outputs into the recorded ones (tensors, or nested sequences of them)."""
    if isinstance(to, torch.Tensor):
        if to is not new:
            to.copy_(new)
    else:
        for a, b in zip(to, new, strict=True):
            _copy_into(a, b)
