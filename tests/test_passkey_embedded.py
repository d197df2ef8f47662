"""The embedded SmolLM2 finds a pass key in ~3K tokens of filler, with head-wise KV offload."""

from __future__ import annotations

from pathlib import Path

from kvtier import LLM, SamplingParams

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "


def test_passkey_at_3k_tokens_with_headwise_offload(embedded_hf_dir: Path) -> None:
    llm = LLM(str(embedded_hf_dir), device="cpu", kv="head", head_group=1, chunk_size=1024)
    prompt = (
        "There is important info hidden inside a lot of irrelevant text. Find it and memorize it.\n"
        + FILLER * 62
        + "The pass key is 68423. Remember it. 68423 is the pass key. "
        + FILLER * 62
        + "\nWhat is the pass key? The pass key is"
    )
    out = llm.generate(prompt, SamplingParams(max_tokens=6))[0]
    assert 2900 <= out.stats.prompt_tokens <= 3300
    assert out.text.split()[0].rstrip(".") == "68423"
    # Head-wise offload: the GPU tier (here: device memory) held two head slices, the host all KV.
    assert out.stats.plan["policy"] == "head"
    assert out.stats.peak_bytes["host_kv"] > 10 * out.stats.peak_bytes["gpu_kv"]
