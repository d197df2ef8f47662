"""InfiniteHiP sparse attention (kvtier.sparse): exact when budgets cover the context, block-sparse
attention equal to a masked dense reference, decode refresh intervals, config validation."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from kvtier.attention.dense import attend
from kvtier.attention.interface import DenseKernel, SliceKernel, SliceStep
from kvtier.config import ModelConfig, RopeConfig
from kvtier.errors import ConfigError
from kvtier.kv.store import StoreOptions, TieredKVStore
from kvtier.loading.weights import load_safetensors_folder
from kvtier.model.llama import CausalLM
from kvtier.model.rope import Rotary
from kvtier.planner.placement import KVPlan
from kvtier.sparse import HIP_PRESETS, HipConfig, HipKernel, make_hip_kernel
from kvtier.sparse.block_sparse import attend_block, attend_block_reference, masked_dense_attention
from kvtier.sparse.pruning import prune_stage
from kvtier.sparse.rope_ext import attention_key_positions, rotate
from tests.hf_reference import drive, make_hf_model

CPU = torch.device("cpu")
D = 16
# Small stages; budgets far above the test contexts, so nothing is pruned.
COVER = {
    "sink": 4,
    "window": 16,
    "block_q": 8,
    "chunk_sizes": (32, 8, 2),
    "budgets": (4096, 2048, 1024),
    "wide_budget": 1024,
}
# Same stages, budgets that prune a 200-token context.
SPARSE = {**COVER, "budgets": (96, 32, 16), "wide_budget": 24}


def tensors(s: int, t: int, g: int = 2, r: int = 2, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(t, g * r, D, generator=gen), torch.randn(s, 2, g, D, generator=gen)


def rotated(rot: Rotary, q: torch.Tensor, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What the store would have handed a dense kernel: q and K rotated at true positions."""
    s, t = kv.shape[0], q.shape[0]
    kvr = kv.clone()
    kvr[:, 0] = rotate(rot, kv[:, 0], torch.arange(s))
    return rotate(rot, q, torch.arange(s - t, s)), kvr


@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("t", [1, 37])
def test_budgets_covering_context_are_exactly_dense(per_head: bool, t: int) -> None:
    q, kv = tensors(200, t)
    kernel = HipKernel(HipConfig(**COVER, extend=False, per_head=per_head))  # type: ignore[arg-type]
    out = kernel(q, kv, SliceStep(4, 0, 200 - t))
    assert torch.allclose(out, attend(q, kv), rtol=0, atol=1e-6)


def test_first_prefill_chunk_with_blocks_inside_the_sinks_is_dense() -> None:
    q, kv = tensors(40, 40)
    kernel = HipKernel(HipConfig(**{**COVER, "sink": 20}, extend=False))  # type: ignore[arg-type]
    out = kernel(q, kv, SliceStep(0, 0, 0))  # blocks 0-7 and 8-15 lie wholly in the sinks
    assert torch.allclose(out, attend(q, kv), rtol=0, atol=1e-6)


@pytest.mark.parametrize("sink", [4, 20])  # 20: blocks that end among the sinks
@pytest.mark.parametrize("extend", [False, True])
@pytest.mark.parametrize("head_score", ["max", "softmax"])
@pytest.mark.parametrize("start", [0, 3, 100])  # 0, 3: the chunk begins among the sinks
def test_prefill_chunk_prunes_its_blocks_together_as_each_alone(
    head_score: str, start: int, extend: bool, sink: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prefill chunk's blocks are pruned in one batch, also a short last block and blocks
    that begin among the sinks (a short prompt's only chunk): the output equals each block
    pruned alone (`run_stages`, the stages decode runs) and attended by the torch reference,
    under pruning budgets, with context extension's rotations or without."""
    from kvtier.sparse import kernel as kernel_module

    gen = torch.Generator().manual_seed(1)
    s = 220 if start < 100 else 303
    q, kv = torch.randn(s - start, 4, D, generator=gen), torch.randn(s, 2, 2, D, generator=gen)
    assert q.shape[0] % 8, "the chunk should end in a short block"
    cfg = HipConfig(**{**SPARSE, "sink": sink}, extend=extend, head_score=head_score)  # type: ignore[arg-type]
    rot = Rotary(RopeConfig(), D) if extend else None
    calls: list[int] = []
    real = kernel_module.prune_whole_blocks

    def counted(*args: object, **kwargs: object) -> object:
        calls.append(1)
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(kernel_module, "prune_whole_blocks", counted)
    batched = HipKernel(cfg, rot)(q, kv, SliceStep(5, 0, start))
    assert calls == [1], "the chunk's blocks were not pruned in one batch"
    # Reference: each block selected alone by `run_stages`, attended by the torch reference.
    ref = HipKernel(cfg, rot)
    parts: list[torch.Tensor] = []
    for b in range(0, q.shape[0], cfg.block_q):
        e = min(b + cfg.block_q, q.shape[0])
        w0 = ref._window_start(start + b)
        pos = torch.arange(start + b, start + e)
        sel = ref._stages(q[b:e], pos, kv, 5, ref._middle(w0, q.device), 0)[-1]
        prefix = torch.cat((torch.arange(min(cfg.sink, start + e)), sel))
        parts.append(
            attend_block_reference(q[b:e], pos, kv, prefix, w0, rotary=ref.rotary, mode=cfg.attention_rope)
        )
    assert torch.allclose(batched, torch.cat(parts), rtol=0, atol=1e-5)


@pytest.mark.parametrize("t", [1, 37])
def test_streaming_positions_are_true_positions_when_nothing_is_pruned(t: int) -> None:
    rot = Rotary(RopeConfig(), D)
    q, kv = tensors(200, t)
    kernel = HipKernel(HipConfig(**COVER), rot)  # type: ignore[arg-type]
    out = kernel(q, kv, SliceStep(4, 0, 200 - t))  # un-rotated in, rotated inside
    assert torch.allclose(out, attend(*rotated(rot, q, kv)), rtol=0, atol=1e-5)


def test_block_sparse_equals_masked_dense_reference() -> None:
    q, kv = tensors(120, 10)
    pos = torch.arange(110, 120)
    prefix = torch.tensor([0, 1, 2, 3, 17, 18, 40, 41, 42, 43, 90])  # sinks + selected
    w0 = 96
    out = attend_block(q, pos, kv, prefix, w0)
    allowed = torch.zeros(10, 120, dtype=torch.bool)
    allowed[:, prefix] = True
    allowed[:, w0:] = True
    allowed &= torch.arange(120)[None, :] <= pos[:, None]
    assert torch.allclose(out, masked_dense_attention(q, kv, allowed), rtol=0, atol=1e-6)


def test_kernel_output_equals_masked_dense_over_its_selection() -> None:
    q, kv = tensors(200, 1)
    kernel = HipKernel(HipConfig(**SPARSE, extend=False))  # type: ignore[arg-type]
    out = kernel(q, kv, SliceStep(5, 0, 199))
    st = kernel._cache[(5, 0, -1)]
    sel = st.outputs[-1]
    assert sel.numel() == 16 and torch.all((sel >= 4) & (sel < st.window_start))
    allowed = torch.zeros(1, 200, dtype=torch.bool)
    allowed[0, :4] = allowed[0, sel] = allowed[0, st.window_start :] = True
    assert torch.allclose(out, masked_dense_attention(q, kv, allowed), rtol=0, atol=1e-6)


@pytest.mark.parametrize("head_score", ["max", "softmax"])
def test_pruning_keeps_the_chunk_holding_a_planted_key(head_score: str) -> None:
    gen = torch.Generator().manual_seed(1)
    keys = torch.randn(512, 1, D, generator=gen) * 0.1  # [S, G, D]
    q = torch.randn(4, 2, D, generator=gen)
    keys[300, 0] = q.mean((0, 1)) * 20  # one key every query attends strongly
    kept = prune_stage(
        q,
        torch.arange(4),
        keys,
        torch.arange(8, 480),
        32,
        64,
        mode="absolute",
        rotary=None,
        window=16,
        head_score=head_score,
    )
    assert kept.numel() == 64 and bool((kept == 300).any())
    assert torch.equal(kept, kept.sort().values)


def test_softmax_head_score_keeps_a_chunk_only_a_small_logit_head_prefers() -> None:
    keys = torch.zeros(200, 1, D)
    keys[:, 0, 0] = 1.0
    keys[50, 0, 1] = 20.0  # chunk 5 (candidates from 8, chunks of 8), probed by the bisection
    q = torch.zeros(1, 2, D)
    q[0, 0, 0] = 50.0  # head A: large, equal logits everywhere
    q[0, 1, 1] = 1.0  # head B: small logits, singles out position 50
    kept = prune_stage(
        q,
        torch.tensor([199]),
        keys,
        torch.arange(8, 136),
        8,
        8,
        mode="absolute",
        rotary=None,
        window=16,
        head_score="softmax",
    )
    assert kept.tolist() == list(range(48, 56))


def test_streaming_positions_pack_sinks_and_selection_below_the_window() -> None:
    prefix = torch.tensor([0, 1, 50, 51, 90])
    pos = attention_key_positions("streaming", prefix, 1000, 1004)
    assert pos.tolist() == [995, 996, 997, 998, 999, 1000, 1001, 1002, 1003]


def test_decode_refresh_intervals_are_honoured() -> None:
    cfg = HipConfig(**{**SPARSE, "refresh": (4, 2, 1)}, extend=False)  # type: ignore[arg-type]
    kernel = HipKernel(cfg)
    q, kv = tensors(220, 1)
    for i in range(10):  # 10 decode steps over contexts 201 .. 210
        for layer in range(3):
            kernel(q, kv[: 201 + i], SliceStep(layer, 0, 200 + i))
    # Stage i recomputes at steps 0, r_i, 2 r_i, ...: ceil(10 / r_i) times per slice, 3 slices.
    assert kernel.stats.decode_recomputes == [3 * 3, 3 * 5, 3 * 10]


def test_decode_before_the_first_stage_0_rerun_does_not_depend_on_its_interval() -> None:
    """`lean` reruns stage 0 every 32 decode steps where its quality runs used 16: the steps
    before the earlier rerun attend the same keys, and the outputs part only at that rerun
    (the window there leaves keys to stage 0, which its budget prunes)."""
    q, kv = tensors(400, 1)
    outs = []
    for every in (4, 8):
        kernel = HipKernel(HipConfig(**{**SPARSE, "refresh": (every, 2, 1)}, extend=False))  # type: ignore[arg-type]
        outs.append([kernel(q, kv[: 301 + i], SliceStep(0, 0, 300 + i)) for i in range(8)])
    assert all(torch.equal(a, b) for a, b in zip(outs[0][:4], outs[1][:4], strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(outs[0][4:], outs[1][4:], strict=True))


def test_flash_preset_refreshes_stage_one_every_96_steps() -> None:
    cfg = ModelConfig(64, 64, 96, 1, 4, 2, D, 512)
    kernel, unrotated = make_hip_kernel(
        cfg,
        CPU,
        "flash",
        sink=4,
        window=16,
        block_q=8,
        chunk_sizes=(32, 8, 2),
        budgets=(96, 32, 16),
        wide_budget=16,
    )
    assert unrotated and isinstance(kernel, HipKernel)
    q, kv = tensors(400, 1)
    for i in range(100):
        kernel(q, kv[: 201 + i], SliceStep(0, 0, 200 + i))
    assert kernel.stats.decode_recomputes == [2, 5, 13]


@pytest.mark.parametrize(
    "kwargs,name",
    [
        ({"window": 0}, "window"),
        ({"window": -5}, "window"),
        ({"chunk_sizes": (), "budgets": (), "query_strides": (), "refresh": ()}, "chunk"),
        ({"budgets": (8192, 8192, 2048)}, "budgets"),
        ({"budgets": (32768, 8192, 16384)}, "budgets"),
        ({"chunk_sizes": (256, 48, 8)}, "chunk_sizes"),
        ({"chunk_sizes": (32, 256, 8)}, "chunk_sizes"),
        ({"budgets": (32768, 8192, 2044)}, "budgets"),
        ({"refresh": (16, 0, 4)}, "refresh"),
        ({"refresh": (16, 8)}, "refresh"),
        ({"max_context": 1024}, "window"),
        ({"wide_budget": 1024}, "wide_budget"),
        ({"pruning_rope": "ntk"}, "pruning_rope"),
        ({"head_score": "mean"}, "head_score"),
    ],
)
def test_contradictory_configs_are_rejected(kwargs: dict[str, object], name: str) -> None:
    with pytest.raises(ConfigError, match=name):
        HipConfig(**kwargs)  # type: ignore[arg-type]


def test_presets_and_factory_options() -> None:
    cfg = ModelConfig(64, 64, 96, 2, 4, 2, D, 512)
    assert HIP_PRESETS["flash"].refresh == (96, 24, 8) and HIP_PRESETS["fast"].refresh == (32, 16, 8)
    assert HIP_PRESETS["default"].attended_tokens == 256 + 2048 + 1024 + 64
    long = HIP_PRESETS["long"]  # the quality runs' --preset 5k --set head_score=softmax window=2048
    assert long == replace(HIP_PRESETS["5k"], head_score="softmax", window=2048)
    lean = HIP_PRESETS["lean"]  # long's scores, finer chunks after the first stage, fewer keys
    assert lean.attended_tokens == 256 + 2048 + 1024 + 64 < long.attended_tokens
    sizes = {"chunk_sizes": (256, 16, 8), "budgets": (32768, 16384, 2048), "window": 1024}
    want = replace(long, **sizes, refresh=(128, 8, 4))  # type: ignore[arg-type]
    assert lean == want
    _, unrotated = make_hip_kernel(cfg, CPU, "default", extend=False)
    assert not unrotated
    with pytest.raises(ConfigError, match="preset"):
        make_hip_kernel(cfg, CPU, "turbo")
    with pytest.raises(ConfigError, match="windw"):
        make_hip_kernel(cfg, CPU, windw=3)
    for ctx in (64, 300, 2048, 4096, 16384, 65536, 131072, 1 << 20):
        HipConfig.scaled(ctx, max_context=ctx)  # valid at every size


# -- through the tiered store, with a model ---------------------------------------------------

PROMPT, DECODE = 45, 9


@pytest.fixture(scope="module")
def gqa(tmp_path_factory: pytest.TempPathFactory) -> tuple[CausalLM, ModelConfig]:
    folder: Path = tmp_path_factory.mktemp("gqa")
    make_hf_model("llama-gqa", folder)  # 3 layers, 4 q heads, 2 KV heads
    return load_safetensors_folder(folder, CPU, torch.float32)


def run(
    model: CausalLM, cfg: ModelConfig, kernel: SliceKernel, rotate_keys: bool
) -> tuple[list[torch.Tensor], list[int]]:
    ids = torch.randint(0, cfg.vocab_size, (PROMPT,), generator=torch.Generator().manual_seed(7))
    p = KVPlan(
        policy="gpu", group_size=1, resident_slices=6, chunk_size=11, staging_buffers=0, staging_tokens=0
    )
    store = TieredKVStore(
        cfg,
        p,
        device=CPU,
        dtype=torch.float32,
        capacity=PROMPT + DECODE,
        options=StoreOptions(block_size=5),
        kernel=kernel,
        rotate_keys=rotate_keys,
    )
    logits, tokens = drive(model, store, ids, p.chunk_size, DECODE)
    return logits, tokens


SMALL: dict[str, object] = {
    "sink": 2,
    "window": 6,
    "block_q": 4,
    "chunk_sizes": (8, 4, 2),
    "query_strides": (2, 2, 1),
}


@pytest.mark.parametrize("extend", [False, True])
def test_store_run_with_covering_budgets_matches_dense(
    gqa: tuple[CausalLM, ModelConfig], extend: bool
) -> None:
    model, cfg = gqa
    ref_logits, ref_tokens = run(model, cfg, DenseKernel(), True)
    kernel, unrotated = make_hip_kernel(
        cfg, CPU, "default", **SMALL, budgets=(256, 128, 64), wide_budget=64, extend=extend
    )
    logits, tokens = run(model, cfg, kernel, not unrotated)
    assert tokens == ref_tokens
    tol = 1e-4 if extend else 1e-5  # extend: RoPE applied in the kernel, a different rounding order
    for a, b in zip(logits, ref_logits, strict=True):
        assert torch.allclose(a, b, rtol=tol, atol=tol)


def test_store_run_with_pruning_attends_fewer_keys(gqa: tuple[CausalLM, ModelConfig]) -> None:
    model, cfg = gqa
    kernel, unrotated = make_hip_kernel(
        cfg, CPU, "default", **SMALL, budgets=(16, 8, 4), wide_budget=4, wide_layers=()
    )
    logits, tokens = run(model, cfg, kernel, not unrotated)
    assert len(tokens) == DECODE and all(torch.isfinite(x).all() for x in logits)
    assert isinstance(kernel, HipKernel)
    # Per query block: at most sink 2 + selected 4 + window 6 + block 4 - 1 keys.
    assert kernel.stats.attended_keys <= kernel.stats.prefill_blocks * 15


@pytest.mark.parametrize("first_chunk", [8, 32])
def test_a_first_stage_whose_budget_covers_the_middle_changes_nothing(
    gqa: tuple[CausalLM, ModelConfig], first_chunk: int
) -> None:
    """`lean`'s measured quality (contexts up to 32K, where its 32K first-stage budget keeps every
    candidate) holds for any first-stage chunk: a stage that keeps all never scores, so the logits
    are those of chunk 4 in the same place, bit for bit, while the later stages do prune."""
    model, cfg = gqa
    options: dict[str, object] = {**SMALL, "budgets": (64, 8, 4), "wide_budget": 4, "wide_layers": ()}
    options["head_score"] = "softmax"
    base, unrotated = make_hip_kernel(cfg, CPU, "default", **{**options, "chunk_sizes": (4, 2, 1)})
    ref_logits, ref_tokens = run(model, cfg, base, not unrotated)
    kernel, _ = make_hip_kernel(cfg, CPU, "default", **{**options, "chunk_sizes": (first_chunk, 2, 1)})
    logits, tokens = run(model, cfg, kernel, not unrotated)
    assert tokens == ref_tokens
    assert all(torch.equal(a, b) for a, b in zip(logits, ref_logits, strict=True))
    assert isinstance(kernel, HipKernel) and PROMPT + DECODE - 2 - 6 < 64  # stage 0 keeps all
    assert kernel.stats.attended_keys < kernel.stats.prefill_blocks * (PROMPT - 1)  # later stages prune
