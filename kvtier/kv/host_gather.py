"""Runs of a host slice's tokens read by the GPU itself from pinned host memory, in one launch.

A HiP stage rerun at 512K misses ~450 short runs of a slice in its block cache. Copied one DMA a
run (`torch._foreach_copy_`) they cost ~8 ms of host time a slice (views and copy calls) and
~2.6 ms of copy-engine time, where the bytes alone take ~1.3 ms at 55 GB/s (H200,
`bench/results/hip_decode_profile_lean_512k_stage1.json`). Pinned host memory is mapped into
the GPU's address space (UVA), so a kernel can read it directly: one program copies a tile of up
to `TILE` consecutive tokens of one run, ~45 GB/s for 64-token blocks on the H200
(`bench/results/host_key_read_512k_h8.json`).

The extents of a slice are separate allocations. The kernel addresses them from the first one:
each extent's start as an element offset from it (`extent_offsets`), so no integer becomes a
pointer. Tiles are cut on the host from the runs with a few vectorized torch ops.

    tiles [T, 3] int64: (first source token, first output row, rows <= TILE); cut on the host
    from runs (`run_tiles`), or on the device from pages (`page_tiles`: Quest's selected pages,
    whose count the host never reads)
    token p of the slice -> extent (p // E) % ring, row p % E; a row is contiguous (2 * G * D
    elements of K and V, or a packed row of bytes)

`triton` is imported at module level: import this module only where a GPU reads (or under
Triton's interpreter, TRITON_INTERPRET=1, in tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

TILE = 16  # tokens a program
BLOCK_C = 1024  # elements of a row a program copies


@triton.jit
def _gather_rows(  # type: ignore[no-untyped-def]
    REF,  # the first extent: element offsets are taken from it
    OFFSETS,  # [extents] int64 element offset of each extent's start from REF
    TILES,  # [T, 3] int64 (source token, output row, rows)
    OUT,  # [n, COLS] contiguous
    extent_tokens,
    ring,  # extents in the ring: token p is in extent (p // extent_tokens) % ring
    ROW: tl.constexpr,  # elements a token (2 * G * D)
    COLS: tl.constexpr,  # elements copied of a row, from its start (ROW; G * D: the keys)
    TILE: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)  # [BC]
    src = tl.load(TILES + t * 3)
    dst = tl.load(TILES + t * 3 + 1)
    n = tl.load(TILES + t * 3 + 2)
    r = tl.arange(0, TILE)  # [TILE]
    ok = (r < n)[:, None] & (cols < COLS)[None, :]
    pos = src + r  # [TILE] slice tokens
    nth = pos // extent_tokens  # the extent counted from the first token, before the wrap
    start = tl.load(OFFSETS + nth % ring, mask=r < n, other=0)  # [TILE]
    row = start + (pos - nth * extent_tokens) * ROW  # [TILE] element offset of the token's row
    x = tl.load(REF + row[:, None] + cols[None, :], mask=ok)
    tl.store(OUT + (dst + r)[:, None] * COLS + cols[None, :], x, mask=ok)


def extent_offsets(extents: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Each extent's start as an element offset from the first extent's: [len(extents)] int64 on
    `device`. The extents must share a dtype (and sit at multiples of its size apart)."""
    ref, size = extents[0].data_ptr(), extents[0].element_size()
    deltas = [e.data_ptr() - ref for e in extents]
    if any(d % size for d in deltas):
        raise ValueError("extents are not a whole number of elements apart")
    return torch.tensor([d // size for d in deltas], dtype=torch.int64).to(device)


def run_tiles(spans: list[tuple[int, int, int]], tile: int = TILE) -> torch.Tensor:
    """The (start, end, at) runs cut into tiles of at most `tile` tokens: [T, 3] int64 (source
    token, output row, rows) on the CPU; empty runs give none."""
    s = torch.tensor(spans, dtype=torch.int64).view(-1, 3)  # [S, 3]
    start, end, at = s.unbind(1)
    count = ((end - start).clamp(min=0) + tile - 1) // tile  # tiles a run
    run = torch.repeat_interleave(torch.arange(s.shape[0]), count)  # [T] the run of each tile
    first = torch.cumsum(count, 0) - count  # each run's first tile
    j = (torch.arange(run.shape[0]) - first[run]) * tile  # the tile's first token in its run
    src = start[run] + j
    return torch.stack((src, at[run] + j, (end[run] - src).clamp(max=tile)), dim=1)


def page_tiles(pages: torch.Tensor, counts: torch.Tensor, page: int, tile: int = TILE) -> torch.Tensor:
    """Tiles of pages, built where `pages` is (no host sync): the first counts[k] tokens of page
    pages[k] ([K] int64 each, any order; counts <= page, 0 copies nothing) go to output rows
    k * page on. [K * ceil(page / tile), 3] int64 (source token, output row, rows)."""
    per = -(-page // tile)
    j = torch.arange(per, device=pages.device) * tile  # [per] each tile's first token in its page
    k = torch.arange(pages.shape[0], device=pages.device)
    src = (pages[:, None] * page + j).flatten()
    dst = (k[:, None] * page + j).flatten()
    rows = (counts[:, None] - j).clamp(min=0, max=tile)  # [K, per]
    return torch.stack((src, dst, rows.flatten()), dim=1)


def gather_tiles(
    extents: list[torch.Tensor],
    offsets: torch.Tensor,
    extent_tokens: int,
    tiles: torch.Tensor,
    out: torch.Tensor,
    ring: int | None = None,
) -> None:
    """The rows `tiles` ([T, 3] int64 on out's device: `run_tiles`, `page_tiles`) name, copied
    into out [n, *row] (contiguous, the extents' dtype); rows no tile names are untouched.
    Asynchronous on CUDA."""
    if tiles.shape[0] == 0:
        return
    row, cols = extents[0][0].numel(), out[0].numel()
    grid = (tiles.shape[0], triton.cdiv(cols, BLOCK_C))
    _gather_rows[grid](
        extents[0], offsets, tiles, out, extent_tokens, ring or len(extents),
        ROW=row, COLS=cols, TILE=TILE, BLOCK_C=min(BLOCK_C, triton.next_power_of_2(cols)),
        num_warps=4,
    )  # fmt: skip


def gather_runs(
    extents: list[torch.Tensor],
    offsets: torch.Tensor,
    extent_tokens: int,
    spans: list[tuple[int, int, int]],
    out: torch.Tensor,
    ring: int | None = None,
    keys: bool = False,
) -> None:
    """Tokens [start, end) of each (start, end, at) run into out[at : at + end - start].

    extents: the slice's host extents, each [E, *row] contiguous (pinned, when out is on the
    GPU); offsets: `extent_offsets(extents, out.device)`; out [n, *row] contiguous, of the
    extents' dtype, or with `keys` [n, *row[1:]]: each row's first half only (rows [2, G, D]:
    the keys, half the bytes over PCIe); ring: token p is in extent (p // E) % ring (None:
    every extent, no wrap). Asynchronous on CUDA (the tile list goes over from pinned memory).
    """
    row_shape = extents[0].shape[1:]
    want = row_shape[1:] if keys else row_shape
    if not out.is_contiguous() or out.dtype != extents[0].dtype or out.shape[1:] != want:
        raise ValueError(f"out {tuple(out.shape)} {out.dtype} must be contiguous rows [n, {tuple(want)}]")
    tiles = run_tiles(spans)
    if tiles.shape[0] == 0:
        return
    if out.is_cuda:
        tiles = tiles.pin_memory().to(out.device, non_blocking=True)
    gather_tiles(extents, offsets, extent_tokens, tiles, out, ring)
