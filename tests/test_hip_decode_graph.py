"""`kvtier.sparse.decode_graph`: a layer's cached HiP decode step from static tensors, the body a
CUDA graph replays (`KVTIER_HIP_GRAPHS=1`), against `step_buffers`'s Triton path it stands in for.

Without CUDA the body runs eagerly on CPU tensors under Triton's interpreter (see
tests/triton_interpreter.py); capture and replay themselves need a GPU (bench/gpu_checks.py).
"""

from __future__ import annotations

import sys
from typing import Any, cast

import pytest
import torch

from tests.triton_interpreter import DEVICES, NEEDS_TRITON, SUBPROCESS_ONLY, run_cpu_cases

CPU = [p for p in DEVICES if p.values[0] == "cpu"]

pytestmark = NEEDS_TRITON

from kvtier.config import ModelConfig  # noqa: E402
from kvtier.model.llama import CausalLM  # noqa: E402
from kvtier.sparse import cached_decode, decode_buffer, decode_graph  # noqa: E402
from kvtier.sparse.decode_graph import LayerGraphs  # noqa: E402
from kvtier.sparse.gpu_cache import BlockCache  # noqa: E402
from kvtier.sparse.graph_recorders import ReplayRecorder  # noqa: E402
from kvtier.sparse.opcount import OpCounter  # noqa: E402
from tests.hip_store import REFRESH0, TINY, assert_same, kernel_for, run  # noqa: E402


@pytest.mark.parametrize("device", CPU)
@pytest.mark.parametrize("probes", [False, True])
def test_layer_steps_through_the_graph_bodies_decode_as_before(
    gqa: tuple[CausalLM, ModelConfig], device: str, probes: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Head-wise streamed slices (two a layer): decode steps that rerun nothing and (with
    probes) those that rerun a layer's stages 1.. in one batch, through the graphs' bodies
    (position, window start and META read from one device tensor, rows appended by a device
    index, the buffers' prefixes rewritten in place): the logits are bitwise those of the eager
    steps (`step_buffers`'s Triton path, `_refresh_layer`), the caches and buffers end where
    they did, and every step the bodies take ran through them."""
    for module in (decode_buffer, cached_decode):  # the Triton path on CPU tensors, both runs
        monkeypatch.setattr(module, "buffer_kernel", lambda q: True)
    model, cfg = gqa
    opts: dict[str, object] = {"refresh": (REFRESH0, 3, 2)}
    if probes:
        opts |= {"probe_scoring": True, "host_scoring": True}
    ref = kernel_for(cfg, **opts)
    assert ref._graphs is None
    fast: list[int] = []  # positions of the layer steps that ran `step_buffers`: rerun nothing
    step_buffers = cached_decode.step_buffers

    def counted(bufs: object, q: object, rows: object, position: int, rotary: object) -> torch.Tensor:
        fast.append(position)
        return step_buffers(bufs, q, rows, position, rotary)  # type: ignore[arg-type]

    monkeypatch.setattr(cached_decode, "step_buffers", counted)
    reruns: list[tuple[int, int]] = []  # (position, first stage) of the layer steps that rerun stages 1..
    refresh = cached_decode.CachedDecode._refresh_layer

    def counted_rerun(self: cached_decode.CachedDecode, *args: object) -> torch.Tensor:
        reruns.append((args[2][0].start, args[-1]))  # type: ignore[index]
        return refresh(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(cached_decode.CachedDecode, "_refresh_layer", counted_rerun)
    ref_logits, ref_tokens, _, _ = run(model, cfg, "head", ref)
    fast, ref_fast = [], fast
    ref_reruns, reruns = reruns, []
    monkeypatch.setenv("KVTIER_HIP_GRAPHS", "1")
    graphed = kernel_for(cfg, **opts)
    assert graphed._graphs is not None
    # what a capture records must not wait for the device: no body reads a value back
    in_bodies: list[OpCounter] = []
    read_back: list[str] = []  # `tolist` runs no aten operator on a CPU tensor: watched apart
    at: list[tuple[str, int]] = []  # (body, position) of every body run
    for name in ("_cached_body", "_rerun_body"):
        body = getattr(decode_graph, name)

        def counted_body(*args: object, _body: Any = body, _name: str = name) -> Any:
            at.append((_name, int(cast(Any, args[0]).inputs[0])))  # before: the op count sees no read
            with OpCounter() as ops:
                out = _body(*args)
            in_bodies.append(ops)
            return out

        monkeypatch.setattr(decode_graph, name, counted_body)
    tolist = torch.Tensor.tolist

    def watched(t: torch.Tensor) -> Any:
        frame = sys._getframe(1)
        while frame is not None and not frame.f_code.co_name.endswith("_body"):
            frame = frame.f_back  # type: ignore[assignment]
        if frame is not None:
            read_back.append(frame.f_code.co_name)
        return tolist(t)

    monkeypatch.setattr(torch.Tensor, "tolist", watched)
    logits, tokens, _, _ = run(model, cfg, "head", graphed)
    monkeypatch.setattr(torch.Tensor, "tolist", tolist)
    assert in_bodies and all(ops.sync_total == 0 and ops.total > 0 for ops in in_bodies)
    assert not read_back
    assert tokens == ref_tokens
    assert_same(logits, ref_logits)
    assert graphed.stats.cache == ref.stats.cache
    assert graphed.stats.decode_recomputes == ref.stats.decode_recomputes
    for key, st in graphed._cache.items():
        mine, theirs = st.attn, ref._cache[key].attn
        assert (mine.length, mine.end, mine.n_prefix) == (theirs.length, theirs.end, theirs.n_prefix)
        assert mine.k is not None and theirs.k is not None
        assert torch.equal(mine.k[: mine.length], theirs.k[: theirs.length])
    for key, cache in graphed._gpu.items():
        theirs = ref._gpu[key]
        assert cache.end == theirs.end and torch.equal(cache.ids, theirs.ids)
        for slot, block in enumerate(cache.ids.tolist()):  # every row of a position it holds
            n = min(cache.block, cache.end - block * cache.block) if block >= 0 else 0
            assert torch.equal(cache.bank[slot, :n], theirs.bank[slot, :n])
    # every such step ran a body, those that start a cache block (of 4 tokens) too (the block
    # taken on the host first): the cached steps' and, with probes (which rerun a layer's
    # stages 1.. in one batch), the reruns'
    block = cast(int, TINY["cache_block"])
    steps = graphed._graphs.steps
    assert steps[0] == len(ref_fast) > 0 and fast == []
    assert any(p % block == 0 for p in ref_fast)
    # the same layer steps reran the same stages, through the graphs' bodies but where the
    # slices' selections differ in size (partial chunks of this tiny context)
    assert reruns == ref_reruns and bool(ref_reruns) == probes
    assert steps[1] + steps[2] <= len(ref_reruns)
    assert (steps[1] > 0 and steps[2] > 0) == probes
    assert graphed._graphs.eager == sum(steps.values())
    assert graphed._graphs.captures == 0  # CPU tensors: the body runs, nothing is captured
    # every layer step offered to the graphs ran a body or was declined, counted by why
    declined = graphed._graphs.declined
    assert sum(n for why, n in declined.items() if why.startswith("cached:")) == len(fast)
    assert not any("not at the position" in why for why in declined), declined
    reran_eagerly = sum(n for why, n in declined.items() if why.startswith("stage"))
    # steps at a block's first position ran through the bodies too
    assert any(name == "_cached_body" and p % block == 0 for name, p in at)
    assert any(name == "_rerun_body" and p % block == 0 for name, p in at) == probes
    assert steps[1] + steps[2] + reran_eagerly == len(ref_reruns)
    assert graphed.counters()["decode_graphs"].get("declined") == (dict(sorted(declined.items())) or None)  # type: ignore[attr-defined]


@pytest.mark.parametrize("device", CPU)
def test_graphs_recorded_once_and_replayed_decode_as_before(
    gqa: tuple[CausalLM, ModelConfig], device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The graphs replayed as a recording would (`ReplayRecorder`: each body's host values those
    of the step it was recorded at): the logits bitwise the eager ones, each layer's graph of a
    kind recorded once (what it baked in stays put: banks, tail slots, slot tables, buffers, the
    RoPE table) and replayed at every step that took it."""
    for module in (decode_buffer, cached_decode):
        monkeypatch.setattr(module, "buffer_kernel", lambda q: True)
    model, cfg = gqa
    opts: dict[str, object] = {"refresh": (REFRESH0, 3, 2), "probe_scoring": True, "host_scoring": True}
    ref_logits, ref_tokens, _, _ = run(model, cfg, "head", kernel_for(cfg, **opts))
    monkeypatch.setenv("KVTIER_HIP_GRAPHS", "1")
    graphed = kernel_for(cfg, **opts)
    graphs = cast(LayerGraphs, graphed._graphs)
    graphs.recorder = ReplayRecorder()
    logits, tokens, _, _ = run(model, cfg, "head", graphed)
    assert tokens == ref_tokens
    assert_same(logits, ref_logits)
    assert graphs.eager == 0 and graphs.replays == sum(graphs.steps.values())
    assert graphs.steps[0] and graphs.steps[1] and graphs.steps[2]
    # one recording a layer and kind (3 layers x cached, from stage 1, from stage 2), each replayed on
    assert set(graphs._made.values()) == {1} and graphs.captures == len(graphs._made) == 9


def test_append_at_writes_the_row_append_writes() -> None:
    """`BlockCache.append_at` (a device position) writes the row where `append` does, and the
    tail stays one tensor however often a block starts."""
    a, b = (BlockCache(4, 4, (2, 1, 8), torch.float32, torch.device("cpu")) for _ in range(2))
    a.bank.zero_()
    b.bank.zero_()
    assert a.tail is None
    rows = torch.randn(10, 2, 1, 8)
    for p in range(10):
        a.append(p, rows[p])
        if p % 4:
            b.append_at(torch.tensor([p]), rows[p])
            b.advance(p)
        else:
            b.append(p, rows[p])
    assert a.tail is a._tail and b.tail is b._tail  # one tensor for the cache's life
    assert torch.equal(a.bank, b.bank) and a.end == b.end == 10
    with pytest.raises(AssertionError):
        b.advance(12)  # not the next position


def test_a_layer_whose_graphs_keep_changing_runs_as_before() -> None:
    """Graphs made 8 times for a layer and kind, replayed under 4 times each on average: that
    layer's steps of that kind stop taking graphs (a capture costs more than it saves); others,
    and a steady one, go on."""
    graphs = LayerGraphs()
    graphs._made[(3, 0)], graphs._used[(3, 0)] = 8, 31
    graphs._made[(3, 2)], graphs._used[(3, 2)] = 8, 32
    graphs._made[(4, 0)], graphs._used[(4, 0)] = 7, 0
    assert graphs._unsteady((3, 0))
    assert not graphs._unsteady((3, 2)) and not graphs._unsteady((4, 0)) and not graphs._unsteady((5, 1))


@SUBPROCESS_ONLY
def test_cpu_cases_in_subprocess() -> None:
    """triton.language was imported before TRITON_INTERPRET was set (by torch, while collecting
    other modules): run this file's CPU cases in a fresh interpreter-mode process."""
    run_cpu_cases(__file__)
