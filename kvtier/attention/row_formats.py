"""The packed KV rows the native CPU decode kernel (`cpu_decode.cpp`) reads in place, by name.

    "kivi2" / "kivi4" / "kivi8"   KiviCodec rows: 32 tokens of codes, min-max scales (fp16)
    "fp8"                         Fp8Codec rows: one token of E4M3 codes, an fp16 scale a vector

The names key the native pool's kernels (`ROW_KINDS`) and the planner's measured CPU rates over
packed rows (`kvtier.planner.hardware.Hardware.cpu_packed_bw`). Codecs live above this layer, so
a codec is recognised by its `row_layout`, `group` and `bits`.
"""

from __future__ import annotations

from typing import Protocol

import torch

KIVI_BITS = (2, 4, 8)  # packed rows the native kernel reads (KiviCodec, groups of KIVI_GROUP tokens)
KIVI_GROUP = 32
# Packed rows the native kernel reads -> the pool's kernel kind (cpu_pool.cpp's kvtier_pool_run).
ROW_KINDS = {**{f"kivi{b}": b for b in KIVI_BITS}, "fp8": 3}


def native_row_format(codec: object) -> str | None:
    """The name of a codec's packed rows where the native kernel reads them in place ("kivi2",
    "kivi4", "kivi8": KIVI rows of `KIVI_GROUP` tokens; "fp8": E4M3 rows of one token), else None."""
    layout, group = getattr(codec, "row_layout", None), getattr(codec, "group", None)
    if layout == "e4m3" and group == 1:
        return "fp8"
    bits = getattr(codec, "bits", None)
    return f"kivi{bits}" if layout == "kivi" and group == KIVI_GROUP and bits in KIVI_BITS else None


def kivi_row_bytes(bits: int, heads: int, head_dim: int) -> int:
    """Bytes of one KIVI row (`cpu_decode.cpp`'s layout): codes of `KIVI_GROUP` tokens' keys and
    values, keys' fp16 (min, step) per channel, values' per token and run of 32 channels (one
    run when 32 does not divide the head dim)."""
    runs = head_dim // KIVI_GROUP if head_dim % KIVI_GROUP == 0 else 1
    codes = 2 * KIVI_GROUP * heads * head_dim * bits // 8
    return codes + 2 * 2 * heads * head_dim + 2 * 2 * KIVI_GROUP * heads * runs


class RowCodec(Protocol):
    """What `CpuDecoder.start_rows` needs of a packing codec (`kvtier.kv.hooks.KVCodec` has it):
    rows of `group` tokens, their size, and their unpacking. A codec whose `row_layout` is
    "kivi" (`kvtier.policies.quant.KiviCodec`) or "e4m3" (`Fp8Codec`) has rows the native kernel
    reads in place."""

    @property
    def group(self) -> int: ...

    def row_bytes(self, heads: int, head_dim: int) -> int: ...

    def unpack(self, rows: torch.Tensor, heads: int, head_dim: int, dtype: torch.dtype) -> torch.Tensor: ...


class RowFormat:
    """A named row format standing in for its codec where only the layout matters (timing the
    kernel over zero rows): what `CpuDecoder.start_rows` reads of a codec, and
    `native_row_format(RowFormat(name)) == name`. It cannot unpack."""

    def __init__(self, name: str) -> None:
        if name not in ROW_KINDS:
            raise ValueError(f"unknown row format {name!r}; known: {', '.join(ROW_KINDS)}")
        self.name = name
        self.row_layout = "e4m3" if name == "fp8" else "kivi"
        self.group = 1 if name == "fp8" else KIVI_GROUP
        self.bits = ROW_KINDS[name] if name != "fp8" else 8

    def row_bytes(self, heads: int, head_dim: int) -> int:
        """Bytes of one row: `kivi_row_bytes`, or for fp8 a byte a value and an fp16 scale a vector."""
        if self.name == "fp8":
            return 2 * heads * (head_dim + 2)
        return kivi_row_bytes(self.bits, heads, head_dim)

    def unpack(self, rows: torch.Tensor, heads: int, head_dim: int, dtype: torch.dtype) -> torch.Tensor:
        raise NotImplementedError(f"{self.name} rows stand in for a codec: the native kernel reads them")
