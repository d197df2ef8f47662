"""Bytes of packed (quantized) slices, as the store allocates them (`kvtier.kv.packed`).

A packed slice keeps its coded tokens as rows of `group` tokens (codes + scales) in extents of
about 16 MiB, and its uncoded tokens in a full-precision ring of two extents, each one chunk
plus the codec's full-precision window long:

```
 rows:  ceil(ceil(capacity / group) / extent_rows) x extent_rows x row_bytes
 tail:  2 x round_up(uncoded + chunk, block) tokens x token bytes
```

Streamed slices keep both in host memory; resident ones in GPU memory, where loads unpack
through a scratch of rows for one staging buffer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from kvtier.errors import ConfigError
from kvtier.planner.memory import round_up

ROWS_EXTENT_BYTES = 16 << 20  # one copy per 16 MiB of packed rows


@runtime_checkable
class PackedFormat(Protocol):
    """The sizes of a packing codec: the part of `kvtier.kv.hooks.KVCodec` the planner needs.

    Tokens are coded `group` at a time into one row of `row_bytes` bytes per slice, once they
    are older than the newest `residual` (plus the partial group).
    """

    @property
    def group(self) -> int:
        """Tokens per packed row (>= 1)."""
        ...

    @property
    def residual(self) -> int:
        """Newest tokens kept full precision (>= 0) besides the group being filled."""
        ...

    def frozen_tokens(self, length: int) -> int:
        """How many leading tokens are stored coded once `length` tokens are stored (the rest
        stay full precision): a multiple of `group`, non-decreasing in `length`."""
        ...

    def row_bytes(self, heads: int, head_dim: int) -> int:
        """Bytes of one packed row: `group` tokens of `heads` KV heads of `head_dim`."""
        ...


def uncoded_tokens(fmt: PackedFormat) -> int:
    """The most tokens a slice holds uncoded after a step (the codec's full-precision window)."""
    return fmt.residual + fmt.group - 1


@dataclass(frozen=True)
class PackedSizing:
    """A packing codec's storage for slices of one group size."""

    row_bytes: int  # one row: `group` tokens of one slice
    group: int
    uncoded: int  # the most tokens a slice holds uncoded after a step

    @classmethod
    def of(cls, codec: PackedFormat, group_size: int, head_dim: int) -> PackedSizing:
        if not isinstance(codec, PackedFormat):
            raise ConfigError(
                f"{type(codec).__name__} cannot size packed slices: a packing codec needs group, "
                "residual, frozen_tokens and row_bytes (kvtier.planner.packed.PackedFormat)"
            )
        return cls(codec.row_bytes(group_size, head_dim), codec.group, uncoded_tokens(codec))

    def extent_rows(self, capacity: int) -> int:
        rows = -(-capacity // self.group)
        return max(1, min(rows, ROWS_EXTENT_BYTES // self.row_bytes))

    def rows_bytes(self, capacity: int) -> int:
        """Rows reserved for `capacity` tokens, in whole extents."""
        rows, per = -(-capacity // self.group), self.extent_rows(capacity)
        return -(-rows // per) * per * self.row_bytes

    def tail_tokens(self, chunk: int, block_size: int) -> int:
        """Full-precision tokens of a slice's tail ring (two extents)."""
        return 2 * round_up(self.uncoded + chunk, block_size)

    def scratch_bytes(self, staging_tokens: int) -> int:
        """GPU rows one staging load unpacks from."""
        return (staging_tokens // self.group + 2) * self.row_bytes
