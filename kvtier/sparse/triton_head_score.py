"""The "softmax" head score of a pruning stage in two Triton passes over the per-row maxima.

`prefill.softmax_head_score` takes it with torch: scale, mask, logsumexp over chunks, subtract,
max over rows, exp, each a pass over the [B, C, rows] float32 maxima that `bisect_triton`
writes. On SmolLM2 at 16K (`lean`, whose last stage scores every 8-token chunk of the context
for all 64 queries of a block) those passes took ~200 ms of a 0.68 s prefill on an H100,
more than the bisection itself (bench/results/hip_small_prefill_profile_b.json). Here:

    pass 1 (_row_lse):      lse[b, row] = logsumexp over live chunks c of scale * x[b, c, row]
    pass 2 (_chunk_score):  out[b, c]   = exp(max over rows of (scale * x[b, c, row] - lse[b, row]))
                                          for a live chunk, -inf for a dead one

Two reads of the maxima and nothing of their size written. The same values as
`softmax_head_score` up to float rounding (its logsumexp subtracts a global maximum; pass 1 keeps
a running one).

Imports triton at module level; only `kvtier.sparse.prefill` imports this module, on CUDA (or
CPU tensors under TRITON_INTERPRET=1).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_ROWS = 64  # rows a program (pass 1) or a tile (pass 2) holds
BLOCK_CHUNKS = 64  # chunks a tile (pass 1) or a program (pass 2) holds


@triton.jit
def _tile(  # type: ignore[no-untyped-def]
    x_ptr, live_ptr, b, cs, js, C, ROWS, RPG, stride_b, stride_c, stride_g, stride_r, scale
):
    """scale * x[b, cs, js] as [BR, BC] float32, -inf where the chunk is dead or out of range or
    the row is; js are flat row indices g * RPG + r."""
    cmask = cs < C
    live = tl.load(live_ptr + b * C + cs, mask=cmask, other=0) != 0
    jmask = js < ROWS
    g = (js // RPG).to(tl.int64)
    r = (js % RPG).to(tl.int64)
    ptr = x_ptr + b * stride_b + cs[None, :].to(tl.int64) * stride_c + (g * stride_g + r * stride_r)[:, None]
    ok = jmask[:, None] & (cmask & live)[None, :]
    x = tl.load(ptr, mask=ok, other=float("-inf"))
    return tl.where(ok, x * scale, float("-inf"))


@triton.jit
def _row_lse(  # type: ignore[no-untyped-def]
    x_ptr,  # the maxima, x[b, c, g, r] at the strides given
    live_ptr,  # [B, C] int8, 1 where the chunk is live
    lse_ptr,  # [B, ROWS] float32 out
    C,
    ROWS,
    RPG,
    stride_b,
    stride_c,
    stride_g,
    stride_r,
    scale,
    BR: tl.constexpr,
    BC: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    js = tl.program_id(1) * BR + tl.arange(0, BR)
    m = tl.full((BR,), float("-inf"), tl.float32)
    s = tl.zeros((BR,), tl.float32)
    for c0 in range(0, C, BC):
        cs = c0 + tl.arange(0, BC)
        y = _tile(x_ptr, live_ptr, b, cs, js, C, ROWS, RPG, stride_b, stride_c, stride_g, stride_r, scale)
        m_new = tl.maximum(m, tl.max(y, axis=1))
        safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing live so far
        s = s * tl.exp(m - safe) + tl.sum(tl.exp(y - safe[:, None]), axis=1)
        m = m_new
    lse = tl.where(s > 0, m + tl.log(tl.where(s > 0, s, 1.0)), float("-inf"))
    tl.store(lse_ptr + b * ROWS + js, lse, mask=js < ROWS)


@triton.jit
def _chunk_score(  # type: ignore[no-untyped-def]
    x_ptr,
    live_ptr,
    lse_ptr,
    out_ptr,  # [B, C] float32 out
    C,
    ROWS,
    RPG,
    stride_b,
    stride_c,
    stride_g,
    stride_r,
    scale,
    BR: tl.constexpr,
    BC: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    cs = tl.program_id(1) * BC + tl.arange(0, BC)
    best = tl.full((BC,), float("-inf"), tl.float32)
    for j0 in range(0, ROWS, BR):
        js = j0 + tl.arange(0, BR)
        y = _tile(x_ptr, live_ptr, b, cs, js, C, ROWS, RPG, stride_b, stride_c, stride_g, stride_r, scale)
        lse = tl.load(lse_ptr + b * ROWS + js, mask=js < ROWS, other=float("inf"))
        lse = tl.where(lse == float("-inf"), float("inf"), lse)  # no live chunk: -inf, not nan
        best = tl.maximum(best, tl.max(y - lse[:, None], axis=0))
    cmask = cs < C
    live = tl.load(live_ptr + b * C + cs, mask=cmask, other=0) != 0
    tl.store(out_ptr + b * C + cs, tl.where(live, tl.exp(best), float("-inf")), mask=cmask)


def softmax_head_score_triton(rows: torch.Tensor, live: torch.Tensor, scale: float) -> torch.Tensor:
    """`prefill.softmax_head_score` of `bisect_triton`'s per-row maxima rows [B, C, G, R] (any
    strides; its view of [B, G, R_pad, C]) with live [B, C]: bool, or integers nonzero where a
    chunk is live (the chunks' lengths, read as they are: no launch to compare them): [B, C]
    float32, -inf where a chunk is dead (`softmax_head_score` gives nan or a value there, which
    its caller masks). Reads `rows` twice and leaves it as it is. No host sync."""
    bsz, c_count, g, r = rows.shape
    n_rows = g * r
    live8 = live.to(torch.int8) if live.dtype == torch.bool else live
    live8 = live8.contiguous()
    lse = torch.empty(bsz, n_rows, dtype=torch.float32, device=rows.device)
    out = torch.empty(bsz, c_count, dtype=torch.float32, device=rows.device)
    strides = (rows.stride(0), rows.stride(1), rows.stride(2), rows.stride(3))
    _row_lse[(bsz, triton.cdiv(n_rows, BLOCK_ROWS))](
        rows, live8, lse, c_count, n_rows, r, *strides, scale, BR=BLOCK_ROWS, BC=BLOCK_CHUNKS
    )
    _chunk_score[(bsz, triton.cdiv(c_count, BLOCK_CHUNKS))](
        rows, live8, lse, out, c_count, n_rows, r, *strides, scale, BR=BLOCK_ROWS, BC=BLOCK_CHUNKS
    )
    return out
