"""Every launched Triton kernel of kvtier, compiled to TTIR for an sm90 target on a machine with
no GPU: Triton's frontend only (`ASTSource.make_ir`), over the constexpr values and argument
specializations that the kernel's Python wrapper can pass.

`tests/test_triton_compile.py` runs this module as a script, in processes where TRITON_INTERPRET
is unset: under the interpreter the kernels are `InterpretedFunction`s, which never compile. By
hand: `python -m tests.triton_compile_variants [KERNEL ...] [--shard I/N]` prints one JSON line
a variant ({"index", "kernel", "variant", "error"}: error null where it compiled).

A variant is every argument of one launch as the wrapper passes it: pointers as `Ptr` (the
tensor's dtype), integers and floats as values, constexprs as values. Triton's own specializer
(`native_specialize_impl`) turns them into the signature a real launch compiles, so an integer
argument equal to 1 becomes a constexpr there as it does on the GPU (a stride of 1, one ring
extent, a single KV head), and 16-divisible values and pointers get their alignment hints.
The wrappers' choices (dtypes, BLOCK sizes, strides, flags) are mirrored here by hand, each
builder naming its wrapper: change the builder with the wrapper. Importing this module does not
import triton (the test process lists the kernels and counts their variants with it).
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import json
import math
import os
import re
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# kernel -> its module; each one is launched by a wrapper in that module (or a sibling)
KERNELS: dict[str, str] = {
    "_rms_norm_kernel": "kvtier.model.fused",
    "_rope_kernel": "kvtier.model.fused",
    "_silu_mul_kernel": "kvtier.model.fused",
    "_paged_decode_split": "kvtier.attention.paged_decode",
    "_combine_splits": "kvtier.attention.paged_decode",
    "put_rows": "kvtier.sparse.triton_decode",
    "buffers_attn_fwd": "kvtier.sparse.triton_decode",
    "_row_lse": "kvtier.sparse.triton_head_score",
    "_chunk_score": "kvtier.sparse.triton_head_score",
    "sparse_attn_fwd": "kvtier.sparse.triton_attn_kernels",
    "merge_splits": "kvtier.sparse.triton_attn_kernels",
    "_unpack_kivi": "kvtier.policies.quant_triton",
    "_unpack_fp8": "kvtier.policies.quant_triton",
    "_gather_rows": "kvtier.kv.host_gather",
    "_bisect_kernel": "kvtier.sparse.triton_bisect",
}

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


# --- kvtier.model.fused ---------------------------------------------------------------------


def _rms_norm() -> Iterator[Variant]:
    # `_rms_norm_launch`: x [M, N] 16-bit; M 1 in a decode step of one sequence
    for c in _cases(dtype=HALF, HAS_DELTA=(False, True), N=(128, 576, 4096, 8192), M=(1, 7)):
        n, x = c["N"], Ptr(c["dtype"])
        block_n = _p2(n)
        block_m = max(1, 4096 // block_n)
        args = dict(
            x=x, delta=x, weight=x, out=x, summed=x, M=c["M"], N=n, inv_n=1.0 / n, eps=1e-5,
            HAS_DELTA=c["HAS_DELTA"], BLOCK_M=block_m, BLOCK_N=block_n, INTERPRET=False,
        )  # fmt: skip
        warps = 8 if block_m * block_n >= 4096 else 4
        yield Variant("_rms_norm_kernel", c, args, dict(num_warps=warps, enable_fp_fusion=False))


def _rope() -> Iterator[Variant]:
    # `rope`: x [T, H, D] a slice of heads of a fused [T, 2 * H + 8, D] projection
    for c in _cases(dtype=HALF, D=(64, 128, 256), H=(1, 3, 32)):
        d, h, p = c["D"], c["H"], Ptr(c["dtype"])
        args = dict(
            x=p, cos=p, sin=p, out=p, H=h, stride_xt=(2 * h + 8) * d, stride_xh=d, stride_ct=d, stride_st=d,
            HALF=d // 2, BLOCK_H=min(_p2(h), 16), BLOCK_HALF=_p2(d // 2), INTERPRET=False,
        )  # fmt: skip
        yield Variant("_rope_kernel", c, args, dict(num_warps=4, enable_fp_fusion=False))


def _silu_mul() -> Iterator[Variant]:
    # `silu_mul`: gate and up the halves of a [T, 2I] gate-up output
    for c in _cases(dtype=HALF, I=(64, 1536, 14336)):
        width, p = c["I"], Ptr(c["dtype"])
        args = dict(
            gate=p, up=p, out=p, width=width, stride_g=2 * width, stride_u=2 * width,
            BLOCK=min(4096, _p2(width)), INTERPRET=False,
        )  # fmt: skip
        yield Variant("_silu_mul_kernel", c, args, dict(num_warps=8, enable_fp_fusion=False))


# --- kvtier.attention.paged_decode ----------------------------------------------------------


def _paged_decode_split() -> Iterator[Variant]:
    # `paged_decode_splits`: q [B, H_q, D], pages [N, P, 2, H_kv, D] of q's dtype, int32 tables
    # and lengths; S splits (1: a full batch; lse's head stride is then 1)
    hkv, page, blocks = 2, 16, 64
    for c in _cases(dtype=ACT, D=(64, 128), R=(1, 3, 8), S=(1, 16)):
        d, r, s, p = c["D"], c["R"], c["S"], Ptr(c["dtype"])
        hq = hkv * r
        args = dict(
            Q=p, PAGES=p, TABLES=Ptr("int32"), LENS=Ptr("int32"), OUT=Ptr("float32"), LSE=Ptr("float32"),
            stride_qb=hq * d, stride_qh=d, stride_qd=1,
            **_named("stride_pn stride_ps stride_pkv stride_ph stride_pd", _strides(100, page, 2, hkv, d)),
            stride_tb=blocks, stride_tn=1,
            stride_ob=hq * s * d, stride_oh=s * d, stride_os=d, stride_lb=hq * s, stride_lh=s,
            sm_scale_log2=math.log2(math.e) / math.sqrt(d),
            PAGE=page, R=r, BLOCK_H=max(16, _p2(r)), D=d, BLOCK_D=max(16, _p2(d)), BLOCK_N=64,
            IEEE=c["dtype"] == "float32", INTERPRET=False,
        )  # fmt: skip
        yield Variant("_paged_decode_split", c, args, dict(num_warps=4))


def _combine_splits() -> Iterator[Variant]:
    # `combine_splits_fused`: fp32 partials [B, H, S, D] (S > 1) into [B, H, D] of q's dtype
    h = 8
    for c in _cases(dtype=ACT, D=(64, 128), S=(2, 33)):
        d, s = c["D"], c["S"]
        args = dict(
            PART=Ptr("float32"), LSE=Ptr("float32"), OUT=Ptr(c["dtype"]),
            **_named("stride_pb stride_ph stride_ps stride_pd", _strides(4, h, s, d)),
            **_named("stride_lb stride_lh stride_ls", _strides(4, h, s)),
            **_named("stride_ob stride_oh stride_od", _strides(4, h, d)),
            S=s, D=d, BLOCK_S=_p2(s), BLOCK_D=_p2(d),
        )  # fmt: skip
        yield Variant("_combine_splits", c, args, dict(num_warps=1 if d <= 64 else 2))


# --- kvtier.sparse.triton_decode ------------------------------------------------------------


def _put_rows() -> Iterator[Variant]:
    # `attend_buffers_triton`: buffers [cap, G, D], new keys and values [B, G, D]
    for c in _cases(dtype=ACT, G=(1, 8), D=(64, 128)):
        g, d, p = c["G"], c["D"], Ptr(c["dtype"])
        args = dict(
            BASE=p, META=Ptr("int64"), K=p, V=p, stride_ks=g * d, stride_kg=d, stride_nb=g * d, stride_ng=d,
            stride_vb=g * d, stride_vg=d, G=g, D=d,
        )  # fmt: skip
        yield Variant("put_rows", c, args)


def _attn_tiles(rows: int, dtype: str, d: int) -> tuple[int, int, int, int]:
    """`kvtier.sparse.triton_attn._tiles` (its TILES override unset)."""
    if dtype != "float32" and d <= 128 and rows >= 128:
        return (256, 32, 8, 3) if rows >= 256 else (128, 32, 4, 2)
    block_m = 16 if rows <= 16 else (32 if rows <= 32 else 64)
    return block_m, 32 if dtype == "float32" or d > 128 else 64, 4, 3


def _buffers_attn_fwd() -> Iterator[Variant]:
    # `attend_buffers_triton`: one decode query per buffer, r = H_q / G rows a program
    b = 3
    for c in _cases(dtype=ACT, D=(64, 128, 256), GR=((3, 3), (8, 4), (1, 32))):
        (g, r), d, p = c["GR"], c["D"], Ptr(c["dtype"])
        h = g * r
        block_m, block_n, warps, stages = _attn_tiles(r, c["dtype"], d)
        args = dict(
            Q=p, BASE=p, META=Ptr("int64"), Out=Ptr("float32"), LSE=Ptr("float32"),
            stride_qb=h * d, stride_qh=d, stride_ks=g * d, stride_kg=d,
            stride_os=b * h * d, stride_ob=h * d, stride_oh=d, stride_ls=b * h, stride_lb=h,
            sm_scale_log2=math.log2(math.e) / math.sqrt(d),
            G=g, R=r, D=d, BLOCK_M=block_m, BLOCK_N=block_n, IEEE=c["dtype"] == "float32", INTERPRET=False,
        )  # fmt: skip
        yield Variant("buffers_attn_fwd", c, args, dict(num_warps=warps, num_stages=stages))


# --- kvtier.sparse.triton_attn_kernels (launched by kvtier.sparse.triton_attn, triton_decode) -


def _merge_splits() -> Iterator[Variant]:
    # `_launch` (SPLITS > 1, SPLITS_P2 its power of two) and `attend_buffers_triton` (SPLITS_P2
    # 64, SPLITS from 1)
    for c in _cases(dtype=ACT, D=(64, 128), SPLITS=((1, 64), (5, 64), (3, 4))):
        n, p2 = c["SPLITS"]
        args = dict(
            PART=Ptr("float32"),
            LSE=Ptr("float32"),
            Out=Ptr(c["dtype"]),
            N=36,
            SPLITS=n,
            D=c["D"],
            SPLITS_P2=p2,
        )
        yield Variant("merge_splits", c, args)


# (PER_BLOCK_WINDOW, K_GATHERED, ROTATE, STREAMING) that `_launch`'s two callers pass:
# `attend_block_triton` (a window of ints; keys gathered and rotated in torch when rotary) and
# `attend_blocks_triton` (per-block windows; keys rotated in the kernel when rotary; STREAMING
# is mode == "streaming", with or without rotary)
_ATTN_FLAGS = (
    (False, False, False, False),
    (False, True, False, False),
    *((True, False, rot, stream) for rot in (False, True) for stream in (False, True)),
)
# (dtype, D, Tb, r, P): a prefill block of 64 queries, a decode query, an fp32 block, no prefix
_ATTN_SHAPES = (
    ("bfloat16", 128, 64, 4, 200),
    ("float16", 64, 64, 3, 0),
    ("bfloat16", 128, 1, 4, 96),
    ("float32", 64, 16, 3, 40),
)


def _sparse_attn_fwd() -> Iterator[Variant]:
    g = 2
    for (per_block, gathered, rotate, streaming), split, (dtype, d, tb, r, p) in itertools.product(
        _ATTN_FLAGS, (False, True), _ATTN_SHAPES
    ):
        b = 2 if per_block else 1  # attend_block_triton: one block
        h = g * r
        block_m, block_n, warps, stages = _attn_tiles(tb * r, dtype, d)
        splits = 3 if split else 1
        s_out = _strides(splits, b, tb, h, d)
        s_lse = _strides(splits, b, tb, h) if split else (1, 1, 1, 1)  # `new_empty((1, 1, 1, 1))`
        s_k = (0, g * d, d) if gathered else (0, 2 * g * d, d)  # gathered [L, G, D]; else kv[:, 0]
        q = Ptr(dtype)
        case = dict(
            PER_BLOCK_WINDOW=per_block, K_GATHERED=gathered, SPLIT=split, ROTATE=rotate, STREAMING=streaming,
            dtype=dtype, D=d, Tb=tb, R=r, P=p,
        )  # fmt: skip
        args = dict(
            Q=q, QPOS=Ptr("int64"), K=q, V=q, PREFIX=Ptr("int64"), W0=Ptr("int64"), WEND=Ptr("int64"),
            COS=q, SIN=q, NPRE=Ptr("int64"), Out=Ptr("float32") if split else q, LSE=Ptr("float32"),
            stride_qb=tb * h * d, stride_qt=h * d, stride_qh=d, stride_pb=tb,
            stride_kb=s_k[0], stride_ks=s_k[1], stride_kg=s_k[2], stride_vs=2 * g * d, stride_vg=d,
            stride_prb=max(p, 1),  # P = 0: a [B, 1] placeholder
            stride_os=s_out[0], stride_ob=s_out[1], stride_ot=s_out[2], stride_oh=s_out[3],
            stride_ls=s_lse[0], stride_lb=s_lse[1], stride_lt=s_lse[2],
            Tb=tb, P=p, w0_scalar=0 if per_block else 300, wend_scalar=0 if per_block else 300 + tb,
            keys_per_split=192 if split else 1 << 30, sm_scale_log2=math.log2(math.e) / math.sqrt(d),
            G=g, R=r, D=d, BLOCK_M=block_m, BLOCK_N=block_n, PER_BLOCK_WINDOW=per_block, K_GATHERED=gathered,
            SPLIT=split, IEEE=dtype == "float32", INTERPRET=False, ROTATE=rotate, STREAMING=streaming,
        )  # fmt: skip
        yield Variant("sparse_attn_fwd", case, args, dict(num_warps=warps, num_stages=stages))


# --- kvtier.sparse.triton_head_score --------------------------------------------------------


def _head_score(kernel: str) -> Iterator[Variant]:
    # `softmax_head_score_triton` of `bisect_triton`'s rows: a view [B, C, G, rows] of
    # [B, G, R_pad, C] (C's stride 1), or any contiguous [B, C, G, rows] (rows' stride 1); live
    # bool (as int8) or the chunks' int64 lengths
    for c in _cases(layout=("kernel", "contiguous"), GR=((8, 192, 192), (1, 9, 16)), live=("int8", "int64")):
        (g, rows, r_pad), n_c = c["GR"], 300
        strides: tuple[int, ...] = (g * r_pad * n_c, 1, r_pad * n_c, n_c)  # layout "kernel"
        if c["layout"] == "contiguous":
            strides = _strides(2, n_c, g, rows)
        args: dict[str, Any] = dict(x_ptr=Ptr("float32"), live_ptr=Ptr(c["live"]), lse_ptr=Ptr("float32"))
        if kernel == "_chunk_score":
            args["out_ptr"] = Ptr("float32")
        args.update(
            C=n_c, ROWS=g * rows, RPG=rows, stride_b=strides[0], stride_c=strides[1], stride_g=strides[2],
            stride_r=strides[3], scale=0.125, BR=64, BC=64,
        )  # fmt: skip
        yield Variant(kernel, c, args)


# --- kvtier.policies.quant_triton -----------------------------------------------------------


def _unpack_kivi() -> Iterator[Variant]:
    # `unpack_kivi_into`: KIVI rows of `group` 32 tokens, bits 2, 4 or 8
    t = 32
    for c in _cases(dtype=ACT, BITS=(2, 4, 8), GD=((8, 128), (1, 64))):
        (g, d), bits = c["GD"], c["BITS"]
        cg = t if d % t == 0 else d  # `KiviCodec.channel_group`
        n_codes = t * g * d * bits // 8
        row_bytes = 2 * n_codes + 2 * g * d * 2 + 2 * t * g * (d // cg) * 2
        args = dict(
            rows=Ptr("uint8"), scales=Ptr("float16", aligned=n_codes % 8 == 0), out=Ptr(c["dtype"]),
            stride_row=row_bytes, stride_prow=row_bytes // 2, n_elem=t * g * d, gd=g * d, value_codes=n_codes,
            vp=t * g * d // cg, cg=cg, BITS=bits, BLOCK=1024,
        )  # fmt: skip
        yield Variant("_unpack_kivi", c, args)


def _unpack_fp8() -> Iterator[Variant]:
    # `unpack_fp8_into`: rows [m, 2 * G * D + 4 * G] bytes
    for c in _cases(dtype=ACT, GD=((8, 128), (1, 64))):
        g, d = c["GD"]
        n = 2 * g * d
        args = dict(
            rows=Ptr("uint8"), scales=Ptr("float16"), out=Ptr(c["dtype"]), stride_row=n + 4 * g,
            stride_srow=(n + 4 * g) // 2, first_scale=n // 2, n_elem=n, d=d, BLOCK=1024,
        )  # fmt: skip
        yield Variant("_unpack_fp8", c, args)


# --- kvtier.kv.host_gather ------------------------------------------------------------------


def _gather_rows() -> Iterator[Variant]:
    # `gather_tiles`: rows [E, 2, G, D] (all of a row, or with `keys` its first half) or packed
    # rows of bytes; a ring of one extent or several
    kinds = [(dtype, keys) for dtype in HALF for keys in (False, True)] + [("uint8", False)]
    for c in _cases(rows=kinds, GD=((8, 128), (1, 64)), ring=(1, 4)):
        (dtype, keys), (g, d) = c["rows"], c["GD"]
        row = 2 * g * d if dtype != "uint8" else 2 * g * d + 4 * g  # an FP8 row's bytes
        cols = g * d if keys else row
        args = dict(
            REF=Ptr(dtype), OFFSETS=Ptr("int64"), TILES=Ptr("int64"), OUT=Ptr(dtype), extent_tokens=4096,
            ring=c["ring"], ROW=row, COLS=cols, TILE=16, BLOCK_C=min(1024, _p2(cols)),
        )  # fmt: skip
        yield Variant("_gather_rows", c, args, dict(num_warps=4))


# --- kvtier.sparse.triton_bisect ------------------------------------------------------------

# (BITS, EXTENTS, ADDR, ARANGE) that `bisect_triton` passes: keys a tensor, a host slice's
# token rows (`ExtentKeys`) or its KIVI rows (BITS > 0, EXTENTS only); addresses only with
# candidates (not ARANGE) and keys a tensor
_BISECT_KEYS = (
    *((0, False, False, arange) for arange in (False, True)),
    *((0, True, False, arange) for arange in (False, True)),
    *((4, True, False, arange) for arange in (False, True)),
    (0, False, True, False),
)


def _bisect_variant(
    case: dict[str, Any],
    *,
    bits: int,
    extents: bool,
    addr: bool,
    arange: bool,
    rotate: bool,
    mode: int,
    per_row: bool,
    g: int,
    rows: int,
    dtype: str = "bfloat16",
    chunk: int = 64,
    d: int = 128,
    ring: int = 4,
    head: int | None = None,
    heads: int | None = None,
    first: int = 4096,
) -> Variant:
    """One `bisect_triton` launch: its ints as the wrapper derives them. head/heads: the host
    slice's KV head read (None: all) and heads a row (None: g)."""
    heads = heads if heads is not None else g
    tile = rows & -rows  # `prune_memory.row_tiles`
    r_pad, tr = (rows, tile) if tile >= 64 and tile != rows else (max(16, _p2(rows)), max(16, _p2(rows)))
    n_c = 300
    if bits:  # KIVI rows of 32 tokens: byte offsets; the wrapper reads head `head` of `heads`
        group = 32
        n_codes = group * heads * d * bits // 8
        k_ptr = Ptr("uint8")
        extent_tokens, stride_ks, stride_kg = 4096 // group, 2 * n_codes + 6 * heads * d * 2, 0
        head0, g_all = head or 0, heads
    elif extents:  # token rows [E, 2, heads, D]
        group, n_codes, k_ptr = 1, 0, Ptr(dtype)
        extent_tokens, stride_ks, stride_kg, head0, g_all = 4096, 2 * heads * d, d, 0, g
    else:  # keys [S, G, D] (kv[:, 0]): the extents' ints are placeholders, 1
        group, n_codes, k_ptr = 1, 0, Ptr(dtype)
        extent_tokens, ring, stride_ks, stride_kg, head0, g_all = 1, 1, 2 * g * d, d, 0, g
    args = dict(
        q_ptr=Ptr(dtype), k_ptr=k_ptr, cand_ptr=Ptr("int64"), addr_ptr=Ptr("int64"), len_ptr=Ptr("int64"),
        cos_ptr=Ptr(dtype), sin_ptr=Ptr(dtype), out_ptr=Ptr("float32"), row_ptr=Ptr("float32"),
        C=n_c, N=n_c * chunk, first=first, offs_ptr=Ptr("int64"), extent_tokens=extent_tokens, ring=ring,
        stride_ks=stride_ks, stride_kg=stride_kg, head0=head0, g_all=g_all, n_codes=n_codes, R_VALID=rows,
        G=g, R=r_pad, TR=tr, N_TILES=r_pad // tr, D=d, CHUNK=chunk,
        LEVELS=max(1, math.ceil(math.log2(chunk))), MODE=mode, ROTATE=rotate, ARANGE=arange,
        EXTENTS=extents, ADDR=addr, BITS=bits, GROUP=group, INTERPRET=False, PER_ROW=per_row, BLOCK_C=32,
    )  # fmt: skip
    return Variant("_bisect_kernel", case, args, dict(num_warps=8 if tr >= 128 else 4, num_stages=1))


def _bisect() -> Iterator[Variant]:
    # every flag combination the wrapper passes, at G 1 and 8 and rows of one tile (64) or three
    # (192 = 3 x 64)
    for (bits, extents, addr, arange), rotate, mode, per_row, g, rows in itertools.product(
        _BISECT_KEYS, (False, True), (0, 1, 2), (False, True), (1, 8), (64, 192)
    ):
        case: dict[str, Any] = dict(
            BITS=bits, EXTENTS=extents, ADDR=addr, ARANGE=arange, ROTATE=rotate, MODE=mode, PER_ROW=per_row,
            G=g, rows=rows,
        )  # fmt: skip
        yield _bisect_variant(
            case, bits=bits, extents=extents, addr=addr, arange=arange, rotate=rotate, mode=mode,
            per_row=per_row, g=g, rows=rows,
        )  # fmt: skip
    # a host slice's integers equal to 1 (constexprs in a real launch): one extent (ring), the
    # slice's KV head 1 of 8 or its only head (KIVI head0, g_all), first 1; other key widths and
    # dtypes, padded rows (9 -> 16), short chunks
    for bits, rotate, mode in itertools.product((0, 4), (False, True), (0, 1)):
        base: dict[str, Any] = dict(bits=bits, extents=True, addr=False, arange=True, rotate=rotate)
        extra: list[dict[str, Any]] = [dict(ring=1), dict(first=1)]
        if bits:
            extra += [dict(head=1, heads=8), dict(heads=1), dict(ring=1, heads=1)]
        for kw in extra:
            case = {"BITS": bits, "ROTATE": rotate, "MODE": mode, "G": 1, "rows": 64, **kw}
            yield _bisect_variant(case, **base, mode=mode, per_row=False, g=1, rows=64, **kw)
    for bits, rotate, mode, per_row in itertools.product((2, 8), (False, True), (0, 1, 2), (False, True)):
        case = dict(BITS=bits, EXTENTS=True, ROTATE=rotate, MODE=mode, PER_ROW=per_row, G=8, rows=192)
        yield _bisect_variant(
            case, bits=bits, extents=True, addr=False, arange=True, rotate=rotate, mode=mode, per_row=per_row,
            g=8, rows=192,
        )  # fmt: skip
    for dtype, d, rows, chunk, rotate in itertools.product(
        ("float16", "float32"), (64, 128), (9, 256), (8, 64), (False, True)
    ):
        case = dict(dtype=dtype, D=d, rows=rows, CHUNK=chunk, ROTATE=rotate, MODE=2, G=3)
        yield _bisect_variant(
            case, bits=0, extents=False, addr=False, arange=False, rotate=rotate, mode=2, per_row=True, g=3,
            rows=rows, dtype=dtype, chunk=chunk, d=d,
        )  # fmt: skip


BUILDERS: dict[str, Callable[[], Iterator[Variant]]] = {
    "_rms_norm_kernel": _rms_norm,
    "_rope_kernel": _rope,
    "_silu_mul_kernel": _silu_mul,
    "_paged_decode_split": _paged_decode_split,
    "_combine_splits": _combine_splits,
    "put_rows": _put_rows,
    "buffers_attn_fwd": _buffers_attn_fwd,
    "_row_lse": lambda: _head_score("_row_lse"),
    "_chunk_score": lambda: _head_score("_chunk_score"),
    "sparse_attn_fwd": _sparse_attn_fwd,
    "merge_splits": _merge_splits,
    "_unpack_kivi": _unpack_kivi,
    "_unpack_fp8": _unpack_fp8,
    "_gather_rows": _gather_rows,
    "_bisect_kernel": _bisect,
}


def variants(kernels: list[str] | None = None) -> list[Variant]:
    """Every variant of `kernels` (None: all), in a fixed order."""
    return [v for name in kernels or list(KERNELS) for v in BUILDERS[name]()]


# --- compiling ------------------------------------------------------------------------------


class _Tensor:
    """What Triton's specializer reads of a tensor argument: its dtype and data pointer."""

    def __init__(self, ptr: Ptr) -> None:
        import torch

        self.dtype = getattr(torch, ptr.dtype)
        self._ptr = 1 << 20 if ptr.aligned else (1 << 20) + 2

    def data_ptr(self) -> int:
        return self._ptr


def _chain(exc: BaseException) -> list[BaseException]:
    """exc and its `__cause__`s, outermost first: the last is the root cause."""
    out = [exc]
    while out[-1].__cause__ is not None:
        out.append(out[-1].__cause__)
    return out


def describe(exc: BaseException, scope: dict[str, Any] | None = None) -> str:
    """The root cause's message, then where it was raised: each Triton function on the way (the
    kernel, then the helpers it calls) at its file and line where `scope` (name -> JITFunction)
    has it, and the innermost source line."""
    chain = _chain(exc)
    root = chain[-1]
    message = getattr(root, "error_message", None) or f"{type(root).__name__}: {root}"
    steps, line = [], ""
    for e in chain:
        node, src = getattr(e, "node", None), getattr(e, "src", None)
        if node is None or not hasattr(node, "lineno") or not isinstance(src, str):
            continue  # not a CompilationError with a location
        found = re.search(r"def\s+(\w+)", src)
        name = found.group(1) if found else "?"
        fn = (scope or {}).get(name)
        if fn is not None:  # node.lineno counts from the function's `def` line
            path = Path(fn.file_name)
            where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
            steps.append(f"{name} ({where}:{fn.def_file_line_number + node.lineno - 1})")
        else:
            steps.append(f"{name} (line {node.lineno} from its def)")
        lines = src.splitlines()
        line = lines[node.lineno - 1].strip() if node.lineno <= len(lines) else ""
    text = str(message).strip()
    if steps:
        text += f"\n  at {' > '.join(steps)}: {line}"
    return text


def _jit_scope(fn: Any) -> dict[str, Any]:
    """The JITFunctions `fn` can reach by name: its module's, and theirs (helpers' modules)."""
    from triton.runtime.jit import JITFunction

    scope, todo = {fn.__name__: fn}, [fn]
    while todo:
        for name, value in todo.pop().fn.__globals__.items():
            if isinstance(value, JITFunction) and name not in scope:
                scope[name] = value
                todo.append(value)
    return scope


class Compiler:
    """make_ir for sm90 with the CUDA backend; no GPU needed."""

    def __init__(self) -> None:
        from triton.backends.compiler import GPUTarget
        from triton.backends.nvidia.compiler import CUDABackend

        self.target = GPUTarget("cuda", 90, 32)
        self.backend = CUDABackend(self.target)

    def signature(
        self, fn: Any, args: dict[str, Any]
    ) -> tuple[dict[str, str], dict[Any, Any], dict[Any, Any]]:
        """(signature, constexprs, attrs) of a launch with `args`, as the JIT's binder makes them."""
        from triton.runtime.jit import native_specialize_impl

        if set(args) != set(fn.arg_names):
            raise TypeError(f"arguments {sorted(set(args) ^ set(fn.arg_names))} missing or unknown")
        signature: dict[str, str] = {}
        constexprs: dict[Any, Any] = {}
        attrs: dict[Any, Any] = {}
        for i, p in enumerate(fn.params):
            value = args[p.name]
            if p.is_constexpr:
                signature[p.name], constexprs[(i,)] = "constexpr", value
                continue
            arg = _Tensor(value) if isinstance(value, Ptr) else value
            specialize, align = not p.do_not_specialize, not p.do_not_specialize_on_alignment
            ty, attr = native_specialize_impl(type(self.backend), arg, p.is_const, specialize, align)[:2]
            signature[p.name] = ty
            if ty == "constexpr":
                constexprs[(i,)] = attr
            elif isinstance(attr, str):
                attrs[(i,)] = self.backend.parse_attr(attr)
        return signature, constexprs, attrs

    def compile(self, variant: Variant) -> str | None:
        """None where `variant` compiles to TTIR, else `describe` of the error."""
        from triton._C.libtriton import ir
        from triton.compiler import ASTSource
        from triton.runtime.jit import JITFunction

        fn = getattr(importlib.import_module(KERNELS[variant.kernel]), variant.kernel)
        if not isinstance(fn, JITFunction):
            return f"{variant.kernel} is a {type(fn).__name__}, not a JITFunction: is TRITON_INTERPRET set?"
        try:
            src = ASTSource(fn, *self.signature(fn, variant.args))
            opts = self.backend.parse_options(variant.options)
            context = ir.context()
            ir.load_dialects(context)
            self.backend.load_dialects(context)
            codegen = self.backend.get_codegen_implementation(opts)
            src.make_ir(self.target, opts, codegen, self.backend.get_module_map(), context)
        except Exception as e:
            return describe(e, _jit_scope(fn))
        return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("kernels", nargs="*", help="kernels (default: all)")
    parser.add_argument("--shard", default="0/1", help="I/N: every N-th variant from the I-th")
    opts = parser.parse_args(argv)
    unknown = set(opts.kernels) - set(KERNELS)
    if unknown:
        parser.error(f"unknown kernels {sorted(unknown)}; known: {', '.join(KERNELS)}")
    index, count = (int(x) for x in opts.shard.split("/"))
    if "triton" not in sys.modules:  # Triton reads it where kvtier's kernels are decorated, below
        os.environ.pop("TRITON_INTERPRET", None)
    compiler = Compiler()
    failed = 0
    every = variants(opts.kernels or None)
    for i in range(index, len(every), count):
        v = every[i]
        error = compiler.compile(v)
        failed += error is not None
        print(json.dumps({"index": i, "kernel": v.kernel, "variant": v.label, "error": error}), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
