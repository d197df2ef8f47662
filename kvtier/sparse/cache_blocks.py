"""Which token blocks the GPU block cache of a streamed slice reads and keeps (HiP offload).

`HipKernel` serves the decode steps between stage-0 refreshes of a streamed slice from a
`BlockCache`; these functions decide its contents from the slice's decode states (one per KV
head with `per_head`, else one) and the step's position `start`:

    needed_positions   what a cached step reads: sinks, the earliest due stage's candidates
                       (the final selection when none is due), the window up to `start`
    refresh_blocks     after a refresh, with a cache that covers a whole interval: stage 0's
                       output, sinks and window as block ids, without a host sync
    keep_blocks        after a refresh (or an overflowing step) otherwise: the same blocks in
                       priority order, as many as the cache holds
    fetch_blocks       missing blocks read from host memory, every run in one fetch
"""

from __future__ import annotations

import torch

from kvtier.attention.interface import Fetch
from kvtier.sparse.config import HipConfig
from kvtier.sparse.decode_buffer import DecodeState
from kvtier.sparse.gpu_cache import BlockCache, CacheStats


def needed_positions(
    cfg: HipConfig, states: list[DecodeState], start: int, device: torch.device
) -> torch.Tensor:
    """Positions a cached decode step at `start` reads: sinks, the candidates of the earliest due
    stage (the final selection when none is due), window [w0, start]. Union over states."""
    parts = [torch.arange(min(cfg.sink, start + 1), device=device)]
    for st in states:
        stage = st.first_due(cfg.refresh, st.step + 1) - 1
        parts.append(st.outputs[stage].to(device))
        # NOTE: a context shorter than the sinks has its window start past the query: none
        parts.append(torch.arange(min(st.window_start, start + 1), start + 1, device=device))
    return torch.cat(parts)


def refresh_blocks(
    cfg: HipConfig, states: list[DecodeState], start: int, device: torch.device, cache: BlockCache
) -> torch.Tensor | None:
    """The blocks of stage 0's output, sinks and window without `unique` (a sync), or None if
    unsure (then `keep_blocks`).

    Stage 0 keeps whole chunks of consecutive positions (its candidates are a range), each
    starting at a multiple of chunk_sizes[0] in its sorted output. Sampling that output every
    `block` entries, plus each chunk's last entry, hits every block a chunk touches (samples
    are at most `block` positions apart), at most one sample per block of the capacity
    formula. Sinks and window are ranges known on the host; the window's last block (the
    new token's) comes last. Duplicates are harmless: a duplicate slot holds a copy.

        sorted stage-0 output  [ s .. s+255 ][ t .. t+255 ] ...   (chunk 256, block 16)
        samples                 ^   ^  ..  ^^ ^   ^  ..  ^^       16 + 1 per chunk
    """
    b, c0 = cache.block, cfg.chunk_sizes[0]
    if c0 % b:
        return None
    parts = []
    w0 = start + 1
    for st in states:
        sel = st.outputs[0].to(device)
        n = sel.shape[0]
        if n:
            ends = torch.arange(c0 - 1, n + c0 - 1, c0, device=device).clamp(max=n - 1)  # partial: n - 1
            parts.append(torch.div(sel[ends], b, rounding_mode="floor"))
            parts.append(torch.div(sel[::b], b, rounding_mode="floor"))
        w0 = min(w0, st.window_start)
    w0 = min(w0, start + 1)  # a context shorter than the sinks: no window past the query
    # NOTE: the sink blocks stop below the window's first block: `append` writes the new
    # token to one copy of the last block only, so the block it writes must not be duplicated
    # (a context shorter than the sinks has its window inside the sink blocks).
    sink_blocks = min(-(-min(cfg.sink, start + 1) // b), w0 // b)
    parts.insert(0, torch.arange(sink_blocks, device=device))
    parts.append(torch.arange(w0 // b, start // b + 1, device=device))
    blocks = torch.cat(parts)
    m = blocks.shape[0]
    # The appends until the next stage-0 refresh take free slots (never a refreshed block).
    upcoming = (start + cfg.refresh[0]) // b - start // b
    if m + upcoming > cache.slots:
        return None
    return blocks


def keep_blocks(
    cfg: HipConfig,
    states: list[DecodeState],
    start: int,
    device: torch.device,
    slots: int,
    within: torch.Tensor | None = None,
) -> torch.Tensor:
    """The blocks a cache of `slots` keeps after a full step (sorted, unique, at most `slots`
    unless the sinks and window alone exceed it): the sinks and the window, then the final
    selection, then each earlier stage's output, as far as they fit. So the next steps, which
    read the final selection, hit, and so do as many as fit of the stage reruns' reads. A cache
    that covers the interval keeps all of stage 0's output. `within` (sorted block ids): of
    those, only the ones in it (what a step read, so its overflow holds them).

    One host-device sync: every tier's blocks are ranked at once, by (tier, block id) after
    dropping a block from all tiers but its first,

        tier    0 (edges)  1 (final)  2 (stage 1)  3 (stage 0)
        rank    0 .. n0-1  n0 ..      ..           ..            keep rank < max(slots, n0)

    which is the order the tiers would fill the cache one by one.
    """
    b = cfg.cache_block
    w0 = min(min(st.window_start for st in states), start + 1)  # none past the query
    edges = torch.cat(
        (torch.arange(min(cfg.sink, start + 1), device=device), torch.arange(w0, start + 1, device=device))
    )
    stages = reversed(range(len(cfg.chunk_sizes)))  # the final selection first
    tiers = [edges] + [torch.cat([st.outputs[i].to(device) for st in states]) for i in stages]
    ids = torch.div(torch.cat(tiers), b, rounding_mode="floor")  # [n]
    tier = torch.cat([torch.full((t.numel(),), i, device=device) for i, t in enumerate(tiers)])
    n_tiers, span = len(tiers), int(start // b) + 1  # every id is below span
    by_id = torch.sort(ids * n_tiers + tier).values  # [n]: each id's first tier comes first
    first = torch.ones_like(by_id, dtype=torch.bool)
    first[1:] = by_id[1:] // n_tiers != by_id[:-1] // n_tiers
    # Rank: by (tier, id), repeats last (tier n_tiers).
    rank_key = torch.where(first, by_id % n_tiers, n_tiers) * span + by_id // n_tiers
    order = torch.sort(rank_key).values
    tier_of, id_of = order // span, order % span
    n0 = (tier_of == 0).sum()
    rank = torch.arange(order.numel(), device=device)
    keep = (tier_of < n_tiers) & ((rank < slots) | (rank < n0))
    if within is not None:
        keep &= torch.isin(id_of, within)
    return id_of[keep].sort().values


def fetch_blocks(
    missing: torch.Tensor, block: int, stored: int, fetch: Fetch, like: torch.Tensor, stats: CacheStats
) -> torch.Tensor:
    """Missing blocks [k] read from the host, runs of consecutive blocks as one span each, all
    spans in one `fetch.runs` (a stage rerun over more candidates than the cache holds misses
    hundreds of runs a slice; one call each cost ~0.9 s a step at 512K on the H200).

    Rows at or past `stored` (not on the host yet) are zero; `like` [_, 2, G, D] gives row shape,
    dtype and device. Counts the bytes read in `stats.fetched_bytes`. Returns [k, block, 2, G, D].
    """
    ids = missing.cpu()  # [k] the one sync (a 1M refresh that turns a slice's selection over: ~2K)
    k = ids.shape[0]
    out = torch.empty(k * block, *like.shape[1:], dtype=like.dtype, device=like.device)
    cut = torch.nonzero(ids[1:] != ids[:-1] + 1).flatten() + 1  # where a run of consecutive ids starts
    first = torch.cat((torch.zeros(1, dtype=torch.long), cut)) if k else cut  # [R] each run's first index
    last = torch.cat((cut, torch.full((1,), k, dtype=torch.long))) - 1 if k else cut
    lo, hi, at = ids[first] * block, (ids[last] * block + block).clamp(max=stored), first * block
    live = hi > lo
    spans = [(a, b, c) for a, b, c in torch.stack((lo, hi, at), 1)[live].tolist()]
    read = int((hi - lo)[live].sum())
    end = int((at + hi - lo)[live].max()) if spans else 0
    if read < out.shape[0]:  # rows past `stored`: zero (with ids in order, the rows after `end`)
        out[end if end == read else 0 :].zero_()
    fetch.runs(spans, out)
    stats.fetched_bytes += read * like[0].numel() * like.element_size()
    return out.view(len(ids), block, *like.shape[1:])
