"""Fused dequantization on the GPU: packed rows -> K/V tokens in a staging buffer, one kernel
(KIVI integers and FP8 E4M3).

The torch `KiviCodec.unpack` runs ~10 kernels and materializes int32/fp32 copies of every
element; on a long offloaded slice that is many times the HBM traffic of the result and runs on
the copy stream, so it ate most of what the packed host tier saved on PCIe (H200, 512K, int4:
3.2x fewer bytes, 1.10x faster decode). This kernel reads each packed byte and fp16 parameter
once and writes each output element once. The store reaches it through `KiviCodec.unpack_into`.

Row layout (see `kvtier.policies.quant`): one row per `group` tokens,
`[key codes | value codes | key (min, scale) per channel | value (min, scale) per channel group]`,
codes packed `8 // bits` per byte, lowest bits first. For element i of a row's t*G*D keys (or
values), token i // (G*D), channel i % (G*D):

    key   = code_k[i] * k_scale[i % (G*D)] + k_min[i % (G*D)]
    value = code_v[i] * v_scale[i // cg] + v_min[i // cg]          (cg: value channel group)

The result equals the torch unpack up to fused multiply-add rounding on the GPU (bitwise in
Triton's interpreter).

FP8 rows (`Fp8Codec`, one token a row) are `[codes 2*G*D | scales 2*G fp16]`, element i scaled
by scale i // D. The torch unpack widens every code to fp32 and multiplies in place: at 512K
tokens of a 4-head slice that was ~5 GB of temporaries, which overran a 24 GiB plan.
"""

from __future__ import annotations

from typing import Protocol

import torch
import triton
import triton.language as tl


class KiviLayout(Protocol):
    """What the kernel needs of a KIVI codec (`kvtier.policies.quant.KiviCodec`)."""

    @property
    def bits(self) -> int: ...

    @property
    def group(self) -> int: ...

    def channel_group(self, d: int) -> int: ...


BLOCK = 1024  # elements of a row per program


@triton.jit
def _unpack_kivi(  # type: ignore[no-untyped-def]
    rows,  # [m, row_bytes] uint8
    scales,  # [m, row_bytes // 2] float16 view of the same rows, from the parameters on
    # NOTE: not named `params`: Triton 3.6's generated binder has a local of that name, which
    # shadows such an argument with a dict on the compiled path (the interpreter never sees it).
    out,  # [m * t, 2, G, D] contiguous
    stride_row,  # bytes between rows
    stride_prow,  # float16 elements between rows of `scales`
    n_elem,  # t * G * D
    gd,  # G * D
    value_codes,  # byte offset of the value codes in a row
    vp,  # value (min, scale) pairs per row: t * G * D // cg
    cg,  # value channel group
    BITS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK] element of the row
    ok = i < n_elem
    per = 8 // BITS
    base = rows + row.to(tl.int64) * stride_row
    shift = (i % per) * BITS
    mask = (1 << BITS) - 1
    kb = tl.load(base + i // per, mask=ok, other=0).to(tl.int32)
    vb = tl.load(base + value_codes + i // per, mask=ok, other=0).to(tl.int32)
    kq = ((kb >> shift) & mask).to(tl.float32)
    vq = ((vb >> shift) & mask).to(tl.float32)
    p = scales + row.to(tl.int64) * stride_prow
    c = i % gd
    k_min = tl.load(p + c, mask=ok, other=0.0).to(tl.float32)
    k_scale = tl.load(p + gd + c, mask=ok, other=0.0).to(tl.float32)
    vg = i // cg
    v_min = tl.load(p + 2 * gd + vg, mask=ok, other=0.0).to(tl.float32)
    v_scale = tl.load(p + 2 * gd + vp + vg, mask=ok, other=0.0).to(tl.float32)
    token = row.to(tl.int64) * (n_elem // gd) + i // gd
    o = out + token * (2 * gd) + c
    tl.store(o, (kq * k_scale + k_min).to(out.dtype.element_ty, fp_downcast_rounding="rtne"), mask=ok)
    tl.store(o + gd, (vq * v_scale + v_min).to(out.dtype.element_ty, fp_downcast_rounding="rtne"), mask=ok)


def unpack_kivi_into(codec: KiviLayout, rows: torch.Tensor, dst: torch.Tensor) -> None:
    """Dequantize rows [m, row_bytes] (uint8, on dst's device) into dst [m * group, 2, G, D]
    (contiguous) on the current stream."""
    m = rows.shape[0]
    t = codec.group
    _, _, g, d = dst.shape
    if dst.shape[0] != m * t or not dst.is_contiguous() or rows.stride(-1) != 1:
        raise ValueError(f"unpack_kivi_into: dst {tuple(dst.shape)} must be contiguous [m * {t}, 2, G, D]")
    cg = codec.channel_group(d)
    n_codes = t * g * d * codec.bits // 8
    # The fp16 parameters start after both code blocks; 2 * n_codes is even, so they are aligned.
    scales = rows[:, 2 * n_codes :].view(torch.float16)
    grid = (m, triton.cdiv(t * g * d, BLOCK))
    _unpack_kivi[grid](
        rows,
        scales,
        dst,
        rows.stride(0),
        scales.stride(0),
        t * g * d,
        g * d,
        n_codes,
        t * g * d // cg,
        cg,
        BITS=codec.bits,
        BLOCK=BLOCK,
    )


@triton.jit
def _unpack_fp8(  # type: ignore[no-untyped-def]
    rows,  # [m, row_bytes] uint8
    scales,  # [m, row_bytes // 2] float16 view of the same rows (the scales after the codes)
    out,  # [m, 2, G, D] contiguous
    stride_row,  # bytes between rows
    stride_srow,  # float16 elements between rows of `scales`
    first_scale,  # float16 index of a row's first scale
    n_elem,  # 2 * G * D
    d,  # D: elements a scale covers
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = i < n_elem
    b = tl.load(rows + row.to(tl.int64) * stride_row + i, mask=ok, other=0).to(tl.int32)
    # E4M3 by its bits (exact, and the same in the interpreter): 1 sign, 4 exponent bits (bias
    # 7), 3 mantissa bits; exponent 0 is subnormal, man * 2^-9. The NaN code (0x7f) never occurs:
    # pack scales every vector's largest magnitude to 448, the largest finite code.
    e = (b >> 3) & 15
    man = b & 7
    normal = (((e + 120) << 23) | (man << 20)).to(tl.float32, bitcast=True)
    mag = tl.where(e == 0, man.to(tl.float32) * 0.001953125, normal)
    x = tl.where((b & 128) != 0, -mag, mag)
    s = tl.load(scales + row.to(tl.int64) * stride_srow + first_scale + i // d, mask=ok, other=0.0)
    y = (x * s.to(tl.float32)).to(out.dtype.element_ty, fp_downcast_rounding="rtne")
    tl.store(out + row.to(tl.int64) * n_elem + i, y, mask=ok)


def unpack_fp8_into(rows: torch.Tensor, dst: torch.Tensor) -> None:
    """Dequantize FP8 rows [m, 2*G*D + 4*G] (uint8, on dst's device) into dst [m, 2, G, D]
    (contiguous) on the current stream, with no temporaries."""
    m, _, g, d = dst.shape
    n = 2 * g * d
    if rows.shape != (m, n + 4 * g) or not dst.is_contiguous() or rows.stride(-1) != 1:
        raise ValueError(f"unpack_fp8_into: rows {tuple(rows.shape)} and dst {tuple(dst.shape)} disagree")
    if rows.stride(0) % 2:
        raise ValueError("unpack_fp8_into: rows must start at even byte offsets (fp16 scales)")
    if m == 0:
        return
    scales = rows.view(torch.float16)  # the codes are 2*G*D bytes: the scales start aligned
    _unpack_fp8[(m, triton.cdiv(n, BLOCK))](
        rows, scales, dst, rows.stride(0), rows.stride(0) // 2, n // 2, n, d, BLOCK=BLOCK
    )
