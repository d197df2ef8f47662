"""`SliceReader`: what a caching slice kernel may read of a streamed slice (`Fetch`).

Ranges are copied extent by extent (packed rows unpacked on the GPU when the host tier is
quantized); runs and pages of scattered tokens are read by one GPU kernel from the pinned
extents (`kvtier.kv.host_gather`), so only they cross PCIe. Every byte sent is counted in the
store's `TierAccount.h2d_bytes`.
"""

from __future__ import annotations

from itertools import pairwise

import torch

from kvtier.attention.interface import ExtentKeys
from kvtier.kv.host_slice import HostSlice
from kvtier.kv.layout import KVLayout
from kvtier.kv.packed import PackedTier
from kvtier.kv.streams import Streams
from kvtier.kv.tiers import TierAccount

# A quantized tier's keys are unpacked with their values: `keys` does it this many pieces a
# range, so the keys and values of one piece, not of the range, are in GPU memory beside the
# keys returned (at 1M tokens int4 a 2-head slice's stage-0 slab of 262,144 tokens read whole
# asked 256 MiB more than the plan's scoring bytes and ran out of memory under 24 GiB).
KEY_PIECES = 8


class SliceReader:
    """Reads the `length` stored tokens of streamed slice `sid` to `device`."""

    def __init__(
        self,
        sid: int,
        host: HostSlice,
        layout: KVLayout,
        length: int,
        *,
        device: torch.device,
        streams: Streams,
        account: TierAccount,
        packed: PackedTier | None,
    ) -> None:
        self.sid, self.host, self.layout, self.length = sid, host, layout, length
        self.device, self.streams, self.account, self.packed = device, streams, account, packed

    def _empty(self, n: int, pin: bool = False, device: torch.device | None = None) -> torch.Tensor:
        lay = self.layout
        shape = (n, 2, lay.group_size, lay.head_dim)
        return torch.empty(shape, dtype=lay.dtype, device=device or self.device, pin_memory=pin)

    def __call__(self, start: int, end: int) -> torch.Tensor:
        """Tokens [start, end) -> [end - start, 2, G, D] on the device."""
        if not 0 <= start <= end <= self.length:
            raise IndexError(f"fetch({start}, {end}) outside the {self.length} stored tokens")
        dst = self._empty(end - start)
        self.streams.wait([self.host.last_write])
        if self.packed is not None:
            self.account.h2d_bytes += self.packed.read_into(
                self.sid, self.host, dst, start, end, scratch=False
            )
        else:
            self.host.read_into(dst, start, end)
            self.account.h2d_bytes += (end - start) * self.layout.token_bytes
        return dst

    def keys(self, start: int, end: int) -> torch.Tensor:
        """The keys of tokens [start, end) -> [end - start, G, D] on the device: only they cross
        PCIe from a full-precision host tier (half the bytes of `__call__`); a quantized tier's
        rows hold keys and values together, so they are read and unpacked whole, `KEY_PIECES`
        pieces a range (the unpacked values of one piece at a time)."""
        if not 0 <= start <= end <= self.length:
            raise IndexError(f"keys({start}, {end}) outside the {self.length} stored tokens")
        lay = self.layout
        dst = torch.empty(end - start, lay.group_size, lay.head_dim, dtype=lay.dtype, device=self.device)
        if self.packed is not None:
            g = self.packed.codec.group
            per = -(-(end - start) // KEY_PIECES)
            piece = max(g, -(-per // g) * g)  # whole rows; pieces start on row bounds
            edges = [start, *range((start // piece + 1) * piece, end, piece), end]
            for lo, hi in pairwise(edges):
                dst[lo - start : hi - start] = self(lo, hi)[:, 0]
            return dst
        self.streams.wait([self.host.last_write])
        self.host.read_keys_into(dst, start, end)
        self.account.h2d_bytes += (end - start) * lay.token_bytes // 2
        return dst

    def key_extents(self, end: int) -> ExtentKeys | None:
        """The stored keys of tokens [0, end) where a GPU kernel reads them in place
        (`ExtentKeys`, after the host's pending writes; what it reads is counted, but not from
        a slice packed on the device), or None: a quantized tier's rows other than KIVI's, an
        `end` past its coded tokens (the rest are in its full-precision tail), or extents a GPU
        cannot map."""
        if self.packed is None:
            keys = self.host.key_extents(self.length, self.device, on_read=self._count)
        elif end <= self.packed.coded:
            count = None if self.sid in self.packed.device_slices else self._count
            keys = self.packed.key_extents(self.sid, self.length, self.device, count)
        else:
            return None
        if keys is not None:
            self.streams.wait([self.host.last_write])
        return keys

    def _count(self, h2d_bytes: int) -> None:
        self.account.h2d_bytes += h2d_bytes

    def runs(self, spans: list[tuple[int, int, int]], out: torch.Tensor) -> None:
        """Tokens [start, end) of each (start, end, at) span into out[at : at + end - start]
        (out [n, 2, G, D] on the device): one wait for the host's writes, then every copy."""
        for start, end, at in spans:
            if not 0 <= start <= end <= self.length or at < 0 or at + end - start > out.shape[0]:
                raise IndexError(
                    f"run ({start}, {end}) at {at}: outside the {self.length} stored tokens "
                    f"or the {out.shape[0]} output rows"
                )
        self.streams.wait([self.host.last_write])
        if self.packed is not None:
            self.account.h2d_bytes += self.packed.read_runs_into(self.sid, self.host, out, spans)
            return
        self.host.read_runs_into(out, spans)
        self.account.h2d_bytes += sum(end - start for start, end, _ in spans) * self.layout.token_bytes

    def pages(self, pages: torch.Tensor, counts: torch.Tensor, page: int) -> torch.Tensor:
        """Pages of `page` tokens -> [K * page, 2, G, D] on the device: the first counts[k] stored
        tokens of page pages[k] at rows k * page on, zeros elsewhere (pages, counts [K] int64 on
        the device). On CUDA the GPU reads them from the pinned extents itself
        (`HostSlice.read_pages_into`): the host never learns which pages or how many, so the
        step does not wait; only their bytes cross PCIe, counted on the device (`add_h2d`)."""
        if self.packed is not None:
            raise NotImplementedError("gathering tokens from a quantized host tier is not supported")
        dst = self._empty(pages.shape[0] * page)
        self.streams.wait([self.host.last_write])  # NOTE: the GPU reads the host's newest rows
        gpu_reads = dst.is_cuda and bool(self.host.extents) and self.host.extents[0].is_pinned()
        if not gpu_reads and self.host.last_write is not None:
            self.host.last_write.synchronize()  # NOTE: the host reads these tokens itself
        self.host.read_pages_into(dst, pages, counts, page)
        self.account.add_h2d(counts.sum() * self.layout.token_bytes)
        return dst
