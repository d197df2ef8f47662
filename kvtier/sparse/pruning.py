"""Hierarchical chunk pruning (InfiniteHiP), pure torch: the reference for future GPU kernels.

One query block's selection, stage by stage:

    candidates (sorted key positions)     e.g. [sink .. w0) at stage 0
        | split into chunks of chunk_sizes[i] tokens *of the candidate list*
        v
    [c0 c0 c0 c0][c1 c1 c1 c1][c2 c2 -- --]      (last chunk may be partial: padded with -1)
        | per chunk: bisection for a representative key (SelectRep), score = running max of the
        | winning probes' q.k, max-pooled over the block's (pooled) queries and all heads
        v
    top budgets[i] // chunk_sizes[i] chunks, re-sorted by position -> next stage's candidates

Chunk sizes divide each other, so the chunks of a stage are sub-chunks of the previous stage's.
"""

from __future__ import annotations

import math

import torch

from kvtier.sparse.rope_ext import RopeTable, probe_positions, scoring_query_position


def pool_queries(q: torch.Tensor, positions: torch.Tensor, stride: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean-pool groups of `stride` consecutive queries: q [T, H, D] -> [ceil(T/stride), H, D].

    Returns the pooled queries and each group's last position [ceil(T/stride)].
    """
    t = q.shape[0]
    if stride == 1 or t == 1:
        return q, positions
    n = -(-t // stride)
    idx = torch.arange(t, device=q.device) // stride
    sums = torch.zeros(n, *q.shape[1:], dtype=q.dtype, device=q.device).index_add_(0, idx, q)
    counts = torch.bincount(idx, minlength=n).to(q.dtype)
    last = positions[torch.clamp(torch.arange(n, device=q.device) * stride + stride - 1, max=t - 1)]
    return sums / counts[:, None, None], last


def chunk_scores(
    chunks: torch.Tensor, lengths: torch.Tensor, score_keys: ScoreFn, head_score: str = "max"
) -> torch.Tensor:
    """SelectRep by bisection over each chunk; returns each chunk's score [C] (float32).

    chunks [C, c] key positions (-1 = padding), lengths [C] valid entries (>= 1, a prefix).
    Each of ceil(log2 c) rounds halves every chunk's range [lo, hi): it probes the midpoints of
    both halves, (lo+mid)//2 and (mid+hi)//2, keeps the half whose probe scores higher (max over
    queries and heads), and the chunk's score is the running max of the winning probes (as the
    reference code does). `head_score="max"` (published): that running max of raw q.k, max-pooled
    over queries and heads. `"softmax"` (not published): per (query, head), a softmax over chunks
    of the running max, then the max over (query, head), so a head with small logits that
    singles out one chunk still gets it kept.
    """
    c_count, c = chunks.shape
    rows = torch.arange(c_count, device=chunks.device)
    lo = torch.zeros(c_count, dtype=torch.long, device=chunks.device)
    hi = lengths.clone()
    best: torch.Tensor | None = None  # [C, Nq * H_q]
    for _ in range(max(1, math.ceil(math.log2(c)))):
        mid = lo + (hi - lo) // 2
        left, right = (lo + mid) // 2, (mid + hi) // 2
        s_left = score_keys(chunks[rows, left], rows, 0)  # [C, Nq * H_q]
        s_right = score_keys(chunks[rows, right], rows, 1)
        go_right = s_right.amax(1) > s_left.amax(1)
        top = torch.maximum(s_left, s_right)
        best = top if best is None else torch.maximum(best, top)
        lo = torch.where(go_right, mid, lo)
        hi = torch.where(go_right, hi, mid)
    assert best is not None
    if head_score == "softmax":
        return torch.softmax(best * score_keys.scale, dim=0).amax(dim=1)
    return best.amax(dim=1)


class ScoreFn:
    """Scores probe keys against a block of queries, with RoPE at the stage's scoring positions.

    `__call__(positions [C], chunk_index [C], side) -> [C, Nq * H_q]`: q.k per query and head.
    """

    def __init__(
        self,
        q: torch.Tensor,
        q_pos: torch.Tensor,
        keys: torch.Tensor,
        mode: str,
        rotary: RopeTable | None,
        window: int,
        n_chunks: int,
    ) -> None:
        g = keys.shape[1]
        self.keys = keys  # [S, G, D]
        self.mode = mode
        self.rotary = rotary
        # NOTE: every scoring position (queries, probes, chunk indices) is below this bound, so
        # RoPE never reads positions back to the host.
        self.limit = keys.shape[0] + window + n_chunks + 2
        if rotary is not None:
            q = rotary.rotate(q, scoring_query_position(mode, q_pos, window, n_chunks), limit=self.limit)
        n, hq, d = q.shape
        self.q = q.reshape(n, g, hq // g, d).float()  # [Nq, G, r, D]
        self.scale = d**-0.5

    def __call__(self, positions: torch.Tensor, chunk_index: torch.Tensor, side: int) -> torch.Tensor:
        k = self.keys[positions]  # [C, G, D]
        if self.rotary is not None:
            at = probe_positions(self.mode, side, chunk_index, positions)
            k = self.rotary.rotate(k, at, limit=self.limit)
        s = torch.einsum("ngrd,cgd->cngr", self.q, k.float())  # [C, Nq, G, r]
        return s.flatten(1)


def prune_stage(
    q: torch.Tensor,
    q_pos: torch.Tensor,
    keys: torch.Tensor,
    candidates: torch.Tensor,
    chunk: int,
    budget: int,
    *,
    mode: str,
    rotary: RopeTable | None,
    window: int,
    head_score: str = "max",
) -> torch.Tensor:
    """One pruning stage for one query block: the kept candidate positions, sorted.

    q [Nq, H_q, D] (pooled) queries with positions q_pos [Nq]; keys [S, G, D]; candidates [n]
    sorted positions. Keeps the top `budget // chunk` chunks; all of them when they fit.
    """
    n = candidates.numel()
    n_chunks = -(-n // chunk)
    keep = budget // chunk
    if n_chunks <= keep:
        return candidates
    padded = torch.full((n_chunks * chunk,), -1, dtype=torch.long, device=candidates.device)
    padded[:n] = candidates
    chunks = padded.view(n_chunks, chunk)  # [C, c]
    lengths = torch.full((n_chunks,), chunk, dtype=torch.long, device=candidates.device)
    lengths[-1] = n - (n_chunks - 1) * chunk
    score = ScoreFn(q, q_pos, keys, mode, rotary, window, n_chunks)
    scores = chunk_scores(chunks, lengths, score, head_score)
    top = torch.topk(scores, keep).indices.sort().values
    kept = chunks[top].flatten()
    if n % chunk == 0:  # no padding: skip the boolean mask (a GPU sync)
        return kept
    return kept[kept >= 0]


def run_stages(
    q: torch.Tensor,
    q_pos: torch.Tensor,
    keys: torch.Tensor,
    candidates: torch.Tensor,
    *,
    chunk_sizes: tuple[int, ...],
    budgets: tuple[int, ...],
    strides: tuple[int, ...],
    mode: str,
    rotary: RopeTable | None,
    window: int,
    first: int = 0,
    head_score: str = "max",
) -> list[torch.Tensor]:
    """Run stages `first`.. on one query block (q [Tb, H_q, D], q_pos [Tb]) from `candidates`.

    Returns each run stage's kept positions (sorted), in stage order.
    """
    outs = []
    for i in range(first, len(chunk_sizes)):
        pq, pp = pool_queries(q, q_pos, strides[i])
        candidates = prune_stage(
            pq,
            pp,
            keys,
            candidates,
            chunk_sizes[i],
            budgets[i],
            mode=mode,
            rotary=rotary,
            window=window,
            head_score=head_score,
        )
        outs.append(candidates)
    return outs
