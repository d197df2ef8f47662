"""Request latencies as Prometheus histograms: time to first token, time per output token and
end-to-end latency, with vLLM's metric names and bucket bounds (so its dashboards read ours)."""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field

# Upper bounds in seconds (vLLM's), each histogram also has +Inf.
TTFT_BOUNDS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
TPOT_BOUNDS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)  # fmt: skip
E2E_BOUNDS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
              120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip


@dataclass
class Histogram:
    """Observations counted per bucket (`bounds`, ascending, plus +Inf), with their sum."""

    bounds: tuple[float, ...]
    counts: list[int] = field(init=False)  # per bucket, not cumulative; the last is +Inf
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, x: float) -> None:
        self.counts[bisect_left(self.bounds, x)] += 1  # NOTE: a bound is inclusive (le)
        self.total += x
        self.count += 1

    def cumulative(self) -> list[tuple[str, int]]:
        """(le, observations <= le) for every bound and "+Inf", as Prometheus writes them."""
        out, run = [], 0
        for le, n in zip([*map(repr, self.bounds), "+Inf"], self.counts, strict=True):
            run += n
            out.append((le, run))
        return out


@dataclass
class RequestLatency:
    """The engine's latency histograms (observed on its thread; /metrics reads them)."""

    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BOUNDS))
    tpot: Histogram = field(default_factory=lambda: Histogram(TPOT_BOUNDS))
    e2e: Histogram = field(default_factory=lambda: Histogram(E2E_BOUNDS))
