"""Triton kernel for a HiP pruning stage's chunk scores: `prefill._bisect` in one launch.

`_bisect` runs each level as ~10 torch operators over float32 copies of the probe keys (at 512K
~1.6 GB and ~3,000 launches a layer's slice). Here one program scores BLOCK_C chunks of one
query block, walking the bisection in registers (none where all its chunks are empty):

    for each level:                        lo = 0, hi = length of the chunk
        left  = chunk[(lo + mid) // 2]     mid = lo + (hi - lo) // 2
        right = chunk[(mid + hi) // 2]
        s_side = max over KV heads g and rows of q[g] . rot(k[side, g])     (tl.dot per g)
        best = max(best, s_left, s_right); go right where s_right > s_left

q holds each KV head's rows (pooled queries x its r query heads), already rotated at their
scoring positions. Both probes of a level share one loop over the heads (`_probe_pair`: each
head's rows are loaded once for the two). Keys are read by position straight from the slice's
[S, G, D] keys and, with context extension, rotated in the kernel at `probe_positions` with the
table's cos/sin, rounding each product and the sum to the keys' dtype as `Rotary.apply` does (so
the rotated probe keys are the reference's); in relative mode the left probe sits at position 0,
where cos 1 and sin 0 leave every key value as it is, so it is not rotated at all. The scores
differ from the reference's float32 einsum only in summation order.

Stage 0's candidates are every position of [first, first + valid[b]), so instead of a
[B, N] candidate tensor (64 blocks x 512K positions: 268 MB) the kernel computes them
(ARANGE): position = first + chunk * CHUNK + offset.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from kvtier.attention.interface import ExtentKeys
from kvtier.sparse.prune_memory import bisect_block_c, num_warps
from kvtier.sparse.triton_head_score import ScoreLaunch, dots, row_max, store_lse_part
from kvtier.sparse.triton_keys import (
    key_source,
    load_key,
    packed_key,
    probe_pos,
    rope_rows,
    row_offsets,
    stage0_params,
)

MODES = {"absolute": 0, "relative": 1, "chunk_indexed": 2}
# chunks a program: None takes `bisect_block_c`'s choice by head score (the fastest of 16/32/64
# for each: bench/hip_kernels.py); an int forces it
BLOCK_C: int | None = None
# None: `num_warps`'s choice by shape (bench/hip_kernels.py sweeps); an int forces it
NUM_WARPS: int | None = None
# Stage 0 over KIVI rows in place: copy the rows' key minima and steps to the GPU first
# (`triton_keys.key_params`) where that reads fewer bytes than the probes would; False reads
# them with every probe (bench/hip_decode_profile.py --key-params per-probe, its A/B)
KEY_PARAMS_FIRST = True


@triton.jit
def _probe_pair(  # type: ignore[no-untyped-def]
    q_base,  # pointer: this block's rows, [G, R, D]
    row_base,  # pointer: this block's per-row maxima [G, R, C] (PER_ROW only)
    k_ptr,
    cand_base,  # pointer: this block's candidates [N] (unused when ARANGE)
    addr_base,  # pointer: their keys' element offsets from k_ptr [N] (ADDR only)
    cos_ptr,
    sin_ptr,
    cs,  # [BC] chunk indices
    cmask,  # [BC]
    off_l,  # [BC] offsets of the left and right probes in their chunks
    off_r,
    length,  # [BC] valid entries of the chunk
    first,
    level,  # the bisection's level: the row maxima are read from the second on (PER_ROW)
    last,  # whether it is the last level: the rows' logsumexp parts are written then (LSE)
    lse_m_base,  # pointers: this block's logsumexp parts [G, R, P] (LSE only)
    lse_s_base,
    part,  # this program's part: its index along the chunks
    P,
    scale,
    offs_ptr,  # [extents] int64 (EXTENTS only)
    extent_tokens,  # tokens an extent (BITS: rows)
    ring,
    stride_ks,  # elements between token rows (BITS: bytes between packed rows)
    stride_kg,
    head0,  # BITS: the first KV head read, of g_all in a row
    g_all,
    n_codes,  # BITS: bytes of a row's key codes
    prm_ptr,  # PARAMS: the rows' key minima and steps [rows, 2, G, D] fp16 (`key_params`)
    row0,  # PARAMS: the packed row prm_ptr's first holds
    R_VALID,
    C,
    G: tl.constexpr,
    R: tl.constexpr,  # rows a head holds in q and in the row maxima: TR * N_TILES
    TR: tl.constexpr,  # rows a tile (a power of two)
    N_TILES: tl.constexpr,
    D: tl.constexpr,
    CHUNK: tl.constexpr,
    MODE: tl.constexpr,
    ROTATE: tl.constexpr,
    ARANGE: tl.constexpr,
    EXTENTS: tl.constexpr,
    ADDR: tl.constexpr,  # keys at the element offsets addr_base gives, not at their positions
    BITS: tl.constexpr,  # 0: full-precision keys; else KIVI rows of GROUP tokens
    GROUP: tl.constexpr,
    PARAMS: tl.constexpr,  # BITS: the key minima and steps read from prm_ptr, not the rows
    INTERPRET: tl.constexpr,
    PER_ROW: tl.constexpr,
    LSE: tl.constexpr,  # with PER_ROW: also each row's logsumexp over this program's live chunks
    BLOCK_C: tl.constexpr,
):
    """Both probes of a level: max over KV heads and rows of q . k(probe), [BC] float32 each.
    One loop over the heads loads both probes' keys once and the head's rows a tile of TR at a
    time (N_TILES > 1 where the rows are not a power of two: 192 of SmolLM2's 64 queries x 3
    heads in 3 tiles of 64, not 256 with 64 masked). With PER_ROW each row's max(left, right)
    also goes into the row maxima (this program owns its chunks' cells); with LSE, at the last
    level (the cells final) each row's logsumexp over the program's live chunks of scale times
    them, in two parts: the max m and the sum of exp(x - m) (`triton_head_score`)."""
    pos_l = probe_pos(cand_base, cs, cmask, off_l, length, first, CHUNK, ARANGE)
    pos_r = probe_pos(cand_base, cs, cmask, off_r, length, first, CHUNK, ARANGE)
    if ADDR:  # rows of a block cache's bank (or its overflow): offsets the caller computed
        live = cmask & (length > 0)
        row_l = tl.load(addr_base + cs * CHUNK + off_l, mask=live, other=0).to(tl.int64)
        row_r = tl.load(addr_base + cs * CHUNK + off_r, mask=live, other=0).to(tl.int64)
    elif BITS > 0:  # a packed row holds GROUP tokens: its byte offset, and each probe's token in it
        row_l = row_offsets(pos_l // GROUP, offs_ptr, extent_tokens, ring, stride_ks, EXTENTS)
        row_r = row_offsets(pos_r // GROUP, offs_ptr, extent_tokens, ring, stride_ks, EXTENTS)
        t_l = pos_l % GROUP
        t_r = pos_r % GROUP
        if PARAMS:  # head g's minima at [row - row0, 0, g], its steps G * D elements on
            sp_l = prm_ptr + (pos_l // GROUP - row0) * (2 * G * D)
            sp_r = prm_ptr + (pos_r // GROUP - row0) * (2 * G * D)
            s_stride = G * D
        else:  # after the row's key and value codes: [g_all, D] minima, then the steps
            sp_l = (k_ptr + row_l + 2 * n_codes).to(tl.pointer_type(tl.float16))
            sp_r = (k_ptr + row_r + 2 * n_codes).to(tl.pointer_type(tl.float16))
            s_stride = g_all * D
    else:
        row_l = row_offsets(pos_l, offs_ptr, extent_tokens, ring, stride_ks, EXTENTS)
        row_r = row_offsets(pos_r, offs_ptr, extent_tokens, ring, stride_ks, EXTENTS)
    kdt = q_base.dtype.element_ty  # the keys' dtype, as the queries'
    d = tl.arange(0, D)
    best_l = tl.full((BLOCK_C,), float("-inf"), tl.float32)
    best_r = tl.full((BLOCK_C,), float("-inf"), tl.float32)
    c_l, s_l, c_r, s_r = best_l, best_l, best_l, best_l  # placeholders without ROTATE
    if ROTATE:
        if MODE == 1:  # relative: every left probe at position 0, every right one at 1
            rp_l = tl.zeros_like(pos_l)
            rp_r = rp_l + 1
        elif MODE == 2:  # chunk-indexed: at the chunk's index
            rp_l = cs.to(tl.int64)
            rp_r = rp_l
        else:
            rp_l = pos_l
            rp_r = pos_r
        c_l, s_l = rope_rows(cos_ptr, sin_ptr, rp_l, d, D)
        c_r, s_r = rope_rows(cos_ptr, sin_ptr, rp_r, d, D)
    for g in range(G):  # NOTE: not unrolled: 8 heads x 16 probes of unrolled dots took minutes to compile
        # relative: the left probe's rotation at 0 is the identity (cos 1, sin 0), so none
        if BITS > 0:
            h = head0 + g
            sh = g if PARAMS else h
            # NOTE: the flag inline: assigned to a local it stops being a constexpr, and the
            # rotation's branch compiles (and fails) where ROTATE is off (1M, host int4 keys)
            k_l = packed_key(
                k_ptr, row_l, t_l, h, d, c_l, s_l, g_all, sp_l, sh, s_stride, kdt, D, BITS,
                ROTATE and MODE != 1,
            )  # fmt: skip
            k_r = packed_key(
                k_ptr, row_r, t_r, h, d, c_r, s_r, g_all, sp_r, sh, s_stride, kdt, D, BITS, ROTATE
            )  # fmt: skip
        else:
            k_l = load_key(k_ptr + row_l[:, None] + g * stride_kg, d, c_l, s_l, D, ROTATE and MODE != 1)
            k_r = load_key(k_ptr + row_r[:, None] + g * stride_kg, d, c_r, s_r, D, ROTATE)
        for tile in range(N_TILES):
            rows = tile * TR + tl.arange(0, TR)
            rmask = rows < R_VALID
            q = tl.load(q_base + g * R * D + rows[:, None] * D + d[None, :], mask=rmask[:, None], other=0.0)
            sc_l = dots(q, k_l, INTERPRET)  # [TR, BC]
            sc_r = dots(q, k_r, INTERPRET)
            best_l = tl.maximum(best_l, row_max(sc_l, rmask))
            best_r = tl.maximum(best_r, row_max(sc_r, rmask))
            if PER_ROW:  # NOTE: level 0 writes every cell a reader reads, so the rows need no fill
                cells = row_base + g * R * C + rows[:, None] * C + cs[None, :]
                # NOTE: not `live` (ADDR's [BC] mask): a loop may not reshape a variable it carries
                owned = rmask[:, None] & cmask[None, :]
                old = tl.load(cells, mask=owned & (level > 0), other=float("-inf"))
                cell = tl.maximum(old, tl.maximum(sc_l, sc_r))
                tl.store(cells, cell, mask=owned)
                if LSE:  # noqa: SIM102 (a constexpr branch alone: off, the body is not compiled)
                    if last:  # NOTE: `alive`, not `live` (a name the ADDR branch gives a [BC] mask)
                        alive = cmask & (length > 0)
                        at = (g * R + rows) * P + part
                        store_lse_part(cell, scale, rmask, alive, lse_m_base + at, lse_s_base + at)
    return best_l, best_r


@triton.jit
def _bisect_kernel(  # type: ignore[no-untyped-def]
    q_ptr,  # [B, G, R, D]
    k_ptr,  # [S, G, D] (last dim contiguous)
    cand_ptr,  # [B, N] int64 (unused when ARANGE)
    addr_ptr,  # [B, N] int64 element offsets of the candidates' keys (ADDR only)
    len_ptr,  # [B, C] int64
    cos_ptr,  # [P, D] (unused unless ROTATE)
    sin_ptr,
    out_ptr,  # [B, C] float32
    row_ptr,  # [B, G, R, C] float32 (PER_ROW only): written where rows < R_VALID, read nowhere else
    lse_m_ptr,  # [B, G, R, P] float32 (LSE only): each row's logsumexp parts, P = programs along C
    lse_s_ptr,
    scale,  # the head score's scale (LSE only)
    C,
    N,
    first,
    offs_ptr,  # [extents] int64 element offsets of a host slice's extents (EXTENTS only)
    extent_tokens,
    ring,
    stride_ks,
    stride_kg,
    head0,
    g_all,
    n_codes,
    prm_ptr,  # [rows, 2, G, D] float16 (PARAMS only)
    row0,
    R_VALID,
    G: tl.constexpr,
    R: tl.constexpr,
    TR: tl.constexpr,
    N_TILES: tl.constexpr,
    D: tl.constexpr,
    CHUNK: tl.constexpr,
    LEVELS: tl.constexpr,
    MODE: tl.constexpr,
    ROTATE: tl.constexpr,
    ARANGE: tl.constexpr,
    EXTENTS: tl.constexpr,
    ADDR: tl.constexpr,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    PARAMS: tl.constexpr,
    INTERPRET: tl.constexpr,
    PER_ROW: tl.constexpr,
    LSE: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    n_parts = tl.num_programs(1)
    cs = part * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cs < C
    length = tl.load(len_ptr + b * C + cs, mask=cmask, other=0)
    q_base = q_ptr + b * G * R * D
    cand_base = cand_ptr + b * N
    lo = tl.zeros_like(length)
    hi = length
    best = tl.full((BLOCK_C,), float("-inf"), tl.float32)
    lse_m_base = lse_m_ptr + b * G * R * n_parts
    lse_s_base = lse_s_ptr + b * G * R * n_parts
    if tl.max(length, axis=0) > 0:  # else none (~half of SmolLM2's 16K causal grid under `lean`)
        for level in range(LEVELS):
            mid = lo + (hi - lo) // 2
            off_l = tl.minimum((lo + mid) // 2, CHUNK - 1)
            off_r = tl.minimum((mid + hi) // 2, CHUNK - 1)
            s_l, s_r = _probe_pair(
                q_base, row_ptr + b * G * R * C, k_ptr, cand_base, addr_ptr + b * N, cos_ptr, sin_ptr, cs,
                cmask, off_l, off_r, length, first, level, level == LEVELS - 1, lse_m_base, lse_s_base, part,
                n_parts, scale, offs_ptr, extent_tokens, ring, stride_ks, stride_kg, head0, g_all, n_codes,
                prm_ptr, row0, R_VALID, C, G, R, TR, N_TILES, D, CHUNK, MODE, ROTATE, ARANGE, EXTENTS, ADDR,
                BITS, GROUP, PARAMS, INTERPRET, PER_ROW, LSE, BLOCK_C,
            )  # fmt: skip
            right = s_r > s_l
            best = tl.maximum(best, tl.maximum(s_l, s_r))
            lo = tl.where(right, mid, lo)
            hi = tl.where(right, hi, mid)
    elif LSE:  # its parts of each row's logsumexp, over no live chunk: max -inf, sum 0
        for g in range(G):
            for tile in range(N_TILES):
                rows = tile * TR + tl.arange(0, TR)
                at = (g * R + rows) * n_parts + part
                none = tl.zeros((TR, BLOCK_C), tl.float32)
                store_lse_part(none, scale, rows < R_VALID, length > 0, lse_m_base + at, lse_s_base + at)
    tl.store(out_ptr + b * C + cs, best, mask=cmask)


def bisect_triton(
    q: torch.Tensor,
    keys: torch.Tensor | ExtentKeys,
    candidates: torch.Tensor | None,
    first: int,
    lengths: torch.Tensor,
    chunk: int,
    *,
    mode: str,
    tables: tuple[torch.Tensor, torch.Tensor] | None,
    per_row: bool = False,
    addresses: torch.Tensor | None = None,
    softmax_scale: float | None = None,
) -> torch.Tensor:
    """Chunk scores of a pruning stage, as `prefill._bisect` computes them.

    q [B, Nq, G, r, D] pooled queries, already rotated at their scoring positions; keys [S, G, D]
    (last dim contiguous), or a streamed slice's keys where they lie in pinned host memory
    (`ExtentKeys`: the kernel reads each probe's key over PCIe, ~2 * levels of a chunk's keys,
    and reports those bytes to its `on_read`); candidates [B, C * chunk] sorted positions (-1
    padding), or None for block b's positions first .. first + valid - 1 (stage 0; `lengths`
    carries valid); lengths [B, C] valid entries per chunk. `tables`: the RoPE cos/sin rows
    [P, D] covering every probe position of `mode`, or None (no rotation). Returns [B, C]
    float32 (empty chunks too: the caller masks them); with `per_row`, `_bisect(per_row=True)`'s
    rows as a view [B, C, G, Nq * r] (rows in another order, which the "softmax" head score's
    max over rows ignores; an empty chunk's rows are undefined, as its score: every reader masks
    them). `addresses` [B, N] int64 (with `candidates`, keys a tensor): each candidate's key as
    an element offset from keys' first element, where keys are not at their positions (the rows
    of a block cache's bank, or of its overflow, another allocation).
    `softmax_scale` (with `per_row`): the "softmax" head score itself, [B, C] float32 with dead
    chunks -inf, as `softmax_head_score_triton` of the rows gives it up to float rounding: the
    kernel also writes each row's logsumexp in parts, so the head score reads the rows once
    (`triton_head_score.softmax_head_score_parts`). No host sync.
    """
    bsz, _, g, _, d = q.shape
    c_count = lengths.shape[1]
    block_c = BLOCK_C or bisect_block_c(per_row)
    launch = ScoreLaunch.make(q, c_count, block_c, per_row, softmax_scale)
    out = launch.out
    cand = candidates if candidates is not None else lengths  # a placeholder pointer
    addr = addresses if addresses is not None else cand  # a placeholder unless ADDR
    levels = max(1, math.ceil(math.log2(chunk)))
    src = key_source(keys, lengths)
    probes = bsz * c_count * 2 * levels * g  # at most two a level and chunk
    params, row0 = None, 0
    if isinstance(keys, ExtentKeys) and candidates is None and KEY_PARAMS_FIRST:  # stage 0
        params, row0 = stage0_params(keys, first, c_count * chunk, probes)
    cos, sin = tables if tables is not None else (src.ptr, src.ptr)
    interpret = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    _bisect_kernel[launch.grid](
        launch.qr,
        src.ptr,
        cand,
        addr,
        lengths,
        cos,
        sin,
        out,
        launch.row_best,
        launch.lse_m,
        launch.lse_s,
        1.0 if softmax_scale is None else softmax_scale,
        c_count,
        cand.shape[1],
        first,
        *src[1:9],  # offsets .. n_codes
        out if params is None else params,  # a placeholder pointer unless PARAMS
        row0,
        launch.rows,
        G=g,
        **launch.row_args,
        D=d,
        CHUNK=chunk,
        LEVELS=levels,
        MODE=MODES[mode],
        ROTATE=tables is not None,
        ARANGE=candidates is None,
        EXTENTS=isinstance(keys, ExtentKeys),
        ADDR=addresses is not None,
        BITS=src.bits,
        GROUP=src.group,
        PARAMS=params is not None,
        INTERPRET=interpret,
        PER_ROW=per_row,
        LSE=softmax_scale is not None,
        BLOCK_C=block_c,
        num_warps=NUM_WARPS or num_warps(launch.tile_rows, d),
        num_stages=1,  # NOTE: pipelining the head loop buffered q tiles past shared memory (272 KB)
    )
    if isinstance(keys, ExtentKeys) and keys.on_read is not None:
        if params is None:
            keys.on_read(probes * keys.probe_bytes)
        else:  # the probes' codes, and each row's parameters once
            keys.on_read(probes * keys.code_bytes + params.numel() * params.element_size())
    return launch.result(lengths, per_row, softmax_scale)
