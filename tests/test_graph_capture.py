"""`kvtier.kv.graph_capture.capture`: `torch.cuda.graph`'s steps in its order, less the release
of the pinned host cache (which put 0.6-0.9 s into the first decode step after a 512K prefill by
layer). CUDA itself is stood in for: the test checks what is called, in which order."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

from kvtier.kv.graph_capture import capture


class FakeGraph:
    def __init__(self, calls: list[Any]) -> None:
        self.calls = calls

    def capture_begin(self, pool: Any = None, capture_error_mode: str = "global") -> None:
        self.calls.append(("begin", pool, capture_error_mode))

    def capture_end(self) -> None:
        self.calls.append("end")


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    seen: list[Any] = []

    @contextmanager
    def on(stream: Any) -> Iterator[None]:
        seen.append(("on", stream))
        try:
            yield
        finally:
            seen.append("off")

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: seen.append("sync"))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: seen.append("device cache"))
    monkeypatch.setattr(torch._C, "_host_emptyCache", lambda: seen.append("HOST CACHE"), raising=False)
    monkeypatch.setattr(torch.cuda, "stream", on)
    return seen


def test_a_capture_runs_the_body_on_its_stream_and_keeps_the_pinned_cache(calls: list[Any]) -> None:
    graph: Any = FakeGraph(calls)
    out = capture(graph, lambda: calls.append("body") or 7, "S", "P", error_mode="thread_local")  # type: ignore[arg-type]
    assert out == 7
    begin = ("begin", "P", "thread_local")
    assert calls == ["sync", "device cache", ("on", "S"), begin, "body", "end", "off"]


def test_a_body_that_fails_still_ends_the_capture(calls: list[Any]) -> None:
    def body() -> None:
        raise ValueError("in the body")

    with pytest.raises(ValueError, match="in the body"):
        capture(FakeGraph(calls), body, "S")  # type: ignore[arg-type]
    assert calls[-3:] == [("begin", None, "global"), "end", "off"]
    assert "HOST CACHE" not in calls
