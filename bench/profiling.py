"""Profiling helpers of the decode benches: host-device syncs counted by the tensor methods that
force them, and a step under cProfile and torch.profiler (its kernels merged over windows)."""

from __future__ import annotations

import cProfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from bench.serve_loop import top_kernels

SYNC_METHODS = ("item", "tolist", "__bool__", "__int__", "__index__", "__float__", "nonzero", "unique")


@contextmanager
def count_syncs(counts: dict[str, int], methods: tuple[str, ...] = SYNC_METHODS) -> Iterator[None]:
    """Count calls of tensor `methods` that force a host-device sync (on CUDA) while active."""
    saved: dict[str, Any] = {}

    def wrap(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def inner(*a: Any, **k: Any) -> Any:
            counts[name] = counts.get(name, 0) + 1
            return fn(*a, **k)

        return inner

    for name in methods:
        saved[name] = getattr(torch.Tensor, name)
        setattr(torch.Tensor, name, wrap(name, saved[name]))
    saved_unique = torch.unique
    if "unique" in methods:
        torch.unique = wrap("torch.unique", saved_unique)  # type: ignore[assignment]
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)
        torch.unique = saved_unique  # type: ignore[assignment]


def run_profiled(
    fn: Callable[[], None], prof: cProfile.Profile | None, kernel_profs: list[profile] | None, cuda: bool
) -> None:
    """fn under `prof` (cProfile) and, with `kernel_profs`, a torch.profiler window of its own
    appended to it (with CUDA's activity and a sync when `cuda`)."""
    if prof is not None:
        prof.enable()
    if kernel_profs is not None:
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=activities) as kp:
            fn()
            if cuda:
                torch.cuda.synchronize()
        kernel_profs.append(kp)
    else:
        fn()
    if prof is not None:
        prof.disable()


def merged_kernels(profs: list[profile], top: int) -> list[dict[str, Any]]:
    """`top_kernels` of several profiler windows, summed by kernel name (calls, device ms)."""
    total: dict[str, dict[str, Any]] = {}
    for p in profs:
        for row in top_kernels(p, 10**6):
            acc = total.setdefault(row["name"], {"name": row["name"], "calls": 0, "device_ms": 0.0})
            acc["calls"] += row["calls"]
            acc["device_ms"] = round(acc["device_ms"] + row["device_ms"], 3)
    return sorted(total.values(), key=lambda r: -r["device_ms"])[:top]
