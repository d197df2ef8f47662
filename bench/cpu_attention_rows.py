"""CPU decode attention over packed KV rows (KIVI int2/int4/int8, FP8; `CpuDecoder.start_rows`) against
the same tokens in bf16 extents: issue 23's CPU side of int4 host KV.

    python bench/cpu_attention_rows.py --name cpu_attention_rows_cpu --threads 1

One query token, Llama-3-8B head shapes (head dim 128, 4 query heads per KV head), a slice of
`--kv-heads` KV heads and `--tokens` tokens (default 65,536: 256 MiB in bf16 at 8 heads, past the
caches), rows in 16 MiB extents as the store's packed tier keeps them. Each figure is the best
of `--reps` interleaved runs; the load average is written next to them (the development machine
is shared). Reported per case: seconds per call, tokens attended per second, bytes read per
second (packed bytes for rows), and the speed-up over bf16 at the same thread count. On AVX-512
targets `bf16-narrow` and `kivi4-narrow` are those on the 8-float paths
(`kvtier.attention.cpu_decode.wide_vectors`).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import beside_h2d, write_results
from kvtier.attention.cpu_decode import CpuDecoder, wide_vectors
from kvtier.policies.quant import Fp8Codec, KiviCodec

EXTENT_BYTES = 64 << 20  # bf16 extents, as the store's host tier
ROWS_EXTENT_BYTES = 16 << 20  # packed rows, as kvtier.planner.packed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--name", default="cpu_attention_rows_cpu")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", default="1,2", help="decoder threads to measure, comma-separated")
    ap.add_argument("--tokens", type=int, default=65536)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--bits", default="4,8,2", help="KIVI code widths, comma-separated")
    ap.add_argument("--no-fp8", action="store_true", help="leave out FP8 rows (Fp8Codec)")
    ap.add_argument(
        "--combined",
        action="store_true",
        help="CUDA: also each case at the last --threads count while pinned H2D copies run "
        "(a decode step's link beside the CPU's slices), both rates",
    )
    args = ap.parse_args()
    g, d, r, n = args.kv_heads, 128, 4, args.tokens
    load_before = os.getloadavg()
    gen = torch.Generator().manual_seed(0)
    kv = torch.randn(n, 2, g, d, generator=gen) + torch.randn(1, 2, g, d, generator=gen) * 3
    per_extent = EXTENT_BYTES // (2 * g * d * 2)
    bf16 = list(kv.to(torch.bfloat16).split(per_extent))
    cases: dict[str, tuple[Any, list[torch.Tensor], int, int]] = {"bf16": (None, bf16, n, n * 2 * g * d * 2)}
    if wide_vectors() is not None:  # the 8-float path beside the AVX-512 one
        cases["bf16-narrow"] = cases["bf16"]
    for bits in (int(b) for b in args.bits.split(",")):
        codec = KiviCodec(bits=bits)
        rows = codec.pack(kv)
        per = max(1, ROWS_EXTENT_BYTES // rows.shape[1])
        cases[f"kivi{bits}"] = (codec, list(rows.split(per)), rows.shape[0], rows.numel())
        if bits == 4 and wide_vectors() is not None:  # the 8-float path beside the AVX-512 one
            cases["kivi4-narrow"] = cases["kivi4"]
    if not args.no_fp8:
        fp8 = Fp8Codec()
        rows = fp8.pack(kv)
        per = max(1, ROWS_EXTENT_BYTES // rows.shape[1])
        cases["fp8"] = (fp8, list(rows.split(per)), rows.shape[0], rows.numel())
    del kv
    q = torch.randn(g * r, d, generator=gen)
    results: list[dict[str, Any]] = []
    for threads in (int(t) for t in args.threads.split(",")):
        dec = CpuDecoder(threads, backend="native")
        best: dict[str, float] = {}
        for _ in range(args.reps + 1):  # NOTE: the first round warms up (builds, first touch)
            for name, (codec, exts, units, _) in cases.items():
                wide_vectors(not name.endswith("-narrow"))
                t0 = time.perf_counter()
                if codec is None:
                    dec.attend(q, exts, units)
                else:
                    pending = dec.start_rows(q, codec, exts, units, g, d)
                    assert pending.native
                    pending.result()
                best[name] = min(best.get(name, float("inf")), time.perf_counter() - t0)
        dec.close()
        for name, (_, _, _, nbytes) in cases.items():
            s = best[name]
            row = {
                "case": name,
                "threads": threads,
                "seconds": round(s, 5),
                "tokens_per_s": round(n / s),
                "read_gb_s": round(nbytes / s / 1e9, 3),
                "bytes_vs_bf16": round(nbytes / cases["bf16"][3], 4),
                "speedup_vs_bf16": round(best["bf16"] / s, 3),
            }
            results.append(row)
            print(row, flush=True)
    combined: dict[str, dict[str, float]] = {}
    if args.combined:
        dec = CpuDecoder(threads, backend="native")
        for name, (codec, exts, units, nbytes) in cases.items():
            wide_vectors(not name.endswith("-narrow"))
            if codec is None:
                fn = functools.partial(dec.attend, q, exts, units)
            else:
                fn = lambda c=codec, e=exts, u=units: dec.start_rows(q, c, e, u, g, d).result()  # noqa: E731
            combined[name] = {"threads": threads, **beside_h2d(fn, nbytes)}
            print(name, combined[name], flush=True)
        dec.close()
    out = {
        "load_average_before_after": [load_before, os.getloadavg()],
        "shapes": {"tokens": n, "kv_heads": g, "head_dim": d, "q_per_kv": r, "kivi_group": 32},
        "data": "synthetic: Gaussian KV with a per-channel offset, random query",
        "results": results,
        "beside_h2d": combined,
    }
    print(write_results(args.name, out))


if __name__ == "__main__":
    main()
