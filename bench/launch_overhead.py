"""Host time of one Triton launch on CUDA: through Triton's JIT dispatch and straight to the
compiled kernel, beside a torch operator's, and of the pruning calls HiP's decode makes.

HiP's decode over offloaded slices is bound by host work: on an H100 a stage-2 rerun of eight
4-head slices kept the GPU busy 2.6 ms of ~21 ms, and cProfile put Triton's Python launch path
(`JITFunction.run`: binding and specializing every argument, the cache key, the launch
metadata) at ~60 us a launch, a dozen launches a slice
(`bench/results/hip_decode_profile_lean_512k_int4_probes_g4_cprofile_stage1.json`). cProfile
inflates Python-heavy code, so this measures it plainly: `--launches` back-to-back launches of
tiny kernels (the GPU finishes each before the host issues the next), host time each:

    torch_add       x.add_(1), one torch operator
    jit_2_args      a 2-argument Triton kernel through `kernel[grid](...)` (JITFunction.run)
    direct_2_args   the same kernel through its CompiledKernel (`compiled[grid](*args)`)
    jit_40_args     a kernel with 22 runtime and 18 constexpr arguments, as `_bisect_kernel` has
    direct_40_args  the same through its CompiledKernel
    bisect_decode   `bisect_triton` as a decode stage calls it (one query block, 4 KV heads of
                    4 query heads, 2,048 chunks of 8 candidates: `lean`'s last stage), wrapper
                    included; `head_score` adds `softmax_head_score_triton` on its rows

The direct rows skip the dispatch only: a caller that keeps the CompiledKernel must itself know
the arguments' specialization (dtypes, alignment, which integers are 1 or multiples of 16) is
the same as at the first launch, so the gap is what such a cache could save, not a measure of a
safe one.

    python bench/launch_overhead.py --name launch_overhead

CUDA only (Triton's interpreter on the CPU has no launcher to time). Results: $OUT/NAME.json.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import write_results


@triton.jit
def _touch2(x_ptr, n):  # type: ignore[no-untyped-def]
    i = tl.arange(0, 16)
    tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < n) + 1, mask=i < n)


@triton.jit
def _touch40(  # type: ignore[no-untyped-def]
    x_ptr, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15, a16, a17, a18, a19, a20, n,
    C1: tl.constexpr, C2: tl.constexpr, C3: tl.constexpr, C4: tl.constexpr, C5: tl.constexpr,
    C6: tl.constexpr, C7: tl.constexpr, C8: tl.constexpr, C9: tl.constexpr, C10: tl.constexpr,
    C11: tl.constexpr, C12: tl.constexpr, C13: tl.constexpr, C14: tl.constexpr, C15: tl.constexpr,
    C16: tl.constexpr, C17: tl.constexpr, C18: tl.constexpr,
):  # fmt: skip
    i = tl.arange(0, 16)
    extra = a1 + a2 + a3 + a4 + a5 + a6 + a7 + a8 + a9 + a10 + a11 + a12 + a13 + a14 + a15 + a16 + a17
    extra = extra + a18 + a19 + a20 + C1 + C2 + C3 + C4 + C5 + C6 + C7 + C8 + C9 + C10 + C11 + C12
    extra = extra + C13 + C14 + C15 + C16 + C17 + C18
    tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < n) + extra, mask=i < n)


def host_us(fn: Callable[[], Any], launches: int) -> float:
    """Host microseconds a call of fn, over `launches` calls after 20 untimed ones (which also
    compile), the device drained before and after."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(launches):
        fn()
    dt = time.perf_counter() - t
    torch.cuda.synchronize()
    return round(dt / launches * 1e6, 2)


def direct(fn: Callable[[], Any], launches: int) -> float | str:
    """`host_us` of a call straight to the compiled kernel, or why Triton refused it (its
    launcher's calling convention is not public API: a changed one costs this row, not the run)."""
    try:
        return host_us(fn, launches)
    except (IndexError, TypeError, ValueError) as e:
        return f"error: {type(e).__name__}: {e}"


def bisect_case(dev: torch.device) -> tuple[Callable[[], Any], Callable[[], Any]]:
    """`bisect_triton` and it plus the softmax head score, at a decode stage's shapes (`lean`'s
    last stage: 16K candidates in 8-token chunks, one query of 4 query heads a KV head)."""
    from kvtier.sparse.triton_bisect import bisect_triton
    from kvtier.sparse.triton_head_score import softmax_head_score_triton

    g, r, d, chunk, n = 4, 4, 128, 8, 16384
    keys = torch.randn(n, g, d, device=dev, dtype=torch.bfloat16)
    q = torch.randn(1, 1, g, r, d, device=dev, dtype=torch.bfloat16)
    cand = torch.arange(n, device=dev)[None]
    lengths = torch.full((1, n // chunk), chunk, device=dev, dtype=torch.long)

    def scores(per_row: bool) -> torch.Tensor:
        return bisect_triton(q, keys, cand, 0, lengths, chunk, mode="absolute", tables=None, per_row=per_row)

    return (lambda: scores(False)), (lambda: softmax_head_score_triton(scores(True), lengths, d**-0.5))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--launches", type=int, default=2000, help="timed calls a row")
    ap.add_argument("--name", default="launch_overhead", help="write $OUT/NAME.json (else bench/results/)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("launch_overhead: needs CUDA (Triton's interpreter on the CPU has no launcher to time)")
    dev = torch.device("cuda")
    x = torch.zeros(16, device=dev)
    grid = (1,)
    grid3 = (1, 1, 1)  # a compiled kernel's launcher indexes all three dimensions
    ints = list(range(1, 21))  # a1..a20: 1 and multiples of 16 specialize; these mostly do not
    consts = list(range(1, 19))
    k2 = _touch2[grid](x, 16)
    k40 = _touch40[grid](x, *ints, 16, *consts)
    bisect, scored = bisect_case(dev)
    rows = {
        "torch_add": host_us(lambda: x.add_(1), args.launches),
        "jit_2_args": host_us(lambda: _touch2[grid](x, 16), args.launches),
        "direct_2_args": direct(lambda: k2[grid3](x, 16), args.launches),
        "jit_40_args": host_us(lambda: _touch40[grid](x, *ints, 16, *consts), args.launches),
        "direct_40_args": direct(lambda: k40[grid3](x, *ints, 16, *consts), args.launches),
        "bisect_decode": host_us(bisect, args.launches // 4),
        "bisect_decode_head_score": host_us(scored, args.launches // 4),
    }
    for name, us in rows.items():
        print(f"{name:26s} {us:8.2f} us a call" if isinstance(us, float) else f"{name:26s} {us}")
    path = write_results(args.name, {"launches": args.launches, "host_us_per_call": rows})
    print(f"-> {path}")


if __name__ == "__main__":
    main()
