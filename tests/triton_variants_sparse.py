"""The variants of HiP's Triton kernels (`kvtier.sparse`): the decode buffers' attention, the
block-sparse attention and its split merge, the softmax head score's two passes, the pruning
bisection and the exact fine-chunk scoring, as their wrappers launch them
(`tests.triton_variants` lists every kernel)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from typing import Any

from kvtier.sparse.prune_memory import bisect_block_c, row_tiles
from tests.triton_variant_parts import ACT, Ptr, Variant, _cases, _p2, _strides

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
        if d <= 64 and rows <= 256:
            return (256, 64, 8, 2)
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
        if kernel != "_chunk_score":
            yield Variant(kernel, c, args)
            continue
        # the rows' logsumexp read ([B, ROWS]) or combined from the bisection's parts
        # ([B, G, R_pad, P]: 10 parts of 32 chunks)
        for parts in (False, True):
            more = dict(
                m_ptr=Ptr("float32"), s_ptr=Ptr("float32"), P=10, part_b=g * r_pad * 10, part_g=r_pad * 10
            )
            if not parts:  # placeholders, as `softmax_head_score_triton` passes them
                more.update(P=1, part_b=0, part_g=0)
            yield Variant(kernel, {**c, "PARTS": parts}, {**args, **more, "PARTS": parts, "BP": 16})


def _combine_lse() -> Iterator[Variant]:
    # `softmax_head_score_parts` without the fold: parts [B, G, R_pad, P] of 1, 10 or 64 programs
    for (g, rows, r_pad), parts in itertools.product(((8, 192, 192), (1, 9, 16)), (1, 10, 64)):
        args = dict(
            m_ptr=Ptr("float32"), s_ptr=Ptr("float32"), lse_ptr=Ptr("float32"), ROWS=g * rows, RPG=rows,
            P=parts, part_b=g * r_pad * parts, part_g=r_pad * parts, BR=64, BP=16,
        )  # fmt: skip
        yield Variant("_combine_lse", dict(G=g, rows=rows, P=parts), args)


# --- kvtier.sparse.triton_bisect ------------------------------------------------------------

# (BITS, EXTENTS, ADDR, ARANGE, PARAMS) that `bisect_triton` passes: keys a tensor, a host
# slice's token rows (`ExtentKeys`) or its KIVI rows (BITS > 0, EXTENTS only; their key
# parameters copied first, PARAMS, only with ARANGE: `stage0_params`); addresses only with
# candidates (not ARANGE) and keys a tensor
_BISECT_KEYS = (
    *((0, False, False, arange, False) for arange in (False, True)),
    *((0, True, False, arange, False) for arange in (False, True)),
    *((4, True, False, arange, False) for arange in (False, True)),
    (4, True, False, True, True),
    (0, False, True, False, False),
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
    lse: bool = False,
    dtype: str = "bfloat16",
    chunk: int = 64,
    d: int = 128,
    ring: int = 4,
    head: int | None = None,
    heads: int | None = None,
    first: int = 4096,
    params: bool = False,
) -> Variant:
    """One `bisect_triton` launch: its ints as the wrapper derives them. head/heads: the host
    slice's KV head read (None: all) and heads a row (None: g)."""
    heads = heads if heads is not None else g
    r_pad, tr = row_tiles(rows, d * (4 if dtype == "float32" else 2))
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
        lse_m_ptr=Ptr("float32"), lse_s_ptr=Ptr("float32"), scale=0.125 if lse else 1.0, C=n_c,
        N=n_c * chunk, first=first, offs_ptr=Ptr("int64"), extent_tokens=extent_tokens, ring=ring,
        stride_ks=stride_ks, stride_kg=stride_kg, head0=head0, g_all=g_all, n_codes=n_codes, R_VALID=rows,
        G=g, R=r_pad, TR=tr, N_TILES=r_pad // tr, D=d, CHUNK=chunk,
        LEVELS=max(1, math.ceil(math.log2(chunk))), MODE=mode, ROTATE=rotate, ARANGE=arange,
        EXTENTS=extents, ADDR=addr, BITS=bits, GROUP=group, INTERPRET=False, PER_ROW=per_row, LSE=lse,
        BLOCK_C=bisect_block_c(per_row), prm_ptr=Ptr("float16") if params else Ptr("float32"),
        row0=first // group if params else 0, PARAMS=params,
    )  # fmt: skip
    return Variant("_bisect_kernel", case, args, dict(num_warps=8 if tr >= 128 else 4, num_stages=1))


def _bisect() -> Iterator[Variant]:
    # every flag combination the wrapper passes, at G 1 and 8 and rows of one tile (64) or three
    # (192 = 3 x 64); the per-row maxima without and with their logsumexp parts (LSE)
    for (bits, extents, addr, arange, params), rotate, mode, (per_row, lse), g, rows in itertools.product(
        _BISECT_KEYS,
        (False, True),
        (0, 1, 2),
        ((False, False), (True, False), (True, True)),
        (1, 8),
        (64, 192),
    ):
        case: dict[str, Any] = dict(
            BITS=bits, EXTENTS=extents, ADDR=addr, ARANGE=arange, PARAMS=params, ROTATE=rotate, MODE=mode,
            PER_ROW=per_row, LSE=lse, G=g, rows=rows,
        )  # fmt: skip
        yield _bisect_variant(
            case, bits=bits, extents=extents, addr=addr, arange=arange, rotate=rotate, mode=mode,
            per_row=per_row, g=g, rows=rows, lse=lse, params=params,
        )  # fmt: skip
    # a host slice's integers equal to 1 (constexprs in a real launch): one extent (ring), the
    # slice's KV head 1 of 8 or its only head (KIVI head0, g_all), first 1; other key widths and
    # dtypes, padded rows (9 -> 16), short chunks
    for bits, rotate, mode in itertools.product((0, 4), (False, True), (0, 1)):
        base: dict[str, Any] = dict(bits=bits, extents=True, addr=False, arange=True, rotate=rotate)
        extra: list[dict[str, Any]] = [dict(ring=1), dict(first=1)]
        if bits:
            extra += [dict(head=1, heads=8), dict(heads=1), dict(ring=1, heads=1)]
            extra += [dict(params=True, first=32), dict(params=True, head=1, heads=8)]
            extra += [dict(params=True, heads=1)]
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
            rows=rows, lse=True, dtype=dtype, chunk=chunk, d=d,
        )  # fmt: skip
    # the tallest rows: a stage-0 group of 1,024 queries pooled 4 with 4 heads a KV head (tiles within
    # `prune_memory.TILE_QUERY_BYTES`), float32 queries of 128- and 256-wide heads, rotated in the kernel
    for d in (128, 256):
        case = dict(dtype="float32", D=d, rows=1024, ROTATE=True, MODE=0, G=8, PER_ROW=True, LSE=True)
        yield _bisect_variant(
            case, bits=0, extents=False, addr=False, arange=True, rotate=True, mode=0, per_row=True, g=8,
            rows=1024, lse=True, dtype="float32", d=d,
        )  # fmt: skip


def _gather_key_params() -> Iterator[Variant]:
    # `triton_keys.key_params`: KIVI rows of 32 tokens, one head of 8 or all of G (8, 3 of
    # SmolLM2's, or 1); a ring of one extent or several; row0 0 or not
    for (g, heads, head0, d, bits), ring, row0 in itertools.product(
        ((1, 8, 1, 128, 4), (8, 8, 0, 128, 4), (3, 3, 0, 64, 4), (1, 1, 0, 128, 2)), (1, 4), (0, 9)
    ):
        n_codes = 32 * heads * d * bits // 8
        gd = g * d
        args = dict(
            rows=Ptr("uint8"), offs_ptr=Ptr("int64"), extent_rows=128, ring=ring,
            row_bytes=2 * n_codes + 6 * heads * d * 2, n_codes=n_codes, head0=head0, g_all=heads, row0=row0,
            n_rows=16385, out=Ptr("float16"), D=d, GD=gd, GD_P2=_p2(gd), BLOCK_R=16,
        )  # fmt: skip
        yield Variant("_gather_key_params", dict(G=g, heads=heads, D=d, ring=ring, row0=row0), args)


def _chunk_max_variant(
    case: dict[str, Any],
    *,
    arange: bool,
    rotate: bool,
    mode: int,
    per_row: bool,
    lse: bool,
    g: int,
    rows: int,
    chunk: int,
    d: int = 64,
    dtype: str = "bfloat16",
) -> Variant:
    """One `chunk_max_triton` launch: its ints as the wrapper derives them."""
    r_pad, tr = row_tiles(rows, d * (4 if dtype == "float32" else 2))
    n_c = 300
    args = dict(
        q_ptr=Ptr(dtype), k_ptr=Ptr(dtype), cand_ptr=Ptr("int64"), len_ptr=Ptr("int64"), cos_ptr=Ptr(dtype),
        sin_ptr=Ptr(dtype), out_ptr=Ptr("float32"), row_ptr=Ptr("float32"), lse_m_ptr=Ptr("float32"),
        lse_s_ptr=Ptr("float32"), scale=0.125 if lse else 1.0, C=n_c, N=n_c * chunk, first=4096,
        stride_ks=2 * g * d, stride_kg=d, R_VALID=rows, G=g, R=r_pad, TR=tr, N_TILES=r_pad // tr, D=d,
        CHUNK=chunk, TILE=64, MODE=mode, ROTATE=rotate, ARANGE=arange, INTERPRET=False, PER_ROW=per_row,
        LSE=lse, BLOCK_C=max(32, 64 // chunk),
    )  # fmt: skip
    return Variant("_chunk_max_kernel", case, args, dict(num_warps=8 if tr >= 128 else 4, num_stages=1))


def _chunk_max() -> Iterator[Variant]:
    # every flag the wrapper passes, at SmolLM2's shapes (3 KV heads, 192 rows in 3 tiles, D 64)
    # and chunks of 8 and 16; then other heads, rows, widths, dtypes and the extreme chunks
    for arange, rotate, mode, (per_row, lse), chunk in itertools.product(
        (False, True), (False, True), (0, 1, 2), ((False, False), (True, False), (True, True)), (8, 16)
    ):
        case: dict[str, Any] = dict(
            ARANGE=arange, ROTATE=rotate, MODE=mode, PER_ROW=per_row, LSE=lse, CHUNK=chunk, G=3, rows=192
        )
        yield _chunk_max_variant(
            case,
            arange=arange,
            rotate=rotate,
            mode=mode,
            per_row=per_row,
            lse=lse,
            g=3,
            rows=192,
            chunk=chunk,
        )
    for g, rows, d, dtype, chunk in (
        (8, 64, 128, "bfloat16", 8),
        (1, 256, 128, "float16", 1),
        (4, 9, 64, "float32", 64),
        (2, 32, 128, "bfloat16", 32),
    ):
        for mode in (0, 1, 2):
            case = dict(G=g, rows=rows, D=d, dtype=dtype, CHUNK=chunk, MODE=mode)
            yield _chunk_max_variant(
                case, arange=False, rotate=True, mode=mode, per_row=True, lse=True, g=g, rows=rows,
                chunk=chunk, d=d, dtype=dtype,
            )  # fmt: skip
    # stage 0 on landmarks (`landmarks._triton_scores`): one-key chunks of a rotated key table,
    # Llama-3's 8 KV heads of 16 pooled rows x 4 query heads, both head scores
    for per_row, lse in ((False, False), (True, True)):
        case = dict(G=8, rows=64, D=128, CHUNK=1, ARANGE=True, PER_ROW=per_row, landmarks=True)
        yield _chunk_max_variant(
            case, arange=True, rotate=False, mode=1, per_row=per_row, lse=lse, g=8, rows=64, chunk=1, d=128
        )


def _key_scores() -> Iterator[Variant]:
    """`key_scores_triton` (kvtier.sparse.triton_landmarks): Llama-3's 8 KV heads of 4 query heads
    and SmolLM2's 3 of 3, bf16 rotated queries and keys, hip-attention's 512-query window."""
    for g, r, d in ((8, 4, 128), (3, 3, 64)):
        args = dict(
            q_ptr=Ptr("bfloat16"), k_ptr=Ptr("bfloat16"), out_ptr=Ptr("float32"), T=16384,
            stride_qt=g * r * d, stride_qh=d, stride_kt=g * d, stride_kg=d, G=g, R=r, D=d, WINDOW=512,
            BT=64, BQ=64, INTERPRET=False,
        )  # fmt: skip
        yield Variant("_key_scores_kernel", dict(G=g, R=r, D=d), args, dict(num_warps=4, num_stages=2))
