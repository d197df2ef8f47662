"""Pruning-stage inputs shared by the chunk-scoring kernels' tests (tests/test_triton_bisect.py,
tests/test_chunk_max.py): three query blocks with different candidate counts (a partial last
chunk, empty chunks), their rotated scoring queries and chunk grid."""

from __future__ import annotations

from typing import NamedTuple

import torch

import tests.triton_interpreter  # noqa: F401 (first: it sets TRITON_INTERPRET before triton loads)
from kvtier.config import RopeConfig
from kvtier.model.rope import Rotary
from kvtier.sparse.prefill import _span, scoring_queries
from kvtier.sparse.rope_ext import RopeTable

D = 32


class PruneCase(NamedTuple):
    keys: torch.Tensor  # [S, G, D]
    cand: torch.Tensor  # [B, N] sorted positions, -1 padded
    lengths: torch.Tensor  # [B, C] valid entries a chunk
    rope: RopeTable | None
    qr: torch.Tensor  # [B, Nq, G, r, D] rotated at the scoring positions
    limit: int
    first: int  # stage 0's first candidate (with span)


def prune_case(device: str, span: bool, chunk: int, rotate: bool, mode: str, nq: int = 4) -> PruneCase:
    """Blocks of `nq` queries (2 KV heads x 3 query heads) over 300 keys with 270, 190 and 37
    candidates: stage 0's range from position 4 (`span`) or a different sorted set a block."""
    gen = torch.Generator().manual_seed(5)
    s, g, r, first = 300, 2, 3, 4
    keys = torch.randn(s, g, D, generator=gen).to(device)
    q = torch.randn(3, nq, g * r, D, generator=gen).to(device)  # [B, Nq, H_q, D]
    q_pos = torch.stack([torch.arange(p, p + nq) for p in (280, 200, 60)]).to(device)
    valid = torch.tensor([270, 190, 37], device=device)  # [B]
    if span:
        cand = _span(first, 270, valid)
    else:  # sorted distinct positions, a different set per block
        rows = [torch.randperm(s, generator=gen)[: int(v)].sort().values for v in valid.tolist()]
        cand = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=-1).to(device)
    c_count = -(-cand.shape[1] // chunk)
    lengths = (valid[:, None] - torch.arange(c_count, device=device)[None, :] * chunk).clamp(0, chunk)
    rope = RopeTable(Rotary(RopeConfig(), D, device=device)) if rotate else None
    qr, limit = scoring_queries(q, q_pos, keys, valid, chunk, c_count, mode=mode, rotary=rope, window=8)
    return PruneCase(keys, cand, lengths, rope, qr, limit, first)
