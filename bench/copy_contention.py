"""What a batch step's small host->GPU copies and kernels wait for while a tiered run streams.

`kvtier serve` runs a request too long for its page pool over a tiered store on a stream of
its own: per decode token it copies every streamed slice host->GPU in 64 MiB pieces, while
the batch's steps (on a high-priority stream) copy their inputs host->GPU (a few small
pageable copies) and replay a graph. On the H200 the short streams' time per token grew 8.2x
beside such a run (`serve_gpu_24gib_6447dcc.json`, mixed). This measures, with and without a
background stream of queued 64 MiB pinned copies, the latency of: a small pageable copy
(`torch.tensor(list).to(cuda)`, as the batch step makes), a small pinned non-blocking copy, a
small kernel; each from a high-priority stream, synchronized on its own.

    python bench/copy_contention.py          # bench/results/copy_contention.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import write_results


def latencies(op: Callable[[], object], stream: torch.cuda.Stream, reps: int) -> list[float]:
    """Seconds from issuing `op` on `stream` to that stream being done, `reps` times."""
    out = []
    with torch.cuda.stream(stream):
        for _ in range(reps):
            t0 = time.perf_counter()
            op()
            stream.synchronize()
            out.append(time.perf_counter() - t0)
            time.sleep(0.002)  # as a batch step does other work between copies
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--piece-mib", type=int, default=64, help="the background copies' size")
    ap.add_argument("--queued-gib", type=float, default=8.0, help="background bytes queued at once")
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--name", default="copy_contention")
    args = ap.parse_args()
    dev = torch.device("cuda")
    piece = args.piece_mib << 20
    host = torch.empty(piece, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(piece, dtype=torch.uint8, device=dev)
    small_host = torch.zeros(64, dtype=torch.long, pin_memory=True)
    small_dev = torch.zeros(64, dtype=torch.long, device=dev)
    ids = list(range(64))
    fast = torch.cuda.Stream(dev, priority=-1)
    background = torch.cuda.Stream(dev)
    pieces = max(1, int(args.queued_gib * (1 << 30)) // piece)

    ops: dict[str, Callable[[], object]] = {
        "pageable_h2d_64_longs": lambda: small_dev.copy_(torch.tensor(ids), non_blocking=True),
        "pinned_h2d_64_longs": lambda: small_dev.copy_(small_host, non_blocking=True),
        "small_kernel": lambda: small_dev.add_(1),
    }
    rows: dict[str, dict[str, float]] = {}
    for name, op in ops.items():
        quiet = latencies(op, fast, args.reps)
        loaded = []
        for _ in range(args.reps // 10):
            with torch.cuda.stream(background):
                for _ in range(pieces):
                    dst.copy_(host, non_blocking=True)
            loaded += latencies(op, fast, 10)
            background.synchronize()
        rows[name] = {
            "quiet_ms_p50": round(1e3 * statistics.median(quiet), 4),
            "beside_copies_ms_p50": round(1e3 * statistics.median(loaded), 4),
            "beside_copies_ms_max": round(1e3 * max(loaded), 4),
        }
        print(f"{name:<24} {rows[name]}", flush=True)
    t0 = time.perf_counter()
    with torch.cuda.stream(background):
        for _ in range(pieces):
            dst.copy_(host, non_blocking=True)
    background.synchronize()
    gbps = pieces * piece / (time.perf_counter() - t0) / 1e9
    path = write_results(
        args.name,
        {
            "piece_bytes": piece,
            "queued_pieces": pieces,
            "background_h2d_gb_s": round(gbps, 1),
            "latency": rows,
        },
    )
    print(f"background copies {gbps:.1f} GB/s; wrote {path}")


if __name__ == "__main__":
    main()
