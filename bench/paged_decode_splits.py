"""The paged-decode kernel alone: time per call against its split count, for the page layouts.

Issue 18's one stream at 32K decodes at 8.05-8.30 ms/token on the H200 (target 8), where the
same stream at 1K takes ~5.9: its 4.3 GB of KV a token read at ~2 TB/s, half of HBM. One
sequence of 8 KV heads got `default_splits` = 16 splits (128 programs on 132 SMs; 33 since the
run of 48c4e3a, `paged_decode_splits.json`, showed 32 faster); this measures whether more
programs read faster, and whether the server's page-major pool
(`storage[:, layer]`, pages L x 64 KiB apart) reads slower than a layer's own contiguous pages.

Llama-3-8B shapes (32 query heads, 8 KV heads, head dim 128, 16-token pages, bf16). For each
case (batch, context) and layout, every split count in `--splits`: the median of `--iters`
calls (a CUDA graph of the call replayed back to back, as the server's decode step is;
the first run, `paged_decode_splits_single_calls.json`, timed single calls: their host
launches), the KV read rate, and the largest difference from the 16-split output.

    python bench/paged_decode_splits.py              # $OUT/paged_decode_splits.json
    TRITON_INTERPRET=1 python bench/paged_decode_splits.py --device cpu --small   # a smoke run
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import write_results
from kvtier.attention.paged_decode import default_splits, paged_decode

H_Q, H_KV, D, PAGE, LAYERS = 32, 8, 128, 16, 32
CASES = {"b1-32k": (1, 32768), "b1-1k": (1, 1024), "b32-1k": (32, 1024), "b64-1k": (64, 1024)}
SMALL = {"b1-256": (1, 256), "b4-64": (4, 64)}


def pages_of(layout: str, num_pages: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """One layer's pages [num_pages, P, 2, H_kv, D]: contiguous ("layer"), or the strided view
    of a page-major pool of LAYERS layers ("page", as `PagedKVStore` keeps them)."""
    if layout == "layer":
        return torch.randn(num_pages, PAGE, 2, H_KV, D, dtype=dtype, device=device)
    storage = torch.randn(num_pages, LAYERS, PAGE, 2, H_KV, D, dtype=dtype, device=device)
    return storage[:, LAYERS // 2]


def time_call(fn: Any, iters: int, device: torch.device, reps: int = 20) -> float:
    """Median seconds of one `fn()`: on CUDA, `fn` captured as a graph and replayed `reps` times
    back to back between two events (as the server replays its decode step: one call's host
    launches would otherwise be what is timed, ~0.24 ms on the H200), median over `iters` such
    runs; elsewhere the wall clock of single calls."""
    fn()
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        graph.replay()
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(reps):
                graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3 / reps)
        return statistics.median(times)
    import time

    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run_case(
    batch: int, context: int, layout: str, splits: list[int], iters: int, device: torch.device
) -> dict[str, Any]:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    per_seq = -(-context // PAGE)
    pages = pages_of(layout, batch * per_seq + 1, dtype, device)
    g = torch.Generator().manual_seed(0)
    order = torch.randperm(batch * per_seq, generator=g)  # scattered pages, as a busy pool's
    tables = order.view(batch, per_seq).to(torch.int32).to(device)
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    q = torch.randn(batch, H_Q, D, dtype=dtype, device=device)
    kv_bytes = batch * context * 2 * H_KV * D * pages.element_size()
    ref = paged_decode(q, pages, tables, lens, num_splits=16).float()
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else None
    rows = []
    for s in splits:
        out = paged_decode(q, pages, tables, lens, num_splits=s).float()
        t = time_call(lambda s=s: paged_decode(q, pages, tables, lens, num_splits=s), iters, device)
        rows.append(
            {
                "splits": s,
                "us": round(t * 1e6, 2),
                "kv_gb_per_s": round(kv_bytes / t / 1e9, 1),
                "max_abs_vs_16": float((out - ref).abs().max()),
            }
        )
    best = min(rows, key=lambda r: r["us"])
    return {
        "batch": batch,
        "context": context,
        "layout": layout,
        "default_splits": default_splits(batch, H_KV, sms),
        "kv_bytes": kv_bytes,
        "rows": rows,
        "best_splits": best["splits"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--splits", default="1,2,4,8,16,32,64,128", help="split counts to time")
    ap.add_argument("--layouts", default="layer,page", help="page layouts: layer, page")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--small", action="store_true", help="tiny cases (for a CPU smoke run)")
    ap.add_argument("--name", default="paged_decode_splits")
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(
            "no CUDA device: run on a GPU, or with --device cpu --small under TRITON_INTERPRET=1"
        )
    splits = [int(s) for s in args.splits.split(",")]
    results = []
    for name, (batch, context) in (SMALL if args.small else CASES).items():
        for layout in args.layouts.split(","):
            r = run_case(batch, context, layout, splits, args.iters, device)
            r["case"] = name
            results.append(r)
            line = "  ".join(f"{x['splits']}:{x['us']:.0f}us" for x in r["rows"])
            print(
                f"{name:8} {layout:5} default {r['default_splits']:3}  best {r['best_splits']:3}  {line}",
                flush=True,
            )
    write_results(
        args.name,
        {"shapes": "llama-3-8b: 32 query heads, 8 KV heads, head dim 128, 16-token pages", "cases": results},
    )


if __name__ == "__main__":
    main()
