"""GPU memory of HiP's pruning: the bound on one batch of prefill query blocks
(`PRUNE_BATCH_BYTES`, which HiP's plan counts), what one block takes in each stage, what a whole
prefill chunk's blocks take at once (`whole_chunk_prune_bytes`), and what one decode scoring
product takes (`decode_scoring_bytes`); and the pruning kernel's program shapes that memory
depends on (`row_tiles`, `BISECT_BLOCK_C`) or that go with them (`num_warps`), kept here so the
planner reads them without importing Triton."""

from __future__ import annotations

PRUNE_BATCH_BYTES = 256 << 20  # temporaries of one batch of query blocks in one stage, about
BISECT_BLOCK_C = 32  # chunks a program of the pruning kernel scores per row (the "softmax" head score)
# chunks a program scores for the "max" head score, which keeps no per-row maxima: 64 took fast's
# 512K pruning from 25.3 to 21.9 ms a slice, lean's 48K (max score) 21.8 to 20.9, where with the
# softmax score's rows it ran 55.6 against 45.5 (H100, hip_kernels_512k_fast_stages.json,
# hip_kernels_lean_48k_{max,softmax}_b.json)
BISECT_BLOCK_C_MAX = 64
TILE_ROWS_MIN = 64  # row tiles of the pruning kernel at least this tall replace padding (`row_tiles`)
# The most a row tile's queries take: they sit in shared memory. One tile of 1,024 bfloat16 rows
# of 128-wide heads (stage 0 once per 1,024 queries of Llama-3's 4 heads a KV head, pooled 4)
# asked 272 KiB of an H100's 227 and failed (hip_cli_speed_512k_fast_stage0_more.json); 64 KiB
# is 256 such rows and leaves the keys room on a 4090's 99 KiB
TILE_QUERY_BYTES = 64 << 10


def bisect_block_c(per_row: bool) -> int:
    """Chunks a program of the pruning kernel scores: BISECT_BLOCK_C where it keeps per-row
    maxima (the "softmax" head score), else BISECT_BLOCK_C_MAX."""
    return BISECT_BLOCK_C if per_row else BISECT_BLOCK_C_MAX


def row_tiles(rows: int, row_bytes: int = 256, whole: bool = False) -> tuple[int, int]:
    """(rows a KV head holds, rows a tile) in the pruning kernel (`triton_bisect`) for `rows`
    (query, head) rows of a KV head: whole tiles of 64 or more where they divide `rows` (192 =
    3 x 64), else the next power of two (at least 16, the smallest product tl.dot takes; smaller
    tiles would run slower products than the padding costs); a tile's queries, `row_bytes` a
    row (head_dim x element size), within TILE_QUERY_BYTES (1,024 bfloat16 rows of 128-wide
    heads: 4 tiles of 256). `whole`: padded to the next power of two, as one tile where it fits
    (192 -> one of 256: a kernel that loads its keys once a tile reads them once)."""
    most = max(16, 1 << ((TILE_QUERY_BYTES // row_bytes).bit_length() - 1))  # a power of two
    tile = rows & -rows  # the largest power of two dividing rows
    if tile >= TILE_ROWS_MIN and tile != rows and not whole:
        return rows, min(tile, most)
    pad = max(16, 1 << (rows - 1).bit_length())
    return pad, min(pad, most)


def num_warps(tile_rows: int, head_dim: int) -> int:
    """Warps of a pruning program: 8 with row tiles of 128 or more; 2 for tiles of 64 rows of
    64-wide heads (SmolLM2's 16K stage on an H100: 2.98 ms against 4 warps' 3.53 under `lean`,
    2.36 against 2.80 under `long`, hip_kernels_smollm2_16k{_lean,}.json); else 4 (decode's
    smaller tiles, unmeasured; Llama-3's 128-wide heads at 512K ran 14.4 ms with 2 warps against
    11.7 with 4, hip_kernels.json)."""
    if tile_rows >= 128:
        return 8
    return 2 if head_dim <= 64 and tile_rows == 64 else 4


def stage_prune_bytes(
    middle: int,
    block_q: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    *,
    chunk_sizes: tuple[int, ...],
    budgets: tuple[int, ...],
    strides: tuple[int, ...],
    triton: bool,
    head_score: str,
) -> list[int]:
    """GPU bytes one query block's pruning needs at once in each stage, over `middle` candidate
    tokens (past the sinks) of a slice: with torch the probe keys of every chunk in float32 and
    their scores; with Triton the kept positions (offsets, sum and where, int64) and the scores
    and top-k; the "softmax" head score adds per-row maxima [C, R] float32 (padded as the kernel
    holds them, `row_tiles`) and the queries' copies, or with torch one temporary of their size.
    Each stage has its own chunk count and rows: a stride-1 last stage scores 4x the rows of a
    stride-4 first one (with Triton `lean`'s last stage takes ~21 MB a block at 160K on
    Llama-3-8B's shapes, its first ~3 MB)."""
    sizes, n = [], max(1, middle)
    for c, k, stride in zip(chunk_sizes, budgets, strides, strict=True):
        c_count = -(-n // c)
        size = 3 * 8 * budgets[0] + 16 * c_count if triton else 3 * 4 * kv_heads * head_dim * c_count
        rows = -(-block_q // stride) * heads  # (pooled query, head) rows of a block
        if head_score == "softmax" and triton:  # the kernel's rows, read in place by the Triton
            # head score, and the pooled, rotated and padded copies of the queries (float32 at most)
            # and each row's logsumexp in two float32 parts a program of BISECT_BLOCK_C chunks
            held, _ = row_tiles(rows // kv_heads)
            parts = -(-c_count // BISECT_BLOCK_C)
            size += 4 * (c_count + 2 * parts) * held * kv_heads + 3 * 4 * held * kv_heads * head_dim
        elif head_score == "softmax":  # the rows and logsumexp's one temporary (softmax_head_score)
            size += 2 * 4 * c_count * rows
        sizes.append(size)
        n = min(n, k)
    return sizes


def decode_scoring_bytes(slab: int, head_dim: int, dtype_bytes: int = 2) -> int:
    """GPU bytes of one decode scoring product over `slab` key vectors (candidates x KV heads,
    `kvtier.sparse.pruning.SCORING_SLAB`): the rotated keys (in the model's dtype) and their
    float32 copy, plus each candidate's position and chunk index (int64, at most one a vector)."""
    return slab * ((dtype_bytes + 4) * head_dim + 16)


def whole_chunk_prune_bytes(
    middle: int,
    blocks: int,
    block_q: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    dtype_bytes: int,
    *,
    chunk_sizes: tuple[int, ...],
    budgets: tuple[int, ...],
    strides: tuple[int, ...],
    head_score: str,
    triton: bool = True,
) -> int:
    """GPU bytes `prefill.run_block_stages` needs to prune `blocks` query blocks of a slice of
    `kv_heads` KV heads (`heads` query heads) in one batch in every stage, over at most `middle`
    candidates: the largest stage's bytes a block (`stage_prune_bytes`; `triton`: with the
    Triton kernel, as on CUDA) times the blocks,
    plus what the stage carries for all of them (candidates in and out, int64, and the pooled
    queries where the stride pools them)."""
    per_block = stage_prune_bytes(
        middle, block_q, heads, kv_heads, head_dim,
        chunk_sizes=chunk_sizes, budgets=budgets, strides=strides, triton=triton, head_score=head_score,
    )  # fmt: skip
    worst, n = 0, max(1, middle)
    for size, c, k, stride in zip(per_block, chunk_sizes, budgets, strides, strict=True):
        n_out = n if -(-n // c) <= k // c else k // c * c
        carried = 8 * blocks * (n + n_out)
        carried += blocks * -(-block_q // stride) * heads * head_dim * dtype_bytes if stride > 1 else 0
        worst = max(worst, size * blocks + carried)
        n = n_out
    return worst
