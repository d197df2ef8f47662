"""Offloaded HiP's cached decode steps stay cheap on the GPU: no host-device sync (a tensor's
conversion to Python) on a cached step or on the refill of a cache that covers a refresh
interval, none on a small cache's steps that read nothing stored, and few operator launches a
slice."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from kvtier.config import ModelConfig
from kvtier.kv.store import StoreOptions, TieredKVStore
from kvtier.model.llama import CausalLM
from kvtier.sparse import HipConfig
from kvtier.sparse.opcount import OpCounter
from tests.hf_reference import drive
from tests.hip_store import (
    CHUNK,
    CPU,
    DECODE,
    REFRESH0,
    REFRESH_BYTES,
    SLICES,
    TINY,
    assert_same,
    kernel_for,
    plan,
    run,
)

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
