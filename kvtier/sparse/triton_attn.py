"""Triton kernels for HiP block-sparse attention: `attend_block` without gathering K/V in torch.

One program handles BLOCK_M rows of one (query block, KV head): a row is one (query, query head)
pair, so the r = H_q / G query heads that share a KV head (GQA) share every K/V tile load. The
program walks the block's key index list

    j in [0, P)            ->  prefix[j]                 (sinks + selected, -1 = padding)
    j in [P, P + W)        ->  window_start + (j - P)    (the window, up to the last query)

in tiles of BLOCK_N, loads each tile's indices, gathers the key and value rows straight out of
kv [S, 2, G, D] with pointer arithmetic, masks idx <= q_pos causally, and keeps a flash-attention
style online softmax in fp32. When few programs would cover the GPU (decode: one query block,
one KV head) the key list is split over several programs (flash-decoding) and a second small
kernel merges the partial results by their log-sum-exp.

Rotary (context extension, `rotary` given): q is rotated at its true positions and the block's
keys are gathered and rotated at `attention_key_positions(mode, ...)` in torch first (the same
`RopeTable.rotate` as the reference, so the rotated keys are bit-identical); the kernel then reads
keys from that gathered [L, G, D] buffer by list position (K_GATHERED) and values still straight
from kv by index. The causal mask always uses true positions.

`triton` is imported here at module level; `kvtier.sparse.block_sparse` imports this module only
when it dispatches to it, so importing kvtier never needs triton. For CPU tensors set
TRITON_INTERPRET=1 before this module is first imported (Triton's interpreter). Under the
interpreter (Triton 3.6, numpy 2.4) two things differ from the compiled kernel, both behind the
INTERPRET constexpr and sharing the same tile code (`_attend_tile`): the key loop is a `while`
(the interpreter cannot take a runtime `range` bound) and the dots take fp32 operands (its bf16
`tl.dot` is wrong).
"""

from __future__ import annotations

import functools
import math
import os

import torch
import triton
import triton.language as tl

from kvtier.sparse.rope_ext import RopeTable, attention_key_positions

_NO_SPLIT = 1 << 30  # keys_per_split when the key list is not split


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_available(q: torch.Tensor | None = None) -> bool:
    """Whether the Triton kernels can run on q's device: triton imports (true once this module
    is imported) and q is on CUDA or TRITON_INTERPRET=1 (the interpreter takes CPU tensors)."""
    return _interpreting() or (q is not None and q.is_cuda)


@triton.jit
def _attend_tile(  # type: ignore[no-untyped-def]
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
        rp = tl.where(k_ok, rp, 0).to(tl.int64)
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
def _sparse_attn_fwd(  # type: ignore[no-untyped-def]
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
            m_i, l_i, acc = _attend_tile(
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
            m_i, l_i, acc = _attend_tile(
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
def _merge_splits(  # type: ignore[no-untyped-def]
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


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).multi_processor_count)
    return 4  # interpreter: a few splits, so the split path is exercised on CPU too


def _tiles(rows: int, dtype: torch.dtype, d: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) for `rows` = Tb * r rows per (block, KV head)."""
    block_m = 16 if rows <= 16 else (32 if rows <= 32 else 64)
    block_n = 32 if dtype == torch.float32 or d > 128 else 64
    return block_m, block_n, 4


def _auto_splits(n_programs: int, n_keys: int, block_n: int, device: torch.device) -> int:
    """Split the key list when the grid alone would leave most SMs idle (decode)."""
    sms = _sm_count(device)
    if n_programs * 2 > sms:
        return 1
    by_keys = max(1, n_keys // (4 * block_n))  # at least ~4 tiles per split
    return max(1, min(by_keys, (2 * sms) // n_programs, 64))


def _launch(
    q: torch.Tensor,
    q_pos: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    prefix: torch.Tensor,
    *,
    window: tuple[int, int] | tuple[torch.Tensor, torch.Tensor],
    k_gathered: bool,
    max_keys: int | None,
    num_splits: int | None,
    rope: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    streaming: bool = False,
) -> torch.Tensor:
    """Run the kernel. q [B, Tb, H_q, D], q_pos [B, Tb] int64, k [S, G, D] (or [B, L, G, D] when
    k_gathered), v [S, G, D], prefix [B, P] int64 (-1 padded), window = (w0, wend) as ints (B = 1)
    or [B] int64 tensors. max_keys: an upper bound on P + wend - w0 (None: unknown, no split).
    `rope` = (cos, sin [P_rope, D] covering every key position, valid prefix entries [B]): keys
    are rotated in the kernel, at packed positions below the window when `streaming`.
    Returns [B, Tb, H_q, D] in q's dtype."""
    bsz, tb, h_q, d = q.shape
    g = v.shape[-2]
    if h_q % g:
        raise ValueError(f"{h_q} query heads are not a multiple of {g} KV heads")
    if d & (d - 1) or d < 16:
        raise ValueError(f"head dim {d} must be a power of two >= 16")
    r = h_q // g
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("keys and values must be contiguous along the head dim")
    p = prefix.shape[1]
    if p == 0:  # a valid pointer for the (fully masked) prefix loads
        prefix = torch.full((bsz, 1), -1, dtype=torch.int64, device=q.device)
    block_m, block_n, warps = _tiles(tb * r, q.dtype, d)
    grid_m = triton.cdiv(tb * r, block_m)
    if num_splits is None:
        num_splits = 1 if max_keys is None else _auto_splits(grid_m * bsz * g, max_keys, block_n, q.device)
    keys_per_split = _NO_SPLIT
    if num_splits > 1:
        if max_keys is None:
            raise ValueError("splitting the key list needs max_keys")
        keys_per_split = triton.cdiv(triton.cdiv(max(max_keys, 1), num_splits), block_n) * block_n
        num_splits = triton.cdiv(max(max_keys, 1), keys_per_split)
    split = num_splits > 1

    out = torch.empty((bsz, tb, h_q, d), dtype=q.dtype, device=q.device)
    if split:
        part = torch.empty((num_splits, bsz, tb, h_q, d), dtype=torch.float32, device=q.device)
        lse = torch.empty((num_splits, bsz, tb, h_q), dtype=torch.float32, device=q.device)
        o_t, l_t = part, lse
    else:
        o_t, l_t = out.unsqueeze(0), out.new_empty((1, 1, 1, 1), dtype=torch.float32)
    if isinstance(window[0], torch.Tensor):
        w0_t, wend_t = window
        w0_s = wend_s = 0
        per_block = True
    else:
        w0_s, wend_s = int(window[0]), int(window[1])
        w0_t = wend_t = q_pos  # unused
        per_block = False
    if k_gathered:
        stride_kb = k.stride(0) if k.dim() == 4 else 0
        stride_ks, stride_kg = k.stride(-3), k.stride(-2)
    else:
        stride_kb, stride_ks, stride_kg = 0, k.stride(0), k.stride(1)
    cos, sin, n_pre = rope if rope is not None else (q, q, q_pos)  # placeholders when not rotating
    _sparse_attn_fwd[(grid_m, bsz * g, num_splits)](
        q,
        q_pos,
        k,
        v,
        prefix,
        w0_t,
        wend_t,
        cos,
        sin,
        n_pre,
        o_t,
        l_t,
        q.stride(0),
        q.stride(1),
        q.stride(2),
        q_pos.stride(0),
        stride_kb,
        stride_ks,
        stride_kg,
        v.stride(0),
        v.stride(1),
        prefix.stride(0),
        o_t.stride(0),
        o_t.stride(1),
        o_t.stride(2),
        o_t.stride(3),
        l_t.stride(0),
        l_t.stride(1),
        l_t.stride(2),
        tb,
        p,
        w0_s,
        wend_s,
        keys_per_split,
        math.log2(math.e) / math.sqrt(d),
        G=g,
        R=r,
        D=d,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        PER_BLOCK_WINDOW=per_block,
        K_GATHERED=k_gathered,
        SPLIT=split,
        IEEE=q.dtype == torch.float32,
        INTERPRET=_interpreting(),
        ROTATE=rope is not None,
        STREAMING=streaming,
        num_warps=warps,
    )
    if split:
        n = bsz * tb * h_q
        _merge_splits[(n,)](part, lse, out, n, num_splits, D=d, SPLITS_P2=triton.next_power_of_2(num_splits))
    return out


def attend_block_triton(
    q: torch.Tensor,
    q_pos: torch.Tensor,
    kv: torch.Tensor,
    prefix: torch.Tensor,
    window_start: int,
    *,
    rotary: RopeTable | None = None,
    mode: str = "absolute",
    num_splits: int | None = None,
) -> torch.Tensor:
    """`attend_block` in Triton: q [Tb, H_q, D] at true positions q_pos [Tb] (ascending) over
    kv [S, 2, G, D]; keys = `prefix` [P] (sorted, all < window_start) + [window_start, q_pos[-1]],
    masked causally by true position. `rotary`/`mode` as in `attend_block`. num_splits: key-list
    splits (None: chosen from the grid size). Returns [Tb, H_q, D] in q's dtype."""
    end = int(q_pos[-1]) + 1
    window_start = min(window_start, end)
    prefix = prefix.to(torch.int64)
    q_pos2 = q_pos.to(torch.int64).reshape(1, -1)
    k_src = kv[:, 0]
    if rotary is not None:
        idx = torch.cat((prefix, torch.arange(window_start, end, device=prefix.device)))
        k_src = rotary.rotate(kv[idx, 0], attention_key_positions(mode, prefix, window_start, end))
        q = rotary.rotate(q, q_pos)
    out = _launch(
        q.unsqueeze(0),
        q_pos2,
        k_src,
        kv[:, 1],
        prefix.reshape(1, -1),
        window=(window_start, end),
        k_gathered=rotary is not None,
        max_keys=prefix.numel() + end - window_start,
        num_splits=num_splits,
    )
    return out[0]


def attend_blocks_triton(
    q: torch.Tensor,
    q_pos: torch.Tensor,
    kv: torch.Tensor,
    prefix: torch.Tensor,
    window_start: torch.Tensor,
    *,
    rotary: RopeTable | None = None,
    mode: str = "absolute",
    num_splits: int | None = None,
    limit: int | None = None,
) -> torch.Tensor:
    """Several query blocks in one launch (prefill): block b is `attend_block(q[b], q_pos[b],
    kv, prefix[b], window_start[b])` with the padding dropped.

    q [B, Tb, H_q, D]; q_pos [B, Tb] ascending true positions, -1 = padding (its output row is 0);
    prefix [B, P] sorted positions, valid entries first then -1 padding; window_start [B].
    With `rotary` the queries are rotated at their true positions and the keys in the kernel, at
    `attention_key_positions(mode, ...)` (no gathered copy of the keys); `limit` bounds every
    position (None: read from q_pos, a host sync). Returns [B, Tb, H_q, D] in q's dtype.
    num_splits > 1 splits the key lists (costs a sync); None never splits here (many blocks fill
    the GPU anyway).
    """
    prefix = prefix.to(torch.int64)
    q_pos = q_pos.to(torch.int64)
    wend = q_pos.amax(dim=1) + 1  # [B]
    w0 = torch.minimum(window_start.to(device=q.device, dtype=torch.int64), wend)
    split = num_splits is not None and num_splits > 1
    max_keys = prefix.shape[1] + int((wend - w0).max()) if split else None
    rope = None
    if rotary is not None:
        if limit is None:
            limit = int(q_pos.max()) + 1
        cos, sin = rotary.tables(limit, kv)
        rope = (cos, sin, (prefix >= 0).sum(dim=1))
        b, tb, h, d = q.shape
        q = rotary.rotate(q.reshape(b * tb, h, d), q_pos.clamp(min=0).reshape(-1), limit).reshape(b, tb, h, d)
    return _launch(
        q,
        q_pos,
        kv[:, 0],
        kv[:, 1],
        prefix,
        window=(w0, wend),
        k_gathered=False,
        max_keys=max_keys,
        num_splits=num_splits,
        rope=rope,
        streaming=mode == "streaming",
    )


def attend_gathered_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    index: torch.Tensor,
    far: torch.Tensor,
    *,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Decode over keys already gathered (and rotated): q [1, H_q, D] (rotated) attends rows
    0..L-1 of k, v [cap, G, D], L = index.numel(), index = arange(L) int64 (the key list), far
    [1, 1] int64 a query position past every row (nothing masked). One launch (two when the
    key list is split). Returns [1, H_q, D] in q's dtype."""
    n = index.numel()
    out = _launch(
        q.unsqueeze(0),
        far,
        k,
        v,
        index.view(1, -1),
        window=(n, n),
        k_gathered=True,
        max_keys=n,
        num_splits=num_splits,
    )
    return out[0]
