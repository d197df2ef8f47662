"""HiP prefill pruning of many query blocks at once: one set of operators per stage, not per block.

`run_stages` prunes one query block at a time, so a prefill chunk of 64 blocks launches every
stage's ~100 operators 64 times per slice. Here the blocks of a chunk are a batch dimension:

    candidates  [B, N]      sorted positions, valid entries first, -1 padding after
    chunks      [B, C, c]   chunk j of block b = candidates [b, j*c : (j+1)*c]
    lengths     [B, C]      valid entries of each chunk (0: no chunk, scored -inf)

Stage 0's candidates differ between blocks only in length (each block's window starts 64
tokens later), so all blocks share one chunk grid. Every stage runs `chunk_scores`'s bisection on
[B, C] at once, with either head score: "max" keeps each chunk's running max max-pooled over
the block's queries and heads; "softmax" keeps it per (query, head) row, [B, C, R], takes a
softmax over each block's live chunks per row (empty chunks are -inf) and then the max over
rows, as `chunk_scores` does for one block. The top `budget // c` chunks of each block are kept in chunk
order, which keeps their entries sorted with the padding last (no sort). Where a block has no
more chunks than it keeps, all are kept, as `prune_stage` returns its candidates.

NOTE: the same selection as `run_stages` block by block up to float rounding (pooling and
products run as batched operators), so a near-tie between chunk scores may break differently.
"""

from __future__ import annotations

import torch

from kvtier.attention.interface import ExtentKeys
from kvtier.sparse.block_sparse import use_triton
from kvtier.sparse.chunk_layout import _chunks, _span, kept_chunks, softmax_head_score
from kvtier.sparse.config import EXACT_CHUNK_MAX, HipConfig
from kvtier.sparse.landmarks import landmark_keys, landmark_stage
from kvtier.sparse.prefill_bisect import bisect_chunks
from kvtier.sparse.prune_memory import PRUNE_BATCH_BYTES, stage_prune_bytes
from kvtier.sparse.rope_ext import RopeTable, scoring_query_position

# With Triton, the "softmax" head score runs as `triton_head_score`'s two passes; False: the torch
# passes of `softmax_head_score` over the kernel's rows (bench/hip_kernels.py's A/B).
TRITON_HEAD_SCORE = True
# With it, the bisection kernel also writes each row's logsumexp over its chunks in parts, so
# the head score reads the maxima once, not twice (`bisect_triton(softmax_scale=...)`); False:
# the two passes over the rows (bench/hip_kernels.py's A/B).
FUSED_LSE = True
# With Triton, stage 0 on landmarks scores them by `triton_chunk_max`'s kernel (one-key chunks);
# False: torch's float32 products per batch of blocks (bench/hip_kernels.py's A/B)
LANDMARK_TRITON = True


def pool_blocks(
    q: torch.Tensor, q_pos: torch.Tensor, stride: int, ragged: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean-pool groups of `stride` queries of blocks: q [B, Tb, H, D] -> [B, Tb/stride, H, D]
    (Tb a multiple of stride), and each group's last position [B, Tb/stride].

    `ragged`: some blocks end early (q_pos -1 after their last query, whose rows are ignored).
    A group then pools its live queries alone, as `pruning.pool_queries` pools a short block's
    last group, and a group with none repeats the block's last live group: a copy of a row
    changes no max over rows, so the block scores as the short block alone would."""
    b, t, h, d = q.shape
    if not ragged:
        if stride == 1:
            return q, q_pos
        pooled = q.view(b, t // stride, stride, h, d).sum(dim=2) / stride
        return pooled, q_pos[:, stride - 1 :: stride]
    g = t // stride
    live = (q_pos >= 0).view(b, g, stride).to(q.dtype)  # [B, G, stride]
    sums = (q.view(b, g, stride, h, d) * live[..., None, None]).sum(dim=2)
    counts = live.sum(dim=2)  # [B, G]
    pooled = sums / counts.clamp(min=1)[..., None, None]
    last = q_pos.view(b, g, stride).amax(dim=2)  # [B, G]: each group's last live position
    filled = (counts > 0).sum(dim=1, keepdim=True) - 1  # [B, 1]: live groups come first
    idx = torch.minimum(torch.arange(g, device=q.device)[None, :], filled.clamp(min=0))  # [B, G]
    return pooled.gather(1, idx[..., None, None].expand(-1, -1, h, d)), last.gather(1, idx)


def prune_blocks(
    q: torch.Tensor,
    q_pos: torch.Tensor,
    keys: torch.Tensor | ExtentKeys,
    candidates: torch.Tensor | None,
    valid: torch.Tensor,
    chunk: int,
    budget: int,
    *,
    mode: str,
    rotary: RopeTable | None,
    window: int,
    first: int = 0,
    width: int = 0,
    triton: bool = False,
    head_score: str = "max",
    addresses: torch.Tensor | None = None,
    length: int | None = None,
    scoring: tuple[torch.Tensor, int] | None = None,
    exact: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One pruning stage of B query blocks: q [B, Nq, H_q, D] pooled queries at q_pos [B, Nq],
    keys [S, G, D], candidates [B, N] (sorted, -1 padded) with valid [B] entries each, or None:
    block b's candidates are first .. first + valid[b] - 1 (stage 0, or a stage after stages that
    kept all they had), N = `width`.
    `triton`: score chunks with `bisect_triton` (CUDA, or CPU tensors under TRITON_INTERPRET=1),
    which alone reads keys in place from host memory (`ExtentKeys`, stage 0: `candidates` None).
    `head_score`: "max" or "softmax", as `pruning.chunk_scores`. `addresses` [B, N] (with
    `triton` and candidates): where each candidate's key is in keys (`bisect_triton`), keys then
    not indexed by position; `length`: the slice's length then (keys' rows otherwise).
    `scoring`: `scoring_queries` of these blocks, when the caller rotated them once for all its
    batches (each batch rotating its own took ~5 launches of ~25 a batch on CUDA).
    `exact`: score every key of each chunk, not the bisection's probes (`triton_chunk_max`,
    or `bisect_chunks(exact=True)` without Triton), where the keys are one tensor indexed by
    position and chunks are a power of two up to `EXACT_CHUNK_MAX` tokens (else the bisection).

    Returns the kept positions [B, K] (sorted, -1 padded; K = min(budget, N rounded up to whole
    chunks)) and their counts [B]. No host sync.
    """
    n = candidates.shape[1] if candidates is not None else width
    c_count = -(-n // chunk)
    keep = budget // chunk
    dev = valid.device
    if candidates is None and not (triton and c_count > keep):
        candidates = _span(first, n, valid)
    if c_count <= keep:  # every block keeps all it has
        assert candidates is not None
        return candidates, valid
    starts = torch.arange(c_count, device=dev) * chunk  # [C]
    lengths = (valid[:, None] - starts[None, :]).clamp(min=0, max=chunk)  # [B, C]
    if scoring is None:
        scoring = scoring_queries(
            q, q_pos, keys, valid, chunk, c_count, mode=mode, rotary=rotary, window=window, length=length
        )
    qr, limit = scoring
    chunks = _chunks(candidates, c_count, chunk) if candidates is not None else None  # [B, C, c]
    per_row = head_score == "softmax"
    scale = q.shape[-1] ** -0.5
    fused = per_row and triton and TRITON_HEAD_SCORE and FUSED_LSE  # scores: the head score itself
    fine = chunk <= EXACT_CHUNK_MAX and chunk & (chunk - 1) == 0  # whole chunks in a 64-key tile
    exact = exact and fine and isinstance(keys, torch.Tensor) and addresses is None
    if triton:
        from kvtier.sparse.triton_bisect import bisect_triton
        from kvtier.sparse.triton_chunk_max import chunk_max_triton

        like = q if isinstance(keys, ExtentKeys) else keys  # the table's dtype and device
        tables = rotary.tables(limit, like) if rotary is not None else None
        if exact:
            assert isinstance(keys, torch.Tensor)
            scores = chunk_max_triton(
                qr, keys, candidates, first, lengths, chunk, mode=mode, tables=tables, per_row=per_row,
                softmax_scale=scale if fused else None,
            )  # fmt: skip
        else:
            scores = bisect_triton(
                qr, keys, candidates, first, lengths, chunk, mode=mode, tables=tables, per_row=per_row,
                addresses=addresses, softmax_scale=scale if fused else None,
            )  # fmt: skip
    else:
        assert chunks is not None and isinstance(keys, torch.Tensor), "keys in place need the Triton kernel"
        scores = bisect_chunks(
            qr, keys, chunks, lengths, mode=mode, rotary=rotary, limit=limit, per_row=per_row, exact=exact
        )
    if per_row and triton and TRITON_HEAD_SCORE and not fused:  # the kernel's rows [B, C, G, rows]
        from kvtier.sparse.triton_head_score import softmax_head_score_triton

        scores = softmax_head_score_triton(scores, lengths, scale)  # dead chunks -inf
    elif not fused:  # (fused: the kernel's head score, dead chunks -inf already)
        if per_row:  # scores [B, C, rows...]: a softmax over each row's live chunks, then the max over rows
            scores = softmax_head_score(scores, lengths > 0, scale)
        scores = torch.where(lengths > 0, scores, float("-inf"))
    top = torch.topk(scores, keep, dim=1).indices.sort(dim=1).values  # [B, keep]
    # Chunks are consecutive runs of the sorted candidates and every -1 lies past the last valid
    # entry, so kept chunks in ascending order are already sorted with their padding last.
    if chunks is None:  # stage 0: chunk j holds first + j * chunk + [0, chunk)
        return kept_chunks(top, first, chunk, valid)
    kept = chunks.gather(1, top[:, :, None].expand(-1, -1, chunk)).flatten(1)  # [B, keep * c]
    return kept, (kept >= 0).sum(dim=1)


def scoring_queries(
    q: torch.Tensor,
    q_pos: torch.Tensor,
    keys: torch.Tensor | ExtentKeys,
    valid: torch.Tensor,
    chunk: int,
    c_count: int,
    *,
    mode: str,
    rotary: RopeTable | None,
    window: int,
    length: int | None = None,
) -> tuple[torch.Tensor, int]:
    """Pooled queries q [B, Nq, H_q, D] at q_pos [B, Nq] rotated at the scoring positions of
    `mode` and split per KV head: [B, Nq, G, r, D]; and a bound on every scoring position
    (queries and probes) of a stage of `chunk`-token chunks, at most `c_count` of them, over
    valid [B] candidates a block. `length`: the slice's tokens, when keys' rows are not its
    positions. A block's rotation depends on its own candidates alone, so the queries of many
    blocks may be rotated at once and split into batches after."""
    g = keys.shape[1]
    limit = (length or keys.shape[0]) + window + c_count + 2  # every scoring position is below it
    if rotary is not None:
        if mode == "chunk_indexed":  # per block: min(true position, its chunk count + window)
            n_chunks = -(-valid // chunk)  # [B] each block's own chunk count
            at = torch.minimum(q_pos, (n_chunks + window)[:, None]).flatten()
        else:
            at = scoring_query_position(mode, q_pos.flatten(), window, c_count)
        q = rotary.rotate(q.flatten(0, 1), at, limit=limit).view(q.shape)
    bsz, nq, hq, d = q.shape
    return q.reshape(bsz, nq, g, hq // g, d), limit


def run_block_stages(
    q: torch.Tensor,
    q_pos: torch.Tensor,
    keys: torch.Tensor,
    sink: int,
    window_starts: torch.Tensor,
    *,
    chunk_sizes: tuple[int, ...],
    budgets: tuple[int, ...],
    strides: tuple[int, ...],
    mode: str,
    rotary: RopeTable | None,
    window: int,
    triton: bool | None = None,
    head_score: str = "max",
    ragged: bool = False,
    starts_host: list[int] | None = None,
    batch_bytes: int | None = None,
    exact_chunk: int = 0,
    stage0_group: int = 1,
    landmarks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every stage for B query blocks q [B, Tb, H_q, D] at q_pos [B, Tb] over keys [S, G, D]
    of a whole slice; block b's stage-0 candidates are [sink, window_starts[b]). `ragged`: a
    block may end early (q_pos -1 past its last query; see `pool_blocks`). `starts_host`: the
    window starts as host ints, if the caller has them (else read back: one sync).
    `exact_chunk`: stages of chunks of at most this many tokens score every key of a chunk
    (`prune_blocks(exact=True)`; `HipConfig.exact_chunk`). `stage0_group`: consecutive blocks
    whose pooled queries prune stage 0 together, over the first one's candidates, each of them
    taking its result (B a multiple of it, no ragged block; else one block a group).
    `landmarks` [C, G]: stage 0 scores each chunk by its landmark key (`kvtier.sparse.landmarks`).

    Returns the final selection [B, K] (sorted, -1 padded) and its counts [B].

    Chunks are scored by `bisect_triton` (`triton`; None: on CUDA when triton is installed) or
    by `bisect_chunks`'s torch operators. Stage by stage, blocks are pruned in batches whose
    temporaries (`stage_prune_bytes`), with every block's candidates, stay near `batch_bytes`
    (None: `PRUNE_BATCH_BYTES`): with torch the probe keys of every chunk of every block, in float32, and
    their scores (at 512K a layer slice of 8 KV heads takes ~25 MB per block, so 64 blocks at
    once took ~1.6 GB); with Triton only the kept positions (~0.8 MB a block). The "softmax"
    head score adds each chunk's per-row maxima and their softmax. Each stage has its own batch
    size: one sized on the largest stage pruned `lean`'s 160K prefill 7 blocks at a time in
    every stage and took 30% longer (bench/results/hip_cli_speed_160k_lean_fast_c.json).
    """
    if triton is None:
        triton = q.is_cuda and use_triton()
    n_blocks = q.shape[0]
    stage_bytes = stage_prune_bytes(
        keys.shape[0] - sink, q.shape[1], q.shape[2], keys.shape[1], keys.shape[2],
        chunk_sizes=chunk_sizes, budgets=budgets, strides=strides, triton=triton, head_score=head_score,
    )  # fmt: skip
    starts_all = starts_host if starts_host is not None else window_starts.tolist()  # NOTE: else a sync
    n_in = max(0, max(starts_all) - sink)  # stage 0's candidates: [sink, window_starts[b])
    valid = (window_starts - sink).clamp(min=0)
    # [B, n_in] after a stage that pruned, -1 padded; None while every stage so far kept all it
    # had: block b's positions sink .. sink + valid[b] - 1, which the next stage's kernel reads by
    # position (no candidate list to load before each key: lean's 8-token stage at 16K)
    cand: torch.Tensor | None = None
    for stage, (c, k, stride, per_block) in enumerate(
        zip(chunk_sizes, budgets, strides, stage_bytes, strict=True)
    ):
        if -(-n_in // c) <= k // c:  # every block keeps all it has (lean's first two stages
            continue  # up to 16K): no launches
        pq, pp = pool_blocks(q, q_pos, stride, ragged)  # [B, Tb/stride, H_q, D], [B, Tb/stride]
        # stage 0 once per group of blocks (`HipConfig.stage0_block_q`), over its first's candidates
        group = stage0_group if stage == 0 and not ragged and n_blocks % stage0_group == 0 else 1
        blocks, v, starts = n_blocks // group, valid[::group], starts_all[::group]
        pq, pp = pq.reshape(blocks, -1, *pq.shape[2:]), pp.reshape(blocks, -1)
        n_out = n_in if -(-n_in // c) <= k // c else k // c * c  # the widest any batch returns
        # every block's candidates (in and out) and pooled queries live through the stage: the
        # batches get the rest of the bound
        carried = 8 * blocks * (n_in + n_out if cand is not None else n_out)
        carried += pq.numel() * pq.element_size() if stride > 1 else 0
        bound = PRUNE_BATCH_BYTES if batch_bytes is None else batch_bytes
        step = max(1, (bound - carried) // (per_block * group))
        # Several batches that prune: rotate every block's queries once, a copy the stage holds
        # (counted in the bound), where it is small beside the bound: Llama-3's unpooled last
        # stage at 512K would hold ~126 MB and halve the batches, costing more launches than
        # the rotations save
        scoring = None
        rotated = pq.numel() * pq.element_size() if rotary is not None else 0
        if step < blocks and -(-n_in // c) > k // c and rotated <= bound // 8:
            step = max(1, (bound - carried - rotated) // (per_block * group))
            scoring = scoring_queries(
                pq, pp, keys, v, c, -(-n_in // c), mode=mode, rotary=rotary, window=window
            )  # fmt: skip
        if stage == 0 and landmarks is not None:
            c_n = -(-n_in // c)
            qr, lim = scoring_queries(pq, pp, keys, v, c, c_n, mode=mode, rotary=rotary, window=window)
            cand, valid = landmark_stage(
                qr, landmark_keys(keys, landmarks, c_n), landmarks, v, c, k, first=sink, mode=mode,
                rotary=rotary, limit=lim, head_score=head_score, triton=triton and LANDMARK_TRITON,
            )  # fmt: skip
        elif step >= blocks:
            cand, valid = prune_blocks(
                pq, pp, keys, cand, v, c, k, mode=mode, rotary=rotary, window=window,
                first=sink, width=n_in, triton=triton, head_score=head_score, exact=c <= exact_chunk,
            )  # fmt: skip
        else:
            out = torch.full((blocks, n_out), -1, dtype=torch.long, device=q.device)
            kept = torch.empty_like(v)
            for i in range(0, blocks, step):
                sp = slice(i, i + step)
                width = max(0, max(starts[sp]) - sink) if cand is None else n_in
                batch = None if scoring is None else (scoring[0][sp], scoring[1])
                sel, n_sel = prune_blocks(
                    pq[sp], pp[sp], keys, None if cand is None else cand[sp], v[sp], c, k,
                    mode=mode, rotary=rotary, window=window, first=sink, width=width,
                    triton=triton, head_score=head_score, scoring=batch, exact=c <= exact_chunk,
                )  # fmt: skip
                out[sp, : sel.shape[1]] = sel
                kept[sp] = n_sel
            cand, valid = out, kept
        if group > 1:  # each block of a group takes its selection
            cand, valid = cand.repeat_interleave(group, 0), valid.repeat_interleave(group, 0)
        n_in = cand.shape[1]
    return (_span(sink, n_in, valid) if cand is None else cand), valid


def prune_whole_blocks(
    q: torch.Tensor,
    start: int,
    keys: torch.Tensor,
    window_starts: list[int],
    cfg: HipConfig,
    layer: int,
    rotary: RopeTable | None,
    landmarks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`run_block_stages` with `cfg`'s stages for every query block of a prefill chunk q [T, H_q, D]
    whose first query is at `start`, over a slice's keys [S, G, D]; window_starts: each block's
    w0 (ceil(T / block_q) of them). A short last block is padded (`pool_blocks`' ragged
    pooling), and a block that ends among the sinks keeps those before its end, so every block
    selects and attends as it would alone.

    Returns each block's attended prefix [n, sink + K] (its sinks, then its selection, -1
    padded) and how many keys the prefixes hold (a device scalar: no sync).
    """
    n, bq, dev = len(window_starts), cfg.block_q, q.device
    t = q.shape[0]
    pad = n * bq - t
    pos = torch.arange(start, start + n * bq, device=dev)
    pos = torch.where(pos < start + t, pos, -1).view(n, bq)  # [n, Tb], -1 past the chunk
    if pad:  # copies of the last query: `pool_blocks` pools past them
        q = torch.cat((q, q[-1:].expand(pad, *q.shape[1:])))
    w0 = torch.tensor(window_starts, dtype=torch.long).to(dev, non_blocking=True)
    sel, n_sel = run_block_stages(
        q.reshape(n, bq, *q.shape[1:]),
        pos,
        keys,
        cfg.sink,
        w0,
        chunk_sizes=cfg.chunk_sizes,
        budgets=cfg.stage_budgets(layer),
        strides=cfg.query_strides,
        mode=cfg.scoring_rope(layer),
        rotary=rotary,
        window=cfg.window,
        head_score=cfg.head_score,
        ragged=pad > 0,
        starts_host=window_starts,
        batch_bytes=cfg.prune_bytes,
        exact_chunk=cfg.exact_chunk,
        stage0_group=max(1, cfg.stage0_block_q // bq),
        landmarks=landmarks,
    )
    ends = torch.clamp(start + (torch.arange(n, device=dev) + 1) * bq, max=start + t)  # [n]
    prefix = attended_prefix(sel, cfg.sink, ends)
    return prefix, (prefix[:, : cfg.sink] >= 0).sum() + n_sel.sum()


def attended_prefix(sel: torch.Tensor, sink: int, ends: torch.Tensor) -> torch.Tensor:
    """Each block's attended prefix [n, sink + K]: its sinks, then its selection sel [n, K]
    (-1 padded). A block that ends among the sinks (ends [n]: one past its last query) keeps
    only those before its end, as `attend_blocks` requires of a prefix (every entry before the
    block's window); such a block selects nothing, so valid entries still come first."""
    sinks = torch.arange(sink, device=sel.device).expand(sel.shape[0], -1)
    sinks = torch.where(sinks < ends[:, None], sinks, -1)  # a block's sinks end with it
    return torch.cat((sinks, sel), dim=1)
