"""`kvtier serve` freezes its start-up heap, so a full garbage collection walks only what
requests created since (a collection stops the engine loop's thread too)."""

from __future__ import annotations

import gc
import weakref
from typing import Any

import pytest

from kvtier.serve import server


class Node:
    other: Any = None


def test_freeze_heap_freezes_what_is_alive_and_later_cycles_are_still_collected() -> None:
    try:
        before = gc.get_freeze_count()
        server.freeze_heap()
        assert gc.get_freeze_count() > before
        a, b = Node(), Node()
        a.other, b.other = b, a  # a cycle made after the freeze: still the collector's
        ref = weakref.ref(a)
        del a, b
        gc.collect()
        assert ref() is None
    finally:
        gc.unfreeze()


def test_serve_forever_freezes_before_it_listens(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[int] = []

    class Fake:
        started = True

        def run(self) -> None:
            seen.append(gc.get_freeze_count())

    monkeypatch.setattr(server, "_server", lambda *args: Fake())
    try:
        gc.unfreeze()
        server.serve_forever(None, "127.0.0.1", 0)  # type: ignore[arg-type]
        assert seen and seen[0] > 0
    finally:
        gc.unfreeze()
