"""CPU decode attention over host extents: KV read rate of each backend against the machine's
memory read rate, and (on a CUDA machine) the rates when DMA copies run at the same time.

    python bench/cpu_attention.py --name cpu_attention_cpu            # any machine
    python bench/cpu_attention.py --combined --name cpu_attention_h200  # CUDA: with H2D copies

Memory read rate: `torch.sum` over 1 GiB of fp32 with the same thread count. Attention: one
query token, Llama-3-8B head shapes (head dim 128, 4 query heads per KV head), slices of 1, 2
and 8 KV heads holding ~256 MiB (past the caches), in 64 MiB extents as the store keeps them.
Each figure is the best of `--reps` runs (the development machine is shared: the load average is
written next to them). The H200 predictions are the planner's (`kvtier.planner.cpu_split`)
with the CPU attention rate predicted from the fraction of the memory read rate measured here.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import beside_h2d, write_results
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


def combined(dec: CpuDecoder) -> dict[str, float]:
    """CPU attention (bf16, 1 KV head per slice) while a second thread keeps pinned H2D copies
    running: both rates, measured over the same interval (`bench.common.beside_h2d`; since
    2026-12-07 the rate alone is its 2 s mean too, not the best of --reps)."""
    exts, length = slice_extents(1, torch.bfloat16, 1 << 30)
    q = torch.randn(4, 128).to(torch.bfloat16)
    dec.attend(q, exts, length)  # warm-up
    rates = beside_h2d(lambda: dec.attend(q, exts, length), length * 2 * 128 * 2)
    return {
        "cpu_attention_alone_gb_s": rates["alone_gb_s"],
        "h2d_alone_gb_s": rates["h2d_alone_gb_s"],
        "cpu_attention_with_h2d_gb_s": rates["beside_h2d_gb_s"],
        "h2d_with_cpu_attention_gb_s": rates["h2d_beside_gb_s"],
        "combined_gb_s": rates["combined_gb_s"],
    }


def h200_predictions(scenarios: dict[str, float]) -> dict[str, Any]:
    """The planner's split for llama-3-8b on the H200 preset (24 GB) for each predicted CPU
    attention rate (B/s), under the default contention model (DMA and CPU together no faster
    than the host's 102 GB/s read rate, issue 23's measurement) and with none."""
    from kvtier.loading.presets import preset_config
    from kvtier.planner.cpu_split import decode_step_s
    from kvtier.planner.hardware import HARDWARE
    from kvtier.planner.placement import plan_kv

    cfg = preset_config("llama-3-8b")
    out: dict[str, Any] = {"host_read_gb_s": 102.0, "pcie_gb_s": 55.0, "rows": []}
    for scenario, cpu_bw in scenarios.items():
        base = replace(HARDWARE["h200"], cpu_attention_bw=cpu_bw)
        for contention, hw in (
            ("host read rate", base),
            ("none", replace(base, host_combined_bw=base.pcie_bw + cpu_bw)),
        ):
            for ctx in (131072, 524288):
                for policy, group in (("auto", None), ("head", 1), ("head", 2)):
                    plan = plan_kv(
                        cfg,
                        ctx,
                        policy=policy,
                        group_size=group,
                        gpu_budget=24 * 10**9,
                        hardware=hw,
                        cpu_attention="auto",
                    )
                    shape = plan.slice_shape(cfg)
                    out["rows"].append(
                        {
                            "cpu_rate": scenario,
                            "cpu_attention_gb_s": round(cpu_bw / 1e9, 2),
                            "contention": contention,
                            "context": ctx,
                            "policy": policy,
                            "group_size": plan.group_size,
                            "resident_slices": plan.resident_slices,
                            "streamed_slices": plan.streamed_slices,
                            "cpu_slices": plan.cpu_slices,
                            "decode_s_link_only": round(decode_step_s(cfg, shape, hw, 2, 0), 4),
                            "decode_s_split": round(decode_step_s(cfg, shape, hw, 2, plan.cpu_slices), 4),
                        }
                    )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--name", default="cpu_attention_cpu")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", default="1,2", help="worker threads to measure, comma-separated")
    ap.add_argument("--combined", action="store_true", help="also measure with H2D copies (CUDA)")
    args = ap.parse_args()
    rows: list[dict[str, Any]] = []
    memory: dict[str, float] = {}
    load_before = os.getloadavg()
    x = torch.ones(256 << 20, dtype=torch.float32)  # 1 GiB for the memory read rate
    slices = {
        (dtype, g): slice_extents(g, dtype, 256 << 20)
        for dtype in (torch.bfloat16, torch.float32)
        for g in (1, 8)
    }
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        decoders = {b: CpuDecoder(threads, backend=b) for b in ("native", "torch")}
        best: dict[Any, float] = {}

        def timed(key: Any, fn: Any) -> None:
            t = time.perf_counter()
            fn()
            best[key] = min(best.get(key, float("inf")), time.perf_counter() - t)

        # NOTE: interleaved, so the memory read rate and every kernel see the same machine load.
        for _ in range(args.reps):
            timed("sum", x.sum)
            for (dtype, g), (exts, length) in slices.items():
                q = torch.randn(g * 4, 128).to(dtype)
                for b, dec in decoders.items():
                    timed((b, dtype, g), lambda: dec.attend(q, exts, length))
        memory[str(threads)] = x.numel() * 4 / best["sum"] / 1e9
        for (dtype, g), (exts, length) in slices.items():
            kv_bytes = length * 2 * g * 128 * exts[0].element_size()
            for b in decoders:
                gbps = kv_bytes / best[(b, dtype, g)] / 1e9
                row = {
                    "backend": b,
                    "threads": threads,
                    "dtype": str(dtype).removeprefix("torch."),
                    "kv_heads_per_slice": g,
                    "kv_read_gb_s": round(gbps, 3),
                    "fraction_of_memory_read": round(gbps / memory[str(threads)], 3),
                }
                rows.append(row)
                print(row, flush=True)
        for dec in decoders.values():
            dec.close()
    native = {(r["threads"], r["kv_heads_per_slice"]): r for r in rows if r["backend"] == "native"}
    bf16 = [r for r in rows if r["backend"] == "native" and r["dtype"] == "bfloat16"]
    fraction = max(r["fraction_of_memory_read"] for r in bf16 if r["threads"] == max(t for t, _ in native))
    per_core = max(r["kv_read_gb_s"] for r in bf16 if r["threads"] == 1) * 1e9
    scenarios = {
        "fraction of the read rate measured here": fraction * 102e9,
        "1-thread rate measured here x 15 workers": min(15 * per_core, 102e9),
    }
    results: dict[str, Any] = {
        "load_average_before_after": [load_before, os.getloadavg()],
        "memory_read_gb_s": memory,
        "shapes": {"head_dim": 128, "q_per_kv": 4, "slice_bytes": 256 << 20, "extent_bytes": EXTENT_BYTES},
        "attention": rows,
        "native_bf16_best_fraction_of_memory_read": fraction,
        "native_bf16_best_1_thread_gb_s": per_core / 1e9,
        "h200_predictions": h200_predictions(scenarios),
    }
    if args.combined:
        dec = CpuDecoder()
        results["combined"] = combined(dec)
        dec.close()
    print(write_results(args.name, results))


if __name__ == "__main__":
    main()
