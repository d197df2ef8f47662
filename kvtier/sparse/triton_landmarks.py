"""Triton kernel for the landmark key scores (`kvtier.sparse.landmarks.key_scores`) of a prefill
chunk: each key's mean attention from the next `window` queries of the chunk, over the query
heads of its KV head.

The torch version sums the window's queries by differences of float64 running sums, ~12
launches a slab of ~2.6K keys and ~1.5 GB of float64 traffic for a 16K chunk of 8 KV heads: 2.81
ms a layer at 512K on an H100 (bench/results/hip_kernels_512k_fast_landmarks.json), where the
products themselves are ~70 GFLOP of tensor-core work. Here one program takes BT keys of one KV
head and the (BT + window) queries that reach them, in tiles of BQ queries and one query head:

    s[t, i]   = k_t . q_i,h                                  [BT, BQ], float32 accumulation
    acc[t]   += sum over i in [t, t + window) of s[t, i]      (the band of the tile)
    score[t]  = acc[t] / (count_t * r)

Keys and queries come rotated (the caller rotates both at their positions). The sum of bf16
products in float32, in another order than the torch path's: equal up to float rounding.
Imports triton at module level; only `kvtier.sparse.landmarks` imports this module, on CUDA (or
CPU tensors under TRITON_INTERPRET=1).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kvtier.sparse.triton_head_score import dots

BT = 64  # keys a program
BQ = 64  # queries a tile


@triton.jit
def _key_scores_kernel(  # type: ignore[no-untyped-def]
    q_ptr,  # [T, H_q, D] (last dim contiguous)
    k_ptr,  # [T, G, D] (last dim contiguous)
    out_ptr,  # [T, G] float32
    T,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kg,
    G: tl.constexpr,
    R: tl.constexpr,  # query heads a KV head
    D: tl.constexpr,
    WINDOW: tl.constexpr,
    BT: tl.constexpr,
    BQ: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    tile = tl.program_id(0)
    g = tl.program_id(1).to(tl.int64)
    t = tile * BT + tl.arange(0, BT)
    tmask = t < T
    d = tl.arange(0, D)
    k_rows = k_ptr + t[:, None].to(tl.int64) * stride_kt + g * stride_kg
    k = tl.load(k_rows + d[None, :], mask=tmask[:, None], other=0.0)
    acc = tl.zeros((BT,), tl.float32)
    for j in range(0, BT + WINDOW - 1, BQ):  # query tiles from the first key's position on
        i = tile * BT + j + tl.arange(0, BQ)
        imask = i < T
        band = (i[None, :] >= t[:, None]) & (i[None, :] < t[:, None] + WINDOW) & imask[None, :]
        for h in range(R):
            q = tl.load(
                q_ptr + i[:, None].to(tl.int64) * stride_qt + (g * R + h) * stride_qh + d[None, :],
                mask=imask[:, None],
                other=0.0,
            )
            acc += tl.sum(tl.where(band, dots(k, q, INTERPRET), 0.0), axis=1)
    count = tl.minimum(t + WINDOW, T) - t
    tl.store(out_ptr + t.to(tl.int64) * G + g, acc / (tl.maximum(count, 1) * R).to(tl.float32), mask=tmask)


def key_scores_triton(q: torch.Tensor, k: torch.Tensor, window: int) -> torch.Tensor:
    """`key_scores` of rotated queries q [T, H_q, D] and keys k [T, G, D]: [T, G] float32, key
    t's mean of q_i . k_t over i in [t, t + window) and its KV head's query heads."""
    t, hq, d = q.shape
    g = k.shape[1]
    q, k = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k))  # a slice's keys: a view
    out = torch.empty(t, g, dtype=torch.float32, device=q.device)
    if t == 0:
        return out
    _key_scores_kernel[(triton.cdiv(t, BT), g)](
        q,
        k,
        out,
        t,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        G=g,
        R=hq // g,
        D=d,
        WINDOW=window,
        BT=BT,
        BQ=BQ,
        INTERPRET=os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"),
        num_warps=4,
        num_stages=2,
    )
    return out
