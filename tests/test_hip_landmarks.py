"""Stage 0 of HiP's prefill on landmark keys (`kvtier.sparse.landmarks`): each key's score is
the mean attention its next queries give it, each stage-0 chunk keeps its best-scored key, and
stage 0 scores a chunk by that key alone."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from kvtier.config import ModelConfig, RopeConfig
from kvtier.engine.llm import LLM
from kvtier.engine.sampling import SamplingParams
from kvtier.errors import ConfigError
from kvtier.model.llama import CausalLM
from kvtier.model.rope import Rotary
from kvtier.sparse import landmarks
from kvtier.sparse.landmarks import Landmarks, key_scores, landmark_keys, landmark_stage
from kvtier.sparse.rope_ext import RopeTable
from tests.hip_store import PROMPT as PROMPT_TOKENS
from tests.hip_store import REFRESH_BYTES, SLICES, TOKEN_BYTES, assert_same, kernel_for, run
from tests.tiny_llm import PROMPT

D = 16


@pytest.mark.parametrize("rotate", [False, True])
def test_key_scores_are_the_mean_attention_of_the_next_window_of_queries(
    rotate: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Slabs of 8 keys against a window of 16 queries (37 keys: a short last slab, windows cut
    by the chunk's end) give each key the mean of q_i . k_t over i in [t, t + 16) and the two
    query heads of its KV head, with both rotated at their positions."""
    monkeypatch.setattr(landmarks, "WINDOW", 16)
    monkeypatch.setattr(landmarks, "KEY_SCORE_BYTES", (8 + 16) * 52 * 2 * D)  # slabs of 8 keys
    monkeypatch.setattr(landmarks, "SCAN_BLOCK", 5)  # running sums in blocks, a short last one
    gen = torch.Generator().manual_seed(1)
    t, g, r, start = 37, 2, 2, 50
    q = torch.randn(t, g * r, D, generator=gen)
    k = torch.randn(t, g, D, generator=gen)
    rope = RopeTable(Rotary(RopeConfig(), D)) if rotate else None
    got = key_scores(q, k, start, rope)
    if rope is not None:
        pos = torch.arange(start, start + t)
        q, k = rope.rotate(q, pos), rope.rotate(k, pos)
    want = torch.empty(t, g)
    for j in range(t):
        qs = q[j : min(t, j + 16)].view(-1, g, r, D)  # [n, G, r, D]
        want[j] = torch.einsum("ngrd,gd->g", qs, k[j]) / (qs.shape[0] * r)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 63, 64, 65, 300])
def test_running_sums_in_blocks_are_the_exclusive_cumsum(rows: int) -> None:
    """`running_sums` (a block's own sums plus the blocks' before it) is the exclusive cumsum
    along dim 0, up to float64 rounding: row 0 zero, row t the sum of rows 0 .. t - 1."""
    x = torch.randn(rows, 3, 4, generator=torch.Generator().manual_seed(rows), dtype=torch.float64)
    got = landmarks.running_sums(x)
    assert got.shape == (rows + 1, 3, 4) and got.dtype == torch.float64
    assert not got[0].any()
    assert torch.allclose(got[1:], x.cumsum(dim=0), rtol=1e-12, atol=1e-12)


def test_landmarks_merge_prefill_chunks_as_one_and_restart_with_a_new_sequence() -> None:
    """Three prefill chunks whose ends split stage-0 chunks give each chunk the best key and
    its position that one update of the whole prompt gives; a prompt from position 0 replaces
    them; a prefill after unscored chunks (a cached prefix, decoded tokens) drops them until a
    prompt from the sinks comes."""
    gen = torch.Generator().manual_seed(2)
    scores = torch.randn(100, 2, generator=gen)
    whole = Landmarks(sink=4, chunk=8)
    whole.update(scores, 0)
    parts = Landmarks(sink=4, chunk=8)
    for a, b in ((0, 13), (13, 50), (50, 100)):
        parts.update(scores[a:b], a)
    pos = parts.positions()
    assert parts.best is not None and whole.best is not None and pos is not None
    assert torch.equal(parts.best, whole.best) and torch.equal(pos, whole.positions())
    assert pos.shape == (12, 2)  # 96 tokens past the sinks, 8 a chunk
    assert bool(((pos - 4) // 8 == torch.arange(12)[:, None]).all())  # each in its own chunk
    assert torch.equal(pos[3], 4 + 24 + scores[28:36].argmax(dim=0))
    parts.update(torch.randn(20, 2, generator=gen), 0)
    assert (p := parts.positions()) is not None and p.shape == (2, 2)
    parts.update(torch.randn(10, 2, generator=gen), 60)  # chunks 2-6 never scored: a gap
    assert parts.positions() is None
    parts.update(torch.randn(10, 2, generator=gen), 70)  # still no landmarks for them
    assert parts.positions() is None
    parts.update(torch.randn(30, 2, generator=gen), 0)  # a prompt from the sinks scores them again
    assert (p := parts.positions()) is not None and p.shape == (4, 2)


def test_landmark_stage_keeps_the_chunks_whose_landmarks_the_queries_match() -> None:
    """Each block keeps the chunks whose landmark keys score highest against its pooled rows
    (the "max" head score), as a direct top-k of those scores, and never past its candidates."""
    gen = torch.Generator().manual_seed(3)
    b, nq, g, r, chunk, first = 3, 4, 2, 2, 8, 4
    keys = torch.randn(200, g, D, generator=gen) * 0.1
    qr = torch.randn(b, nq, g, r, D, generator=gen)
    valid = torch.tensor([160, 120, 90])
    where = first + torch.arange(20)[:, None] * chunk + torch.randint(0, chunk, (20, g), generator=gen)
    planted = [2, 9, 17]  # block i's queries match chunk planted[i]'s landmark, if a candidate
    for i, j in enumerate(planted):
        keys[where[j], torch.arange(g)] = qr[i].mean(dim=(0, 2)) * 5
    kept, n = landmark_stage(
        qr, landmark_keys(keys, where, 20), where, valid, chunk, 4 * chunk, first=first, mode="relative",
        rotary=None, limit=0,
    )  # fmt: skip
    rows = torch.einsum("bngrd,cgd->bcgnr", qr, keys[where, torch.arange(g)]).flatten(2).amax(dim=2)
    for i in range(b):
        live = torch.arange(20) * chunk < valid[i]
        top = torch.topk(torch.where(live, rows[i], float("-inf")), 4).indices.sort().values
        want = (first + top[:, None] * chunk + torch.arange(chunk)).flatten()
        want = want[want < first + valid[i]]
        assert torch.equal(kept[i, : int(n[i])], want)
    assert int(kept[0].ge(first + planted[0] * chunk).sum()) > 0
    assert planted[0] in ((kept[0][kept[0] >= 0] - first) // chunk).tolist()
    assert planted[1] in ((kept[1][kept[1] >= 0] - first) // chunk).tolist()
    assert int(kept[2].max()) < first + 90  # block 2's candidates end before chunk 17


def test_store_run_with_landmarks_prunes_on_them_and_slicing_changes_nothing(
    gqa: tuple[CausalLM, ModelConfig], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A chunked prefill with stage 0 on landmarks (budgets that prune 120 tokens) scores every
    prefill chunk's keys, runs the landmark stage and decodes; resident and streamed slices give
    the same logits."""
    from kvtier.sparse import prefill

    model, cfg = gqa
    calls = _spy(monkeypatch, prefill, "landmark_stage")
    outs = []
    for policy in ("gpu", "head"):
        kernel = kernel_for(cfg, stage0_landmarks=True)
        logits, _, _, _ = run(model, cfg, policy, kernel)
        assert all(torch.isfinite(x).all() for x in logits)
        assert len(kernel._landmarks) == cfg.num_layers * cfg.num_kv_heads
        outs.append(logits)
    assert calls, "the landmark stage never ran"
    assert_same(outs[0], outs[1])
    # a kernel told its request holds 34 tokens (32 past the sinks: stage 0 would keep them all)
    short = kernel_for(cfg, stage0_landmarks=True, capacity=34)
    run(model, cfg, "gpu", short)
    assert not short._landmarks  # no key scored for a request stage 0 never prunes
    plain, _, _, _ = run(model, cfg, "gpu", kernel_for(cfg))
    assert any(not torch.equal(a, b) for a, b in zip(plain, outs[0], strict=True))  # another selection


def test_hip_landmarks_option(tiny: Path) -> None:
    """`hip,hip_landmarks=on` and `LLM(hip_landmarks=True)` set `HipConfig.stage0_landmarks` and
    say so in the description, `all` `prompt_landmarks` as well; a value other than on/all/off,
    or the option without HiP, is refused."""
    from kvtier.methods.spec import parse_choice

    cfg, cpu = LLM(str(tiny), device="cpu").model_config, torch.device("cpu")
    parts = parse_choice("hip,hip_landmarks=on").build(cfg, cpu, None, context=1 << 20)
    kernel: Any = parts.kernel
    assert kernel.cfg.stage0_landmarks and "stage 0 on landmark keys" in parts.describe
    assert not kernel.cfg.prompt_landmarks and "last token" not in parts.describe
    every: Any = parse_choice("hip,hip_landmarks=all").build(cfg, cpu, None, context=1 << 20)
    assert every.kernel.cfg.stage0_landmarks and every.kernel.cfg.prompt_landmarks
    assert "stage 0 on landmark keys (its last token's too)" in every.describe
    off: Any = parse_choice("hip,hip_landmarks=off").build(cfg, cpu, None, context=1 << 20).kernel
    assert not off.cfg.stage0_landmarks
    with pytest.raises(ConfigError, match="--hip-landmarks takes on, all or off"):
        parse_choice("hip,hip_landmarks=yes")
    with pytest.raises(ConfigError, match="--hip-landmarks applies only with"):
        parse_choice("hip_landmarks=on")
    llm = LLM(str(tiny), device="cpu", chunk_size=16, attention="hip", hip_landmarks=True)
    out = llm.generate(PROMPT, SamplingParams(max_tokens=3, ignore_eos=True))[0]
    assert out.stats.plan["method"].endswith("stage 0 on landmark keys")


@pytest.mark.parametrize("per_head", [False, True])
def test_the_first_query_after_a_prefill_scores_stage_0_on_the_prompts_landmarks(
    gqa: tuple[CausalLM, ModelConfig], monkeypatch: pytest.MonkeyPatch, per_head: bool
) -> None:
    """With `prompt_landmarks` (`--hip-landmarks all`) the decode query right after a landmark
    prefill (`Landmarks.end`) takes stage 0 from the landmark stage, once a slice (a KV head's
    with `per_head`), whether its slice is resident or streamed; a streamed one then reads only
    the landmark rows and the kept chunks, not the whole slice, and the tokens are the same
    either way. Later stage-0 reruns bisect, and without it (`on`) so does that query."""
    from kvtier.sparse import prompt_stage0

    model, cfg = gqa
    calls = _spy(monkeypatch, prompt_stage0, "landmark_stage")
    outs = {}
    for policy in ("gpu", "head"):
        calls.clear()
        kernel = kernel_for(cfg, stage0_landmarks=True, prompt_landmarks=True, per_head=per_head)
        logits, tokens, _, h2d = run(model, cfg, policy, kernel)
        slices = cfg.num_layers * cfg.num_kv_heads  # TINY's slices hold a KV head each
        assert len(calls) == slices == kernel.stats.prompt_landmarks
        assert kernel.counters()["prompt_landmarks"] == slices
        assert kernel.stats.decode_recomputes[0] == 4 * slices  # steps 0, 6, 12 and 18 rerun stage 0
        outs[policy] = (logits, tokens)
        fetched = kernel.stats.cache.fetched_bytes
    assert outs["gpu"][1] == outs["head"][1]
    assert_same(outs["gpu"][0], outs["head"][0])
    # streamed: stage-0 reruns stream whole slices (REFRESH_BYTES, as the bisection's every
    # one does), but not the first: its landmark rows (one a chunk) and the block cache's fetches
    hip = kernel.cfg
    chunks = -(-(PROMPT_TOKENS - hip.window + 1 - hip.sink) // hip.chunk_sizes[0])  # at the prompt's end
    landmark_rows = SLICES * chunks * TOKEN_BYTES
    assert h2d == REFRESH_BYTES - SLICES * PROMPT_TOKENS * TOKEN_BYTES + landmark_rows + fetched
    calls.clear()
    prefill_only = kernel_for(cfg, stage0_landmarks=True, per_head=per_head)  # `--hip-landmarks on`
    _, _, _, streamed = run(model, cfg, "head", prefill_only)
    assert not calls and prefill_only.stats.prompt_landmarks == 0 and streamed == REFRESH_BYTES
    assert "prompt_landmarks" not in prefill_only.counters()


def test_prompt_stage0_applies_to_the_query_after_the_prefill_alone() -> None:
    """`prompt_chunks` counts the chunks the query right after a prefill scores on its landmarks,
    and 0 for any other query, for a stage 0 that keeps every candidate, and without
    landmarks; `prompt_stage0` keeps the chunks whose landmark keys score highest."""
    from kvtier.sparse.config import HipConfig
    from kvtier.sparse.prompt_stage0 import prompt_chunks, prompt_stage0

    cfg = HipConfig(sink=4, window=8, block_q=4, chunk_sizes=(8, 4), budgets=(16, 8), wide_budget=8,
                    query_strides=(1, 1), refresh=(4, 2), extend=False, stage0_landmarks=True,
                    prompt_landmarks=True)  # fmt: skip
    gen = torch.Generator().manual_seed(4)
    marks = Landmarks(sink=4, chunk=8)
    marks.update(torch.randn(100, 2, generator=gen), 0)  # 12 chunks of positions 4 .. 99
    w0 = 100 - 8 + 1
    assert prompt_chunks(cfg, marks, 100, 5, w0) == 12  # (93 - 4) / 8 rounded up
    assert prompt_chunks(cfg, marks, 101, 5, w0 + 1) == 0  # a later query bisects
    assert prompt_chunks(cfg, None, 100, 5, w0) == 0
    assert prompt_chunks(cfg, marks, 100, 5, 4 + 16) == 0  # two chunks: stage 0 keeps both
    keys = torch.randn(101, 2, D, generator=gen) * 0.1
    q = torch.randn(1, 4, D, generator=gen)
    where = marks.positions()
    assert where is not None
    keys[where[7], torch.arange(2)] = q[0].view(2, 2, D).mean(dim=1) * 5  # chunk 7's landmarks match
    got = prompt_stage0(cfg, marks, q, 100, 5, w0, None, lambda at: landmark_keys(keys, at, at.shape[0]))
    assert got is not None and got.numel() == 16 and bool((got < w0).all())
    assert 4 + 7 * 8 in got.tolist()
    assert prompt_stage0(cfg, marks, q, 100, 5, w0, None, lambda at: None) is None  # unreadable: bisect
    assert prompt_chunks(replace(cfg, prompt_landmarks=False), marks, 100, 5, w0) == 0  # `on`
    with pytest.raises(ConfigError, match="prompt_landmarks needs stage0_landmarks"):
        replace(cfg, stage0_landmarks=False)


def _spy(monkeypatch: pytest.MonkeyPatch, module: Any, name: str) -> list[int]:
    """Count the calls of `module.name` (a list that grows by one a call) while it still runs."""
    calls: list[int] = []
    real = getattr(module, name)

    def spy(*a: Any, **kw: Any) -> Any:
        calls.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(module, name, spy)
    return calls
