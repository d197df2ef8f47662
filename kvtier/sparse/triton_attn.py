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

Rotary (context extension, `rotary` given): q is rotated at its true positions in torch. For a
prefill chunk's blocks (`attend_blocks_triton`) the kernel rotates each key tile itself, at
`attention_key_positions(mode, ...)` with the RoPE table's cos/sin and `Rotary.apply`'s rounding
(ROTATE); for one block the keys are gathered and rotated in torch first and read from that
[L, G, D] buffer by list position (K_GATHERED). Values are always read straight from kv by index,
and the causal mask always uses true positions. A decode query's rows kept gathered between
steps (`AttendBuffer`) are attended by `kvtier.sparse.triton_decode`, many buffers a launch.

The kernels themselves are in `kvtier.sparse.triton_attn_kernels`; this module launches them.
`triton` is imported here at module level; `kvtier.sparse.block_sparse` imports this module only
when it dispatches to it, so importing kvtier never needs triton. For CPU tensors set
TRITON_INTERPRET=1 before this module is first imported (Triton's interpreter). Under the
interpreter (Triton 3.6, numpy 2.4) two things differ from the compiled kernel, both behind the
INTERPRET constexpr and sharing the same tile code (`attend_tile`): the key loop is a `while`
(the interpreter cannot take a runtime `range` bound) and the dots take fp32 operands (its bf16
`tl.dot` is wrong).
"""

from __future__ import annotations

import functools
import math
import os

import torch
import triton

from kvtier.attention.fit_shared import launch
from kvtier.sparse.rope_ext import RopeTable, attention_key_positions
from kvtier.sparse.triton_attn_kernels import merge_splits, sparse_attn_fwd

_NO_SPLIT = 1 << 30  # keys_per_split when the key list is not split


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_available(q: torch.Tensor | None = None) -> bool:
    """Whether the Triton kernels can run on q's device: triton imports (true once this module
    is imported) and q is on CUDA or TRITON_INTERPRET=1 (the interpreter takes CPU tensors)."""
    return _interpreting() or (q is not None and q.is_cuda)


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).multi_processor_count)
    return 4  # interpreter: a few splits, so the split path is exercised on CPU too


# (BLOCK_M, BLOCK_N, num_warps, num_stages) instead of `_tiles`' choice (bench/hip_kernels.py)
TILES: tuple[int, int, int, int] | None = None


def _tiles(rows: int, dtype: torch.dtype, d: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for `rows` = Tb * r rows per (block, KV head)."""
    if TILES is not None:
        return TILES
    if dtype != torch.float32 and d <= 128 and rows >= 128:
        # prefill blocks (64 queries x r heads): one program gathers and rotates a key tile for
        # 128-256 rows; 2.5x faster than 64-row programs at 512K (bench/hip_kernels.py)
        if d <= 64 and rows <= 256:
            # small heads (SmolLM2's 192 rows of 64 dims): one 256-row program and 64-key tiles,
            # 1.68-1.79 ms a 16K chunk's layer against 1.73-2.24 on four H100 starts
            # (bench/results/hip_kernels_smollm2_16k_lean*.json, their "tiles" rows)
            return (256, 64, 8, 2)
        return (256, 32, 8, 3) if rows >= 256 else (128, 32, 4, 2)
    block_m = 16 if rows <= 16 else (32 if rows <= 32 else 64)
    block_n = 32 if dtype == torch.float32 or d > 128 else 64
    return block_m, block_n, 4, 3


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
    block_m, block_n, warps, stages = _tiles(tb * r, q.dtype, d)
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
    launch(
        sparse_attn_fwd,
        (grid_m, bsz * g, num_splits),
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
        num_stages=stages,
    )
    if split:
        n = bsz * tb * h_q
        merge_splits[(n,)](part, lse, out, n, num_splits, D=d, SPLITS_P2=triton.next_power_of_2(num_splits))
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
