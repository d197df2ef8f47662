"""HiP composes with a KV codec (`--attention hip --kv-quant int4`): the codec packs what the
store holds, in both tiers, and HiP's kernel reads it, as a 1M-token context needs (issue 19:
host RAM holds 768K tokens of Llama-3-8B's bf16 KV, ~3x that packed in int4)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvtier.config import ModelConfig
from kvtier.engine.llm import LLM
from kvtier.engine.sampling import SamplingParams
from kvtier.errors import ConfigError
from kvtier.loading.presets import preset_config
from kvtier.methods.spec import parse_choice
from kvtier.policies.quant import KiviCodec
from tests.hf_reference import make_hf_model


def test_hip_and_a_codec_select_both_and_other_pairs_still_refuse() -> None:
    both = parse_choice("hip,hip_preset=lean,kv_quant=int4")
    assert both.entry is not None and both.entry.name == "hip"
    assert isinstance(both.codec(), KiviCodec) and not both.lossless
    parts = both.build(make_cfg(), torch.device("cpu"), None)
    assert parts.codec is not None and parts.kernel is not None and not parts.rotate_keys
    assert parts.describe == "hip lean + kv-quant int4"
    with pytest.raises(ConfigError, match="what combines: --attention hip with --kv-quant"):
        parse_choice("quest,kv_quant=int4,kv_budget=64")
    with pytest.raises(ConfigError, match="cannot be combined"):
        parse_choice("hip,evict=h2o,kv_budget=64")


def make_cfg() -> ModelConfig:
    return preset_config("smollm2-135m")


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    folder: Path = tmp_path_factory.mktemp("gqa")
    make_hf_model("llama-gqa", folder)  # 3 layers, 4 query heads, 2 KV heads
    return LLM(str(folder), device="cpu", dtype="fp32", max_model_len=8192)


def test_hip_over_packed_kv_streams_packed_rows_with_the_tokens_of_resident_kv(llm: LLM) -> None:
    """6,000 tokens under HiP `lean` (sink 256 + 2K selected + 1K window: the middle is pruned)
    over int4 KV: offloaded head-wise (packed rows streamed, HiP's block cache fetching ranges of
    them) it gives the tokens of the same method with every slice resident."""
    ids = torch.randint(1, 211, (6000,), generator=torch.Generator().manual_seed(7)).tolist()
    params = SamplingParams(max_tokens=8)
    resident = llm.generate(ids, params, method="hip,hip_preset=lean,kv_quant=int4,kv=gpu")[0]
    streamed = llm.generate(ids, params, method="hip,hip_preset=lean,kv_quant=int4,kv=head")[0]
    alone = llm.generate(ids, params, method="hip,hip_preset=lean,kv=head")[0]
    assert streamed.stats.plan["policy"] == "head" and resident.stats.plan["policy"] == "gpu"
    assert streamed.stats.plan["method"].endswith("+ kv-quant int4")
    assert streamed.token_ids == resident.token_ids
    assert streamed.stats.plan["packed"]["row_bytes"] > 0 and alone.stats.plan["packed"] is None


def test_hip_over_int4_batches_each_prompt_over_a_store_of_its_own(llm: LLM) -> None:
    """A list of prompts under the pair runs through the batch engine (as the server runs a
    request that names it), each over its own store, with the tokens of running each alone."""
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, 211, (n,), generator=g).tolist() for n in (900, 1500, 40)]
    params, method = SamplingParams(max_tokens=6), "hip,hip_preset=lean,kv_quant=int4"
    batched = llm.generate(prompts, params, method=method)
    assert all(o.stats.plan["method"].startswith("hip lean + kv-quant int4, own store") for o in batched)
    alone = [llm.generate(p, params, method=method)[0] for p in prompts]
    assert [o.token_ids for o in batched] == [o.token_ids for o in alone]
