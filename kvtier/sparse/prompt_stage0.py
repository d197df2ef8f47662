"""Stage 0 of the first query after a prefill, scored on the prompt's landmarks
(`HipConfig.prompt_landmarks`, a request's `--hip-landmarks all`).

With `HipConfig.stage0_landmarks` the prefill's stage 0 scores each chunk by one landmark key
(`kvtier.sparse.landmarks`). The prompt's last token runs as a step of its own
(`HipConfig.last_query_alone`), a decode step, whose stage 0 bisected every chunk: over a
streamed slice that read all of its keys from the host tier (at 512K on an H100 ~38 GB over
PCIe and 1.59 s of a 35.3 s prefill by layer: bench/results/
hip_cli_speed_512k_fast_landmarks_triton.json). The query right after the prefill
(`Landmarks.end`: the prompt's last token, or its first answer token's without
`last_query_alone`) scores stage 0 on the same landmarks instead, so the whole prompt is
selected one way, and only the landmark keys (one a chunk and KV head) are read; the later
stages then read the kept chunks (through the block cache, when streamed). Decode steps after
it that rerun stage 0 bisect as before: decoded tokens have no landmarks.

Faster, and worse at retrieval: one query's selection on one key a chunk missed needles the
bisection found (SmolLM2 prose NIAH at 64K on an H100: 11 of 33 against 15), while at 512K it
took the last token's step from 1.59 s to 0.80 s (bench/results/
hip_cli_speed_512k_fast_landmarks_all_layer.json). So `--hip-landmarks on` leaves it off.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvtier.sparse.block_sparse import use_triton
from kvtier.sparse.config import HipConfig
from kvtier.sparse.landmarks import Landmarks, landmark_stage
from kvtier.sparse.prefill import LANDMARK_TRITON, scoring_queries
from kvtier.sparse.rope_ext import RopeTable


def prompt_chunks(cfg: HipConfig, marks: Landmarks | None, s: int, layer: int, w0: int) -> int:
    """The stage-0 chunks the query at position s scores on `marks` (its slice's landmarks, or
    one KV head's with `per_head`) over its candidates [sink, w0), or 0 where it does not:
    without `HipConfig.prompt_landmarks`, not the first query after a prefill that scored
    landmarks, chunks it never scored, or a stage 0 that keeps every candidate anyway."""
    if not cfg.prompt_landmarks or marks is None or marks.end != s or (where := marks.positions()) is None:
        return 0
    chunk, budget = cfg.chunk_sizes[0], cfg.stage_budgets(layer)[0]
    c_count = -(-max(0, w0 - cfg.sink) // chunk)
    return c_count if budget // chunk < c_count <= where.shape[0] else 0


def prompt_stage0(
    cfg: HipConfig,
    marks: Landmarks | None,
    q: torch.Tensor,
    s: int,
    layer: int,
    w0: int,
    rotary: RopeTable | None,
    read: Callable[[torch.Tensor], torch.Tensor | None],
) -> torch.Tensor | None:
    """Stage 0 of the decode query q [1, H_q, D] at position s over the candidates [sink, w0)
    on the prompt's landmarks `marks` (`prompt_chunks`): the kept positions [K], sorted. `read(where)`:
    the landmark keys [C, G, D] at where [C, G], as stored (None: they cannot be read there; the
    caller bisects). None where the landmarks do not apply (`prompt_chunks`) or cannot be read."""
    c_count = prompt_chunks(cfg, marks, s, layer, w0)
    if c_count == 0 or marks is None or marks.where is None:
        return None
    where = marks.where[:c_count]
    lk = read(where)  # [C, G, D]
    if lk is None:
        return None
    chunk, budget, n = cfg.chunk_sizes[0], cfg.stage_budgets(layer)[0], w0 - cfg.sink
    mode = cfg.scoring_rope(layer)
    pos = torch.full((1, 1), s, dtype=torch.long, device=q.device)
    valid = torch.full((1,), n, dtype=torch.long, device=q.device)
    qr, limit = scoring_queries(
        q[None], pos, lk, valid, chunk, c_count, mode=mode, rotary=rotary, window=cfg.window, length=s + 1
    )  # fmt: skip
    triton = q.is_cuda and use_triton() and LANDMARK_TRITON
    kept, _ = landmark_stage(
        qr, lk, where, valid, chunk, budget, first=cfg.sink, mode=mode, rotary=rotary, limit=limit,
        head_score=cfg.head_score, triton=triton,
    )  # fmt: skip
    # a partial last chunk kept leaves -1s at its end (a boolean mask: one sync a slice)
    return kept[0] if n % chunk == 0 else kept[0][kept[0] >= 0]
