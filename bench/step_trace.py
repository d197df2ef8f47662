"""`traced_step`: one decode step of a store under torch.profiler, summed by stream: whether the
link stands idle between loads (and for how long), or copies slowly; each stream's kernel time.
Used by `bench/tiered_store.py --trace-step` (e.g. int4_512k_g1_trace.json: over int4 the link
idled 55 ms of a 0.369 s step, lossless 1.5 ms of 1.115 s)."""

from __future__ import annotations

import itertools
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch


def traced_step(store: Any, model: Any, token: torch.Tensor) -> dict[str, Any]:
    """One decode step under torch.profiler (CUDA activity): its wall seconds; the host-to-device
    copies' count, bytes and busy seconds (their intervals merged: idle link = wall - busy); the
    kernels' busy seconds per stream; the longest gaps between consecutive H2D copies."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        store.begin_step(1)
        model(token.view(1), store)
        store.end_step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    # Stream ids and copy sizes are in the chrome trace's events (kineto), not in prof.events().
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        trace = json.loads(Path(f.name).read_text())
    copies: list[tuple[float, float]] = []
    kernels: dict[str, list[tuple[float, float]]] = {}
    copy_bytes = 0
    for ev in trace.get("traceEvents", []):
        cat, args = ev.get("cat", ""), ev.get("args", {})
        if cat not in ("kernel", "gpu_memcpy") or "dur" not in ev:
            continue
        span = (ev["ts"] / 1e6, (ev["ts"] + ev["dur"]) / 1e6)
        if cat == "gpu_memcpy" and "HtoD" in ev.get("name", ""):
            copies.append(span)
            copy_bytes += int(args.get("bytes", 0))
        elif cat == "kernel":
            kernels.setdefault(f"stream {args.get('stream', '?')}", []).append(span)

    def busy(spans: list[tuple[float, float]]) -> float:
        total, end = 0.0, -1.0
        for a, b in sorted(spans):
            if b > end:
                total += b - max(a, end)
                end = b
        return total

    ordered = sorted(copies)
    gaps = sorted((b[0] - a[1] for a, b in itertools.pairwise(ordered)), reverse=True)
    return {
        "wall_s": wall,
        "h2d_copies": len(copies),
        "h2d_bytes": copy_bytes,
        "h2d_busy_s": busy(copies),
        "h2d_gap_s_total": sum(g for g in gaps if g > 0),
        "h2d_gaps_ms_top": [round(g * 1e3, 3) for g in gaps[:10]],
        "h2d_gaps_over_50us": sum(g > 50e-6 for g in gaps),
        "h2d_gap_s_over_50us": sum(g for g in gaps if g > 50e-6),
        "kernel_busy_s_by_stream": {k: busy(v) for k, v in kernels.items()},
        "kernel_count_by_stream": {k: len(v) for k, v in kernels.items()},
        "top_cuda_ops": [
            (e.key, e.count, round(e.device_time_total / 1e3, 2))
            for e in sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:12]
        ],
    }
