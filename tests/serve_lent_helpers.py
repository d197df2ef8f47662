"""What the lent-pages tests share: a served request's deltas queued and its tokens read back,
a seeded request with what `LLM.generate` gives it under "head", and a request served alone as a
tiered run, with a probe of its store."""

from __future__ import annotations

from collections.abc import Callable
from queue import Queue
from typing import Any

import torch

from kvtier.engine.batch.sequence import Delta
from kvtier.engine.llm import LLM
from kvtier.engine.sampling import SamplingParams
from kvtier.methods import parse_choice
from kvtier.serve.engine import ServeEngine


def collect(engine: ServeEngine, ids: list[int], params: SamplingParams, **kw: object) -> Queue[Delta]:
    q: Queue[Delta] = Queue()
    engine.submit(ids, params, q.put, **kw)  # type: ignore[arg-type]
    return q


def tokens(q: Queue[Delta]) -> list[int]:
    out: list[int] = []
    while not q.empty():
        out += q.get().token_ids
    return out


def head_request(llm: LLM, seed: int, max_tokens: int) -> tuple[list[int], SamplingParams, list[int]]:
    """40 seeded token ids, their sampling parameters, and what `LLM.generate` gives them under
    the lossless "head" method (what a served request must equal)."""
    ids = torch.randint(1, 211, (40,), generator=torch.Generator().manual_seed(seed)).tolist()
    params = SamplingParams(max_tokens=max_tokens)
    return ids, params, list(llm.generate(ids, params, method="head")[0].token_ids)


Probe = Callable[[Any], dict[str, Any]]  # a tiered run -> what a test looks at


def served_alone(
    engine: ServeEngine, ids: list[int], params: SamplingParams, method: str, probe: Probe
) -> tuple[list[int], dict[str, Any]]:
    """A request naming `method` served alone as a tiered run: its tokens, and what `probe(run)`
    returned at its last token (`run.store` is built by then)."""
    seen: dict[str, Any] = {}
    q: Queue[Delta] = Queue()

    def sink(d: Delta) -> None:
        (run,) = engine._tiered.values()
        assert run.store is not None
        seen.update(probe(run))
        q.put(d)

    engine.submit(ids, params, sink, method=parse_choice(method))
    engine.run_until_idle()
    return tokens(q), seen
