"""CUDA graph capture that leaves PyTorch's pinned-memory cache alone.

`torch.cuda.graph` empties both of PyTorch's caches before it captures: the device allocator's
free blocks, and the pinned host allocator's cached blocks, which it unpins and frees
(`torch._C._host_emptyCache`). The pinned cache is meant to stay: a closed store gives its host
slabs back to it for the next long request (`kvtier.kv.tiers.release_pinned_cache` is the
deliberate release), and a prefill by layer leaves its hidden-state pieces there (4.3 GB at 512K
for Llama-3-8B), which the next such prefill reuses instead of pinning again. Every prefill by
layer was followed by a first decode step of 0.61-0.94 s against 0.08-0.15 by chunk, with the
same graph captures and allocator calls (bench/results/hip_cli_speed_512k_fast_order_ab.json):
that step's first capture unpinned the pieces. `capture` does the rest of `torch.cuda.graph`'s
work; with it that step took 0.10-0.17 s (hip_cli_speed_512k_fast_landmarks_layer_combined.json).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch

T = TypeVar("T")


def capture(
    graph: torch.cuda.CUDAGraph,
    body: Callable[[], T],
    stream: torch.cuda.Stream,
    pool: Any = None,
    error_mode: str = "global",
) -> T:
    """Capture body() into `graph` on `stream` (not the current stream) within memory pool
    `pool` (None: a new one, then `graph.pool()`), as `torch.cuda.graph(graph, pool, stream,
    capture_error_mode=error_mode)` does: the device synchronized and the device allocator's
    free blocks released first; the pinned host cache kept. Returns body()'s output, whose
    memory belongs to the pool."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    with torch.cuda.stream(stream):
        graph.capture_begin(pool, capture_error_mode=error_mode)
        try:
            out = body()
        finally:
            graph.capture_end()
    return out
