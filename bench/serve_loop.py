"""Driving `kvtier serve`'s engine in-process for the serve benches: its step loop as the serving
thread runs it (with host timings and a profile window), token arrival times per request, and a
device-op table of a profile."""

from __future__ import annotations

import gc
import itertools
import statistics
import time
from typing import Any

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from kvtier.engine.batch.sequence import Delta
from kvtier.serve.engine import ServeEngine


def step_loop(
    engine: ServeEngine,
    times: dict[str, list[Any]] | None = None,
    profile_steps: tuple[int, int] | None = None,
    trace: str | None = None,
) -> tuple[int, list[dict[str, Any]] | None]:
    """Step the engine in this thread until idle, as its serving thread does (batch steps, then
    tiered runs, never waiting on them while the batch has work). Returns the batch steps, and
    with `profile_steps` (first, last) the kernels by device time over those batch steps (every
    stream's: the tiered runs' too). With `times`, the host seconds of each batch step ("step"),
    this thread's CPU seconds in it ("step_cpu": less than "step" by the time it waited, for the
    device or for the GIL), the rest of each loop pass that stepped the batch ("gap": the tiered
    runs' calls, the inbox, these counters), each tiered-run call ("tiered"), on CUDA the batch
    stream's time from each step's start to its end ("device_step") and from one step's end to the
    next one's start ("device_idle": the host's time between steps), and on CUDA for each
    batch step over 50 ms ("slow", as
    [step, ms, *counts]) what could have made it wait on other streams' work: the allocator's
    counts of cudaMalloc, cudaFree, allocation retries and pinned host allocations and frees
    (CUDA synchronizes implicitly around device and page-locked allocations), during the step
    and since the previous one (any thread's, the tiered launcher's too). `trace`: write the
    profile's Chrome trace there (gzipped when it ends in .gz): every stream's ops in time."""
    steps = 0
    prof: profile | None = None
    kernels = None
    engine._drain(block=False)
    cuda = engine.device.type == "cuda" and times is not None
    if times is not None:
        times.setdefault("slow", [])
    before = sync_counts() if cuda else None
    events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []  # each batch step's start, end
    while engine.has_work:
        if profile_steps is not None and prof is None and kernels is None and steps == profile_steps[0]:
            prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
            prof.__enter__()
        it0 = time.perf_counter()
        start = sync_counts() if cuda else None
        t0, c0 = time.perf_counter(), time.thread_time()
        stepped = engine.scheduler.has_work
        if stepped:
            marks = (timed_event(), timed_event()) if cuda else None
            if marks is not None:
                marks[0].record(engine.stream)
            engine.step()
            if marks is not None:
                marks[1].record(engine.stream)
                events.append(marks)
            steps += 1
        t1, c1 = time.perf_counter(), time.thread_time()
        if start is not None and before is not None and stepped and t1 - t0 > 0.05:
            end = sync_counts()
            during = [b - a for a, b in zip(start, end, strict=True)]
            since = [b - a for a, b in zip(before, start, strict=True)]
            assert times is not None
            times["slow"].append([steps, round(1e3 * (t1 - t0), 1), *during, *since])
        before = start
        engine.step_tiered()
        if times is not None:
            if stepped:
                times["step"].append(t1 - t0)
                times.setdefault("step_cpu", []).append(c1 - c0)
            times["tiered"].append(time.perf_counter() - t1)
            times.setdefault("waiting", []).append(len(engine.scheduler.waiting))
        if prof is not None and profile_steps is not None and steps >= profile_steps[1]:
            torch.cuda.synchronize()
            prof.__exit__(None, None, None)
            if trace is not None:
                prof.export_chrome_trace(trace)
            kernels, prof = top_kernels(prof), None
        engine._idle_wait()
        engine._drain(block=False)
        if times is not None and stepped:
            times.setdefault("gap", []).append(time.perf_counter() - it0 - (t1 - t0))
    if events and times is not None:
        # On the batch's stream: from a step's start to its end (its device work, and the host
        # work inside it the device waited for), and from its end to the next one's start (the
        # device idle while the host ran between steps)
        torch.cuda.synchronize()
        times["device_step"] = [1e-3 * a.elapsed_time(b) for a, b in events]
        times["device_idle"] = [1e-3 * b.elapsed_time(a) for (_, b), (a, _) in itertools.pairwise(events)]
    return steps, kernels


FIRST_STEPS = 8  # batch steps whose host times each case records


def ms_p50(xs: list[float]) -> float | None:
    return round(1e3 * statistics.median(xs), 3) if xs else None


def ms_quantile(xs: list[float], q: float) -> float | None:
    return round(1e3 * sorted(xs)[min(len(xs) - 1, int(q * len(xs)))], 3) if xs else None


def timed_event() -> torch.cuda.Event:
    return torch.cuda.Event(enable_timing=True)


class GcPauses:
    """Records the interpreter's garbage collections while active: (generation, seconds) each.
    A full collection over a large heap stops every Python thread, the engine loop's too."""

    def __init__(self) -> None:
        self.pauses: list[tuple[int, float]] = []
        self._t0 = 0.0

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.pauses.append((int(info["generation"]), time.perf_counter() - self._t0))

    def __enter__(self) -> GcPauses:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._callback)

    def summary(self) -> dict[str, Any]:
        """Collections by generation, the longest in ms and the seconds of all of them."""
        by_gen = [sum(g == k for g, _ in self.pauses) for k in range(3)]
        longest = max((t for _, t in self.pauses), default=0.0)
        return {
            "collections_by_generation": by_gen,
            "longest_ms": round(1e3 * longest, 2),
            "total_s": round(sum(t for _, t in self.pauses), 4),
        }


class ThreadClock:
    """Wraps a function to record the wall and this thread's CPU seconds of each call (for a
    tiered run's launcher: how long queuing one step takes, and how much of that is Python)."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        self.calls: list[tuple[float, float]] = []  # (wall, cpu)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.calls.append((time.perf_counter() - t0, time.thread_time() - c0))


SYNC_COUNTS = ("cuda_malloc", "cuda_free", "alloc_retries", "host_alloc", "host_free")


def sync_counts() -> list[int]:
    """Counts of the allocator calls CUDA synchronizes around (`SYNC_COUNTS`, in that order)."""
    dev = torch.cuda.memory_stats()
    host = torch.cuda.host_memory_stats()
    dev_keys = ("num_device_alloc", "num_device_free", "num_alloc_retries")
    host_keys = ("num_host_alloc", "num_host_free")
    return [int(dev.get(k, 0)) for k in dev_keys] + [int(host.get(k, 0)) for k in host_keys]


def top_kernels(prof: profile, top: int = 14) -> list[dict[str, Any]]:
    """The `top` device operations (kernels and copies) by their total device time."""
    rows = []
    for e in prof.key_averages():
        us = float(getattr(e, "self_device_time_total", 0.0) or 0.0)
        if us > 0 and e.device_type == DeviceType.CUDA:  # kernels and copies, not their operators
            rows.append({"name": e.key[:90], "calls": e.count, "device_ms": round(us / 1e3, 3)})
    rows.sort(key=lambda r: -r["device_ms"])
    return rows[:top]


def sync(engine: ServeEngine) -> None:
    if engine.device.type == "cuda":
        torch.cuda.synchronize()


class Stream:
    """Token arrival times of one request (a sink)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.tokens: list[int] = []
        self.done = False

    def __call__(self, d: Delta) -> None:
        now = time.perf_counter()
        self.times.extend([now] * len(d.token_ids))
        self.tokens.extend(d.token_ids)
        self.done = d.finish_reason is not None
        if d.finish_reason == "error":
            raise SystemExit(f"request failed: {getattr(d, 'error', d)}")

    def tpot(self) -> float | None:
        n = len(self.times)
        return (self.times[-1] - self.times[0]) / (n - 1) if n > 1 else None
