"""How a pruning stage's candidates lie in chunks, shared by the bisection's stages
(`kvtier.sparse.prefill`) and the landmark stage (`kvtier.sparse.landmarks`): a block's span
of positions, candidates as [B, C, chunk], kept chunks as positions, and the "softmax" head
score over chunk scores."""

from __future__ import annotations

import torch


def kept_chunks(
    top: torch.Tensor, first: int, chunk: int, valid: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The positions [B, K] of chunks top [B, keep] (sorted) of candidates first .. first +
    valid[b] - 1 (chunk j: first + j * chunk + [0, chunk)), -1 past a block's last, and their
    counts [B]."""
    kept = first + top[:, :, None] * chunk + torch.arange(chunk, device=top.device)  # [B, keep, c]
    kept = torch.where(kept < first + valid[:, None, None], kept, -1).flatten(1)
    return kept, (kept >= 0).sum(dim=1)


def softmax_head_score(rows: torch.Tensor, live: torch.Tensor, scale: float) -> torch.Tensor:
    """The "softmax" head score from per-row chunk maxima rows [B, C, ...rows] (any strides: the
    Triton kernel's keep C contiguous): per row, a softmax over the block's live chunks (live
    [B, C]) of the scaled maxima, then the max over rows -> [B, C] (nan where a block has no
    live chunk; the caller masks those). Taken as max_r exp(x - logsumexp_c x), so no softmax
    output is written and both reductions run over the tensor as it lies (on CUDA a softmax
    along a strided dim took ~2 ms a layer of SmolLM2 at 16K). Overwrites `rows` (the pruning
    kernel's temporary): at most one more tensor of its size lives at once, inside logsumexp."""
    shape = (*live.shape, *([1] * (rows.dim() - 2)))
    logits = rows.mul_(scale).masked_fill_(~live.view(shape), float("-inf"))
    lse = torch.logsumexp(logits, dim=1, keepdim=True)
    return logits.sub_(lse).amax(dim=tuple(range(2, rows.dim()))).exp()


def _span(first: int, n: int, valid: torch.Tensor) -> torch.Tensor:
    """Candidates [B, n]: block b's positions first .. first + valid[b] - 1, then -1."""
    pos = torch.arange(first, first + n, device=valid.device)
    return torch.where(torch.arange(n, device=valid.device)[None, :] < valid[:, None], pos, -1)


def _chunks(candidates: torch.Tensor, c_count: int, chunk: int) -> torch.Tensor:
    """candidates [B, N] padded with -1 to [B, C, chunk]."""
    pad = c_count * chunk - candidates.shape[1]
    cand = torch.nn.functional.pad(candidates, (0, pad), value=-1) if pad else candidates
    return cand.view(candidates.shape[0], c_count, chunk)
