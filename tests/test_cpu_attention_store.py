"""Streamed slices attended on the CPU at decode: the same tokens as all-on-device attention,
logits within fp32 rounding, exact bytes over each link, and the options that turn it on."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

import kvtier.kv.cpu_attend as cpu_attend
from bench.cpu_split_trace import cpu_split_row, cpu_timeline
from kvtier import LLM, SamplingParams
from kvtier.attention.cpu_decode import CpuDecoder
from kvtier.cli.main import main as cli_main
from kvtier.config import ModelConfig
from kvtier.errors import ConfigError
from kvtier.kv.store import StoreOptions, TieredKVStore
from kvtier.loading.weights import load_safetensors_folder
from kvtier.model.llama import CausalLM
from kvtier.planner.placement import KVPlan
from tests.hf_reference import drive, make_hf_model

CPU = torch.device("cpu")
PROMPT, DECODE, CHUNK = 45, 9, 11  # the last prompt chunk is one token: a decode-shaped step too


@pytest.fixture(scope="module")
def gqa_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder: Path = tmp_path_factory.mktemp("gqa-cpu")
    make_hf_model("llama-gqa", folder)  # 3 layers, 2 KV heads of 2 query heads, head dim 16
    return folder


@pytest.fixture(scope="module")
def gqa_model(gqa_folder: Path) -> tuple[CausalLM, ModelConfig]:
    return load_safetensors_folder(gqa_folder, CPU, torch.float32)


@pytest.fixture(scope="module")
def reference(gqa_model: tuple[CausalLM, ModelConfig]) -> tuple[list[torch.Tensor], list[int]]:
    """Logits and tokens with every slice on the device."""
    logits, tokens, store = run(*gqa_model, KVPlan("gpu", 2, 3, CHUNK, 0, 0))
    store.close()
    return logits, tokens


def run(
    model: CausalLM, cfg: ModelConfig, plan: KVPlan
) -> tuple[list[torch.Tensor], list[int], TieredKVStore]:
    ids = torch.randint(0, cfg.vocab_size, (PROMPT,), generator=torch.Generator().manual_seed(7))
    store = TieredKVStore(
        cfg,
        plan,
        device=CPU,
        dtype=torch.float32,
        capacity=PROMPT + DECODE,
        options=StoreOptions(block_size=5, extent_blocks=2),  # extents of 10 tokens: many per slice
    )
    logits, tokens = drive(model, store, ids, CHUNK, DECODE)
    return logits, tokens, store


def plan(group: int, resident: int, cpu: int, staging: int = 60, buffers: int = 2) -> KVPlan:
    return KVPlan(
        "head", group, resident, CHUNK, buffers, staging, num_slices=3 * (2 // group), cpu_slices=cpu
    )


@pytest.mark.parametrize(
    "p",
    [
        plan(2, 0, 1),  # layer-wise: one whole layer on the CPU
        plan(1, 0, 6),  # head-wise, every streamed slice
        plan(1, 2, 4),  # resident slices next to CPU ones
        plan(1, 0, 3, staging=15),  # the link's slices in sequence blocks
        plan(1, 1, 2, buffers=3),  # three staging buffers, as the planner buys them for the CPU
    ],
    ids=lambda p: (
        f"g{p.group_size}-r{p.resident_slices}-cpu{p.cpu_slices}-s{p.staging_tokens}-b{p.staging_buffers}"
    ),
)
def test_cpu_slices_give_the_same_tokens(
    gqa_model: tuple[CausalLM, ModelConfig],
    reference: tuple[list[torch.Tensor], list[int]],
    backend: str,
    p: KVPlan,
) -> None:
    model, cfg = gqa_model
    ref_logits, ref_tokens = reference
    logits, tokens, store = run(model, cfg, p)
    assert store.cpu is not None and len(store.cpu.slices) == p.cpu_slices
    assert tokens == ref_tokens
    # NOTE: not bitwise: the CPU kernels reduce in another order than SDPA's, then merge by
    # log-sum-exp with the new token; fp32 rounding only.
    for a, b in zip(logits, ref_logits, strict=True):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-5)
    token_bytes = 2 * p.group_size * cfg.head_dim * 4
    streamed = p.num_slices - p.resident_slices
    # Every streamed slice, CPU ones included, writes each new token to the host exactly once.
    assert store.account.d2h_bytes == streamed * (PROMPT + DECODE) * token_bytes
    # The link carries each step's stored tokens of every streamed slice but the CPU ones at
    # one-token steps (the last prompt chunk and every decode step).
    steps = [(s, min(CHUNK, PROMPT - s)) for s in range(0, PROMPT, CHUNK)] + [
        (PROMPT + i, 1) for i in range(DECODE)
    ]
    loaded = sum(s * (streamed - (p.cpu_slices if n == 1 else 0)) for s, n in steps)
    assert store.account.h2d_bytes == loaded * token_bytes
    # The split's timers (bench/tiered_store.py's cpu_split): the host waited for CPU results,
    # and the native jobs ran, at some step
    assert store.cpu.wait_s > 0
    assert (store.cpu.decoder.busy_s > 0) == (backend == "native")
    split = cpu_split_row(store, (0.0, 0.0), DECODE)
    assert split["cpu_bytes_per_token"] == p.cpu_slices * store.length * token_bytes
    assert split["host_wait_s_per_token"] == store.cpu.wait_s / DECODE
    store.close()


@pytest.mark.skipif(shutil.which("c++") is None, reason="no c++: the native kernel's jobs are timed")
def test_cpu_timeline_times_every_cpu_layer_of_a_step(
    gqa_model: tuple[CausalLM, ModelConfig], monkeypatch: pytest.MonkeyPatch
) -> None:
    """bench/tiered_store.py --trace-cpu: one decode step's CPU layers, each part of the CPU's
    chain non-negative where it must be, and the step's tracing switched off after it."""
    dec = CpuDecoder(2, backend="native")
    monkeypatch.setattr(cpu_attend, "shared_decoder", lambda: dec)
    model, cfg = gqa_model
    ids = torch.randint(0, cfg.vocab_size, (PROMPT,), generator=torch.Generator().manual_seed(7))
    store = TieredKVStore(
        cfg, plan(1, 1, 3), device=CPU, dtype=torch.float32, capacity=PROMPT + 2,
        options=StoreOptions(block_size=5, extent_blocks=2),
    )  # fmt: skip
    logits, _ = drive(model, store, ids, CHUNK, 1)
    assert store.cpu is not None
    timeline = cpu_timeline(store, model, logits[-1][-1].argmax())
    layers = {s // 2 for s in store.cpu.slices}  # one KV head a slice, two a layer
    assert timeline["cpu_layers"] == len(layers)
    per = timeline["per_layer_ms"]
    assert all(len(v) == len(layers) for v in per.values())
    for part in ("q_to_cpu", "cpu_busy", "wake", "host_enqueue", "host_wait", "cpu_gap"):
        assert min(per[part]) >= 0, part
    assert min(per["cpu_busy"]) > 0
    # the CPU idles between layers at least while the host merges and runs the next projections
    assert per["cpu_gap"][0] == 0 and min(per["cpu_gap"][1:]) > 0
    assert timeline["sum_s"]["host_wait"] <= timeline["wall_s"]
    assert store.cpu.trace is None and store.cpu.decoder.trace is None
    store.close()


def test_cpu_slices_write_back_tokens_made_before_their_event(
    gqa_model: tuple[CausalLM, ModelConfig], monkeypatch: pytest.MonkeyPatch
) -> None:
    """On CUDA a write-back copies a CPU slice's new token on the D2H stream after the event it is
    given, so the token must exist by that event: every token handed to `write_back` was made
    (or is a view made) before the event was recorded. Checked on the CPU by logging the order."""
    model, cfg = gqa_model
    ids = torch.randint(0, cfg.vocab_size, (PROMPT,), generator=torch.Generator().manual_seed(7))
    store = TieredKVStore(
        cfg, plan(1, 1, 3), device=CPU, dtype=torch.float32, capacity=PROMPT + DECODE,
        options=StoreOptions(block_size=5, extent_blocks=2),
    )  # fmt: skip
    assert store.cpu is not None
    log: list[tuple[str, object]] = []

    class Recorded:  # the CPU slices' own events, logged in order
        def record(self) -> object:
            log.append(("event", ev := object()))
            return ev

    contiguous = torch.Tensor.contiguous

    def made(self: torch.Tensor, *a: object, **k: object) -> torch.Tensor:
        out = contiguous(self, *a, **k)
        log.append(("made", out))
        return out

    writes: list[tuple[torch.Tensor, object]] = []
    write_back = store._write_back

    def logged(sid: int, new: torch.Tensor, after: object) -> None:
        writes.append((new, after))
        write_back(sid, new, None)  # NOTE: the real streams know no such event

    store.cpu.streams = Recorded()  # type: ignore[assignment]
    monkeypatch.setattr(store, "_write_back", logged)
    monkeypatch.setattr(torch.Tensor, "contiguous", made)
    drive(model, store, ids, CHUNK, DECODE)
    monkeypatch.undo()
    assert len(writes) == 3 * (DECODE + 1)  # every CPU slice, every one-token step (the last chunk too)
    for new, after in writes:
        at_event = next(i for i, (kind, x) in enumerate(log) if kind == "event" and x is after)
        at_made = max(i for i, (kind, x) in enumerate(log) if kind == "made" and x is new)
        assert at_made < at_event
    store.close()


def test_a_layers_cpu_slices_merge_together_adjacent_or_not(tmp_path: Path, backend: str) -> None:
    """Four KV heads a layer, slices of one: a layer's CPU slices are merged in one batch whether
    their groups are adjacent (every slice on the CPU) or not (a resident slice between them),
    with the tokens and logits of all-on-device attention, and a decode step's operators do not
    grow with a layer's CPU slices (the old per-slice merge took ~16 a slice)."""
    from kvtier.sparse.opcount import OpCounter

    make_hf_model("llama-mha", tmp_path)  # 3 layers, 4 KV heads
    model, cfg = load_safetensors_folder(tmp_path, CPU, torch.float32)

    def go(p: KVPlan) -> tuple[list[torch.Tensor], list[int], int, frozenset[int]]:
        logits, tokens, store = run(model, cfg, p)
        store.begin_step(1)
        with OpCounter() as ops:
            model(torch.tensor([tokens[-1]]), store)
        store.end_step()
        slices = store.cpu.slices if store.cpu is not None else frozenset()
        store.close()
        return logits, tokens, ops.total, slices

    def mha(group: int, resident: int, cpu: int) -> KVPlan:
        return KVPlan("head", group, resident, CHUNK, 2, 60, num_slices=3 * (4 // group), cpu_slices=cpu)

    ref_logits, ref_tokens, _, _ = go(KVPlan("gpu", 4, 3, CHUNK, 0, 0))
    _, _, layer_ops, _ = go(mha(4, 0, 3))  # one CPU slice a layer
    for p, groups in ((mha(1, 0, 12), (0, 1, 2, 3)), (mha(1, 6, 6), (0, 2))):
        logits, tokens, ops, slices = go(p)
        assert sorted(s % 4 for s in slices if s < 4) == list(groups)
        assert tokens == ref_tokens
        for a, b in zip(logits, ref_logits, strict=True):
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-5)
        if p.resident_slices == 0 and backend == "native":
            # 9 more CPU slices than layer slices: a write-back each (the torch backend also merges
            # each slice's tasks with CPU operators)
            assert ops - layer_ops <= 3 * 9, (ops, layer_ops)


def test_a_store_with_a_method_kernel_or_evictor_streams_its_cpu_slices(
    gqa_model: tuple[CausalLM, ModelConfig],
) -> None:
    from kvtier.methods import build_policy

    cfg = gqa_model[1]
    for option in (dict(evict="window", kv_budget=32), dict(attention="quest", kv_budget=32)):
        parts = build_policy(cfg, device=CPU, **option)  # type: ignore[arg-type]
        store = TieredKVStore(
            cfg, plan(1, 0, 3), device=CPU, dtype=torch.float32, capacity=64, **parts.store_kwargs()
        )
        assert store.cpu is None, option
        store.close()


@pytest.mark.parametrize(
    "codec",
    ["int4-native", "int4-g8", "fp8"],
)
def test_cpu_slices_of_a_quantized_cache_give_its_tokens(
    gqa_model: tuple[CausalLM, ModelConfig], backend: str, codec: str
) -> None:
    """The CPU reads a quantized cache's packed rows (and its full-precision tail) where a load
    would unpack them: the same tokens as streaming every slice, fewer bytes over the link."""
    from kvtier.policies.quant import Fp8Codec, KiviCodec

    model, cfg = gqa_model
    made = {
        "int4-native": KiviCodec(bits=4, group=32, residual=0),  # the native kernel's rows
        "int4-g8": KiviCodec(bits=4, group=8, residual=8),  # unpacked with torch
        "fp8": Fp8Codec(),
    }[codec]

    def go(cpu: int) -> tuple[list[torch.Tensor], list[int], TieredKVStore]:
        ids = torch.randint(0, cfg.vocab_size, (PROMPT,), generator=torch.Generator().manual_seed(7))
        store = TieredKVStore(
            cfg,
            plan(1, 1, cpu),
            device=CPU,
            dtype=torch.float32,
            capacity=PROMPT + DECODE,
            options=StoreOptions(block_size=5, extent_blocks=2),
            codec=made,
        )
        logits, tokens = drive(model, store, ids, CHUNK, DECODE)
        return logits, tokens, store

    ref_logits, ref_tokens, ref_store = go(0)
    logits, tokens, store = go(3)
    assert store.cpu is not None and len(store.cpu.slices) == 3
    assert store.packed is not None and store.packed.coded > 0
    assert tokens == ref_tokens
    for a, b in zip(logits, ref_logits, strict=True):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-4)
    assert store.account.h2d_bytes < ref_store.account.h2d_bytes
    store.close()
    ref_store.close()


def test_llm_cpu_attention_option(gqa_folder: Path) -> None:
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    prompt = list(range(3, 40))
    ref = LLM(str(gqa_folder), device="cpu", kv="gpu").generate(prompt, params)[0]
    llm = LLM(str(gqa_folder), device="cpu", kv="head", cpu_attention=3)
    out = llm.generate(prompt, params)[0]
    assert out.token_ids == ref.token_ids
    assert out.stats.plan["cpu_slices"] == 3
    # auto on the CPU device: no separate GPU to overlap with, so nothing goes to the CPU path.
    assert LLM(str(gqa_folder), device="cpu", kv="head").plan(64).cpu_slices == 0
    assert llm.plan(64, llm.resolve_method("int8,kv=head")).cpu_slices == 3  # over its packed rows
    with pytest.raises(ConfigError, match="lossless or quantized"):
        llm.plan(64, llm.resolve_method("quest,kv_budget=32"))
    with pytest.raises(ConfigError, match="--cpu-attention"):
        LLM(str(gqa_folder), device="cpu", cpu_attention="most")


def test_plan_cli_shows_the_split(capsys: pytest.CaptureFixture[str]) -> None:
    base = ["plan", "--model", "llama-3-8b", "--context", "512K", "--gpu", "h200", "--gpu-memory", "24GB"]
    assert cli_main([*base, "--cpu-attention", "20"]) == 0
    assert "cpu attention (20): 20/118 streamed slices on the CPU at decode" in capsys.readouterr().out
    assert cli_main([*base, "--cpu-attention", "off", "--json"]) == 0
    assert '"cpu_slices": 0' in capsys.readouterr().out
    assert cli_main([*base, "--cpu-attention", "several"]) == 2
    assert "--cpu-attention 'several': use auto, off or a number of slices" in capsys.readouterr().err
