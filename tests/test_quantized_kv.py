"""Quantized KV over the store: codec error bounds and layout, the packed tiers (host and GPU)
against the in-place round trip, bytes moved and stored, the planner's packed sizes, and the
codec protocol a codec from outside kvtier plugs in through."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import pytest
import torch

from kvtier.config import ModelConfig
from kvtier.errors import ConfigError
from kvtier.kv.hooks import KVCodec
from kvtier.kv.store import StoreOptions, TieredKVStore
from kvtier.model.llama import CausalLM
from kvtier.planner.placement import KVPlan
from kvtier.policies import PolicyParts
from kvtier.policies.quant import Fp8Codec, KiviCodec, minmax_roundtrip
from tests.policy_store import CPU, make_store, run


def test_codec_errors_shrink_with_bits_and_fp8_is_finite() -> None:
    kv = torch.randn(64, 2, 2, 64, generator=torch.Generator().manual_seed(0))
    err = {b: (KiviCodec(bits=b).roundtrip(kv) - kv).abs().max().item() for b in (2, 4, 8)}
    assert err[8] < err[4] < err[2]
    # Min-max error is at most half a step: (max - min) / (2^b - 1) / 2 per group.
    assert err[8] <= (kv.max() - kv.min()).item() / 255 / 2 + 1e-6
    fp8 = Fp8Codec().roundtrip(kv)
    assert torch.isfinite(fp8).all()
    assert ((fp8 - kv).abs() <= kv.abs().amax(-1, keepdim=True) / 8 + 1e-6).all()  # 3 mantissa bits


def test_kivi_layout_keys_per_channel_values_per_token() -> None:
    codec = KiviCodec(bits=2, group=4, residual=8)
    kv = torch.zeros(8, 2, 1, 4)
    kv[:, 0, 0, 0] = torch.arange(8.0)  # a key channel varies along tokens
    kv[:, 1, 0] = torch.tensor([0.0, 1.0, 2.0, 3.0])  # values vary along channels
    out = codec.roundtrip(kv)
    # Keys: each channel of a 4-token group has its own (min, scale): 0..3 and 4..7 are exact.
    assert torch.equal(out[:, 0, 0, 0], torch.arange(8.0))
    # Values: per token, the 4 channels share a group: 0..3 at 2 bits is exact.
    assert torch.equal(out[:, 1], kv[:, 1])
    # Residual: the newest 8 tokens stay full precision; coded tokens come in groups of 4.
    assert [codec.frozen_tokens(n) for n in (7, 8, 11, 12, 13, 20)] == [0, 0, 0, 4, 4, 12]
    assert torch.equal(minmax_roundtrip(torch.ones(3, 4), 4, dim=1), torch.ones(3, 4))


class RoundTripOnly:
    """A codec that cannot pack: the store keeps its quantize -> dequantize round trip in place.
    The reference the packed tiers must equal bitwise."""

    def __init__(self, codec: KiviCodec | Fp8Codec) -> None:
        self.codec = codec

    def frozen_tokens(self, length: int) -> int:
        return self.codec.frozen_tokens(length)

    def roundtrip(self, kv: torch.Tensor) -> torch.Tensor:
        return self.codec.roundtrip(kv)


def read_slice(store: TieredKVStore, sid: int) -> torch.Tensor:
    """The tokens a slice attends, as the store serves them: [length, 2, G, D]."""
    n = store.slice_length[sid]
    if sid in store.resident:
        return store.resident[sid][:n]
    assert store.packed is not None
    out = torch.empty(n, *store.hosts[sid].extents[0].shape[1:])
    store.packed.read_into(sid, store.hosts[sid], out, 0, n, scratch=False)
    return out


@pytest.mark.parametrize(
    "codec", [KiviCodec(bits=4, group=8, residual=16), RoundTripOnly(KiviCodec(4, 8, 16))]
)
def test_store_codes_only_tokens_outside_the_residual_window(
    gqa: tuple[CausalLM, ModelConfig], codec: Any
) -> None:
    """Packed on the GPU tier or rounded in place: coded tokens are the round trip, the
    residual window is untouched."""
    model, cfg = gqa
    # One prefill chunk: every layer's K/V is computed before the codec runs at end_step.
    _, store = run(model, cfg, PolicyParts(codec=codec), decode=0)
    _, ref = run(model, cfg, PolicyParts(), decode=0)
    n = store.length
    coded = codec.frozen_tokens(n)
    assert coded == 40
    n_slices = len(ref.resident)
    packed = not isinstance(codec, RoundTripOnly)
    assert (len(store.on_device), len(store.resident)) == ((n_slices, 0) if packed else (0, n_slices))
    for sid, full in ref.resident.items():
        got = read_slice(store, sid)
        assert torch.equal(got[coded:n], full[coded:n])  # residual: untouched
        assert not torch.equal(got[:coded], full[:coded])
        assert torch.equal(codec.roundtrip(full[:coded]), got[:coded])


@pytest.mark.parametrize(
    "codec", [KiviCodec(bits=4, group=8, residual=16), KiviCodec(bits=8, group=4, residual=4), Fp8Codec()]
)
def test_packed_tiers_equal_the_round_trip_and_move_packed_bytes(
    gqa: tuple[CausalLM, ModelConfig], codec: KiviCodec | Fp8Codec
) -> None:
    model, cfg = gqa
    ref, _ = run(model, cfg, PolicyParts(codec=RoundTripOnly(codec)), group=1, chunk=25)
    on_gpu, gpu_store = run(model, cfg, PolicyParts(codec=codec), group=1, chunk=25)
    logits, store = run(model, cfg, PolicyParts(codec=codec), group=1, chunk=25, streamed=True)
    for a, b, c in zip(logits, ref, on_gpu, strict=True):
        assert torch.equal(a, b)  # packed rows unpack to exactly the simulated round trip
        assert torch.equal(c, b)
    assert store.packed is not None
    row, token = codec.row_bytes(1, cfg.head_dim), 2 * cfg.head_dim * 4
    slices = cfg.num_layers * cfg.num_kv_heads
    # One more decode step: the loads send packed rows for coded tokens, full tokens for the rest;
    # the GPU tier's packed slices send nothing.
    h2d, gpu_h2d = store.account.h2d_bytes, gpu_store.account.h2d_bytes
    for s in (store, gpu_store):
        s.begin_step(1)
        model(torch.tensor([1]), s)
    n, coded = store.length, store.packed.coded
    assert store.account.h2d_bytes - h2d == slices * (coded // codec.group * row + (n - coded) * token)
    assert gpu_store.account.h2d_bytes == gpu_h2d == 0 and gpu_store.account.d2h_bytes == 0
    assert codec.group * token / row > (3.0 if getattr(codec, "bits", 8) == 4 else 1.7)
    # The GPU tier holds packed bytes: the stored KV shrinks by the byte ratio.
    assert gpu_store.stored_bytes() == {
        "gpu": slices * (coded // codec.group * row + (n - coded) * token),
        "host": 0,
    }
    for s in (store, gpu_store):
        s.end_step()
        s.close()
        assert s.account.allocated == {"gpu": 0, "host": 0}


@pytest.mark.parametrize("policy", ["gpu", "head", "auto"])
def test_planner_sizes_packed_slices_as_the_store_allocates_them(
    gqa: tuple[CausalLM, ModelConfig], policy: str
) -> None:
    """With a packing codec, plan_kv counts rows, tails, staging and scratch exactly; the same
    GPU budget then keeps more slices resident than at full precision."""
    from kvtier.planner.memory import activation_bytes, weight_bytes
    from kvtier.planner.placement import plan_kv

    _, cfg = gqa
    codec = KiviCodec(bits=4, group=8, residual=16)
    n, block = 1000, 8
    kw: dict[str, Any] = dict(policy=policy, dtype_bytes=4, chunk_size=64, block_size=block, reserve_bytes=0)
    kw["group_size"] = None if policy == "gpu" else 1
    full = plan_kv(cfg, n, gpu_budget=None, **kw)
    budget = None
    if policy == "auto":  # room for three quarters of the KV at full precision
        budget = (
            weight_bytes(cfg, 4) + activation_bytes(cfg, 64, 4, group_size=1) + full.gpu_kv_bytes * 3 // 4
        )
        full = plan_kv(cfg, n, gpu_budget=budget, **kw)
    plan = plan_kv(cfg, n, gpu_budget=budget, codec=codec, **kw)
    store = TieredKVStore(
        cfg,
        plan,
        device=CPU,
        dtype=torch.float32,
        capacity=n,
        options=StoreOptions(block_size=block),
        codec=codec,
    )
    assert store.account.allocated == {"gpu": plan.gpu_kv_bytes, "host": plan.host_kv_bytes}
    assert (len(store.on_device), len(store.hosts) - len(store.on_device)) == (
        plan.resident_slices,
        plan.streamed_slices,
    )
    if policy != "head":  # a resident slice: packed rows and a tail, under half of full precision
        assert plan.slice_store_bytes < full.capacity_tokens * full.slice_token_bytes / 2
    if policy == "auto":
        assert 0 < full.resident_slices < plan.resident_slices
    store.close()


def test_quantized_host_tier_keeps_only_a_full_precision_tail(gqa: tuple[CausalLM, ModelConfig]) -> None:
    """Host RAM of a packed host tier: packed rows plus a two-extent tail per slice, not the
    whole context at full precision; a step longer than the tail is refused with a message."""
    from kvtier.kv.synthetic import fill_synthetic

    model, cfg = gqa
    codec = KiviCodec(bits=4, group=8, residual=16)

    def store(parts: PolicyParts) -> TieredKVStore:
        return make_store(cfg, KVPlan("head", 1, 0, 16, 2, 1024), parts, capacity=1024)

    packed, full = store(PolicyParts(codec=codec)), store(PolicyParts())
    for s in (packed, full):
        fill_synthetic(s, 1000)
        for _ in range(3):
            s.begin_step(1)
            assert torch.isfinite(model(torch.tensor([5]), s)).all()
            s.end_step()
    token = 2 * cfg.head_dim * 4
    tail = 40  # uncoded tail (16 + 8 - 1) + a 16-token step, rounded up to 8-token blocks
    rows = 1024 // 8 * codec.row_bytes(1, cfg.head_dim)
    assert packed.account.peak["host"] == 6 * (rows + 2 * tail * token)
    assert full.account.peak["host"] == 6 * 1024 * token
    assert packed.account.peak["host"] < full.account.peak["host"] / 3
    packed.begin_step(41)  # more than a planned step: its write-back does not fit one extent
    with pytest.raises(ValueError, match="do not fit the 2-extent tail"):
        model(torch.arange(41), packed)


@dataclass(frozen=True)
class RawBytes:
    """A toy packing codec, defined here and not in kvtier: a row is its `group` tokens' own
    float32 bytes, so storage is lossless and only the protocol is exercised."""

    group: int = 4
    residual: int = 8

    def frozen_tokens(self, length: int) -> int:
        return max(0, (length - self.residual) // self.group * self.group)

    def row_bytes(self, heads: int, head_dim: int) -> int:
        return self.group * 2 * heads * head_dim * 4

    def pack(self, kv: torch.Tensor) -> torch.Tensor:
        return kv.float().contiguous().view(torch.uint8).reshape(kv.shape[0] // self.group, -1)

    def unpack(self, rows: torch.Tensor, heads: int, head_dim: int, dtype: torch.dtype) -> torch.Tensor:
        return rows.contiguous().view(torch.float32).reshape(-1, 2, heads, head_dim).to(dtype)

    def unpack_into(self, rows: torch.Tensor, dst: torch.Tensor) -> bool:
        return False

    def roundtrip(self, kv: torch.Tensor) -> torch.Tensor:
        return self.unpack(self.pack(kv), kv.shape[2], kv.shape[3], kv.dtype)


def test_a_codec_from_outside_kvtier_plugs_in_through_the_protocol(gqa: tuple[CausalLM, ModelConfig]) -> None:
    """A lossless toy codec, packed on the GPU tier or streamed from host rows: logits bitwise
    equal to the lossless store's, and a decode step moves and stores the same bytes."""
    model, cfg = gqa
    codec = RawBytes()
    assert isinstance(codec, KVCodec)
    ref, ref_store = run(model, cfg, PolicyParts(), group=1, chunk=25, streamed=True)
    for streamed in (False, True):
        logits, store = run(model, cfg, PolicyParts(codec=codec), group=1, chunk=25, streamed=streamed)
        assert store.packed is not None and store.packed.coded == codec.frozen_tokens(store.length) == 56
        assert len(store.on_device) == (0 if streamed else cfg.num_layers * cfg.num_kv_heads)
        for a, b in zip(logits, ref, strict=True):
            assert torch.equal(a, b)
        if streamed:
            h2d, ref_h2d = store.account.h2d_bytes, ref_store.account.h2d_bytes
            for s in (store, ref_store):
                s.begin_step(1)
                model(torch.tensor([1]), s)
            assert store.account.h2d_bytes - h2d == ref_store.account.h2d_bytes - ref_h2d
            assert store.stored_bytes() == ref_store.stored_bytes()
            for s in (store, ref_store):
                s.end_step()
        store.close()


class PackOnly:
    """Half a packing codec: it rounds and packs but cannot unpack or size its rows."""

    group = 4

    def frozen_tokens(self, length: int) -> int:
        return length // 4 * 4

    def roundtrip(self, kv: torch.Tensor) -> torch.Tensor:
        return kv.clone()

    def pack(self, kv: torch.Tensor) -> torch.Tensor:
        return kv.view(torch.uint8)


@pytest.mark.parametrize(
    ("codec", "message"),
    [
        (object(), "object is not a KV codec: it lacks frozen_tokens, group, pack, residual, roundtrip"),
        (PackOnly(), "PackOnly is not a KV codec: it lacks residual, row_bytes, unpack, unpack_into"),
        (RawBytes(group=0), r"RawBytes: group \(0\) must be >= 1"),
    ],
)
def test_the_store_refuses_what_is_not_a_codec_when_built(
    gqa: tuple[CausalLM, ModelConfig], codec: object, message: str
) -> None:
    from kvtier.planner.packed import PackedSizing

    _, cfg = gqa
    with pytest.raises(ConfigError, match=message):
        make_store(cfg, KVPlan("gpu", 1, 6, 16, 0, 0), PolicyParts(codec=codec))
    if not isinstance(codec, RawBytes):
        with pytest.raises(ConfigError, match="cannot size packed slices"):
            PackedSizing.of(codec, 1, cfg.head_dim)


@pytest.mark.parametrize("resident", [0, 3])
def test_loads_unpacked_on_their_own_stream_give_the_same_logits(
    gqa: tuple[CausalLM, ModelConfig], monkeypatch: pytest.MonkeyPatch, resident: int
) -> None:
    """`StoreOptions.unpack_stream`: a streamed slice's rows are copied on the H2D stream into
    alternating scratches and unpacked on the unpack stream; a slice packed on the device is
    unpacked there from its rows, a run of adjacent extents at a time (3-row extents here),
    with nothing on the H2D stream. The same logits bit for bit and the same bytes moved as the
    loads unpacked on the H2D stream."""
    import contextlib

    import kvtier.planner.packed as packed_sizes
    from kvtier.kv.streams import Streams
    from tests.policy_store import DECODE, PROMPT, drive_store

    model, cfg = gqa
    codec = KiviCodec(bits=4, group=8, residual=16)
    monkeypatch.setattr(packed_sizes, "ROWS_EXTENT_BYTES", 3 * codec.row_bytes(1, cfg.head_dim))
    plan = KVPlan("head", 1, resident, 25, 2, PROMPT + DECODE)

    def store(aside: bool) -> TieredKVStore:
        return TieredKVStore(
            cfg,
            plan,
            device=CPU,
            dtype=torch.float32,
            capacity=PROMPT + DECODE,
            options=StoreOptions(block_size=8, unpack_stream=aside),
            **PolicyParts(codec=codec).store_kwargs(),
        )

    on: list[str] = []  # the streams entered, innermost last
    unpacked: list[tuple[tuple[str, ...], int]] = []  # (streams entered, scratch read or -1)

    def entering(label: str) -> contextlib.AbstractContextManager[None]:
        @contextlib.contextmanager
        def ctx() -> Any:
            on.append(label)
            try:
                yield
            finally:
                on.pop()

        return ctx()

    monkeypatch.setattr(Streams, "on_h2d", lambda self: entering("h2d"))
    monkeypatch.setattr(Streams, "on_unpack", lambda self: entering("unpack"))
    original = KiviCodec.unpack_into
    a, b = store(False), store(True)
    assert a.packed is not None and b.packed is not None
    assert (len(a.packed.scratches), len(b.packed.scratches)) == (1, 2)
    for planned in (1, 2):  # the default (None) follows the plan's `unpack_scratches`
        c = TieredKVStore(
            cfg,
            replace(plan, unpack_scratches=planned),
            device=CPU,
            dtype=torch.float32,
            capacity=PROMPT + DECODE,
            options=StoreOptions(block_size=8),
            **PolicyParts(codec=codec).store_kwargs(),
        )
        assert c.packed is not None and len(c.packed.scratches) == planned
        c.close()
    scratches: list[torch.Tensor] = []  # of the store being driven

    def spy(self: KiviCodec, rows: torch.Tensor, dst: torch.Tensor) -> bool:
        which = [i for i, t in enumerate(scratches) if rows.data_ptr() == t.data_ptr()]
        unpacked.append((tuple(on), which[0] if which else -1))
        return original(self, rows, dst)

    monkeypatch.setattr(KiviCodec, "unpack_into", spy)
    scratches[:] = a.packed.scratches
    ref = drive_store(model, cfg, a, chunk=25)
    before = unpacked[:]
    unpacked.clear()
    scratches[:] = b.packed.scratches
    got = drive_store(model, cfg, b, chunk=25)
    for x, y in zip(ref, got, strict=True):
        assert torch.equal(x, y)
    assert a.account.h2d_bytes == b.account.h2d_bytes > 0
    assert before and all(streams == ("h2d",) for streams, _ in before)  # between two copies
    assert unpacked and all(streams == ("h2d", "unpack") for streams, _ in unpacked)
    streamed = [i for _, i in unpacked if i >= 0]
    assert streamed == [k % 2 for k in range(len(streamed))]  # alternating scratches
    from_rows = len(unpacked) - len(streamed)  # device-packed rows unpacked where they lie
    assert (from_rows > 0) == (resident > 0)
    for s in (a, b):
        s.close()
        assert s.account.allocated == {"gpu": 0, "host": 0}
