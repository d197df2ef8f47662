"""`HipConfig.probe_scoring`: decode's stage 0 scored on the bisection's probes by the Triton
kernel, over the staged slice or in place in the host tier's extents (`ExtentKeys`).

Runs the compiled kernel on CUDA and, without CUDA, Triton's interpreter on CPU tensors (see
tests/triton_interpreter.py: a subprocess re-runs the CPU cases when triton was imported first).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tests.triton_interpreter import DEVICES, NEEDS_TRITON, SUBPROCESS_ONLY, run_cpu_cases

# The model-level checks run the interpreter's CPU case alone (their helpers build CPU stores).
CPU = [p for p in DEVICES if p.values[0] == "cpu"]

pytestmark = NEEDS_TRITON

from kvtier.attention.interface import ExtentKeys  # noqa: E402
from kvtier.config import ModelConfig, RopeConfig  # noqa: E402
from kvtier.model.llama import CausalLM  # noqa: E402
from kvtier.model.rope import Rotary  # noqa: E402
from kvtier.sparse.opcount import OpCounter  # noqa: E402
from kvtier.sparse.prefill import scoring_queries  # noqa: E402
from kvtier.sparse.rope_ext import RopeTable  # noqa: E402
from tests.hip_store import (  # noqa: E402
    DECODE,
    PROMPT,
    REFRESH0,
    SLICES,
    TINY,
    TOKEN_BYTES,
    assert_same,
    kernel_for,
    run,
)

D = 32


def _host(x: torch.Tensor, device: str) -> torch.Tensor:
    """x as the host tier keeps it for `device`: pinned host memory for a GPU (which the kernel
    reads in place, as the store's extents), a CPU tensor of its own for the interpreter."""
    return x.cpu().pin_memory() if device == "cuda" else x.clone()


def _extents(s: int, g: int, per: int, device: str) -> list[torch.Tensor]:
    """A host slice's extents: separate allocations of `per` tokens [per, 2, g, D] each."""
    gen = torch.Generator().manual_seed(11)
    return [_host(torch.randn(per, 2, g, D, generator=gen), device) for _ in range(-(-s // per))]


def _stage0(
    keys: torch.Tensor, valid: int, chunk: int, mode: str, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """A decode query's stage 0 over the first `valid` candidates of keys [S, G, D]: its scoring
    queries [1, 1, G, 2, D] (two query heads a KV head, at the last position), the chunks'
    lengths [1, C] and the RoPE tables (cos, sin) covering every scoring position."""
    s, g, dev = keys.shape[0], keys.shape[1], keys.device
    q = torch.randn(1, 1, g * 2, D, generator=gen).to(dev)  # [B, Nq, H_q, D]
    c_count = -(-valid // chunk)
    lengths = (valid - torch.arange(c_count, device=dev)[None, :] * chunk).clamp(0, chunk)
    rope = RopeTable(Rotary(RopeConfig(), D, device=dev))
    pos = torch.tensor([[s - 1]], device=dev)
    n_valid = torch.tensor([valid], device=dev)
    qr, limit = scoring_queries(q, pos, keys, n_valid, chunk, c_count, mode=mode, rotary=rope, window=8)
    return qr, lengths, rope.tables(limit, keys)


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
    whole = torch.cat(extents)[:s].to(device)  # [S, 2, G, D]
    keys = whole[:, 0] if head is None else whole[:, 0, head : head + 1]  # [S, G', D]
    read: list[int] = []
    dev = torch.device(device)
    offsets = extent_offsets(extents, dev)
    in_place = ExtentKeys(tuple(extents), offsets, per, len(extents), s, dev, g, D, whole.dtype)
    in_place = replace(in_place, on_read=read.append)
    in_place = in_place if head is None else in_place.of_head(head)
    assert in_place.shape == keys.shape
    qr, lengths, tables = _stage0(keys, s - 20 - first, chunk, mode, torch.Generator().manual_seed(5))
    c_count = lengths.shape[1]
    opts = {"mode": mode, "tables": tables, "per_row": per_row}
    ref = bisect_triton(qr, keys, None, first, lengths, chunk, **opts)  # type: ignore[arg-type]
    with OpCounter() as ops:  # under the interpreter the kernel counts as the one launch it is
        got = bisect_triton(qr, in_place, None, first, lengths, chunk, **opts)  # type: ignore[arg-type]
    assert torch.equal(got, ref)
    if device == "cpu":
        assert ops.counts["triton:_bisect_kernel"] == 1 and ops.total < 12, ops.counts
    assert read == [c_count * 2 * 4 * keys.shape[1] * D * 4]  # 4 levels of 16-token chunks, float32 keys


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bits", [4, 8, 2])
@pytest.mark.parametrize("head", [None, 2])
@pytest.mark.parametrize("mode", ["relative", "absolute"])
@pytest.mark.parametrize("params_first", [True, False])
def test_keys_read_in_place_from_kivi_rows_score_as_the_rows_unpacked(
    device: str, bits: int, head: int | None, mode: str, params_first: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Over KIVI rows in separate extents (`ExtentKeys` with the codec's bits) the kernel unpacks
    each probe's key as the store's unpack does, so it scores bitwise what it scores over the
    rows unpacked into one tensor. It reports the bytes it read: each probe's codes, and each
    row's fp16 parameters once (copied first, `KEY_PARAMS_FIRST`) or each probe's again."""
    from kvtier.kv.host_gather import extent_offsets
    from kvtier.policies.quant import KiviCodec
    from kvtier.sparse import triton_bisect
    from kvtier.sparse.triton_bisect import bisect_triton

    monkeypatch.setattr(triton_bisect, "KEY_PARAMS_FIRST", params_first)

    codec = KiviCodec(bits=bits)
    s, g, rows_per, chunk, first = 320, 3, 3, 16, 4  # 10 rows in extents of 3
    gen = torch.Generator().manual_seed(2)
    kv = (torch.randn(s, 2, g, D, generator=gen) * 2 + 0.5).to(device)
    rows = codec.pack(kv)  # [10, row_bytes]
    unpacked = torch.empty_like(kv)
    if not codec.unpack_into(rows, unpacked):  # on CUDA the Triton unpack, as the store
        unpacked = codec.unpack(rows, g, D, kv.dtype)
    extents = [_host(rows[i : i + rows_per], device) for i in range(0, rows.shape[0], rows_per)]
    dev = torch.device(device)
    read: list[int] = []
    in_place = ExtentKeys(
        tuple(extents), extent_offsets(extents, dev), rows_per * codec.group, len(extents), s, dev, g, D,
        kv.dtype, on_read=read.append, bits=bits, group=codec.group,
    )  # fmt: skip
    keys = unpacked[:, 0]
    if head is not None:
        in_place, keys = in_place.of_head(head), keys[:, head : head + 1]
    gq = keys.shape[1]
    qr, lengths, tables = _stage0(keys, s - 30 - first, chunk, mode, gen)
    c_count = lengths.shape[1]
    ref = bisect_triton(qr, keys.contiguous(), None, first, lengths, chunk, mode=mode, tables=tables)
    got = bisect_triton(qr, in_place, None, first, lengths, chunk, mode=mode, tables=tables)
    assert torch.equal(got, ref)
    probes = c_count * 2 * 4 * gq  # 4 levels of 16-token chunks
    # the rows [first, first + 16 C) spans: 32 tokens a row
    rows = (first + c_count * chunk - 1) // codec.group - first // codec.group + 1
    params = rows * gq * 4 * D if params_first else probes * 4 * D
    assert read == [probes * D * bits // 8 + params]


@pytest.mark.parametrize("device", CPU)
# (context extension's rotations, one selection per KV head, the block cache: None covers a
# refresh interval, 24 tokens misses and overflows); two cases: Triton's interpreter is slow
@pytest.mark.parametrize(("extend", "per_head", "cache"), [(True, False, None), (False, True, 24)])
def test_probe_scoring_is_the_same_streamed_resident_or_in_place_and_reads_only_probes(
    gqa: tuple[CausalLM, ModelConfig],
    device: str,
    extend: bool,
    per_head: bool,
    cache: int | None,
) -> None:
    """With probe scoring (every stage's chunks scored on their probes, later stages' keys read
    from the block cache by address, its overflow too), HiP decode gives the same tokens and
    logits over resident KV, over streamed slices, and with stage 0 read in place from the host
    tier (`host_scoring`), where decode moves only the probes' keys and the block cache's
    misses; the tokens are those of the torch scoring (these random keys have no near-ties)."""
    model, cfg = gqa
    opts = {"extend": extend, "per_head": per_head, "cache_tokens": cache}
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


@pytest.mark.parametrize("device", CPU)
def test_probes_read_in_place_from_an_int4_tier_decode_as_streaming_it(
    gqa: tuple[CausalLM, ModelConfig],
    device: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Over an int4 host tier, stage 0 read in place from the packed rows (each probe's key
    unpacked by the kernel) decodes the tokens of streaming the packed slices and moves only the
    probes' codes and parameters (and the block cache's misses). Logits agree within rounding,
    not bitwise: with host keys the block cache keeps the full-precision copy of a window token
    coded after it was cached, where a streamed refresh reads it unpacked (host keys without
    probes differ from streaming the same way; the kernel's unpacking is bitwise, see above)."""
    from kvtier.policies.quant import KiviCodec
    from kvtier.sparse import triton_bisect

    model, cfg = gqa

    def codec() -> KiviCodec:  # every full row coded; a window past the uncoded tail
        return KiviCodec(bits=4, residual=0)

    opts = {"cache_tokens": 48, "window": 40}
    streamed = kernel_for(cfg, **opts, probe_scoring=True)
    ref_logits, ref_tokens, _, _ = run(model, cfg, "head", streamed, codec=codec())
    in_place = kernel_for(cfg, **opts, probe_scoring=True, host_scoring=True)
    read: list[tuple[int, int]] = []  # (bits, bytes) of each in-place stage-0 run's keys
    kernel = triton_bisect.bisect_triton

    def spy(q: torch.Tensor, keys: object, *args: object, **kwargs: object) -> torch.Tensor:
        if isinstance(keys, ExtentKeys):
            keys = replace(keys, on_read=lambda n: read.append((keys.bits, n)))  # type: ignore[attr-defined]
        return kernel(q, keys, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(triton_bisect, "bisect_triton", spy)
    logits, tokens, _, _ = run(model, cfg, "head", in_place, codec=codec())
    assert tokens == ref_tokens
    assert all(torch.allclose(a, b, atol=0.05) for a, b in zip(logits, ref_logits, strict=True))
    # Every stage-0 run (steps 0, 6, 12, 18 of each slice) read its probes in place from the
    # packed rows: two keys a level of each 8-token chunk of [sink, w0), a key its 4-bit codes
    # (16 dims), and the fp16 minima and steps of each 32-token row those chunks span, once;
    # nothing else of the rows.
    chunk, levels, sink = TINY["chunk_sizes"][0], 3, TINY["sink"]  # type: ignore[index]
    w0 = [PROMPT + k - 40 + 1 for k in range(0, DECODE, REFRESH0)]
    chunks = [-(-(w - sink) // chunk) for w in w0]  # type: ignore[operator]
    per_slice = [c * 2 * levels * 16 * 4 // 8 + ((sink + c * chunk - 1) // 32 + 1) * 4 * 16 for c in chunks]  # type: ignore[operator]
    assert sorted(read) == sorted((4, n) for n in per_slice * SLICES)
    assert in_place.stats.decode_recomputes[0] == len(w0) * SLICES


@pytest.mark.parametrize("device", CPU)
def test_a_layers_slices_rerun_their_stages_in_one_batch_as_one_by_one(
    gqa: tuple[CausalLM, ModelConfig], device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Decode steps that rerun stages 1 and 2 (not 0) of a layer's two slices, from caches that
    cover a refresh interval, prune both slices in one batch (`CachedDecode._refresh_layer`:
    a block a slice, each reading its keys by address in its own block cache) and attend both
    in one go: the same logits, bitwise, as the slices one by one, with stage 0 read in place
    from the host tier; every such step of every layer ran batched."""
    from kvtier.sparse.cached_decode import CachedDecode

    model, cfg = gqa
    opts = {"probe_scoring": True, "host_scoring": True, "refresh": (REFRESH0, 3, 2)}
    alone = kernel_for(cfg, **opts)
    monkeypatch.setattr(alone, "attend_cached_layer", lambda *a: None)  # slice by slice, every step
    ref_logits, ref_tokens, _, _ = run(model, cfg, "head", alone)
    batched = kernel_for(cfg, **opts)
    calls: list[int] = []
    refresh = CachedDecode._refresh_layer

    def counted(self: CachedDecode, *args: object) -> torch.Tensor:
        calls.append(args[-1])  # type: ignore[arg-type]
        return refresh(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(CachedDecode, "_refresh_layer", counted)
    logits, tokens, _, _ = run(model, cfg, "head", batched)
    assert tokens == ref_tokens
    assert_same(logits, ref_logits)
    assert batched.stats.decode_recomputes == alone.stats.decode_recomputes
    # every rerun from stage 1 or 2 ran batched, a layer (two slices) at a time: a slice's
    # stage-0 reruns also rerun 1 and 2, its stage-1 reruns also 2 (counts a slice)
    rc = alone.stats.decode_recomputes
    assert rc[1] > rc[0] and rc[2] > rc[1]
    assert calls.count(1) * 2 == rc[1] - rc[0] and calls.count(2) * 2 == rc[2] - rc[1]


@SUBPROCESS_ONLY
def test_cpu_cases_in_subprocess() -> None:
    """triton.language was imported before TRITON_INTERPRET was set (by torch, while collecting
    other modules): run this file's CPU cases in a fresh interpreter-mode process."""
    run_cpu_cases(__file__)
