"""Peak CPU allocator bytes inside named modules' forwards, from torch's profiler.

The profiler (`profile_memory=True`) records every allocation and free of the CPU allocator
with its address and time; each watched module's forward is marked as a `record_function`
span, and a span's peak is the most bytes alive at once while it runs, counting only what was
allocated after profiling began (weights, the KV store and the inputs are not counted).

NOTE: the event tree (`kineto_results.experimental_event_tree`, `_EventType.Allocation`) is
torch's own, not public API; it is what `torch.profiler`'s memory timeline reads.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function


def phase_peaks(run: Callable[[], Any], modules: dict[str, torch.nn.Module]) -> dict[str, int]:
    """Run `run()` under the profiler; for each name, the peak bytes alive during the forward of
    `modules[name]` (its first call, if it runs more than once)."""
    from torch._C._profiler import _EventType

    open_spans: list[Any] = []
    handles = []
    for name, module in modules.items():

        def enter(_m: Any, _args: Any, name: str = name) -> None:
            span = record_function(name)
            span.__enter__()
            open_spans.append(span)

        def leave(_m: Any, _args: Any, _out: Any) -> None:
            open_spans.pop().__exit__(None, None, None)

        handles += [module.register_forward_pre_hook(enter), module.register_forward_hook(leave)]
    try:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            run()
    finally:
        for h in handles:
            h.remove()
    allocations, spans = [], {}
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        if event.tag == _EventType.Allocation:
            allocations.append(event)
        elif event.name in modules:
            span = (event.start_time_ns, event.end_time_ns)
            spans[event.name] = min(spans.get(event.name, span), span)
        stack.extend(event.children)
    allocations.sort(key=lambda e: e.start_time_ns)
    alive: dict[int, int] = {}
    live, curve = 0, [(0, 0)]  # (time, bytes alive from then on)
    for event in allocations:
        f = event.extra_fields
        if f.alloc_size > 0:
            alive[f.ptr] = f.alloc_size
            live += f.alloc_size
        elif f.ptr in alive:  # frees of blocks from before the profiler are not counted
            live -= alive.pop(f.ptr)
        curve.append((event.start_time_ns, live))

    def peak(start: int, end: int) -> int:
        first = max(i for i, (t, _) in enumerate(curve) if t <= start)  # alive as the span opens
        return max(n for t, n in curve[first:] if t <= end)

    return {name: peak(start, end) for name, (start, end) in spans.items()}
