"""Structured synthetic KV (`kvtier.kv.structured`): no block, extent or layer repeats; the same
KV for a seed whatever the plan, rotation, evictor or codec; and needle queries whose dense
attention lands on the planted needles."""

from __future__ import annotations

import math

import pytest
import torch

from kvtier.config import ModelConfig, RopeConfig
from kvtier.kv.store import StoreOptions, TieredKVStore
from kvtier.kv.structured import Needles, fill_structured
from kvtier.kv.synthetic import fill_synthetic
from kvtier.model.llama import CausalLM
from kvtier.model.rope import Rotary
from kvtier.planner.placement import KVPlan
from kvtier.policies import PolicyParts
from kvtier.policies.head_sparsity import HeadStreamingEvictor
from kvtier.policies.quant import KiviCodec
from tests.policy_store import CPU, make_store

CFG = ModelConfig(
    vocab_size=64,
    hidden_size=64,
    intermediate_size=64,
    num_layers=3,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    max_position_embeddings=8192,
    rope=RopeConfig(theta=500000.0),  # llama-3's: low-frequency pairs stay coherent over 4K tokens
)
ALL_RESIDENT = KVPlan("gpu", 2, 3, 64, 0, 0)
STREAMED = KVPlan("head", 1, 0, 16, 2, 512)  # every (layer, KV head) slice in host memory


def store(plan: KVPlan, capacity: int = 512, block: int = 8, rotate_keys: bool = True) -> TieredKVStore:
    """A float32 CPU store of CFG; extents of 2 blocks, so a few hundred tokens span many."""
    opts = StoreOptions(block_size=block, extent_blocks=2)
    return TieredKVStore(
        CFG, plan, device=CPU, dtype=torch.float32, capacity=capacity, options=opts, rotate_keys=rotate_keys
    )


def heads_kv(s: TieredKVStore) -> torch.Tensor:
    """Every stored token of every (layer, KV head): [L, H_kv, length, 2, D] (no evictor)."""
    lay, n = s.layout, s.length
    out = torch.empty(lay.num_layers, lay.num_kv_heads, n, 2, lay.head_dim)
    for sid in range(lay.num_slices):
        layer, group = divmod(sid, lay.num_groups)
        if sid in s.resident:
            kv = s.resident[sid][:n]
        else:
            kv = torch.empty(n, 2, lay.group_size, lay.head_dim)
            s.hosts[sid].read_into(kv, 0, n)
        out[layer, lay.kv_heads(group)] = kv.permute(2, 0, 1, 3)
    return out


def repeated_blocks(s: TieredKVStore) -> int:
    """Token blocks (of any slice) whose K and V equal another block's."""
    bs = s.layout.block_size
    kv = heads_kv(s)
    blocks = kv[:, :, : kv.shape[2] // bs * bs].reshape(-1, bs * 2 * s.layout.head_dim)
    return blocks.shape[0] - torch.unique(blocks, dim=0).shape[0]


def test_no_block_extent_or_layer_repeats() -> None:
    s = store(STREAMED)
    fill_structured(s, 400)
    assert repeated_blocks(s) == 0
    extents = [e for host in s.hosts.values() for e in host.extents[: 400 // 16]]
    assert len(extents) == 6 * 25
    assert torch.unique(torch.stack(extents).flatten(1), dim=0).shape[0] == len(extents)
    kv = heads_kv(s)
    assert not torch.isclose(kv[0], kv[1]).all(-1).any()  # no token equal in two layers
    # The check catches the old fill: one random extent copied everywhere.
    old = store(STREAMED)
    fill_synthetic(old, 400)
    assert repeated_blocks(old) > 0


def test_same_seed_same_kv_other_seed_other_kv() -> None:
    def filled(seed: int) -> tuple[torch.Tensor, Needles]:
        s = store(STREAMED)
        needles = fill_structured(s, 300, seed)
        return heads_kv(s), needles

    (a, na), (b, nb), (c, nc) = filled(0), filled(0), filled(1)
    assert torch.equal(a, b) and torch.equal(na.starts, nb.starts) and torch.equal(na.queries, nb.queries)
    assert not torch.isclose(a, c).all(-1).any()
    assert not torch.equal(na.starts, nc.starts)


def test_kv_does_not_depend_on_the_plan_and_rotation_is_rope_at_true_positions() -> None:
    """Resident and host slices, head groups of 1 or 2: the same KV per (layer, KV head); a store
    with un-rotated keys holds the same keys before RoPE."""
    mixed = KVPlan("head", 1, 2, 16, 2, 512)  # 2 resident slices, 4 in host memory
    kvs = []
    for plan in (ALL_RESIDENT, mixed, STREAMED):
        s = store(plan)
        fill_structured(s, 333)
        assert s.length == s.position == 333 and s.slice_length == [333] * s.layout.num_slices
        kvs.append(heads_kv(s))
    assert len(store(mixed).resident) == 2
    assert torch.equal(kvs[0], kvs[1]) and torch.equal(kvs[0], kvs[2])
    s = store(ALL_RESIDENT, rotate_keys=False)
    fill_structured(s, 333)
    raw = heads_kv(s)
    assert torch.equal(raw[..., 1, :], kvs[0][..., 1, :])
    cos, sin = Rotary(CFG.rope, CFG.head_dim).cos_sin(torch.arange(333), torch.float32)
    keys = raw[..., 0, :].flatten(0, 1).transpose(0, 1)  # [T, L * H_kv, D]
    rotated = Rotary.apply(keys, cos, sin).transpose(0, 1).view_as(raw[..., 0, :])
    torch.testing.assert_close(rotated, kvs[0][..., 0, :], rtol=0, atol=1e-5)


def test_needles_lie_in_whole_blocks_one_per_stratum() -> None:
    s = store(ALL_RESIDENT, capacity=1024, block=16)
    needles = fill_structured(s, 1000, needles=3, needle_tokens=5, depth=(0.2, 0.8))
    assert needles.starts.shape == (3, 2, 3) and needles.queries.shape == (3, 2, 16)
    first, last = 13, 50  # whole blocks inside tokens [200, 800)
    blocks = needles.blocks
    assert ((blocks >= first) & (blocks < last)).all()
    assert (needles.starts % 16 + 5 <= 16).all()  # a needle never crosses a block boundary
    strata = first + torch.arange(4) * (last - first) // 3  # one needle between each pair
    assert ((blocks >= strata[:-1]) & (blocks < strata[1:])).all()
    assert needles.positions(1, 0).shape == (15,) and needles.position == 1000


@pytest.mark.parametrize("rotate_keys", [True, False])
def test_needle_queries_put_most_of_dense_attention_on_the_needles(rotate_keys: bool) -> None:
    """Dense attention of each KV head's needle query (rotated at the query's position for a
    rotated store, raw otherwise) puts most of its mass on that head's needles; over the same
    KV without needles (same seed), the same query puts almost none on those tokens."""

    def keys(needles: int) -> tuple[torch.Tensor, Needles]:
        s = store(ALL_RESIDENT, capacity=4096, block=16, rotate_keys=rotate_keys)
        planted = fill_structured(s, 4000, needles=needles, needle_tokens=8)
        return heads_kv(s)[..., 0, :].flatten(0, 1), planted  # [L * H_kv, T, D]

    (with_needles, needles), (without, _) = keys(4), keys(0)
    rotary = Rotary(CFG.rope, CFG.head_dim) if rotate_keys else None
    q = torch.cat([needles.query(layer, rotary=rotary) for layer in range(3)]).view(6, 1, 16)
    for k, least, most in ((with_needles, 0.9, 1.0), (without, 0.0, 0.1)):
        probs = torch.softmax((q @ k.transpose(1, 2))[:, 0] / 4.0, dim=-1)  # [L * H_kv, T]
        for h in range(6):
            mass = probs[h, needles.positions(*divmod(h, 2))].sum()
            assert least < mass <= most, (h, mass)


def test_a_halo_fades_the_needle_into_the_tokens_around_it() -> None:
    """Keys' component along the needle direction (un-rotated store): strength * sqrt(D) on the
    needle, exp(-d / halo) of it d tokens away; nothing outside a needle without a halo."""

    def along(halo: float, d: int) -> float:
        s = store(ALL_RESIDENT, capacity=1024, block=32, rotate_keys=False)
        needles = fill_structured(s, 1000, needle_tokens=8, halo=halo)
        kv, unit = heads_kv(s), needles.queries / needles.queries.norm(dim=-1, keepdim=True)
        starts = needles.starts + 8 + d - 1 if d > 0 else needles.starts  # d tokens past a needle
        keys = kv[..., 0, :].gather(2, starts[..., None].expand(-1, -1, -1, 16))  # [L, H_kv, N, D]
        return float((keys * unit[:, :, None]).sum(-1).mean())

    peak = 0.5 * 16**0.5  # NEEDLE * sqrt(D)
    assert abs(along(4.0, 0) - peak) < 0.2 and abs(along(0.0, 0) - peak) < 0.2
    assert abs(along(4.0, 2) - peak * math.exp(-0.5)) < 0.2
    assert abs(along(4.0, 12)) < 0.3 and abs(along(0.0, 1)) < 0.3


def test_refuses_a_filled_store_and_impossible_needles() -> None:
    s = store(ALL_RESIDENT)
    fill_structured(s, 100)
    with pytest.raises(ValueError, match="empty store"):
        fill_structured(s, 100)
    with pytest.raises(ValueError, match="one block"):
        fill_structured(store(ALL_RESIDENT), 100, needle_tokens=9)
    with pytest.raises(ValueError, match="whole 8-token blocks"):
        fill_structured(store(ALL_RESIDENT), 100, needles=20)
    with pytest.raises(ValueError, match="rank"):
        fill_structured(store(ALL_RESIDENT), 100, rank=16)


def test_an_evictor_keeps_the_tokens_it_would_keep(gqa: tuple[CausalLM, ModelConfig]) -> None:
    """Head-wise streaming: the compacted slices hold the sinks and recent tokens of the same
    KV the other slices hold whole, and the store serves a decode step."""
    model, cfg = gqa
    plan = KVPlan("head", 1, 0, 16, 2, 128)
    scores = torch.arange(6.0).view(3, 2)
    evicted = make_store(cfg, plan, PolicyParts(evictor=HeadStreamingEvictor(scores, 0.5, 4, 20)), 128)
    full = make_store(cfg, plan, PolicyParts(), 128)
    fill_structured(evicted, 100)
    fill_structured(full, 100)
    assert sorted(evicted.slice_length) == [24] * 3 + [100] * 3
    keep = torch.cat((torch.arange(4), torch.arange(80, 100)))
    for sid, n in enumerate(evicted.slice_length):
        ref = torch.empty(100, 2, 1, cfg.head_dim)
        full.hosts[sid].read_into(ref, 0, 100)
        if n == 24:
            assert torch.equal(evicted.resident[sid][:24], ref[keep])
        else:
            got = torch.empty_like(ref)
            evicted.hosts[sid].read_into(got, 0, 100)
            assert torch.equal(got, ref)
    evicted.begin_step(1)
    assert torch.isfinite(model(torch.tensor([1]), evicted)).all()
    evicted.end_step()


@pytest.mark.parametrize("where", ["host", "gpu"])
def test_a_packing_codec_gets_packed_rows_and_a_full_precision_tail(
    gqa: tuple[CausalLM, ModelConfig], where: str
) -> None:
    """Coded tokens are the codec's round trip of the same KV, stored as packed rows (in host
    memory, or on the device for the plan's resident slices); the uncoded tail is exact."""
    model, cfg = gqa
    codec = KiviCodec(bits=4, group=8, residual=16)
    plan = KVPlan("head", 1, 0, 16, 2, 128) if where == "host" else KVPlan("gpu", 1, 6, 16, 0, 0)
    packed_store = make_store(cfg, plan, PolicyParts(codec=codec), 128)
    full = make_store(cfg, KVPlan("head", 1, 0, 16, 2, 128), PolicyParts(), 128)
    fill_structured(packed_store, 100)
    fill_structured(full, 100)
    packed = packed_store.packed
    assert packed is not None and packed.coded == packed_store._coded == 80
    assert len(packed_store.on_device) == (6 if where == "gpu" else 0)
    for sid, host in packed_store.hosts.items():
        ref = torch.empty(100, 2, 1, cfg.head_dim)
        full.hosts[sid].read_into(ref, 0, 100)
        got = torch.empty_like(ref)
        packed.read_into(sid, host, got, 0, 100, scratch=False)
        assert torch.equal(got[:80], codec.roundtrip(ref[:80]))
        assert torch.equal(got[80:], ref[80:])
    packed_store.begin_step(1)
    assert torch.isfinite(model(torch.tensor([1]), packed_store)).all()
    packed_store.end_step()
