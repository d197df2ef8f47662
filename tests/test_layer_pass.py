"""A prefill taken layer by layer (`kvtier.engine.layer_prefill`, `kvtier.kv.layer_pass`) gives
the chunk-by-chunk prefill's logits and tokens bitwise, loads no stored prefix of a fresh
prompt (and a stored one once a layer), writes the same bytes back, and runs only where the
store can; elsewhere the prefill keeps the chunk order."""

from __future__ import annotations

import pytest
import torch

from kvtier.config import ModelConfig
from kvtier.engine.layer_prefill import prefill_by_layer
from kvtier.engine.runner import prefill
from kvtier.errors import ConfigError
from kvtier.kv.store import TieredKVStore
from kvtier.model.llama import CausalLM
from kvtier.planner.placement import KVPlan
from kvtier.policies import PolicyParts
from kvtier.policies.quant import KiviCodec
from kvtier.sparse import HipKernel
from tests import hip_store, policy_store

CPU = torch.device("cpu")
PROMPT, DECODE, CHUNK = 45, 6, 11


def kv_plan(policy: str, group: int, resident: int = 0, buffers: int = 2, staging: int = 64) -> KVPlan:
    return KVPlan(
        policy=policy,
        group_size=group,
        resident_slices=resident,
        chunk_size=CHUNK,
        staging_buffers=buffers,
        staging_tokens=staging,
    )


def make_store(cfg: ModelConfig, plan: KVPlan, codec: KiviCodec | None = None) -> TieredKVStore:
    """A float32 CPU store of PROMPT + DECODE tokens (`tests.policy_store`'s), with `codec`."""
    return policy_store.make_store(cfg, plan, PolicyParts(codec=codec), capacity=PROMPT + DECODE)


def generate(
    model: CausalLM, store: TieredKVStore, ids: torch.Tensor, by_layer: bool, chunk: int = CHUNK
) -> tuple[list[torch.Tensor], bool]:
    """Prefill (chunk or layer order) then greedy decode: every step's logits, and whether the
    prefill ran by layer."""
    last, layered = prefill(model, store, ids, chunk, by_layer=by_layer)
    logits = [last]
    for _ in range(DECODE):
        store.begin_step(1)
        logits.append(model(logits[-1].argmax().view(1), store)[-1])
        store.end_step()
    return logits, layered


def prompt(cfg: ModelConfig, n: int = PROMPT, seed: int = 3) -> torch.Tensor:
    return torch.randint(0, cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(
    "plan",
    [kv_plan("layer", 2), kv_plan("head", 1, buffers=2), kv_plan("auto", 1, resident=2, buffers=3)],
    ids=["layer-slices", "head-slices", "partly-resident"],
)
def test_layer_order_is_bitwise_the_chunk_order(gqa: tuple[CausalLM, ModelConfig], plan: KVPlan) -> None:
    model, cfg = gqa  # 3 layers, 2 KV heads
    ids = prompt(cfg)
    ref_store, store = make_store(cfg, plan), make_store(cfg, plan)
    ref, ref_layered = generate(model, ref_store, ids, by_layer=False)
    got, layered = generate(model, store, ids, by_layer=True)
    assert (ref_layered, layered) == (False, True)
    for a, b in zip(got, ref, strict=True):
        assert torch.equal(a, b)
    # the same bytes went to the host tier; a fresh prompt's prefix was never loaded
    assert store.account.d2h_bytes == ref_store.account.d2h_bytes > 0
    assert ref_store.account.h2d_bytes > store.account.h2d_bytes


def test_the_pass_reports_whole_tokens_that_sum_to_the_prompt(gqa: tuple[CausalLM, ModelConfig]) -> None:
    """A progress bar's updates: whole tokens, the pass's pairs' tokens over the layer count,
    summing to the prompt (float shares summed past a bar's total and tqdm warned)."""
    model, cfg = gqa  # 3 layers: 11-token chunks give shares of 11/3
    store = make_store(cfg, kv_plan("layer", 2))
    spans = [(s, min(s + CHUNK, PROMPT)) for s in range(0, PROMPT, CHUNK)]
    assert store.layer_pass_fits(PROMPT)
    got: list[int] = []
    prefill_by_layer(model, store, prompt(cfg), spans, CHUNK, progress=got.append)
    assert all(isinstance(n, int) and n >= 0 for n in got)
    assert len(got) == len(spans) * len(model.model.layers) and sum(got) == PROMPT


def test_a_fresh_prompt_loads_nothing_and_a_stored_prefix_once_a_layer(
    gqa: tuple[CausalLM, ModelConfig],
) -> None:
    model, cfg = gqa
    plan = kv_plan("head", 1)
    ids = prompt(cfg)
    store = make_store(cfg, plan)
    prefill(model, store, ids[:20], CHUNK, by_layer=True)
    assert store.account.h2d_bytes == 0
    # a second part after 20 stored tokens: each streamed slice's 20 tokens, once
    ref_store = make_store(cfg, plan)
    ref_logits, _ = prefill(model, ref_store, ids[:20], CHUNK)
    ref_logits, _ = prefill(model, ref_store, ids[20:], CHUNK)
    logits, layered = prefill(model, store, ids[20:], CHUNK, by_layer=True)
    assert layered and torch.equal(logits, ref_logits)
    token = 2 * cfg.head_dim * 4  # K and V of one head, float32
    assert store.account.h2d_bytes == 20 * token * len(store.hosts)


def count_decode_state(store: TieredKVStore, kernel: HipKernel, held: list[int]) -> None:
    """Append the kernel's decode state bytes to `held` as each of the store's chunks starts."""
    chunk = store.pass_chunk

    def spy(start: int, end: int) -> None:
        held.append(kernel.attend_buffer_bytes() + kernel.gpu_cache_bytes())
        chunk(start, end)

    store.pass_chunk = spy  # type: ignore[method-assign]


def test_hip_prefill_by_layer_is_bitwise(gqa: tuple[CausalLM, ModelConfig]) -> None:
    """HiP prunes each chunk's blocks over the whole slice in either order (the prompt's last
    token alone after the pass), and decodes the same tokens after it. No layer's decode state
    (made at the last token) exists while the pass runs: HiP's plan counts it in place of a
    chunk's activations, not beside them."""
    model, cfg = gqa
    ids = prompt(cfg, hip_store.PROMPT, seed=7)
    outs, held = [], []
    for by_layer in (False, True):
        kernel = hip_store.kernel_for(cfg)
        store = hip_store.make_store(cfg, "head", kernel)
        if by_layer:
            count_decode_state(store, kernel, held)
        outs.append(generate(model, store, ids, by_layer, chunk=hip_store.CHUNK))
    (ref, ref_layered), (got, layered) = outs
    assert (ref_layered, layered) == (False, True)
    for a, b in zip(got, ref, strict=True):
        assert torch.equal(a, b)
    # the pass's (layer, chunk)s and the last token's step, then the decode steps
    assert len(held) > cfg.num_layers * 2 + DECODE
    assert not any(held[:-DECODE]) and all(held[-DECODE:]), held


def test_where_the_store_cannot_the_prefill_keeps_the_chunk_order(gqa: tuple[CausalLM, ModelConfig]) -> None:
    model, cfg = gqa
    ids = prompt(cfg)
    cases = {
        "resident": make_store(cfg, kv_plan("gpu", 2, resident=3, buffers=0, staging=0)),
        "a layer's slices outnumber the buffers": make_store(cfg, kv_plan("head", 1, buffers=1)),
        "sequence blocks": make_store(cfg, kv_plan("layer", 2, staging=30)),
        "a codec": make_store(cfg, kv_plan("layer", 2), codec=KiviCodec(bits=8, group=8, residual=8)),
    }
    for why, store in cases.items():
        assert not store.layer_pass_fits(PROMPT), why
        _, layered = prefill(model, store, ids, CHUNK, by_layer=True)
        assert not layered, why
    # one chunk: nothing to gain
    assert not prefill(model, make_store(cfg, kv_plan("layer", 2)), ids[:CHUNK], CHUNK, by_layer=True)[1]


def test_a_layer_step_the_store_cannot_take_is_refused_before_anything_moves(
    gqa: tuple[CausalLM, ModelConfig],
) -> None:
    _, cfg = gqa
    store = make_store(cfg, kv_plan("head", 1, buffers=1))
    with pytest.raises(ConfigError, match="layer by layer"):
        store.begin_step(PROMPT, by_layer=True)
    assert (store.length, store.position) == (0, 0)
    store.begin_step(PROMPT)  # the chunk order still runs


def test_an_unknown_prefill_order_is_refused() -> None:
    from kvtier.engine.config import EngineConfig

    with pytest.raises(ConfigError, match="--prefill-order 'diagonal': use one of chunk, layer"):
        EngineConfig(prefill_order="diagonal")


def test_the_hidden_pieces_pin_setting_is_read_and_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    """`KVTIER_HIDDEN_PIN`: unset is PyTorch's pinned allocator, "register" (any case) the
    registered pieces, "huge" those in huge pages; anything else is refused with the values it
    takes."""
    from kvtier.engine.host_pin import hidden_pin

    monkeypatch.delenv("KVTIER_HIDDEN_PIN", raising=False)
    assert hidden_pin() == "alloc"
    monkeypatch.setenv("KVTIER_HIDDEN_PIN", " Register ")
    assert hidden_pin() == "register"
    monkeypatch.setenv("KVTIER_HIDDEN_PIN", "HUGE")
    assert hidden_pin() == "huge"
    monkeypatch.setenv("KVTIER_HIDDEN_PIN", "mlock")
    with pytest.raises(ConfigError, match=r"use alloc \(the default\), register or huge"):
        hidden_pin()


def test_registered_pieces_are_kept_for_the_next_pass_and_released_once() -> None:
    """`RegisteredPool` (KVTIER_HIDDEN_PIN=register): a piece given back is taken again for the
    same shape and dtype instead of a new registration; `close` releases each kept one once."""
    from kvtier.kv.host_register import RegisteredPool

    made: list[torch.Tensor] = []
    released: list[torch.Tensor] = []

    def make(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        made.append(torch.zeros(shape, dtype=dtype))
        return made[-1]

    pool = RegisteredPool(make, released.append)
    a, b = pool.take((4, 8), torch.bfloat16), pool.take((4, 8), torch.bfloat16)
    pool.give([a, b])
    assert pool.take((2, 8), torch.bfloat16) is made[2]  # another shape: a new one
    assert pool.take((4, 8), torch.float32) is made[3]  # another dtype too
    again = {id(pool.take((4, 8), torch.bfloat16)) for _ in range(2)}
    assert again == {id(a), id(b)} and len(made) == 4
    pool.give([a, made[2]])
    pool.close()
    assert [id(t) for t in released] == [id(a), id(made[2])]
    pool.close()
    assert len(released) == 2
