"""The bytes of one context's candidate placements, as `plan_kv` (`kvtier.planner.placement`)
weighs them, and the `KVPlan` each candidate becomes.

A candidate is a slicing (`g` KV heads a slice) and a prefill chunk (`c` tokens). Its GPU
bytes are those that are not placed KV (`fixed`: weights, one chunk's activations, the reserve,
windowed and compact slices) plus the placed KV it keeps there: resident slices at capacity
(`slice_kv`, packed: rows and tail) and the staging buffers streamed slices go through
(`staging_kv`, packed: and the scratch a load unpacks into). `pick_chunk` finds the chunk that
fits beside them; `make` builds the plan and checks the host budget.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from kvtier.config import ModelConfig
from kvtier.errors import HostCapacityError
from kvtier.planner.compact import CompactSlices
from kvtier.planner.hardware import Hardware
from kvtier.planner.kv_plan import KVPlan
from kvtier.planner.memory import (
    activation_bytes,
    hf_activation_bytes,
    kv_token_bytes,
    round_up,
    weight_bytes,
    window_kv_bytes,
    window_tokens,
)
from kvtier.planner.packed import PackedFormat, PackedSizing
from kvtier.planner.roofline import default_chunk_size

MIN_REDUCED_CHUNK = 256  # the planner halves the roofline chunk no further than this


@dataclass(frozen=True)
class PlacementSizes:
    """What `plan_kv` was asked for (checked: `kvtier.planner.placement`), and the bytes each of
    its candidate placements takes. `scratches` is the unpack scratches a packed slice loads
    through (1 without a codec)."""

    cfg: ModelConfig
    context: int
    policy: str
    gpu_budget: int | None
    host_budget: int | None
    dtype_bytes: int
    chunk_size: int | None
    hw: Hardware
    block_size: int
    reserve_bytes: int
    mlp_chunk: int | None
    codec: PackedFormat | None
    activations: str
    compact: CompactSlices | None
    scratches: int
    capacity: int = field(init=False)  # tokens a slice holds: the context in whole blocks
    placed_layers: int = field(init=False)  # windowed layers are resident, outside the placement
    windowed: int = field(init=False)  # layers whose sliding window binds at the context

    def __post_init__(self) -> None:
        placed_layers = self.cfg.full_layers(self.context)
        object.__setattr__(self, "capacity", round_up(self.context, self.block_size))
        object.__setattr__(self, "placed_layers", placed_layers)
        object.__setattr__(self, "windowed", self.cfg.num_layers - placed_layers)

    def n_compact(self, g: int) -> int:
        cfg, compact = self.cfg, self.compact
        return 0 if compact is None else compact.count(cfg.num_layers * (cfg.num_kv_heads // g))

    def placed(self, g: int) -> int:
        """Placed slices of `g` KV heads: the full layers' less the compact ones among them (at
        least those the windowed layers cannot hold: the evictor picks by score, not layer)."""
        groups = self.cfg.num_kv_heads // g
        return self.placed_layers * groups - max(0, self.n_compact(g) - self.windowed * groups)

    def compact_tokens(self, c: int) -> int:
        compact = self.compact
        return 0 if compact is None else min(compact.tokens(c, self.block_size), self.capacity)

    def fixed(self, c: int, g: int) -> int:  # GPU bytes that are not placed KV
        cfg, context, dtype_bytes, compact = self.cfg, self.context, self.dtype_bytes, self.compact
        if self.activations == "hf":
            act = hf_activation_bytes(cfg, c, dtype_bytes, group_size=g, context=context)
        else:
            act = activation_bytes(cfg, c, dtype_bytes, self.mlp_chunk, group_size=g, context=context)
        return (
            weight_bytes(cfg, dtype_bytes)
            + act
            + self.reserve_bytes
            + window_kv_bytes(cfg, c, context, dtype_bytes, self.block_size)
            + (
                0
                if compact is None
                else compact.gpu_bytes(
                    self.n_compact(g), self.compact_tokens(c), kv_token_bytes(cfg, g, dtype_bytes)
                )
            )
        )

    def sizing(self, g: int) -> PackedSizing | None:
        return None if self.codec is None else PackedSizing.of(self.codec, g, self.cfg.head_dim)

    def slice_kv(self, g: int, c: int) -> int:
        """Bytes one slice of `g` KV heads stores at capacity (packed: rows and tail)."""
        tok, pk = kv_token_bytes(self.cfg, g, self.dtype_bytes), self.sizing(g)
        if pk is None:
            return self.capacity * tok
        return pk.rows_bytes(self.capacity) + pk.tail_tokens(c, self.block_size) * tok

    def staging_kv(self, g: int, tokens: int) -> int:
        """Two staging buffers of `tokens` tokens (packed: and the rows a load unpacks from)."""
        pk = self.sizing(g)
        scratch = 0 if pk is None else self.scratches * pk.scratch_bytes(tokens)
        return 2 * tokens * kv_token_bytes(self.cfg, g, self.dtype_bytes) + scratch

    def all_resident_kv(self, g: int, c: int) -> int:
        n = self.placed(g)
        return n * self.slice_kv(g, c) + (0 if self.codec is None else self.staging_kv(g, self.capacity))

    def pick_chunk(self, g: int, kv: Callable[[int], int], floor: int = MIN_REDUCED_CHUNK) -> int:
        """The roofline chunk for slices of `g` KV heads (finer slices need longer chunks to hide
        the host's per-slice work), halved down to `floor` until it fits next to kv(chunk) bytes."""
        context, gpu_budget = self.context, self.gpu_budget
        if self.chunk_size is not None:
            return min(self.chunk_size, context)
        pieces = self.placed(g) + self.windowed
        c = min(default_chunk_size(self.cfg, context, self.hw, self.dtype_bytes, pieces=pieces), context)
        while gpu_budget is not None and c > floor and self.fixed(c, g) + kv(c) > gpu_budget:
            c = max(c // 2, floor)
        return c

    def make(self, g: int, resident: int, staging_tokens: int, c: int) -> KVPlan:
        """The plan of `resident` resident slices of `g` KV heads, staging buffers of
        `staging_tokens` tokens and chunks of `c`; HostCapacityError where the host budget is
        too small for its streamed slices."""
        cfg, context, capacity, block_size = self.cfg, self.context, self.capacity, self.block_size
        windowed, dtype_bytes = self.windowed, self.dtype_bytes
        n = self.placed(g)
        pk = self.sizing(g)
        staged = resident < n or pk is not None  # packed resident slices unpack through staging
        plan = KVPlan(
            policy=self.policy,
            group_size=g,
            resident_slices=resident,
            chunk_size=c,
            staging_buffers=2 if staged else 0,
            staging_tokens=(staging_tokens if resident < n else capacity) if staged else 0,
            context=context,
            capacity_tokens=capacity,
            num_slices=n,
            slice_token_bytes=kv_token_bytes(cfg, g, dtype_bytes),
            packed=pk,
            packed_tail_tokens=0 if pk is None else pk.tail_tokens(c, block_size),
            unpack_scratches=self.scratches,
            window_slices=windowed * (cfg.num_kv_heads // g),
            window_tokens=0
            if not windowed
            else window_tokens(cfg.sliding_window or 0, c, context, block_size),
            compact_slices=self.n_compact(g),
            compact_tokens=self.compact_tokens(c),
        )
        host_budget = self.host_budget
        if host_budget is not None and plan.host_kv_bytes > host_budget:
            raise HostCapacityError(
                f"{context} tokens need {gb(plan.host_kv_bytes)} of host memory for the offloaded KV "
                f"({plan.streamed_slices} slices of {gb(plan.slice_bytes(cfg, capacity, dtype_bytes))}), "
                f"--host-memory is {gb(host_budget)}; use a shorter context or a larger --host-memory"
            )
        return plan


def buffer_tokens(avail: int | None, capacity: int, token_bytes: int, block_size: int) -> int:
    """Tokens per ping-pong buffer: the whole slice if two fit in `avail`, else whole blocks."""
    if avail is None or 2 * capacity * token_bytes <= avail:
        return capacity
    return max(avail, 0) // (2 * token_bytes) // block_size * block_size  # 0: not even one block


def gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB"
