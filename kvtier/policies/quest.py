"""Quest: query-aware page selection at decode (Tang et al. 2024), as a `SliceKernel`.

Per page of `page` tokens the kernel keeps channel-wise key minima m and maxima M (post-RoPE).
A decode query q scores each page with the upper bound of q.k over its keys,

    U(page) = sum_i max(q_i * m_i, q_i * M_i)

and attends only to the top `max(3, budget // page)` pages, per query head. Prefill steps and the
first `dense_layers` layers are dense; a context within the budget is dense (bitwise equal).

A decode step reads only the union of the pages its query heads select (each head masked to its
own): a gather in GPU memory for a resident slice; for an *offloaded* slice Quest is a
`CachingSliceKernel` that keeps the page minima and maxima (and the keys of the unfinished page)
on the GPU and has the GPU read the selected pages from pinned host memory (`Fetch.pages`), so
PCIe carries the selection, not the context. A step's shapes do not depend on the selection
(`_gathered`), so nothing is read back to the host.
`read_tokens / total_tokens` counts the (query head, token) pairs attended. Page metadata is
cached per slice for full pages (tokens are append-only under Quest), in one buffer a slice of
the request's capacity when that is known: allocated once, filled in place, and taken from the
store's memory when it hands the kernel one (`place_caches`: a server's lent pool pages).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from kvtier.attention.dense import attend
from kvtier.attention.interface import Alloc, Fetch, SliceStep
from kvtier.config import ModelConfig
from kvtier.errors import ConfigError

DENSE_LAYERS = 2  # the first layers attend densely and keep no page bounds (the paper's)
# Decode steps in shapes independent of the pages chosen (`QuestKernel.fixed_shapes`; None: on
# CUDA). `bench/decode_ops.py --fixed-shapes` sets True to count CUDA's path on the CPU.
FIXED_SHAPES: bool | None = None


def bounds_slice_bytes(cfg: ModelConfig, context: int, page: int, group: int, dtype_bytes: int) -> int:
    """Bytes of one slice's page bounds buffer (`group` KV heads) at `context` tokens: a key
    minimum and maximum per page, the last partial one included, per KV head and channel."""
    return 2 * -(-context // page) * group * cfg.head_dim * dtype_bytes  # [2, P, G, D]


def bounded_slices(cfg: ModelConfig, group: int) -> int:
    """Slices that keep page bounds: every KV-head group of the layers past the dense ones."""
    return max(cfg.num_layers - DENSE_LAYERS, 0) * -(-cfg.num_kv_heads // group)


def quest_gpu_bytes(cfg: ModelConfig, context: int, page: int, dtype_bytes: int) -> int:
    """GPU bytes of Quest's page bounds at `context` tokens, resident and streamed slices alike
    (`bounds_slice_bytes` for each KV head of the layers past the dense ones)."""
    return bounded_slices(cfg, 1) * bounds_slice_bytes(cfg, context, page, 1, dtype_bytes)


class QuestKernel:
    """Dense prefill, top-page sparse decode under a token `budget`. `capacity`: the request's
    tokens (prompt plus output), which each slice's page bounds buffer is sized for (None: not
    known; the buffers then double as pages come)."""

    def __init__(
        self, budget: int, page: int = 16, dense_layers: int = DENSE_LAYERS, capacity: int | None = None
    ) -> None:
        if page < 1 or budget < page:
            raise ConfigError(f"--kv-budget {budget} for Quest must be at least one page of {page} tokens")
        self.budget, self.page, self.dense_layers = budget, page, dense_layers
        self._capacity_pages = 0 if capacity is None else -(-capacity // page)
        self._alloc: Alloc | None = None  # the store's memory (`place_caches`; None: the allocator)
        # Per slice: key minima and maxima per page [2, P, G, D] (slot `full` holds the partial
        # last page's while a resident step reads it) and how many full pages they hold.
        self._bounds: dict[tuple[int, int], torch.Tensor] = {}
        self._full: dict[tuple[int, int], int] = {}
        # For offloaded slices: keys of the unfinished last page [n < page, G, D] and the stored
        # length they describe (a cached step needs exactly that length).
        self._tail: dict[tuple[int, int], tuple[torch.Tensor, int]] = {}
        self.total_tokens = 0
        # Decode steps in shapes independent of the pages chosen (no host read; None: on CUDA)
        self.fixed_shapes: bool | None = FIXED_SHAPES
        # (query head, token) pairs attended, and tokens offloaded steps read from host memory:
        # counted on the host where it knows them, else on the device (read by the properties)
        self._counts = {"read": 0, "gathered": 0}
        self._pending: dict[str, list[torch.Tensor]] = {"read": [], "gathered": []}

    @property
    def read_tokens(self) -> int:
        """(query head, token) pairs decode steps attended (reads the device counts: a sync)."""
        return self._total("read")

    @property
    def gathered_tokens(self) -> int:
        """Tokens offloaded (cached) decode steps read from host memory (a sync, as read_tokens)."""
        return self._total("gathered")

    def _fixed(self, q: torch.Tensor) -> bool:
        return q.is_cuda if self.fixed_shapes is None else self.fixed_shapes

    def _count(self, name: str, n: torch.Tensor) -> None:
        """Add a device count without reading it (summed on the device every 256)."""
        pending = self._pending[name]
        pending.append(n)
        if len(pending) >= 256:
            pending[:] = [torch.stack(pending).sum()]

    def _total(self, name: str) -> int:
        pending = self._pending[name]
        if pending:
            self._counts[name] += int(torch.stack(pending).sum())
            pending.clear()
        return self._counts[name]

    def place_caches(self, alloc: Alloc) -> None:
        """Allocate the page bounds' buffers with `alloc` from now on (`PlacesCaches`: the
        store's memory after its own buffers; a server lists them in `Placement.method_buffers`)."""
        self._alloc = alloc

    def clear(self) -> None:
        """Forget every slice's page bounds and drop their buffers."""
        self._bounds.clear()
        self._full.clear()

    def _buffer(self, key: tuple[int, int], keys: torch.Tensor, pages: int) -> torch.Tensor:
        """The slice's bounds buffer [2, >= pages, G, D] (keys: its [n, G, D] rows): allocated at
        the capacity's pages once; past them (an unknown capacity) it doubles, keeping its pages."""
        buf = self._bounds.get(key)
        if buf is not None and buf.shape[1] >= pages:
            return buf
        held = 0 if buf is None else buf.shape[1]
        shape = (2, max(pages, self._capacity_pages, 2 * held), *keys.shape[-2:])
        if self._alloc is not None:
            grown = self._alloc(shape, keys.dtype)
        else:
            grown = torch.empty(shape, dtype=keys.dtype, device=keys.device)
        if buf is not None:
            full = self._full.get(key, 0)
            grown[:, :full].copy_(buf[:, :full])
        self._bounds[key] = grown
        return grown

    def _minmax(self, kv: torch.Tensor, step: SliceStep) -> tuple[torch.Tensor, torch.Tensor]:
        """Key minima and maxima per page, [P, G, D] each (views of the slice's buffer); the
        last page may be partial."""
        key = (step.layer, step.group)
        s, p = kv.shape[0], self.page
        full, pages = s // p, -(-s // p)
        buf = self._buffer(key, kv[:, 0], pages)
        done = self._full.get(key, 0)
        if done < full:
            keys = kv[done * p : full * p, 0].unflatten(0, (-1, p))  # [P', p, G, D]
            buf[0, done:full] = keys.amin(1)
            buf[1, done:full] = keys.amax(1)
            self._full[key] = full
        if s > full * p:
            tail = kv[full * p :, 0]
            buf[0, full], buf[1, full] = tail.amin(0), tail.amax(0)
        return buf[0, :pages], buf[1, :pages]

    def held_bytes(self) -> int:
        """GPU bytes of every slice's page bounds buffer."""
        return sum(b.numel() * b.element_size() for b in self._bounds.values())

    def __call__(self, q: torch.Tensor, kv: torch.Tensor, step: SliceStep) -> torch.Tensor:
        out = self._attend(q, kv, step)
        key = (step.layer, step.group)
        if step.layer >= self.dense_layers:
            self._minmax(kv, step)  # caches the full pages' metadata
            full = kv.shape[0] // self.page
            self._tail[key] = (kv[full * self.page :, 0].clone(), kv.shape[0])
        return out

    def _top_pages(
        self, q: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, pages: int, top_k: int
    ) -> torch.Tensor:
        """Per query head, the `top_k` pages by Quest's bound; the last page always. [G, r, K]"""
        g, d = lo.shape[1], q.shape[-1]
        r = q.shape[1] // g
        qh = q[0].view(g, r, 1, d)  # [G, r, 1, D]
        bound = torch.maximum(qh * lo.permute(1, 0, 2)[:, None], qh * hi.permute(1, 0, 2)[:, None]).sum(-1)
        if bound.shape[-1] < pages:  # the unfinished page has no metadata yet
            bound = torch.cat((bound, bound.new_zeros(g, r, pages - bound.shape[-1])), dim=-1)
        bound[..., pages - 1] = float("inf")  # NOTE: the current token's page is always read
        return bound[..., :pages].topk(top_k, dim=-1).indices

    def _sparse(self, step: SliceStep, s: int) -> tuple[bool, int, int]:
        """Whether a decode step over `s` tokens selects pages, the page count and top_k."""
        pages = -(-s // self.page)
        top_k = min(max(3, self.budget // self.page), pages)
        return step.layer >= self.dense_layers and s > self.budget and top_k < pages, pages, top_k

    @property
    def decode_streams(self) -> bool:
        """Decode steps stream a slice whole when their page bounds need refreshing."""
        return True

    def needs_slice(self, step: SliceStep, n_new: int) -> bool:
        """Offloaded slices: only prefill, dense layers and dense-sized contexts stream whole."""
        tail = self._tail.get((step.layer, step.group))
        sparse = self._sparse(step, step.start + n_new)[0]
        return n_new > 1 or not sparse or tail is None or tail[1] != step.start

    def attend_cached(
        self, q: torch.Tensor, kv_new: torch.Tensor, step: SliceStep, fetch: Fetch
    ) -> torch.Tensor:
        """Decode over an offloaded slice: select pages from the GPU metadata, gather only them."""
        key = (step.layer, step.group)
        full = self._full[key]
        buf = self._bounds[key]
        out, rows = self._gathered(
            q, step, buf[0, :full], buf[1, :full], lambda o, c: fetch.pages(o, c, self.page), kv_new
        )
        self._count("gathered", rows)
        tail, _ = self._tail[key]
        tail = torch.cat((tail, kv_new[:, 0]))
        if tail.shape[0] == self.page:  # the page is complete: its bounds join the others
            buf = self._buffer(key, tail, full + 1)
            buf[0, full], buf[1, full] = tail.amin(0), tail.amax(0)
            self._full[key] = full + 1
            tail = tail[:0]
        self._tail[key] = (tail, step.start + 1)
        return out

    def _gathered(
        self,
        q: torch.Tensor,
        step: SliceStep,
        lo: torch.Tensor,
        hi: torch.Tensor,
        read: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        kv_new: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One decode query over the pages its heads select: q [1, H_q, D], page metadata lo/hi
        [>= start // page, G, D], `read(pages, counts)` -> the first counts[k] stored rows of
        page pages[k] at rows k * page on ([K] int64 each; [K * page, 2, G, D], other rows
        finite), kv_new [1, 2, G, D] the query's own row. Only the union of the heads' pages is
        read, each head masked to its own. Shapes do not depend on which pages were chosen, so
        nothing is read back to the host:

            K = min(complete pages, G * r * (top_k - 1)) union slots, the chosen complete pages
            first (ascending; the rest count 0 rows), then the query's own page (its stored
            tokens; the last page is always chosen) -> K + 1 pages of rows, masked

        (`fixed_shapes`; on the CPU, where reading the union back costs nothing and the padded
        slots would cost work, K is the union's size.)

        Returns [1, H_q, D] and the number of stored rows read (a device count)."""
        s, hq, p = step.start + 1, q.shape[1], self.page
        _, pages, top_k = self._sparse(step, s)
        g = lo.shape[1]
        r = hq // g
        m = step.start // p  # complete pages before the query's (its own is page m = pages - 1)
        top = self._top_pages(q, lo[:m], hi[:m], pages, top_k)  # [G, r, K]
        chosen = torch.zeros(g, r, pages, dtype=torch.bool, device=q.device)
        chosen.scatter_(-1, top, True)
        union = chosen[..., :m].flatten(0, 1).any(0)  # [m] complete pages any head reads
        if self._fixed(q):
            slots = min(m, g * r * (top_k - 1))
            first = torch.sort(union.to(torch.uint8), descending=True, stable=True).indices[:slots]  # [slots]
        else:  # the union itself (a host read: free on the CPU, where fewer rows cost less work)
            first = union.nonzero().flatten()
        # NOTE: torch.full, not new_tensor: a tensor made from host values is a copy that waits
        # for the device on CUDA
        own = torch.full((1,), m, dtype=torch.long, device=q.device)
        order = torch.cat((first, own))  # [slots + 1] pages read
        counts = torch.cat((union[first].long() * p, torch.full_like(own, step.start - m * p)))
        kv = torch.cat((read(order, counts), kv_new))  # [(slots + 1) * p + 1, 2, G, D]
        filled = (torch.arange(p, device=q.device)[None, :] < counts[:, None]).flatten()  # rows read
        page_of = order.repeat_interleave(p)
        mask = (chosen[:, :, page_of] & filled).reshape(1, hq, 1, -1)
        mask = torch.cat((mask, mask.new_ones(1, hq, 1, 1)), dim=-1)  # the query's own row
        self.total_tokens += s * hq
        self._count("read", mask.sum())
        return self._masked(q, kv, mask, r), counts.sum()

    @staticmethod
    def _masked(q: torch.Tensor, kv: torch.Tensor, mask: torch.Tensor, r: int) -> torch.Tensor:
        """One query q [1, H_q, D] over kv [L, 2, G, D] with mask [1, H_q, 1, L] -> [1, H_q, D]."""
        keys = kv[:, 0].repeat_interleave(r, dim=1).transpose(0, 1)[None]  # [1, H_q, L, D]
        values = kv[:, 1].repeat_interleave(r, dim=1).transpose(0, 1)[None]
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys, values, attn_mask=mask)
        return out[0].transpose(0, 1)

    def _attend(self, q: torch.Tensor, kv: torch.Tensor, step: SliceStep) -> torch.Tensor:
        t, hq, _ = q.shape
        s = kv.shape[0]
        pages = -(-s // self.page)
        top_k = min(max(3, self.budget // self.page), pages)
        if step.start == 0:
            self._full.pop((step.layer, step.group), None)  # a new sequence (its buffer stays)
            self._tail.pop((step.layer, step.group), None)
        if t > 1 or step.layer < self.dense_layers or s <= self.budget or top_k >= pages:
            if t == 1:
                self.total_tokens += s * hq
                self._counts["read"] += s * hq
            return attend(q, kv)
        lo, hi = self._minmax(kv, step)
        # A resident slice is read the same way: only the selected pages' rows (a GPU gather; the
        # rows past a page's count are any stored rows, masked).
        last = max(step.start - 1, 0)

        def rows(order: torch.Tensor, _: torch.Tensor) -> torch.Tensor:
            at = order[:, None] * self.page + torch.arange(self.page, device=order.device)
            return kv[at.flatten().clamp(max=last)]

        return self._gathered(q, step, lo, hi, rows, kv[step.start :])[0]
