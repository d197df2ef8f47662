"""Fused Triton kernels for the decoder's elementwise work: RMSNorm (optionally after the residual
add), RoPE and SwiGLU's silu(gate) * up. Each reads its inputs once and writes its outputs once,
where the torch code in `kvtier.model.layers` / `kvtier.model.rope` runs 3-7 kernels with fp32
temporaries.

The kernels compute in float32 and round to the activation dtype exactly where torch rounds, op
by op (torch computes a 16-bit elementwise op in float32 and rounds its result to nearest even):

* `rope`, the residual add: bitwise equal to the torch code (each product of two 16-bit values
  is exact in float32, so one rounding per op, the same as torch's).
* `silu_mul`: the same formula as torch's CUDA silu, x / (1 + exp(-x)) with libdevice's expf and
  an IEEE division, then the rounded product; bitwise equal on CUDA (seen on an H200 with torch
  2.11 and Triton 3.6) unless libdevice's flush of subnormals differs (inputs below 1e-38).
* `rms_norm`: HF's rounding (statistics in float32, normalized value rounded to the dtype, then
  times the weight, rounded), but the sum of squares is reduced in another order than torch's
  mean kernel, so a result can differ from torch's by one unit in the last place (4 in a million
  bf16 outputs on that H200). A model's bf16 logits are therefore close to, not bitwise, the
  torch path's.

NOTE: every launch passes enable_fp_fusion=False. With it on, LLVM narrows each rounded float32
op to a 16-bit instruction (exact: float32 has more than 2p + 2 bits) and then contracts RoPE's
product and add into one 16-bit FMA, which skips the product's rounding that torch does.

`triton` is imported here at module level; `kvtier.model.layers` and `kvtier.model.rope` import
this module only when `use_fused` says so, so importing kvtier never needs triton. For CPU
tensors set TRITON_INTERPRET=1 before this module is first imported: its float32 -> bfloat16
cast truncates, so under the interpreter the kernels round to nearest even by hand (INTERPRET).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

_ELEMENTWISE_BLOCK = 4096  # the most elements of one silu_mul program: 16 per thread at 8 warps
_NORM_TILE = 4096  # elements of one rms_norm program (whole rows: BLOCK_M * BLOCK_N)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@triton.jit
def _round(x, dtype: tl.constexpr, INTERPRET: tl.constexpr):  # type: ignore[no-untyped-def]
    """float32 x rounded to nearest even in `dtype` (as a `dtype` tensor)."""
    if INTERPRET and dtype == tl.bfloat16:
        # NOTE: the interpreter's float32 -> bfloat16 cast truncates; add half an ulp (ties to
        # even) to the bits first so the truncation rounds. Not NaN-safe; the interpreter only
        # runs tests.
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype, fp_downcast_rounding="rtne")


@triton.jit
def _rms_norm_kernel(  # type: ignore[no-untyped-def]
    x,  # [M, N] contiguous
    delta,  # [M, N] contiguous, added to x first when HAS_DELTA (else unused)
    weight,  # [N]
    out,  # [M, N] normalized
    summed,  # [M, N] x + delta when HAS_DELTA (else unused)
    M,
    N,
    inv_n,  # float32 1 / N (torch's mean multiplies the sum by it)
    eps,
    HAS_DELTA: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    dtype = out.dtype.element_ty
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    cols = tl.arange(0, BLOCK_N)  # [BN]
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    offs = rows[:, None] * N + cols[None, :]  # [BM, BN]
    h = tl.load(x + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_DELTA:
        d = tl.load(delta + offs, mask=mask, other=0.0).to(tl.float32)
        s = _round(h + d, dtype, INTERPRET)
        tl.store(summed + offs, s, mask=mask)
        h = s.to(tl.float32)
    mean_sq = tl.sum(h * h, axis=1) * inv_n  # [BM]
    normed = _round(h * tl.math.rsqrt(mean_sq + eps)[:, None], dtype, INTERPRET).to(tl.float32)
    w = tl.load(weight + cols, mask=cols < N, other=0.0).to(tl.float32)
    tl.store(out + offs, _round(normed * w[None, :], dtype, INTERPRET), mask=mask)


def _rms_norm_launch(
    x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    if not x.is_contiguous() or (delta is not None and not delta.is_contiguous()):
        raise ValueError("fused rms_norm: x and delta must be contiguous")
    n = x.shape[-1]
    m = x.numel() // n
    out = torch.empty_like(x)
    summed = torch.empty_like(x) if delta is not None else None
    if m == 0:
        return out, summed
    block_n = triton.next_power_of_2(n)
    block_m = max(1, _NORM_TILE // block_n)
    _rms_norm_kernel[(triton.cdiv(m, block_m),)](
        x,
        delta if delta is not None else x,
        weight,
        out,
        summed if summed is not None else out,
        m,
        n,
        1.0 / n,
        eps,
        HAS_DELTA=delta is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        INTERPRET=_interpreting(),
        num_warps=8 if block_m * block_n >= 4096 else 4,
        enable_fp_fusion=False,
    )
    return out, summed


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x [..., N] (contiguous, 16-bit) over its last dim, times weight [N] (x's dtype)."""
    return _rms_norm_launch(x, None, weight, eps)[0]


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add and the norm after it in one pass: returns (x + delta, rms_norm(x + delta)).

    x, delta [..., N] contiguous, same 16-bit dtype; the sum is rounded to that dtype before the
    norm reads it, as `x + delta` followed by `rms_norm` would.
    """
    out, summed = _rms_norm_launch(x, delta, weight, eps)
    assert summed is not None
    return summed, out


@triton.jit
def _rope_kernel(  # type: ignore[no-untyped-def]
    x,  # [T, H, D], last dim contiguous
    cos,  # [T, D], last dim contiguous
    sin,  # [T, D], last dim contiguous
    out,  # [T, H, D] contiguous
    H,
    stride_xt,
    stride_xh,
    stride_ct,
    stride_st,
    HALF: tl.constexpr,  # D // 2
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    dtype = out.dtype.element_ty
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # [BH]
    cols = tl.arange(0, BLOCK_HALF)  # [BHALF]
    col_ok = cols < HALF
    mask = (heads < H)[:, None] & col_ok[None, :]
    src = x + t * stride_xt + heads[:, None] * stride_xh + cols[None, :]  # [BH, BHALF]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    c = cos + t * stride_ct + cols
    s = sin + t * stride_st + cols
    c1 = tl.load(c, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    c2 = tl.load(c + HALF, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    s1 = tl.load(s, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    s2 = tl.load(s + HALF, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    # NOTE: x * cos + rotate_half(x) * sin with each product rounded to the dtype before the
    # add, as torch's three ops round; rotate_half(x) = cat(-x2, x1).
    a1 = _round(x1 * c1, dtype, INTERPRET).to(tl.float32)
    b1 = _round(-x2 * s1, dtype, INTERPRET).to(tl.float32)
    a2 = _round(x2 * c2, dtype, INTERPRET).to(tl.float32)
    b2 = _round(x1 * s2, dtype, INTERPRET).to(tl.float32)
    dst = out + (t * H + heads[:, None]) * (2 * HALF) + cols[None, :]
    tl.store(dst, _round(a1 + b1, dtype, INTERPRET), mask=mask)
    tl.store(dst + HALF, _round(a2 + b2, dtype, INTERPRET), mask=mask)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`Rotary.apply` in one pass: x [T, H, D] rotated by cos/sin [T, D] -> new contiguous [T, H, D].

    x, cos and sin share a 16-bit dtype and have a contiguous last dim (other strides are free:
    x may be a slice of heads). Bitwise equal to `Rotary.apply`'s torch code.
    """
    t, h, d = x.shape
    if d % 2 or cos.shape != (t, d) or sin.shape != (t, d):
        raise ValueError(f"fused rope: x {tuple(x.shape)} needs cos/sin [{t}, {d}] and an even D")
    if x.stride(-1) != 1 or cos.stride(-1) != 1 or sin.stride(-1) != 1:
        raise ValueError("fused rope: x, cos and sin need a contiguous last dim")
    out = torch.empty((t, h, d), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    block_h = min(triton.next_power_of_2(h), 16)
    _rope_kernel[(t, triton.cdiv(h, block_h))](
        x,
        cos,
        sin,
        out,
        h,
        x.stride(0),
        x.stride(1),
        cos.stride(0),
        sin.stride(0),
        HALF=d // 2,
        BLOCK_H=block_h,
        BLOCK_HALF=triton.next_power_of_2(d // 2),
        INTERPRET=_interpreting(),
        num_warps=4,
        enable_fp_fusion=False,
    )
    return out


@triton.jit
def _silu_mul_kernel(  # type: ignore[no-untyped-def]
    gate,  # [T, I], rows `stride_g` apart, each contiguous
    up,  # [T, I], rows `stride_u` apart, each contiguous
    out,  # [T, I] contiguous
    width,  # I
    stride_g,
    stride_u,
    BLOCK: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    # NOTE: one program per (row, block of columns): no per-element division for the row.
    dtype = out.dtype.element_ty
    row = tl.program_id(0).to(tl.int64)
    col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = col < width
    g = tl.load(gate + row * stride_g + col, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up + row * stride_u + col, mask=mask, other=0.0).to(tl.float32)
    # NOTE: torch's CUDA silu is x / (1 + expf(-x)) in float32 with an IEEE division; tl.exp and
    # `/` would be the fast approximations. The interpreter has no libdevice (numpy's exp there).
    e = tl.exp(-g) if INTERPRET else libdevice.exp(-g)
    act = _round(tl.math.div_rn(g, 1.0 + e), dtype, INTERPRET).to(tl.float32)
    tl.store(out + row * width + col, _round(act * u, dtype, INTERPRET), mask=mask)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up in one pass -> [T, I] contiguous. gate and up: [T, I] of one 16-bit dtype
    whose rows are contiguous (they may be the two halves of one [T, 2I] gate-up output)."""
    if gate.shape != up.shape or gate.dim() != 2 or gate.stride(1) != 1 or up.stride(1) != 1:
        raise ValueError("fused silu_mul: gate and up must be [T, I] of one shape with contiguous rows")
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    rows, width = gate.shape
    if rows and width:
        block = min(_ELEMENTWISE_BLOCK, triton.next_power_of_2(width))
        _silu_mul_kernel[(rows, triton.cdiv(width, block))](
            gate,
            up,
            out,
            width,
            gate.stride(0),
            up.stride(0),
            BLOCK=block,
            INTERPRET=_interpreting(),
            num_warps=8,
            enable_fp_fusion=False,
        )
    return out
