"""Triton kernel for a HiP pruning stage of fine chunks scored on every key: `bisect_triton`'s
outputs, each chunk's true maximum instead of its bisection path's.

A stage of 8-token chunks probes 6 of a chunk's 8 keys (three levels of two probes), each
level waiting on the last. Where its candidates are the whole causal context (SmolLM2 at 16K
under `lean`, whose first two stages keep everything), that is ~3/4 of a dense QK^T taken as
gathers of a few keys: 2.96 ms of a 5.70 ms pruning a layer on an H100
(bench/results/hip_kernels_smollm2_16k_lean_skip.json) where the prefill's dense attention
takes ~0.7. Here one program scores BLOCK_C chunks of one query block in tiles of TILE_N
candidates (TILE_N // CHUNK whole chunks), one tensor-core product per KV head and row tile:

    s[r, j]    = q[r] . rot(k[cand[j]])                        [TR, TILE_N]
    cell[r, c] = max over chunk c's keys j of s[r, j]            [TR, TILE_N // CHUNK]
    score[c]   = max over rows and KV heads of cell[r, c]        (the "max" head score)

and writes the rows' maxima and their logsumexp parts as `triton_bisect` does, so the
"softmax" head score and the top-k after it are the same code. A bisection's score is a lower
bound of the chunk's maximum (its path can miss the best key), so the selection can differ
from the bisection's: `HipConfig.exact_chunk` chooses the stages, measured against it.

Keys are rotated as the probes are: at the chunk's index (chunk-indexed), at their positions
(absolute), or, in relative mode, every key at the left probe's position 0 (no rotation).
Imports triton at module level; only `kvtier.sparse.prefill` imports this module, on CUDA (or
CPU tensors under TRITON_INTERPRET=1).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kvtier.sparse.config import EXACT_CHUNK_MAX
from kvtier.sparse.prune_memory import BISECT_BLOCK_C, num_warps
from kvtier.sparse.triton_bisect import MODES
from kvtier.sparse.triton_head_score import ScoreLaunch, dots, row_max
from kvtier.sparse.triton_keys import load_key, rope_rows

# Candidates a tile scores at once: whole chunks (of up to EXACT_CHUNK_MAX tokens)
TILE_N = EXACT_CHUNK_MAX
BLOCK_C = BISECT_BLOCK_C  # chunks per program at least (a module setting: bench/hip_kernels.py sweeps it)
# A KV head's rows as one padded tile (192 -> 256) rather than tiles of 64: the kernel loads each
# candidate's key once a row tile, so 3 tiles read the keys 3 times (a module setting, off until
# bench/hip_kernels.py has timed it on a GPU)
WHOLE_ROWS = False


@triton.jit
def _chunk_max_kernel(  # type: ignore[no-untyped-def]
    q_ptr,  # [B, G, R, D]
    k_ptr,  # [S, G, D] (last dim contiguous)
    cand_ptr,  # [B, N] int64 (unused when ARANGE)
    len_ptr,  # [B, C] int64
    cos_ptr,  # [P, D] (unused unless ROTATE)
    sin_ptr,
    out_ptr,  # [B, C] float32
    row_ptr,  # [B, G, R, C] float32 (PER_ROW only)
    lse_m_ptr,  # [B, G, R, P] float32 (LSE only), P = programs along C
    lse_s_ptr,
    scale,
    C,
    N,
    first,
    stride_ks,
    stride_kg,
    R_VALID,
    G: tl.constexpr,
    R: tl.constexpr,
    TR: tl.constexpr,
    N_TILES: tl.constexpr,
    D: tl.constexpr,
    CHUNK: tl.constexpr,
    TILE: tl.constexpr,  # candidates a tile: TILE // CHUNK whole chunks
    MODE: tl.constexpr,
    ROTATE: tl.constexpr,
    ARANGE: tl.constexpr,
    INTERPRET: tl.constexpr,
    PER_ROW: tl.constexpr,
    LSE: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    TC: tl.constexpr = TILE // CHUNK  # chunks a tile
    SUB: tl.constexpr = BLOCK_C // TC  # tiles a program
    b = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    n_parts = tl.num_programs(1)
    c0 = part * BLOCK_C
    d = tl.arange(0, D)
    j = tl.arange(0, TILE)  # a tile's candidates: chunk j // CHUNK of it, entry j % CHUNK
    sub = tl.arange(0, SUB)
    # best[t, i]: chunk c0 + t * TC + i, max over the KV heads and rows
    best = tl.full((SUB, TC), float("-inf"), tl.float32)
    lengths = tl.load(
        len_ptr + b * C + c0 + tl.arange(0, BLOCK_C), mask=c0 + tl.arange(0, BLOCK_C) < C, other=0
    )
    any_live = tl.max(lengths, axis=0) > 0
    for g in range(G):
        for tile in range(N_TILES):
            rows = tile * TR + tl.arange(0, TR)
            rmask = rows < R_VALID
            m_run = tl.full((TR,), float("-inf"), tl.float32)
            s_run = tl.zeros((TR,), tl.float32)
            if any_live:  # else none (~half of SmolLM2's 16K causal grid under `lean`)
                q = tl.load(
                    q_ptr + ((b * G + g) * R + rows[:, None]) * D + d[None, :], mask=rmask[:, None], other=0.0
                )
                for t in range(SUB):
                    cj = c0 + t * TC + j // CHUNK  # [TILE] each candidate's chunk
                    cs = c0 + t * TC + tl.arange(0, TC)  # [TC]
                    len_j = tl.load(len_ptr + b * C + cj, mask=cj < C, other=0)
                    ok = (cj < C) & (j % CHUNK < len_j)
                    if ARANGE:
                        pos = first + cj * CHUNK + j % CHUNK
                    else:
                        pos = tl.load(cand_ptr + b * N + cj * CHUNK + j % CHUNK, mask=ok, other=0)
                    ok = ok & (pos >= 0)
                    pos = tl.where(ok, pos, 0).to(tl.int64)
                    if MODE == 2:  # noqa: SIM108 (a constexpr branch) chunk-indexed: at the chunk's index
                        rp = cj.to(tl.int64)
                    else:
                        rp = pos
                    c_rot, s_rot = tl.zeros((TILE, D), tl.float32), tl.zeros((TILE, D), tl.float32)
                    if ROTATE and MODE != 1:  # relative: at position 0, the identity
                        c_rot, s_rot = rope_rows(cos_ptr, sin_ptr, rp, d, D)
                    k = load_key(
                        k_ptr + pos[:, None] * stride_ks + g * stride_kg,
                        d,
                        c_rot,
                        s_rot,
                        D,
                        ROTATE and MODE != 1,
                    )
                    sc = tl.where(ok[None, :], dots(q, k, INTERPRET), float("-inf"))  # [TR, TILE]
                    cell = tl.max(tl.reshape(sc, (TR, TC, CHUNK)), axis=2)  # [TR, TC]
                    best = tl.where(sub[:, None] == t, tl.maximum(best, row_max(cell, rmask)[None, :]), best)
                    if PER_ROW:
                        cells = row_ptr + ((b * G + g) * R + rows[:, None]) * C + cs[None, :]
                        tl.store(cells, cell, mask=rmask[:, None] & (cs < C)[None, :])
                    if LSE:  # this program's part of each row's logsumexp over its live chunks
                        len_c = tl.load(len_ptr + b * C + cs, mask=cs < C, other=0)
                        y = tl.where(rmask[:, None] & (len_c > 0)[None, :], cell * scale, float("-inf"))
                        m_new = tl.maximum(m_run, tl.max(y, axis=1))
                        safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                        s_run = s_run * tl.exp(m_run - safe) + tl.sum(tl.exp(y - safe[:, None]), axis=1)
                        m_run = m_new
            if LSE:  # its parts: max -inf and sum 0 where no chunk of the program is live
                at = ((b * G + g) * R + rows) * n_parts + part
                tl.store(lse_m_ptr + at, m_run, mask=rmask)
                tl.store(lse_s_ptr + at, s_run, mask=rmask)
    cs2 = c0 + sub[:, None] * TC + tl.arange(0, TC)[None, :]  # [SUB, TC]
    tl.store(out_ptr + b * C + cs2, best, mask=cs2 < C)


def chunk_max_triton(
    q: torch.Tensor,
    keys: torch.Tensor,
    candidates: torch.Tensor | None,
    first: int,
    lengths: torch.Tensor,
    chunk: int,
    *,
    mode: str,
    tables: tuple[torch.Tensor, torch.Tensor] | None,
    per_row: bool = False,
    softmax_scale: float | None = None,
) -> torch.Tensor:
    """Chunk scores of a pruning stage from every key of each chunk, for chunks of a power of
    two up to `EXACT_CHUNK_MAX` tokens: `bisect_triton`'s arguments and outputs (q [B, Nq, G,
    r, D] rotated at the scoring positions, keys [S, G, D], candidates [B, C * chunk] or None
    for stage 0's range from `first`, lengths [B, C]; [B, C] float32, or with `per_row` the
    rows' maxima as a view [B, C, G, Nq * r], or with `softmax_scale` the "softmax" head
    score), each chunk scored by its maximum over all its keys. No host sync."""
    assert chunk <= TILE_N and chunk & (chunk - 1) == 0, f"chunk_max_triton: chunks of {chunk} tokens"
    g, d = q.shape[2], q.shape[4]
    c_count = lengths.shape[1]
    block_c = max(BLOCK_C, TILE_N // chunk)
    launch = ScoreLaunch.make(q, c_count, block_c, per_row, softmax_scale, WHOLE_ROWS)
    cand = candidates if candidates is not None else lengths  # a placeholder pointer
    cos, sin = tables if tables is not None else (keys, keys)
    _chunk_max_kernel[launch.grid](
        launch.qr,
        keys,
        cand,
        lengths,
        cos,
        sin,
        launch.out,
        launch.row_best,
        launch.lse_m,
        launch.lse_s,
        1.0 if softmax_scale is None else softmax_scale,
        c_count,
        cand.shape[1],
        first,
        keys.stride(0),
        keys.stride(1),
        launch.rows,
        G=g,
        **launch.row_args,
        D=d,
        CHUNK=chunk,
        TILE=TILE_N,
        MODE=MODES[mode],
        ROTATE=tables is not None,
        ARANGE=candidates is None,
        INTERPRET=os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"),
        PER_ROW=per_row,
        LSE=softmax_scale is not None,
        BLOCK_C=block_c,
        num_warps=num_warps(launch.tile_rows, d),
        num_stages=1,
    )
    return launch.result(lengths, per_row, softmax_scale)
