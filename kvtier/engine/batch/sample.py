"""A batch step's next tokens: greedy rows in one argmax, sampled rows in one batched draw."""

from __future__ import annotations

import torch

from kvtier.engine.batch.sequence import Sequence
from kvtier.engine.sampling import sample_rows


def sample_all(seqs: list[Sequence], logits: torch.Tensor) -> list[int]:
    """Next token of each sequence from logits [N, vocab] (`sample_on_device`), then one host
    sync for all."""
    return [int(t) for t in sample_on_device(seqs, logits).tolist()]


def sample_on_device(seqs: list[Sequence], logits: torch.Tensor) -> torch.Tensor:
    """Next token of each sequence from logits [N, vocab], on their device ([N], no host sync):
    the greedy ones in one argmax, the sampled ones in one batch (`sample_rows`)."""
    logits = logits[: len(seqs)]
    picked = logits.argmax(-1)  # [N]
    drawn = [i for i, s in enumerate(seqs) if s.params.temperature != 0]
    if drawn:  # NOTE: all-greedy steps copy nothing to the device
        if len(drawn) == len(seqs):
            return sample_rows(logits, [s.sampler for s in seqs])
        rows = torch.tensor(drawn).to(logits.device, non_blocking=True)
        picked[rows] = sample_rows(logits[rows], [seqs[i].sampler for i in drawn])
    return picked
