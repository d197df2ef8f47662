"""How the pruning kernel (`kvtier.sparse.triton_bisect`) reads a probe's key, as Triton device
functions: by position in one tensor, in a host slice's extents (`ExtentKeys`: token rows or
KIVI rows, whose probe keys are unpacked here as `quant_triton._unpack_kivi` unpacks them), or at
element offsets the caller computed (a block cache's bank and overflow); then rotated at its
scoring position, rounded as `Rotary.apply` rounds.

KIVI rows keep a key's fp16 minima and steps per (KV head, channel) for the row's `group`
tokens: 4 bytes a channel against a 4-bit code's half byte, so read with each probe they were
~89% of the bytes a stage-0 run moved over PCIe. `key_params` copies them to the GPU first, once
a row, in whole runs (`_gather_key_params`), and the probes then read their codes alone there.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kvtier.attention.interface import ExtentKeys
from kvtier.sparse.prune_memory import PRUNE_BATCH_BYTES

PARAM_ROWS = 16  # packed rows a program of `_gather_key_params` copies


class KeySource(NamedTuple):
    """Where a kernel reads keys, as `row_offsets` and `packed_key` take it."""

    ptr: torch.Tensor  # the first key row's (KIVI: packed row's bytes)
    offsets: torch.Tensor  # the extents' starts from ptr (a placeholder pointer for one tensor)
    extent_tokens: int  # tokens an extent (KIVI: rows)
    ring: int
    stride_ks: int  # elements between token rows (KIVI: bytes between packed rows)
    stride_kg: int  # elements between KV heads (KIVI: 0, unused)
    head0: int  # KIVI: the first KV head read, of g_all in a row
    g_all: int
    n_codes: int  # KIVI: bytes of a row's key codes
    bits: int  # 0: full-precision keys
    group: int  # KIVI: tokens a packed row


def key_source(keys: torch.Tensor | ExtentKeys, placeholder: torch.Tensor) -> KeySource:
    """keys [S, G, D] (last dim contiguous), or a host slice's `ExtentKeys` (token rows, or KIVI
    rows), as a kernel reads them; `placeholder` stands for the offsets of one tensor."""
    if isinstance(keys, ExtentKeys) and keys.bits:  # KIVI rows: bytes, from the rows' first
        return KeySource(
            keys.extents[0].view(-1), keys.offsets, keys.extent_rows, keys.ring, keys.row_bytes, 0,
            keys.head or 0, keys.heads, keys.key_code_bytes, keys.bits, keys.group,
        )  # fmt: skip
    if isinstance(keys, ExtentKeys):
        return KeySource(
            keys.extents[0].view(-1)[keys.first_element :], keys.offsets, keys.extent_tokens, keys.ring,
            keys.row_elements, keys.head_dim, 0, keys.shape[1], 0, 0, 1,
        )  # fmt: skip
    return KeySource(keys, placeholder, 1, 1, keys.stride(0), keys.stride(1), 0, keys.shape[1], 0, 0, 1)


@triton.jit
def probe_pos(cand_base, cs, cmask, off, length, first, CHUNK: tl.constexpr, ARANGE: tl.constexpr):  # type: ignore[no-untyped-def]
    """Positions [BC] of the probes at offsets `off` of chunks `cs` (0 where there is none)."""
    if ARANGE:  # noqa: SIM108 (a constexpr branch: only one side is compiled)
        pos = first + cs * CHUNK + off
    else:
        pos = tl.load(cand_base + cs * CHUNK + off, mask=cmask, other=0)
    return tl.where(cmask & (length > 0) & (pos >= 0), pos, 0).to(tl.int64)


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
def packed_vals(rows, base, t, h, dd, g_all, sp, sh, s_stride, D: tl.constexpr, BITS: tl.constexpr):  # type: ignore[no-untyped-def]
    """float32 keys [BC, D] of tokens t [BC] of KIVI rows starting base [BC] bytes from `rows`,
    KV head h, channels dd [D]: code * step + min, as `quant_triton._unpack_kivi` computes them
    (codes in (token, head, channel) order, BITS to a byte from the low bits). The fp16 minima
    of head sh lie at sp [BC] (pointers), its steps s_stride elements on: after a row's two code
    blocks (sh = h, s_stride = g_all * D), or in the copy `key_params` made."""
    per = 8 // BITS
    i = (t[:, None] * g_all + h) * D + dd[None, :]  # [BC, D] code index in the row
    b = tl.load(rows + base[:, None] + i // per).to(tl.int32)
    code = ((b >> ((i % per) * BITS)) & ((1 << BITS) - 1)).to(tl.float32)
    c = sp[:, None] + sh * D + dd[None, :]
    lo = tl.load(c).to(tl.float32)
    step = tl.load(c + s_stride).to(tl.float32)
    return code * step + lo


@triton.jit
def packed_key(  # type: ignore[no-untyped-def]
    rows, base, t, h, d, c, s, g_all, sp, sh, s_stride,
    KDT: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr, ROTATE: tl.constexpr,
):  # fmt: skip
    """`load_key` of keys unpacked from KIVI rows (`packed_vals`), rounded to KDT as an unpacked
    slice holds them."""
    k = packed_vals(rows, base, t, h, d, g_all, sp, sh, s_stride, D, BITS)
    k = k.to(KDT, fp_downcast_rounding="rtne")
    if ROTATE:
        sign = tl.where(d < D // 2, -1.0, 1.0)
        half = packed_vals(rows, base, t, h, (d + D // 2) % D, g_all, sp, sh, s_stride, D, BITS)
        ks = half.to(KDT, fp_downcast_rounding="rtne").to(tl.float32) * sign[None, :]
        a = (k.to(tl.float32) * c).to(KDT).to(tl.float32)
        b = (ks * s).to(KDT).to(tl.float32)
        k = (a + b).to(KDT)
    return k


@triton.jit
def _gather_key_params(  # type: ignore[no-untyped-def]
    rows,  # uint8 pointer: the extents' first row
    offs_ptr,  # [extents] int64 byte offsets of the extents from `rows`
    extent_rows,
    ring,
    row_bytes,
    n_codes,  # bytes of a row's key codes
    head0,
    g_all,
    row0,
    n_rows,
    out,  # [n_rows, 2, G * D] float16
    D: tl.constexpr,
    GD: tl.constexpr,  # G * D
    GD_P2: tl.constexpr,  # its next power of two
    BLOCK_R: tl.constexpr,
):
    """The key minima and steps of heads head0 .. head0 + G - 1 in rows row0 .. row0 + n_rows - 1:
    two runs of G * D fp16 a row, each contiguous where it lies."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    e = tl.arange(0, GD_P2)
    mask = (r < n_rows)[:, None] & (e < GD)[None, :]
    base = row_offsets(row0 + r.to(tl.int64), offs_ptr, extent_rows, ring, row_bytes, True)
    src = (rows + base + 2 * n_codes).to(tl.pointer_type(tl.float16))[:, None] + head0 * D + e[None, :]
    dst = out + r.to(tl.int64)[:, None] * (2 * GD) + e[None, :]
    tl.store(dst, tl.load(src, mask=mask), mask=mask)
    tl.store(dst + GD, tl.load(src + g_all * D, mask=mask), mask=mask)


def key_params(keys: ExtentKeys, row0: int, n_rows: int) -> torch.Tensor:
    """The key minima and steps of KIVI rows row0 .. row0 + n_rows - 1 of `keys` (its heads: one
    with `head`, else all), copied onto keys.device in one launch: [n_rows, 2, G, D] float16
    (minima, then steps). Asynchronous; rows past the stored ones read whatever their extent
    holds (a caller masks them)."""
    g = 1 if keys.head is not None else keys.heads
    gd = g * keys.head_dim
    out = torch.empty(n_rows, 2, g, keys.head_dim, dtype=torch.float16, device=keys.device)
    if n_rows:
        _gather_key_params[(triton.cdiv(n_rows, PARAM_ROWS),)](
            keys.extents[0].view(-1), keys.offsets, keys.extent_rows, keys.ring, keys.row_bytes,
            keys.key_code_bytes, keys.head or 0, keys.heads, row0, n_rows, out,
            D=keys.head_dim, GD=gd, GD_P2=triton.next_power_of_2(gd), BLOCK_R=PARAM_ROWS,
        )  # fmt: skip
    return out


def stage0_params(keys: ExtentKeys, first: int, span: int, probes: int) -> tuple[torch.Tensor | None, int]:
    """For stage 0 over positions [first, first + span) of KIVI rows read in place, probed
    `probes` times (keys of one head): (`key_params` of the rows they span, the first row), where
    those rows are fewer than the probes (each would read its row's) and their copy fits the
    pruning temporaries the planner reserves (`PRUNE_BATCH_BYTES`: 64 MB at 1M tokens of 4 heads
    of 128 dims in 32-token rows); (None, 0) otherwise."""
    if not keys.bits or span <= 0:
        return None, 0
    row0 = first // keys.group
    n_rows = (first + span - 1) // keys.group - row0 + 1
    heads = 1 if keys.head is not None else keys.heads
    if n_rows * heads > probes or n_rows * heads * keys.head_dim * 4 > PRUNE_BATCH_BYTES:
        return None, 0
    return key_params(keys, row0, n_rows), row0
