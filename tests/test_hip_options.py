"""HiP's per-request options (`--hip-preset`, `--hip-host-keys`, `--hip-probes`, `--hip-refresh`,
`--hip-strides`, `--hip-align-window`) reach its kernel and its plan from a method spec, a CLI
flag and `LLM`, and bad values are refused with what to give."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kvtier import LLM, SamplingParams
from kvtier.errors import ConfigError
from tests.tiny_llm import PROMPT, tokens


def test_hip_auto_preset_is_lean_past_the_trained_length(tiny: Path) -> None:
    from kvtier.config import ModelConfig
    from kvtier.methods import MethodChoice
    from kvtier.sparse import resolve_preset

    llm = LLM(str(tiny), device="cpu", chunk_size=64, attention="hip", max_model_len=1024)
    cfg: ModelConfig = llm.model_config
    trained = cfg.max_position_embeddings  # 512
    assert resolve_preset("auto", cfg, trained) == "fast"
    assert resolve_preset("auto", cfg, trained + 1) == "lean"
    assert resolve_preset("auto", cfg, None) == "fast"
    assert resolve_preset("fast", cfg, 10 * trained) == "fast"  # a named preset is kept
    with pytest.raises(ConfigError, match="auto, default"):
        resolve_preset("nope", cfg, 1)
    assert MethodChoice(attention="hip").hip_preset == "auto"
    # One request past the trained length plans and builds lean; lean's budgets cover these 700
    # tokens, so it equals dense attention.
    ids = [3 + i % 50 for i in range(trained + 188)]
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    out = llm.generate(ids, params)[0]
    assert out.stats.plan["method"] == "hip lean (auto)"
    assert out.token_ids == llm.generate(ids, params, method="auto")[0].token_ids
    named = llm.generate(ids, params, method="hip,hip_preset=default")[0]
    assert named.stats.plan["method"] == "hip default"
    # Within it the same LLM takes the paper's setting.
    assert llm.generate(PROMPT, params)[0].stats.plan["method"] == "hip fast (auto)"


def test_hip_host_keys_reaches_the_kernel_from_a_spec_and_a_flag(tiny: Path) -> None:
    """`hip,hip_host_keys=on` (a request's spec) and `--hip-host-keys on` (the CLI) turn on
    `HipConfig.host_scoring` and say so in the method's description; "off" leaves it off; "auto"
    (the default) turns it on for a 512K request without a quantized tier; any other value names
    the three."""
    from kvtier.cli.main import build_parser
    from kvtier.cli.options import method_kwargs
    from kvtier.methods.spec import parse_choice

    cfg, cpu = LLM(str(tiny), device="cpu").model_config, torch.device("cpu")
    parts = parse_choice("hip,hip_preset=lean,hip_host_keys=on").build(cfg, cpu, None)
    kernel: Any = parts.kernel
    assert kernel.cfg.host_scoring and parts.describe.endswith("stage 0 on host keys")
    off: Any = parse_choice("hip,hip_host_keys=off").build(cfg, cpu, None).kernel
    assert not off.cfg.host_scoring
    with pytest.raises(ConfigError, match="on, off or auto"):
        parse_choice("hip,hip_host_keys=yes")
    assert parse_choice("hip,hip_host_keys=auto").hip_host_keys is None
    at_512k: Any = parse_choice("hip").build(cfg, cpu, None, context=512 * 1024).kernel
    assert at_512k.cfg.host_scoring  # auto, the default
    int4: Any = parse_choice("hip,kv_quant=int4").build(cfg, cpu, None, context=512 * 1024).kernel
    assert not int4.cfg.host_scoring
    flags = ["generate", "--prompt", "x", "--attention", "hip", "--hip-host-keys", "on"]
    args = build_parser().parse_args(flags)
    assert method_kwargs(args)["hip_host_keys"] is True


def test_hip_probes_reaches_the_kernel_from_a_spec_a_flag_and_the_llm(tiny: Path) -> None:
    """`hip,hip_probes=on`, `--hip-probes on` and `LLM(hip_probes=True)` turn on
    `HipConfig.probe_scoring` and say so in the method's description; off by default; another
    value names the two; without `--attention hip` it is refused."""
    from kvtier.cli.main import build_parser
    from kvtier.cli.options import method_kwargs
    from kvtier.methods.spec import parse_choice

    cfg, cpu = LLM(str(tiny), device="cpu").model_config, torch.device("cpu")
    parts = parse_choice("hip,hip_host_keys=on,hip_probes=on").build(cfg, cpu, None)
    kernel: Any = parts.kernel
    assert kernel.cfg.probe_scoring and kernel.cfg.host_scoring
    assert parts.describe.endswith("stage 0 on host keys, stage 0 on its probes")
    plain: Any = parse_choice("hip").build(cfg, cpu, None, context=512 * 1024).kernel
    assert not plain.cfg.probe_scoring
    with pytest.raises(ConfigError, match="on or off"):
        parse_choice("hip,hip_probes=auto")
    with pytest.raises(ConfigError, match="--hip-probes applies only with"):
        parse_choice("hip_probes=on")
    flags = ["generate", "--prompt", "x", "--attention", "hip", "--hip-probes", "on"]
    args = build_parser().parse_args(flags)
    assert method_kwargs(args)["hip_probes"] is True
    llm = LLM(str(tiny), device="cpu", attention="hip", hip_probes=True)
    assert llm.method.hip_probes is True


def test_hip_refresh_sets_the_decode_intervals_of_the_preset(tiny: Path) -> None:
    """`--hip-refresh NAME` keeps the preset's budgets and takes NAME's refresh intervals: in the
    kernel, in the plan's block cache (which holds a refresh interval's window growth) and in
    the request's description; stage 0 then reruns as often as NAME says."""
    from dataclasses import replace

    from kvtier.methods import MethodChoice
    from kvtier.sparse import HIP_PRESETS, hip_config, hip_gpu_bytes

    llm = LLM(str(tiny), device="cpu", chunk_size=64, attention="hip", hip_preset="default")
    cfg = llm.model_config
    parts = MethodChoice(attention="hip", hip_preset="lean", hip_refresh="fast").build(
        cfg, torch.device("cpu"), None
    )
    kernel: Any = parts.kernel
    assert kernel.cfg == replace(HIP_PRESETS["lean"], refresh=(32, 16, 8))
    assert parts.describe == "hip lean, refresh fast"
    # the block cache holds the window grown over a refresh interval: longer intervals, more bytes
    assert hip_gpu_bytes(cfg, hip_config("default", "flash")) > hip_gpu_bytes(cfg, "default")
    ids, _ = tokens(tiny)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    every = llm.generate(ids, params, method="hip,hip_preset=default,hip_refresh=always,kv=head")[0]
    assert every.stats.plan["method"].startswith("hip default, refresh always")
    # the tiny model's prompt is within every budget: any refresh attends every key, as dense does
    assert every.token_ids == llm.generate(ids, params, method="auto")[0].token_ids


def test_hip_refresh_takes_explicit_intervals(tiny: Path) -> None:
    """`--hip-refresh 64/8/4` (InfiniteHiP's SGLang takes any list too) sets each stage's
    interval, from a spec, a flag and `LLM`; a shorter list repeats its last; zero, words and
    empty parts are refused with both forms named."""
    from kvtier.cli.main import build_parser
    from kvtier.cli.options import method_kwargs
    from kvtier.methods.spec import parse_choice

    cfg, cpu = LLM(str(tiny), device="cpu").model_config, torch.device("cpu")
    parts = parse_choice("hip,hip_preset=lean,hip_refresh=64/8/4").build(cfg, cpu, None)
    kernel: Any = parts.kernel
    assert kernel.cfg.refresh == (64, 8, 4) and parts.describe == "hip lean, refresh 64/8/4"
    short: Any = parse_choice("hip,hip_refresh=1").build(cfg, cpu, None).kernel
    assert short.cfg.refresh == (1, 1, 1)
    for bad in ("0/8/4", "64/x/4", "64//4", "sometimes"):
        with pytest.raises(ConfigError, match=r"joined by '/', e\.g\. 64/8/4"):
            parse_choice(f"hip,hip_refresh={bad}")
    args = build_parser().parse_args(
        ["generate", "--prompt", "x", "--attention", "hip", "--hip-refresh", "64/8/4"]
    )
    assert method_kwargs(args)["hip_refresh"] == "64/8/4"
    llm = LLM(str(tiny), device="cpu", chunk_size=16, attention="hip", hip_refresh="64/8/4")
    out = llm.generate(PROMPT, SamplingParams(max_tokens=3, ignore_eos=True))[0]
    assert "refresh 64/8/4" in out.stats.plan["method"]


def test_hip_strides_reach_the_kernel_and_the_plan(tiny: Path) -> None:
    """`hip,hip_strides=4/4/2`, `--hip-strides 4/4/2` and `LLM(hip_strides=...)` set the
    kernel's query strides, say so in the description and size the plan's pruning bytes with
    them; a malformed list, one that does not fit the preset's stages, and the option without
    HiP are refused with what to give."""
    from kvtier.cli.main import build_parser
    from kvtier.cli.options import method_kwargs
    from kvtier.methods.spec import method_spec, parse_choice

    cfg, cpu = LLM(str(tiny), device="cpu").model_config, torch.device("cpu")
    choice = parse_choice("hip,hip_strides=4/4/2")
    assert method_spec(choice) == "attention=hip,hip_strides=4/4/2"  # round-trips
    parts = choice.build(cfg, cpu, None, context=4096)
    kernel: Any = parts.kernel
    assert kernel.cfg.query_strides == (4, 4, 2) and parts.describe.endswith("query strides 4/4/2")
    assert parse_choice("hip").build(cfg, cpu, None).kernel.cfg.query_strides == (4, 4, 1)  # type: ignore[union-attr]
    with pytest.raises(ConfigError, match="joined by '/'"):
        parse_choice("hip,hip_strides=4/0/1")
    with pytest.raises(ConfigError, match="one value per stage"):
        parse_choice("hip,hip_strides=4/4").build(cfg, cpu, None)
    with pytest.raises(ConfigError, match="--hip-strides applies only with"):
        parse_choice("hip_strides=4/4/2")
    args = build_parser().parse_args(
        ["generate", "--prompt", "x", "--attention", "hip", "--hip-strides", "4/4/2"]
    )
    assert method_kwargs(args)["hip_strides"] == "4/4/2"
    llm = LLM(str(tiny), device="cpu", chunk_size=16, attention="hip", hip_strides="4/4/2")
    out = llm.generate(PROMPT, SamplingParams(max_tokens=3, ignore_eos=True))[0]
    assert out.stats.plan["method"].endswith("query strides 4/4/2")


def test_hip_align_window_reaches_the_kernel(tiny: Path) -> None:
    """`hip,hip_align_window=on`, `--hip-align-window on` and `LLM(hip_align_window=True)` set
    `HipConfig.align_window` and say so in the description; its decode buffers hold up to a
    stage-0 chunk more; a value other than on/off and the option without HiP are refused."""
    from kvtier.cli.main import build_parser
    from kvtier.cli.options import method_kwargs
    from kvtier.methods.spec import method_spec, parse_choice

    cfg, cpu = LLM(str(tiny), device="cpu").model_config, torch.device("cpu")
    choice = parse_choice("hip,hip_align_window=on")
    assert method_spec(choice) == "attention=hip,hip_align_window=on"  # round-trips
    parts = choice.build(cfg, cpu, None, context=1 << 20)  # a context no budget caps
    kernel: Any = parts.kernel
    plain: Any = parse_choice("hip").build(cfg, cpu, None, context=1 << 20).kernel
    assert kernel.cfg.align_window and not plain.cfg.align_window
    assert "window at stage-0 chunks" in parts.describe
    grown = kernel.cfg.decode_buffer_tokens() - plain.cfg.decode_buffer_tokens()
    assert grown == kernel.cfg.chunk_sizes[0] - 1
    with pytest.raises(ConfigError, match="--hip-align-window takes on or off"):
        parse_choice("hip,hip_align_window=yes")
    with pytest.raises(ConfigError, match="--hip-align-window applies only with"):
        parse_choice("hip_align_window=on")
    args = build_parser().parse_args(
        ["generate", "--prompt", "x", "--attention", "hip", "--hip-align-window", "on"]
    )
    assert method_kwargs(args)["hip_align_window"] is True
    llm = LLM(str(tiny), device="cpu", chunk_size=16, attention="hip", hip_align_window=True)
    out = llm.generate(PROMPT, SamplingParams(max_tokens=3, ignore_eos=True))[0]
    assert out.stats.plan["method"].endswith("window at stage-0 chunks")


# (option, value, HipConfig field, the description's words, refused values, the refusal)
_PREFILL_OPTIONS = [
    ("hip_exact", 8, "exact_chunk", "chunks of up to 8 tokens scored on every key", ("12", "128", "yes"),
     "takes off or a chunk size"),
    ("hip_stage0", 256, "stage0_block_q", "stage 0 once per 256 queries", ("100", "-64", "yes"),
     "takes off or a number of queries"),
]  # fmt: skip


@pytest.mark.parametrize(("option", "value", "field", "words", "bad", "refusal"), _PREFILL_OPTIONS)
def test_hip_prefill_option_reaches_the_kernel(
    tiny: Path, option: str, value: int, field: str, words: str, bad: tuple[str, ...], refusal: str
) -> None:
    """`hip,<option>=N`, its flag and `LLM(<option>=N)` set the HipConfig field and say so in
    the description; `off` is 0; a value the kernel cannot take (--hip-exact: no power of two
    up to 64; --hip-stage0: no multiple of the query block), or the option without HiP, is
    refused."""
    from kvtier.cli.main import build_parser
    from kvtier.cli.options import method_kwargs
    from kvtier.methods.spec import method_spec, parse_choice

    flag = "--" + option.replace("_", "-")
    cfg, cpu = LLM(str(tiny), device="cpu").model_config, torch.device("cpu")
    choice = parse_choice(f"hip,{option}={value}")
    assert method_spec(choice) == f"attention=hip,{option}={value}"  # round-trips
    parts = choice.build(cfg, cpu, None, context=1 << 20)
    kernel: Any = parts.kernel
    assert getattr(kernel.cfg, field) == value and words in parts.describe
    off: Any = parse_choice(f"hip,{option}=off").build(cfg, cpu, None, context=1 << 20).kernel
    assert getattr(off.cfg, field) == 0
    for text in bad:
        with pytest.raises(ConfigError, match=f"{flag} {refusal}"):
            parse_choice(f"hip,{option}={text}")
    with pytest.raises(ConfigError, match=f"{flag} applies only with"):
        parse_choice(f"{option}={value}")
    args = build_parser().parse_args(["generate", "--prompt", "x", "--attention", "hip", flag, str(value)])
    assert method_kwargs(args)[option] == value
    llm = LLM(str(tiny), device="cpu", chunk_size=16, attention="hip", **{option: value})
    out = llm.generate(PROMPT, SamplingParams(max_tokens=3, ignore_eos=True))[0]
    assert out.stats.plan["method"].endswith(words)
