"""CPU decode attention over host extents: KV read rate of each backend against the machine's
memory read rate, and (on a CUDA machine) the rates when DMA copies run at the same time.

    python bench/cpu_attention.py --name cpu_attention_cpu            # any machine
    python bench/cpu_attention.py --combined --name cpu_attention_h200  # CUDA: with H2D copies

Memory read rate: `torch.sum` over 1 GiB of fp32 with the same thread count. Attention: one
query token, Llama-3-8B head shapes (head dim 128, 4 query heads per KV head), slices of 1, 2
and 8 KV heads holding ~256 MiB (past the caches), in 64 MiB extents as the store keeps them.
Each figure is the best of `--reps` runs (the development machine is shared). The H200
predictions of the planner come from `kvtier.planner.cpu_split` with the rates written here.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import write_results
from kvtier.attention.cpu_decode import CpuDecoder

EXTENT_BYTES = 64 << 20


def best_of(fn: Any, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def memory_read_gbps(threads: int, reps: int) -> float:
    torch.set_num_threads(threads)
    x = torch.ones(256 << 20, dtype=torch.float32)  # 1 GiB
    return x.numel() * 4 / best_of(x.sum, reps) / 1e9


def slice_extents(g: int, dtype: torch.dtype, nbytes: int) -> tuple[list[torch.Tensor], int]:
    d = 128
    token = 2 * g * d * torch.empty((), dtype=dtype).element_size()
    e = EXTENT_BYTES // token
    n = max(1, nbytes // EXTENT_BYTES)
    pin = torch.cuda.is_available()
    exts = [torch.randn(e, 2, g, d).to(dtype) for _ in range(n)]
    if pin:
        exts = [x.pin_memory() for x in exts]
    return exts, n * e


def attention_gbps(dec: CpuDecoder, g: int, dtype: torch.dtype, reps: int, nbytes: int = 256 << 20) -> float:
    exts, length = slice_extents(g, dtype, nbytes)
    q = torch.randn(g * 4, 128).to(dtype)
    kv_bytes = length * 2 * g * 128 * exts[0].element_size()
    return kv_bytes / best_of(lambda: dec.attend(q, exts, length), reps) / 1e9


def combined(dec: CpuDecoder, reps: int) -> dict[str, float]:
    """CPU attention (bf16, 1 KV head per slice) while a second thread keeps pinned H2D copies
    running: both rates, measured over the same interval."""
    exts, length = slice_extents(1, torch.bfloat16, 1 << 30)
    q = torch.randn(4, 128).to(torch.bfloat16)
    src = torch.empty(1 << 30, dtype=torch.uint8).pin_memory()
    dst = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()
    stop = threading.Event()
    copied = [0]

    def copier() -> None:
        with torch.cuda.stream(stream):
            while not stop.is_set():
                dst.copy_(src, non_blocking=True)
                stream.synchronize()
                copied[0] += src.numel()

    kv_bytes = length * 2 * 128 * 2
    alone_cpu = kv_bytes / best_of(lambda: dec.attend(q, exts, length), reps) / 1e9
    t = time.perf_counter()
    dst.copy_(src)
    torch.cuda.synchronize()
    alone_h2d = src.numel() / (time.perf_counter() - t) / 1e9
    th = threading.Thread(target=copier)
    th.start()
    time.sleep(0.2)
    c0, t0 = copied[0], time.perf_counter()
    n = 0
    while time.perf_counter() - t0 < 2.0:
        dec.attend(q, exts, length)
        n += 1
    t1, c1 = time.perf_counter(), copied[0]
    stop.set()
    th.join()
    cpu = n * kv_bytes / (t1 - t0) / 1e9
    h2d = (c1 - c0) / (t1 - t0) / 1e9
    return {
        "cpu_attention_alone_gb_s": alone_cpu,
        "h2d_alone_gb_s": alone_h2d,
        "cpu_attention_with_h2d_gb_s": cpu,
        "h2d_with_cpu_attention_gb_s": h2d,
        "combined_gb_s": cpu + h2d,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--name", default="cpu_attention_cpu")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", default="1,2", help="worker threads to measure, comma-separated")
    ap.add_argument("--combined", action="store_true", help="also measure with H2D copies (CUDA)")
    args = ap.parse_args()
    rows: list[dict[str, Any]] = []
    memory: dict[str, float] = {}
    for threads in (int(t) for t in args.threads.split(",")):
        memory[str(threads)] = memory_read_gbps(threads, args.reps)
        for backend in ("native", "torch"):
            dec = CpuDecoder(threads, backend=backend)
            for dtype in (torch.bfloat16, torch.float32):
                for g in (1, 2, 8):
                    gbps = attention_gbps(dec, g, dtype, args.reps)
                    row = {
                        "backend": backend,
                        "threads": threads,
                        "dtype": str(dtype).removeprefix("torch."),
                        "kv_heads_per_slice": g,
                        "kv_read_gb_s": round(gbps, 3),
                        "fraction_of_memory_read": round(gbps / memory[str(threads)], 3),
                    }
                    rows.append(row)
                    print(row, flush=True)
            dec.close()
    results: dict[str, Any] = {
        "memory_read_gb_s": memory,
        "shapes": {"head_dim": 128, "q_per_kv": 4, "slice_bytes": 256 << 20, "extent_bytes": EXTENT_BYTES},
        "attention": rows,
    }
    if args.combined:
        dec = CpuDecoder()
        results["combined"] = combined(dec, args.reps)
        dec.close()
    print(write_results(args.name, results))


if __name__ == "__main__":
    main()
