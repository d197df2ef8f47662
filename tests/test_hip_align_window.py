"""`HipConfig.align_window`: decode's window starts at a stage-0 chunk boundary, so stage 0
scores whole chunks only and every selection of a stage has one size (no partial chunk to trim
with a host sync, no layer graph declined for sizes that differ). The same output resident,
streamed or scored on host keys; a different lossy method than the default's window."""

from __future__ import annotations

from dataclasses import replace

import torch

from kvtier.config import ModelConfig
from kvtier.model.llama import CausalLM
from kvtier.sparse import HipConfig
from kvtier.sparse.gpu_cache import block_ids
from tests.hip_store import TINY, assert_same, kernel_for, run


def test_an_aligned_window_decodes_the_same_resident_streamed_or_on_host_keys(
    gqa: tuple[CausalLM, ModelConfig],
) -> None:
    """Resident slices, slices streamed head by head, and stage 0 scored on keys read from the
    host tier (whose block cache must cover the larger window: `attend_cached` asserts it did
    not overflow) give the same tokens and logits with the window aligned."""
    model, cfg = gqa
    ref_logits, ref_tokens, _, _ = run(model, cfg, "gpu", kernel_for(cfg, align_window=True))
    for opts in ({}, {"host_scoring": True}):
        logits, tokens, _, _ = run(model, cfg, "head", kernel_for(cfg, align_window=True, **opts))
        assert tokens == ref_tokens, opts
        assert_same(logits, ref_logits)


def test_stage_0_keeps_whole_chunks_and_the_window_starts_at_a_chunk_boundary(
    gqa: tuple[CausalLM, ModelConfig],
) -> None:
    """After decode, every slice's state starts its window at sink + k * chunk_sizes[0], at
    most a chunk before the unaligned start, and its stage-0 selection is whole chunks (the
    unaligned default keeps a partial chunk somewhere over these 20 steps)."""
    model, cfg = gqa
    sink, c0 = TINY["sink"], TINY["chunk_sizes"][0]  # type: ignore[index]
    partial = []
    for align in (True, False):
        kernel = kernel_for(cfg, align_window=align, host_scoring=True)
        run(model, cfg, "head", kernel)
        states = list(kernel._cache.values())
        assert states
        for st in states:
            starts_aligned = (st.window_start - sink) % c0 == 0  # type: ignore[operator]
            whole = st.outputs[0].numel() % c0 == 0
            if align:
                assert starts_aligned and whole, (st.window_start, st.outputs[0].numel())
                rerun_at = st.position - (st.step - st.computed_at[0])  # the query stage 0 last ran for
                assert 0 <= kernel._window_start(rerun_at) - st.window_start < c0
            partial.append(not whole)
    assert any(partial), "the unaligned default never kept a partial chunk: the test shows nothing"


def test_the_aligned_window_is_another_lossy_method(gqa: tuple[CausalLM, ModelConfig]) -> None:
    """It attends more recent tokens than the default's window, so decode's logits differ."""
    model, cfg = gqa
    aligned, _, _, _ = run(model, cfg, "gpu", kernel_for(cfg, align_window=True))
    default, _, _, _ = run(model, cfg, "gpu", kernel_for(cfg))
    assert len(aligned) == len(default)
    assert any(not torch.equal(a, b) for a, b in zip(aligned[-20:], default[-20:], strict=True))


def test_buffers_and_block_caches_grow_by_up_to_a_chunk() -> None:
    """A decode buffer holds up to chunk_sizes[0] - 1 more rows, a block cache that many more
    tokens in whole blocks; with a `capacity` the window still stops at what the request fills."""
    hip = HipConfig()
    aligned = replace(hip, align_window=True)
    c0, b = hip.chunk_sizes[0], hip.cache_block
    assert aligned.decode_buffer_tokens() - hip.decode_buffer_tokens() == c0 - 1
    assert aligned.offload_cache_tokens() - hip.offload_cache_tokens() == -(-(c0 - 1) // b) * b
    short = replace(hip, capacity=300)
    assert replace(short, align_window=True).offload_cache_tokens() == short.offload_cache_tokens()


def test_a_stage_0_rerun_on_host_keys_knows_its_blocks_without_unique(
    gqa: tuple[CausalLM, ModelConfig],
) -> None:
    """With the window aligned (and sinks and chunks whole blocks) a stage-0 rerun on host keys
    builds its blocks without `unique`: the blocks `block_ids` finds in its positions, and the
    same tokens and logits as resident slices."""
    model, cfg = gqa
    opts = {"align_window": True, "sink": 4}  # TINY's 2 sinks are half a block of 4
    ref_logits, ref_tokens, _, _ = run(model, cfg, "gpu", kernel_for(cfg, **opts))
    kernel = kernel_for(cfg, **opts, host_scoring=True)
    refresh, built = kernel._refresh_from_host, []

    def spy(*args: object) -> tuple[torch.Tensor, torch.Tensor | None]:
        needed, blocks = refresh(*args)  # type: ignore[arg-type]
        assert blocks is not None
        assert torch.equal(blocks, block_ids(needed, kernel.cfg.cache_block))
        built.append(blocks.numel())
        return needed, blocks

    kernel._refresh_from_host = spy  # type: ignore[method-assign]
    logits, tokens, _, _ = run(model, cfg, "head", kernel)
    assert tokens == ref_tokens
    assert_same(logits, ref_logits)
    assert len(built) == 4 * 6  # stage 0 at decode steps 0, 6, 12, 18 of the 6 slices
