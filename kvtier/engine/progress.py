"""Progress of a request's long work before its prefill: the host memory its store pins.

Llama-3-8B's 512K-token store pins 64 GiB of host memory before the prefill, 31-35 s on an H100
host (bench/results/hip_cli_speed_512k_fast_landmarks_layer_combined.json's `setup_s`), which
the command line used to spend silently.
"""

from __future__ import annotations

import sys

from tqdm import tqdm

SHOWN_FROM = 1 << 30  # bytes: a store that pins less is done in well under a second


class PinBar:
    """`report(nbytes)` for `kvtier.kv.tiers.reporting_pins`: a bar of the bytes pinned so far
    on stderr, shown once they pass `SHOWN_FROM` (none when `enabled` is False); `close()` ends
    it."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.pinned = 0
        self._bar: tqdm | None = None

    def __call__(self, nbytes: int) -> None:
        self.pinned += nbytes
        if self._bar is not None:
            self._bar.update(nbytes)
        elif self.enabled and self.pinned >= SHOWN_FROM:
            self._bar = tqdm(
                initial=self.pinned,
                unit="B",
                unit_scale=True,
                unit_divisor=1024,
                desc="pinning host KV",
                file=sys.stderr,
                dynamic_ncols=True,
            )

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
