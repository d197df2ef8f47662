"""The CPU side of a split decode step (issue 23, `bench/tiered_store.py`): per-step counters of
the CPU slices' jobs and the host's waits, and one step's timeline layer by layer.

A layer with CPU slices runs (`kvtier.kv.cpu_attend.CpuSlices.attend_layer`):

```
 host:  entry ─ q to host, CPU jobs started, GPU slices issued ─ wait ........ end ─ merge, next layer ─ entry
 CPU:               (q lands) start ─ jobs ─ end
```

so the CPU's chain a layer is its jobs plus `q_to_cpu` (from the host's entry to the first job's
start: the GPU reaching the query, its copy, the issuing thread's wake), `wake` (the last job's
end to the host's wait end) and `host_between` (the host from one layer's results to the next
layer's entry: the merge, the rest of the layer, the next layer's projections). With the
stream's wait (`--cpu-handoff gpu`, `kvtier.kv.host_flag`) the host does not wait, so these
describe its issuing, off the chain; `cpu_gap` (one layer's last job's end to the next layer's
first job's start: the CPU idle) is the handoff on the chain either way.
"""

from __future__ import annotations

import time
from typing import Any

import torch


def cpu_counters(store: Any) -> tuple[float, float]:
    """(CPU busy seconds, host seconds waiting for CPU results) so far; zeros without CPU slices."""
    if store.cpu is None:
        return 0.0, 0.0
    return store.cpu.decoder.busy_s, store.cpu.wait_s


def cpu_split_row(store: Any, before: tuple[float, float], steps: int) -> dict[str, float]:
    """Per decode step of the last `steps`: the CPU slices' bytes read, the seconds the CPU's
    jobs ran and the host waited for them, and the CPU's attention rate while the link copies
    (issue 23: which side bounds a split step)."""
    busy, wait = (now - then for now, then in zip(cpu_counters(store), before, strict=True))
    packed, length = store.packed, store.length
    full = length * store.layout.token_bytes
    read = sum(full if packed is None else packed.stored_bytes(sid, length) for sid in store.cpu.slices)
    n = max(steps, 1)
    return {
        "cpu_bytes_per_token": read,
        "cpu_busy_s_per_token": busy / n,
        "host_wait_s_per_token": wait / n,
        "cpu_gb_per_s_busy": read / (busy / n) / 1e9 if busy > 0 else 0.0,
    }


def cpu_timeline(store: Any, model: Any, token: torch.Tensor) -> dict[str, Any]:
    """One more decode step with its CPU layers' times recorded (see the module docstring):
    the step's wall seconds, and each part of the CPU's chain summed over the layers (seconds)
    and per layer (ms)."""
    cpu = store.cpu
    cpu.trace, cpu.decoder.trace = [], []
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t = time.perf_counter()
    try:
        store.begin_step(1)
        model(token.view(1), store)
        store.end_step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        wall = time.perf_counter() - t
        layers, jobs = list(cpu.trace), list(cpu.decoder.trace)
    finally:
        cpu.trace, cpu.decoder.trace = None, None
    parts: dict[str, list[float]] = {
        k: []
        for k in ("host_between", "q_to_cpu", "cpu_busy", "wake", "host_enqueue", "host_wait", "cpu_gap")
    }
    at, last_end, last_job = 0, None, None
    for _layer, n, entry, wait0, wait1 in layers:
        mine = jobs[at : at + n]  # NOTE: one issuing thread runs the jobs in the order started
        at += n
        start, end = mine[0][0], mine[-1][1]
        parts["host_between"].append(entry - last_end if last_end is not None else 0.0)
        parts["q_to_cpu"].append(start - entry)
        parts["cpu_busy"].append(sum(b - a for a, b in mine))
        parts["wake"].append(wait1 - end)
        parts["host_enqueue"].append(wait0 - entry)
        parts["host_wait"].append(wait1 - wait0)
        parts["cpu_gap"].append(start - last_job if last_job is not None else 0.0)
        last_end, last_job = wait1, end
    return {
        "wall_s": wall,
        "cpu_layers": len(layers),
        "sum_s": {k: sum(v) for k, v in parts.items()},
        "per_layer_ms": {k: [round(x * 1e3, 3) for x in v] for k, v in parts.items()},
    }
