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

# Decode (one pooled query) scores every candidate of a stage, not just the probes: a few large
# operators instead of two gathers and RoPEs a round. Key vectors (candidates x KV heads) per
# product, which bounds the temporaries (`decode_scoring_bytes`: ~0.4 GB at head dim 128 in
# bf16): 65,536 candidates of an 8-head slice, 262,144 of a 2-head one. NOTE: a bound in
# candidates alone made 1M's 2-head slices score in 16 slabs of ~34 launches each, most of a
# stage-0 step's ~550 launches a slice (hip_offload_planned_1m_int4_gather.json's profile).
SCORING_SLAB = 1 << 19


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
        return softmax_over_chunks(best, score_keys.scale)
    return best.amax(dim=1)


def softmax_over_chunks(best: torch.Tensor, scale: float) -> torch.Tensor:
    """The "softmax" head score: per (query, head) column of best [C, Nq * H_q], a softmax over
    the C chunks of the scaled running max, then the max over columns -> [C]."""
    return torch.softmax(best * scale, dim=0).amax(dim=1)


def bisect_scores(left: torch.Tensor, right: torch.Tensor, chunk: int, n: int) -> torch.Tensor:
    """`chunk_scores` from every candidate's score as a left and as a right probe.

    left, right [n] (max-pooled q.k, the "max" head score) or [n, K] (q.k per query and head,
    for the "softmax" one): each candidate at its left-/right-branch probe position; chunks of
    `chunk` consecutive candidates, the last one partial when chunk does not divide n. The same
    bisection, on scores instead of probes (a branch is chosen by the max over the K columns,
    the running max is kept per column); returns [ceil(n / chunk)] (or [ceil(n / chunk), K]).

    NOTE: with whole chunks of a power-of-two size every node of a round spans the same number
    of candidates, so each round's probes are strided views and the path is chosen bottom-up,
    4 operators a round for all chunks:

        round r: nodes [C, 2**r, chunk >> r]; probes at fixed offsets of every node
        value(node) = max(top(node), value(the child its probes choose)); score = value(root)
    """
    flat = left.dim() == 1
    left, right = (left[:, None], right[:, None]) if flat else (left, right)  # [n, K]
    rounds = max(1, math.ceil(math.log2(chunk)))
    if n % chunk or chunk & (chunk - 1):
        value = _bisect_generic(left, right, chunk, n, rounds)
        return value[:, 0] if flat else value
    c_count, k = n // chunk, left.shape[1]
    tops, go = [], []
    for r in range(rounds):
        size = chunk >> r
        mid = size // 2
        sl = left.view(c_count, 1 << r, size, k)[:, :, mid // 2]  # [C, 2**r, K]
        sr = right.view(c_count, 1 << r, size, k)[:, :, (mid + size) // 2]
        tops.append(torch.maximum(sl, sr))
        go.append((sr > sl) if flat else (sr.amax(-1) > sl.amax(-1))[..., None])
    value = tops[-1]
    for r in range(rounds - 2, -1, -1):
        child = value.view(c_count, 1 << r, 2, k)
        value = torch.maximum(tops[r], torch.where(go[r], child[:, :, 1], child[:, :, 0]))
    value = value.view(c_count, k)
    return value[:, 0] if flat else value


def _bisect_generic(left: torch.Tensor, right: torch.Tensor, chunk: int, n: int, rounds: int) -> torch.Tensor:
    """`bisect_scores` for any chunk size and a partial last chunk, left/right [n, K]:
    `chunk_scores`'s loop. Returns [ceil(n / chunk), K]."""
    c_count = -(-n // chunk)
    base = torch.arange(c_count, device=left.device) * chunk
    lo = torch.zeros(c_count, dtype=torch.long, device=left.device)
    hi = torch.full((c_count,), chunk, dtype=torch.long, device=left.device)
    hi[-1] = n - (c_count - 1) * chunk
    best: torch.Tensor | None = None
    for _ in range(rounds):
        mid = lo + (hi - lo) // 2
        s_left = left[base + (lo + mid) // 2]  # [C, K]
        s_right = right[base + (mid + hi) // 2]
        go_right = s_right.amax(1) > s_left.amax(1)
        top = torch.maximum(s_left, s_right)
        best = top if best is None else torch.maximum(best, top)
        lo = torch.where(go_right, mid, lo)
        hi = torch.where(go_right, hi, mid)
    assert best is not None
    return best


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
        self.q_raw, self.q_pos, self.window, self.n_chunks, self.groups = q, q_pos, window, n_chunks, g
        self.scale = q.shape[-1] ** -0.5
        self._q: torch.Tensor | None = None
        self._q_sides: torch.Tensor | None = None  # relative RoPE: queries as seen by each side

    @property
    def slab(self) -> int:
        """Candidates scored per product: `SCORING_SLAB` key vectors over the slice's KV heads."""
        return max(1, SCORING_SLAB // self.groups)

    @property
    def q(self) -> torch.Tensor:
        """The queries at their scoring positions, [Nq, G, r, D] float32 (rotated on first use)."""
        if self._q is None:
            q = self.q_raw
            if self.rotary is not None:
                at = scoring_query_position(self.mode, self.q_pos, self.window, self.n_chunks)
                q = self.rotary.rotate(q, at, limit=self.limit)
            n, hq, d = q.shape
            self._q = q.reshape(n, self.groups, hq // self.groups, d).float()
        return self._q

    def all_candidates(
        self, candidates: torch.Tensor, chunk: int, span: int | None = None, per_head: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every candidate scored as a left-branch and as a right-branch probe: two [n] tensors of
        q.k max-pooled over queries and heads (one tensor twice when the side does not matter);
        `per_head`: two [n, Nq * H_q] tensors, q.k per query and head (the softmax head score).

        candidates [n] sorted positions; chunk j holds candidates [j * chunk, (j + 1) * chunk).
        Keys are read in slabs of `slab` candidates (bounded temporary memory at any context).
        `span`: the candidates are the range span..span+n-1 of a whole slice (keys are sliced,
        not gathered).
        """
        n, slab = candidates.shape[0], self.slab
        parts = [
            self._slab(candidates[lo : lo + slab], lo, chunk, span, per_head) for lo in range(0, n, slab)
        ]
        if len(parts) == 1:
            return parts[0]
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])

    def bisected(
        self, candidates: torch.Tensor, chunk: int, span: int | None = None, per_head: bool = False
    ) -> torch.Tensor:
        """`bisect_scores` of `all_candidates`, slab by slab of whole chunks, so per-head scores
        never exist for more than a slab of candidates at once: [C] (or [C, Nq * H_q])."""
        n = candidates.shape[0]
        step = max(chunk, self.slab // chunk * chunk)
        parts = []
        for lo in range(0, n, step):
            part = candidates[lo : lo + step]
            left, right = self._slab(part, lo, chunk, span, per_head)
            parts.append(bisect_scores(left, right, chunk, part.shape[0]))
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _slab(
        self, candidates: torch.Tensor, offset: int, chunk: int, span: int | None, per_head: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`all_candidates` of candidates [m] starting at candidate index `offset`."""
        lo, m = (span or 0) + offset, candidates.shape[0]
        k = self.keys[candidates] if span is None else self.keys[lo : lo + m]  # [m, G, D]
        if self.rotary is None:
            return (s := self._scores(k, per_head)), s
        if self.mode == "relative":
            # NOTE: every probe of a side sits at one position (0 or 1) and the queries at
            # window + 1; RoPE depends only on the distance, so the keys stay un-rotated and the
            # queries move instead: to window + 1 (left) and window (right). One product.
            if self._q_sides is None:
                nq, hq, d = self.q_raw.shape
                at = scoring_query_position(self.mode, self.q_pos, self.window, 0)  # [Nq]
                qs = self.rotary.rotate(self.q_raw.repeat(2, 1, 1), torch.cat((at, at - 1)), limit=self.limit)
                self._q_sides = qs.reshape(2 * nq, self.groups, hq // self.groups, d).float()
            s2 = torch.einsum("ngrd,cgd->cngr", self._q_sides, k.float())  # [m, 2 Nq, G, r]
            s2 = s2.reshape(k.shape[0], 2, -1)  # [m, side, Nq * H_q]
            if not per_head:
                s2 = s2.amax(dim=2)
            return s2[:, 0], s2[:, 1]
        index = (torch.arange(k.shape[0], device=k.device) + offset) // chunk
        at = probe_positions(self.mode, 0, index, candidates)
        s = self._scores(self.rotary.rotate(k, at, limit=self.limit), per_head)
        return s, s

    def _scores(self, k: torch.Tensor, per_head: bool) -> torch.Tensor:
        """q.k for keys k [n, G, D]: per query and head [n, Nq * H_q], or their max [n] (float32)."""
        s = torch.einsum("ngrd,cgd->cngr", self.q, k.float()).flatten(1)
        return s if per_head else s.amax(dim=1)

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
    span: int | None = None,
) -> torch.Tensor:
    """One pruning stage for one query block: the kept candidate positions, sorted.

    q [Nq, H_q, D] (pooled) queries with positions q_pos [Nq]; keys [S, G, D]; candidates [n]
    sorted positions. Keeps the top `budget // chunk` chunks; all of them when they fit.
    `span`: the caller knows candidates == arange(span, span + n) and keys is a whole slice.
    """
    n = candidates.numel()
    n_chunks = -(-n // chunk)
    keep = budget // chunk
    if n_chunks <= keep:
        return candidates
    padded = torch.full((n_chunks * chunk,), -1, dtype=torch.long, device=candidates.device)
    padded[:n] = candidates
    chunks = padded.view(n_chunks, chunk)  # [C, c]
    score = ScoreFn(q, q_pos, keys, mode, rotary, window, n_chunks)
    if q.shape[0] == 1:  # decode: every candidate in one product, then the bisection on scores
        soft = head_score == "softmax"
        scores = score.bisected(candidates, chunk, span, per_head=soft)
        if soft:
            scores = softmax_over_chunks(scores, score.scale)
    else:
        lengths = torch.full((n_chunks,), chunk, dtype=torch.long, device=candidates.device)
        lengths[-1] = n - (n_chunks - 1) * chunk
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
    span: int | None = None,
) -> list[torch.Tensor]:
    """Run stages `first`.. on one query block (q [Tb, H_q, D], q_pos [Tb]) from `candidates`.

    `span`: candidates == arange(span, span + n) over a whole slice of keys (see prune_stage).
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
            span=span if i == first else None,
        )
        outs.append(candidates)
    return outs
