"""HiP decode queries over their gathered rows (`AttendBuffer`s), many in one Triton launch.

Each entry b is one decode query's buffer: keys and values [cap, G, D] (keys already rotated),
rows 0..n_b-1 valid, all attended (nothing masked). The buffers live anywhere in device memory;
the kernels reach them by element offsets from one base pointer (the first buffer's keys):

    META [B, 4] int64:  (key offset, value offset, rows n_b, keys per split of b)

`put_rows` writes each entry's new key and value at row n_b - 1; `buffers_attn_fwd` runs the
online softmax of `kvtier.sparse.triton_attn_kernels.attend_tile` over (query rows, entry x KV
head, key split) programs, always as splits merged by `merge_splits`.

NOTE: an entry's key splits are chosen from its own row count and head shape alone (as if it
were launched by itself), every program writes a partial (an empty split writes 0 and -inf),
and the merge always reads `SPLITS_P2` lanes: so an entry's output is bitwise the same whether
it is attended alone or beside others. A store's layer of cached slices is one launch; a slice
attended alone (resident) gives the same bits.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kvtier.attention.fit_shared import launch
from kvtier.sparse.triton_attn import _NO_SPLIT, _auto_splits, _interpreting, _tiles
from kvtier.sparse.triton_attn_kernels import attend_tile, merge_splits

SPLITS_P2 = 64  # merge lanes: at least `_auto_splits`' largest count, the same for every launch


@triton.jit
def put_rows(  # type: ignore[no-untyped-def]
    BASE,  # the first buffer's keys: offsets below are in its elements
    META,  # [B, 4] int64 (key offset, value offset, rows, keys per split)
    K,  # [B, G, D] the new keys (rotated)
    V,  # [B, G, D] the new values
    stride_ks,  # elements between two rows of a buffer
    stride_kg,
    stride_nb,  # K's
    stride_ng,
    stride_vb,  # V's
    stride_vg,
    G: tl.constexpr,
    D: tl.constexpr,
):
    """Program (b, g): entry b's new key and value of KV head g at its row n_b - 1."""
    b = tl.program_id(0)
    g = tl.program_id(1)
    d = tl.arange(0, D)
    row = (tl.load(META + b * 4 + 2) - 1) * stride_ks + g * stride_kg
    k = tl.load(K + b * stride_nb + g * stride_ng + d)
    v = tl.load(V + b * stride_vb + g * stride_vg + d)
    tl.store(BASE + tl.load(META + b * 4) + row + d, k)
    tl.store(BASE + tl.load(META + b * 4 + 1) + row + d, v)


@triton.jit
def buffers_attn_fwd(  # type: ignore[no-untyped-def]
    Q,  # [B, H, D] rotated queries, H = G * R, last stride 1
    BASE,  # the first buffer's keys (offsets in META are in its elements)
    META,  # [B, 4] int64
    Out,  # [SPLITS, B, H, D] fp32 partial outputs
    LSE,  # [SPLITS, B, H] fp32 log2-sum-exp of each partial
    stride_qb,
    stride_qh,
    stride_ks,
    stride_kg,
    stride_os,
    stride_ob,
    stride_oh,
    stride_ls,
    stride_lb,
    sm_scale_log2,
    G: tl.constexpr,
    R: tl.constexpr,
    D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IEEE: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bg = tl.program_id(1)
    pid_s = tl.program_id(2)
    b = pid_bg // G
    g = pid_bg % G
    k_base = BASE + tl.load(META + b * 4) + g * stride_kg
    v_base = BASE + tl.load(META + b * 4 + 1) + g * stride_kg
    n_keys = tl.load(META + b * 4 + 2)
    per_split = tl.load(META + b * 4 + 3)
    k_lo = pid_s * per_split
    k_hi = tl.minimum(n_keys, k_lo + per_split)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # row = head in the group (one query)
    head = g * R + offs_m
    m_valid = offs_m < R
    qpos = tl.where(m_valid, 1 << 62, -1).to(tl.int64)  # past every row: nothing masked
    offs_d = tl.arange(0, D)
    q = tl.load(
        Q + b * stride_qb + head[:, None] * stride_qh + offs_d[None, :], mask=m_valid[:, None], other=0.0
    )

    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    # P = 0, w0 = 0: list position j is row j (what the single-query kernel reads by index)
    if INTERPRET:  # the interpreter cannot take a runtime `range` bound
        start = k_lo
        while start < k_hi:
            m_i, l_i, acc = attend_tile(
                q, qpos, m_i, l_i, acc, k_base, v_base, META, start, k_hi, 0, 0, stride_ks, stride_ks,
                D, BLOCK_N, True, IEEE, INTERPRET, sm_scale_log2, Q, Q, 0, False, False,
            )  # fmt: skip
            start += BLOCK_N
    else:
        for start in range(k_lo, k_hi, BLOCK_N):
            m_i, l_i, acc = attend_tile(
                q, qpos, m_i, l_i, acc, k_base, v_base, META, start, k_hi, 0, 0, stride_ks, stride_ks,
                D, BLOCK_N, True, IEEE, INTERPRET, sm_scale_log2, Q, Q, 0, False, False,
            )  # fmt: skip

    l_safe = tl.where(l_i > 0, l_i, 1.0)
    out = acc / l_safe[:, None]  # an empty split writes 0
    o_ptrs = Out + pid_s * stride_os + b * stride_ob + head[:, None] * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, out, mask=m_valid[:, None])
    lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
    tl.store(LSE + pid_s * stride_ls + b * stride_lb + head, lse, mask=m_valid)


def entry_split(
    rows: int, r: int, g: int, dtype: torch.dtype, d: int, device: torch.device
) -> tuple[int, int]:
    """(splits, keys per split) of one buffer of `rows` rows attended alone: r query heads per
    KV head, g KV heads. The choice depends on nothing else, so batching never changes it."""
    block_m, block_n, _, _ = _tiles(r, dtype, d)
    grid_m = triton.cdiv(r, block_m)
    splits = _auto_splits(grid_m * g, rows, block_n, device)
    if splits <= 1:
        return 1, _NO_SPLIT
    per = triton.cdiv(triton.cdiv(max(rows, 1), splits), block_n) * block_n
    return triton.cdiv(max(rows, 1), per), per


def buffers_meta(
    q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], rows: list[int]
) -> tuple[list[int], int]:
    """META's values [B * 4] of decode queries q [B, H_q, D] over buffers keys[b], values[b]
    [cap_b, G, D] (rows[b] rows each), and the launch's key splits: the host's half of
    `attend_buffers_triton`. Raises ValueError on buffers the kernels cannot read."""
    h_q, d = q.shape[1], q.shape[2]
    g = keys[0].shape[-2]
    if h_q % g:
        raise ValueError(f"{h_q} query heads are not a multiple of {g} KV heads")
    if d & (d - 1) or d < 16:
        raise ValueError(f"head dim {d} must be a power of two >= 16")
    r = h_q // g
    base = keys[0]
    size = base.element_size()
    meta: list[int] = []
    splits = 1
    for k, v, n in zip(keys, values, rows, strict=True):
        if k.stride() != base.stride() or v.stride() != base.stride() or k.dtype != base.dtype:
            raise ValueError("every buffer must be [cap, G, D] contiguous in one dtype")
        s, per = entry_split(n, r, g, q.dtype, d, q.device)
        splits = max(splits, s)
        meta += [(k.data_ptr() - base.data_ptr()) // size, (v.data_ptr() - base.data_ptr()) // size, n, per]
    return meta, splits


def attend_buffers_triton(
    q: torch.Tensor,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    rows: list[int],
    new: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Decode queries q [B, H_q, D] (rotated) over buffers keys[b], values[b] [cap_b, G, D]
    (rows 0..rows[b]-1; contiguous, one dtype). With `new` = (keys, values) [B, G, D], entry
    b's are first written at row rows[b] - 1 (one launch for all). Returns [B, H_q, D] in q's
    dtype: two launches (attention, merge) plus one small host-to-device copy of META."""
    meta, splits = buffers_meta(q, keys, values, rows)
    meta_t = torch.tensor(meta, dtype=torch.int64).to(q.device, non_blocking=True)  # [B * 4]
    return attend_buffers_meta(q, keys[0], meta_t, splits, new)


def attend_buffers_meta(
    q: torch.Tensor,
    base: torch.Tensor,
    meta_t: torch.Tensor,
    splits: int,
    new: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """The device's half of `attend_buffers_triton`: META already on the device, meta_t [B * 4]
    int64 as `buffers_meta` gives it, `base` the first buffer's keys, `splits` its key splits.
    Reads no host value of its inputs (a CUDA graph may replay it with new META)."""
    bsz, h_q, d = q.shape
    g = base.shape[-2]
    r = h_q // g
    stride_ks, stride_kg = base.stride(0), base.stride(1)
    if new is not None:
        nk, nv = new
        if nk.stride(-1) != 1 or nv.stride(-1) != 1:
            raise ValueError("new keys and values must be contiguous along the head dim")
        put_rows[(bsz, g)](
            base,
            meta_t,
            nk,
            nv,
            stride_ks,
            stride_kg,
            nk.stride(0),
            nk.stride(1),
            nv.stride(0),
            nv.stride(1),
            G=g,
            D=d,
        )
    if q.stride(-1) != 1:
        q = q.contiguous()
    block_m, block_n, warps, stages = _tiles(r, q.dtype, d)
    part = torch.empty((splits, bsz, h_q, d), dtype=torch.float32, device=q.device)
    lse = torch.empty((splits, bsz, h_q), dtype=torch.float32, device=q.device)
    launch(
        buffers_attn_fwd, (triton.cdiv(r, block_m), bsz * g, splits),
        q, base, meta_t, part, lse,
        q.stride(0), q.stride(1), stride_ks, stride_kg,
        part.stride(0), part.stride(1), part.stride(2), lse.stride(0), lse.stride(1),
        math.log2(math.e) / math.sqrt(d),
        G=g, R=r, D=d, BLOCK_M=block_m, BLOCK_N=block_n, IEEE=q.dtype == torch.float32,
        INTERPRET=_interpreting(), num_warps=warps, num_stages=stages,
    )  # fmt: skip
    out = torch.empty((bsz, h_q, d), dtype=q.dtype, device=q.device)
    n = bsz * h_q
    merge_splits[(n,)](part, lse, out, n, splits, D=d, SPLITS_P2=SPLITS_P2)
    return out
