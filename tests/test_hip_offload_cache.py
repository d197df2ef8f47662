"""HiP's GPU block cache over offloaded KV: what a cache short of a refresh interval keeps (the
final selection first, the new selection out of a step's overflow, least recently used slots
evicted), and the device memory the caches and decode buffers take: sized by the cache's
capacity, freed by `reset` and before a prompt chunk that follows decode, carved from a region
of lent pages, bounded by a short request's tokens, and covered by `hip_gpu_bytes`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from kvtier.config import ModelConfig
from kvtier.kv.device_memory import RegionMemory, fitting, region_buffers
from kvtier.kv.layout import KVLayout
from kvtier.kv.store import StoreOptions, TieredKVStore
from kvtier.model.llama import CausalLM
from kvtier.sparse import HipConfig, HipKernel, cache_bank_bytes, hip_method_buffers, make_hip_kernel
from kvtier.sparse.gpu_cache import BlockCache, block_ids
from tests.hf_reference import drive
from tests.hip_store import (
    CHUNK,
    CPU,
    DECODE,
    PROMPT,
    REFRESH0,
    SLICES,
    TINY,
    TOKEN_BYTES,
    assert_same,
    kernel_for,
    make_store,
    plan,
    run,
)


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
