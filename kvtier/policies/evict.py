"""Token eviction under a KV budget: sliding window, StreamingLLM, H2O and SnapKV.

Each evictor implements the store's `Evictor` hook: after every step, with `length` tokens in a
slice, it returns the token indices each KV head keeps ([G, K], ascending) or None. Kept tokens
stay in order; the store compacts them and shrinks the slice's length, never `position`.

```
 window      [ .................................. | last B          ]
 streaming   [ sinks | ......................... | last B - sinks  ]   (RoPE at cache indices)
 h2o         [ top B/2 by accumulated attention  | last B/2        ]   (per KV head)
 snapkv      [ top B - w by window votes, pooled | last w = window ]   (per KV head, prefill)
```

NOTE: one evictor serves one store at a time; `bind` (called by the store) resets its state.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvtier.attention.interface import SliceStep
from kvtier.errors import ConfigError
from kvtier.kv.layout import KVLayout


def check_budget(budget: int, capacity: int, what: str) -> None:
    """A budget must be below the store's capacity, or nothing would ever be evicted."""
    if budget >= capacity:
        raise ConfigError(
            f"--kv-budget {budget} is not below the context capacity of {capacity} tokens: {what} "
            "would never evict; use a smaller budget or no eviction"
        )


def _recent(length: int, n: int, like: torch.Tensor | None = None) -> torch.Tensor:
    """Indices of the newest `n` of `length` tokens (on `like`'s device)."""
    return torch.arange(length - n, length, device=None if like is None else like.device)


class _Budgeted:
    """Shared state: the budget, the layout it was bound to, and a slice-id lookup."""

    name = "evictor"

    def __init__(self, budget: int, minimum: int) -> None:
        if budget < minimum:
            raise ConfigError(
                f"--kv-budget {budget} is too small for --evict {self.name}: use at least {minimum}"
            )
        self.budget = budget
        self.group_size = 1
        self.layout: KVLayout | None = None

    def bind(self, layout: KVLayout, capacity: int) -> frozenset[int]:
        check_budget(self.budget, capacity, f"--evict {self.name}")
        self.layout = layout
        self.group_size = layout.group_size
        self.reset()
        return frozenset(range(layout.num_slices))

    def reset(self) -> None:
        """Forget the previous sequence."""

    def slice_id(self, step: SliceStep) -> int:
        assert self.layout is not None, "evictor used before the store bound it"
        return self.layout.slice_index(step.layer, step.group)


class WindowEvictor(_Budgeted):
    """Keep the first `sinks` tokens and the most recent `budget - sinks` (sinks=0: sliding window).

    StreamingLLM (sinks=4) pairs this with `CacheRopeKernel`, so positions are cache indices.
    """

    WINDOW, STREAMING = "window", "streaming"  # its names without and with sinks

    def __init__(self, budget: int, sinks: int = 0) -> None:
        self.name = self.STREAMING if sinks else self.WINDOW
        super().__init__(budget, sinks + 1)
        self.sinks = sinks

    def keep(self, slice_id: int, length: int, new_tokens: int) -> torch.Tensor | None:
        if length <= self.budget:
            return None
        idx = torch.cat((torch.arange(self.sinks), _recent(length, self.budget - self.sinks)))
        return idx.expand(self.group_size, -1)


class H2OEvictor(_Budgeted):
    """Heavy hitters: per KV head, the `budget - recent` older tokens with the largest attention
    accumulated over every query so far, plus the `recent` newest tokens (H2O: half and half)."""

    name = "h2o"

    def __init__(self, budget: int, recent: int | None = None) -> None:
        super().__init__(budget, 2)
        self.recent = budget // 2 if recent is None else recent
        self.scores: dict[int, torch.Tensor] = {}  # slice -> [G, stored tokens] float32

    def reset(self) -> None:
        self.scores.clear()

    def rows(self, t: int) -> range:
        return range(t)

    def observe(self, step: SliceStep, mass: torch.Tensor) -> None:
        sid = self.slice_id(step)
        old = self.scores.get(sid)
        if old is not None:
            mass[:, : old.shape[1]] += old
        self.scores[sid] = mass

    def keep(self, slice_id: int, length: int, new_tokens: int) -> torch.Tensor | None:
        if length <= self.budget:
            return None
        scores = self.scores[slice_id]  # [G, length]
        older = length - self.recent
        heavy = scores[:, :older].topk(self.budget - self.recent, dim=1).indices.sort(dim=1).values
        idx = torch.cat((heavy, _recent(length, self.recent, heavy).expand(heavy.shape[0], -1)), dim=1)
        self.scores[slice_id] = torch.gather(scores, 1, idx)
        return idx


class SnapKVEvictor(_Budgeted):
    """SnapKV: the last `window` queries of a prefill step vote (summed attention, average-pooled
    over `kernel` neighbours); per KV head the top `budget - window` older tokens are kept with the
    window itself. Decode steps append without eviction.

    NOTE: with chunked prefill every chunk of >= `window` tokens is compressed by its own window;
    with the prompt in one chunk this is the paper's algorithm.
    """

    name = "snapkv"

    def __init__(self, budget: int, window: int = 32, kernel: int = 5) -> None:
        super().__init__(budget, window + 1)
        self.window, self.kernel = window, kernel
        self.votes: dict[int, torch.Tensor] = {}  # slice -> [G, stored tokens] of the last step

    def reset(self) -> None:
        self.votes.clear()

    def rows(self, t: int) -> range:
        return range(t - self.window, t) if t >= self.window else range(0)

    def observe(self, step: SliceStep, mass: torch.Tensor) -> None:
        self.votes[self.slice_id(step)] = mass

    def keep(self, slice_id: int, length: int, new_tokens: int) -> torch.Tensor | None:
        votes = self.votes.pop(slice_id, None)
        if votes is None or length <= self.budget:
            return None
        older = length - self.window
        pooled = F.avg_pool1d(votes[None, :, :older], self.kernel, stride=1, padding=self.kernel // 2)[0]
        top = pooled[:, :older].topk(self.budget - self.window, dim=1).indices.sort(dim=1).values
        return torch.cat((top, _recent(length, self.window, top).expand(top.shape[0], -1)), dim=1)
