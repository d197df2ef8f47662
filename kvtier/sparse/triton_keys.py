"""How the pruning kernel (`kvtier.sparse.triton_bisect`) reads a probe's key, as Triton device
functions: by position in one tensor, in a host slice's extents (`ExtentKeys`: token rows or
KIVI rows, whose probe keys are unpacked here as `quant_triton._unpack_kivi` unpacks them), or at
element offsets the caller computed (a block cache's bank and overflow); then rotated at its
scoring position, rounded as `Rotary.apply` rounds.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def row_offsets(pos, offs_ptr, extent_tokens, ring, stride_ks, EXTENTS: tl.constexpr):  # type: ignore[no-untyped-def]
    """Element offsets [BC] of the key rows of positions pos [BC] from the keys' pointer: pos *
    stride_ks in one tensor, or with EXTENTS in a host slice's extents (`ExtentKeys`): token p in
    extent (p // extent_tokens) % ring, whose start is offs_ptr[that] elements on."""
    if EXTENTS:
        nth = pos // extent_tokens
        start = tl.load(offs_ptr + nth % ring)
        return start + (pos - nth * extent_tokens) * stride_ks
    return pos * stride_ks


@triton.jit
def rope_rows(cos_ptr, sin_ptr, rp, d, D: tl.constexpr):  # type: ignore[no-untyped-def]
    """cos and sin rows [BC, D] float32 at rotation positions rp [BC]."""
    c = tl.load(cos_ptr + rp[:, None] * D + d[None, :]).to(tl.float32)
    s = tl.load(sin_ptr + rp[:, None] * D + d[None, :]).to(tl.float32)
    return c, s


@triton.jit
def load_key(k_rows, d, c, s, D: tl.constexpr, ROTATE: tl.constexpr):  # type: ignore[no-untyped-def]
    """Key rows [BC, D] at row pointers k_rows [BC, 1]; with ROTATE, `Rotary.apply`'s rounding:
    x * cos + rotate_half(x) * sin, each op rounded to the keys' dtype."""
    k = tl.load(k_rows + d[None, :])
    if ROTATE:
        sign = tl.where(d < D // 2, -1.0, 1.0)
        ks = tl.load(k_rows + ((d + D // 2) % D)[None, :]).to(tl.float32) * sign[None, :]
        kdt = k.dtype
        a = (k.to(tl.float32) * c).to(kdt).to(tl.float32)
        b = (ks * s).to(kdt).to(tl.float32)
        k = (a + b).to(kdt)
    return k


@triton.jit
def packed_vals(rows, base, t, h, dd, g_all, n_codes, D: tl.constexpr, BITS: tl.constexpr):  # type: ignore[no-untyped-def]
    """float32 keys [BC, D] of tokens t [BC] of KIVI rows starting base [BC] bytes from `rows`,
    KV head h, channels dd [D]: code * step + min, as `quant_triton._unpack_kivi` computes them
    (codes in (token, head, channel) order, BITS to a byte from the low bits; then the keys'
    fp16 minima and steps per (head, channel) after both code blocks)."""
    per = 8 // BITS
    i = (t[:, None] * g_all + h) * D + dd[None, :]  # [BC, D] code index in the row
    b = tl.load(rows + base[:, None] + i // per).to(tl.int32)
    code = ((b >> ((i % per) * BITS)) & ((1 << BITS) - 1)).to(tl.float32)
    sp = (rows + base[:, None] + 2 * n_codes).to(tl.pointer_type(tl.float16))
    c = h * D + dd[None, :]
    lo = tl.load(sp + c).to(tl.float32)
    step = tl.load(sp + g_all * D + c).to(tl.float32)
    return code * step + lo


@triton.jit
def packed_key(  # type: ignore[no-untyped-def]
    rows, base, t, h, d, c, s, g_all, n_codes,
    KDT: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr, ROTATE: tl.constexpr,
):  # fmt: skip
    """`load_key` of keys unpacked from KIVI rows (`packed_vals`), rounded to KDT as an unpacked
    slice holds them."""
    k = packed_vals(rows, base, t, h, d, g_all, n_codes, D, BITS).to(KDT, fp_downcast_rounding="rtne")
    if ROTATE:
        sign = tl.where(d < D // 2, -1.0, 1.0)
        half = packed_vals(rows, base, t, h, (d + D // 2) % D, g_all, n_codes, D, BITS)
        ks = half.to(KDT, fp_downcast_rounding="rtne").to(tl.float32) * sign[None, :]
        a = (k.to(tl.float32) * c).to(KDT).to(tl.float32)
        b = (ks * s).to(KDT).to(tl.float32)
        k = (a + b).to(KDT)
    return k
