"""KVTIER_HOST_PIN=huge: a store's host slabs as registered memory in transparent huge pages,
kept between stores in `kvtier.kv.tiers.HUGE_SLABS` (`kvtier.kv.host_register`). The
registration itself needs CUDA (bench/host_memory.py measures it); here the setting, the
mapping and the pool around it."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import torch

import kvtier.kv.tiers as tiers
from kvtier.errors import ConfigError
from kvtier.kv.host_register import HUGE_PAGE, RegisteredPool, _huge_mapped
from kvtier.kv.tiers import HostArena, TierAccount, host_pin


def test_the_host_pin_setting_is_read_and_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVTIER_HOST_PIN", raising=False)
    assert host_pin() == "alloc"
    monkeypatch.setenv("KVTIER_HOST_PIN", " Huge ")
    assert host_pin() == "huge"
    monkeypatch.setenv("KVTIER_HOST_PIN", "register")
    with pytest.raises(ConfigError, match=r"KVTIER_HOST_PIN='register': use alloc \(the default\) or huge"):
        host_pin()


def test_a_huge_mapping_starts_on_a_huge_page_and_holds_what_is_written() -> None:
    t = _huge_mapped(3 * HUGE_PAGE + 4096)
    assert t.numel() == 3 * HUGE_PAGE + 4096 and t.data_ptr() % HUGE_PAGE == 0
    t.view(torch.bfloat16).fill_(1.5)
    assert float(t.view(torch.bfloat16)[-1]) == 1.5 and float(t.view(torch.bfloat16)[0]) == 1.5


def _zeros_recorded(made: list[torch.Tensor]) -> Callable[[tuple[int, ...], torch.dtype], torch.Tensor]:
    """A pool's `make` over plain zeros (no CUDA here), each one appended to `made`."""

    def make(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        made.append(torch.zeros(shape, dtype=dtype))
        return made[-1]

    return make


def _fake_pool(monkeypatch: pytest.MonkeyPatch) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """HUGE_SLABS over plain zeros: the tensors it made and released."""
    made: list[torch.Tensor] = []
    released: list[torch.Tensor] = []
    monkeypatch.setattr(tiers, "HUGE_SLABS", RegisteredPool(_zeros_recorded(made), released.append))
    monkeypatch.setattr(tiers.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(tiers.torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(tiers.torch._C, "_host_emptyCache", lambda: None, raising=False)  # a CUDA build's
    return made, released


def test_a_huge_arena_takes_its_slabs_from_the_pool_and_the_next_store_reuses_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    made, released = _fake_pool(monkeypatch)
    monkeypatch.setenv("KVTIER_HOST_PIN", "huge")
    account = TierAccount()
    arena = HostArena((4, 8), torch.bfloat16, pin=True, account=account, slab_bytes=4 * 4 * 8 * 2)
    assert arena.huge
    arena.grow(10, threads=3)  # 3 slabs of 4 extents, from 3 threads
    assert len(made) == 3 and account.allocated[tiers.HOST] == 3 * 256
    first = arena.take()
    assert first.shape == (4, 8) and first.data_ptr() == made[0].data_ptr()  # the first slab's first row
    arena.close()
    assert account.allocated[tiers.HOST] == 0 and tiers.HUGE_SLABS.kept_bytes() == 3 * 256 and not released
    again = HostArena((4, 8), torch.bfloat16, pin=True, account=TierAccount(), slab_bytes=256)
    again.grow(8)
    assert len(made) == 3  # two kept slabs taken again, none made
    again.close()
    tiers.release_pinned_cache()
    assert sorted(map(id, released)) == sorted(map(id, made)) and tiers.HUGE_SLABS.kept_bytes() == 0


def test_without_the_setting_or_pinning_an_arena_never_touches_the_pool(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    made, _ = _fake_pool(monkeypatch)
    monkeypatch.delenv("KVTIER_HOST_PIN", raising=False)
    assert not HostArena((4, 8), torch.float32, pin=True, account=TierAccount()).huge
    monkeypatch.setenv("KVTIER_HOST_PIN", "huge")
    arena = HostArena((4, 8), torch.float32, pin=False, account=TierAccount(), slab_bytes=128)
    arena.grow(2)
    assert not arena.huge and not made


def test_the_pool_hands_each_kept_tensor_to_one_taker_across_threads() -> None:
    made: list[torch.Tensor] = []
    pool = RegisteredPool(_zeros_recorded(made))
    kept = [torch.zeros(4) for _ in range(64)]
    pool.give(kept)
    taken: list[torch.Tensor] = []
    lock = threading.Lock()

    def taker() -> None:
        for _ in range(16):
            t = pool.take((4,), torch.float32)
            with lock:
                taken.append(t)

    threads = [threading.Thread(target=taker) for _ in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert len({id(t) for t in taken}) == 64 and not made and pool.kept_bytes() == 0


def test_a_refused_registration_says_which_setting_asked_and_how_to_do_without(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kvtier.kv import host_register

    class Refusing:
        def cudaHostRegister(self, ptr: int, nbytes: int, flags: int) -> int:  # cudart's name
            return 2  # cudaErrorMemoryAllocation

    monkeypatch.setattr(host_register.torch.cuda, "cudart", lambda: Refusing())
    with pytest.raises(RuntimeError, match=r"cudaError 2 \(KVTIER_HOST_PIN=huge .* unset them"):
        host_register.registered_empty((4, 8), torch.bfloat16, huge=True)
