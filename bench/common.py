"""Helpers shared by the GPU benchmarks: machine facts, timing, JSON output."""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def cpu_model() -> dict[str, Any]:
    """The host CPU's model name and the vector extensions the native CPU kernels can use (from
    /proc/cpuinfo; empty where there is none): CPU-attention rates differ between hosts."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    fields = {
        k.strip(): v.strip() for k, v in (ln.split(":", 1) for ln in text.splitlines()[:40] if ":" in ln)
    }
    flags = set(fields.get("flags", "").split())
    wanted = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "avx512_fp16", "amx_bf16")
    name = fields.get("model name", "")
    return {"cpu_model": name, "cpu_flags": [f for f in wanted if f in flags]} if name else {}


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        **cpu_model(),
    }
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(gpu=p.name, gpu_total_bytes=p.total_memory, cuda=torch.version.cuda)
        info.update(link_rates())
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    return info


def cuda_ms(fn: Callable[[], Any], iters: int, warmup: int = 3) -> float:
    """Median CUDA-event time of fn() in ms over `iters` calls, after `warmup` untimed calls
    (which also compile Triton kernels)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    torch.cuda.synchronize()
    t = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t, out


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def pinned_h2d_gbps(nbytes: int = 1 << 30) -> float:
    """Measured pinned host-to-device bandwidth (the PCIe floor's denominator)."""
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).fill_(1)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst.copy_(src, non_blocking=True)
    times = [timed(lambda: dst.copy_(src, non_blocking=True))[0] for _ in range(5)]
    return nbytes / median(times) / 1e9


def link_rates(nbytes: int = 1 << 28) -> dict[str, float]:
    """The machine start's pinned host-to-device rate and host-memory read rate (GB/s) and the
    host's time per tiny CUDA op from Python (us), measured when results are written: decode
    over offloaded KV follows them, and they differ between starts of the same machine kind
    (issue 19: 512K decode 17.35 and 8.89 tok/s on two starts; the slower start's short decode
    steps took twice the wall time over the same device work). Empty when the GPU has no room
    left for the probe."""
    try:
        h2d = pinned_h2d_gbps(nbytes)
        x = torch.ones(nbytes // 4)
        x.sum()
        t = time.perf_counter()
        for _ in range(3):
            x.sum()
        host = 3 * nbytes / (time.perf_counter() - t) / 1e9
        one = torch.zeros(1, device="cuda")
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(2000):
            one.add_(1)
        torch.cuda.synchronize()
        launch = (time.perf_counter() - t) / 2000 * 1e6
    except (RuntimeError, torch.cuda.OutOfMemoryError):
        return {}
    finally:
        torch.cuda.empty_cache()
    return {"h2d_gbps": round(h2d, 1), "host_read_gbps": round(host, 1), "launch_us": round(launch, 2)}


def beside_h2d(fn: Callable[[], Any], nbytes: int, seconds: float = 2.0) -> dict[str, float]:
    """`fn` (which reads `nbytes` of host memory a call) run for `seconds` while a second thread
    keeps 1 GiB pinned H2D copies running, as a decode step's link does: both rates, GB/s,
    over the same interval, and each alone (CUDA). What DMA beside it costs a CPU kernel."""
    import threading

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

    def loop() -> float:
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            fn()
            n += 1
        return n * nbytes / (time.perf_counter() - t0) / 1e9

    alone = loop()
    t = time.perf_counter()
    dst.copy_(src)
    torch.cuda.synchronize()
    h2d_alone = src.numel() / (time.perf_counter() - t) / 1e9
    th = threading.Thread(target=copier)
    th.start()
    time.sleep(0.2)
    c0, t0 = copied[0], time.perf_counter()
    beside = loop()
    h2d = (copied[0] - c0) / (time.perf_counter() - t0) / 1e9
    stop.set()
    th.join()
    return {
        "alone_gb_s": round(alone, 2),
        "h2d_alone_gb_s": round(h2d_alone, 2),
        "beside_h2d_gb_s": round(beside, 2),
        "h2d_beside_gb_s": round(h2d, 2),
        "combined_gb_s": round(beside + h2d, 2),
    }


def recorded_command() -> str:
    """The command line that reproduces a result: kvtier's switches in the environment
    (`KVTIER_*`, e.g. KVTIER_HIP_GRAPHS=1, which subprocesses inherit) before the argv."""
    switches = [f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("KVTIER_")]
    return " ".join([*switches, *sys.argv])


def write_results(name: str, results: dict[str, Any]) -> Path:
    out_dir = Path(os.environ.get("OUT", "bench/results"))
    out_dir.mkdir(parents=True, exist_ok=True)
    results = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": recorded_command(),
        "machine": machine(),
        **results,
    }
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps(results, indent=1, default=str))
    return path


KV_FILLS = ("structured", "synthetic")


def fill_store(store: Any, tokens: int, kind: str) -> None:
    """Give an empty store `tokens` tokens of benchmark KV: "structured" (`kvtier.kv.structured`:
    per (layer, head, block) keys with a low-rank part, RoPE at their positions and planted
    needles; what selection methods' speed is measured on, issue 19) or "synthetic"
    (`kvtier.kv.synthetic`: one random extent copied everywhere, enough to time copies)."""
    if kind == "structured":
        from kvtier.kv.structured import fill_structured

        bs = store.layout.block_size  # 4 needles a head, fewer where few blocks lie within depths 0.1-0.9
        blocks = int(0.9 * tokens) // bs - -(-int(0.1 * tokens) // bs)
        fill_structured(store, tokens, needles=max(0, min(4, blocks)))
    elif kind == "synthetic":
        from kvtier.kv.synthetic import fill_synthetic

        fill_synthetic(store, tokens)
    else:
        raise ValueError(f"--kv-fill {kind!r}: use one of {', '.join(KV_FILLS)}")
