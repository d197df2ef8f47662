"""The tiered KV store of one sequence, and the attention it serves to the model.

Slices (layer, KV-head group) are either *resident* (a GPU buffer for the whole context) or
*streamed* (host memory, loaded into ping-pong staging buffers when their turn comes). Which
slices are which, how large a group is and how large the staging buffers are is a `KVPlan`
(see `kvtier.planner.placement`): `gpu`, `layer`, `head` and `auto` are all plans over this one
store. Every policy is lossless; with the same kernels the logits are bitwise equal.

Per step the engine calls `begin_step(n)`, runs the model (which calls the store once per
layer), then `end_step()`. A prefill step may also run layer by layer (`begin_step(n,
by_layer=True)`, then `pass_chunk` before each chunk of each layer: `kvtier.kv.layer_pass`).

Two optional hooks let lossy policies (`kvtier.policies`) act on the stored tokens; with neither
set the store behaves exactly as before:

- `codec` (`KVCodec`): at `end_step`, the tokens the codec declares final are coded, stored
  as packed rows (`kvtier.kv.packed`): streamed slices in host memory, so their loads move the
  packed bytes, and the plan's resident slices in GPU memory, unpacked on the device when
  attended, so they take the packed bytes of GPU memory. A simulated codec (`RoundTripCodec`
  only) keeps the quantize -> dequantize round trip in place.
- `evictor` (`Evictor`): at `end_step`, each slice it owns may be compacted to a subset of its
  tokens, per KV head, in token order. That slice's stored length shrinks; `position` never
  does. The slices it owns are always GPU-resident (sized by what they keep); the plan places
  the rest, so eviction composes with offload.

Layers whose sliding window binds at the capacity keep only their window, resident
(`kvtier.kv.windowed`); every slice's kernel gets its layer's `LayerAttention` (window,
soft-capping, scale) in `SliceStep.attn`.

The store's parts live beside it: its buffers, allocated from the plan (`kvtier.kv.buffers`);
its resident slices (`kvtier.kv.resident`); the loads and attention of staged slices
(`kvtier.kv.staged_attend`) and of those attended on the CPU (`kvtier.kv.cpu_attend`); the
copies of new tokens to the host tier (`kvtier.kv.write_back`).
"""

from __future__ import annotations

import torch

from kvtier.attention.interface import (
    DenseKernel,
    LayerCachedKernel,
    PlacesCaches,
    PrefillAwareKernel,
    SliceKernel,
    SliceStep,
)
from kvtier.attention.spec import layer_attention
from kvtier.config import ModelConfig
from kvtier.errors import CapacityError, ConfigError
from kvtier.kv.buffers import allocate_buffers
from kvtier.kv.coding import code_tokens
from kvtier.kv.cpu_attend import CpuSlices
from kvtier.kv.device_memory import CachingMemory, DeviceMemory
from kvtier.kv.hooks import Evictor, KVCodec, RoundTripCodec, StoreOptions, packing_codec
from kvtier.kv.host_slice import HostSlice
from kvtier.kv.layer_pass import LayerPass, pass_fits
from kvtier.kv.layout import KVLayout
from kvtier.kv.resident import compact, reallocate
from kvtier.kv.staged_attend import StagedSlices
from kvtier.kv.streams import Streams
from kvtier.kv.tiers import GPU, HOST, TierAccount, keeps_pinned, release_pinned_cache
from kvtier.kv.windowed import check_parts, plain_limit, trim, windowed_slices
from kvtier.kv.write_back import HostWrites
from kvtier.model.rope import rotary_for
from kvtier.planner.placement import KVPlan

# The hooks live in kvtier.kv.hooks.
__all__ = ["Evictor", "KVCodec", "RoundTripCodec", "StoreOptions", "TieredKVStore"]


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
        codec: KVCodec | RoundTripCodec | None = None,
        evictor: Evictor | None = None,
        memory: DeviceMemory | None = None,
    ) -> None:
        opts = options or StoreOptions()
        # Where the resident slices of the whole capacity and the staging buffers live: the
        # caching allocator, or a region someone else owns (the server's page runs).
        self.memory: DeviceMemory = memory or CachingMemory(device)
        self.plan = plan
        self.device = device
        self.layout = KVLayout.of(cfg, plan.group_size, opts.block_size, dtype)
        lay = self.layout
        self.account = TierAccount()
        self.streams = Streams(device)
        # The attention method over a slice (dense unless a sparse method is plugged in), and
        # whether the store applies RoPE (False: keys are stored un-rotated and the kernel
        # rotates them at positions of its choosing, e.g. for context extension).
        self.kernel: SliceKernel = kernel or DenseKernel()
        self.rotate_keys = rotate_keys
        self.rotary = rotary_for(cfg, device)
        self.length = 0  # tokens stored in the longest slice (all slices, unless evicted)
        self.position = 0  # absolute position of the next token (> length once tokens are evicted)
        self._step_tokens = 0
        self._cos = self._sin = torch.empty(0)
        self._pass: LayerPass | None = None  # a layer-by-layer prefill step's streamed slices
        self._offset = 0  # its current chunk's first token, counted from the step's first
        self._capacity = lay.round_up(max(capacity, 1))
        packer = packing_codec(codec)  # NOTE: raises ConfigError for an object that is not a codec
        if codec is not None and evictor is not None:
            raise ConfigError("a KV codec and an evictor cannot be combined yet: choose one")
        # Slices an evictor compacts always stay on the GPU (they hold a budget, not the context);
        # the plan places the others (e.g. head-wise sparsity: streaming heads resident and
        # compact, retrieval heads streamed).
        self._evictable = evictor.bind(lay, self._capacity) if evictor is not None else frozenset()
        # Each layer's scoring (window, soft-capping, scale) at this capacity; slices of layers
        # whose window binds keep only the window, resident (kvtier.kv.windowed).
        self.attn = layer_attention(cfg, capacity)
        check_parts(self.attn, kernel, rotate_keys, codec is not None, evictor is not None)
        self._windowed = windowed_slices(cfg, lay, capacity)  # slice -> window
        self._plain_limit = plain_limit(cfg, capacity)
        self._unpack_stream = plan.unpack_scratches == 2 if opts.unpack_stream is None else opts.unpack_stream
        # Where each slice lives and the buffers that hold it, in the order `region_buffers` sizes
        # them (kvtier.kv.buffers): resident slices, extents, staging ring, packed rows.
        bufs = allocate_buffers(
            cfg,
            plan,
            lay,
            capacity,
            opts,
            packer,
            self._evictable,
            self._windowed,
            device=device,
            memory=self.memory,
            streams=self.streams,
            account=self.account,
            unpack_stream=self._unpack_stream,
        )
        self.on_device = bufs.places.on_device
        self._bounded = bufs.bounded
        self.resident = bufs.resident  # slice -> [tokens, 2, G, D]
        self.storage = bufs.storage
        self.ring = bufs.ring
        self.packed = bufs.packed
        self.hosts: dict[int, HostSlice] = self.storage.slices  # slices attended through staging
        self.codec = codec
        self._coded = 0  # leading tokens of every slice already stored coded
        # Tokens stored per slice; differs from `length` only in slices an evictor compacted.
        self.slice_length = [0] * lay.num_slices
        self.evictor = evictor
        # A kernel's decode caches (HiP's block caches) come after the store's buffers from memory
        # the store was given (a server's lent pages: `kvtier.methods.registry.Placement`'s
        # `method_buffers` lists them after `region_buffers`), else from the caching allocator.
        if not isinstance(self.memory, CachingMemory) and isinstance(self.kernel, PlacesCaches):
            self.kernel.place_caches(self.memory.empty)
        # Whether the kernel may serve a layer's cached slices at once, asked once: a protocol's
        # isinstance checks its members (5-10 us), which every layer of every decode step paid.
        self._layer_cached = isinstance(self.kernel, LayerCachedKernel)
        # New tokens of streamed slices to the host tier (`writes.defer`: a decode step's at the
        # next step's start, kvtier.kv.write_back).
        self.writes = HostWrites(self.hosts, self.streams, self.account, self.on_device)
        # Their attention, and each step's loads into the staging buffers (kvtier.kv.staged_attend).
        self.staged: StagedSlices | None = None
        if self.ring is not None:
            self.staged = StagedSlices(
                self.ring,
                self.hosts,
                lay,
                self.kernel,
                self.attn,
                device=device,
                streams=self.streams,
                account=self.account,
                writes=self.writes,
                packed=self.packed,
                unpack_stream=self._unpack_stream,
                caching_memory=isinstance(self.memory, CachingMemory),
            )
        # The plan's CPU-attended slices (kvtier.kv.cpu_attend): dense attention over the host
        # tier's KV, full precision or packed (the values a load would unpack); any other store
        # streams them as usual.
        self.cpu: CpuSlices | None = None
        self._cpu: frozenset[int] = frozenset()  # slices this step attends on the CPU
        plain = not self._windowed and all(a.plain for a in self.attn)  # the CPU kernel's attention
        plain = plain and type(self.kernel) is DenseKernel and evictor is None
        if plan.cpu_slices and plain and (codec is None or self.packed is not None):
            self.cpu = CpuSlices(
                lay, self.hosts, plan.cpu_slices, device, self.streams, packed=self.packed,
                handoff=opts.cpu_handoff, results=opts.cpu_results,
            )  # fmt: skip

    # -- step protocol -------------------------------------------------------------------------

    def begin_step(self, n_new: int, by_layer: bool = False) -> None:
        """Prepare a step that appends `n_new` tokens at positions length .. length + n_new - 1.
        `by_layer` (where `layer_pass_fits`): the step's layers take its chunks one after
        another, each announced by `pass_chunk`."""
        if by_layer and not self.layer_pass_fits(n_new):
            raise ConfigError("this store cannot run the step layer by layer: ask layer_pass_fits first")
        self.writes.flush()  # NOTE: before this step's loads and CPU reads of the host slices
        lay = self.layout
        end = self.length + n_new
        if not by_layer:  # (a pass's chunks set their own)
            self.pass_chunk(0, n_new)
        self._step_tokens = n_new
        if n_new > 1 and isinstance(self.kernel, PrefillAwareKernel):
            self.kernel.begin_prefill()  # before the chunk's activations exist
        if self._plain_limit is not None and self.position + n_new > self._plain_limit:
            raise CapacityError(
                f"this store was planned for {self._capacity} tokens, within the model's sliding window "
                f"({self._plain_limit}), so it runs those layers as plain causal attention; a sequence "
                f"of {self.position + n_new} tokens needs a store planned for its whole length"
            )
        self._fit_windows(n_new)
        if self.evictor is None:
            if end > self._capacity:
                self._grow_resident(lay.round_up(max(end, 2 * self._capacity)))
        else:
            for sid, buf in self.resident.items():
                need = self.slice_length[sid] + n_new
                if need > buf.shape[0]:  # doubling, but never past the capacity the plan counts
                    self._resize_slice(sid, lay.round_up(max(need, min(2 * buf.shape[0], self._capacity))))
        for host in self.hosts.values():
            host.reserve(lay.round_up(end))
        if self.packed is not None:
            self.packed.reserve(lay.round_up(end))
        if self.cpu is not None:
            self._cpu = self.cpu.begin_step(n_new)
        if by_layer:
            assert self.staged is not None
            self._pass = LayerPass(self.staged, self.length)
        elif self.staged is not None:
            self.staged.start(self.length, n_new, self._cpu)

    def layer_pass_fits(self, n_new: int) -> bool:
        """Whether a step of n_new tokens may run layer by layer (`kvtier.kv.layer_pass`): some
        slices stream, each fits a staging buffer whole, and nothing acts on a step's layers
        together (CPU-attended or windowed slices, a codec, an evictor)."""
        plain = self.cpu is None and self.codec is None and self.evictor is None and not self._windowed
        return plain and n_new > 1 and self.staged is not None and pass_fits(self.staged, self.length, n_new)

    def pass_chunk(self, start: int, end: int) -> None:
        """The store's next calls attend tokens [start, end) of the step (counted from its first
        token): each layer's, chunk after chunk, in a layer-by-layer step."""
        positions = torch.arange(self.position + start, self.position + end, device=self.device)
        self._cos, self._sin = self.rotary.cos_sin(positions, self.layout.dtype)
        self._offset = start

    def _fit_windows(self, n_new: int) -> None:
        """Make room for `n_new` tokens in every windowed slice: drop what is past its window
        when the buffer is full (and grow it for a step longer than the plan's chunk)."""
        for sid, window in self._windowed.items():
            buf, n = self.resident[sid], self.slice_length[sid]
            if n + n_new > buf.shape[0]:
                n = self.slice_length[sid] = trim(buf, n, window)
                if n + n_new > buf.shape[0]:
                    self._resize_slice(sid, self.layout.round_up(n + n_new))

    def end_step(self) -> None:
        if self._pass is not None:
            self._pass.close()
            self._pass, self._offset = None, 0
        if self.cpu is not None:
            self.cpu.end_step()  # NOTE: first: raises a CPU slice's error before the length moves
        n_new = self._step_tokens
        self.length += n_new
        self.position += n_new
        self._step_tokens = 0
        for sid in range(len(self.slice_length)):
            self.slice_length[sid] += n_new
        if self.codec is not None and (upto := self.codec.frozen_tokens(self.length)) > self._coded:
            self.writes.flush()
            code_tokens(
                self.codec, self._coded, upto, layout=self.layout, resident=self.resident, hosts=self.hosts,
                packed=self.packed, streams=self.streams, account=self.account,
            )  # fmt: skip
            self._coded = upto
        if self.evictor is not None:
            for sid in sorted(self._evictable):
                keep = self.evictor.keep(sid, self.slice_length[sid], n_new)
                if keep is not None:
                    self._compact(sid, keep)
            self.length = max(self.slice_length)

    def _compact(self, sid: int, keep: torch.Tensor) -> None:
        """Keep tokens `keep` [G, K] (ascending per KV head) of resident slice `sid`, in order
        (`kvtier.kv.resident.compact`), and shrink its buffer if that left it mostly free."""
        buf = self.resident[sid]
        k = self.slice_length[sid] = compact(buf, self.slice_length[sid], keep)
        lay = self.layout
        target = lay.round_up(k + lay.block_size)
        if buf.shape[0] > 2 * target and sid not in self._bounded:  # NOTE: a bounded slice keeps its size
            self._resize_slice(sid, target)

    # -- attention -----------------------------------------------------------------------------

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """`kvtier.attention.Attention`: rotate, append k/v of `layer`, attend. q [T, H_q, D]."""
        lay = self.layout
        if self.rotate_keys:
            q, k, v = self.rotary.rotate_step(q, k, v, self._cos, self._sin)
        # NOTE: one stack per layer and one cat of the outputs, not a copy per slice: with 256
        # head-wise slices per step, per-slice kernel launches are what offload pays for.
        kv = torch.stack((k, v), dim=1)  # [T, 2, H_kv, D]
        if self._cpu and self.cpu is not None and layer in self.cpu.layers:
            return self.cpu.attend_layer(layer, q, kv, self.length, self._attend_slice, self._write_back)
        if q.shape[0] == 1 and self._layer_cached and self.staged is not None and self._pass is None:
            decode = self._step_tokens == 1
            out = self.staged.attend_layer_cached(layer, q, kv, self.slice_length, self.length, decode)
            if out is not None:
                return out
        if lay.num_groups == 1:
            return self._attend_slice(layer, 0, q, kv)
        outs = [
            self._attend_slice(layer, g, q[:, lay.q_heads(g)], kv[:, :, lay.kv_heads(g)])
            for g in range(lay.num_groups)
        ]
        return torch.cat(outs, dim=1)

    def _attend_slice(self, layer: int, group: int, q: torch.Tensor, kv_new: torch.Tensor) -> torch.Tensor:
        """Append the step's kv_new [T, 2, G, D] to slice (layer, group) and attend q [T, H_q_g, D]."""
        sid = self.layout.slice_index(layer, group)
        s, t = self.slice_length[sid] + self._offset, q.shape[0]
        step = SliceStep(layer, group, s, self.attn[layer])
        if sid in self.resident:
            buf = self.resident[sid]
            buf[s : s + t] = kv_new
            return self.kernel(q, buf[: s + t], step)
        if self._pass is not None:
            return self._pass.attend(sid, step, q, kv_new)
        assert self.staged is not None
        return self.staged.attend(sid, step, q, kv_new, self.length, decode=self._step_tokens == 1)

    def _write_back(
        self, sid: int, new: torch.Tensor, after: torch.cuda.Event | None
    ) -> torch.cuda.Event | None:
        """Copy the step's new tokens of a streamed slice to host (`HostWrites.write`); nothing
        else ever moves back."""
        return self.writes.write(sid, new, after, self.length, decode=self._step_tokens == 1)

    # -- memory --------------------------------------------------------------------------------

    @property
    def all_on_device(self) -> bool:
        """Whether every slice lives in device memory (nothing streams over PCIe)."""
        return all(sid in self.on_device for sid in self.hosts)

    def stored_bytes(self) -> dict[str, int]:
        """KV bytes held per tier at the current lengths (not capacity): full-precision resident
        slices, packed slices (rows + uncoded tokens) and full-precision host slices."""
        token = self.layout.token_bytes
        out = {GPU: sum(self.slice_length[s] for s in self.resident) * token, HOST: 0}
        for sid in self.hosts:
            n = self.slice_length[sid]
            nbytes = n * token if self.packed is None else self.packed.stored_bytes(sid, n)
            out[GPU if sid in self.on_device else HOST] += nbytes
        return out

    def _grow_resident(self, tokens: int) -> None:
        if not isinstance(self.memory, CachingMemory):
            raise CapacityError(
                f"the store was planned for {self._capacity:,} tokens in memory it does not own "
                f"and cannot grow to {tokens:,}: plan the request for its whole length"
            )
        for sid, old in self.resident.items():
            if sid in self._windowed:
                continue  # holds its window, not the context
            self.resident[sid] = reallocate(old, self.length, tokens, self.account)
        self._capacity = tokens

    def _resize_slice(self, sid: int, tokens: int) -> None:
        """Reallocate one resident slice to `tokens` tokens, keeping what it stores."""
        self.resident[sid] = reallocate(self.resident[sid], self.slice_length[sid], tokens, self.account)

    def close(self, release_host: bool = True) -> None:
        """Free every tier. The store is unusable afterwards. `release_host=False` leaves its
        pinned host memory in PyTorch's pinned cache, for the next store to reuse without
        pinning it again (`kvtier.kv.tiers.release_pinned_cache`), as does a close within
        `kvtier.kv.tiers.keeping_pinned`."""
        self.writes.drop()
        self.streams.synchronize()
        for buf in self.resident.values():
            self.account.free(GPU, buf.numel() * buf.element_size())
        self.resident.clear()
        if self.ring is not None:
            self.ring.close()
        if self.packed is not None:
            self.packed.close()
        self.storage.close()
        if release_host and not keeps_pinned():
            release_pinned_cache()
