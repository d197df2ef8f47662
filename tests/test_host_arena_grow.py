"""`HostArena.grow`: a store's host slabs made up front, from several threads at once where
`KVTIER_PIN_THREADS` asks (pinning a long prompt's host tier is most of its setup). Its takes must
hand out the extents a take-by-take arena would, in the same order, and make no slab more."""

from __future__ import annotations

import pytest
import torch

from kvtier.engine.progress import SHOWN_FROM, PinBar
from kvtier.errors import ConfigError
from kvtier.kv.host_slice import HostSlice
from kvtier.kv.packed import TailHostSlice
from kvtier.kv.tiers import HostArena, TierAccount, pin_threads, reporting_pins

E, ROW = 4, 8  # tokens an extent, bytes a token; a slab holds 3 extents


def arena() -> HostArena:
    return HostArena((E, ROW), torch.uint8, pin=False, account=TierAccount(), slab_bytes=3 * E * ROW)


def layout(a: HostArena, takes: list[torch.Tensor]) -> list[tuple[int, int]]:
    """Each taken extent as (its slab, its row there)."""
    where = {t.data_ptr(): (i, r) for i, slab in enumerate(a.slabs()) for r, t in enumerate(slab)}
    return [where[t.data_ptr()] for t in takes]


@pytest.mark.parametrize("threads", [1, 4])
def test_grown_extents_are_taken_in_the_order_takes_alone_give(threads: int) -> None:
    alone, grown = arena(), arena()
    first = [alone.take() for _ in range(2)] + [grown.take() for _ in range(2)]
    assert len(first) == 4
    grown.grow(7, threads)  # 1 extent free, so 6 more: two slabs
    assert len(grown.slabs()) == 3
    assert grown.account.allocated["host"] == 3 * 3 * E * ROW
    grown.grow(7, threads)  # as many free as asked: nothing to make
    assert len(grown.slabs()) == 3
    ours = [grown.take() for _ in range(7)]
    theirs = [alone.take() for _ in range(7)]
    assert len(grown.slabs()) == len(alone.slabs()) == 3  # the takes made none: grow made them
    assert layout(grown, ours) == layout(alone, theirs) == [(i // 3, i % 3) for i in range(2, 9)]


def test_slices_say_how_many_extents_their_reserve_takes() -> None:
    a = arena()
    plain, tail = HostSlice(a, E), TailHostSlice(a, E, ring=2)
    assert (plain.extents_for(0), plain.extents_for(1), plain.extents_for(9)) == (0, 1, 3)
    plain.reserve(5)
    assert plain.extents_for(9) == 1 and len(plain.extents) == 2
    assert tail.extents_for(10**6) == 2  # a ring: two extents whatever the length
    tail.reserve(10**6)
    assert tail.extents_for(10**6) == 0


def test_the_pin_threads_setting_is_read_and_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVTIER_PIN_THREADS", raising=False)
    assert pin_threads() == 1
    monkeypatch.setenv("KVTIER_PIN_THREADS", " 8 ")
    assert pin_threads() == 8
    for bad in ("0", "eight", "-2"):
        monkeypatch.setenv("KVTIER_PIN_THREADS", bad)
        with pytest.raises(ConfigError, match=r"KVTIER_PIN_THREADS=.*give a number of threads"):
            pin_threads()


def test_pinned_slabs_are_reported_to_the_active_reporter(monkeypatch: pytest.MonkeyPatch) -> None:
    """Within `reporting_pins`, each pinned slab an arena makes is reported once with its bytes,
    whether `take` or `grow` (from threads) makes it; unpinned slabs and slabs made outside are
    not."""
    # NOTE: a CPU build cannot pin: an arena that pins gets plain slabs here
    monkeypatch.setattr(HostArena, "_new_slab", lambda self: torch.empty(3 * E * ROW, dtype=torch.uint8))
    pinned = HostArena((E, ROW), torch.uint8, pin=True, account=TierAccount(), slab_bytes=3 * E * ROW)
    plain = arena()
    seen: list[int] = []
    pinned.take()  # outside: not reported
    with reporting_pins(seen.append):
        pinned.take()  # from the free extents: no slab
        pinned.grow(9, threads=4)  # 1 free after two takes: 8 more, three slabs
        plain.grow(5)
        pinned.take()
    pinned.grow(12)  # 9 free: one slab more, made outside
    assert seen == [3 * E * ROW] * 3
    assert len(pinned.slabs()) == 5


def test_the_pin_bar_shows_from_a_gib_and_counts_every_byte(capsys: pytest.CaptureFixture[str]) -> None:
    bar = PinBar(enabled=True)
    bar(SHOWN_FROM // 2)
    assert capsys.readouterr().err == ""  # under a GiB: no bar
    bar(SHOWN_FROM)
    bar(SHOWN_FROM // 2)
    bar.close()
    err = capsys.readouterr().err
    assert "pinning host KV" in err and "2.00GB" in err and bar.pinned == 2 * SHOWN_FROM
    quiet = PinBar(enabled=False)
    quiet(4 * SHOWN_FROM)
    quiet.close()
    assert capsys.readouterr().err == "" and quiet.pinned == 4 * SHOWN_FROM
