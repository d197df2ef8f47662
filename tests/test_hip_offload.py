"""HiP sparse attention over offloaded KV: the GPU block cache serves decode between stage-0
refreshes, bitwise equal to HiP over resident KV, and only refreshes and misses cross PCIe."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from kvtier.config import ModelConfig
from kvtier.kv.device_memory import RegionMemory, fitting, region_buffers
from kvtier.kv.layout import KVLayout
from kvtier.kv.reader import KEY_PIECES, SliceReader
from kvtier.kv.store import StoreOptions, TieredKVStore
from kvtier.methods.spec import parse_choice
from kvtier.model.llama import CausalLM
from kvtier.sparse import HipConfig, HipKernel, cache_bank_bytes, hip_method_buffers, make_hip_kernel
from kvtier.sparse.gpu_cache import BlockCache, block_ids
from kvtier.sparse.opcount import OpCounter
from tests.hf_reference import drive
from tests.hip_store import (
    CHUNK,
    CPU,
    DECODE,
    PROMPT,
    REFRESH0,
    REFRESH_BYTES,
    SLICES,
    TINY,
    TOKEN_BYTES,
    assert_same,
    kernel_for,
    make_store,
    plan,
    run,
)


@pytest.mark.parametrize("extend,per_head", [(True, False), (False, False), (True, True)])
def test_offloaded_hip_is_bitwise_resident_hip_and_streams_only_refreshes(
    gqa: tuple[CausalLM, ModelConfig], extend: bool, per_head: bool
) -> None:
    model, cfg = gqa
    ref = kernel_for(cfg, extend=extend, per_head=per_head)
    ref_logits, ref_tokens, _, _ = run(model, cfg, "gpu", ref)
    kernel = kernel_for(cfg, extend=extend, per_head=per_head)
    logits, tokens, store, h2d = run(model, cfg, "head", kernel)
    assert tokens == ref_tokens
    assert_same(logits, ref_logits)
    assert kernel.stats.decode_recomputes == ref.stats.decode_recomputes
    # Default capacity: every cached step hits; only refresh steps stream, nothing is fetched.
    st = kernel.stats.cache
    assert st.misses == 0 and st.fetched_bytes == 0 and st.cached_steps > 0
    assert kernel.stats.hit_rate == 1.0
    assert st.appended == SLICES * sum((PROMPT + k) % 4 == 0 for k in range(DECODE) if k % REFRESH0)
    assert h2d == REFRESH_BYTES
    every_step = sum(PROMPT + k for k in range(DECODE)) * SLICES * TOKEN_BYTES
    assert h2d * 4 < every_step
    # New tokens still reach the host once each.
    assert store.account.d2h_bytes == SLICES * (PROMPT + DECODE) * TOKEN_BYTES


def test_small_cache_misses_fetch_and_stay_bitwise(gqa: tuple[CausalLM, ModelConfig]) -> None:
    model, cfg = gqa
    ref_logits, ref_tokens, _, _ = run(model, cfg, "gpu", kernel_for(cfg))
    kernel = kernel_for(cfg, cache_tokens=24)  # 6 blocks of 4: less than one step reads
    logits, tokens, _, h2d = run(model, cfg, "head", kernel)
    assert tokens == ref_tokens
    assert_same(logits, ref_logits)
    st = kernel.stats.cache
    assert st.misses > 0 and st.fetched_bytes > 0
    assert 0.0 < kernel.stats.hit_rate < 1.0
    assert st.hits + st.misses == st.lookups
    # Refreshes stream whole slices; everything else that crossed PCIe is a fetched miss.
    assert h2d == REFRESH_BYTES + st.fetched_bytes
    assert kernel.gpu_cache_bytes() == SLICES * (6 * 4 * TOKEN_BYTES + 2 * 6 * 8)


@pytest.mark.parametrize(
    "extend,per_head,cache,indexed",
    [
        (True, False, 24, (0, 1, 2)),
        (True, False, 40, ()),
        (False, False, 40, ()),
        (True, True, 24, (1,)),
        (True, False, None, ()),  # a cache that covers a refresh interval
        (True, True, None, (0,)),
    ],
)
def test_stage_0_scored_on_host_keys_is_bitwise_and_streams_no_slice_in_decode(
    gqa: tuple[CausalLM, ModelConfig],
    extend: bool,
    per_head: bool,
    cache: int | None,
    indexed: tuple[int, ...],
) -> None:
    """`host_scoring`: every decode step of a streamed slice is served from its block cache (one
    short of a refresh interval, or one that covers it, whose later steps then read it without
    lookups); a step that runs stage 0, the first included, scores keys read from the host tier
    (half a token's bytes) and reads the rest through the cache, so no decode step streams a
    slice whole. Tokens, logits and the stages' reruns are those of HiP over resident KV
    (relative, chunk-indexed and absolute scoring); the bytes moved are exactly the keys of
    every stage-0 run's candidates (sink to window) and the misses fetched (the stage-0 output
    a streamed step copies into the cache from the staged slice is fetched here)."""
    model, cfg = gqa
    opts = {"extend": extend, "per_head": per_head, "chunk_indexed_layers": indexed}  # RoPE modes
    ref = kernel_for(cfg, **opts)
    ref_logits, ref_tokens, _, _ = run(model, cfg, "gpu", ref)
    kernel = kernel_for(cfg, **opts, cache_tokens=cache, host_scoring=True)
    logits, tokens, _, h2d = run(model, cfg, "head", kernel)
    assert tokens == ref_tokens
    assert_same(logits, ref_logits)
    assert kernel.stats.decode_recomputes == ref.stats.decode_recomputes
    w0 = [PROMPT + k - TINY["window"] + 1 for k in range(0, DECODE, REFRESH0)]  # type: ignore[operator]
    keys = sum(w - TINY["sink"] for w in w0) * SLICES * TOKEN_BYTES // 2  # type: ignore[operator]
    assert h2d == keys + kernel.stats.cache.fetched_bytes
    assert keys < REFRESH_BYTES // 2  # streamed, those steps sent whole slices


def test_host_keys_free_the_staging_buffers_in_decode_and_prefill_makes_them_again(
    gqa: tuple[CausalLM, ModelConfig],
) -> None:
    """With host keys no decode step loads a slice, so the store gives its staging buffers back
    while it decodes (their GPU bytes leave the account) and makes them again for a prefill
    chunk that follows (a turn appended to the conversation); every logit is resident HiP's."""
    model, cfg = gqa
    gen = torch.Generator().manual_seed(3)
    first, more = (torch.randint(0, cfg.vocab_size, (n,), generator=gen) for n in (PROMPT - 40, 24))

    def turns(store: TieredKVStore, ring: list[int]) -> list[torch.Tensor]:
        out, _ = drive(model, store, first, CHUNK, 8)
        ring.append(store.account.allocated["gpu"])
        tail, _ = drive(model, store, more, CHUNK, 8)  # prefill chunks again, then decode
        ring.append(store.account.allocated["gpu"])
        return out + tail

    ref_store = make_store(cfg, "gpu", kernel_for(cfg))
    ref = turns(ref_store, [])
    store = make_store(cfg, "head", kernel_for(cfg, cache_tokens=24, host_scoring=True))
    assert store.ring is not None
    staging, held = store.ring.nbytes, store.account.allocated["gpu"]
    gpu: list[int] = []
    assert_same(turns(store, gpu), ref)
    assert gpu == [held - staging, held - staging]  # decoding: given back; remade for the chunks
    assert store.account.peak["gpu"] == held
    streaming = make_store(cfg, "head", kernel_for(cfg, cache_tokens=24))
    drive(model, streaming, first, CHUNK, 8)
    assert streaming.account.allocated["gpu"] == held  # without host keys decode streams: kept


def test_stage_0_on_host_keys_over_an_int4_tier_is_bitwise_streaming_it(
    gqa: tuple[CausalLM, ModelConfig], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Over an int4 host tier (keys and values share packed rows, so stage 0's keys are read
    from whole rows and unpacked): the same tokens and logits as streaming the packed slices."""
    model, cfg = gqa
    codec = parse_choice("int4").codec
    ref_logits, ref_tokens, _, _ = run(model, cfg, "head", kernel_for(cfg, cache_tokens=24), codec=codec())
    kernel = kernel_for(cfg, cache_tokens=24, host_scoring=True)
    pieces: list[tuple[int, int, int]] = []  # (range asked, largest piece unpacked, pieces)
    keys, read = SliceReader.keys, SliceReader.__call__

    def counted_keys(self: SliceReader, start: int, end: int) -> torch.Tensor:
        sizes: list[int] = []

        def piece(reader: SliceReader, lo: int, hi: int) -> torch.Tensor:
            sizes.append(hi - lo)
            return read(reader, lo, hi)

        monkeypatch.setattr(SliceReader, "__call__", piece)
        try:
            return keys(self, start, end)
        finally:
            monkeypatch.setattr(SliceReader, "__call__", read)
            pieces.append((end - start, max(sizes), len(sizes)))

    monkeypatch.setattr(SliceReader, "keys", counted_keys)
    logits, tokens, _, _ = run(model, cfg, "head", kernel, codec=codec())
    assert tokens == ref_tokens
    assert_same(logits, ref_logits)
    assert kernel.stats.cache.misses > 0
    # keys and values are unpacked a piece at a time (rows of `group` tokens), not a range whole
    group = codec().group
    assert any(n > 2 * group for n, _, _ in pieces)
    for n, largest, count in pieces:
        assert largest <= max(group, -(-n // KEY_PIECES) + group) and count <= KEY_PIECES + 2


def test_a_cache_short_of_stage_0_keeps_the_final_selection_first(
    gqa: tuple[CausalLM, ModelConfig], monkeypatch: pytest.MonkeyPatch
) -> None:
    """40 tokens (10 blocks) hold the sinks, the window and the final selection but not all of
    stage 0's output: a refresh keeps those first (then stage 1's, then stage 0's), so the steps
    until the next rerun hit. Keeping stage 0's blocks in position order instead misses more."""
    model, cfg = gqa
    refresh = (REFRESH0, 3, 2)
    ref_logits, ref_tokens, _, _ = run(model, cfg, "gpu", kernel_for(cfg, refresh=refresh))

    def by_position(
        self: HipKernel, step: Any, groups: int, device: torch.device, slots: int, within: Any = None
    ) -> torch.Tensor:
        st = self._cache[(step.layer, step.group, -1)]
        window = torch.arange(st.window_start, step.start + 1)
        blocks = block_ids(torch.cat((torch.arange(2), st.outputs[0], window)), 4)
        return blocks if within is None else blocks[torch.isin(blocks, within)]

    misses = {}
    for fill in ("priority", "position"):
        kernel = kernel_for(cfg, cache_tokens=40, refresh=refresh)
        if fill == "position":
            monkeypatch.setattr(kernel, "_keep_blocks", by_position.__get__(kernel))
        logits, tokens, _, _ = run(model, cfg, "head", kernel)
        assert tokens == ref_tokens
        assert_same(logits, ref_logits)
        misses[fill] = kernel.stats.cache.misses
    assert 0 < misses["priority"] < misses["position"]


def test_after_a_step_that_overflows_the_cache_keeps_the_new_selection(
    gqa: tuple[CausalLM, ModelConfig], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stage rerun reads more candidates than 32 tokens hold, so some sit in the step's
    overflow. Keeping the new final selection and stage 1's output out of it (`_keep_read`)
    lets the next reruns hit; without it they miss and fetch from the host."""
    model, cfg = gqa
    refresh = (12, 4, 2)
    ref_logits, ref_tokens, _, _ = run(model, cfg, "gpu", kernel_for(cfg, refresh=refresh))
    misses = {}
    for keep in (True, False):
        kernel = kernel_for(cfg, cache_tokens=32, refresh=refresh)
        if not keep:
            monkeypatch.setattr(kernel, "_keep_read", lambda *a: None)
        logits, tokens, _, _ = run(model, cfg, "head", kernel)
        assert tokens == ref_tokens
        assert_same(logits, ref_logits)
        misses[keep] = kernel.stats.cache.misses
    assert 0 < misses[True] < misses[False]


def test_cache_memory_follows_capacity_and_reset_frees_it(gqa: tuple[CausalLM, ModelConfig]) -> None:
    model, cfg = gqa
    kernel = kernel_for(cfg)
    run(model, cfg, "head", kernel)
    hip = HipConfig(**TINY)  # type: ignore[arg-type]
    # sink 1 block + 4 chunks x 3 blocks + (6 + 6) / 4 + 1 window blocks + 1 = 18 blocks
    assert hip.offload_cache_tokens() == 4 * 18
    assert kernel.gpu_cache_bytes() == SLICES * (18 * 4 * TOKEN_BYTES + 2 * 18 * 8)
    kernel.reset()
    assert kernel.gpu_cache_bytes() == 0


def second_turn(
    model: CausalLM,
    store: TieredKVStore,
    chunk: torch.Tensor,
    logits: list[torch.Tensor],
    tokens: list[int],
    began: Callable[[], None] = lambda: None,
    steps: int = 8,
) -> None:
    """After decode steps, a prompt `chunk` as one step (`began` runs once the store began it),
    then `steps` greedy tokens; appends to `logits` and `tokens`."""
    store.begin_step(chunk.shape[0])
    began()
    logits.append(model(chunk, store, logits_at=torch.arange(chunk.shape[0])))
    store.end_step()
    for _ in range(steps):
        tokens.append(int(logits[-1][-1].argmax()))
        store.begin_step(1)
        logits.append(model(torch.tensor([tokens[-1]]), store))
        store.end_step()


@pytest.mark.parametrize("per_head", [False, True])
def test_block_caches_placed_in_a_region_come_from_it_once_and_stay_bitwise(
    gqa: tuple[CausalLM, ModelConfig], per_head: bool
) -> None:
    """A store over memory it was given (a server's lent pages) hands the kernel that memory
    after its own buffers (`place_caches`): the RoPE table, then each streamed slice's decode
    rows and block cache (a bank of `cache_bank_bytes`) come from it, where `region_buffers`
    plus HiP's `method_buffers` (`hip_method_buffers`) say. A prompt chunk after decode empties
    the caches but keeps them (a region frees nothing piecewise), so the region's use does not
    grow; tokens and logits equal the caching allocator's."""
    model, cfg = gqa
    ids = torch.randint(0, cfg.vocab_size, (PROMPT,), generator=torch.Generator().manual_seed(9))
    hip = kernel_for(cfg, per_head=per_head).cfg
    bank = cache_bank_bytes(cfg, hip, 1, 4)
    lay = KVLayout.of(cfg, 1, 5, torch.float32)
    method = hip_method_buffers(cfg, hip, 1, 4, PROMPT + DECODE, [True] * SLICES)
    assert len(method) == 2 + SLICES  # cos, sin, then a slice's rows and bank each
    sizes = region_buffers(lay, plan("head"), PROMPT + DECODE) + list(method)
    region = torch.zeros(fitting(sizes, 1 << 40), dtype=torch.uint8)
    lo, hi = region.data_ptr(), region.data_ptr() + region.numel()
    runs: dict[str, tuple[list[torch.Tensor], list[int]]] = {}
    for where in ("allocator", "region"):
        kernel = kernel_for(cfg, per_head=per_head, capacity=PROMPT + DECODE)
        memory = RegionMemory(region) if where == "region" else None
        store = TieredKVStore(
            cfg, plan("head"), device=CPU, dtype=torch.float32, capacity=PROMPT + DECODE,
            options=StoreOptions(block_size=5, extent_blocks=4), kernel=kernel,
            rotate_keys=not kernel.needs_unrotated_keys, memory=memory,
        )  # fmt: skip
        logits, tokens = drive(model, store, ids[:104], CHUNK, 8)
        banks = {sl: c.bank.data_ptr() for sl, c in kernel._gpu.items()}
        rows = [t.data_ptr() for pair in kernel._rows.values() for t in pair]
        assert kernel.rotary is not None
        rope = [kernel.rotary._cos.data_ptr(), kernel.rotary._sin.data_ptr()]
        used = None if memory is None else memory.used
        second_turn(model, store, ids[104:], logits, tokens)
        if memory is not None:
            assert len(banks) == SLICES and all(lo <= p < hi for p in banks.values())
            assert len(rows) == 2 * SLICES and all(lo <= p < hi for p in rows + rope)
            assert {sl: c.bank.data_ptr() for sl, c in kernel._gpu.items()} == banks  # the same banks
            assert all(c.bank.numel() * 4 == bank for c in kernel._gpu.values())
            assert memory.used == used and memory.spilled == 0 and region.numel() - memory.used < 512
        else:
            assert not rows and all(not lo <= p < hi for p in [*banks.values(), *rope])
        runs[where] = logits, tokens
        store.close()
    assert runs["region"][1] == runs["allocator"][1]
    assert_same(runs["region"][0], runs["allocator"][0])


def test_a_short_requests_decode_memory_is_bounded_by_its_tokens_and_stays_bitwise(
    gqa: tuple[CausalLM, ModelConfig],
) -> None:
    """HiP's block caches and decode rows hold at most the request's tokens (`HipConfig.capacity`):
    an 18-token request (12 prompt, 6 decoded) over streamed slices takes 60-token caches (3
    stage-0 chunks, not 4) and 19-row buffers where the preset's are 72 and 23; a region sized
    by `hip_method_buffers` for that length holds them exactly; tokens and logits equal
    resident KV's and an unbounded kernel's. (A 304-token HiP request on an 8B model under 24
    GiB could not be served: the preset-sized caches took 2.08 GB of a 1.88 GB offload
    reserve.)"""
    model, cfg = gqa
    prompt, new = 12, 6
    cap = prompt + new
    ids = torch.randint(0, cfg.vocab_size, (prompt,), generator=torch.Generator().manual_seed(3))
    lay = KVLayout.of(cfg, 1, 5, torch.float32)
    runs = {}
    cases = (("resident", "gpu", None), ("unbounded", "head", None), ("bounded", "head", cap))
    for name, policy, capacity in cases:
        kernel = kernel_for(cfg, capacity=capacity)
        memory = None
        if capacity is not None:
            assert kernel.cfg.offload_cache_tokens() == 60 and kernel.cfg.decode_buffer_tokens() == cap + 1
            method = hip_method_buffers(cfg, kernel.cfg, 1, 4, cap, [True] * SLICES)
            assert method == hip_method_buffers(cfg, HipConfig(**TINY), 1, 4, cap, [True] * SLICES)  # type: ignore[arg-type]
            sizes = region_buffers(lay, plan(policy), cap) + list(method)
            memory = RegionMemory(torch.zeros(fitting(sizes, 1 << 40), dtype=torch.uint8))
        store = TieredKVStore(
            cfg, plan(policy), device=CPU, dtype=torch.float32, capacity=cap,
            options=StoreOptions(block_size=5, extent_blocks=4), kernel=kernel,
            rotate_keys=not kernel.needs_unrotated_keys, memory=memory,
        )  # fmt: skip
        runs[name] = drive(model, store, ids, CHUNK, new)
        if memory is not None:
            banks = list(kernel._gpu.values())
            assert len(banks) == SLICES and all(c.slots == 15 for c in banks)
            assert all(k.shape[0] == cap + 1 for pair in kernel._rows.values() for k in pair)
            assert memory.spilled == 0 and memory.region.numel() - memory.used < 512
        store.close()
    for name in ("unbounded", "bounded"):
        assert runs[name][1] == runs["resident"][1]
        assert_same(runs[name][0], runs["resident"][0])


def test_more_prompt_after_decode_frees_the_decode_caches_first(gqa: tuple[CausalLM, ModelConfig]) -> None:
    """A prompt chunk after decode steps (the next chat turn): the store's multi-token step frees
    HiP's block caches and decode buffers before the chunk runs, so prefill's activations and
    decode's caches need not fit at once; the run stays bitwise equal to HiP over resident KV."""
    model, cfg = gqa
    ids = torch.randint(0, cfg.vocab_size, (PROMPT,), generator=torch.Generator().manual_seed(9))
    runs: dict[str, tuple[list[torch.Tensor], list[int]]] = {}
    for policy in ("gpu", "head"):
        kernel = kernel_for(cfg)
        store = make_store(cfg, policy, kernel)
        logits, tokens = drive(model, store, ids[:104], CHUNK, 8)
        held = kernel.gpu_cache_bytes() + kernel.attend_buffer_bytes()

        def freed(k: HipKernel = kernel) -> None:
            assert k.gpu_cache_bytes() + k.attend_buffer_bytes() == 0

        second_turn(model, store, ids[104:], logits, tokens, freed)
        assert held > 0 and kernel.gpu_cache_bytes() + kernel.attend_buffer_bytes() > 0  # refilled
        runs[policy] = logits, tokens
        store.close()
    assert runs["head"][1] == runs["gpu"][1]
    assert_same(runs["head"][0], runs["gpu"][0])


@pytest.mark.parametrize("host_scoring", [False, True])
def test_a_new_sequence_without_reset_does_not_reuse_stale_blocks(
    gqa: tuple[CausalLM, ModelConfig], host_scoring: bool
) -> None:
    model, cfg = gqa
    ref_logits, ref_tokens, _, _ = run(model, cfg, "gpu", kernel_for(cfg), seed=8)
    kernel = kernel_for(cfg, host_scoring=host_scoring)
    run(model, cfg, "head", kernel, seed=7)
    logits, tokens, _, _ = run(model, cfg, "head", kernel, seed=8)  # same kernel, next sequence
    assert tokens == ref_tokens
    assert_same(logits, ref_logits)


def test_block_cache_evicts_least_recently_used_slots() -> None:
    cache = BlockCache(3, 2, (1,), torch.float32, CPU)

    def load(missing: torch.Tensor) -> torch.Tensor:
        return missing[:, None, None].float().expand(-1, 2, 1)  # block b holds rows of value b

    t = cache.ensure(torch.tensor([0, 1, 2]), load)  # tick 1: all miss, slots 0, 1, 2
    assert (t.hits, t.stored) == (0, 3) and t.extra is None
    cache.ensure(torch.tensor([1]), load)  # tick 2: block 1 used
    cache.ensure(torch.tensor([2]), load)  # tick 3: block 2 used
    t = cache.ensure(torch.tensor([2, 5]), load)  # tick 4: block 0 (slot 0) is the LRU victim
    assert (t.hits, t.stored) == (1, 1)
    assert cache.ids.tolist() == [5, 1, 2]
    t = cache.ensure(torch.tensor([3, 4, 6, 7]), load)  # 4 misses, 3 slots: one overflows
    assert (t.hits, t.stored) == (0, 3) and t.extra is not None
    assert sorted(cache.ids.tolist()) == [3, 4, 6]
    assert cache.lookup(torch.tensor([7, 5])).tolist() == [-1, -1]


SYNCS = ("item", "tolist", "__bool__", "__int__", "__index__", "__float__", "nonzero")


def recording_syncs(fn: Callable[..., Any], calls: list[str]) -> Callable[..., Any]:
    """`fn`, appending to `calls` the name of every tensor-to-Python conversion (and `unique`) it
    makes: each one is a host-device sync on the GPU."""

    def counted(*args: object, **kwargs: object) -> Any:
        with pytest.MonkeyPatch.context() as m:
            for name in SYNCS:
                orig = getattr(torch.Tensor, name)
                m.setattr(
                    torch.Tensor, name, lambda *a, _n=name, _f=orig, **k: calls.append(_n) or _f(*a, **k)
                )
            unique = torch.unique
            m.setattr(torch, "unique", lambda *a, **k: calls.append("unique") or unique(*a, **k))
            return fn(*args, **kwargs)

    return counted


@pytest.mark.parametrize("extend,per_head", [(True, False), (False, False), (True, True)])
def test_cached_steps_make_no_host_sync_with_the_default_cache(
    gqa: tuple[CausalLM, ModelConfig], monkeypatch: pytest.MonkeyPatch, extend: bool, per_head: bool
) -> None:
    """Every Python conversion of a tensor is a host-device sync on the GPU: a cached step of a
    cache that covers the refresh interval makes none (with stages 1.. due or not)."""
    model, cfg = gqa
    kernel = kernel_for(cfg, extend=extend, per_head=per_head)
    calls: list[str] = []
    monkeypatch.setattr(kernel, "attend_cached", recording_syncs(kernel.attend_cached, calls))
    monkeypatch.setattr(kernel, "attend_cached_layer", recording_syncs(kernel.attend_cached_layer, calls))
    run(model, cfg, "head", kernel)
    assert kernel.stats.cache.cached_steps == SLICES * sum(1 for k in range(DECODE) if k % REFRESH0)
    assert calls == []


def test_a_small_cache_appends_without_syncs_on_steps_that_read_nothing_stored(
    gqa: tuple[CausalLM, ModelConfig], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a cache short of a refresh interval, a step where no stage is due reads only its
    gathered buffer and the new token: it appends the token to the cache with no lookup and no
    sync. Steps with a due stage still look up (and fetch misses). Output stays bitwise."""
    model, cfg = gqa
    refresh = (REFRESH0, 3, 2)  # stage 2 every other step: half the cached steps append only
    ref_logits, ref_tokens, _, _ = run(model, cfg, "gpu", kernel_for(cfg, refresh=refresh))
    kernel = kernel_for(cfg, cache_tokens=40, refresh=refresh)
    syncs: list[int] = []

    def counting(fn: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*a: Any, **k: Any) -> Any:
            calls: list[str] = []
            before = kernel.stats.cache.cached_steps
            out = recording_syncs(fn, calls)(*a, **k)
            syncs.extend([len(calls)] * (kernel.stats.cache.cached_steps - before))  # a slice each
            return out

        return counted

    monkeypatch.setattr(kernel, "attend_cached", counting(kernel.attend_cached))
    monkeypatch.setattr(kernel, "attend_cached_layer", counting(kernel.attend_cached_layer))
    logits, tokens, _, _ = run(model, cfg, "head", kernel)
    assert tokens == ref_tokens
    assert_same(logits, ref_logits)
    assert kernel.stats.cache.lookups > 0 and kernel.stats.cache.misses > 0
    assert len(syncs) >= SLICES * 6 and set(syncs) == {0}


# Operators (non-view aten ops, i.e. GPU launches) one cached decode step of one slice may run.
# A step that recomputes no stage appends one token to the block cache and the gathered
# attention rows and attends them; stage recomputations are paid every refresh[i] steps.
OPS_PLAIN_STEP = 20
OPS_MEAN_STEP = 64


@pytest.mark.parametrize("extend,per_head", [(True, False), (False, False)])
def test_cached_steps_launch_few_operators(
    gqa: tuple[CausalLM, ModelConfig], monkeypatch: pytest.MonkeyPatch, extend: bool, per_head: bool
) -> None:
    """Offloaded HiP decode is launch-bound (one small step per slice): count what a cached step
    runs so the per-slice operator count cannot creep back up."""
    model, cfg = gqa
    kernel = kernel_for(cfg, extend=extend, per_head=per_head, refresh=(REFRESH0, 3, 2))
    plain: list[float] = []  # operators a slice of the steps that recompute nothing
    every: list[float] = []  # operators a slice
    layered: list[int] = []  # slices of each layer served at once

    def counting(fn: Callable[..., Any], layer: bool) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            before = sum(kernel.stats.decode_recomputes)
            with OpCounter() as ops:
                out = fn(*args, **kwargs)
            if out is None:  # the layer path declined before running anything
                assert ops.total == 0
                return out
            slices = len(args[2]) if layer else 1
            if layer:
                layered.append(slices)
            every.extend([ops.total / slices] * slices)
            if sum(kernel.stats.decode_recomputes) == before:
                plain.extend([ops.total / slices] * slices)
            return out

        return counted

    monkeypatch.setattr(kernel, "attend_cached", counting(kernel.attend_cached, False))
    monkeypatch.setattr(kernel, "attend_cached_layer", counting(kernel.attend_cached_layer, True))
    run(model, cfg, "head", kernel)
    assert plain and len(plain) < len(every)
    # Steps that recompute nothing are served a layer (2 slices) at a time.
    assert layered and set(layered) == {SLICES // 3} and sum(layered) == len(plain)
    assert max(plain) <= OPS_PLAIN_STEP, sorted(plain)
    assert sum(every) / len(every) <= OPS_MEAN_STEP, sum(every) / len(every)


def test_refresh_fill_of_a_covering_cache_makes_no_host_sync(
    gqa: tuple[CausalLM, ModelConfig], monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a refresh step streamed a slice, a cache that covers the interval is refilled with
    static shapes (`BlockCache.refill`): no `unique`, no lookups read back, so the next slice's
    stream can overlap it."""
    model, cfg = gqa
    kernel = kernel_for(cfg)
    calls: list[str] = []
    monkeypatch.setattr(kernel, "_fill", recording_syncs(kernel._fill, calls))
    _, _, _, h2d = run(model, cfg, "head", kernel)
    assert h2d == REFRESH_BYTES and kernel.stats.cache.refresh_inserted > 0
    assert calls == []


def test_a_cache_bounded_by_a_short_request_still_covers_and_refills_without_syncs(
    gqa: tuple[CausalLM, ModelConfig], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 20-token request's default cache is cut to the stage-0 chunks it can hold (3 of 4) and
    the blocks it fills, yet still covers a refresh interval: refills take static shapes (no
    host sync), as the preset-sized cache's do."""
    model, cfg = gqa
    cap = 20
    kernel = kernel_for(cfg, capacity=cap)
    assert kernel.cfg.offload_cache_tokens() < HipConfig(**TINY).offload_cache_tokens()  # type: ignore[arg-type]
    calls: list[str] = []
    monkeypatch.setattr(kernel, "_fill", recording_syncs(kernel._fill, calls))
    ids = torch.randint(0, cfg.vocab_size, (14,), generator=torch.Generator().manual_seed(2))
    store = TieredKVStore(
        cfg, plan("head"), device=CPU, dtype=torch.float32, capacity=cap,
        options=StoreOptions(block_size=5, extent_blocks=4), kernel=kernel,
        rotate_keys=not kernel.needs_unrotated_keys,
    )  # fmt: skip
    drive(model, store, ids, CHUNK, cap - 14)
    store.close()
    assert kernel.stats.cache.refresh_inserted > 0 and calls == []


@pytest.mark.parametrize("sink,window", [(256, 6), (2, 3), (1, 2)])
def test_offloaded_hip_matches_resident_when_window_or_sinks_share_the_new_tokens_block(
    gqa: tuple[CausalLM, ModelConfig], sink: int, window: int
) -> None:
    """A context shorter than the sinks (the window lies inside the sink blocks), or a window
    shorter than a cache block (the stage-0 selection shares the new token's block): the block
    the new token is appended to must be cached once, or a stale copy is read back."""
    model, cfg = gqa
    over = {"sink": sink, "window": window}
    ref_logits, ref_tokens, _, _ = run(model, cfg, "gpu", kernel_for(cfg, **over))
    logits, tokens, _, _ = run(model, cfg, "head", kernel_for(cfg, **over))
    assert tokens == ref_tokens
    assert_same(logits, ref_logits)


def test_hip_gpu_bytes_cover_the_block_caches_and_buffers_a_run_allocates(
    gqa: tuple[CausalLM, ModelConfig],
) -> None:
    """What the engine takes off the GPU budget for HiP bounds what the kernel holds."""
    from kvtier.sparse import hip_gpu_bytes

    model, cfg = gqa
    kernel, _ = make_hip_kernel(cfg, CPU, "default")
    assert isinstance(kernel, HipKernel)
    run(model, cfg, "head", kernel)
    held = kernel.gpu_cache_bytes() + kernel.attend_buffer_bytes()
    assert 0 < held <= hip_gpu_bytes(cfg, "default", dtype_bytes=4)
    # With context extension the RoPE table covers the positions too.
    assert kernel.rotary is not None
    table = 2 * kernel.rotary._cos.numel() * 4
    assert 0 < held + table <= hip_gpu_bytes(cfg, "default", dtype_bytes=4, context=PROMPT + DECODE)


@pytest.mark.parametrize("host_scoring", [False, True])
def test_a_context_shorter_than_the_sinks_streams_like_resident_kv(
    gqa: tuple[CausalLM, ModelConfig], host_scoring: bool
) -> None:
    """A prompt shorter than the sinks (every key a sink: the window would start past the
    query) decodes over streamed slices, filling and reading their block caches, with the
    tokens and logits of resident KV. (`kvtier generate --attention hip --kv head` on a
    5-token prompt failed in the block cache's bookkeeping: an arange from 256 down to 5.)"""
    model, cfg = gqa
    ids = torch.randint(0, cfg.vocab_size, (5,), generator=torch.Generator().manual_seed(4))
    runs = {}
    for policy in ("gpu", "head"):
        # a cache smaller than a refresh interval's reads: the full steps rank what it keeps
        kernel = kernel_for(cfg, sink=16, window=8, cache_tokens=8, host_scoring=host_scoring)
        store = make_store(cfg, policy, kernel)
        runs[policy] = drive(model, store, ids, CHUNK, 12)
        store.close()
    assert runs["head"][1] == runs["gpu"][1]
    assert_same(runs["head"][0], runs["gpu"][0])
