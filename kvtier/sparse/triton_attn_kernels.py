"""The Triton kernels of HiP's block-sparse attention (`kvtier.sparse.triton_attn` launches them
and documents the algorithm): one online-softmax tile over gathered K/V rows, the program over a
(query block, KV head, key split), and the log-sum-exp merge of key splits.

Imports triton at module level; only `kvtier.sparse.triton_attn` imports this module.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def attend_tile(  # type: ignore[no-untyped-def]
    q,  # [BM, D] queries of the program
    qpos,  # [BM] their true positions (-1 = padding)
    m_i,  # [BM] running max (log2 domain)
    l_i,  # [BM] running sum
    acc,  # [BM, D] fp32 running output
    k_base,  # key row 0 of this (block, KV head)
    v_base,  # value row 0 of this KV head
    prefix,  # this block's prefix [P]
    start,  # first list position of the tile
    k_hi,  # end of this program's list range
    P,
    w0,
    stride_ks,
    stride_vs,
    D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    K_GATHERED: tl.constexpr,
    IEEE: tl.constexpr,
    INTERPRET: tl.constexpr,
    sm_scale_log2,
    cos_ptr,
    sin_ptr,
    n_pre,
    ROTATE: tl.constexpr,
    STREAMING: tl.constexpr,
):
    """One BLOCK_N tile of the key list: gather K/V rows by index (rotating keys at their
    attention positions when ROTATE), update the online softmax."""
    offs_d = tl.arange(0, D)
    j = start + tl.arange(0, BLOCK_N)  # [BN] positions in the block's key list
    in_range = j < k_hi
    is_pre = j < P
    pre = tl.load(prefix + j, mask=in_range & is_pre, other=-1)
    kpos = tl.where(is_pre, pre, w0 + (j - P)).to(tl.int64)
    kpos = tl.where(in_range, kpos, -1)
    k_ok = kpos >= 0
    krow = j.to(tl.int64) if K_GATHERED else kpos
    k = tl.load(k_base + krow[:, None] * stride_ks + offs_d[None, :], mask=k_ok[:, None], other=0.0)
    if ROTATE:  # Rotary.apply at the key's attention position, each op rounded to the dtype
        rp = kpos
        if STREAMING:  # sinks and selected packed right below the window
            rp = tl.where(is_pre, w0 - n_pre + j, kpos)
        # clamped at 0: a prefix must lie below its window (so n_pre <= w0); one that does not
        # (sinks past a block's queries) would read the tables below row 0 (a fault on CUDA)
        rp = tl.where(k_ok, tl.maximum(rp, 0), 0).to(tl.int64)
        c = tl.load(cos_ptr + rp[:, None] * D + offs_d[None, :]).to(tl.float32)
        sn = tl.load(sin_ptr + rp[:, None] * D + offs_d[None, :]).to(tl.float32)
        sign = tl.where(offs_d < D // 2, -1.0, 1.0)
        swapped = (offs_d + D // 2) % D
        ks = tl.load(k_base + krow[:, None] * stride_ks + swapped[None, :], mask=k_ok[:, None], other=0.0)
        kdt = k.dtype
        a = (k.to(tl.float32) * c).to(kdt).to(tl.float32)
        bb = (ks.to(tl.float32) * sign[None, :] * sn).to(kdt).to(tl.float32)
        k = (a + bb).to(kdt)
    if INTERPRET:  # the interpreter's tl.dot is wrong for bf16: take the products in fp32
        s = tl.dot(q.to(tl.float32), tl.trans(k).to(tl.float32), input_precision="ieee")
    elif IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    allowed = k_ok[None, :] & (kpos[None, :] <= qpos[:, None])
    s = tl.where(allowed, s * sm_scale_log2, float("-inf"))  # [BM, BN], log2 domain
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_base + kpos[:, None] * stride_vs + offs_d[None, :], mask=k_ok[:, None], other=0.0)
    if INTERPRET:
        pv = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), input_precision="ieee")
    elif IEEE:
        pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc * alpha[:, None] + pv


@triton.jit(do_not_specialize=["Tb", "P", "w0_scalar", "wend_scalar", "keys_per_split"])
def sparse_attn_fwd(  # type: ignore[no-untyped-def]
    Q,  # [B, Tb, H_q, D], last stride 1
    QPOS,  # [B, Tb] int64, -1 = padding (no query)
    K,  # kv[:, 0] [S, G, D] or gathered keys [B, L, G, D] (K_GATHERED)
    V,  # kv[:, 1] [S, G, D]
    PREFIX,  # [B, P] int64 sorted positions, -1 = padding
    W0,  # [B] int64 window starts (PER_BLOCK_WINDOW)
    WEND,  # [B] int64 window ends = last query + 1 (PER_BLOCK_WINDOW)
    COS,  # [P_rope, D] RoPE table rows (ROTATE)
    SIN,
    NPRE,  # [B] int64 valid prefix entries per block (ROTATE and STREAMING)
    Out,  # [SPLITS, B, Tb, H_q, D] (fp32 partials when SPLIT, else the output in q's dtype)
    LSE,  # [SPLITS, B, Tb, H_q] fp32 log2-sum-exp of each partial (SPLIT only)
    stride_qb,
    stride_qt,
    stride_qh,
    stride_pb,
    stride_kb,
    stride_ks,
    stride_kg,
    stride_vs,
    stride_vg,
    stride_prb,
    stride_os,
    stride_ob,
    stride_ot,
    stride_oh,
    stride_ls,
    stride_lb,
    stride_lt,
    Tb,
    P,
    w0_scalar,
    wend_scalar,
    keys_per_split,
    sm_scale_log2,
    G: tl.constexpr,
    R: tl.constexpr,
    D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PER_BLOCK_WINDOW: tl.constexpr,
    K_GATHERED: tl.constexpr,
    SPLIT: tl.constexpr,
    IEEE: tl.constexpr,
    INTERPRET: tl.constexpr,
    ROTATE: tl.constexpr,
    STREAMING: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bg = tl.program_id(1)
    pid_s = tl.program_id(2)
    b = pid_bg // G
    g = pid_bg % G
    if PER_BLOCK_WINDOW:
        w0 = tl.load(W0 + b)
        wend = tl.load(WEND + b)
    else:
        w0 = w0_scalar
        wend = wend_scalar
    n_pre = tl.load(NPRE + b) if ROTATE and STREAMING else 0
    n_keys = P + wend - w0
    k_lo = pid_s * keys_per_split
    k_hi = tl.minimum(n_keys, k_lo + keys_per_split)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # row = query t * R + head-in-group
    t = offs_m // R
    head = g * R + offs_m % R
    m_valid = t < Tb
    qpos = tl.load(QPOS + b * stride_pb + t, mask=m_valid, other=-1)  # [BM]
    offs_d = tl.arange(0, D)
    q = tl.load(
        Q + b * stride_qb + t[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
        mask=m_valid[:, None],
        other=0.0,
    )  # [BM, D]

    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)  # finite: a fully masked tile gives p = 0
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    k_base = K + b * stride_kb + g * stride_kg
    v_base = V + g * stride_vg
    if INTERPRET:  # the interpreter (with numpy >= 2.4) cannot take a runtime `range` bound
        start = k_lo
        while start < k_hi:
            m_i, l_i, acc = attend_tile(
                q,
                qpos,
                m_i,
                l_i,
                acc,
                k_base,
                v_base,
                PREFIX + b * stride_prb,
                start,
                k_hi,
                P,
                w0,
                stride_ks,
                stride_vs,
                D,
                BLOCK_N,
                K_GATHERED,
                IEEE,
                INTERPRET,
                sm_scale_log2,
                COS,
                SIN,
                n_pre,
                ROTATE,
                STREAMING,
            )
            start += BLOCK_N
    else:
        for start in range(k_lo, k_hi, BLOCK_N):
            m_i, l_i, acc = attend_tile(
                q,
                qpos,
                m_i,
                l_i,
                acc,
                k_base,
                v_base,
                PREFIX + b * stride_prb,
                start,
                k_hi,
                P,
                w0,
                stride_ks,
                stride_vs,
                D,
                BLOCK_N,
                K_GATHERED,
                IEEE,
                INTERPRET,
                sm_scale_log2,
                COS,
                SIN,
                n_pre,
                ROTATE,
                STREAMING,
            )

    l_safe = tl.where(l_i > 0, l_i, 1.0)
    out = acc / l_safe[:, None]  # a row with no allowed key (padding) is 0
    o_ptrs = Out + pid_s * stride_os + b * stride_ob + t[:, None] * stride_ot + head[:, None] * stride_oh
    tl.store(o_ptrs + offs_d[None, :], out.to(Out.dtype.element_ty), mask=m_valid[:, None])
    if SPLIT:
        lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(LSE + pid_s * stride_ls + b * stride_lb + t * stride_lt + head, lse, mask=m_valid)


@triton.jit
def merge_splits(  # type: ignore[no-untyped-def]
    PART,  # [SPLITS, N, D] fp32 partial outputs (N = B * Tb * H_q rows)
    LSE,  # [SPLITS, N] fp32 log2-sum-exp
    Out,  # [N, D] output
    N,
    SPLITS,
    D: tl.constexpr,
    SPLITS_P2: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    s = tl.arange(0, SPLITS_P2)
    offs_d = tl.arange(0, D)
    s_ok = s < SPLITS
    lse = tl.load(LSE + s * N + row, mask=s_ok, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m)  # [SPLITS_P2], 0 for empty splits
    total = tl.sum(w, 0)
    total = tl.where(total > 0, total, 1.0)
    part = tl.load(PART + (s[:, None] * N + row) * D + offs_d[None, :], mask=s_ok[:, None], other=0.0)
    out = tl.sum(part * w[:, None], 0) / total
    tl.store(Out + row * D + offs_d, out.to(Out.dtype.element_ty))
