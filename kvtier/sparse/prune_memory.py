"""GPU memory of HiP's pruning: the bound on one batch of prefill query blocks
(`PRUNE_BATCH_BYTES`, which HiP's plan counts), what one block takes in each stage, and what one
decode scoring product takes (`decode_scoring_bytes`)."""

from __future__ import annotations

PRUNE_BATCH_BYTES = 256 << 20  # temporaries of one batch of query blocks in one stage, about


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
    and top-k; the "softmax" head score adds per-row maxima [C, R] float32 and one temporary of
    their size. Each stage has its own chunk count and rows: a stride-1 last stage scores 4x the
    rows of a stride-4 first one (`lean`'s last stage takes ~34 MB a block at 160K where its
    first takes ~3 MB)."""
    sizes, n = [], max(1, middle)
    for c, k, stride in zip(chunk_sizes, budgets, strides, strict=True):
        c_count = -(-n // c)
        size = 3 * 8 * budgets[0] + 16 * c_count if triton else 3 * 4 * kv_heads * head_dim * c_count
        if head_score == "softmax":  # the rows and logsumexp's one temporary (softmax_head_score)
            size += 2 * 4 * c_count * -(-block_q // stride) * heads
        sizes.append(size)
        n = min(n, k)
    return sizes


def decode_scoring_bytes(slab: int, head_dim: int, dtype_bytes: int = 2) -> int:
    """GPU bytes of one decode scoring product over `slab` key vectors (candidates x KV heads,
    `kvtier.sparse.pruning.SCORING_SLAB`): the rotated keys (in the model's dtype) and their
    float32 copy, plus each candidate's position and chunk index (int64, at most one a vector)."""
    return slab * ((dtype_bytes + 4) * head_dim + 16)
