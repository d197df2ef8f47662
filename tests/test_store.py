"""Every placement policy over the tiered store is lossless, and its memory is what it promises."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvtier.attention.dense import attend
from kvtier.attention.interface import Fetch, SliceStep
from kvtier.config import ModelConfig
from kvtier.kv.store import StoreOptions, TieredKVStore
from kvtier.loading.weights import load_safetensors_folder
from kvtier.model.llama import CausalLM
from kvtier.planner.placement import KVPlan
from tests.hf_reference import drive, make_hf_model

CPU = torch.device("cpu")
PROMPT, DECODE = 45, 9


@pytest.fixture(scope="module")
def mha(tmp_path_factory: pytest.TempPathFactory) -> tuple[CausalLM, ModelConfig]:
    folder: Path = tmp_path_factory.mktemp("mha")
    make_hf_model("llama-mha", folder)  # 3 layers, 4 KV heads: groups of 1, 2 or 4
    return load_safetensors_folder(folder, CPU, torch.float32)


def run(
    model: CausalLM, cfg: ModelConfig, plan: KVPlan, block: int = 5
) -> tuple[list[torch.Tensor], list[int], TieredKVStore]:
    """Chunked prefill + greedy decode; returns every step's logits and the tokens."""
    ids = torch.randint(0, cfg.vocab_size, (PROMPT,), generator=torch.Generator().manual_seed(7))
    store = TieredKVStore(
        cfg,
        plan,
        device=CPU,
        dtype=torch.float32,
        capacity=PROMPT + DECODE,
        options=StoreOptions(block_size=block, extent_blocks=2),
    )
    logits, tokens = drive(model, store, ids, plan.chunk_size, DECODE)
    return logits, tokens, store


def plan(policy: str, group: int, resident: int, staging: int, buffers: int = 2, chunk: int = 11) -> KVPlan:
    return KVPlan(
        policy=policy,
        group_size=group,
        resident_slices=resident,
        chunk_size=chunk,
        staging_buffers=buffers if staging else 0,
        staging_tokens=staging,
    )


FULL = 60  # staging tokens that hold the whole context (no sequence blocks)


@pytest.mark.parametrize(
    "p",
    [
        plan("layer", 4, 0, FULL),
        plan("head", 1, 0, FULL),
        plan("head", 2, 0, FULL),
        plan("head", 1, 0, FULL, buffers=1),
        plan("head", 1, 0, FULL, buffers=3),
        plan("auto", 1, 5, FULL),
        plan("auto", 2, 3, FULL, chunk=16),
    ],
    ids=lambda p: f"{p.policy}-g{p.group_size}-r{p.resident_slices}-b{p.staging_buffers}-c{p.chunk_size}",
)
def test_offload_policies_are_bitwise_lossless(mha: tuple[CausalLM, ModelConfig], p: KVPlan) -> None:
    model, cfg = mha
    ref_logits, ref_tokens, _ = run(model, cfg, plan("gpu", 4, 3, 0, chunk=p.chunk_size))
    logits, tokens, store = run(model, cfg, p)
    assert tokens == ref_tokens
    for a, b in zip(logits, ref_logits, strict=True):
        assert torch.equal(a, b)
    streamed = cfg.num_layers * (cfg.num_kv_heads // p.group_size) - p.resident_slices
    token_bytes = 2 * p.group_size * cfg.head_dim * 4
    # Every streamed slice crosses to the host exactly once per token, nothing more.
    assert store.account.d2h_bytes == streamed * (PROMPT + DECODE) * token_bytes


@pytest.mark.parametrize("staging,group", [(10, 1), (15, 2), (5, 4)])
def test_sequence_blocks_match_within_rounding(
    mha: tuple[CausalLM, ModelConfig], staging: int, group: int
) -> None:
    model, cfg = mha
    ref_logits, ref_tokens, _ = run(model, cfg, plan("gpu", 4, 3, 0))
    logits, tokens, store = run(model, cfg, plan("head", group, 0, staging))
    assert tokens == ref_tokens
    for a, b in zip(logits, ref_logits, strict=True):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-5)
    # GPU KV is two staging buffers, whatever the context.
    assert store.account.peak["gpu"] == 2 * staging * 2 * group * cfg.head_dim * 4


def test_gpu_tier_holds_two_head_slices_for_head_policy(mha: tuple[CausalLM, ModelConfig]) -> None:
    model, cfg = mha
    _, _, store = run(model, cfg, plan("head", 1, 0, FULL))
    one_slice = FULL * 2 * 1 * cfg.head_dim * 4  # 60 tokens of K and V of one head, fp32
    assert store.account.peak["gpu"] == 2 * one_slice
    whole_cache = (PROMPT + DECODE) * cfg.kv_bytes_per_token(4)
    assert store.account.peak["gpu"] < whole_cache / 5
    # Host holds every slice, in whole extents of 2 blocks of 5 tokens.
    extent = 10 * 2 * cfg.head_dim * 4
    assert store.account.peak["host"] >= cfg.num_layers * cfg.num_kv_heads * 6 * extent
    store.close()
    assert store.account.allocated == {"gpu": 0, "host": 0}


def test_close_keeps_pinned_memory_cached_only_when_asked(
    mha: tuple[CausalLM, ModelConfig], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`close()` returns the pinned allocator's cache to the OS (a one-shot run); a server's
    `close(release_host=False)` keeps it for the next store (unpinning ~34 GB took 5.9 s)."""
    model, cfg = mha
    released: list[int] = []
    monkeypatch.setattr("kvtier.kv.store.release_pinned_cache", lambda: released.append(1))
    for release, calls in ((False, 0), (True, 1)):
        released.clear()
        _, _, store = run(model, cfg, plan("head", 1, 0, FULL))
        store.close(release_host=release)
        assert len(released) == calls and store.account.allocated == {"gpu": 0, "host": 0}


def test_gpu_policy_keeps_everything_resident(mha: tuple[CausalLM, ModelConfig]) -> None:
    model, cfg = mha
    _, _, store = run(model, cfg, plan("gpu", 4, 3, 0))
    assert store.account.peak["host"] == 0
    assert store.account.h2d_bytes == store.account.d2h_bytes == 0
    assert store.account.peak["gpu"] == 55 * cfg.kv_bytes_per_token(4)  # capacity 54 -> 11 blocks of 5


class MirrorKernel:
    """A `CachingSliceKernel` for the test: dense attention over its own copy of each slice.

    The whole slice is streamed on the first step and every `refresh` steps after it; in between
    the kernel keeps its copy up to date with each step's new tokens, except that it drops the
    copy's oldest `forget` tokens and `fetch`es them back, so both paths of the hook run.
    """

    def __init__(self, refresh: int, forget: int) -> None:
        self.refresh, self.forget = refresh, forget
        self.copies: dict[tuple[int, int], torch.Tensor] = {}
        self.steps: dict[tuple[int, int], int] = {}
        self.fetched = 0  # tokens read through fetch
        self.streamed = 0  # stored tokens of the slices streamed whole
        self.cached_calls = 0

    decode_streams = True  # it streams every `refresh` steps

    def needs_slice(self, step: SliceStep, n_new: int) -> bool:
        key = (step.layer, step.group)
        return n_new > 1 or key not in self.copies or self.steps[key] + 1 >= self.refresh

    def __call__(self, q: torch.Tensor, kv: torch.Tensor, step: SliceStep) -> torch.Tensor:
        key = (step.layer, step.group)
        self.copies[key], self.steps[key] = kv.clone(), 0
        self.streamed += step.start
        return attend(q, kv)

    def attend_cached(
        self, q: torch.Tensor, kv_new: torch.Tensor, step: SliceStep, fetch: Fetch
    ) -> torch.Tensor:
        key = (step.layer, step.group)
        old = self.copies[key]
        assert old.shape[0] == step.start
        head = fetch(0, self.forget)
        self.fetched += head.shape[0]
        self.cached_calls += 1
        kv = torch.cat((head, old[self.forget :], kv_new))
        self.copies[key], self.steps[key] = kv, self.steps[key] + 1
        return attend(q, kv)


@pytest.mark.parametrize("group,refresh", [(1, 3), (2, 4), (4, 100)])
def test_caching_kernel_streams_only_what_it_fetches(
    mha: tuple[CausalLM, ModelConfig], group: int, refresh: int
) -> None:
    model, cfg = mha
    ref_logits, ref_tokens, _ = run(model, cfg, plan("gpu", 4, 3, 0))
    ids = torch.randint(0, cfg.vocab_size, (PROMPT,), generator=torch.Generator().manual_seed(7))
    p = plan("head", group, 0, FULL)
    kernel = MirrorKernel(refresh, forget=7)
    store = TieredKVStore(
        cfg,
        p,
        device=CPU,
        dtype=torch.float32,
        capacity=PROMPT + DECODE,
        kernel=kernel,
        options=StoreOptions(block_size=5, extent_blocks=2),
    )
    logits, tokens = drive(model, store, ids, p.chunk_size, DECODE)
    assert tokens == ref_tokens
    for a, b in zip(logits, ref_logits, strict=True):
        assert torch.equal(a, b)
    slices = cfg.num_layers * cfg.num_kv_heads // group
    token_bytes = 2 * group * cfg.head_dim * 4
    # One-token steps between refreshes are served from the kernel's copies: per slice, all of
    # them when nothing is due (refresh 100), two of every `refresh` otherwise.
    one_token_steps = DECODE + (PROMPT % p.chunk_size == 1)
    cached = one_token_steps if refresh > one_token_steps else None
    assert kernel.cached_calls > 0
    if cached is not None:
        assert kernel.cached_calls == slices * cached
    assert kernel.fetched == 7 * kernel.cached_calls
    # Nothing crosses to the GPU but the whole slices of refresh steps and the fetched tokens.
    assert store.account.h2d_bytes == (kernel.streamed + kernel.fetched) * token_bytes
    # New tokens still reach the host once each, cached step or not.
    assert store.account.d2h_bytes == slices * (PROMPT + DECODE) * token_bytes


def test_slice_reader_reads_ranges_and_gathers_positions_across_extents(
    mha: tuple[CausalLM, ModelConfig],
) -> None:
    """`SliceReader` (what caching kernels read offloaded slices through) returns exactly the
    stored rows, counts the bytes it sends, and refuses positions that are not stored."""
    from kvtier.kv.reader import SliceReader

    model, cfg = mha
    _, _, store = run(model, cfg, plan("head", 1, 0, FULL))  # extents of 2 blocks of 5 tokens
    sid, n = 4, store.length
    host = store.hosts[sid]
    whole = torch.empty(n, 2, 1, cfg.head_dim)
    host.read_into(whole, 0, n)

    def reader() -> SliceReader:
        return SliceReader(
            sid, host, store.layout, n, device=CPU, streams=store.streams, account=store.account, packed=None
        )

    before = store.account.h2d_bytes
    assert torch.equal(reader()(7, 31), whole[7:31])
    # pages of 4 (Quest's): a page across an extent boundary (tokens 8-11), a partial one, an
    # unused slot; rows past a page's count are zeros, the bytes are the rows read
    got = reader().pages(torch.tensor([2, 0, 7, 5]), torch.tensor([4, 4, 2, 0]), 4)
    want = torch.zeros(16, 2, 1, cfg.head_dim)
    want[0:4], want[4:8], want[8:10] = whole[8:12], whole[0:4], whole[28:30]
    assert torch.equal(got, want)
    assert store.account.h2d_bytes - before == (24 + 10) * 2 * cfg.head_dim * 4
    with pytest.raises(IndexError, match="outside"):
        reader()(0, n + 1)
    # several runs in one call, each across extent boundaries, placed at their own offsets
    out = torch.full((40, 2, 1, cfg.head_dim), 7.0)
    before = store.account.h2d_bytes
    reader().runs([(3, 12, 0), (18, 31, 20), (n - 2, n, 38)], out)
    assert torch.equal(out[:9], whole[3:12]) and torch.equal(out[20:33], whole[18:31])
    assert torch.equal(out[38:], whole[n - 2 :]) and bool((out[9:20] == 7).all())
    assert store.account.h2d_bytes - before == (9 + 13 + 2) * 2 * cfg.head_dim * 4
    with pytest.raises(IndexError, match="outside"):
        reader().runs([(0, 5, 36)], out)


def test_runs_from_a_quantized_host_tier_equal_one_read_a_run(gqa: tuple[CausalLM, ModelConfig]) -> None:
    """`SliceReader.runs` over packed rows (what HiP's block cache fetches its misses with under
    `--kv-quant`) returns what one read a run returns, and counts the same bytes: runs that start
    and end inside a codec group, cross into the uncoded tail, or lie in it."""
    from kvtier.kv.reader import SliceReader
    from kvtier.kv.synthetic import fill_synthetic
    from kvtier.policies import PolicyParts
    from kvtier.policies.quant import KiviCodec
    from tests.policy_store import make_store

    _, cfg = gqa
    codec = KiviCodec(bits=4, group=8, residual=16)
    store = make_store(cfg, KVPlan("head", 1, 0, 16, 2, 128), PolicyParts(codec=codec), capacity=128)
    fill_synthetic(store, 100)
    assert store.packed is not None and store.packed.coded == 80
    sid = 2

    def reader() -> SliceReader:
        return SliceReader(
            sid,
            store.hosts[sid],
            store.layout,
            100,
            device=CPU,
            streams=store.streams,
            account=store.account,
            packed=store.packed,
        )

    spans = [(3, 13, 0), (16, 32, 10), (45, 47, 26), (76, 90, 28), (94, 100, 42)]
    before = store.account.h2d_bytes
    want = torch.cat([reader()(a, b) for a, b, _ in spans])
    one_a_run = store.account.h2d_bytes - before
    got = torch.full_like(want, float("nan"))
    before = store.account.h2d_bytes
    reader().runs(spans, got)
    assert torch.equal(got, want)
    assert store.account.h2d_bytes - before == one_a_run > 0
