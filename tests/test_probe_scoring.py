"""`HipConfig.probe_scoring`: decode's stage 0 scored on the bisection's probes by the Triton
kernel, over the staged slice or in place in the host tier's extents (`ExtentKeys`).

Runs the compiled kernel on CUDA and, without CUDA, Triton's interpreter on CPU tensors (see
tests/triton_interpreter.py: a subprocess re-runs the CPU cases when triton was imported first).
"""

from __future__ import annotations

import pytest
import torch

from tests.triton_interpreter import DEVICES, NEEDS_TRITON, SUBPROCESS_ONLY, run_cpu_cases

pytestmark = NEEDS_TRITON

from kvtier.attention.interface import ExtentKeys  # noqa: E402
from kvtier.config import ModelConfig, RopeConfig  # noqa: E402
from kvtier.model.llama import CausalLM  # noqa: E402
from kvtier.model.rope import Rotary  # noqa: E402
from kvtier.sparse.prefill import _scoring_queries  # noqa: E402
from kvtier.sparse.rope_ext import RopeTable  # noqa: E402
from tests.test_hip_offload import (  # noqa: E402
    DECODE,
    PROMPT,
    REFRESH0,
    SLICES,
    TINY,
    TOKEN_BYTES,
    assert_same,
    gqa,  # noqa: F401 (the fixture)
    kernel_for,
    run,
)

D = 32


def _extents(s: int, g: int, per: int, device: str) -> list[torch.Tensor]:
    """A host slice's extents: separate allocations of `per` tokens [per, 2, g, D] each."""
    gen = torch.Generator().manual_seed(11)
    return [torch.randn(per, 2, g, D, generator=gen).to(device) for _ in range(-(-s // per))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["relative", "chunk_indexed", "absolute"])
@pytest.mark.parametrize("head", [None, 1])
@pytest.mark.parametrize("per_row", [False, True])
def test_keys_read_in_place_from_extents_score_as_the_same_keys_in_one_tensor(
    device: str, mode: str, head: int | None, per_row: bool
) -> None:
    """`bisect_triton` over `ExtentKeys` (rows in four separate extents, one KV head of them or
    all) gives bitwise the scores it gives over the same keys copied into one tensor, and
    reports the probes' bytes: two keys a level of every chunk."""
    from kvtier.kv.host_gather import extent_offsets
    from kvtier.sparse.triton_bisect import bisect_triton

    s, g, per, chunk, first = 250, 3, 64, 16, 4
    extents = _extents(s, g, per, device)
    whole = torch.cat(extents)[:s]  # [S, 2, G, D]
    keys = whole[:, 0] if head is None else whole[:, 0, head : head + 1]  # [S, G', D]
    read: list[int] = []
    in_place = ExtentKeys(
        tuple(extents), extent_offsets(extents, torch.device(device)), per, len(extents), s,
        torch.device(device), on_read=read.append,
    )  # fmt: skip
    in_place = in_place if head is None else in_place.of_head(head)
    assert in_place.shape == keys.shape
    gq = keys.shape[1]
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(1, 1, gq * 2, D, generator=gen).to(device)  # [B, Nq, H_q, D]
    valid = torch.tensor([s - 20 - first], device=device)
    c_count = -(-int(valid) // chunk)
    lengths = (valid[:, None] - torch.arange(c_count, device=device)[None, :] * chunk).clamp(0, chunk)
    rope = RopeTable(Rotary(RopeConfig(), D, device=device))
    qr, limit = _scoring_queries(
        q, torch.tensor([[s - 1]], device=device), keys, -(-valid // chunk), c_count, mode=mode,
        rotary=rope, window=8,
    )  # fmt: skip
    tables = rope.tables(limit, keys)
    ref = bisect_triton(qr, keys, None, first, lengths, chunk, mode=mode, tables=tables, per_row=per_row)
    got = bisect_triton(qr, in_place, None, first, lengths, chunk, mode=mode, tables=tables, per_row=per_row)
    assert torch.equal(got, ref)
    assert read == [c_count * 2 * 4 * gq * D * 4]  # 4 levels of 16-token chunks, float32 keys


@pytest.mark.parametrize("device", ["cpu"])  # the model-level check: the interpreter's CPU run
@pytest.mark.parametrize("extend", [True, False])
@pytest.mark.parametrize("per_head", [False, True])
def test_probe_scoring_is_the_same_streamed_resident_or_in_place_and_reads_only_probes(
    gqa: tuple[CausalLM, ModelConfig],  # noqa: F811
    device: str,
    extend: bool,
    per_head: bool,
) -> None:
    """With probe scoring, HiP decode gives the same tokens and logits over resident KV, over
    streamed slices, and with stage 0 read in place from the host tier (`host_scoring`), where
    decode moves only the probes' keys and the block cache's misses; the tokens are those of
    the torch scoring (these random keys have no near-ties)."""
    if device == "cpu" and not _interpreting():
        pytest.skip("needs TRITON_INTERPRET=1 before triton is imported (run by the subprocess case)")
    model, cfg = gqa
    opts = {"extend": extend, "per_head": per_head}
    _, torch_tokens, _, _ = run(model, cfg, "gpu", kernel_for(cfg, **opts))
    ref = kernel_for(cfg, **opts, probe_scoring=True)
    ref_logits, ref_tokens, _, _ = run(model, cfg, "gpu", ref)
    assert ref_tokens == torch_tokens
    streamed = kernel_for(cfg, **opts, probe_scoring=True)
    logits, tokens, _, _ = run(model, cfg, "head", streamed)
    assert tokens == ref_tokens
    assert_same(logits, ref_logits)
    in_place = kernel_for(cfg, **opts, probe_scoring=True, host_scoring=True)
    logits, tokens, _, h2d = run(model, cfg, "head", in_place)
    assert tokens == ref_tokens
    assert_same(logits, ref_logits)
    assert in_place.stats.decode_recomputes == ref.stats.decode_recomputes
    # Each stage-0 run (decode steps 0, 6, 12, 18) reads two keys a level of each chunk of its
    # candidates (sink to window) per KV head: 3 levels of TINY's 8-token chunks, half a row.
    chunk, levels = TINY["chunk_sizes"][0], 3  # type: ignore[index]
    w0 = [PROMPT + k - TINY["window"] + 1 for k in range(0, DECODE, REFRESH0)]  # type: ignore[operator]
    probes = sum(-(-(w - TINY["sink"]) // chunk) * 2 * levels for w in w0) * SLICES * TOKEN_BYTES // 2  # type: ignore[operator]
    assert h2d == probes + in_place.stats.cache.fetched_bytes


def _interpreting() -> bool:
    from tests.triton_interpreter import INTERPRET

    return INTERPRET


@SUBPROCESS_ONLY
def test_cpu_cases_in_subprocess() -> None:
    """triton.language was imported before TRITON_INTERPRET was set (by torch, while collecting
    other modules): run this file's CPU cases in a fresh interpreter-mode process."""
    run_cpu_cases(__file__)
