"""`HipConfig.exact_chunk`: pruning stages of fine chunks scored on every key of a chunk (its
true maximum), by `triton_chunk_max`'s kernel and by `bisect_chunks(exact=True)` without
Triton, against a brute-force product of every (row, key) pair.

CPU cases run Triton's interpreter, as tests/test_triton_bisect.py does.
"""

from __future__ import annotations

import pytest
import torch

from tests.prune_cases import D, prune_case
from tests.triton_interpreter import DEVICES, NEEDS_TRITON, SUBPROCESS_ONLY, run_cpu_cases

MODES = ["relative", "chunk_indexed", "absolute"]

from kvtier.errors import ConfigError  # noqa: E402
from kvtier.sparse.config import HipConfig  # noqa: E402
from kvtier.sparse.prefill import _chunks, prune_blocks, run_block_stages, scoring_queries  # noqa: E402
from kvtier.sparse.prefill_bisect import bisect_chunks  # noqa: E402


def _brute(qr, keys, cand, lengths, chunk, mode, rope, limit):
    """Every row's maximum over each chunk's keys, one (block, chunk) at a time: [B, C, R]."""
    bsz, nq, g, r, _d = qr.shape
    out = torch.full((bsz, lengths.shape[1], g * nq * r), float("-inf"))
    for b in range(bsz):
        for c in range(lengths.shape[1]):
            n = int(lengths[b, c])
            if n == 0:
                continue
            pos = cand[b, c * chunk : c * chunk + n].cpu()
            k = keys.cpu()[pos]  # [n, G, D]
            if rope is not None and mode == "chunk_indexed":
                k = rope.rotate(k.to(keys.device), torch.full((n,), c, device=keys.device), limit).cpu()
            elif rope is not None and mode == "absolute":
                k = rope.rotate(k.to(keys.device), pos.to(keys.device), limit).cpu()
            s = torch.einsum("ngrd,jgd->gnrj", qr[b].cpu().float(), k.float())  # [G, Nq, r, n]
            out[b, c] = s.amax(-1).flatten()
    return out


@pytest.mark.parametrize("rotate", [True, False])
@pytest.mark.parametrize("mode", MODES)
def test_torch_exact_scores_are_each_chunks_maximum(rotate: bool, mode: str) -> None:
    """`bisect_chunks(exact=True)` gives every row's maximum over all of a chunk's keys (keys
    rotated at the chunk's index, at their positions, or not at all in relative mode), and
    without `per_row` the maximum over rows; the bisection's scores never exceed them."""
    chunk = 8
    keys, cand, lengths, rope, qr, limit, _ = prune_case("cpu", False, chunk, rotate, mode)
    chunks = _chunks(cand, lengths.shape[1], chunk)
    kw = {"mode": mode, "rotary": rope, "limit": limit}
    rows = bisect_chunks(qr, keys, chunks, lengths, per_row=True, exact=True, **kw)
    ref = _brute(qr, keys, cand, lengths, chunk, mode, rope, limit)
    live = lengths > 0
    assert torch.allclose(rows[live], ref[live], rtol=1e-5, atol=1e-4)
    assert bool((rows[~live] == float("-inf")).all())
    scores = bisect_chunks(qr, keys, chunks, lengths, exact=True, **kw)
    assert torch.allclose(scores[live], ref.amax(dim=2)[live], rtol=1e-5, atol=1e-4)
    if mode != "relative":  # (relative probes the right side at position 1, the exact keys at 0)
        probed = bisect_chunks(qr, keys, chunks, lengths, **kw)
        assert bool((probed[live] <= scores[live] + 1e-4).all())
        assert bool((probed[live] < scores[live] - 1e-3).any())  # some path missed its chunk's best key


@NEEDS_TRITON
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("span", [True, False])  # stage 0's implicit candidates, or a list
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("chunk", [8, 16])
@pytest.mark.parametrize("per_row", [False, True])
def test_kernel_equals_the_torch_exact_scores(
    device: str, span: bool, mode: str, chunk: int, per_row: bool
) -> None:
    """`chunk_max_triton` gives `bisect_chunks(exact=True)`'s scores and row maxima (rows
    compared sorted, the kernel's come in another order), with RoPE, with stage 0's implicit
    range or a candidate list, over more chunks than one program holds."""
    from kvtier.sparse.triton_chunk_max import chunk_max_triton

    keys, cand, lengths, rope, qr, limit, first = prune_case(device, span, chunk, True, mode)
    ref = bisect_chunks(
        qr, keys, _chunks(cand, lengths.shape[1], chunk), lengths, mode=mode, rotary=rope, limit=limit,
        per_row=per_row, exact=True,
    )  # fmt: skip
    tables = rope.tables(limit, keys) if rope is not None else None
    got = chunk_max_triton(
        qr, keys, None if span else cand, first, lengths, chunk, mode=mode, tables=tables, per_row=per_row
    )
    live = lengths > 0
    if per_row:
        got = got.flatten(2)
        assert got.shape == ref.shape
        got, ref = got.sort(dim=2).values, ref.sort(dim=2).values
    assert torch.allclose(got[live], ref[live], rtol=1e-5, atol=1e-4)


@NEEDS_TRITON
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("whole_rows", [False, True])
def test_kernel_head_score_and_padded_rows(
    device: str, whole_rows: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """192 rows a KV head (64 queries x 3 heads: three tiles of 64, or with `WHOLE_ROWS` one
    padded tile of 256) and the fused "softmax" head score: the kernel's logsumexp parts give
    the head score its rows give, and `prune_blocks` with and without Triton keeps the same
    positions."""
    from kvtier.sparse import triton_chunk_max
    from kvtier.sparse.triton_chunk_max import chunk_max_triton
    from kvtier.sparse.triton_head_score import softmax_head_score_triton

    monkeypatch.setattr(triton_chunk_max, "WHOLE_ROWS", whole_rows)

    gen = torch.Generator().manual_seed(7)
    s, g, r, nq, chunk = 700, 2, 3, 64, 8
    keys = torch.randn(s, g, D, generator=gen).to(device)
    q = torch.randn(2, nq, g * r, D, generator=gen).to(device)
    valid = torch.tensor([690, 300], device=device)
    q_pos = torch.stack([torch.arange(700 - nq, 700)] * 2).to(device)
    c_count = -(-690 // chunk)
    lengths = (valid[:, None] - torch.arange(c_count, device=device)[None, :] * chunk).clamp(0, chunk)
    qr, _ = scoring_queries(q, q_pos, keys, valid, chunk, c_count, mode="absolute", rotary=None, window=8)
    scale = D**-0.5
    rows = chunk_max_triton(qr, keys, None, 0, lengths, chunk, mode="absolute", tables=None, per_row=True)
    ref = softmax_head_score_triton(rows, lengths, scale)
    got = chunk_max_triton(
        qr, keys, None, 0, lengths, chunk, mode="absolute", tables=None, per_row=True, softmax_scale=scale
    )
    live = lengths > 0
    assert torch.allclose(got[live], ref[live], rtol=1e-5, atol=1e-7)
    assert bool((got[~live] == float("-inf")).all())
    kept = [
        prune_blocks(
            q,
            q_pos,
            keys,
            None,
            valid,
            chunk,
            128,
            mode="absolute",
            rotary=None,
            window=8,
            width=690,
            triton=use,
            head_score="softmax",
            exact=True,
        )
        for use in (True, False)
    ]
    assert torch.equal(kept[0][0].cpu(), kept[1][0].cpu()) and torch.equal(kept[0][1].cpu(), kept[1][1].cpu())


@NEEDS_TRITON
@pytest.mark.parametrize("device", DEVICES)
def test_exact_stages_keep_the_chunks_holding_the_best_keys(device: str) -> None:
    """`run_block_stages(exact_chunk=8)` scores its 8-token stage on every key: with four keys
    planted to match the blocks' queries (far above the rest), every block keeps the four
    chunks that hold them, with and without Triton."""
    gen = torch.Generator().manual_seed(3)
    s, bq, sink, window = 512, 8, 4, 16
    keys = torch.randn(s, 2, D, generator=gen) * 0.1
    q = torch.randn(4 * bq, 4, D, generator=gen) * 0.1
    start = s - q.shape[0]
    starts = [max(sink, start + b - window + 1) for b in range(0, q.shape[0], bq)]
    planted = [37 + 101 * b for b in range(4)]  # one key a block, in its middle
    for b, p in enumerate(planted):
        keys[p] = q[b * bq : (b + 1) * bq].mean(0).view(2, 2, D).sum(1) * 40
    pos = torch.arange(start, s).view(-1, bq)
    stages = {"chunk_sizes": (64, 8), "budgets": (512, 32), "strides": (1, 1)}  # stage 1 alone prunes
    for triton in (True, False):
        sel, n = run_block_stages(
            q.view(-1, bq, 4, D).to(device), pos.to(device), keys.to(device), sink,
            torch.tensor(starts, device=device), **stages, mode="absolute", rotary=None, window=window,
            triton=triton, head_score="softmax", exact_chunk=8,
        )  # fmt: skip
        for b in range(4):
            kept = sel[b, : int(n[b])].cpu()
            assert sorted(kept.tolist()) == sorted(
                (p - sink) // 8 * 8 + sink + i for p in planted for i in range(8)
            )  # chunks from the sinks on


def test_exact_chunk_is_validated() -> None:
    """A power of two up to 64, or 0."""
    assert HipConfig(exact_chunk=8).exact_chunk == 8
    for bad in (3, 128, 12):
        with pytest.raises(ConfigError, match="exact_chunk"):
            HipConfig(exact_chunk=bad)


@SUBPROCESS_ONLY
def test_cpu_cases_in_subprocess() -> None:
    """triton.language was imported before TRITON_INTERPRET was set: run this file's CPU cases
    in a fresh interpreter-mode process."""
    run_cpu_cases(__file__)
