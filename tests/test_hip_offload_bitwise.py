"""HiP sparse attention over offloaded KV decodes bitwise as HiP over resident KV, and only what
it must crosses PCIe: whole slices at stage-0 refreshes (or, with host keys, `host_scoring`, their
keys alone, with the staging buffers given back while decoding) plus the block cache's misses.
Also over an int4 host tier, for a next sequence on the same kernel, for sinks or a window that
share the new token's block, and for a context shorter than the sinks."""

from __future__ import annotations

import pytest
import torch

from kvtier.config import ModelConfig
from kvtier.kv.reader import KEY_PIECES, SliceReader
from kvtier.kv.store import TieredKVStore
from kvtier.methods.spec import parse_choice
from kvtier.model.llama import CausalLM
from tests.hf_reference import drive
from tests.hip_store import (
    CHUNK,
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
