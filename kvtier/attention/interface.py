"""The one narrow interface between the model and the KV cache.

The model computes q, k, v for the tokens of a step and hands them to an `Attention`; the
attention owns positions, RoPE and the cache. Everything that decides where KV lives or which
keys are read (offload, sparsity, quantization, eviction) sits behind this interface, so the
model code never changes for them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Protocol, runtime_checkable

import torch

from kvtier.attention.spec import PLAIN, LayerAttention


class Attention(Protocol):
    """Attention of one step (a prefill chunk or a decode token) over the cached context."""

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Attend the step's queries to the cache of `layer` plus the step's own keys.

        q: [T, H_q, D], k and v: [T, H_kv, D], all *before* RoPE; the implementation rotates
        them at the positions of the current step. Mutates the cache: the step's k and v are
        appended to layer `layer`. Returns the attention output [T, H_q, D].
        """
        ...


@dataclass(frozen=True)
class SliceStep:
    """Where a slice kernel runs: slice (layer, group), the step's first token index, and how
    the layer scores its keys (a kernel that is not exact for a spec other than `PLAIN` must not
    be given one: the store refuses such combinations)."""

    layer: int
    group: int
    start: int  # tokens stored before this step; the step's own tokens are kv[start:]
    attn: LayerAttention = PLAIN


class SliceKernel(Protocol):
    """Attention of one step's queries over one slice's KV, inside the KV store.

    This is where attention methods plug in (dense by default; sparse or query-aware selection
    as alternatives): the store hands over q [T, H_q_group, D] and the slice's KV
    kv [start + T, 2, G, D], token-major, with the step's own K/V already written at the end.
    Must not mutate kv. Returns [T, H_q_group, D].
    """

    def __call__(self, q: torch.Tensor, kv: torch.Tensor, step: SliceStep) -> torch.Tensor: ...


@dataclass(frozen=True)
class ExtentKeys:
    """The stored keys [length, G, D] of a streamed slice where they lie: its host tier's pinned
    extents, for a GPU kernel to read in place over PCIe (pinned memory is mapped into the GPU's
    address space), only the rows it needs (`Fetch.key_extents`). Full precision (`bits` 0):
    extents [E, 2, heads, D] (a token's row holds its K, then its V); KIVI (`bits` 2, 4 or 8,
    `kvtier.policies.quant.KiviCodec`): extents [E / group, row bytes] uint8 of packed rows of
    `group` tokens. Token p lies in extent (p // extent_tokens) % ring, whose start is
    offsets[that] elements from extents[0]'s; `head`: one of the slice's KV heads (G = 1), else
    all of them (G = heads)."""

    extents: tuple[torch.Tensor, ...]
    offsets: torch.Tensor  # [len(extents)] int64 on `device`
    extent_tokens: int
    ring: int
    length: int
    device: torch.device  # where the reading kernel runs
    heads: int  # KV heads in a token's row
    head_dim: int
    dtype: torch.dtype  # the keys' (KIVI: what the rows unpack to)
    head: int | None = None
    on_read: Callable[[int], None] | None = None  # bytes a kernel read, for the slice's PCIe count
    bits: int = 0
    group: int = 1

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.length, 1 if self.head is not None else self.heads, self.head_dim))

    @property
    def row_elements(self) -> int:
        """Full precision: elements from one token's row to the next (2 * heads * D)."""
        return 2 * self.heads * self.head_dim

    @property
    def first_element(self) -> int:
        """Full precision: element of a row where the (first) key read starts: its head's."""
        return (self.head or 0) * self.head_dim

    @property
    def extent_rows(self) -> int:
        """KIVI: packed rows an extent."""
        return self.extent_tokens // self.group

    @property
    def row_bytes(self) -> int:
        """KIVI: bytes from one packed row to the next."""
        return self.extents[0].shape[1]

    @property
    def key_code_bytes(self) -> int:
        """KIVI: bytes of a row's key codes (its value codes follow, then the parameters)."""
        return self.group * self.heads * self.head_dim * self.bits // 8

    @property
    def code_bytes(self) -> int:
        """KIVI: bytes of one key's codes of one KV head."""
        return self.head_dim * self.bits // 8

    @property
    def probe_bytes(self) -> int:
        """Bytes read for one key of one KV head: its elements, or its codes and fp16 minima
        and steps."""
        if self.bits:
            return self.code_bytes + 2 * 2 * self.head_dim
        return self.head_dim * self.dtype.itemsize

    def of_head(self, head: int) -> ExtentKeys:
        """KV head `head` of the slice alone."""
        return replace(self, head=head)


class Fetch(Protocol):
    """Reads stored tokens of one streamed slice into GPU memory, on the compute stream.

    `fetch(start, end)` -> kv [end - start, 2, G, D]: tokens [start, end).
    `fetch.runs(spans, out)`: tokens [start, end) of each (start, end, at) span copied into
    out[at : at + end - start] (out [n, 2, G, D] on the device), all spans in one call.
    `fetch.keys(start, end)` -> k [end - start, G, D]: the keys alone of tokens [start, end).
    `fetch.pages(pages, counts, page)` -> kv [K * page, 2, G, D]: the first counts[k] tokens of
    page pages[k] (pages of `page` tokens) at rows k * page on, zeros elsewhere (pages, counts
    [K] int64 on the device); which pages and how many are never read on the host (no sync).
    `fetch.key_extents(end)` -> the stored keys of tokens [0, end) where a GPU kernel reads them
    in place (after the host tier's pending writes), or None where it cannot (rows it cannot
    decode, unpinned memory).
    """

    def __call__(self, start: int, end: int) -> torch.Tensor: ...

    def keys(self, start: int, end: int) -> torch.Tensor: ...

    def runs(self, spans: list[tuple[int, int, int]], out: torch.Tensor) -> None: ...

    def pages(self, pages: torch.Tensor, counts: torch.Tensor, page: int) -> torch.Tensor: ...

    def key_extents(self, end: int) -> ExtentKeys | None: ...


@runtime_checkable
class PrefillAwareKernel(Protocol):
    """A slice kernel holding GPU memory for decode steps only (caches, gathered rows) that it
    rebuilds after a prefill step anyway: the store calls `begin_prefill` before every step of
    more than one token, so that memory is free while the chunk's activations are live."""

    def begin_prefill(self) -> None: ...


Alloc = Callable[[tuple[int, ...], torch.dtype], torch.Tensor]
"""Uninitialised device tensors of (shape, dtype) from memory someone else owns and frees whole
(`kvtier.kv.device_memory.DeviceMemory.empty`)."""


@runtime_checkable
class PlacesCaches(Protocol):
    """A slice kernel whose decode caches may live in the memory the store was given (a server's
    lent pool pages) instead of the caching allocator: the store hands it `alloc` once, after
    its own buffers; the kernel then allocates its caches there once and keeps them across
    prefill steps (a region frees nothing one by one)."""

    def place_caches(self, alloc: Alloc) -> None: ...


@runtime_checkable
class ReplaysGraphs(Protocol):
    """A slice kernel that may replay its decode steps as CUDA graphs on its own (HiP's,
    `KVTIER_HIP_GRAPHS`): `allow_graphs(False)`, right after it is made, keeps the default
    ("auto") from doing so where the caller has not measured it (a server's requests)."""

    def allow_graphs(self, allowed: bool) -> None: ...


@runtime_checkable
class CachingSliceKernel(Protocol):
    """A slice kernel that keeps what it needs of a *streamed* slice on the GPU between steps.

    Before each step the store asks `needs_slice`; when True the slice is streamed in whole and
    the kernel is called as a plain `SliceKernel` (and may refresh its cache from that kv). When
    False nothing is streamed: `attend_cached` gets the step's queries and own K/V
    kv_new [T, 2, G, D], and reads any stored tokens it lacks through `fetch` (only those cross
    PCIe). The answer must depend only on the kernel's state before the step and `step`.
    """

    def __call__(self, q: torch.Tensor, kv: torch.Tensor, step: SliceStep) -> torch.Tensor: ...

    def needs_slice(self, step: SliceStep, n_new: int) -> bool: ...

    @property
    def decode_streams(self) -> bool:
        """Whether a decode step may still need a slice whole (False: decode never streams, so
        the store may free its staging buffers while it decodes)."""
        ...

    def attend_cached(
        self, q: torch.Tensor, kv_new: torch.Tensor, step: SliceStep, fetch: Fetch
    ) -> torch.Tensor: ...


@runtime_checkable
class LayerCachedKernel(Protocol):
    """A `CachingSliceKernel` that may serve a decode step of a whole layer's cached slices at
    once (one launch for what a slice at a time costs several each): `attend_cached_layer`
    returns None, having done nothing, when it cannot, and the store then calls `attend_cached`
    per slice. Its outputs must equal those, bit for bit."""

    def attend_cached_layer(
        self, q: torch.Tensor, kv_new: torch.Tensor, steps: list[SliceStep]
    ) -> torch.Tensor | None: ...


@runtime_checkable
class CountingKernel(Protocol):
    """A slice kernel that reports run-time counters a request's stats carry (`counters()`: a
    JSON-ready dict, read once the request has finished)."""

    def counters(self) -> dict[str, object]: ...


class DenseKernel:
    """Exact causal attention over all stored tokens, scored as the layer's spec says (window,
    soft-capping, scale): the lossless default."""

    def __call__(self, q: torch.Tensor, kv: torch.Tensor, step: SliceStep) -> torch.Tensor:
        from kvtier.attention.dense import attend

        return attend(q, kv, step.attn)
