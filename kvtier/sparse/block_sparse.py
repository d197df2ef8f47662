"""Block-sparse attention of one query block over sink + selected + window keys, one softmax.

Pure torch: gather the block's key indices, rotate (context extension) if asked, and take an
exact softmax over their union with a causal mask on true positions. This is the reference the
Triton kernels are to be tested against; `masked_dense_attention` is its own reference.

`attend_block` runs the Triton kernel (`kvtier.sparse.triton_attn`) instead when q is on CUDA
and triton is installed; KVTIER_SPARSE_KERNEL=torch forces this pure-torch reference.

    keys of a block:  [ sinks | selected (sorted) ][ window w0 .. last query ]
                        `prefix`, shared by every    causal per query
                        query of the block
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch
import torch.nn.functional as F

from kvtier.sparse.rope_ext import RopeTable, attention_key_positions


def attend_block(
    q: torch.Tensor,
    q_pos: torch.Tensor,
    kv: torch.Tensor,
    prefix: torch.Tensor,
    window_start: int,
    *,
    rotary: RopeTable | None = None,
    mode: str = "absolute",
) -> torch.Tensor:
    """Attention of q [Tb, H_q, D] at true positions q_pos [Tb] (ascending) over kv [S, 2, G, D].

    Keys: `prefix` [P] sorted positions (all < window_start) plus [window_start, q_pos[-1]], each
    masked causally by true position. With `rotary`, q and k are un-rotated and are rotated here:
    queries at their true positions, keys at `attention_key_positions(mode, ...)`.
    Returns [Tb, H_q, D] in q's dtype. On CUDA with triton installed this is the Triton kernel
    (unless KVTIER_SPARSE_KERNEL=torch), else `attend_block_reference`.
    """
    if q.is_cuda and use_triton():
        from kvtier.sparse.triton_attn import attend_block_triton

        return attend_block_triton(q, q_pos, kv, prefix, window_start, rotary=rotary, mode=mode)
    return attend_block_reference(q, q_pos, kv, prefix, window_start, rotary=rotary, mode=mode)


def attend_block_reference(
    q: torch.Tensor,
    q_pos: torch.Tensor,
    kv: torch.Tensor,
    prefix: torch.Tensor,
    window_start: int,
    *,
    rotary: RopeTable | None = None,
    mode: str = "absolute",
    end: int | None = None,
) -> torch.Tensor:
    """`attend_block` in pure torch (the reference): gather, rotate, one masked softmax.
    q [Tb, H_q, D], q_pos [Tb], kv [S, 2, G, D], prefix [P] -> [Tb, H_q, D] in q's dtype.
    `end`: q_pos[-1] + 1 when the caller knows it (saves reading q_pos back: a GPU sync)."""
    end = int(q_pos[-1]) + 1 if end is None else end
    window_start = min(window_start, end)  # a block below the sinks has no window
    idx = torch.cat((prefix, torch.arange(window_start, end, device=prefix.device)))  # [L]
    k = kv[idx, 0]  # [L, G, D]
    v = kv[idx, 1]
    if rotary is not None:
        k = rotary.rotate(k, attention_key_positions(mode, prefix, window_start, end), limit=end)
        q = rotary.rotate(q, q_pos, limit=end)
    mask = idx[None, :] <= q_pos[:, None]  # [Tb, L]
    return softmax_attention(q, k, v, mask)


def attend_blocks(
    q: torch.Tensor,
    first: int,
    block: int,
    kv: torch.Tensor,
    prefix: torch.Tensor,
    window_starts: list[int],
    *,
    rotary: RopeTable | None = None,
    mode: str = "absolute",
    triton: bool | None = None,
) -> torch.Tensor:
    """Prefill: every query block of q [T, H_q, D] (true positions first..first+T-1, blocks of
    `block` queries, the last maybe shorter) attends its prefix row prefix[b] ([B, P] sorted
    positions, valid first, -1 padding after) and its window from window_starts[b], as
    `attend_block` would. Returns [T, H_q, D].

    On CUDA with triton: one batched launch (`attend_blocks_triton`, which rotates keys in the
    kernel) over padded blocks; else `attend_block_reference` per block. `triton` forces either
    (True also runs on CPU under TRITON_INTERPRET=1).
    """
    t = q.shape[0]
    if not (q.is_cuda and use_triton() if triton is None else triton):
        out = torch.empty_like(q)
        for i, w0 in enumerate(window_starts):
            b, e = i * block, min(i * block + block, t)
            pos = torch.arange(first + b, first + e, device=q.device)
            pre = prefix[i][prefix[i] >= 0]  # NOTE: a host sync; the reference path only
            out[b:e] = attend_block_reference(q[b:e], pos, kv, pre, w0, rotary=rotary, mode=mode)
        return out
    from kvtier.sparse.triton_attn import attend_blocks_triton

    n = len(window_starts)
    pad = n * block - t
    qb = F.pad(q, (0, 0, 0, 0, 0, pad)).view(n, block, *q.shape[1:])  # [B, Tb, H_q, D]
    pos = torch.arange(first, first + n * block, device=q.device)
    q_pos = torch.where(pos < first + t, pos, -1).view(n, block)  # [B, Tb], -1 = padding
    starts = torch.tensor(window_starts, dtype=torch.int64).to(q.device, non_blocking=True)  # [B]
    out = attend_blocks_triton(qb, q_pos, kv, prefix, starts, rotary=rotary, mode=mode, limit=first + t)
    return out.view(n * block, *q.shape[1:])[:t]


def use_triton() -> bool:
    """Triton dispatch for CUDA tensors: not forced off by KVTIER_SPARSE_KERNEL=torch, and
    triton importable."""
    return os.environ.get("KVTIER_SPARSE_KERNEL", "").lower() != "torch" and _triton_installed()


@functools.cache
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def masked_dense_attention(q: torch.Tensor, kv: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Reference: attention of q [T, H_q, D] over *all* of kv [S, 2, G, D] with a boolean mask
    allowed [T, S] (already causal). Returns [T, H_q, D]."""
    return softmax_attention(q, kv[:, 0], kv[:, 1], allowed)


def softmax_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Exact softmax attention, q [T, H_q, D], k/v [L, G, D], mask [T, L] -> [T, H_q, D]."""
    qt = q.transpose(0, 1).unsqueeze(0)  # [1, H_q, T, D]
    kt = k.transpose(0, 1).unsqueeze(0)  # [1, G, L, D]
    vt = v.transpose(0, 1).unsqueeze(0)
    out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])
    return out[0].transpose(0, 1)
