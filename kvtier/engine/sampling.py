"""Sampling parameters (vLLM's names) and the sampler."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvtier.errors import ConfigError
from kvtier.units import SEED_LIMIT

SEED_MIN = -(2**63)
"""The lowest seed `torch.Generator.manual_seed` takes (the CLI's --seed starts at 0; the server
takes negative seeds too)."""


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens. temperature 0 is greedy; `seed` makes sampling reproducible."""

    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ConfigError(f"max_tokens must be at least 1, got {self.max_tokens}")
        # NOTE: `not x >= 0` and friends are also true for nan, which no comparison accepts.
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ConfigError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ConfigError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if self.seed is not None and not SEED_MIN <= self.seed < SEED_LIMIT:
            raise ConfigError(f"seed must be in {SEED_MIN}..{SEED_LIMIT - 1}, got {self.seed}")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        if any(not s for s in self.stop):
            raise ConfigError("stop strings must not be empty")


class Sampler:
    """Picks the next token from float32 logits [vocab], with a random stream of its own (seeded
    by `params.seed` when given), so a request's tokens do not depend on what it is batched with."""

    def __init__(self, params: SamplingParams, device: torch.device) -> None:
        self.params = params
        self.generator: torch.Generator | None = None
        if params.temperature > 0:
            self.generator = torch.Generator(device=device)
            if params.seed is not None:
                self.generator.manual_seed(params.seed)
            else:
                self.generator.seed()

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """Token id as a 0-d tensor on the logits' device (no host sync)."""
        if self.params.temperature == 0:
            return logits.argmax(-1)
        return sample_rows(logits[None], [self])[0]


def sample_rows(logits: torch.Tensor, samplers: list[Sampler]) -> torch.Tensor:
    """One token per row of logits [N, vocab] (float32), row i drawn by samplers[i] (each with
    temperature > 0), in one batch of operations instead of ~13 a row: per-row temperature,
    top-k (ties kept) and top-p (the smallest set of tokens whose mass reaches it), then an
    exponential race, argmax(p / e) with e ~ Exp(1) a token drawn from each row's own generator,
    which picks token j with probability p_j. Returns [N] token ids on the logits' device (no
    host sync). A row's result does not depend on the other rows: `Sampler` draws one row alike."""
    dev = logits.device
    params = [s.params for s in samplers]
    temps = torch.tensor([p.temperature for p in params], dtype=logits.dtype).to(dev, non_blocking=True)
    x = logits / temps[:, None]  # [N, V]
    ks = [min(p.top_k, x.shape[-1]) for p in params]
    if any(ks):
        top = torch.topk(x, max(ks), dim=-1).values  # [N, kmax], descending
        at = torch.tensor([max(k, 1) - 1 for k in ks]).to(dev, non_blocking=True)
        kth = top.gather(1, at[:, None])  # [N, 1]
        on = torch.tensor([k > 0 for k in ks]).to(dev, non_blocking=True)
        x = x.masked_fill((x < kth) & on[:, None], float("-inf"))
    if any(p.top_p < 1.0 for p in params):
        tops = torch.tensor([p.top_p for p in params], dtype=x.dtype).to(dev, non_blocking=True)
        ordered, order = torch.sort(x, dim=-1, descending=True)
        mass = ordered.softmax(-1)
        drop = (mass.cumsum(-1) - mass >= tops[:, None]) & (tops[:, None] < 1.0)  # mass before >= top_p
        x = torch.empty_like(x).scatter_(-1, order, ordered.masked_fill(drop, float("-inf")))
    probs = x.softmax(-1)
    race = torch.empty_like(probs)
    for i, s in enumerate(samplers):  # NOTE: one launch a row, each on the row's own stream of numbers
        race[i].exponential_(generator=s.generator)
    return (probs / race.clamp_(min=torch.finfo(race.dtype).tiny)).argmax(-1)  # [N]
