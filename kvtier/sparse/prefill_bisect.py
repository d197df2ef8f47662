"""The torch bisection of HiP's prefill pruning (`kvtier.sparse.prefill.prune_blocks` without
Triton: the CPU, and the reference the Triton kernel `kvtier.sparse.triton_bisect` is tested
against): every chunk's representative key found by bisection, scored against each block's
queries, in tiles on the CPU.
"""

from __future__ import annotations

import math

import torch

from kvtier.sparse.rope_ext import RopeTable, probe_positions

# On the CPU `bisect_chunks` runs tiles of (blocks, chunks) whose per-row score tensors stay near this
# size, so a round's ~10 operators over them read cache, not memory: 1.8x faster per block on the
# 2-core development machine (16 against 29 ms at SmolLM2's stage 2 at 16K: 2,048 chunks of 8,
# 64 queries x 9 heads); tiles of 4 blocks were the best of 1-8. Each chunk's bisection is its
# own, so tiles give the same scores up to float rounding (the products run in other shapes).
CPU_TILE_BYTES = 2 << 20
CPU_TILE_BLOCKS = 4


def bisect_chunks(
    q: torch.Tensor,
    keys: torch.Tensor,
    chunks: torch.Tensor,
    lengths: torch.Tensor,
    *,
    mode: str,
    rotary: RopeTable | None,
    limit: int,
    per_row: bool = False,
    exact: bool = False,
) -> torch.Tensor:
    """`chunk_scores`'s bisection of chunks [B, C, c] (lengths [B, C]) for each block's rotated
    queries q [B, Nq, G, r, D] (`prefill.scoring_queries`); with `exact`, every key of a chunk
    scored instead of the bisection's probes (`triton_chunk_max`'s reference: relative mode
    rotates every key at the left probe's position 0, chunk-indexed at the chunk's index).

    Returns [B, C] float32: per chunk, the max over the bisection path of the probes' q.k,
    max-pooled over the block's queries and heads; with `per_row`, that max per (query, head)
    row, [B, C, Nq * G * r] (the "softmax" head score's input). The path goes where the
    max-pooled probe is larger, either way. On the CPU in tiles (`CPU_TILE_BYTES`).
    """
    bsz, c_count, _ = chunks.shape
    rows = q.shape[1] * q.shape[2] * q.shape[3]
    blocks = min(bsz, CPU_TILE_BLOCKS)
    width = max(1, CPU_TILE_BYTES // (blocks * rows * 4 * (chunks.shape[2] if exact else 1)))
    if (q.is_cuda and not exact) or (blocks == bsz and width >= c_count):  # exact: c x the bytes, tiled
        blocks, width = bsz, c_count
    tiles = [
        [
            _tile(
                q[b : b + blocks],
                keys,
                chunks[b : b + blocks, a : a + width],
                lengths[b : b + blocks, a : a + width],
                a,
                mode=mode,
                rotary=rotary,
                limit=limit,
                per_row=per_row,
                exact=exact,
            )
            for a in range(0, c_count, width)
        ]
        for b in range(0, bsz, blocks)
    ]
    if len(tiles) == 1 and len(tiles[0]) == 1:
        return tiles[0][0]
    return torch.cat([torch.cat(row, dim=1) for row in tiles])


def _tile(
    q: torch.Tensor,
    keys: torch.Tensor,
    chunks: torch.Tensor,
    lengths: torch.Tensor,
    offset: int,
    *,
    mode: str,
    rotary: RopeTable | None,
    limit: int,
    per_row: bool,
    exact: bool = False,
) -> torch.Tensor:
    """`bisect_chunks` of chunks [B, C', c] that are chunks `offset` .. `offset` + C' - 1 of each
    block (their index places chunk-indexed probes)."""
    bsz, c_count, c = chunks.shape
    g, d = keys.shape[1], keys.shape[2]
    qf = q.float()  # [B, Nq, G, r, D]
    index = (torch.arange(c_count, device=chunks.device) + offset).expand(bsz, c_count)  # [B, C']
    if exact:
        return _exact_tile(
            qf, keys, chunks, lengths, index, mode=mode, rotary=rotary, limit=limit, per_row=per_row
        )

    def probe(offset: torch.Tensor, side: int) -> torch.Tensor:
        pos = chunks.gather(2, offset[:, :, None]).squeeze(2)  # [B, C]; -1 in empty chunks
        k = keys[pos.clamp(min=0).flatten()]  # [B * C, G, D]
        if rotary is not None and mode == "relative":
            # NOTE: every left probe sits at position 0 (the identity: cos 1, sin 0, as the
            # Triton kernel skips it) and every right one at 1: one table row for all, broadcast
            # (`rotate_at`: bitwise the gathered rows' rotation, without the gather)
            k = k if side == 0 else rotary.rotate_at(k, 1)
        elif rotary is not None:
            k = rotary.rotate(
                k, probe_positions(mode, side, index.flatten(), pos.clamp(min=0).flatten()), limit
            )
        # NOTE: in the order the batched product writes ([B, G, Nq, r, C]), read as [B, C, R]
        # through a view: rows in (g, n, r) order, which no reduction over them minds
        s = torch.einsum("bngrd,bcgd->bgnrc", qf, k.view(bsz, c_count, g, d).float())
        return s.permute(0, 4, 1, 2, 3).flatten(2)  # [B, C, R]

    lo = torch.zeros_like(lengths)
    hi = lengths
    best: torch.Tensor | None = None
    for _ in range(max(1, math.ceil(math.log2(c)))):
        mid = lo + (hi - lo) // 2
        rows_left = probe(((lo + mid) // 2).clamp(max=c - 1), 0)
        rows_right = probe(((mid + hi) // 2).clamp(max=c - 1), 1)
        s_left, s_right = rows_left.amax(dim=2), rows_right.amax(dim=2)  # [B, C]
        go_right = s_right > s_left
        if not per_row:
            top = torch.maximum(s_left, s_right)
            best = top if best is None else torch.maximum(best, top)
        elif best is None:
            best = torch.maximum(rows_left, rows_right)
        else:  # NOTE: in place: no new tensor of the rows' size per round
            torch.maximum(best, rows_left, out=best)
            torch.maximum(best, rows_right, out=best)
        lo = torch.where(go_right, mid, lo)
        hi = torch.where(go_right, hi, mid)
    assert best is not None
    return best


def _exact_tile(
    qf: torch.Tensor,
    keys: torch.Tensor,
    chunks: torch.Tensor,
    lengths: torch.Tensor,
    index: torch.Tensor,
    *,
    mode: str,
    rotary: RopeTable | None,
    limit: int,
    per_row: bool,
) -> torch.Tensor:
    """`_tile` with every key of each chunk scored: chunks [B, C', c] at their indices index
    [B, C'], queries qf [B, Nq, G, r, D] float32. [B, C'] (or [B, C', R] rows in (g, n, r)
    order, as `_tile`'s); an empty chunk scores -inf."""
    bsz, c_count, c = chunks.shape
    g, d = keys.shape[1], keys.shape[2]
    pos = chunks.clamp(min=0).flatten()  # [B * C' * c]
    k = keys[pos]  # [B * C' * c, G, D]
    if rotary is not None and mode == "chunk_indexed":
        k = rotary.rotate(k, index[:, :, None].expand(-1, -1, c).flatten(), limit)
    elif rotary is not None and mode == "absolute":
        k = rotary.rotate(k, pos, limit)
    # relative: every key at the left probe's position 0, the identity
    s = torch.einsum("bngrd,bcjgd->bcgnrj", qf, k.view(bsz, c_count, c, g, d).float())
    live = torch.arange(c, device=chunks.device) < lengths[:, :, None]  # [B, C', c]
    s = s.masked_fill(~live[:, :, None, None, None, :], float("-inf")).amax(dim=-1)  # [B, C', G, Nq, r]
    rows = s.flatten(2)
    return rows if per_row else rows.amax(dim=2)
