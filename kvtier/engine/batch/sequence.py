"""One request's state inside the engine: its tokens, pages and progress."""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvtier.engine.batch.detokenize import IncrementalText
from kvtier.engine.sampling import Sampler, SamplingParams
from kvtier.kv.store import TieredKVStore
from kvtier.methods import MethodChoice


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True)
class Delta:
    """What the engine tells a request's listener after a step (or when it finishes)."""

    token_ids: tuple[int, ...]  # tokens new since the last delta
    text: str  # text new since the last delta
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" once finished
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None


Sink = Callable[[Delta], Any]


@dataclass
class OwnStore:
    """A sequence's own `TieredKVStore` (a method of its own, every slice in device memory),
    attended inside the batch's forward instead of over the page pool.

    `spans`: its prefill steps, [start, end) over the prompt, fixed when it is made (the store's
    kernel may want the last query alone, as HiP does), so its chunks are those of
    `LLM.generate` with the same chunk size. `describe`: the method, for logs and stats.
    """

    store: TieredKVStore
    spans: list[tuple[int, int]]
    describe: str = ""

    def next_span(self, computed: int) -> int:
        """Tokens of the prefill span that starts at `computed` (1 once the prompt is done)."""
        for s, e in self.spans:
            if s == computed:
                return e - s
        return 1


@dataclass(eq=False)
class Sequence:
    """A request being served. `tokens` = prompt + output so far; mutated only by the engine thread.

    `num_computed` tokens have their KV in the pages of `block_table`; the step computes
    tokens[num_computed : num_computed + n]. After a preemption both reset to 0 and the
    sequence is prefilled again (recompute), prefix-cache hits included.
    """

    request_id: str
    prompt: list[int]
    params: SamplingParams
    root: bytes  # prefix-cache parent hash of the first page (salted)
    sink: Sink
    sampler: Sampler
    tokens: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    hashes: list[bytes] = field(default_factory=list)
    num_computed: int = 0
    num_registered: int = 0  # leading pages registered in the prefix cache
    cached_tokens: int = 0  # prompt tokens the first admission found in the prefix cache
    admitted: bool = False
    status: Status = Status.WAITING
    finish_reason: str | None = None
    emitted_tokens: int = 0
    emitted_text: int = 0  # characters of the output text already sent
    arrival: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    last_token_at: float | None = None
    method: MethodChoice | None = None  # a method of its own: served over a tiered store
    own: OwnStore | None = None  # that store, when the batch's forward attends it (no pages)
    text: IncrementalText | None = None  # its output text, decoded as tokens come (with a tokenizer)

    def __post_init__(self) -> None:
        if not self.tokens:
            self.tokens = list(self.prompt)

    @property
    def output(self) -> list[int]:
        return self.tokens[len(self.prompt) :]

    @property
    def num_pending(self) -> int:
        """Tokens whose KV is not computed yet (1 while decoding)."""
        return len(self.tokens) - self.num_computed
