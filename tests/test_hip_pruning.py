"""HiP's pruning machinery (`kvtier.sparse.pruning`, `kvtier.sparse.prefill`, `rope_ext`): decode
scoring of every candidate against the probe bisection, slabs, query blocks pruned together as
each alone, kept chunks sorted, and the RoPE table's growth."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvtier.config import RopeConfig
from kvtier.model.rope import Rotary
from kvtier.sparse.pruning import ScoreFn, bisect_scores, chunk_scores, prune_stage, softmax_over_chunks
from kvtier.sparse.rope_ext import RopeTable, rotate

D = 16


@pytest.mark.parametrize("head_score", ["max", "softmax"])
@pytest.mark.parametrize("mode", ["relative", "chunk_indexed", "absolute"])
@pytest.mark.parametrize("chunk,n", [(8, 96), (8, 101), (32, 256), (6, 60), (1, 40), (2, 33)])
def test_decode_scores_every_candidate_like_the_probe_bisection(
    mode: str, chunk: int, n: int, head_score: str
) -> None:
    """Decode scores all candidates at once and bisects on those scores (`bisect_scores`): the
    chunk scores are the probe bisection's (`chunk_scores`), on whole and partial chunks, with
    either head score (softmax: the bisection keeps q.k per head, the softmax over chunks after)."""
    gen = torch.Generator().manual_seed(chunk * n)
    keys = torch.randn(300, 2, D, generator=gen)  # [S, G, D]
    q = torch.randn(1, 4, D, generator=gen)
    cand = torch.randperm(280, generator=gen)[:n].sort().values + 10
    score = ScoreFn(
        q, torch.tensor([299]), keys, mode, RopeTable(Rotary(RopeConfig(), D)), 16, -(-n // chunk)
    )
    c = -(-n // chunk)
    padded = torch.full((c * chunk,), -1, dtype=torch.long)
    padded[:n] = cand
    lengths = torch.full((c,), chunk, dtype=torch.long)
    lengths[-1] = n - (c - 1) * chunk
    probes = chunk_scores(padded.view(c, chunk), lengths, score, head_score)
    soft = head_score == "softmax"
    dense = bisect_scores(*score.all_candidates(cand, chunk, per_head=soft), chunk, n)
    if soft:
        dense = softmax_over_chunks(dense, score.scale)
    assert dense.shape == probes.shape == (c,)
    assert torch.allclose(dense, probes, rtol=1e-5, atol=1e-5)
    # and prune_stage, which takes this path for one query, keeps the chunks the probes rank top
    keep = max(1, c // 2) * chunk
    kept = prune_stage(q, torch.tensor([299]), keys, cand, chunk, keep, mode=mode, rotary=score.rotary,
                       window=16, head_score=head_score)  # fmt: skip
    top = torch.topk(probes, keep // chunk).indices.sort().values
    expect = padded.view(c, chunk)[top].flatten()
    assert torch.equal(kept, expect[expect >= 0])


def test_decode_scoring_in_slabs_equals_one_product(monkeypatch: pytest.MonkeyPatch) -> None:
    """Candidates scored slab by slab (bounded memory) give the same scores as all at once."""
    import kvtier.sparse.pruning as pruning

    gen = torch.Generator().manual_seed(5)
    keys = torch.randn(300, 2, D, generator=gen)
    q = torch.randn(1, 4, D, generator=gen)
    cand = torch.arange(10, 250)
    for mode in ("relative", "chunk_indexed"):
        score = ScoreFn(q, torch.tensor([299]), keys, mode, RopeTable(Rotary(RopeConfig(), D)), 16, 30)
        whole = score.all_candidates(cand, 8)
        monkeypatch.setattr(pruning, "SCORING_SLAB", 128)
        slabs = score.all_candidates(cand, 8)
        monkeypatch.undo()
        for a, b in zip(whole, slabs, strict=True):
            assert torch.allclose(a, b, rtol=1e-6, atol=1e-6)
        # bisected slab by slab (128 key vectors over 2 KV heads: 64 candidates, so whole chunks of
        # 64 // 24 * 24 = 48 a slab), per head too
        for per_head in (False, True):
            one = bisect_scores(*score.all_candidates(cand, 24, per_head=per_head), 24, cand.numel())
            monkeypatch.setattr(pruning, "SCORING_SLAB", 128)
            parts = score.bisected(cand, 24, per_head=per_head)
            monkeypatch.undo()
            assert parts.shape == one.shape and torch.allclose(parts, one, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("batch_bytes", [1 << 30, 1])  # 1: every block its own batch
@pytest.mark.parametrize("s", [400, 150])  # 150: some blocks keep every chunk they have
@pytest.mark.parametrize("mode", ["relative", "chunk_indexed", "absolute"])
@pytest.mark.parametrize("head_score", ["max", "softmax"])
def test_prefill_blocks_pruned_together_select_what_each_block_selects_alone(
    mode: str, s: int, batch_bytes: int, head_score: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`run_block_stages` (the blocks of a prefill chunk as one batch, or in memory-bounded
    batches) keeps, block by block, the positions `run_stages` keeps for each block alone,
    blocks with few candidates included, with either head score (softmax: over each block's
    own chunks, where the batch pads shorter blocks with empty ones)."""
    from kvtier.sparse import prefill
    from kvtier.sparse.prefill import run_block_stages
    from kvtier.sparse.pruning import run_stages

    monkeypatch.setattr(prefill, "PRUNE_BATCH_BYTES", batch_bytes)

    gen = torch.Generator().manual_seed(3)
    bq, sink, window = 8, 4, 16
    keys = torch.randn(s, 2, D, generator=gen)  # [S, G, D]
    q = torch.randn(6 * bq, 4, D, generator=gen)
    start = s - q.shape[0]
    rope = RopeTable(Rotary(RopeConfig(), D))
    stages = {"chunk_sizes": (32, 8, 2), "budgets": (96, 32, 16), "strides": (4, 4, 1)}
    starts = [max(sink, start + b - window + 1) for b in range(0, q.shape[0], bq)]
    pos = torch.arange(start, s).view(-1, bq)
    sel, n = run_block_stages(
        q.view(-1, bq, 4, D),
        pos,
        keys,
        sink,
        torch.tensor(starts),
        **stages,
        mode=mode,
        rotary=rope,
        window=window,
        head_score=head_score,
    )
    for b, w0 in enumerate(starts):
        alone = run_stages(
            q[b * bq : (b + 1) * bq],
            pos[b],
            keys,
            torch.arange(sink, w0),
            **stages,
            mode=mode,
            rotary=rope,
            window=window,
            head_score=head_score,
        )[-1]
        assert int(n[b]) == alone.numel()
        assert torch.equal(sel[b, : int(n[b])], alone)
        assert bool((sel[b, int(n[b]) :] == -1).all())


@pytest.mark.parametrize("stage0", [True, False])
def test_kept_chunks_come_out_sorted_with_padding_last(stage0: bool) -> None:
    """`prune_blocks` keeps chunks in chunk order instead of sorting their entries: rows are
    ascending positions, then -1, also for a block with fewer valid chunks than it keeps (its
    empty chunks tie at -inf) and for a block with none."""
    from kvtier.sparse.prefill import _span, prune_blocks

    gen = torch.Generator().manual_seed(5)
    keys = torch.randn(300, 2, D, generator=gen)
    q = torch.randn(3, 4, 4, D, generator=gen)  # [B, Nq, H_q, D]
    q_pos = torch.tensor([[296, 297, 298, 299]]).expand(3, -1)
    valid = torch.tensor([280, 70, 0])  # 35, 9 and 0 of 8-token chunks; 4 kept
    first = 8
    cand = None if stage0 else _span(first, 280, valid)
    kept, n = prune_blocks(
        q, q_pos, keys, cand, valid, 8, 32, mode="relative", rotary=None, window=16,
        first=first, width=280,
    )  # fmt: skip
    assert n.tolist() == [32, 32, 0]
    for b in range(3):
        row = kept[b]
        m = int(n[b])
        assert bool((row[m:] == -1).all()) and bool((row[:m] >= first).all())
        assert bool((row[:m] < first + valid[b]).all())
        assert bool((torch.diff(row[:m]) > 0).all())  # strictly ascending


def test_rope_table_grows_in_bounded_steps_with_the_same_values(monkeypatch: pytest.MonkeyPatch) -> None:
    """The table is computed a step of positions at a time (bounded temporaries), grows by about a
    quarter, and holds exactly Rotary.cos_sin's values."""
    import kvtier.sparse.rope_ext as rope_ext

    monkeypatch.setattr(rope_ext, "TABLE_STEP", 64)
    rotary = Rotary(RopeConfig(), D)
    table = RopeTable(rotary)
    x = torch.randn(300, 2, D)
    pos = torch.arange(300)
    out = table.rotate(x, pos, limit=300)
    assert table._cos.shape[0] == rope_ext.table_positions(300) == 384  # 300 + 75, in steps of 64
    assert torch.equal(out, rotate(rotary, x, pos))
    table.rotate(x[:1], torch.tensor([384]), limit=385)  # one past the end: grow by a quarter
    assert table._cos.shape[0] == rope_ext.table_positions(385) == 512
    cos, sin = rotary.cos_sin(torch.arange(512), torch.float32)
    assert torch.equal(table._cos, cos) and torch.equal(table._sin, sin)


def test_prune_batches_are_sized_on_the_largest_stage() -> None:
    """`lean` at 512K (Llama-3.1-8B shapes, a layer slice of 8 KV heads): the last stage scores
    2,048 8-token chunks for each of a block's 64 x 32 (query, head) rows (stride 1), 4x the
    first stage's rows. The batch bytes of a block cover that stage's softmax rows, so a 15K-token
    prefill chunk's 240 blocks are pruned ~12 at a time (~20 while torch's head score took a
    temporary of the rows' size), not ~190 (3 GB: the H200 ran out of memory under 24 GiB,
    bench/results/hip_cli_speed_512k_hip.json)."""
    from kvtier.sparse import HIP_PRESETS
    from kvtier.sparse.prune_memory import PRUNE_BATCH_BYTES, stage_prune_bytes

    lean = HIP_PRESETS["lean"]
    kw = {"chunk_sizes": lean.chunk_sizes, "budgets": lean.budgets, "strides": lean.query_strides}
    at_512k = max(
        stage_prune_bytes(524288 - lean.sink, 64, 32, 8, 128, **kw, triton=True, head_score="softmax")
    )
    # [C, R] float32, which the Triton head score reads in place (torch's took a temporary too)
    last_stage_rows = 4 * (lean.budgets[1] // lean.chunk_sizes[2]) * 64 * 32
    assert at_512k >= last_stage_rows
    assert PRUNE_BATCH_BYTES // at_512k <= 16
    # early in a prefill (32K keys) stage 0 has few chunks, but the later stages are as large
    at_32k = max(stage_prune_bytes(32768, 64, 32, 8, 128, **kw, triton=True, head_score="softmax"))
    assert at_32k >= last_stage_rows
    # the max head score keeps no rows: only the kept positions and the scores count
    plain = max(stage_prune_bytes(524288, 64, 32, 8, 128, **kw, triton=True, head_score="max"))
    # at 160K the first stage needs a seventh of the last: batched alike, it pruned 7 blocks at a
    # time where ~70 fit, and lean's prefill lost 30% (hip_cli_speed_160k_lean_fast_c.json)
    at_160k = stage_prune_bytes(163840 - lean.sink, 64, 32, 8, 128, **kw, triton=True, head_score="softmax")
    assert 6 * at_160k[0] < at_160k[-1]
    assert plain < last_stage_rows // 10


def test_prune_batches_keep_every_stages_softmax_rows_within_the_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Run on the CPU: with many query heads the stride-1 last stage's per-row scores dominate a
    block's pruning bytes, and every batch `run_block_stages` forms keeps them (the rows and one
    temporary) within `PRUNE_BATCH_BYTES`. Sized on stage 0 alone, a batch took 10 blocks and
    twice the bound. The first stage, with a quarter of the rows, takes more blocks a batch:
    sized on the largest stage, every stage took the last's few (lean's 160K prefill: 30%
    slower)."""
    from kvtier.sparse import prefill
    from kvtier.sparse.prefill import run_block_stages
    from kvtier.sparse.prune_memory import stage_prune_bytes

    bq, heads, g, s, sink, window = 8, 32, 2, 400, 4, 16
    stages = {"chunk_sizes": (32, 8, 2), "budgets": (96, 32, 16), "strides": (4, 4, 1)}
    sizes = stage_prune_bytes(s - sink, bq, heads, g, D, **stages, triton=False, head_score="softmax")
    per_block = max(sizes)
    monkeypatch.setattr(prefill, "PRUNE_BATCH_BYTES", 4 * per_block)
    seen: list[int] = []
    blocks: list[int] = []  # each batch's blocks, stage by stage
    original = prefill.softmax_head_score

    def recording(rows: torch.Tensor, live: torch.Tensor, scale: float) -> torch.Tensor:
        seen.append(rows.numel() * rows.element_size())
        blocks.append(rows.shape[0])
        return original(rows, live, scale)

    monkeypatch.setattr(prefill, "softmax_head_score", recording)
    gen = torch.Generator().manual_seed(5)
    keys = torch.randn(s, g, D, generator=gen)
    q = torch.randn(12 * bq, heads, D, generator=gen)
    start = s - q.shape[0]
    starts = [max(sink, start + b - window + 1) for b in range(0, q.shape[0], bq)]
    run_block_stages(
        q.view(-1, bq, heads, D),
        torch.arange(start, s).view(-1, bq),
        keys,
        sink,
        torch.tensor(starts),
        **stages,
        mode="relative",
        rotary=RopeTable(Rotary(RopeConfig(), D)),
        window=window,
        triton=False,
        head_score="softmax",
    )
    assert len(seen) >= 3 * 2  # every stage scored, in more than one batch
    assert 2 * max(seen) <= 4 * per_block
    assert sum(blocks) == 3 * 12  # every block in every stage, once
    assert blocks[0] > blocks[-1]  # stage 0's batches are larger than the last stage's


def test_decode_slabs_hold_a_fixed_count_of_key_vectors(monkeypatch: pytest.MonkeyPatch) -> None:
    """A slab bounds key vectors (candidates x KV heads), not candidates: a 2-head slice scores
    4x the candidates of an 8-head one per product (fewer launches at 1M), same memory."""
    import kvtier.sparse.pruning as pruning

    monkeypatch.setattr(pruning, "SCORING_SLAB", 256)
    gen = torch.Generator().manual_seed(9)
    q = torch.randn(1, 8, D, generator=gen)
    for groups, slabs in ((2, 8), (8, 32)):
        keys = torch.randn(1100, groups, D, generator=gen)
        score = ScoreFn(q, torch.tensor([1099]), keys, "chunk_indexed", None, 16, 64)
        calls: list[int] = []
        real = score._slab

        def counted(c: torch.Tensor, *a: Any, calls: list[int] = calls, real: Any = real) -> Any:
            calls.append(c.numel())
            return real(c, *a)

        monkeypatch.setattr(score, "_slab", counted)
        score.all_candidates(torch.arange(50, 1074), 16)
        assert len(calls) == slabs and max(calls) == 256 // groups


def test_hip_reserve_covers_a_decode_scoring_product(monkeypatch: pytest.MonkeyPatch) -> None:
    """HiP's always-held bytes cover the larger of prefill's pruning batch and one decode
    scoring product (`SCORING_SLAB` key vectors, fewer at a short context): Llama-3-8B's head
    dim 128 plans the product, SmolLM2's 64 keeps the prefill batch (its plans do not change)."""
    import kvtier.sparse as sparse
    from kvtier.loading.presets import preset_config
    from kvtier.sparse.prune_memory import PRUNE_BATCH_BYTES, decode_scoring_bytes

    def always(name: str, context: int) -> int:
        return sparse.hip_phase_bytes(preset_config(name), "fast", 2, context)[1]

    product = decode_scoring_bytes(sparse.SCORING_SLAB, 128, 2)
    assert product > PRUNE_BATCH_BYTES
    long, short, small = (
        always("llama-3-8b", 1 << 20),
        always("llama-3-8b", 1024),
        always("smollm2-135m", 1 << 15),
    )
    monkeypatch.setattr(sparse, "SCORING_SLAB", 0)  # the prefill batch alone
    assert long - always("llama-3-8b", 1 << 20) == product - PRUNE_BATCH_BYTES
    assert short == always("llama-3-8b", 1024)  # 1K tokens x 8 heads: below the prefill batch
    assert small == always("smollm2-135m", 1 << 15)


@pytest.mark.parametrize("mode", ["relative", "chunk_indexed", "absolute"])
@pytest.mark.parametrize("per_row", [False, True])
def test_cpu_bisection_in_tiles_equals_one_tile(
    mode: str, per_row: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CPU's bisection over tiles of blocks and chunks (`CPU_TILE_BYTES`) gives the scores of
    one tile of everything up to float rounding (the products run in other shapes: a few
    scores differ in the last bit), with chunk-indexed RoPE placing each tile's probes by their
    chunk's index in the block, a partial last chunk and empty chunks."""
    from kvtier.sparse import prefill, prefill_bisect

    gen = torch.Generator().manual_seed(7)
    s, g, r, nq, chunk, d = 300, 2, 3, 4, 8, 32
    keys = torch.randn(s, g, d, generator=gen)
    q = torch.randn(5, nq, g * r, d, generator=gen)
    q_pos = torch.tensor([[296 + i for i in range(nq)]] * 5) - torch.arange(5)[:, None] * 40
    valid = torch.tensor([290, 250, 211, 170, 37])
    rows = [torch.randperm(s, generator=gen)[: int(v)].sort().values for v in valid.tolist()]
    cand = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=-1)
    c_count = -(-cand.shape[1] // chunk)
    lengths = (valid[:, None] - torch.arange(c_count)[None, :] * chunk).clamp(0, chunk)
    rope = RopeTable(Rotary(RopeConfig(), d, device=torch.device("cpu")))
    qr, limit = prefill.scoring_queries(
        q, q_pos, keys, valid, chunk, c_count, mode=mode, rotary=rope, window=8
    )
    chunks = prefill._chunks(cand, c_count, chunk)

    def scores() -> torch.Tensor:
        kw = {"mode": mode, "rotary": rope, "limit": limit, "per_row": per_row}
        return prefill_bisect.bisect_chunks(qr, keys, chunks, lengths, **kw)

    monkeypatch.setattr(prefill_bisect, "CPU_TILE_BYTES", 1 << 30)
    whole = scores()
    monkeypatch.setattr(prefill_bisect, "CPU_TILE_BYTES", 2 * nq * g * r * 4 * 5)  # 5 chunks of 2 blocks
    monkeypatch.setattr(prefill_bisect, "CPU_TILE_BLOCKS", 2)
    tiled = scores()
    assert tiled.shape == whole.shape == ((5, c_count, nq * g * r) if per_row else (5, c_count))
    torch.testing.assert_close(tiled, whole, rtol=1e-6, atol=4e-6)
    live = lengths > 0

    def kept(rows: torch.Tensor) -> torch.Tensor:  # the chunks a stage keeping 8 would keep
        score = prefill.softmax_head_score(rows.clone(), live, d**-0.5) if per_row else rows
        return torch.where(live, score, float("-inf")).topk(8, dim=1).indices.sort(dim=1).values

    assert torch.equal(kept(tiled), kept(whole))
