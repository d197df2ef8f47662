"""The tiered KV store of one sequence, and the attention it serves to the model.

Slices (layer, KV-head group) are either *resident* (a GPU buffer for the whole context) or
*streamed* (host memory, loaded into ping-pong staging buffers when their turn comes). Which
slices are which, how large a group is and how large the staging buffers are is a `KVPlan`
(see `kvtier.planner.placement`): `gpu`, `layer`, `head` and `auto` are all plans over this one
store. Every policy is lossless; with the same kernels the logits are bitwise equal.

Per step the engine calls `begin_step(n)`, runs the model (which calls the store once per
layer), then `end_step()`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvtier.attention.dense import attend_prefix_lse, attend_self_lse, merge_into
from kvtier.attention.interface import DenseKernel, SliceKernel, SliceStep
from kvtier.config import ModelConfig
from kvtier.errors import CapacityError
from kvtier.kv.host_slice import HostSlice
from kvtier.kv.layout import KVLayout, spread
from kvtier.kv.staging import Load, StagingRing
from kvtier.kv.streams import Streams
from kvtier.kv.tiers import GPU, HostArena, TierAccount
from kvtier.model.rope import Rotary
from kvtier.planner.placement import KVPlan


@dataclass(frozen=True)
class StoreOptions:
    """Storage granularity: token blocks, and host extents (the unit of one PCIe copy).

    Extents are sized in bytes, so a finer head group does not mean more, smaller copies: the
    host issues each copy, and ~10K copies per decode step would make the CPU the bottleneck.
    `extent_blocks` overrides the size (in blocks) for tests.
    """

    block_size: int = 256
    extent_bytes: int = 64 << 20
    extent_blocks: int | None = None


class TieredKVStore:
    """KV cache of one sequence over GPU and host tiers; callable as `kvtier.attention.Attention`."""

    def __init__(
        self,
        cfg: ModelConfig,
        plan: KVPlan,
        *,
        device: torch.device,
        dtype: torch.dtype,
        capacity: int,
        options: StoreOptions | None = None,
        kernel: SliceKernel | None = None,
        rotate_keys: bool = True,
    ) -> None:
        opts = options or StoreOptions()
        self.plan = plan
        self.device = device
        self.layout = KVLayout(
            num_layers=cfg.num_layers,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            q_per_kv=cfg.q_per_kv,
            group_size=plan.group_size,
            block_size=opts.block_size,
            dtype=dtype,
        )
        lay = self.layout
        self.account = TierAccount()
        self.streams = Streams(device)
        # The attention method over a slice (dense unless a sparse method is plugged in), and
        # whether the store applies RoPE (False: keys are stored un-rotated and the kernel
        # rotates them at positions of its choosing, e.g. for context extension).
        self.kernel: SliceKernel = kernel or DenseKernel()
        self.rotate_keys = rotate_keys
        self.rotary = Rotary(cfg.rope, cfg.head_dim, device)
        self.length = 0  # tokens stored per slice
        self.position = 0  # absolute position of the next token (> length once tokens are evicted)
        self._step_tokens = 0
        self._cos = self._sin = torch.empty(0)
        shape = (2, lay.group_size, lay.head_dim)
        self._capacity = lay.round_up(max(capacity, 1))
        self.resident: dict[int, torch.Tensor] = {}  # slice -> [capacity, 2, G, D]
        self.hosts: dict[int, HostSlice] = {}
        is_resident = spread(lay.num_slices, plan.resident_slices)
        extent_blocks = opts.extent_blocks or max(1, opts.extent_bytes // (lay.block_size * lay.token_bytes))
        # NOTE: never larger than the planned capacity, or short contexts would over-reserve.
        extent_blocks = min(extent_blocks, self._capacity // lay.block_size)
        extent_tokens = lay.block_size * extent_blocks
        streamed = [s for s in range(lay.num_slices) if not is_resident[s]]
        self.arena = HostArena(
            (extent_tokens, *shape),
            dtype,
            pin=device.type == "cuda",
            account=self.account,
            slab_bytes=extent_tokens
            * lay.token_bytes
            * max(1, min(len(streamed), (1 << 30) // max(1, extent_tokens * lay.token_bytes))),
        )
        for s in range(lay.num_slices):
            if is_resident[s]:
                self.resident[s] = torch.empty(self._capacity, *shape, dtype=dtype, device=device)
                self.account.alloc(GPU, self.resident[s].numel() * self.resident[s].element_size())
            else:
                self.hosts[s] = HostSlice(self.arena, extent_tokens)
                # Pre-allocate the planned capacity now: pinning memory mid-prefill stalls the GPU.
                self.hosts[s].reserve(self._capacity)
        self.ring: StagingRing | None = None
        if streamed:
            self.ring = StagingRing(
                max(1, plan.staging_buffers),
                lay.round_up(plan.staging_tokens),
                shape,
                dtype,
                device,
                self.streams,
                self.account,
            )

    # -- step protocol -------------------------------------------------------------------------

    def begin_step(self, n_new: int) -> None:
        """Prepare a step that appends `n_new` tokens at positions length .. length + n_new - 1."""
        lay = self.layout
        end = self.length + n_new
        positions = torch.arange(self.position, self.position + n_new, device=self.device)
        self._cos, self._sin = self.rotary.cos_sin(positions, lay.dtype)
        self._step_tokens = n_new
        if end > self._capacity:
            self._grow_resident(lay.round_up(max(end, 2 * self._capacity)))
        for host in self.hosts.values():
            host.reserve(lay.round_up(end))
        if self.ring is not None:
            self.ring.start(self._schedule(n_new), self.hosts)

    def end_step(self) -> None:
        self.length += self._step_tokens
        self.position += self._step_tokens
        self._step_tokens = 0

    def _schedule(self, n_new: int) -> list[Load]:
        assert self.ring is not None
        s, cap = self.length, self.ring.tokens
        loads = []
        for sid in sorted(self.hosts):
            if s + n_new <= cap:
                loads.append(Load(sid, 0, s))
            else:
                loads.extend(Load(sid, a, min(a + cap, s)) for a in range(0, s, cap))
        return loads

    # -- attention -----------------------------------------------------------------------------

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """`kvtier.attention.Attention`: rotate, append k/v of `layer`, attend. q [T, H_q, D]."""
        lay = self.layout
        if self.rotate_keys:
            q = Rotary.apply(q, self._cos, self._sin)
            k = Rotary.apply(k, self._cos, self._sin)
        if lay.num_groups == 1:
            return self._attend_slice(layer, 0, q, k, v)
        out = torch.empty_like(q)
        for g in range(lay.num_groups):
            kh, qh = lay.kv_heads(g), lay.q_heads(g)
            out[:, qh] = self._attend_slice(layer, g, q[:, qh], k[:, kh], v[:, kh])
        return out

    def _attend_slice(
        self, layer: int, group: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        s, t = self.length, q.shape[0]
        sid = self.layout.slice_index(layer, group)
        step = SliceStep(layer, group, s)
        if sid in self.resident:
            buf = self.resident[sid]
            buf[s : s + t, 0] = k
            buf[s : s + t, 1] = v
            return self.kernel(q, buf[: s + t], step)
        assert self.ring is not None
        if s + t <= self.ring.tokens:
            return self._attend_streamed(sid, step, q, k, v)
        if not isinstance(self.kernel, DenseKernel):
            raise CapacityError(
                f"slice ({layer}, {group}) needs {s + t} tokens but a staging buffer holds "
                f"{self.ring.tokens}; this attention method needs whole slices on the GPU: "
                "give it more --gpu-memory or a finer --head-group"
            )
        return self._attend_streamed_blocks(sid, q, k, v)

    def _attend_streamed(
        self, sid: int, step: SliceStep, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        assert self.ring is not None
        s, t = self.length, q.shape[0]
        loaded = self.ring.take(Load(sid, 0, s))
        buf = loaded.view
        buf[s : s + t, 0] = k
        buf[s : s + t, 1] = v
        out = self.kernel(q, buf[: s + t], step)
        computed = self.streams.record()
        written = self._write_back(sid, buf[s : s + t], computed)
        self.ring.release(loaded, [computed, written])
        return out

    def _attend_streamed_blocks(
        self, sid: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """The slice does not fit a staging buffer: stream its prefix in sequence blocks and merge
        the partial results by log-sum-exp, so GPU memory does not grow with the context."""
        assert self.ring is not None
        s, cap = self.length, self.ring.tokens
        acc = None
        for a in range(0, s, cap):
            loaded = self.ring.take(Load(sid, a, min(a + cap, s)))
            acc = merge_into(acc, attend_prefix_lse(q, loaded.view[: min(cap, s - a)]))
            self.ring.release(loaded, [self.streams.record()])
        out = merge_into(acc, attend_self_lse(q, k, v))[0].to(q.dtype)
        new = torch.stack((k, v), dim=1)  # [T, 2, G, D]
        self._write_back(sid, new, self.streams.record())
        return out

    def _write_back(
        self, sid: int, new: torch.Tensor, after: torch.cuda.Event | None
    ) -> torch.cuda.Event | None:
        """Copy the step's new tokens of a streamed slice to host; nothing else ever moves back."""
        host = self.hosts[sid]
        with self.streams.on_d2h():
            self.streams.wait([after])
            host.write(self.length, new)
            written = self.streams.record()
        if self.streams.d2h is not None:
            new.record_stream(self.streams.d2h)
        host.last_write = written
        self.account.d2h_bytes += new.numel() * new.element_size()
        return written

    # -- memory --------------------------------------------------------------------------------

    def _grow_resident(self, tokens: int) -> None:
        for sid, old in self.resident.items():
            new = torch.empty(tokens, *old.shape[1:], dtype=old.dtype, device=old.device)
            new[: self.length] = old[: self.length]
            self.account.alloc(GPU, new.numel() * new.element_size())
            self.account.free(GPU, old.numel() * old.element_size())
            self.resident[sid] = new
        self._capacity = tokens

    def close(self) -> None:
        """Free every tier. The store is unusable afterwards."""
        self.streams.synchronize()
        for buf in self.resident.values():
            self.account.free(GPU, buf.numel() * buf.element_size())
        self.resident.clear()
        if self.ring is not None:
            self.ring.close()
        self.hosts.clear()
        self.arena.close()
