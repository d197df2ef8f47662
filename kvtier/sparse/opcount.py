"""Count the torch operators a piece of code runs: the launches of a CUDA step, measured on CPU.

HiP decode over offloaded KV runs one small step per slice (256 slices for an 8B model), so its
cost is the number of operators launched, not their work. `OpCounter` counts every aten operator
dispatched while active, leaving out views (no kernel launch on a GPU):

    with OpCounter() as ops:
        step()
    ops.total, ops.counts  # operators run, and per operator name
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode


class OpCounter(TorchDispatchMode):
    """A dispatch mode that counts non-view aten operators by name (mutable `counts`)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if not func.is_view:
            self.counts[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))
