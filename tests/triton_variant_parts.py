"""What `tests.triton_variants`' builders are made of: a tensor argument (`Ptr`), one launch's
arguments (`Variant`), and the small helpers the builders share."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HALF = ("bfloat16", "float16")  # the 16-bit activation dtypes
ACT = (*HALF, "float32")  # where a wrapper also takes float32 tensors
ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Ptr:
    """A tensor argument: its torch dtype's name; `aligned`: its data pointer is 16-byte aligned
    (False for a view at an offset)."""

    dtype: str
    aligned: bool = True


@dataclass
class Variant:
    kernel: str
    case: dict[str, Any]  # what varies: the label
    args: dict[str, Any]  # every parameter of the kernel by name
    options: dict[str, Any] = field(default_factory=dict)  # num_warps, num_stages, enable_fp_fusion

    @property
    def label(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.case.items())


def _cases(**axes: Any) -> Iterator[dict[str, Any]]:
    for values in itertools.product(*axes.values()):
        yield dict(zip(axes, values, strict=True))


def _p2(n: int) -> int:
    """triton.next_power_of_2."""
    return 1 << (n - 1).bit_length()


def _named(names: str, values: tuple[int, ...]) -> dict[str, int]:
    return dict(zip(names.split(), values, strict=True))


def _strides(*shape: int) -> tuple[int, ...]:
    """A contiguous tensor's strides (torch's, size-1 dims included)."""
    out = [1]
    for n in reversed(shape[1:]):
        out.insert(0, out[0] * n)
    return tuple(out)
