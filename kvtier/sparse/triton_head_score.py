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

`bisect_triton(softmax_scale=...)` saves pass 1's read: the bisection kernel, when it writes a
row's final maxima for its BLOCK_C chunks, also writes their logsumexp in two parts (the max m
and the sum s of exp(x - m)) per program, [B, G, R_pad, P] with P programs along the chunks.
`softmax_head_score_parts` then combines each row's P parts (`_combine_lse`: one small pass, or
inside pass 2 itself where it is small, as in decode: one launch fewer) and runs pass 2.

Also the score's two small pieces the bisection kernel takes (`dots`, `row_max`). Imports triton
at module level; only `kvtier.sparse.prefill` and `kvtier.sparse.triton_bisect`
import this module, on CUDA (or CPU tensors under TRITON_INTERPRET=1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvtier.sparse.prune_memory import row_tiles

BLOCK_ROWS = 64  # rows a program (pass 1) or a tile (pass 2) holds
BLOCK_CHUNKS = 64  # chunks a tile (pass 1) or a program (pass 2) holds
BLOCK_PARTS = 16  # logsumexp parts a tile holds where they are combined
# Pass 2 combines the rows' logsumexp parts itself (no `_combine_lse` launch) while all its
# programs read at most this many parts together: decode's one query block (one query's rows,
# ~64 parts at 2,048 chunks: ~64K), not a prefill batch (256 blocks of 2,048 rows: ~10^10).
FOLD_PARTS_MAX = 1 << 20


@triton.jit
def dots(q, k, INTERPRET: tl.constexpr):  # type: ignore[no-untyped-def]
    """q [R, D] . k [BC, D]^T: [R, BC] float32."""
    if INTERPRET:  # the interpreter's tl.dot is wrong for 16-bit operands
        return tl.dot(q.to(tl.float32), tl.trans(k).to(tl.float32), input_precision="ieee")
    return tl.dot(q, tl.trans(k.to(q.dtype)), input_precision="ieee")


@triton.jit
def row_max(sc, rmask):  # type: ignore[no-untyped-def]
    """max over valid rows of sc [R, BC]: [BC]."""
    return tl.max(tl.where(rmask[:, None], sc, float("-inf")), axis=0)


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
def store_lse_part(x, scale, rmask, live, m_at, s_at):  # type: ignore[no-untyped-def]
    """One part of rows' logsumexp: over the live chunks of x [R, BC] (the rows' final maxima),
    of scale * x, the max m [R] (-inf: none live) and the sum of exp(scale * x - m), stored at
    m_at/s_at [R] where rmask."""
    y = tl.where(rmask[:, None] & live[None, :], x * scale, float("-inf"))
    m = tl.max(y, axis=1)
    safe = tl.where(m == float("-inf"), 0.0, m)
    tl.store(m_at, m, mask=rmask)
    tl.store(s_at, tl.sum(tl.exp(y - safe[:, None]), axis=1), mask=rmask)


@triton.jit
def _lse_of_parts(m_ptr, s_ptr, b, js, ROWS, RPG, P, part_b, part_g, BP: tl.constexpr):  # type: ignore[no-untyped-def]
    """Rows js's logsumexp [BR] from their P parts (max m, sum s of exp(x - m)) at
    m_ptr/s_ptr[b * part_b + g * part_g + r * P + p] (flat row j = g * RPG + r); -inf for a row
    whose parts are all empty (m -inf, s 0)."""
    jmask = js < ROWS
    row = b * part_b + (js // RPG).to(tl.int64) * part_g + (js % RPG).to(tl.int64) * P  # [BR]
    m = tl.full(js.shape, float("-inf"), tl.float32)
    s = tl.zeros(js.shape, tl.float32)
    for p0 in range(0, P, BP):
        ps = p0 + tl.arange(0, BP)
        ok = jmask[:, None] & (ps < P)[None, :]
        mp = tl.load(m_ptr + row[:, None] + ps[None, :], mask=ok, other=float("-inf"))
        sp = tl.load(s_ptr + row[:, None] + ps[None, :], mask=ok, other=0.0)
        m_new = tl.maximum(m, tl.max(mp, axis=1))
        safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing live so far
        s = s * tl.exp(m - safe) + tl.sum(sp * tl.exp(mp - safe[:, None]), axis=1)
        m = m_new
    return tl.where(s > 0, m + tl.log(tl.where(s > 0, s, 1.0)), float("-inf"))


@triton.jit
def _combine_lse(  # type: ignore[no-untyped-def]
    m_ptr,  # [B, G, R_pad, P] float32: each part's max
    s_ptr,  # [B, G, R_pad, P] float32: each part's sum of exp(x - max)
    lse_ptr,  # [B, ROWS] float32 out
    ROWS,
    RPG,
    P,
    part_b,
    part_g,
    BR: tl.constexpr,
    BP: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    js = tl.program_id(1) * BR + tl.arange(0, BR)
    lse = _lse_of_parts(m_ptr, s_ptr, b, js, ROWS, RPG, P, part_b, part_g, BP)
    tl.store(lse_ptr + b * ROWS + js, lse, mask=js < ROWS)


@triton.jit
def _chunk_score(  # type: ignore[no-untyped-def]
    x_ptr,
    live_ptr,
    lse_ptr,  # [B, ROWS] (unless PARTS)
    out_ptr,  # [B, C] float32 out
    m_ptr,  # the parts (PARTS only; placeholders otherwise)
    s_ptr,
    C,
    ROWS,
    RPG,
    stride_b,
    stride_c,
    stride_g,
    stride_r,
    scale,
    P,
    part_b,
    part_g,
    BR: tl.constexpr,
    BC: tl.constexpr,
    PARTS: tl.constexpr,  # each row's logsumexp combined here from its parts, not read
    BP: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    cs = tl.program_id(1) * BC + tl.arange(0, BC)
    cmask = cs < C
    live = tl.load(live_ptr + b * C + cs, mask=cmask, other=0) != 0
    best = tl.full((BC,), float("-inf"), tl.float32)
    if tl.max(live.to(tl.int32), axis=0) > 0:  # chunks all dead (as the bisection's skip): -inf
        for j0 in range(0, ROWS, BR):
            js = j0 + tl.arange(0, BR)
            y = _tile(x_ptr, live_ptr, b, cs, js, C, ROWS, RPG, stride_b, stride_c, stride_g, stride_r, scale)
            if PARTS:
                lse = _lse_of_parts(m_ptr, s_ptr, b, js, ROWS, RPG, P, part_b, part_g, BP)
                lse = tl.where(js < ROWS, lse, float("inf"))
            else:
                lse = tl.load(lse_ptr + b * ROWS + js, mask=js < ROWS, other=float("inf"))
            lse = tl.where(lse == float("-inf"), float("inf"), lse)  # no live chunk: -inf, not nan
            best = tl.maximum(best, tl.max(y - lse[:, None], axis=0))
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
        rows, live8, lse, out, lse, lse, c_count, n_rows, r, *strides, scale, 1, 0, 0,
        BR=BLOCK_ROWS, BC=BLOCK_CHUNKS, PARTS=False, BP=BLOCK_PARTS,
    )  # fmt: skip
    return out


def softmax_head_score_parts(
    rows: torch.Tensor, live: torch.Tensor, scale: float, m: torch.Tensor, s: torch.Tensor
) -> torch.Tensor:
    """`softmax_head_score_triton` of rows [B, C, G, R] (`bisect_triton`'s view of [B, G,
    R_pad, C]) whose rows' logsumexp the bisection kernel wrote in parts m, s [B, G, R_pad, P]
    (see the module doc): the same values up to float rounding, with one read of the maxima,
    not two. Where each pass-2 program combining every row's parts reads less than a pass of
    its own costs a launch (`FOLD_PARTS_MAX`: decode's single query block), it does; else
    `_combine_lse` writes the rows' logsumexp first. No host sync."""
    bsz, c_count, g, r = rows.shape
    n_rows, parts = g * r, m.shape[-1]
    assert m.shape == s.shape == (bsz, g, m.shape[2], parts) and m.is_contiguous() and s.is_contiguous()
    live8 = live.to(torch.int8) if live.dtype == torch.bool else live
    live8 = live8.contiguous()
    out = torch.empty(bsz, c_count, dtype=torch.float32, device=rows.device)
    strides = (rows.stride(0), rows.stride(1), rows.stride(2), rows.stride(3))
    programs = triton.cdiv(c_count, BLOCK_CHUNKS)
    fold = bsz * programs * n_rows * parts <= FOLD_PARTS_MAX
    lse = out  # a placeholder pointer when folded
    if not fold:
        lse = torch.empty(bsz, n_rows, dtype=torch.float32, device=rows.device)
        _combine_lse[(bsz, triton.cdiv(n_rows, BLOCK_ROWS))](
            m, s, lse, n_rows, r, parts, m.stride(0), m.stride(1), BR=BLOCK_ROWS, BP=BLOCK_PARTS
        )
    _chunk_score[(bsz, programs)](
        rows, live8, lse, out, m, s, c_count, n_rows, r, *strides, scale, parts, m.stride(0), m.stride(1),
        BR=BLOCK_ROWS, BC=BLOCK_CHUNKS, PARTS=fold, BP=BLOCK_PARTS,
    )  # fmt: skip
    return out


@dataclass(frozen=True)
class ScoreLaunch:
    """What a chunk-scoring kernel (`triton_bisect`, `triton_chunk_max`) is launched with:
    the queries as [B, G, R_pad, D] (a KV head's rows padded to whole tiles), its outputs
    (scores [B, C]; the per-row maxima [B, G, R_pad, C] with `per_row`; the logsumexp parts
    [B, G, R_pad, P] with a softmax scale; placeholders pointing at `out` otherwise), the grid
    (B, P programs of `block_c` chunks) and the rows' sizes."""

    qr: torch.Tensor
    out: torch.Tensor
    row_best: torch.Tensor
    lse_m: torch.Tensor
    lse_s: torch.Tensor
    grid: tuple[int, int]
    rows: int
    r_pad: int
    tile_rows: int

    @staticmethod
    def make(
        q: torch.Tensor,
        c_count: int,
        block_c: int,
        per_row: bool,
        softmax_scale: float | None,
        whole_rows: bool = False,
    ) -> ScoreLaunch:
        """For pooled queries q [B, Nq, G, r, D] scoring `c_count` chunks a block; `whole_rows`:
        a KV head's rows padded to one tile where they fit (`row_tiles(whole=True)`)."""
        bsz, nq, g, r, d = q.shape
        rows = nq * r
        r_pad, tile_rows = row_tiles(rows, d * q.element_size(), whole_rows)
        qr = q.permute(0, 2, 1, 3, 4).reshape(bsz, g, rows, d)  # [B, G, Nq r, D]
        if r_pad != rows:
            qr = torch.nn.functional.pad(qr, (0, 0, 0, r_pad - rows))
        out = torch.empty(bsz, c_count, dtype=torch.float32, device=q.device)
        row_best = out  # a placeholder pointer unless per_row; rows < `rows` written
        if per_row:
            row_best = torch.empty(bsz, g, r_pad, c_count, dtype=torch.float32, device=q.device)
        grid = (bsz, triton.cdiv(c_count, block_c))
        lse_m = lse_s = out  # placeholder pointers unless softmax_scale
        if softmax_scale is not None:
            assert per_row, "the softmax head score needs the per-row maxima"
            lse_m, lse_s = torch.empty(2, bsz, g, r_pad, grid[1], dtype=torch.float32, device=q.device)
        return ScoreLaunch(qr.contiguous(), out, row_best, lse_m, lse_s, grid, rows, r_pad, tile_rows)

    @property
    def row_args(self) -> dict[str, int]:
        """The kernels' constexprs of the rows: R (a KV head's, padded), TR (a tile's), N_TILES."""
        return {"R": self.r_pad, "TR": self.tile_rows, "N_TILES": self.r_pad // self.tile_rows}

    def result(self, lengths: torch.Tensor, per_row: bool, softmax_scale: float | None) -> torch.Tensor:
        """The launch's scores [B, C]; with `per_row` the rows as a view [B, C, G, rows] (C
        stays contiguous: no copy), or with `softmax_scale` the "softmax" head score of them."""
        if not per_row:
            return self.out
        view = self.row_best[:, :, : self.rows].permute(0, 3, 1, 2)
        if softmax_scale is not None:
            return softmax_head_score_parts(view, lengths, softmax_scale, self.lse_m, self.lse_s)
        return view
