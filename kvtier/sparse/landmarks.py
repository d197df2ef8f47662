"""Stage 0 of HiP's prefill pruning scored on one landmark key a chunk, not by bisection.

The bisection probes ~2 keys a level of every stage-0 chunk for every query block (8 levels
of 256-token chunks), dependent loads whose dot products grow with the context: at 512K stage 0
is 56% of `fast`'s pruning (bench/results/hip_kernels_512k_fast_stages.json). hip-attention's
later code instead gives each key a query-independent score once, when its chunk is
prefilled, the mean of its dot products with the next `WINDOW` queries (how much its neighbours
attend it), and keeps each chunk's best-scored key as the chunk's landmark; stage 0 then scores
a chunk by its landmark alone, one key a chunk in one dense product:

    score[t]      = mean over queries i in [t, t + WINDOW) of the chunk, heads h of the group: q_i,h . k_t
    landmark[j]   = argmax over chunk j's keys of score             (per KV head)
    stage0[b, j]  = head score over block b's pooled rows of q_r . rot(k[landmark[j]])

`Landmarks` keeps, per slice, each stage-0 chunk's best score and its position, merged chunk by
chunk of the prefill (a stage-0 chunk split by a prefill chunk takes the better of its parts).
Keys scored near a prefill chunk's end see fewer queries, as in hip-attention. Decode keeps the
bisection. Lossy differently from the bisection: `HipConfig.stage0_landmarks` chooses it.
"""

from __future__ import annotations

import torch

from kvtier.sparse.chunk_layout import kept_chunks, softmax_head_score
from kvtier.sparse.rope_ext import RopeTable

WINDOW = 512  # queries after a key whose attention scores it (hip-attention's landmark chunk)
# float32 products one batch of query blocks may hold in `landmark_stage`; the batch's queries
# take about as much again (inside HiP's pruning reserve, which is free before stage 0)
SCORE_BYTES = 64 << 20
# `key_scores`' temporaries a slab of keys may hold (also inside the pruning reserve,
# `PRUNE_BATCH_BYTES`, 256 MiB): ~3 slabs of a 16K chunk of 8 KV heads of 128 dims
KEY_SCORE_BYTES = 160 << 20
SCAN_BLOCK = 64  # rows a block of `running_sums` scans in sequence


def key_scores(
    q: torch.Tensor, k: torch.Tensor, start: int, rotary: RopeTable | None, triton: bool = False
) -> torch.Tensor:
    """Each key's landmark score [T, G], float32: the mean of q_i . k_t over the chunk's queries
    i in [t, t + WINDOW) and the query heads of its KV head, for a prefill chunk's queries
    q [T, H_q, D] and keys k [T, G, D] at positions start .. start + T - 1, both rotated there
    (`rotary`; None: as given).

    The mean of dot products is the dot product with the mean: k_t . (sum of the window's
    queries over their r heads) / (count * r). A window's sum is the difference of two running
    sums of the queries (float64, so the difference keeps float32's precision): O(T * D) work
    in a few launches a slab, where scoring each key against its window's queries took ~12
    launches a batch of 768 keys and ~5x the products (the windows overlap).

    `triton`: by `triton_landmarks`' kernel instead (CUDA, or CPU tensors under
    TRITON_INTERPRET=1): the band of products itself in tensor-core tiles, one launch."""
    t, hq, d = q.shape
    g = k.shape[1]
    if rotary is not None:
        pos = torch.arange(start, start + t, device=q.device)
        q, k = rotary.rotate(q, pos, limit=start + t), rotary.rotate(k, pos, limit=start + t)  # no sync
    if triton:
        from kvtier.sparse.triton_landmarks import key_scores_triton

        return key_scores_triton(q, k, WINDOW)
    r = hq // g
    # a slab's queries reach WINDOW - 1 past its last key; per row: the queries' sums, their
    # blocks, the blocks' running sums and the running sums (float64), the windows (float64),
    # their float32 copy and the keys' (52 bytes a value)
    rows = max(1, KEY_SCORE_BYTES // (52 * g * d) - WINDOW)
    out = torch.empty(t, g, dtype=torch.float32, device=q.device)
    for s0 in range(0, t, rows):
        n = min(rows, t - s0)
        e = min(t, s0 + n + WINDOW - 1)  # queries [s0, e): every window of the slab's keys
        qs = q[s0:e].reshape(e - s0, g, r, d).sum(dim=2, dtype=torch.float64)  # [E, G, D]
        sums = running_sums(qs)  # [E + 1, G, D]
        idx = torch.arange(n, device=q.device)
        hi = (idx + WINDOW).clamp(max=e - s0)  # each key's window end, slab-relative
        win = (sums[hi] - sums[:n]).float()  # [n, G, D]: the window's query sum
        dots = torch.einsum("ngd,ngd->ng", win, k[s0 : s0 + n].float())
        out[s0 : s0 + n] = dots / ((hi - idx) * r).unsqueeze(1)
    return out


def running_sums(x: torch.Tensor) -> torch.Tensor:
    """The exclusive running sums of x [E, ...] along dim 0: [E + 1, ...], row t the sum of
    rows 0 .. t - 1, in x's dtype. Scanned in blocks of SCAN_BLOCK rows (each block's own
    running sums, plus the sum of the blocks before it): one `cumsum` along dim 0 of a
    [5,850, 8, 128] float64 slab ran one thread per column through all its rows, 1.7 ms a slab
    and 83% of a 16K chunk's key scores on an H100 (8.3 ms, 8 KV heads); blocks give it a thread
    per block and column and SCAN_BLOCK steps."""
    e = x.shape[0]
    nb = -(-e // SCAN_BLOCK)
    blocks = x.new_zeros((nb * SCAN_BLOCK, *x.shape[1:]))
    blocks[:e] = x
    inner = blocks.view(nb, SCAN_BLOCK, *x.shape[1:]).cumsum(dim=1)  # inclusive, within a block
    before = inner[:, -1].cumsum(dim=0) - inner[:, -1]  # [nb, ...]: the blocks before each
    out = x.new_zeros((e + 1, *x.shape[1:]))
    out[1:] = (inner + before.unsqueeze(1)).view(nb * SCAN_BLOCK, *x.shape[1:])[:e]
    return out


class Landmarks:
    """One slice's stage-0 landmarks: chunk j = positions sink + j * chunk .. + chunk - 1, its
    best key score [C, G] and that key's position [C, G]; `end`: one past the last position
    scored (the prefill's end: the next query is the prompt's last token, or its first answer
    token's, which `kvtier.sparse.prompt_stage0` scores on these landmarks too)."""

    def __init__(self, sink: int, chunk: int) -> None:
        self.sink, self.chunk = sink, chunk
        self.best: torch.Tensor | None = None  # [C, G] float32
        self.where: torch.Tensor | None = None  # [C, G] int64
        self.end = 0

    def update(self, scores: torch.Tensor, start: int) -> None:
        """Merge the key scores [T, G] of positions start .. start + T - 1 (`key_scores`). A
        chunk from `start` on is replaced (a new sequence, or one prefilled again from there);
        one that `start` splits keeps its earlier keys and takes the better. Where the chunks
        before `start` were never scored (a prompt whose prefix came from a cache, or tokens
        decoded since), the landmarks are dropped until a prompt from the sinks scores them."""
        t, g = scores.shape
        self.end = start + t
        first = max(start, self.sink)
        if first >= start + t:
            return
        scores = scores[first - start :]
        j0, off = divmod(first - self.sink, self.chunk)
        keep = j0 + (1 if off else 0)  # chunks before `first` stay
        held = 0 if self.best is None else self.best.shape[0]
        if held < keep:  # a gap: no landmarks for its chunks
            self.best = self.where = None
            return
        n = -(-(off + scores.shape[0]) // self.chunk)
        grid = torch.full((n * self.chunk, g), float("-inf"), device=scores.device)
        grid[off : off + scores.shape[0]] = scores
        best, arg = grid.view(n, self.chunk, g).max(dim=1)  # [n, G]
        where = self.sink + (j0 + torch.arange(n, device=scores.device))[:, None] * self.chunk + arg
        if self.best is None or self.where is None:  # from the sinks on: nothing to keep
            self.best, self.where = best, where
            return
        if off:  # the split chunk: the better of its two parts
            better = best[0] > self.best[j0]
            best[0] = torch.where(better, best[0], self.best[j0])
            where[0] = torch.where(better, where[0], self.where[j0])
        self.best = torch.cat((self.best[:j0], best))
        self.where = torch.cat((self.where[:j0], where))

    def positions(self) -> torch.Tensor | None:
        """Each chunk's landmark position [C, G] (a key of its KV head), or None where no prompt
        from the sinks has scored them (stage 0 then bisects)."""
        return self.where


def landmark_keys(keys: torch.Tensor, where: torch.Tensor, c_count: int) -> torch.Tensor:
    """The first `c_count` chunks' landmark keys [C, G, D] of a slice's keys [S, G, D], where
    [C', G] (C' >= c_count) their positions (`Landmarks.positions`), a KV head's of its head."""
    return keys[where[:c_count], torch.arange(keys.shape[1], device=keys.device)]


def landmark_stage(
    qr: torch.Tensor,
    lk: torch.Tensor,
    where: torch.Tensor,
    valid: torch.Tensor,
    chunk: int,
    budget: int,
    *,
    first: int,
    mode: str,
    rotary: RopeTable | None,
    limit: int,
    head_score: str = "max",
    triton: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stage 0 of B query blocks over their candidates first .. first + valid[b] - 1, each chunk
    scored by its landmark key: qr [B, Nq, G, r, D] rotated as `scoring_queries` rotates them
    for `mode`, lk [C, G, D] the landmark keys of the widest block's C chunks (`landmark_keys`,
    as stored: un-rotated with context extension), where [C', G] their positions (C' >= C).
    The landmarks are rotated as the bisection's probes: at their chunk's index
    (chunk_indexed), their positions (absolute), or not at all (relative).

    `triton`: score with `triton_chunk_max`'s kernel (CUDA, or CPU tensors under
    TRITON_INTERPRET=1), the landmarks as one-key chunks of a [C, G, D] key table: one
    tensor-core product a tile and the max over rows in registers, where the torch products
    write every (row, chunk) score in float32 and read it back for the max (1.07 GB at 512K,
    16K queries of 8 KV heads: 4.4 ms of a 16 ms pruning, bench/results/
    hip_kernels_512k_fast_landmarks.json). The same scores up to float rounding (bf16 products
    summed in another order).

    Returns the kept positions [B, K] (sorted, -1 padded) and their counts [B], as
    `prune_blocks` does for stage 0."""
    bsz, _nq, g, _r, d = qr.shape
    keep, c_count = budget // chunk, lk.shape[0]
    if rotary is not None and mode != "relative":
        at = where[:c_count] if mode == "absolute" else torch.arange(c_count, device=lk.device)[:, None]
        at = at.expand(-1, g).reshape(-1)
        lk = rotary.rotate(lk.reshape(-1, 1, d), at, limit=limit).view(c_count, g, d)
    lengths = (valid[:, None] - torch.arange(c_count, device=valid.device)[None, :] * chunk).clamp(0, chunk)
    live = lengths > 0  # [B, C]
    scores = (_triton_scores if triton else _torch_scores)(qr, lk, live, head_score)  # [B, C]
    if c_count <= keep:
        top = torch.arange(c_count, device=qr.device).expand(bsz, -1)
    else:
        top = torch.topk(scores, keep, dim=1).indices.sort(dim=1).values  # [B, keep]
    return kept_chunks(top, first, chunk, valid)


def _triton_scores(qr: torch.Tensor, lk: torch.Tensor, live: torch.Tensor, head_score: str) -> torch.Tensor:
    """`_torch_scores` by `chunk_max_triton`: chunks of one key each, the table's rows in order
    (stage 0's implicit range from 0, no rotation: the landmarks are rotated already); a chunk
    of no live key scores -inf there."""
    from kvtier.sparse.triton_chunk_max import chunk_max_triton

    softmax = head_score == "softmax"
    scale = qr.shape[-1] ** -0.5 if softmax else None
    return chunk_max_triton(
        qr, lk, None, 0, live.long(), 1, mode="relative", tables=None, per_row=softmax, softmax_scale=scale
    )


def _torch_scores(qr: torch.Tensor, lk: torch.Tensor, live: torch.Tensor, head_score: str) -> torch.Tensor:
    """Each block's head score of each chunk's landmark [B, C] (-inf where not live), from qr
    [B, Nq, G, r, D] and the rotated landmarks lk [C, G, D], in float32 products per batch of
    blocks."""
    bsz, nq, g, r, d = qr.shape
    c_count = lk.shape[0]
    step = max(1, SCORE_BYTES // max(1, 4 * c_count * g * nq * r))
    scores = torch.empty(bsz, c_count, dtype=torch.float32, device=qr.device)
    for b0 in range(0, bsz, step):
        qb = qr[b0 : b0 + step].float()
        if head_score == "softmax":  # [B, C, rows]: a softmax over live chunks, then the max over rows
            rows = torch.einsum("bngrd,cgd->bcgnr", qb, lk.float()).flatten(2)
            part = softmax_head_score(rows, live[b0 : b0 + step], d**-0.5)
        else:  # the max over rows, reduced in the product's own layout (no [B, C, rows] copy)
            part = torch.einsum("bngrd,cgd->bgnrc", qb, lk.float()).amax(dim=(1, 2, 3))
        scores[b0 : b0 + step] = torch.where(live[b0 : b0 + step], part, float("-inf"))
    return scores
