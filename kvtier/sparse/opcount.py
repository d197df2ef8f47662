"""Count the torch operators a piece of code runs: the launches of a CUDA step, measured on CPU.

HiP decode over offloaded KV runs one small step per slice (256 slices for an 8B model), so its
cost is the number of operators launched, and the times the host waits for the GPU, not their
work. `OpCounter` counts every aten operator dispatched while active, leaving out views (no
kernel launch on a GPU), and, apart, the operators that make a CUDA host wait for the device
(`SYNC_OPS`: a value read back, an output whose size depends on the data):

    with OpCounter() as ops:
        step()
    ops.total, ops.counts  # operators run, and per operator name
    ops.sync_total, ops.syncs  # of them, those that would sync on CUDA
    ops.by_function  # per innermost kvtier function that ran them (OpCounter(by_function=True))

`Tensor.tolist` reads a CUDA tensor back without an aten operator on a CPU tensor: it is not
counted here (wrap it, as `bench/hip_decode_profile.py` does). A Triton kernel that Triton's
interpreter runs (TRITON_INTERPRET=1: the CPU's stand-in for a GPU launch) counts as one
operator, "triton:<kernel>", not as the torch operators the interpreter runs for it.
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# aten operators that wait for the device on CUDA: reading a scalar (`item`, `int`, `bool`),
# and those whose output size depends on the data. Indexing (and index_put_) with a boolean
# mask runs `nonzero` inside: see `_syncs`.
SYNC_OPS = frozenset(
    ("_local_scalar_dense", "nonzero", "_unique2", "unique_dim", "unique_consecutive", "masked_select")
)


def _syncs(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether operator `name` with these arguments would make a CUDA host wait."""
    if name in SYNC_OPS:
        return True
    if name in ("index", "index_put_", "index_put") and len(args) > 1 and isinstance(args[1], (list, tuple)):
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1])
    if name == "repeat_interleave":  # repeats in a tensor (the only argument, or the second)
        tensor_repeats = len(args) == 1 or isinstance(args[1], torch.Tensor)
        return tensor_repeats and kwargs.get("output_size") is None
    return False


class OpCounter(TorchDispatchMode):
    """A dispatch mode that counts non-view aten operators by name (mutable `counts`), and those
    of them that would sync a CUDA host (`syncs`)."""

    def __init__(self, by_function: bool = False) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()
        self.syncs: Counter[str] = Counter()
        # "module.py:function" of the innermost kvtier frame that ran each operator (a stack walk
        # an operator: only when asked)
        self.by_function: Counter[str] | None = Counter() if by_function else None

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    @property
    def sync_total(self) -> int:
        return sum(self.syncs.values())

    def __enter__(self) -> OpCounter:
        super().__enter__()
        self._unpatch = _count_interpreted_launches(self)
        _ACTIVE.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        _ACTIVE.remove(self)
        self._unpatch()
        super().__exit__(*exc)

    def launched(self, name: str) -> None:
        """Count one launch of kernel `name` (not an aten operator), unless `unseen`."""
        if _UNSEEN:
            return
        self.counts[f"triton:{name}"] += 1
        if self.by_function is not None:
            self.by_function[_innermost_kvtier_frame()] += 1

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if not func.is_view and not _UNSEEN:
            name = str(func.overloadpacket.__name__)
            self.counts[name] += 1
            if _syncs(name, args, kwargs):
                self.syncs[name] += 1
            if self.by_function is not None:
                self.by_function[_innermost_kvtier_frame()] += 1
        return func(*args, **kwargs)


_UNSEEN = 0  # depth of `unseen` blocks


@contextmanager
def unseen(launch: str | None = None) -> Iterator[None]:
    """Run a block no active `OpCounter` counts, having counted it as the one launch `launch` (if
    given): what a CUDA graph's replay runs (`bench/hip_decode_profile.py --emulate-graphs`)."""
    global _UNSEEN
    if launch is not None:
        for counter in _ACTIVE:
            counter.launched(launch)
    _UNSEEN += 1
    try:
        yield
    finally:
        _UNSEEN -= 1


_ACTIVE: list[OpCounter] = []  # the counters entered, innermost last


def _count_interpreted_launches(counter: OpCounter) -> Callable[[], None]:
    """Under Triton's interpreter, make each kernel run count as one launch in `counter`, its own
    torch operators uncounted; returns what undoes it (a no-op elsewhere)."""
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0") or "triton" not in sys.modules:
        return lambda: None
    from torch.utils._python_dispatch import _disable_current_modes
    from triton.runtime.interpreter import InterpretedFunction

    run = InterpretedFunction.run

    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("warmup"):
            return run(self, *args, **kwargs)
        counter.launched(self.fn.__name__)
        with _disable_current_modes():
            return run(self, *args, **kwargs)

    InterpretedFunction.run = counted

    def undo() -> None:
        InterpretedFunction.run = run

    return undo


def _innermost_kvtier_frame() -> str:
    """'subpackage/module.py:function' of the innermost kvtier frame on the stack (beside this
    module), or 'outside kvtier'."""
    f: FrameType | None = sys._getframe(2)
    while f is not None:
        path = f.f_code.co_filename
        if path.startswith(_PACKAGE) and path != __file__:
            return f"{path[len(_PACKAGE) :]}:{f.f_code.co_name}"
        f = f.f_back
    return "outside kvtier"


_PACKAGE = os.path.dirname(os.path.dirname(__file__)) + os.sep  # kvtier/'s path, with its separator
