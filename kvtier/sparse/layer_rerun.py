"""The pruning stages a layer's streamed slices rerun together at a decode step (stages first..,
never 0), shared by `CachedDecode._refresh_layer` and its CUDA graph (`kvtier.sparse.decode_graph`).

Each stage scores every slice's candidates in one `prune_blocks`, a query block a slice, each
slice's keys read by address in its own block cache (`layer_key_addresses`):

    cand   [E, N]   each slice's candidates (sorted; -1 padding after a shorter slice's)
    valid  [E]      their counts
    ->     per stage: the kept positions [E, K] and their counts [E]
"""

from __future__ import annotations

import torch

from kvtier.sparse.config import HipConfig
from kvtier.sparse.gpu_cache import PositionedKV, layer_key_addresses
from kvtier.sparse.prefill import prune_blocks
from kvtier.sparse.rope_ext import RopeTable


def rerun_stages(
    cfg: HipConfig,
    layer: int,
    q: torch.Tensor,
    pos: torch.Tensor,
    views: list[PositionedKV],
    cand: torch.Tensor,
    valid: torch.Tensor,
    first: int,
    rotary: RopeTable | None,
    length: int,
) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], bool]:
    """Stages first.. of a layer's E slices: q [E, 1, H_q_e, D] their decode queries at pos [E, 1]
    (a device tensor: no host value of it is read), views their block caches, cand [E, N] and
    valid [E] the previous stage's selections. `length`: the slices' tokens (a bound on the RoPE
    positions, for the table's size only). Returns each stage's (kept [E, K], counts [E]) and
    whether a stage kept a partial chunk (-1s inside a slice's K, which the caller strips)."""
    outs: list[tuple[torch.Tensor, torch.Tensor]] = []
    partial = False
    for i in range(first, len(cfg.chunk_sizes)):
        m, chunk, budget = cand.shape[1], cfg.chunk_sizes[i], cfg.stage_budgets(layer)[i]
        if -(-m // chunk) > budget // chunk:  # else every candidate is kept (`prune_stage`)
            partial = partial or m % chunk != 0  # a partial chunk kept leaves -1s
            keys, addresses = layer_key_addresses(views, cand)
            cand, valid = prune_blocks(
                q, pos, keys, cand, valid, chunk, budget, mode=cfg.scoring_rope(layer), rotary=rotary,
                window=cfg.window, triton=True, head_score=cfg.head_score, addresses=addresses,
                length=length,
            )  # fmt: skip
        outs.append((cand, valid))
    return outs, partial
