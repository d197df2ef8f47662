"""`KVPlan`: one sequence's KV placement, as `plan_kv` (`kvtier.planner.placement`) sizes it:
slices, resident and streamed, staging buffers, windowed and compact slices, and the bytes each
tier holds and each decode token moves."""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.config import ModelConfig
from kvtier.errors import ConfigError
from kvtier.planner.cpu_split import SliceShape
from kvtier.planner.memory import kv_token_bytes
from kvtier.planner.packed import PackedSizing

POLICIES = ("gpu", "layer", "head", "auto")


@dataclass(frozen=True)
class KVPlan:
    """A KV placement. The sizing fields (context .. slice_token_bytes) are filled by `plan_kv`;
    a plan built by hand may leave them 0, and its byte properties are then 0."""

    policy: str  # "gpu" | "layer" | "head" | "auto" — what was asked
    group_size: int  # KV heads per (layer, group) slice; num_kv_heads = one group per layer
    resident_slices: int  # slices that stay on the GPU for good (0..num_slices)
    chunk_size: int  # prefill chunk, tokens
    staging_buffers: int  # ping-pong GPU buffers for streamed slices (0 if nothing is streamed)
    staging_tokens: int  # tokens one staging buffer holds; < capacity_tokens = sequence blocks
    context: int = 0  # tokens the plan was made for
    capacity_tokens: int = 0  # context rounded up to the block size: what each slice can hold
    num_slices: int = 0  # placed slices: full (non-windowed) layers x num_groups
    slice_token_bytes: int = 0  # K and V of one token of one slice, B
    window_slices: int = 0  # slices of windowed layers: always on the GPU, not placed
    window_tokens: int = 0  # tokens one windowed slice holds (its window plus one chunk)
    # A packing codec (quantized KV): every slice stores packed rows and a full-precision tail;
    # resident slices unpack on the GPU through the staging buffers.
    packed: PackedSizing | None = None
    packed_tail_tokens: int = 0  # full-precision tokens of a packed slice's tail ring
    # Row scratches packed loads unpack from: 2 = on a stream of their own, so the link only
    # copies (`StoreOptions.unpack_stream`; `plan_kv` plans it where the link model says it pays).
    unpack_scratches: int = 1
    # Streamed slices a decode step attends on the CPU, where their KV lives, instead of copying
    # them (kvtier.planner.cpu_split); prefill streams them like the others.
    cpu_slices: int = 0
    # Slices an evictor keeps compact (kvtier.planner.compact): on the GPU, not placed.
    compact_slices: int = 0
    # Tokens the store allocates each slice an evictor compacts (`--evict`: every slice, placed as
    # resident; head sparsity: its compact slices), once: kept tokens plus a step's. 0: none.
    compact_tokens: int = 0

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ConfigError(f"unknown KV policy {self.policy!r}; use one of {', '.join(POLICIES)}")
        if self.group_size < 1 or self.chunk_size < 1:
            raise ConfigError(f"group_size and chunk_size must be positive: {self}")
        if min(self.resident_slices, self.staging_buffers, self.staging_tokens) < 0:
            raise ConfigError(f"resident_slices and staging sizes must not be negative: {self}")
        if (self.staging_buffers == 0) != (self.staging_tokens == 0):
            raise ConfigError(f"staging_buffers and staging_tokens must both be 0 or both positive: {self}")
        if self.num_slices and self.resident_slices > self.num_slices:
            raise ConfigError(f"resident_slices exceeds num_slices: {self}")
        if self.streamed_slices > 0 and self.staging_buffers == 0:
            raise ConfigError(f"{self.streamed_slices} slices are streamed but there is no staging buffer")
        if self.cpu_slices < 0 or (self.num_slices and self.cpu_slices > self.streamed_slices):
            raise ConfigError(f"cpu_slices must be between 0 and the streamed slices: {self}")
        if self.unpack_scratches not in (1, 2):
            raise ConfigError(f"unpack_scratches must be 1 or 2: {self}")

    def num_groups(self, cfg: ModelConfig) -> int:
        """KV-head groups per layer."""
        return cfg.num_kv_heads // self.group_size

    def slice_bytes(self, cfg: ModelConfig, tokens: int, dtype_bytes: int) -> int:
        """Bytes of K and V for `tokens` tokens of one slice."""
        return tokens * kv_token_bytes(cfg, self.group_size, dtype_bytes)

    @property
    def streamed_slices(self) -> int:
        """Slices that live on the host and are copied in for every forward pass."""
        return max(self.num_slices - self.resident_slices, 0)

    @property
    def blocks_per_slice(self) -> int:
        """Staging-buffer loads per streamed slice per forward pass (1 = whole slice at once)."""
        return -(-self.capacity_tokens // self.staging_tokens) if self.streamed_slices else 0

    @property
    def slice_store_bytes(self) -> int:
        """Bytes one slice reserves at capacity: full precision, or packed rows plus the tail."""
        if self.packed is None:
            return self.capacity_tokens * self.slice_token_bytes
        return self.packed.rows_bytes(self.capacity_tokens) + self.packed_tail_tokens * self.slice_token_bytes

    @property
    def gpu_kv_bytes(self) -> int:
        """GPU bytes for KV: resident slices at capacity plus the staging buffers (and, packed,
        the rows a load unpacks from)."""
        staging = self.staging_buffers * self.staging_tokens * self.slice_token_bytes
        if self.packed is not None and self.staging_buffers:
            staging += self.unpack_scratches * self.packed.scratch_bytes(self.staging_tokens)
        compact = self.compact_slices * self.compact_tokens * self.slice_token_bytes  # as CompactSlices
        return self.resident_slices * self.slice_store_bytes + staging + self.window_kv_bytes + compact

    @property
    def window_kv_bytes(self) -> int:
        """GPU bytes of the windowed layers' slices (part of `gpu_kv_bytes`)."""
        return self.window_slices * self.window_tokens * self.slice_token_bytes

    @property
    def host_kv_bytes(self) -> int:
        """Pinned host bytes for KV: every streamed slice at capacity."""
        return self.streamed_slices * self.slice_store_bytes

    @property
    def pcie_bytes_per_decode_token(self) -> int:
        """Bytes over PCIe to decode one token at `context`: streamed slices in (but those the CPU
        attends), every streamed slice's new token out."""
        copied = self.streamed_slices - self.cpu_slices
        return (copied * self.context + self.streamed_slices) * self.slice_token_bytes

    def slice_shape(self, cfg: ModelConfig) -> SliceShape:
        """What the CPU-split simulation (`kvtier.planner.cpu_split`) needs of this plan."""
        return SliceShape(
            num_layers=cfg.num_layers,
            num_groups=self.num_groups(cfg),
            resident_slices=self.resident_slices,
            context=self.context,
            slice_token_bytes=self.slice_token_bytes,
            blocks_per_slice=self.blocks_per_slice,
            staging_buffers=self.staging_buffers,
            read_token_bytes=0.0 if self.packed is None else self.packed.row_bytes / self.packed.group,
        )
