"""How a start's KV is cut into tasks: token (or packed row) ranges within one extent, ~1 MiB
each, all KV heads of the slice. Task n writes out[n], lse[n] only, and the tasks depend on the
shapes only, so a merge over them in order gives bitwise the same result with any thread count.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

TASK_BYTES = 1 << 20  # KV bytes per task (per KV head), about: enough to amortize a task's overhead


@dataclass(frozen=True)
class Task:
    """One task of a start: `tokens` tokens from token `start` of extent `extent`, all KV heads."""

    extent: int
    start: int  # token offset in the extent
    tokens: int


def plan_tasks(extents: list[torch.Tensor], length: int) -> list[Task]:
    """The tasks over tokens [0, length) of `extents`, in merge order. NOTE: they depend on the
    shapes only (never on the thread count), which keeps results bitwise independent of it."""
    e, _, g, d = extents[0].shape
    step = max(64, TASK_BYTES // (2 * g * d * extents[0].element_size()))
    return [
        Task(i, a, min(a + step, end) - a)
        for i in range(-(-length // e))
        for end in (min(e, length - i * e),)  # tokens of extent i that are attended
        for a in range(0, end, step)
    ]


def plan_row_tasks(extents: list[torch.Tensor], rows: int) -> list[Task]:
    """The tasks over packed rows [0, rows) of row `extents` (each [R_e, row_bytes] uint8): as
    `plan_tasks`, with rows for tokens (a Task's `start` and `tokens` then count rows)."""
    e, row_bytes = extents[0].shape
    step = max(2, TASK_BYTES // row_bytes)
    return [
        Task(i, a, min(a + step, end) - a)
        for i in range(-(-rows // e))
        for end in (min(e, rows - i * e),)
        for a in range(0, end, step)
    ]
