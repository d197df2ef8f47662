"""`kvtier generate` through `kvtier.cli.main.main`: JSON output, policies, and one-line errors.

The text path runs the embedded SmolLM2-135M-Instruct (the default when `--model` is omitted)
for 2-3 new tokens on a short prompt: a few seconds on a CPU. Every error case must fail before
any forward pass, exit with code 2 and print one line on stderr, never a traceback.
"""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from kvtier.cli.main import main
from tests.hf_reference import make_hf_model

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama (GQA) saved as an HF folder: config.json and safetensors, no tokenizer."""
    folder = tmp_path_factory.mktemp("tiny-llama")
    make_hf_model("llama-gqa", folder)
    return folder


def run_json(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, Any]:
    rc = main(["generate", "--prompt", PROMPT, "--max-new-tokens", "3", "--device", "cpu", "--json", *args])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "Traceback" not in err
    result: dict[str, Any] = json.loads(out)
    return result


def expect_error(capsys: pytest.CaptureFixture[str], args: list[str], *fragments: str) -> str:
    """Run the CLI, require exit code 2 and one line `kvtier: error: ...` holding `fragments`."""
    rc = main(args)
    out, err = capsys.readouterr()
    assert rc == 2, (out, err)
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("kvtier: error: "), err
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]


# -- the text path on the embedded model ------------------------------------------------------


def test_generate_json_on_the_embedded_model(embedded: Path, capsys: pytest.CaptureFixture[str]) -> None:
    result = run_json(capsys)
    assert set(result) >= {"text", "token_ids", "finish_reason", "prompt_tokens", "stats"}
    assert isinstance(result["text"], str) and result["text"]
    ids = result["token_ids"]
    assert all(isinstance(t, int) for t in ids)
    if result["finish_reason"] == "length":
        assert len(ids) == 3
    else:
        assert result["finish_reason"] == "stop" and 1 <= len(ids) <= 3
    stats = result["stats"]
    assert stats["prompt_tokens"] == result["prompt_tokens"] > 0
    assert stats["generated_tokens"] == len(ids)
    # where a user's wall goes besides the prefill: the model's load, the prompt's tokenizing, and
    # when each part began, in order (load_s, to 3 decimals, between the run and the model)
    assert result["load_s"] > 0 and 0 < stats["tokenize_s"] < result["load_s"]
    at, times = result["at_s"], [*result["at_s"].values()]
    assert [*at] == ["started", "run", "loaded", "generated", "answered"] and sorted(times) == times
    assert at["loaded"] - at["run"] >= result["load_s"] - 1e-3
    assert stats["prefill_tokens_per_s"] > 0
    assert "decode_tokens_per_s" in stats
    if len(ids) > 1:  # each decode step timed: the slowest no longer than all of them
        steps = stats["decode_step_s"]
        assert 0 <= steps["min"] <= steps["p50"] <= steps["p90"] <= steps["max"] <= stats["decode_s"]
        each = stats["decode_step_times_s"]  # every step in order, the summary's own
        assert len(each) == len(ids) - 1 and (min(each), max(each)) == (steps["min"], steps["max"])
        assert sum(each) <= stats["decode_s"] + 0.5e-4 * len(each)
    # auto on the CPU has no budget: the whole cache stays on the compute device
    assert stats["plan"]["policy"] == "auto"
    assert stats["plan"]["resident_slices"] == stats["plan"]["num_slices"] == 30
    assert stats["peak_bytes"]["gpu_kv"] > 0
    assert stats["peak_bytes"]["host_kv"] == 0


def test_ignore_eos_reaches_the_sampling_params(
    embedded: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--ignore-eos` (benchmarks, the smoke's decode-step checks) is serve's `ignore_eos`: the
    run generates every token asked for, past the end-of-sequence token."""
    from kvtier.engine.llm import LLM

    seen = []
    generate = LLM.generate

    def spy(self: LLM, prompt: Any, params: Any, **kw: Any) -> Any:
        seen.append(params)
        return generate(self, prompt, params, **kw)

    monkeypatch.setattr(LLM, "generate", spy)
    result = run_json(capsys, "--ignore-eos")
    assert [p.ignore_eos for p in seen] == [True]
    assert result["finish_reason"] == "length" and len(result["token_ids"]) == 3
    assert len(result["stats"]["decode_step_times_s"]) == 2  # the tokens after the prefill's
    run_json(capsys)
    assert [p.ignore_eos for p in seen] == [True, False]


def test_head_wise_offload_gives_the_same_tokens(embedded: Path, capsys: pytest.CaptureFixture[str]) -> None:
    reference = run_json(capsys)
    head = run_json(capsys, "--kv", "head", "--head-group", "1")
    assert head["token_ids"] == reference["token_ids"]
    assert head["text"] == reference["text"]
    plan = head["stats"]["plan"]
    # SmolLM2-135M: 30 layers x 3 KV heads, each (layer, head) slice in the host tier
    got = (plan["policy"], plan["group_size"], plan["num_slices"], plan["resident_slices"])
    assert got == ("head", 1, 90, 0)
    assert plan["staging_buffers"] == 2
    assert head["stats"]["peak_bytes"]["host_kv"] > 0
    assert head["stats"]["h2d_bytes"] > 0


def test_prefill_by_layer_gives_the_same_tokens_and_loads_less(
    embedded: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--prefill-order layer` over streamed slices: the chunks go through each layer in turn
    (the stats say so), the tokens are the chunk order's, and no chunk loads the prompt's KV."""
    args = ("--kv", "layer", "--chunk-size", "2")  # 5 prompt tokens: chunks of 2, 2 and 1
    chunked = run_json(capsys, *args)
    layered = run_json(capsys, *args, "--prefill-order", "layer")
    assert (chunked["stats"]["prefill_order"], layered["stats"]["prefill_order"]) == ("chunk", "layer")
    assert layered["token_ids"] == chunked["token_ids"]
    assert layered["stats"]["h2d_bytes"] < chunked["stats"]["h2d_bytes"]
    # the stats line says which order ran, and why not by layer where it could not
    cases = (((), "; prefill by layer; peak"), (("--kv", "gpu"), "; prefill by chunk (by layer needs"))
    for extra, said in cases:
        rc = main(["generate", "--prompt", PROMPT, "--max-new-tokens", "2", "--device", "cpu", *args, *extra,
                   "--prefill-order", "layer"])  # fmt: skip
        assert rc == 0 and said in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["generate", "--prompt", "hi", "--prefill-order", "diagonal"])
    assert exc.value.code == 2
    assert "--prefill-order: invalid choice" in capsys.readouterr().err


def test_text_output_and_stats_line(embedded: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["generate", "--prompt", PROMPT, "--max-new-tokens", "2", "--device", "cpu"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert out.strip()
    assert "prompt tokens" in err and "prefill" in err and "kv=auto" in err
    assert "Traceback" not in err
    if "2 new" in err:  # one decode step, timed: its time is every percentile's
        assert re.search(r"step p50 ([\d.]+) ms, max \1 ms", err), err
    # one new token comes from the prefill alone: no decode speed to state
    rc = main(["generate", "--prompt", PROMPT, "--max-new-tokens", "1", "--device", "cpu"])
    err = capsys.readouterr().err
    assert rc == 0 and "1 new, no decode step;" in err and "tok/s;" in err.split("new,")[0], err


def test_stats_line_names_the_batch_engines_pool() -> None:
    """One prompt through the batch engine (CUDA's default) reports its pool, not a placement."""
    from kvtier.cli.generate_cmd import plan_note

    batched = {"policy": "batched", "method": "paged batch of 1", "pages": 12, "cuda_graphs_capture_s": 0.1}
    assert plan_note(batched) == "kv=batched (12 pages, CUDA graphs)"
    assert plan_note({"policy": "batched", "pages": 3}) == "kv=batched (3 pages)"
    tiered = {"policy": "head", "group_size": 1, "resident_slices": 0}
    assert plan_note(tiered) == "kv=head group=1 resident=0"


# -- errors: exit code 2, one line, no traceback ----------------------------------------------


def test_missing_model_folder(capsys: pytest.CaptureFixture[str]) -> None:
    expect_error(capsys, ["generate", "--prompt", "hi", "--model", "/nonexistent"], "/nonexistent")


def test_folder_without_config_json(
    tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "weights-only"
    folder.mkdir()
    for f in tiny_llama.glob("*.safetensors"):
        (folder / f.name).write_bytes(f.read_bytes())
    expect_error(capsys, ["generate", "--prompt", "hi", "--model", str(folder)], "config.json")


def test_malformed_config_json(tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "broken"
    folder.mkdir()
    for f in tiny_llama.glob("*.safetensors"):
        (folder / f.name).write_bytes(f.read_bytes())
    (folder / "config.json").write_text('{"model_type": "llama", "hidden_size": ')
    expect_error(capsys, ["generate", "--prompt", "hi", "--model", str(folder)], "config.json", "JSON")


def test_config_json_without_required_fields(
    tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "incomplete"
    folder.mkdir()
    for f in tiny_llama.glob("*.safetensors"):
        (folder / f.name).write_bytes(f.read_bytes())
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    expect_error(capsys, ["generate", "--prompt", "hi", "--model", str(folder)])


def test_unsupported_model_type(tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "mamba"
    folder.mkdir()
    cfg = json.loads((tiny_llama / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "model_type": "mamba"}))
    expect_error(capsys, ["generate", "--prompt", "hi", "--model", str(folder)], "mamba")


def test_model_without_tokenizer_needs_token_ids(
    tiny_llama: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    expect_error(
        capsys, ["generate", "--prompt", "hi", "--model", str(tiny_llama), "--device", "cpu"], "tokenizer"
    )


def test_unknown_preset_like_name(capsys: pytest.CaptureFixture[str]) -> None:
    expect_error(capsys, ["generate", "--prompt", "hi", "--model", "llama-3-9b"], "llama-3-9b", "llama-3-8b")


def test_empty_prompt(capsys: pytest.CaptureFixture[str]) -> None:
    expect_error(capsys, ["generate", "--prompt", "  "], "empty")


def test_missing_prompt_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    expect_error(capsys, ["generate", "--prompt-file", str(tmp_path / "nope.txt")], "nope.txt")


def long_prompt(folder: Path) -> Path:
    """A prompt file of ~9,000 tokens, past SmolLM2's 8,192-token trained context."""
    path = folder / "long.txt"
    path.write_text("The grass is green. " * 1800)
    return path


def test_prompt_past_the_model_limit(
    embedded: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Rejected after tokenization, before any forward pass. transformers' own warning about the
    # length is silenced here (see the next test), so this checks kvtier's message alone.
    import transformers

    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        line = expect_error(
            capsys,
            [
                "generate",
                "--prompt-file",
                str(long_prompt(tmp_path)),
                "--max-new-tokens",
                "4",
                "--device",
                "cpu",
            ],
            "--max-model-len",
            "8192",
            "9001 tokens",
        )
    finally:
        transformers.logging.set_verbosity(verbosity)
    assert "prompt has" in line


def test_prompt_past_the_model_limit_prints_one_line(embedded: Path, tmp_path: Path) -> None:
    env = {**os.environ, "KVTIER_CACHE_DIR": str(embedded.parents[1])}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvtier",
            "generate",
            "--prompt-file",
            str(long_prompt(tmp_path)),
            "--device",
            "cpu",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()], proc.stderr
    assert proc.stderr.startswith("kvtier: error: the prompt has 9001 tokens")


def test_prompt_and_prompt_file_conflict(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["generate", "--prompt", "x", "--prompt-file", str(tmp_path / "y.txt")])
    assert exc.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err


def test_head_group_with_layer_policy(capsys: pytest.CaptureFixture[str]) -> None:
    expect_error(capsys, ["generate", "--prompt", "hi", "--kv", "layer", "--head-group", "2"], "--head-group")


@pytest.mark.parametrize("group", ["0", "-1"])
def test_head_group_must_be_positive(group: str, capsys: pytest.CaptureFixture[str]) -> None:
    expect_error(
        capsys, ["generate", "--prompt", "hi", "--kv", "head", "--head-group", group], "--head-group"
    )


def test_gpu_memory_that_is_not_a_size(capsys: pytest.CaptureFixture[str]) -> None:
    expect_error(capsys, ["generate", "--prompt", "hi", "--gpu-memory", "banana"], "--gpu-memory", "banana")


@pytest.mark.parametrize(
    ("option", "value"), [("--chunk-size", "lots"), ("--max-model-len", "0"), ("--kv-budget", "0")]
)
def test_token_count_options_that_are_not_counts(
    option: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    expect_error(capsys, ["generate", "--prompt", "hi", option, value], option)


def test_lossy_methods_that_cannot_be_combined(capsys: pytest.CaptureFixture[str]) -> None:
    """Quest and a codec do not combine (HiP and a codec do: tests/test_method_compose.py)."""
    args = ["generate", "--prompt", "hi", "--attention", "quest", "--kv-budget", "64", "--kv-quant", "int8"]
    expect_error(capsys, args, "--attention quest", "--kv-quant", "what combines: --attention hip")


def test_unknown_attention_method(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["generate", "--prompt", "hi", "--attention", "sparse"])
    assert exc.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


def test_missing_gguf_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    expect_error(capsys, ["generate", "--prompt", "hi", "--model", str(tmp_path / "m.gguf")], "m.gguf")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on machines without CUDA")
def test_cuda_on_a_machine_without_one(capsys: pytest.CaptureFixture[str]) -> None:
    expect_error(capsys, ["generate", "--prompt", "hi", "--device", "cuda"], "--device cuda")


def test_unknown_dtype(capsys: pytest.CaptureFixture[str]) -> None:
    expect_error(capsys, ["generate", "--prompt", "hi", "--dtype", "int3"], "int3")


def test_max_new_tokens_must_be_positive(capsys: pytest.CaptureFixture[str]) -> None:
    expect_error(capsys, ["generate", "--prompt", "hi", "--max-new-tokens", "0"], "--max-new-tokens")


def test_step_summary_takes_nearest_rank_percentiles() -> None:
    from kvtier.engine.outputs import step_summary

    assert step_summary([]) == {}
    steps = [0.05] * 15 + [1.25]  # a HiP refresh step among cached ones
    assert step_summary(steps) == {"min": 0.05, "p50": 0.05, "p90": 0.05, "max": 1.25}
    assert step_summary([0.3, 0.1, 0.2]) == {"min": 0.1, "p50": 0.2, "p90": 0.3, "max": 0.3}


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_loading_a_checkpoint_shows_its_bytes_on_a_terminal_only(
    tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`load_safetensors_folder` draws a bar of the checkpoint's bytes on a terminal, for
    checkpoints from `LOAD_BAR_FROM` (here lowered to the tiny model's), and none on a pipe."""
    import kvtier.loading.weights as weights

    size = sum(f.stat().st_size for f in tiny_llama.glob("*.safetensors"))
    monkeypatch.setattr(weights, "LOAD_BAR_FROM", size)
    for stream, shown in ((_Terminal(), True), (io.StringIO(), False)):
        monkeypatch.setattr(sys, "stderr", stream)
        weights.load_safetensors_folder(tiny_llama, torch.device("cpu"), torch.float32)
        assert ("loading weights" in stream.getvalue()) is shown and ("100%" in stream.getvalue()) is shown
    monkeypatch.setattr(weights, "LOAD_BAR_FROM", size + 1)
    monkeypatch.setattr(sys, "stderr", quiet := _Terminal())
    weights.load_safetensors_folder(tiny_llama, torch.device("cpu"), torch.float32)
    assert quiet.getvalue() == ""  # a checkpoint under the bound: no bar
