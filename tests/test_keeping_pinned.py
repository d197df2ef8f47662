"""A store closed within `keeping_pinned` leaves its pinned host memory cached, and `kvtier
generate` prints its answer before it lets that memory go (unpinning a 512K store's ~68 GB
takes seconds: `kvtier.kv.tiers.release_pinned_cache`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import kvtier.cli.generate_cmd as generate_cmd
import kvtier.kv.store as store_module
from kvtier import LLM, SamplingParams
from kvtier.cli.main import main
from kvtier.kv.store import TieredKVStore
from kvtier.kv.tiers import keeping_pinned, keeps_pinned


def test_a_store_closed_within_keeping_pinned_leaves_its_memory_cached(
    tiny: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    released: list[bool] = []
    monkeypatch.setattr(store_module, "release_pinned_cache", lambda: released.append(True))
    llm = LLM(str(tiny), device="cpu", kv="head", head_group=1, chunk_size=8)
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    llm.generate([list(range(3, 20))], params)
    assert released == [True]  # a store released on close, as before
    with keeping_pinned():
        assert keeps_pinned()
        llm.generate([list(range(3, 20))], params)
    assert released == [True] and not keeps_pinned()


def test_generate_prints_its_answer_before_it_lets_the_pinned_memory_go(
    embedded: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    events: list[tuple[str, object]] = []
    real_close = TieredKVStore.close

    def close(self: TieredKVStore, release_host: bool = True) -> None:
        events.append(("close", keeps_pinned()))
        real_close(self, release_host)

    monkeypatch.setattr(TieredKVStore, "close", close)
    monkeypatch.setattr(
        generate_cmd, "release_pinned_cache", lambda: events.append(("release", capsys.readouterr().out))
    )
    argv = [
        "generate",
        "--prompt",
        "hi",
        "--max-new-tokens",
        "2",
        "--device",
        "cpu",
        "--kv",
        "head",
        "--json",
    ]
    assert main(argv) == 0
    assert [name for name, _ in events] == ["close", "release"]
    assert events[0][1] is True  # the store kept its memory cached
    printed = events[1][1]
    assert isinstance(printed, str) and json.loads(printed)["token_ids"]  # the answer was out first
