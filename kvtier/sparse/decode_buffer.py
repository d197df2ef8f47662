"""The keys and values one HiP decode query attends, gathered once and kept between steps.

Between recomputations of the pruning stages a decode query attends the same sinks and selected
keys, and a window [w0, query] whose start stays put (see `kvtier.sparse.kernel`): each step only
adds the new token. `AttendBuffer` keeps those rows gathered, keys already rotated at their
attention positions, so such a step appends one row and runs one attention over a contiguous
prefix of the buffer (O(1) launches) instead of re-gathering and re-rotating ~3.3K keys:

    k, v  [cap, G, D]   [ sinks | selected ][ window w0 .. last token ][ free ...       ]
                         0 .. n_prefix        n_prefix .. length         length .. cap

NOTE: rows are copied bit for bit and rotated by the same elementwise RoPE as a fresh gather, and
the attention takes the same [1, L] all-true mask, so a step served by `append` computes exactly
what `rebuild` (the gather of `attend_block_reference`) would.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import cast

import torch

from kvtier.sparse.block_sparse import softmax_attention, use_triton
from kvtier.sparse.gpu_cache import PositionedKV
from kvtier.sparse.rope_ext import RopeTable, attention_key_positions

# A whole slice [S, 2, G, D], or the rows of it a cached decode step reads.
KV = torch.Tensor | PositionedKV


def buffer_kernel(q: torch.Tensor) -> bool:
    """Whether decode queries like q attend their buffers with `attend_buffers_triton` (CUDA,
    Triton importable) rather than torch's attention, one buffer at a time."""
    return q.is_cuda and use_triton()


class AttendBuffer:
    """Gathered (and rotated) keys and values of one decode query's attention; mutable.

    `end` is the number of slice positions the buffer covers (the last query + 1); a step whose
    query is at `end` may `append`, any other must `rebuild`. `placed`: keys and values
    [rows, G, D] in the store's memory (`HipKernel.place_caches`), used while they hold enough
    rows; past them the buffer grows from the caching allocator.
    """

    def __init__(self, placed: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        self._placed = placed
        self.k: torch.Tensor | None = None  # [cap, G, D] keys at their attention positions
        self.v: torch.Tensor | None = None  # [cap, G, D]
        self.mask: torch.Tensor | None = None  # [1, cap] all true (what the reference masks)
        self.n_prefix = 0
        self.length = 0
        self.end = -1

    @property
    def capacity(self) -> int:
        return 0 if self.k is None else self.k.shape[0]

    def nbytes(self) -> int:
        """Bytes held (keys, values and bookkeeping)."""
        ts = (self.k, self.v, self.mask)
        return sum(t.numel() * t.element_size() for t in ts if t is not None)

    def rebuild(
        self,
        kv: KV,
        prefix: torch.Tensor,
        window_start: int,
        end: int,
        spare: int,
        rotary: RopeTable | None,
        mode: str,
    ) -> None:
        """Gather `prefix` [P] (sorted positions < window_start) and the window [window_start,
        end) from kv [S, 2, G, D] (or a view of it), rotating keys at `attention_key_positions`.
        Keeps room for `spare` more rows. Mutates the buffer."""
        window_start = min(window_start, end)
        idx = torch.cat((prefix, torch.arange(window_start, end, device=prefix.device)))  # [L]
        rows = cast(torch.Tensor, kv)[idx]  # [L, 2, G, D]; a view is read by position
        k, v = rows[:, 0], rows[:, 1]  # [L, G, D]
        if rotary is not None:
            k = rotary.rotate(k, attention_key_positions(mode, prefix, window_start, end), limit=end)
        n = idx.shape[0]
        # NOTE: rows grow by one a step between refreshes, so asking for n + spare at every
        # rebuild reallocated at nearly each one; room for n is enough, with spare when growing.
        self._reserve(n + 1 if n < self.capacity else n + spare, k, n + 1)
        assert self.k is not None and self.v is not None
        self.k[:n] = k
        self.v[:n] = v
        self.n_prefix = prefix.shape[0]
        self.length = n
        self.end = end

    def rewrite_prefix(
        self,
        kv: KV,
        prefix: torch.Tensor,
        window_start: torch.Tensor,
        rotary: RopeTable | None,
        mode: str,
        limit: int,
    ) -> None:
        """`rebuild`'s prefix rows anew, the window rows kept: what a rerun of stages 1.. changes
        (the window's start moves only when stage 0 reruns). prefix [P] (P == n_prefix) sorted
        positions < window_start; window_start [1] on the device, read there (a CUDA graph
        replays this: `kvtier.sparse.decode_graph`); `limit` bounds every position. The same
        rows as `rebuild`'s, bit for bit. Host state unchanged."""
        n = prefix.shape[0]
        assert self.k is not None and self.v is not None and n == self.n_prefix, "the prefix keeps its size"
        rows = cast(torch.Tensor, kv)[prefix]  # [P, 2, G, D]
        k = rows[:, 0]
        if rotary is not None:  # as `attention_key_positions`: packed before the window, or their own
            at = window_start - n + torch.arange(n, device=prefix.device) if mode == "streaming" else prefix
            k = rotary.rotate(k, at, limit=limit)
        self.k[:n] = k
        self.v[:n] = rows[:, 1]

    def append(self, row: torch.Tensor, position: int, rotary: RopeTable | None) -> None:
        """Add the token row [2, G, D] at `position` == `end` to the window. Mutates the buffer."""
        k = row[0:1]  # [1, G, D]
        if rotary is not None:
            k = rotary.rotate_at(k, position)  # window keys sit at their true positions
        self._put(k, row[1:2], position)

    def step(
        self, q: torch.Tensor, row: torch.Tensor, position: int, rotary: RopeTable | None
    ) -> torch.Tensor:
        """`append(row, position)` then `attend(q, position)`, with the query and the new key
        rotated by one RoPE (both sit at `position`): q [1, H_q, D], row [2, G, D]."""
        return step_buffers([self], q, row[None], position, rotary)

    def _put(self, k: torch.Tensor, v: torch.Tensor, position: int) -> None:
        """Store the rotated key k [1, G, D] and value v [1, G, D] of `position` == `end`."""
        self._room(position)
        assert self.k is not None and self.v is not None
        n = self.length
        self.k[n : n + 1] = k
        self.v[n : n + 1] = v
        self.length = n + 1
        self.end = position + 1

    def _room(self, position: int) -> None:
        """Make room for the row of `position` == `end` (growing the buffer when full)."""
        assert position == self.end, "append adds the next token only"
        if self.length == self.capacity:
            assert self.k is not None
            self._reserve(2 * self.capacity, self.k[:1], self.capacity + 1)

    def attend(self, q: torch.Tensor, position: int, rotary: RopeTable | None) -> torch.Tensor:
        """q [1, H_q, D] (un-rotated when `rotary`) at `position` == end - 1 over every row.

        Returns [1, H_q, D] in q's dtype: the Triton kernel on CUDA (`attend_buffers_triton`,
        as one entry of a batch: the same bits as beside others), else pure torch."""
        assert self.k is not None and self.v is not None and self.mask is not None
        if rotary is not None:
            q = rotary.rotate_at(q, position)
        n = self.length
        if buffer_kernel(q):
            from kvtier.sparse.triton_decode import attend_buffers_triton

            return attend_buffers_triton(q, [self.k], [self.v], [n])
        return softmax_attention(q, self.k[:n], self.v[:n], self.mask[:, :n])

    def _reserve(self, capacity: int, like: torch.Tensor, least: int) -> None:
        """Room for `least` rows shaped like `like`'s [G, D], keeping valid rows: the placed
        rows when they hold that many, else `capacity` rows (>= least) from the allocator."""
        if least <= self.capacity and self.k is not None and self.k.dtype == like.dtype:
            return
        dev = like.device
        placed = self._placed
        if placed is not None and placed[0].dtype == like.dtype and least <= placed[0].shape[0]:
            k, v = placed
            capacity = k.shape[0]
        else:
            k = torch.empty(capacity, *like.shape[1:], dtype=like.dtype, device=dev)
            v = torch.empty_like(k)
        if self.k is not None and self.v is not None and self.k.dtype == like.dtype:
            n = min(self.length, capacity)
            k[:n] = self.k[:n]
            v[:n] = self.v[:n]
        self.k, self.v = k, v
        self.mask = torch.ones(1, capacity, dtype=torch.bool, device=dev)


def step_buffers(
    bufs: list[AttendBuffer], q: torch.Tensor, rows: torch.Tensor, position: int, rotary: RopeTable | None
) -> torch.Tensor:
    """`AttendBuffer.step` of several buffers at one `position` (a layer's decode queries that
    recompute nothing): q [B, H_q, D] (buffer b's query heads), rows [B, 2, G, D] their new
    tokens. Returns [B, H_q, D]; mutates the buffers.

    Every query and new key is rotated by one RoPE (elementwise: the values of rotating each
    buffer's alone); on CUDA the rows are written and all buffers attended in one launch each
    (`attend_buffers_triton`), whose output per buffer does not depend on the others; on the
    CPU each buffer appends and attends as alone."""
    bsz, h = q.shape[0], q.shape[1]
    k, v = rows[:, 0], rows[:, 1]  # [B, G, D]
    if rotary is not None:
        g = k.shape[1]
        both = rotary.rotate_at(
            torch.cat((q.reshape(1, bsz * h, -1), k.reshape(1, bsz * g, -1)), dim=1), position
        )
        q, k = both[0, : bsz * h].view_as(q), both[0, bsz * h :].view_as(k)
    if not buffer_kernel(q):
        outs = []
        for b, buf in enumerate(bufs):
            buf._put(k[b : b + 1], v[b : b + 1], position)
            outs.append(buf.attend(q[b : b + 1], position, None))
        return torch.cat(outs)
    from kvtier.sparse.triton_decode import attend_buffers_triton

    for buf in bufs:
        buf._room(position)
    keys = [cast(torch.Tensor, buf.k) for buf in bufs]
    values = [cast(torch.Tensor, buf.v) for buf in bufs]
    out = attend_buffers_triton(q, keys, values, [buf.length + 1 for buf in bufs], new=(k, v))
    for buf in bufs:
        buf.length += 1
        buf.end = position + 1
    return out


def attend_rebuilt(
    bufs: list[AttendBuffer], q: torch.Tensor, position: int, rotary: RopeTable | None
) -> torch.Tensor:
    """`AttendBuffer.attend` of several buffers at one `position` (a layer's decode queries
    that rebuilt them): q [B, H_q, D] (buffer b's query heads, un-rotated when `rotary`).
    Returns [B, H_q, D]: on CUDA one launch for all (`attend_buffers_triton`, whose output per
    buffer does not depend on the others), else each buffer's own attention."""
    if rotary is not None:
        q = rotary.rotate_at(q.reshape(1, -1, q.shape[-1]), position).view_as(q)
    if not buffer_kernel(q):
        return torch.cat([buf.attend(q[b : b + 1], position, None) for b, buf in enumerate(bufs)])
    from kvtier.sparse.triton_decode import attend_buffers_triton

    keys = [cast(torch.Tensor, buf.k) for buf in bufs]
    values = [cast(torch.Tensor, buf.v) for buf in bufs]
    return attend_buffers_triton(q, keys, values, [buf.length for buf in bufs])


@dataclass
class DecodeState:
    """Cached stage outputs of one (layer, group, head) during decode. Mutable."""

    outputs: list[torch.Tensor]  # per stage: kept positions, sorted
    computed_at: list[int]  # decode step of each stage's last recomputation
    window_start: int  # w0 when stage 0 last ran
    step: int = 0
    position: int = 0  # position of the last decoded query
    attn: AttendBuffer = field(default_factory=AttendBuffer)  # what the query attends, gathered

    def first_due(self, refresh: tuple[int, ...], step_no: int) -> int:
        """The earliest stage due at decode step `step_no` (len(refresh) when none is)."""
        due = [step_no - c >= r for c, r in zip(self.computed_at, refresh, strict=True)]
        return due.index(True) if any(due) else len(due)
