"""Paged decode attention in Triton: one query token per sequence over its keys in a page pool.

One layer's cache is a page tensor `pages [num_pages, P, 2, H_kv, D]` (`pages[p, i, 0]` = key,
`pages[p, i, 1]` = value). Sequence b's token t lives in page `block_tables[b, t // P]`, slot
`t % P`; its query attends keys 0 .. seq_lens[b] - 1 (no causal mask: the query is the last
token). GQA: the r = H_q / H_kv query heads of one KV head are adjacent (HF `repeat_kv`).

Split-KV (flash-decoding) on a static grid (B, H_kv, num_splits), so a launch is CUDA-graph
capturable (no host syncs, no shapes that depend on tensor values):

    seq_len = seq_lens[b]                       (read inside the kernel)
    split   = ceil(ceil(seq_len / num_splits) / BLOCK_N) * BLOCK_N keys
    program (b, g, s) -> keys [s * split, min((s + 1) * split, seq_len))

      keys:  |--- split 0 ---|--- split 1 ---|-- split 2 --|  split 3 (empty)
      tiles: |BLOCK_N|BLOCK_N|BLOCK_N|BLOCK_N|BLOCK_N|      |  each token's page id from block_tables

A program loads the r query heads of KV head g as rows of a [BLOCK_H, D] tile (r padded to 16
for `tl.dot`), walks its keys in BLOCK_N tiles with an online softmax in fp32, and writes its
partial output and log-sum-exp; an empty split writes out 0 and lse -inf. A second launch
merges the splits by their log-sum-exp (max-subtracted weights), one program a (sequence,
query head).

`triton` is imported at module level. For CPU tensors set TRITON_INTERPRET=1 before triton is
first imported (Triton's interpreter); there, as in `kvtier.sparse.triton_attn_kernels`, the key
loop is a `while` (the interpreter cannot take a runtime `range` bound) and the dots take fp32
operands (its bf16 `tl.dot` is wrong).
"""

from __future__ import annotations

import functools
import math
import os

import torch
import triton
import triton.language as tl

BLOCK_N = 64  # keys per tile
NUM_WARPS = 4


@triton.jit
def _paged_decode_split(  # type: ignore[no-untyped-def]
    Q,  # [B, H_q, D]
    PAGES,  # [num_pages, P, 2, H_kv, D]
    TABLES,  # [B, max_blocks] int32 page ids
    LENS,  # [B] int32 keys per sequence
    OUT,  # [B, H_q, num_splits, D] fp32 partial outputs, last stride 1
    LSE,  # [B, H_q, num_splits] fp32 natural log-sum-exp, last stride 1
    stride_qb,
    stride_qh,
    stride_qd,
    stride_pn,
    stride_ps,
    stride_pkv,
    stride_ph,
    stride_pd,
    stride_tb,
    stride_tn,
    stride_ob,
    stride_oh,
    stride_os,
    stride_lb,
    stride_lh,
    sm_scale_log2,
    PAGE: tl.constexpr,  # tokens per page
    R: tl.constexpr,  # query heads per KV head
    BLOCK_H: tl.constexpr,  # R padded to a power of two >= 16
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,  # D padded to a power of two >= 16
    BLOCK_N: tl.constexpr,
    IEEE: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    b = tl.program_id(0)
    g = tl.program_id(1)
    s = tl.program_id(2)
    seq_len = tl.load(LENS + b)
    split = tl.cdiv(tl.cdiv(seq_len, tl.num_programs(2)), BLOCK_N) * BLOCK_N
    k_lo = s * split
    k_hi = tl.minimum(seq_len, k_lo + split)

    offs_h = tl.arange(0, BLOCK_H)  # [BH] query head within the group
    offs_d = tl.arange(0, BLOCK_D)
    h_ok = offs_h < R
    d_ok = offs_d < D
    head = g * R + offs_h  # [BH] query head
    q = tl.load(
        Q + b * stride_qb + head[:, None] * stride_qh + offs_d[None, :] * stride_qd,
        mask=h_ok[:, None] & d_ok[None, :],
        other=0.0,
    )  # [BH, BD]

    m_i = tl.full([BLOCK_H], -1.0e30, tl.float32)  # running max, log2 domain
    l_i = tl.zeros([BLOCK_H], tl.float32)  # running sum
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    kv_base = PAGES + g * stride_ph
    table = TABLES + b * stride_tb
    if INTERPRET:  # the interpreter (numpy >= 2.4) cannot take a runtime `range` bound
        start = k_lo
        while start < k_hi:
            m_i, l_i, acc = _attend_tile(
                q, m_i, l_i, acc, kv_base, table, start, k_hi, stride_tn, stride_pn, stride_ps,
                stride_pkv, stride_pd, sm_scale_log2, PAGE, D, BLOCK_D, BLOCK_N, IEEE, INTERPRET,
            )  # fmt: skip
            start += BLOCK_N
    else:
        for start in range(k_lo, k_hi, BLOCK_N):
            m_i, l_i, acc = _attend_tile(
                q, m_i, l_i, acc, kv_base, table, start, k_hi, stride_tn, stride_pn, stride_ps,
                stride_pkv, stride_pd, sm_scale_log2, PAGE, D, BLOCK_D, BLOCK_N, IEEE, INTERPRET,
            )  # fmt: skip

    l_safe = tl.where(l_i > 0, l_i, 1.0)
    out = acc / l_safe[:, None]  # an empty split (acc = 0) writes 0
    lse = tl.where(l_i > 0, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))  # * ln 2
    o_rows = OUT + b * stride_ob + head * stride_oh + s * stride_os  # [BH]
    tl.store(o_rows[:, None] + offs_d[None, :], out, mask=h_ok[:, None] & d_ok[None, :])
    tl.store(LSE + b * stride_lb + head * stride_lh + s, lse, mask=h_ok)


@triton.jit
def _attend_tile(  # type: ignore[no-untyped-def]
    q,  # [BH, BD] the program's query heads
    m_i,  # [BH] running max (log2 domain)
    l_i,  # [BH] running sum
    acc,  # [BH, BD] fp32 running output
    kv_base,  # pages at this program's KV head
    table,  # this sequence's row of block_tables
    start,  # first token of the tile
    k_hi,  # end of the program's keys
    stride_tn,
    stride_pn,
    stride_ps,
    stride_pkv,
    stride_pd,
    sm_scale_log2,
    PAGE: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IEEE: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """One BLOCK_N tile of keys: gather K/V rows through the block table, update the online
    softmax."""
    t = start + tl.arange(0, BLOCK_N)  # [BN] token positions
    t_ok = t < k_hi
    page = tl.load(table + (t // PAGE) * stride_tn, mask=t_ok, other=0).to(tl.int64)
    row = page * stride_pn + (t % PAGE).to(tl.int64) * stride_ps  # [BN] offset of the token's K
    offs_d = tl.arange(0, BLOCK_D)
    kv_ptrs = kv_base + row[:, None] + offs_d[None, :] * stride_pd  # [BN, BD]
    kv_ok = t_ok[:, None] & (offs_d < D)[None, :]
    k = tl.load(kv_ptrs, mask=kv_ok, other=0.0)
    if INTERPRET:  # the interpreter's tl.dot is wrong for bf16: take the products in fp32
        sc = tl.dot(q.to(tl.float32), tl.trans(k).to(tl.float32), input_precision="ieee")
    elif IEEE:
        sc = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        sc = tl.dot(q, tl.trans(k))
    sc = tl.where(t_ok[None, :], sc * sm_scale_log2, float("-inf"))  # [BH, BN], log2 domain
    m_new = tl.maximum(m_i, tl.max(sc, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(sc - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(kv_ptrs + stride_pkv, mask=kv_ok, other=0.0)
    if INTERPRET:
        pv = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), input_precision="ieee")
    elif IEEE:
        pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc * alpha[:, None] + pv


@triton.jit
def _combine_splits(  # type: ignore[no-untyped-def]
    PART,  # [B, H_q, S, D] fp32 partial outputs
    LSE,  # [B, H_q, S] fp32 natural log-sum-exp (-inf: an empty split)
    OUT,  # [B, H_q, D] in the query's dtype
    stride_pb,
    stride_ph,
    stride_ps,
    stride_pd,
    stride_lb,
    stride_lh,
    stride_ls,
    stride_ob,
    stride_oh,
    stride_od,
    S,  # splits
    D: tl.constexpr,
    BLOCK_S: tl.constexpr,  # S padded to a power of two
    BLOCK_D: tl.constexpr,
):
    """One (sequence, query head): the splits' partials weighted by exp(lse - max lse)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_ok = offs_s < S
    d_ok = offs_d < D
    lse = tl.load(LSE + b * stride_lb + h * stride_lh + offs_s * stride_ls, mask=s_ok, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # every split empty: weights 0, output 0
    w = tl.exp(lse - m)  # [BS]
    den = tl.maximum(tl.sum(w, 0), 1e-30)
    rows = PART + b * stride_pb + h * stride_ph + offs_s[:, None] * stride_ps + offs_d[None, :] * stride_pd
    part = tl.load(rows, mask=s_ok[:, None] & d_ok[None, :], other=0.0)  # [BS, BD]
    out = tl.sum(part * w[:, None], 0) / den
    o_row = OUT + b * stride_ob + h * stride_oh
    tl.store(o_row + offs_d * stride_od, out.to(OUT.dtype.element_ty), mask=d_ok)


def paged_decode_splits(
    q: torch.Tensor, pages: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor, num_splits: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel alone: per-split partial outputs and log-sum-exps (see `paged_decode`).

    Returns (out [B, H_q, num_splits, D] fp32, lse [B, H_q, num_splits] fp32, natural log). A
    split with no keys has out 0 and lse -inf.
    """
    bsz, h_q, d = q.shape
    _, page_size, two, h_kv, d_kv = pages.shape
    if two != 2 or d_kv != d:
        raise ValueError(f"pages {tuple(pages.shape)} must be [num_pages, P, 2, H_kv, {d}] (q's head dim)")
    if h_q % h_kv:
        raise ValueError(f"{h_q} query heads are not a multiple of {h_kv} KV heads")
    if q.dtype != pages.dtype:
        raise ValueError(f"q is {q.dtype} but pages are {pages.dtype}: use one dtype")
    if block_tables.dim() != 2 or block_tables.shape[0] != bsz or seq_lens.shape != (bsz,):
        raise ValueError(
            f"block_tables {tuple(block_tables.shape)} and seq_lens {tuple(seq_lens.shape)} "
            f"must be [{bsz}, max_blocks] and [{bsz}]"
        )
    if num_splits < 1:
        raise ValueError(f"num_splits={num_splits} must be >= 1")
    r = h_q // h_kv
    part = torch.empty((bsz, h_q, num_splits, d), dtype=torch.float32, device=q.device)
    lse = torch.empty((bsz, h_q, num_splits), dtype=torch.float32, device=q.device)
    _paged_decode_split[(bsz, h_kv, num_splits)](
        q, pages, block_tables, seq_lens, part, lse,
        q.stride(0), q.stride(1), q.stride(2),
        *pages.stride(),
        block_tables.stride(0), block_tables.stride(1),
        part.stride(0), part.stride(1), part.stride(2),
        lse.stride(0), lse.stride(1),
        math.log2(math.e) / math.sqrt(d),
        PAGE=page_size,
        R=r,
        BLOCK_H=max(16, triton.next_power_of_2(r)),
        D=d,
        BLOCK_D=max(16, triton.next_power_of_2(d)),
        BLOCK_N=BLOCK_N,
        IEEE=q.dtype == torch.float32,
        INTERPRET=os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"),
        num_warps=NUM_WARPS,
    )  # fmt: skip
    return part, lse


MAX_SPLITS = 64


def default_splits(batch: int, kv_heads: int, sms: int | None) -> int:
    """Splits per (sequence, KV head) that give the GPU's `sms` multiprocessors at most about two
    programs each, at least one and at most `MAX_SPLITS` (None: not a GPU, the most).

    Rounded down: on the H200 (bench/results/paged_decode_splits.json, graph replays) 32
    sequences of 1K keys took 45 us with one split (256 programs) and 60 with two; one sequence
    of 32K keys 845 us with one split, 86 with 16 and 65 with 32 (1K keys: 24-26 us with any of
    them), so one sequence gets 33 splits of its 8 KV heads and 32 or more sequences get one."""
    if sms is None:
        return MAX_SPLITS
    return max(1, min(MAX_SPLITS, 2 * sms // max(1, batch * kv_heads)))


@functools.cache
def _sm_count(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


def combine_splits(part: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """Merge split partials: part [B, H, S, D] fp32, lse [B, H, S] -> [B, H, D] fp32.

    Weights exp(lse - max lse), so no split overflows; empty splits (lse -inf) weigh 0. A row
    whose splits are all empty (a sequence with no keys) is 0. Torch ops (~10 launches); the
    reference of `combine_splits_fused`, which `paged_decode` runs.
    """
    m = torch.nan_to_num(lse.amax(dim=-1, keepdim=True), neginf=0.0)  # [B, H, 1]
    w = torch.exp(lse - m)  # [B, H, S]
    return (part * w[..., None]).sum(dim=2) / w.sum(dim=-1, keepdim=True).clamp_min(1e-30)


def combine_splits_fused(part: torch.Tensor, lse: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`combine_splits` in one Triton launch, written in `dtype`: [B, H, D].

    On the H200 the torch merge was ~10 small kernels a layer, ~0.5 ms of a 5.7 ms decode step
    of one 1K-token Llama-3-8B sequence (`bench/results/serve_profile_b1.json`)."""
    bsz, h, splits, d = part.shape
    out = torch.empty((bsz, h, d), dtype=dtype, device=part.device)
    _combine_splits[(bsz, h)](
        part, lse, out,
        *part.stride(), *lse.stride(), *out.stride(),
        splits,
        D=d,
        BLOCK_S=triton.next_power_of_2(splits),
        BLOCK_D=triton.next_power_of_2(d),
        num_warps=1 if d <= 64 else 2,
    )  # fmt: skip
    return out


def paged_decode(
    q: torch.Tensor,
    pages: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Decode attention of one query per sequence over its paged keys; CUDA-graph capturable.

    q [B, H_q, D] (rotated; fp16, bf16 or fp32), pages [num_pages, P, 2, H_kv, D] in q's dtype
    (any strides), block_tables [B, max_blocks] int32 (sequence b's token t is at
    `pages[block_tables[b, t // P], t % P]`), seq_lens [B] int32 (keys 0 .. seq_lens[b] - 1;
    a sequence with 0 keys gets 0). Returns softmax(q k^T / sqrt(D)) v, [B, H_q, D] in q's dtype,
    query head h reading KV head h // (H_q // H_kv). num_splits: programs per (sequence, KV head),
    each over a contiguous share of the sequence's keys (default: `default_splits` for the
    batch and this GPU; static for a given batch size, so a captured graph keeps it).
    """
    if num_splits is None:
        sms = _sm_count(q.device.index or 0) if q.device.type == "cuda" else None
        num_splits = default_splits(q.shape[0], pages.shape[3], sms)
    part, lse = paged_decode_splits(q, pages, block_tables, seq_lens, num_splits)
    if num_splits == 1:  # one split holds every key: its output is the softmax's
        return part[:, :, 0].to(q.dtype)
    return combine_splits_fused(part, lse, q.dtype)


def paged_decode_reference(
    q: torch.Tensor, pages: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor
) -> torch.Tensor:
    """`paged_decode` in plain torch (fp32 softmax), one sequence at a time; reads seq_lens on
    the host, so it is not capturable. Returns [B, H_q, D] in q's dtype."""
    h_q, d = q.shape[1:]
    page_size, h_kv = pages.shape[1], pages.shape[3]
    r = h_q // h_kv
    out = torch.zeros_like(q)
    for b, n in enumerate(seq_lens.tolist()):
        t = torch.arange(n, device=q.device)
        kv = pages[block_tables[b, t // page_size].long(), t % page_size].float()  # [n, 2, H_kv, D]
        k = kv[:, 0].repeat_interleave(r, dim=1)  # [n, H_q, D]
        v = kv[:, 1].repeat_interleave(r, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[b].float(), k) / math.sqrt(d)  # [H_q, n]
        out[b] = torch.einsum("hn,nhd->hd", scores.softmax(dim=-1), v).to(q.dtype)
    return out
