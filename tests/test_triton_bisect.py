"""The Triton chunk-scoring kernel of HiP's pruning stages against the torch bisection.

Runs the compiled kernel on CUDA and, without CUDA, Triton's interpreter on CPU tensors (as in
tests/test_triton_attn.py: TRITON_INTERPRET=1 is set before triton is imported, and a
subprocess re-runs the CPU cases when triton was imported earlier by another test module).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.prune_cases import prune_case
from tests.triton_interpreter import DEVICES, NEEDS_TRITON, SUBPROCESS_ONLY, run_cpu_cases

pytestmark = NEEDS_TRITON

from kvtier.config import RopeConfig  # noqa: E402
from kvtier.model.rope import Rotary  # noqa: E402
from kvtier.sparse.prefill import _chunks, _span, run_block_stages, scoring_queries  # noqa: E402
from kvtier.sparse.prefill_bisect import bisect_chunks  # noqa: E402
from kvtier.sparse.pruning import run_stages  # noqa: E402
from kvtier.sparse.rope_ext import RopeTable  # noqa: E402

D = 32
MODES = ["relative", "chunk_indexed", "absolute"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rotate", [True, False])
@pytest.mark.parametrize("span", [True, False])  # stage 0's implicit candidates, or a list
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("per_row", [False, True])
def test_kernel_scores_equal_the_torch_bisection(
    device: str, rotate: bool, span: bool, mode: str, per_row: bool
) -> None:
    """Chunk scores of blocks with different candidate counts (a partial last chunk, empty
    chunks) equal `bisect_chunks`'s, on the same rotated queries; with `per_row`, every (query, head)
    row's maximum (the kernel's rows come in another order: compared sorted)."""
    from kvtier.sparse.triton_bisect import bisect_triton

    chunk, nq, g, r = 16, 4, 2, 3
    keys, cand, lengths, rope, qr, limit, first = prune_case(device, span, chunk, rotate, mode)
    c_count = lengths.shape[1]
    chunks = _chunks(cand, c_count, chunk)
    ref = bisect_chunks(qr, keys, chunks, lengths, mode=mode, rotary=rope, limit=limit, per_row=per_row)
    tables = rope.tables(limit, keys) if rope is not None else None
    got = bisect_triton(
        qr, keys, None if span else cand, first, lengths, chunk, mode=mode, tables=tables, per_row=per_row
    )
    live = lengths > 0
    if per_row:
        got = got.flatten(2)  # the kernel's view [B, C, G, rows]
        assert got.shape == ref.shape == (3, c_count, nq * g * r)
        got, ref = got.sort(dim=2).values, ref.sort(dim=2).values
    assert torch.allclose(got[live], ref[live], rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("device", DEVICES)
# 150: some blocks keep every chunk they have; 110: every block keeps all it has in stage 0, so
# stage 1 reads its candidates by position (lean's 8-token stage at 16K)
@pytest.mark.parametrize("s", [400, 150, 110])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("head_score", ["max", "softmax"])
def test_blocks_scored_by_the_kernel_select_what_each_block_selects_alone(
    device: str, s: int, mode: str, head_score: str
) -> None:
    """`run_block_stages` with the kernel keeps, block by block, the positions `run_stages`
    (the torch reference, one block at a time) keeps, with either head score."""
    gen = torch.Generator().manual_seed(3)
    bq, sink, window = 8, 4, 16
    keys = torch.randn(s, 2, D, generator=gen)  # [S, G, D]
    q = torch.randn(6 * bq, 4, D, generator=gen)
    start = s - q.shape[0]
    rope = RopeTable(Rotary(RopeConfig(), D, device=device))
    stages = {"chunk_sizes": (32, 8, 2), "budgets": (96, 32, 16), "strides": (4, 4, 1)}
    starts = [max(sink, start + b - window + 1) for b in range(0, q.shape[0], bq)]
    pos = torch.arange(start, s).view(-1, bq)
    sel, n = run_block_stages(
        q.view(-1, bq, 4, D).to(device),
        pos.to(device),
        keys.to(device),
        sink,
        torch.tensor(starts, device=device),
        **stages,
        mode=mode,
        rotary=rope,
        window=window,
        triton=True,
        head_score=head_score,
    )
    ref_rope = RopeTable(Rotary(RopeConfig(), D))
    for b, w0 in enumerate(starts):
        middle = torch.arange(sink, w0)
        alone = run_stages(
            q[b * bq : (b + 1) * bq],
            pos[b],
            keys,
            middle,
            **stages,
            mode=mode,
            rotary=ref_rope,
            window=window,
            head_score=head_score,
        )[-1]
        assert int(n[b]) == alone.numel()
        assert torch.equal(sel[b, : int(n[b])].cpu(), alone)
        assert bool((sel[b, int(n[b]) :] == -1).all())


@pytest.mark.parametrize("device", DEVICES)
def test_a_stage_after_stages_that_kept_everything_reads_candidates_by_position(
    monkeypatch: pytest.MonkeyPatch, device: str
) -> None:
    """Where stage 0 keeps all every block has (lean's first stages up to 16K), the stage that
    prunes first gets no candidate list: the kernel computes each probe's position (ARANGE)
    instead of loading it before the key; where stage 0 prunes, stage 1 gets its list."""
    import kvtier.sparse.triton_bisect as tb

    seen: list[bool] = []
    real = tb.bisect_triton

    def spy(qr: torch.Tensor, keys: torch.Tensor, candidates: torch.Tensor | None, *a: Any, **kw: Any) -> Any:
        seen.append(candidates is None)
        return real(qr, keys, candidates, *a, **kw)

    monkeypatch.setattr(tb, "bisect_triton", spy)
    gen = torch.Generator().manual_seed(5)
    bq, sink, window = 8, 4, 16
    for s, expect in ((110, [True, False]), (400, [True, False, False])):
        keys = torch.randn(s, 2, D, generator=gen)
        q = torch.randn(6 * bq, 4, D, generator=gen)
        start = s - q.shape[0]
        starts = [max(sink, start + b - window + 1) for b in range(0, q.shape[0], bq)]
        seen.clear()
        run_block_stages(
            q.view(-1, bq, 4, D).to(device), torch.arange(start, s).view(-1, bq).to(device), keys.to(device),
            sink, torch.tensor(starts, device=device),
            chunk_sizes=(32, 8, 2), budgets=(96, 32, 16), strides=(4, 4, 1), mode="relative", rotary=None,
            window=window, triton=True,
        )  # fmt: skip
        assert seen == expect, (s, seen)


@SUBPROCESS_ONLY
def test_cpu_cases_in_subprocess() -> None:
    """triton.language was imported before TRITON_INTERPRET was set (by torch, while collecting
    other modules): run this file's CPU cases in a fresh interpreter-mode process."""
    run_cpu_cases(__file__)


def test_softmax_head_score_is_a_softmax_over_live_chunks_then_the_max_over_rows() -> None:
    """`softmax_head_score` (max_r exp(x - logsumexp)) equals the softmax it replaces, on the
    kernel's layout (a permuted view, chunks contiguous) and on `bisect_chunks`'s [B, C, R]."""
    from kvtier.sparse.prefill import softmax_head_score

    gen = torch.Generator().manual_seed(3)
    rows = torch.randn(4, 2, 5, 9, generator=gen) * 6  # [B, G, rows, C] as the kernel stores them
    live = torch.rand(4, 9, generator=gen) > 0.4
    live[:, 0] = True
    view = rows.permute(0, 3, 1, 2)  # [B, C, G, rows]
    flat = view.flatten(2)  # [B, C, R]
    ref = torch.softmax(torch.where(live[:, :, None], flat * 0.125, float("-inf")), dim=1).amax(dim=2)
    for x in (view, flat):
        got = softmax_head_score(x.clone(), live, 0.125)  # it overwrites its input
        assert torch.allclose(got[live], ref[live], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("device", DEVICES)
def test_triton_head_score_equals_the_torch_head_score(device: str) -> None:
    """`softmax_head_score_triton` on the bisection kernel's rows (a view [B, C, G, rows] of
    [B, G, R_pad, C], padding rows left out; more chunks and rows than one tile holds) gives
    `softmax_head_score`'s values on live chunks and -inf on dead ones, a block with no live
    chunk included, and leaves its input as it was."""
    from kvtier.sparse.prefill import softmax_head_score
    from kvtier.sparse.triton_head_score import softmax_head_score_triton

    gen = torch.Generator().manual_seed(11)
    b, g, r, r_pad, c = 3, 2, 40, 64, 150
    stored = (torch.randn(b, g, r_pad, c, generator=gen) * 5).to(device)  # [B, G, R_pad, C]
    view = stored[:, :, :r].permute(0, 3, 1, 2)  # [B, C, G, rows]
    live = torch.rand(b, c, generator=gen) > 0.3
    live[2] = False  # a block with nothing left to score
    live = live.to(device)
    before = view.clone()
    got = softmax_head_score_triton(view, live, 0.125)
    ref = softmax_head_score(view.clone(), live, 0.125)
    assert torch.equal(view, before)
    assert torch.allclose(got[live], ref[live], rtol=1e-5, atol=1e-7)
    assert bool((got[~live] == float("-inf")).all())
    # the chunks' lengths as they are (int64, nonzero = live), as `prune_blocks` passes them
    lengths = torch.where(live, torch.randint(1, 9, (b, c), generator=gen).to(device), 0)
    assert torch.equal(softmax_head_score_triton(view, lengths, 0.125), got)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    ("per_row", "r", "nq", "d"), [(False, 3, 64, D), (True, 3, 64, D), (True, 4, 256, 128)]
)
def test_rows_in_tiles_score_as_the_torch_bisection(
    device: str, per_row: bool, r: int, nq: int, d: int
) -> None:
    """192 (query, head) rows a KV head (64 queries x 3 heads, SmolLM2's last stage) run as 3
    tiles of 64, not padded to 256; 1,024 (a stage-0 group of 1,024 queries pooled 4, 4 heads)
    of 128-wide float32 heads as 8 tiles of 128, not one that overflows shared memory: scores
    and every row's maximum equal `bisect_chunks`'s."""
    from kvtier.sparse.prune_memory import row_tiles
    from kvtier.sparse.triton_bisect import bisect_triton

    assert row_tiles(192) == (192, 64)
    assert row_tiles(256) == (256, 256)
    assert row_tiles(48) == (64, 64)  # tiles of 16 would be slower than padding
    assert row_tiles(1024) == (1024, 256) and row_tiles(1536) == (1536, 256)  # bfloat16, D 128
    assert row_tiles(600) == (1024, 256)  # padded to a power of two, then tiled
    assert row_tiles(1024, 4 * 256) == (1024, 64) and row_tiles(192, 2 * 64) == (192, 64)
    assert row_tiles(192, whole=True) == (256, 256) and row_tiles(1024, whole=True) == (1024, 256)
    gen = torch.Generator().manual_seed(7)
    s, g, chunk = 200, 2, 8
    keys = torch.randn(s, g, d, generator=gen).to(device)  # [S, G, D]
    q = torch.randn(2, nq, g * r, d, generator=gen).to(device)  # [B, Nq, H_q, D]
    q_pos = torch.stack([torch.arange(130, 130 + nq), torch.arange(100, 100 + nq)]).to(device)
    valid = torch.tensor([120, 75], device=device)
    cand = _span(0, 120, valid)
    c_count = -(-cand.shape[1] // chunk)
    lengths = (valid[:, None] - torch.arange(c_count, device=device)[None, :] * chunk).clamp(0, chunk)
    qr, limit = scoring_queries(q, q_pos, keys, valid, chunk, c_count, mode="absolute", rotary=None, window=8)
    ref = bisect_chunks(
        qr,
        keys,
        _chunks(cand, c_count, chunk),
        lengths,
        mode="absolute",
        rotary=None,
        limit=limit,
        per_row=per_row,
    )
    got = bisect_triton(qr, keys, cand, 0, lengths, chunk, mode="absolute", tables=None, per_row=per_row)
    live = lengths > 0
    if per_row:
        got = got.flatten(2)
        assert got.shape == ref.shape == (2, c_count, nq * g * r)
        got, ref = got.sort(dim=2).values, ref.sort(dim=2).values
    assert torch.allclose(got[live], ref[live], rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fold", [True, False])
def test_logsumexp_parts_give_the_two_pass_head_score(
    device: str, fold: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`bisect_triton(softmax_scale=...)`, whose kernel writes each row's logsumexp in parts at
    its last level, gives what `softmax_head_score_triton` gives over its rows: chunks dead in
    some blocks and not others, a block with none live, padded rows (40 a KV head in 64), more
    chunks than one program holds; with the parts combined in the score pass (`fold`, decode's
    case) or by `_combine_lse` first. Then `prune_blocks` keeps what it kept before."""
    from kvtier.sparse import prefill, triton_head_score
    from kvtier.sparse.triton_bisect import bisect_triton
    from kvtier.sparse.triton_head_score import softmax_head_score_triton

    monkeypatch.setattr(triton_head_score, "FOLD_PARTS_MAX", 1 << 30 if fold else 0)
    gen = torch.Generator().manual_seed(5)
    s, g, r, nq, chunk = 700, 2, 4, 10, 4
    keys = torch.randn(s, g, D, generator=gen).to(device)
    q = torch.randn(3, nq, g * r, D, generator=gen).to(device)
    valid = torch.tensor([690, 300, 0], device=device)
    q_pos = torch.stack([torch.arange(690, 690 + nq)] * 3).to(device)
    c_count = -(-690 // chunk)  # 173: six programs of 32 chunks
    lengths = (valid[:, None] - torch.arange(c_count, device=device)[None, :] * chunk).clamp(0, chunk)
    qr, _ = scoring_queries(q, q_pos, keys, valid, chunk, c_count, mode="absolute", rotary=None, window=8)
    scale = D**-0.5
    rows = bisect_triton(qr, keys, None, 0, lengths, chunk, mode="absolute", tables=None, per_row=True)
    ref = softmax_head_score_triton(rows, lengths, scale)
    got = bisect_triton(
        qr, keys, None, 0, lengths, chunk, mode="absolute", tables=None, per_row=True, softmax_scale=scale
    )
    live = lengths > 0
    assert got.shape == ref.shape == (3, c_count)
    assert torch.allclose(got[live], ref[live], rtol=1e-5, atol=1e-7)
    assert bool((got[~live] == float("-inf")).all()) and bool((ref[~live] == float("-inf")).all())
    kept = {}
    for fused in (True, False):
        monkeypatch.setattr(prefill, "FUSED_LSE", fused)
        kept[fused] = prefill.prune_blocks(
            q, q_pos, keys, None, valid, chunk, 64, mode="absolute", rotary=None, window=8, width=690,
            triton=True, head_score="softmax",
        )  # fmt: skip
    assert torch.equal(kept[True][0], kept[False][0]) and torch.equal(kept[True][1], kept[False][1])
