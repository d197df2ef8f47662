"""Structured synthetic KV: keys shaped like a model's, no repetition, and planted needles.

`kvtier.kv.synthetic` copies one random extent everywhere (enough to time copies and attention);
selection methods (HiP's chunk pruning, Quest's pages, block caches) need KV whose scores mean
something. Here every (layer, KV head, token block) gets its own numbers:

```
 key_pre[t] = mean + (TOPIC * topic[b] + sqrt(1 - TOPIC^2) * coef[t]) @ basis + NOISE * noise[t]
              + strength * sqrt(D) * near(t) * direction
 near(t)    = 1 on a planted needle's tokens, exp(-d / halo) d tokens away from the nearest one
 key[t]     = RoPE(key_pre[t], position t)   if the store keeps rotated keys (`rotate_keys`)
 value[t]   ~ N(0, 1)

 per (layer, KV head)  mean [D]        a bias every key shares (none in the needle channels)
                       basis [rank, D] orthonormal directions, scaled by decaying std
                       direction [D]   unit, in the needle channels, orthogonal to the others
 per token block b     topic [rank]    coefficients a block shares: nearby keys are alike
 per token t           coef [rank], noise [D]
```

The needle channels are the lowest-frequency RoPE pairs that turn at most 1 radian over the
context (at most D/8 pairs, at least 2): a query along `direction` stays aligned with a needle's
key at any distance, as retrieval heads use low-frequency channels. NOTE: when fewer than 2
pairs qualify (a context long for the RoPE base, like one past a model's trained length), far
needles fade under RoPE at true positions; HiP's extension RoPE scores them at short distances.

Numbers are counter-based: each is a hash of (seed, layer, KV head, block, index), so a block is
generated alone, on any device, always the same (up to float rounding across devices); no two
blocks, extents or layers repeat, and a slice's content does not depend on the plan.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from kvtier.kv.store import TieredKVStore
from kvtier.model.rope import Rotary

NOISE = 0.35  # std of a key's isotropic noise, per channel
LOWRANK = 0.25  # std of the first low-rank coefficient, per sqrt(D); the others decay by DECAY
DECAY = 0.75
TOPIC = 0.6  # weight of a block's shared coefficients (correlation TOPIC^2 inside a block)
MEAN = 0.5  # norm of the mean key, per sqrt(D)
NEEDLE = 0.5  # default norm of a needle key's extra component along `direction`, per sqrt(D)
MARGIN = 4.0  # a needle query's logit on a needle, over ln(tokens) (before RoPE's fading)
# Numbers of one kind generated at once: large spans on an accelerator (few launches), cache-sized
# ones on the CPU (measured 3x faster than 4M there).
SPAN_NUMBERS = 1 << 22
CPU_SPAN_NUMBERS = 1 << 17
_MASK = 0xFFFFFFFF
_MUL = 0x45D9F3B  # odd and < 2**27: products of 32-bit values fit int64


@dataclass(frozen=True, eq=False)
class Needles:
    """Needles planted by `fill_structured` and the queries that attend to them.

    `starts` [L, H_kv, N] int64 (CPU): first token of each needle, in ascending order; a needle
    is `length` tokens inside token block `starts // block_size`. `queries` [L, H_kv, D] float32
    (CPU): per KV head, the *pre-RoPE* query along the head's needle direction, scaled so a
    needle key's logit (q.k / sqrt(D)) is ln(position) + MARGIN above the same key without its
    needle component (less as RoPE turns the two apart); at the default strength its dense
    attention puts nearly all its mass on the needles. `position`: where the query is asked,
    the filled token count (the next decode step's position).
    """

    starts: torch.Tensor
    length: int
    block_size: int
    queries: torch.Tensor
    position: int

    @property
    def blocks(self) -> torch.Tensor:
        """The planted token blocks, [L, H_kv, N] int64."""
        return self.starts // self.block_size

    def positions(self, layer: int, head: int) -> torch.Tensor:
        """Every needle token of (layer, KV head), [N * length] int64 ascending."""
        return (self.starts[layer, head, :, None] + torch.arange(self.length)).flatten()

    def query(self, layer: int, q_per_kv: int = 1, rotary: Rotary | None = None) -> torch.Tensor:
        """The queries of a layer as the model's query heads: [1, H_kv * q_per_kv, D] float32.

        `rotary`: rotate them at `position` (for a store that keeps rotated keys); None: pre-RoPE
        (for a store with `rotate_keys=False`, whose kernel applies RoPE).
        """
        q = self.queries[layer].repeat_interleave(q_per_kv, dim=0)[None]  # [1, H_q, D]
        if rotary is None:
            return q
        cos, sin = rotary.cos_sin(torch.tensor([self.position]), torch.float32)
        return Rotary.apply(q.to(rotary.inv_freq.device), cos, sin).cpu()


def fill_structured(
    store: TieredKVStore,
    tokens: int,
    seed: int = 0,
    *,
    needles: int = 4,
    rank: int = 8,
    needle_tokens: int | None = None,
    strength: float = NEEDLE,
    halo: float = 0.0,
    depth: tuple[float, float] = (0.1, 0.9),
) -> Needles:
    """Give every slice `tokens` tokens of structured KV (module docstring); set the store's
    length and position to `tokens`; return the planted needles. Mutates the empty `store`.

    Like `kvtier.kv.synthetic.fill_synthetic`: slices an evictor owns get only the tokens it
    keeps; with a packing codec, coded tokens become packed rows and the rest the full-precision
    tail. A simulated codec (`RoundTripCodec`) rounds the tokens at the store's next `end_step`.
    KV is generated on the store's device, a span of blocks at a time.

    Needles: `needles` runs of `needle_tokens` tokens (None: a whole token block) per (layer,
    KV head), each inside one block, one in each of `needles` equal strata of the whole blocks
    between depths depth[0] and depth[1] of the context. `strength`: the needle component's
    norm per sqrt(D) (against NOISE per channel in other keys); lower is harder to find, and
    the queries grow to keep their logit margin, so dense attention spreads over noise keys.
    `rank`: low-rank directions per head.
    `halo` (tokens): the needle component also fades into the tokens around a needle (attention
    locality, which HiP's bisection relies on); 0: none, a needle is a sharp run of tokens.
    Raises ValueError on a non-empty store or impossible sizes.
    """
    if store.length:
        raise ValueError("fill_structured needs an empty store")
    length = store.layout.block_size if needle_tokens is None else needle_tokens
    src = _Source(store, tokens, seed, needles, rank, length, strength, halo, depth)
    for sid in list(store.resident):
        _fill_resident(store, src, sid, tokens)
    packed = store.packed
    if packed is not None:
        packed.reserve(store.layout.round_up(tokens))
    for sid in store.hosts:
        _fill_staged(store, src, sid, tokens)
    if packed is not None:
        packed.coded = store._coded = packed.codec.frozen_tokens(tokens)
    if store.device.type == "cuda":
        torch.cuda.synchronize(store.device)  # NOTE: host writes are asynchronous
    store.length = store.position = tokens
    return src.needles


def _fill_resident(store: TieredKVStore, src: _Source, sid: int, tokens: int) -> None:
    lay = store.layout
    layer, group = divmod(sid, lay.num_groups)
    keep, n = None, tokens
    if store.evictor is not None and sid in store._evictable:
        keep = store.evictor.keep(sid, tokens, tokens)  # [G, K] or None
        n = tokens if keep is None else keep.shape[1]
        store._resize_slice(sid, lay.round_up(n + lay.block_size))
    buf = store.resident[sid]  # [capacity, 2, G, D]
    if n > buf.shape[0]:
        raise ValueError(f"{n} tokens exceed the resident capacity {buf.shape[0]}")
    if keep is None:
        for a, kv in src.spans(layer, group, tokens):
            buf[a : a + kv.shape[0]] = kv
    else:
        buf[:n] = src.at(layer, group, keep.to(store.device))
    store.slice_length[sid] = n


def _fill_staged(store: TieredKVStore, src: _Source, sid: int, tokens: int) -> None:
    """A slice attended through staging: its host (or on-device) extents, or with a packing
    codec its packed rows [0, coded) and full-precision tail [coded, tokens)."""
    lay, host, packed = store.layout, store.hosts[sid], store.packed
    layer, group = divmod(sid, lay.num_groups)
    host.reserve(lay.round_up(tokens))
    g = 1 if packed is None else packed.codec.group
    coded = 0 if packed is None else packed.codec.frozen_tokens(tokens)
    for a, kv in src.spans(layer, group, tokens, multiple=g):
        b = a + kv.shape[0]
        kv = kv.to(lay.dtype)
        if packed is not None and a < coded:  # NOTE: a and min(b, coded) are multiples of g
            packed.rows[sid].write(a // g, packed.codec.pack(kv[: min(b, coded) - a]))
        if b > coded:
            host.write(max(a, coded), kv[max(a, coded) - a :])
    store.slice_length[sid] = tokens


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A bijective hash of 32-bit values held in int64 (elementwise)."""
    x = ((x >> 16) ^ x) * _MUL & _MASK
    x = ((x >> 16) ^ x) * _MUL & _MASK
    return (x >> 16) ^ x


def _normal(ka: torch.Tensor, kb: torch.Tensor, stream: int, count: int) -> torch.Tensor:
    """`count` standard normals (|z| < 5.3) per key pair: ka, kb [...] int64 -> [..., count] float32.

    Number i of a key pair is hash(hash(ka ^ (stream, i)) ^ kb); `stream` tells kinds apart."""
    c = torch.arange(count, device=ka.device) + (stream << 24)
    v = _mix(_mix(ka[..., None] ^ c) ^ kb[..., None])
    return torch.special.ndtri(((v >> 9).float() + 0.5) * 2.0**-23)  # uniform in (0, 1), 23 bits


@dataclass(frozen=True)
class _Head:
    """Parameters of one (layer, KV head), CPU; stacked for a slice's G heads on its device."""

    lanes: torch.Tensor  # [2] int64: the two 32-bit key lanes every number of the head hashes
    mean: torch.Tensor  # [D]
    basis: torch.Tensor  # [rank, D] orthonormal rows, scaled by their std
    direction: torch.Tensor  # [D] unit, in the needle channels
    starts: torch.Tensor  # [N] int64: first token of each needle


class _Source:
    """The structured KV of one fill: per-head parameters and needles, and KV by token block."""

    def __init__(
        self,
        store: TieredKVStore,
        tokens: int,
        seed: int,
        needles: int,
        rank: int,
        needle_tokens: int,
        strength: float,
        halo: float,
        depth: tuple[float, float],
    ) -> None:
        lay = self.layout = store.layout
        bs, d = lay.block_size, lay.head_dim
        if tokens <= 0 or needles < 0 or not 0 < rank < d or strength <= 0 or halo < 0:
            raise ValueError(
                f"need tokens > 0, needles >= 0, 0 < rank < {d}, strength > 0, halo >= 0: "
                f"{tokens}, {needles}, {rank}, {strength}, {halo}"
            )
        if not 0 < needle_tokens <= bs:
            raise ValueError(
                f"needle_tokens must be in 1..{bs} (a needle lies in one block), got {needle_tokens}"
            )
        first, last = -(-int(depth[0] * tokens) // bs), int(depth[1] * tokens) // bs
        if not 0 <= depth[0] < depth[1] <= 1 or last - first < needles:
            raise ValueError(
                f"{needles} needles need as many whole {bs}-token blocks between depths {depth} of "
                f"{tokens} tokens; there are {max(0, last - first)}"
            )
        self.device = store.device
        self.rotary = store.rotary if store.rotate_keys else None
        inv = store.rotary.inv_freq.cpu()
        order = torch.argsort(inv)  # pairs, lowest frequency first
        pairs = order[: max(2, min(int((inv * tokens <= 1.0).sum()), d // 8))]
        channels = torch.cat((pairs, pairs + d // 2))
        self._heads = [
            [
                _head(
                    seed,
                    layer,
                    h,
                    dim=d,
                    rank=rank,
                    channels=channels,
                    blocks=(first, last),
                    needles=needles,
                    needle_tokens=needle_tokens,
                    block_size=bs,
                )
                for h in range(lay.num_kv_heads)
            ]
            for layer in range(lay.num_layers)
        ]
        self.strength, self.halo = strength, halo
        beta = (math.log(tokens) + MARGIN) / strength  # logit = beta * strength on an aligned needle
        self.needles = Needles(
            starts=torch.stack([torch.stack([h.starts for h in hs]) for hs in self._heads]),
            length=needle_tokens,
            block_size=bs,
            queries=beta * torch.stack([torch.stack([h.direction for h in hs]) for hs in self._heads]),
            position=tokens,
        )

    def _slice_heads(self, layer: int, group: int) -> _Head:
        """The parameters of a slice's KV heads, stacked on a leading [G] axis, on its device."""
        hs = self._heads[layer][self.layout.kv_heads(group)]
        return _Head(
            *(torch.stack([getattr(h, f) for h in hs]).to(self.device) for f in _Head.__dataclass_fields__)
        )

    def blocks(self, p: _Head, blocks: torch.Tensor) -> torch.Tensor:
        """KV of token blocks `blocks` [nb] (int64, device) of the heads `p` (`_slice_heads`):
        [nb * block_size, 2, G, D] float32, tokens in the order of `blocks`."""
        bs = self.layout.block_size
        g, rank, d = p.basis.shape
        nb = blocks.numel()
        ka = _mix(p.lanes[:, 0, None] ^ blocks)  # [G, nb]
        kb = _mix(p.lanes[:, 1, None] ^ blocks)
        topic = _normal(ka, kb, 0, rank)[:, :, None]  # [G, nb, 1, rank]
        coef = TOPIC * topic + math.sqrt(1 - TOPIC**2) * _normal(ka, kb, 1, bs * rank).view(g, nb, bs, rank)
        noise = _normal(ka, kb, 2, bs * d).view(g, nb * bs, d)
        keys = p.mean[:, None] + torch.einsum("gtr,grd->gtd", coef.view(g, nb * bs, rank), p.basis)
        keys += NOISE * noise  # [G, T, D]
        pos = (blocks[:, None] * bs + torch.arange(bs, device=blocks.device)).flatten()  # [T]
        if p.starts.shape[1]:
            s = p.starts[:, :, None]  # [G, N, 1]
            away = torch.maximum(s - pos, pos - (s + self.needles.length - 1)).clamp(min=0)
            away = away.amin(dim=1)  # [G, T]: tokens to the nearest needle, 0 inside one
            near = (-away / self.halo).exp() if self.halo else (away == 0).float()
            keys += (self.strength * math.sqrt(d)) * near[:, :, None] * p.direction[:, None]
        keys = keys.transpose(0, 1).contiguous()  # [T, G, D]
        if self.rotary is not None:
            cos, sin = self.rotary.cos_sin(pos, torch.float32)
            keys = Rotary.apply(keys, cos, sin)
        values = _normal(ka, kb, 3, bs * d).view(g, nb * bs, d).transpose(0, 1)  # [T, G, D]
        return torch.stack((keys, values), dim=1)

    def spans(
        self, layer: int, group: int, tokens: int, multiple: int = 1
    ) -> Iterator[tuple[int, torch.Tensor]]:
        """Tokens [0, tokens) of a slice as (start, kv [n, 2, G, D] float32) spans of about
        SPAN_NUMBERS numbers (CPU_SPAN_NUMBERS on the CPU), each start a multiple of the block
        size and of `multiple`."""
        lay = self.layout
        bs = lay.block_size
        step = bs * multiple // math.gcd(bs, multiple)
        numbers = CPU_SPAN_NUMBERS if self.device.type == "cpu" else SPAN_NUMBERS
        step *= max(1, numbers // (lay.group_size * lay.head_dim * step))
        p = self._slice_heads(layer, group)
        for a in range(0, tokens, step):
            b = min(a + step, tokens)
            blocks = torch.arange(a // bs, -(-b // bs), device=self.device)
            yield a, self.blocks(p, blocks)[: b - a]

    def at(self, layer: int, group: int, keep: torch.Tensor) -> torch.Tensor:
        """The tokens `keep` [G, K] (positions per KV head, device) of a slice, compacted as an
        evictor stores them: [K, 2, G, D] float32. Generates only the blocks they fall in."""
        bs = self.layout.block_size
        blocks = torch.unique(keep // bs)  # sorted
        kv = self.blocks(self._slice_heads(layer, group), blocks)  # [nb * bs, 2, G, D]
        rows = torch.searchsorted(blocks, keep // bs) * bs + keep % bs  # [G, K]
        heads = torch.arange(keep.shape[0], device=keep.device)[:, None]
        return kv[rows, :, heads].permute(1, 2, 0, 3)  # [G, K, 2, D] -> [K, 2, G, D]


def _head(
    seed: int,
    layer: int,
    head: int,
    *,
    dim: int,
    rank: int,
    channels: torch.Tensor,
    blocks: tuple[int, int],
    needles: int,
    needle_tokens: int,
    block_size: int,
) -> _Head:
    """The parameters of one (layer, KV head), from a CPU generator seeded by a hash of
    (seed, layer, head). Needles: one per stratum of blocks [blocks[0], blocks[1])."""
    digest = hashlib.blake2b(f"kvtier.structured/{seed}/{layer}/{head}".encode(), digest_size=16).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest[8:], "little") >> 1)
    lanes = torch.tensor([int.from_bytes(digest[:4], "little"), int.from_bytes(digest[4:8], "little")])
    direction = torch.zeros(dim)
    direction[channels] = torch.randn(channels.numel(), generator=gen)
    direction /= direction.norm()
    mean = torch.randn(dim, generator=gen)
    mean[channels] = 0.0  # NOTE: a mean in the needle channels would rotate into the query
    mean *= MEAN * math.sqrt(dim) / mean.norm()
    basis = torch.randn(dim, rank, generator=gen)
    basis -= direction[:, None] * (direction @ basis)[None]  # orthogonal to the needle direction
    std = (
        LOWRANK
        * math.sqrt(dim)
        * DECAY ** torch.arange(rank)
        * torch.exp(0.25 * torch.randn(rank, generator=gen))
    )
    first, last = blocks
    edges = first + torch.arange(needles + 1) * (last - first) // max(needles, 1)
    widths = edges[1:] - edges[:-1]
    chosen = edges[:-1] + (torch.rand(needles, generator=gen) * widths).long()
    offsets = (torch.rand(needles, generator=gen) * (block_size - needle_tokens + 1)).long()
    return _Head(
        lanes=lanes,
        mean=mean,
        basis=torch.linalg.qr(basis).Q.T * std[:, None],
        direction=direction,
        starts=(chosen * block_size + offsets).long(),
    )
