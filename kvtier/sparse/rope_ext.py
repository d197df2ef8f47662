"""Context extension: where RoPE puts queries and keys inside the sparse kernel.

With `HipConfig.extend` the store keeps K and Q un-rotated and the kernel rotates them at
remapped positions, so no query-key distance ever exceeds what the model saw in training:

Pruning (scoring a chunk's probe keys against a block of queries), `scoring_rope`:
    "relative"       left-branch probes at position 0, right-branch probes at 1, every query at
                     window + 1: each probe is scored at a fixed distance just beyond the window
                     (the paper's RT, its default for layers >= 4).
    "chunk_indexed"  every key of chunk j (in the stage's candidate list) at position j, queries at
                     min(true position, n_chunks + window): older chunks look farther away, one
                     position per chunk (CI, the default in the first 4 layers).
    "absolute"       true positions (no extension).

Attention (the final softmax over sink + selected + window), `attention_rope`:
    "streaming"      StreamingLLM-style: the window keeps its true positions and the sinks and
                     selected keys are packed, in order, right below the window, so a block's keys
                     have contiguous positions ending at the query's. When nothing was pruned this
                     *is* the true positions.
    "absolute"       true positions.
"""

from __future__ import annotations

import torch

from kvtier.attention.interface import Alloc
from kvtier.model.layers import use_fused
from kvtier.model.rope import Rotary


def rotate(rotary: Rotary, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """x [N, H, D] rotated at `positions` [N] (any integer positions, in x's dtype)."""
    cos, sin = rotary.cos_sin(positions, x.dtype)
    return Rotary.apply(x, cos, sin)


HALF_ROWS = 256  # rows from which `rotate` takes `Rotary.apply_half` on the torch path
TABLE_STEP = 65536  # positions: the table grows in whole steps, and is computed one step at a time


def table_positions(context: int) -> int:
    """Positions a `RopeTable` holds once it has served `context` positions (at most)."""
    return -(-(context + context // 4) // TABLE_STEP) * TABLE_STEP


def table_bytes(context: int, head_dim: int, dtype_bytes: int) -> int:
    """GPU bytes of a `RopeTable` (cos and sin) that has served `context` positions."""
    return 2 * table_positions(context) * head_dim * dtype_bytes


class RopeTable:
    """cos/sin of every position up to the longest seen, computed once and indexed per call.

    Gives the same values as `Rotary.cos_sin` (same float32 computation, elementwise), without
    recomputing cos and sin for every query block. Grows by a quarter (in whole `TABLE_STEP`s),
    computing `TABLE_STEP` positions at a time, so growing at 512K tokens does not need GBs of
    float32 temporaries (it ran a 24 GB H200 out of memory when it doubled in one piece).
    Mutates only itself.
    """

    def __init__(self, rotary: Rotary) -> None:
        self.rotary = rotary
        self._cos = self._sin = torch.empty(0, rotary.head_dim)
        self._dtype: torch.dtype | None = None
        self._alloc: Alloc | None = None  # the store's memory (`place`)
        self._placed = 0  # positions the placed table holds (0: none placed yet)

    def place(self, alloc: Alloc, positions: int) -> None:
        """Take the table from `alloc` (the store's memory), once, at `positions` rows (a
        request's `table_positions`), computed whole when first used; past them it grows from
        the caching allocator as before."""
        self._alloc, self._placed = alloc, positions

    def rotate(self, x: torch.Tensor, positions: torch.Tensor, limit: int | None = None) -> torch.Tensor:
        """x [N, H, D] rotated at `positions` [N] (non-negative integers), in x's dtype.

        `limit`: a bound the caller knows (every position < limit), so the table is sized
        without reading positions back to the host (a sync on the GPU). None: read their max.
        """
        n = limit if limit is not None else int(positions.max()) + 1 if positions.numel() else 0
        self._grow(n, x)
        if use_fused(x, self._cos) or x.shape[-1] % 2 or x.shape[0] < HALF_ROWS:
            return Rotary.apply(x, self._cos[positions], self._sin[positions])
        half = x.shape[-1] // 2  # the tables repeat each half: gather the first only
        return Rotary.apply_half(x, self._cos[:, :half][positions], self._sin[:, :half][positions])

    def rotate_at(self, x: torch.Tensor, position: int) -> torch.Tensor:
        """x [1, H, D] rotated at one host-known `position`: the table rows are views, so this
        launches only RoPE's arithmetic. Same values as `rotate(x, tensor([position]))`."""
        self._grow(position + 1, x)
        return Rotary.apply(x, self._cos[position : position + 1], self._sin[position : position + 1])

    def rotate_at_index(self, x: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """`rotate_at` with the position [1] int64 read on the device, not the host (a CUDA graph
        replays it at each step's position): the table must already cover it in x's dtype
        (`tables`). Same values as `rotate_at`: the same rows, gathered instead of sliced."""
        return Rotary.apply(x, self._cos.index_select(0, position), self._sin.index_select(0, position))

    def tables(self, limit: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The cos and sin rows [P, D] (P >= limit) in like's dtype, for kernels that rotate by
        position themselves. Valid until the table next grows."""
        self._grow(limit, like)
        return self._cos, self._sin

    def _grow(self, n: int, x: torch.Tensor) -> None:
        """Make the table cover positions < n in x's dtype (recomputed on growth; mutates)."""
        if n > self._cos.shape[0] or self._dtype != x.dtype:
            old = self._cos.shape[0] if self._dtype == x.dtype else 0
            size = table_positions(max(n, old + 1))
            self._cos = self._sin = torch.empty(0, self.rotary.head_dim)  # free the old table first
            if self._alloc is not None and n <= self._placed:
                size = self._placed
                cos = self._alloc((size, self.rotary.head_dim), x.dtype)
                sin = self._alloc((size, self.rotary.head_dim), x.dtype)
                self._alloc = None  # NOTE: once: the store's memory frees nothing piecewise
            else:
                cos = torch.empty(size, self.rotary.head_dim, dtype=x.dtype, device=x.device)
                sin = torch.empty_like(cos)
            for a in range(0, size, TABLE_STEP):
                b = min(a + TABLE_STEP, size)
                cos[a:b], sin[a:b] = self.rotary.cos_sin(torch.arange(a, b, device=x.device), x.dtype)
            self._cos, self._sin, self._dtype = cos, sin, x.dtype


def probe_positions(mode: str, side: int, chunk_index: torch.Tensor, true_pos: torch.Tensor) -> torch.Tensor:
    """Positions of probe keys [C] while scoring: side 0 = left branch, 1 = right branch.

    `chunk_index` [C] is each probe's chunk index in the stage's candidate list, `true_pos` [C]
    its position in the sequence.
    """
    if mode == "relative":
        return torch.full_like(true_pos, side)
    if mode == "chunk_indexed":
        return chunk_index
    return true_pos


def scoring_query_position(mode: str, true_pos: torch.Tensor, window: int, n_chunks: int) -> torch.Tensor:
    """Positions [Nq] of the (pooled) queries while scoring chunks."""
    if mode == "relative":
        return torch.full_like(true_pos, window + 1)
    if mode == "chunk_indexed":
        return true_pos.clamp(max=n_chunks + window)
    return true_pos


def attention_key_positions(
    mode: str, prefix: torch.Tensor, window_start: int, window_end: int
) -> torch.Tensor:
    """Positions of a block's attended keys: `prefix` [P] (sinks + selected, sorted) then the
    window [window_start, window_end). Returns [P + window_end - window_start]."""
    window_end = max(window_end, window_start)  # an empty window
    if mode == "streaming":  # the prefix packed right before the window: one run (one launch)
        return torch.arange(window_start - prefix.numel(), window_end, device=prefix.device)
    return torch.cat((prefix, torch.arange(window_start, window_end, device=prefix.device)))
