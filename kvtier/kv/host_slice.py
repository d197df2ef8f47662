"""The host-tier storage of one streamed (layer, group) slice: a list of extents."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch

from kvtier.attention.interface import ExtentKeys
from kvtier.kv.streams import Event
from kvtier.kv.tiers import HostArena

# A read copies a run of memory-adjacent extents in pieces of at most this many bytes. A packed
# slice reserves its rows' 16 MiB extents in one go (`kvtier.kv.packed`), consecutive rows of a
# slab, so its loads take a quarter of the copies (the host issues each: ~20 per layer at 512K),
# none larger than the lossless tier's 64 MiB extents, whose copies this leaves as they were.
MERGED_READ_BYTES = 64 << 20


class HostSlice:
    """Tokens of one slice in host memory, `[tokens, 2, group_size, head_dim]` split into extents
    of `extent_tokens` tokens. Grows by extents; never copies what it already holds.
    """

    def __init__(self, arena: HostArena, extent_tokens: int) -> None:
        self.arena = arena
        self.extent_tokens = extent_tokens
        self.extents: list[torch.Tensor] = []  # each [E, 2, G, D]
        self.last_write: Event | None = None  # the D2H copy that wrote the newest tokens
        # (extents seen, their starts for host_gather on the GPU): rebuilt when extents change
        self._offsets: tuple[tuple[object, ...], torch.Tensor] | None = None

    @property
    def capacity(self) -> int:
        return len(self.extents) * self.extent_tokens

    def extents_for(self, tokens: int) -> int:
        """Extents `reserve(tokens)` would take from the arena."""
        return max(0, -(-tokens // self.extent_tokens) - len(self.extents))

    def reserve(self, tokens: int) -> None:
        while self.capacity < tokens:
            self.extents.append(self.arena.take())

    def _pieces(self, start: int, end: int) -> list[tuple[int, int, int, int]]:
        """(extent, offset in extent, offset in range, length) covering tokens [start, end)."""
        out = []
        pos = start
        while pos < end:
            e, off = divmod(pos, self.extent_tokens)
            n = min(end - pos, self.extent_tokens - off)
            out.append((e, off, pos - start, n))
            pos += n
        return out

    def _ring(self) -> int:
        """Token t lives in extent (t // extent_tokens) % ring (here every extent: no wrap)."""
        return len(self.extents)

    def views(self, start: int, end: int) -> list[torch.Tensor]:
        """Views of the extents holding tokens [start, end), in order (each [n, 2, G, D], contiguous)."""
        return [self.extents[e][off : off + n] for e, off, _, n in self._pieces(start, end)]

    def write(self, start: int, src: torch.Tensor) -> None:
        """Copy src [n, 2, G, D] (any device) to tokens [start, start + n). Asynchronous on CUDA."""
        for e, off, at, n in self._pieces(start, start + src.shape[0]):
            self.extents[e][off : off + n].copy_(src[at : at + n], non_blocking=True)

    def read_into(self, dst: torch.Tensor, start: int, end: int) -> None:
        """Copy tokens [start, end) into dst[: end - start], one copy per run of memory-adjacent
        extents (`runs`). Asynchronous on CUDA."""
        for src, at, n in self.runs(start, end):
            dst[at : at + n].copy_(src, non_blocking=True)

    def runs(
        self, start: int, end: int, limit: int = MERGED_READ_BYTES
    ) -> list[tuple[torch.Tensor, int, int]]:
        """(source view, offset in range, tokens) covering tokens [start, end): `_pieces`, with
        a piece that starts where the previous one ends in memory (its extent the next row of the
        same slab) joined to it while the view stays within `limit` bytes."""
        out: list[tuple[torch.Tensor, int, int]] = []
        for e, off, at, n in self._pieces(start, end):
            piece = self.extents[e][off : off + n]
            if out:
                src, at0, n0 = out[-1]
                row = src.stride(0) * src.element_size()
                if (
                    (n0 + n) * row <= limit
                    and piece.untyped_storage().data_ptr() == src.untyped_storage().data_ptr()
                    and piece.data_ptr() == src.data_ptr() + n0 * row
                    and piece.stride() == src.stride()
                ):
                    joined = src.as_strided((n0 + n, *src.shape[1:]), src.stride(), src.storage_offset())
                    out[-1] = (joined, at0, n0 + n)
                    continue
            out.append((piece, at, n))
        return out

    def read_runs_into(self, dst: torch.Tensor, spans: list[tuple[int, int, int]]) -> None:
        """Copy tokens [start, end) of each (start, end, at) span into dst[at : at + end - start]
        (a refresh of a HiP block cache reads hundreds of short runs). Into a GPU from pinned
        extents: one kernel reads them all over PCIe (`kvtier.kv.host_gather`); otherwise every
        piece in one `_foreach_copy_`. Asynchronous on CUDA."""
        if dst.is_cuda and self.extents and self.extents[0].is_pinned() and dst.is_contiguous():
            from kvtier.kv import host_gather

            offsets = self._extent_offsets(dst.device)
            host_gather.gather_runs(self.extents, offsets, self.extent_tokens, spans, dst, self._ring())
            return
        dsts, srcs = [], []
        for start, end, at in spans:
            for e, off, rel, n in self._pieces(start, end):
                dsts.append(dst[at + rel : at + rel + n])
                srcs.append(self.extents[e][off : off + n])
        if dsts:
            torch._foreach_copy_(dsts, srcs, non_blocking=True)

    def read_keys_into(self, dst: torch.Tensor, start: int, end: int) -> None:
        """Copy the keys of tokens [start, end) (each row's first half) into dst[: end - start]
        ([n, G, D]). Into a GPU from pinned extents: one kernel reads only those bytes over
        PCIe (`kvtier.kv.host_gather`); otherwise strided copies. Asynchronous on CUDA."""
        if dst.is_cuda and self.extents and self.extents[0].is_pinned() and dst.is_contiguous():
            from kvtier.kv import host_gather

            host_gather.gather_runs(
                self.extents, self._extent_offsets(dst.device), self.extent_tokens, [(start, end, 0)], dst,
                self._ring(), keys=True,
            )  # fmt: skip
            return
        for e, off, at, n in self._pieces(start, end):
            dst[at : at + n].copy_(self.extents[e][off : off + n, 0], non_blocking=True)

    def mapped(self, device: torch.device) -> tuple[tuple[torch.Tensor, ...], torch.Tensor, int] | None:
        """Where a kernel on `device` reads these extents in place: (extents, each one's start as
        an element offset from the first's on `device`, the ring: token t is in extent
        (t // extent_tokens) % ring). None where a GPU cannot map them (not pinned) or there are
        none. The CPU reads any (Triton's interpreter)."""
        if not self.extents or (device.type == "cuda" and not self.extents[0].is_pinned()):
            return None
        return tuple(self.extents), self._extent_offsets(device), self._ring()

    def key_extents(
        self, length: int, device: torch.device, on_read: Callable[[int], None] | None = None
    ) -> ExtentKeys | None:
        """The keys of the first `length` tokens where a kernel on `device` reads them in place
        (`ExtentKeys` of these token rows [E, 2, G, D]), or None (`mapped`)."""
        where = self.mapped(device)
        if where is None:
            return None
        extents, offsets, ring = where
        _, _, heads, head_dim = extents[0].shape
        return ExtentKeys(
            extents, offsets, self.extent_tokens, ring, length, device, heads, head_dim, extents[0].dtype,
            on_read=on_read,
        )  # fmt: skip

    def read_pages_into(
        self, dst: torch.Tensor, pages: torch.Tensor, counts: torch.Tensor, page: int
    ) -> None:
        """Copy the first counts[k] tokens of page pages[k] (tokens pages[k] * page on, stored)
        into dst[k * page :] for every k ([K] int64 each, on dst's device; counts <= page); the
        other rows of dst are zeroed. Into a GPU from pinned extents: one kernel over tiles built
        on the GPU, so the host never reads which pages or how many (no sync); otherwise the
        rows are gathered on the host. Asynchronous on CUDA."""
        if dst.is_cuda and self.extents and self.extents[0].is_pinned() and dst.is_contiguous():
            from kvtier.kv import host_gather

            dst.zero_()
            tiles = host_gather.page_tiles(pages, counts, page)
            host_gather.gather_tiles(
                self.extents, self._extent_offsets(dst.device), self.extent_tokens, tiles, dst, self._ring()
            )
            return
        i = torch.arange(page)
        filled = (i[None, :] < counts.cpu()[:, None]).flatten()  # [K * page] rows that are copied
        rows = filled.nonzero().flatten()
        positions = (pages.cpu()[:, None] * page + i).flatten()[rows]
        n = rows.shape[0]
        prefix = n == 0 or (int(rows[-1]) == n - 1 and bool((positions[1:] > positions[:-1]).all()))
        if prefix and dst.device.type == "cpu":
            # NOTE: the usual case (ascending whole pages, a partial last one): read in place
            self.gather_into(dst, positions)
            dst[n:].zero_()
            return
        order = torch.argsort(positions)  # `gather_into` takes sorted positions
        got = torch.empty((n, *dst.shape[1:]), dtype=dst.dtype)
        self.gather_into(got, positions[order])
        dst.zero_()
        dst[rows[order].to(dst.device)] = got.to(dst.device)

    def _extent_offsets(self, device: torch.device) -> torch.Tensor:
        """`host_gather.extent_offsets` of the extents on `device`, rebuilt when they change."""
        from kvtier.kv import host_gather

        key = (len(self.extents), self.extents[0].data_ptr(), self.extents[-1].data_ptr(), device)
        if self._offsets is None or self._offsets[0] != key:
            self._offsets = (key, host_gather.extent_offsets(self.extents, device))
        return self._offsets[1]

    def gather_into(self, dst: torch.Tensor, positions: torch.Tensor) -> None:
        """Copy the tokens at `positions` ([n] int64, CPU, sorted) into dst[:n] (CPU). Synchronous:
        the caller must make sure no copy into these tokens is still in flight."""
        e = self.extent_tokens
        bounds = torch.searchsorted(positions, torch.arange(0, len(self.extents) + 1) * e).tolist()
        for i, (a, b) in enumerate(itertools.pairwise(bounds)):
            if b > a:
                torch.index_select(self.extents[i], 0, positions[a:b] - i * e, out=dst[a:b])

    def block(self, index: int, block_size: int) -> torch.Tensor:
        """View of token block `index` ([block_size, 2, G, D]); extents hold whole blocks."""
        start = index * block_size
        e, off = divmod(start, self.extent_tokens)
        return self.extents[e][off : off + block_size]
