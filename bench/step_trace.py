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

SMALL = 1 << 20  # bytes: an H2D copy this small is not a KV load


def small_copy_queueing(small: list[tuple[float, float]], big: list[tuple[float, float]]) -> dict[str, Any]:
    """Whether small H2D copies (spans, seconds) wait for the big ones: how many start within
    10 us of a big copy's end (queued behind it on a copy engine), and how many start while one
    is running (another engine took them)."""
    after = sum(any(0 <= a - e <= 10e-6 for _, e in big) for a, _ in small)
    during = sum(any(s < a < e for s, e in big) for a, _ in small)
    return {
        "small_h2d_copies": len(small),
        "small_h2d_right_after_big": after,
        "small_h2d_during_big": during,
    }


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
    big: list[tuple[float, float]] = []  # H2D copies of SMALL bytes or more (KV loads)
    small: list[tuple[float, float]] = []  # the others (e.g. a layer's CPU results)
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
            (small if int(args.get("bytes", 0)) < SMALL else big).append(span)
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
        **small_copy_queueing(small, big),
        "kernel_busy_s_by_stream": {k: busy(v) for k, v in kernels.items()},
        "kernel_count_by_stream": {k: len(v) for k, v in kernels.items()},
        "top_cuda_ops": [
            (e.key, e.count, round(e.device_time_total / 1e3, 2))
            for e in sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:12]
        ],
    }
