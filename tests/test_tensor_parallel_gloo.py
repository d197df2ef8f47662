"""Tensor parallelism over 2 processes on the CPU (gloo), on a tiny random Llama: the tokens of
every lossless placement equal one process's, whether rank 0 starts the other rank itself
(`LLM(tensor_parallel=2)`, which `kvtier generate --tensor-parallel 2` builds) or both are
started as torchrun starts them (its environment, running `kvtier generate` and the model)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import socket
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from kvtier.cli.main import main
from kvtier.config import ModelConfig
from kvtier.engine.llm import LLM
from kvtier.engine.sampling import SamplingParams
from kvtier.errors import CapacityError, ConfigError, KvtierError
from kvtier.kv.store import TieredKVStore
from kvtier.loading.weights import load_safetensors_folder
from kvtier.planner.hardware import detect_hardware
from kvtier.planner.memory import GPU_RESERVE_BYTES
from kvtier.planner.placement import plan_kv
from kvtier.planner.sharding import rank_config, stage_config
from tests.hf_reference import drive, make_hf_model

CHUNK = 16  # prefill chunk: the prompts take 2-3 chunks
BLOCK = 16  # KV block: a 47-token context is 3 blocks, so staging can hold less than a slice


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(1, 211, (n,), generator=g).tolist() for n in (37, 20)]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path: Path = tmp_path_factory.mktemp("mha")
    make_hf_model("llama-mha", path)  # 3 layers, 4 query and 4 KV heads (2 per rank), d=16, vocab 211
    return path


def rank0_config(folder: Path, mode: str) -> ModelConfig:
    """Rank 0's config of 2 ranks: a tensor-parallel shard, or the first pipeline stage."""
    cfg = load_safetensors_folder(folder, torch.device("cpu"), torch.float32)[1]
    return rank_config(cfg, 2) if mode == "tensor" else stage_config(cfg, 2, 0)


def streaming_budget(cfg: ModelConfig, context: int) -> int:
    """A --gpu-memory under which a rank of config `cfg` fits `layer` and `head` plans and its
    `auto` plan keeps some slices resident and streams the others (found by the planner)."""
    kw: dict[str, Any] = {
        "dtype_bytes": 4,
        "chunk_size": CHUNK,
        "block_size": BLOCK,
        "hardware": detect_hardware(torch.device("cpu")),
    }
    budget = GPU_RESERVE_BYTES
    while True:
        budget += 512
        try:
            plan_kv(cfg, context, policy="layer", gpu_budget=budget, **kw)
            plan = plan_kv(cfg, context, policy="auto", gpu_budget=budget, **kw)
        except CapacityError:
            continue
        if plan.streamed_slices and plan.resident_slices:
            return budget


@pytest.mark.parametrize("mode", ["tensor", "pipeline"])
def test_rank_0_starts_the_other_rank_and_every_placement_gives_one_process_tokens(
    folder: Path, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    """Under a --gpu-memory that makes rank 0's `auto` plan stream part of its KV, `layer`,
    `head` and `auto` give one process's tokens (greedy, and sampled: one rank's token is used),
    over 2 tensor-parallel ranks and over 2 pipeline stages; `gpu` does not fit that budget,
    fails on both ranks alike, and the ranks go on; a failure inside the model stops them."""
    greedy, sampled = SamplingParams(max_tokens=10), SamplingParams(max_tokens=10, temperature=1.0, seed=3)
    cfg = rank0_config(folder, mode)
    budget = streaming_budget(cfg, 37 + 10)
    one = LLM(str(folder), device="cpu", chunk_size=CHUNK, block_size=BLOCK)
    expected = [[one.generate(p, params)[0].token_ids for p in prompts()] for params in (greedy, sampled)]
    assert len(set(expected[1][0])) > 3  # sampled tokens vary, so the broadcast token matters
    ranks: dict[str, Any] = {f"{mode}_parallel": 2}
    llm = LLM(str(folder), device="cpu", chunk_size=CHUNK, block_size=BLOCK, gpu_memory=budget, **ranks)
    workers = llm._workers.processes if llm._workers else []
    try:
        assert (llm.tensor_parallel, llm.pipeline_parallel) == ((2, 1) if mode == "tensor" else (1, 2))
        assert llm.is_rank0 and llm.model_config == cfg  # 2 of 4 KV heads, or 2 of 3 layers
        for method in ("layer", "head,head_group=1", "auto"):
            for params, want in zip((greedy, sampled), expected, strict=True):
                outs = llm.generate(prompts(), params, method=method)  # a list: one at a time
                assert [o.token_ids for o in outs] == want, method
        plan = llm.generate(prompts()[0], greedy)[0].stats.plan
        assert plan[f"{mode}_parallel"] == 2
        alone, ranked = (x.generate(prompts()[0], greedy, method="layer")[0].stats for x in (one, llm))
        share = cfg.num_layers * cfg.num_kv_heads / (3 * 4)  # rank 0's part of the KV heads x layers
        assert ranked.peak_bytes["host_kv"] == share * alone.peak_bytes["host_kv"] > 0
        groups = cfg.num_kv_heads // plan["group_size"]
        assert 0 < plan["resident_slices"] < plan["num_slices"] == cfg.num_layers * groups
        with pytest.raises(CapacityError, match="47 tokens need"):
            llm.generate(prompts()[0], greedy, method="gpu")
        with pytest.raises(ConfigError, match="lossless placements only"):
            llm.generate(prompts()[0], greedy, method="int8")
        # The worker met the same errors before any collective and waits for the next call.
        assert llm.generate(prompts()[1], greedy)[0].token_ids == expected[0][1]
        # Rank 0 fails inside the model, its worker then waits in a collective: no more calls
        # are sent, and close() stops the worker rather than waiting for it.
        monkeypatch.setattr(llm.model.model.layers[1].mlp, "forward", _fail)
        with pytest.raises(RuntimeError, match="injected"):
            llm.generate(prompts()[0], greedy)
        with pytest.raises(KvtierError, match="stopped after an error"):
            llm.generate(prompts()[0], greedy)
    finally:
        llm.close()
    assert [p.exitcode for p in workers] == [-15]  # terminated, not joined


def _fail(*args: Any) -> torch.Tensor:
    raise RuntimeError("injected")


TEXT_ARGS = ["--prompt", "The capital of France is", "--max-new-tokens", "8", "--device", "cpu", "--json"]


def _one_process(folder: str, ids: torch.Tensor) -> tuple[list[torch.Tensor], list[int]]:
    """Logits and greedy tokens of the whole model in one process (`drive`, 6 decode steps)."""
    whole, cfg = load_safetensors_folder(Path(folder), torch.device("cpu"), torch.float32)
    plan = plan_kv(cfg, 64, policy="gpu", gpu_budget=None, dtype_bytes=4)
    store = TieredKVStore(cfg, plan, device=torch.device("cpu"), dtype=torch.float32, capacity=64)
    return drive(whole, store, ids, CHUNK, decode=6)


def _prefill_logits(llm: LLM, plan: Any, ids: torch.Tensor) -> list[torch.Tensor]:
    """Every position's logits of `drive`'s prefill chunks of `ids`, over a store of `plan`."""
    store, _ = llm.make_store(plan, 64)
    out = []
    for s in range(0, ids.shape[0], CHUNK):
        part = ids[s : s + CHUNK]
        store.begin_step(part.shape[0])
        out.append(llm.model(part, store, logits_at=torch.arange(part.shape[0])))
        store.end_step()
    return out


def _check_tensor_parallel(llm: LLM, folder: str, ids: torch.Tensor) -> None:
    """2 tensor-parallel ranks: the placements agree bitwise, both ranks feed the same tokens,
    one process's whole model gives the same tokens and logits within 1e-5."""
    runs = {}
    for kv, group in (("gpu", None), ("layer", None), ("head", 1), ("auto", None)):
        plan = plan_kv(llm.model_config, 64, policy=kv, group_size=group, gpu_budget=None, dtype_bytes=4)
        store, _ = llm.make_store(plan, 64)
        runs[kv] = drive(llm.model, store, ids, CHUNK, decode=6)
    logits, tokens = runs["gpu"]
    for kv, (other_logits, other_tokens) in runs.items():
        assert other_tokens == tokens, kv
        assert all(torch.equal(a, b) for a, b in zip(logits, other_logits, strict=True)), kv
    assert llm.parallel is not None and llm.parallel.all_gather_object(tokens) == [tokens, tokens]
    ref_logits, ref_tokens = _one_process(folder, ids)
    assert tokens == ref_tokens
    for a, b in zip(logits, ref_logits, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def _check_pipeline(llm: LLM, folder: str, ids: torch.Tensor) -> None:
    """2 pipeline stages: the last stage's prefill logits are one process's, bit for bit (the
    same products in the same order; only the layers sit in two processes)."""
    ref_logits, ref_tokens = _one_process(folder, ids)
    for kv, group in (("gpu", None), ("layer", None), ("head", 1)):
        plan = plan_kv(llm.model_config, 64, policy=kv, group_size=group, gpu_budget=None, dtype_bytes=4)
        staged = _prefill_logits(llm, plan, ids)
        if llm.parallel is not None and llm.parallel.rank == 1:
            prefill = ref_logits[: -len(ref_tokens)]
            assert all(torch.equal(a, b) for a, b in zip(staged, prefill, strict=True)), (folder, kv)


def _torchrun_rank(
    rank: int, ports: list[int], runs: list[tuple[str, str]], text_model: str, results: Any
) -> None:
    """One of 2 ranks started as torchrun starts them (its environment): `kvtier generate` as
    torchrun runs it, then for each (mode, folder) of `runs` the logits over the rank's own
    stores, as 2 tensor-parallel ranks or 2 pipeline stages."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1")
    try:
        os.environ["MASTER_PORT"] = str(ports[0])
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            assert main(["generate", "--model", text_model, *TEXT_ARGS]) == 0
        ids = torch.tensor(prompts()[0])
        for port, (mode, folder) in zip(ports[1:], runs, strict=True):
            os.environ["MASTER_PORT"] = str(port)
            llm = LLM(folder, device="cpu", **{f"{mode}_parallel": 2})  # joins the 2 ranks
            (_check_tensor_parallel if mode == "tensor" else _check_pipeline)(llm, folder, ids)
            llm.close()
        results.put((rank, printed.getvalue(), None))
    except BaseException as e:
        results.put((rank, "", f"{type(e).__name__}: {e}"))
        raise


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def test_ranks_started_like_torchrun_print_once_agree_bitwise_and_match_one_process(
    folder: Path, text_model: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Also over Gemma-2 (sliding-window layers, soft-caps; its stage 1 starts at an odd layer)
    and, as pipeline stages only, DeepSeek-V2 (latent attention, MoE after a dense layer)."""
    for family in ("gemma2", "deepseek-v2"):
        make_hf_model(family, tmp_path / family)
    runs = [("tensor", str(folder)), ("tensor", str(tmp_path / "gemma2"))]
    runs += [("pipeline", str(f)) for f in (folder, tmp_path / "gemma2", tmp_path / "deepseek-v2")]
    assert main(["generate", "--model", str(text_model), *TEXT_ARGS]) == 0
    one = json.loads(capsys.readouterr().out)
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    ports = [_free_port() for _ in range(1 + len(runs))]
    args = (ports, runs, str(text_model), results)
    procs = [ctx.Process(target=_torchrun_rank, args=(r, *args)) for r in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(300)
    got = sorted(results.get() for _ in procs)
    assert [error for _, _, error in got] == [None, None]
    assert [p.exitcode for p in procs] == [0, 0]
    (_, rank0, _), (_, rank1, _) = got
    assert rank1 == ""  # rank 0 alone prints
    two = json.loads(rank0)
    assert (two["text"], two["token_ids"]) == (one["text"], one["token_ids"])
    assert two["stats"]["plan"]["tensor_parallel"] == 2


@pytest.fixture(scope="module")
def text_model(tmp_path_factory: pytest.TempPathFactory, embedded_hf_dir: Path) -> Path:
    """A tiny random Llama with the embedded model's tokenizer (so `generate` takes text): 2 layers,
    4 query and 2 KV heads (1 per rank), vocab 49152."""
    import transformers

    path: Path = tmp_path_factory.mktemp("text")
    cfg = transformers.LlamaConfig(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
        vocab_size=49152,
        intermediate_size=96,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(embedded_hf_dir / name, path)
    return path
