"""`kvtier plan` through the command line: JSON output, model resolution, errors, plot."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest

from kvtier.cli import plan_cmd
from kvtier.errors import KvtierError
from kvtier.loading.presets import PRESETS

CapSys = pytest.CaptureFixture[str]


def _main(argv: list[str]) -> int:
    """kvtier.cli.main.main, or, while the other subcommands are still being written, the same
    error handling around a parser that holds only `plan`."""
    try:
        from kvtier.cli.main import build_parser, main

        build_parser()
    except Exception:  # NOTE: generate_cmd / eval_cmd may not exist yet or be mid-edit
        parser = argparse.ArgumentParser(prog="kvtier")
        plan_cmd.add_parser(parser.add_subparsers(dest="command", required=True))
        args = parser.parse_args(argv)
        try:
            return int(args.func(args))
        except KvtierError as e:
            print(f"kvtier: error: {e}", file=sys.stderr)
            return 2
    return main(argv)


def _json(capsys: CapSys, *argv: str) -> dict:
    assert _main(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_json_has_every_method_and_a_recommendation(capsys: CapSys) -> None:
    doc = _json(capsys, "--model", "llama-3-8b", "--context", "1M", "--gpu-memory", "24 GB")
    assert set(doc["methods"]) == {"standard", "chunked", "kv4", "layer", "head", "auto"}
    keys = {"weights_gb", "kv_gpu_gb", "activations_gb", "total_gpu_gb", "kv_total_gb", "max_context"}
    assert all(set(row) == keys for row in doc["methods"].values())
    assert doc["methods"]["head"]["max_context"] >= 2_000_000
    assert 15_000 <= doc["methods"]["standard"]["max_context"] <= 35_000
    assert doc["methods"]["standard"]["kv_total_gb"] == pytest.approx(137.44, abs=0.01)  # GB = 1e9 B
    rec = doc["recommended"]
    assert (rec["policy"], rec["group_size"], rec["chunk_size"]) == ("auto", 1, 2048)
    assert rec["staging_buffers"] == 2 and rec["staging_tokens"] == 2**20
    assert 0 < rec["resident_slices"] < rec["num_slices"] == 256
    assert 4 < rec["decode_s_per_token"] < 8 and rec["decode_bound"] == "pcie"
    assert doc["methods"]["auto"]["total_gpu_gb"] + doc["gpu_reserve_gb"] <= 24.0


def test_paper_activation_model_reproduces_table_10(capsys: CapSys) -> None:
    doc = _json(capsys, "--model", "llama-3-8b", "--activations", "paper")
    head = doc["methods"]["head"]
    gib = 1e9 / 2**30
    assert head["total_gpu_gb"] * gib == pytest.approx(16.7, rel=0.03)
    assert doc["methods"]["standard"]["activations_gb"] * gib == pytest.approx(64, rel=0.001)


def test_plain_output_is_a_table(capsys: CapSys) -> None:
    assert _main(["plan", "--model", "mistral-7b", "--context", "128K", "--gpu", "h200"]) == 0
    out = capsys.readouterr().out
    assert "max context" in out and "recommended: policy auto" in out and "roofline h200" in out
    assert out.count("\n") >= 12


@pytest.mark.parametrize("where", ["folder", "file"])
def test_model_from_config_json(tmp_path: Path, where: str, capsys: CapSys) -> None:
    (tmp_path / "config.json").write_text(json.dumps(PRESETS["smollm2-135m"]))
    model = tmp_path if where == "folder" else tmp_path / "config.json"
    doc = _json(capsys, "--model", str(model), "--context", "64K", "--gpu-memory", "4GiB")
    assert doc["recommended"]["resident_slices"] == 30  # smollm2's 1.5 GB of KV fits


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "gpt-7"], "known presets: " + ", ".join(sorted(PRESETS))),
        (["--model", "llama-3-8b", "--gpu-memory", "banana"], "--gpu-memory: cannot read 'banana' as a size"),
        (["--model", "llama-3-8b", "--context", "lots"], "--context: cannot read 'lots'"),
        (["--model", "llama-3-8b", "--group-size", "3"], "must divide the model's 8 KV heads"),
        (["--model", "llama-3-8b", "--gpu-memory", "8GB"], "use a larger --gpu-memory"),
        (["--model", "llama-3-8b", "--context", "8M", "--host-memory", "64GiB"], "of host memory"),
    ],
)
def test_bad_input_exits_2_with_one_line(argv: list[str], message: str, capsys: CapSys) -> None:
    assert _main(["plan", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_context_that_fits_nowhere_says_what_would_fit(capsys: CapSys) -> None:
    assert _main(["plan", "--model", "llama-3-8b", "--context", "8M", "--json"]) == 2
    captured = capsys.readouterr()
    doc = json.loads(captured.out)
    assert doc["recommended"] is None and "longest context that fits is" in doc["error"]
    assert "1099.51 GB of host memory" in captured.err


def test_disk_extends_the_host_tier(capsys: CapSys) -> None:
    doc = _json(capsys, "--model", "llama-3-8b", "--context", "1M", "--host-memory", "64GiB", "--disk", "1TB")
    rec = doc["recommended"]
    assert rec["host_kv_gb"] == pytest.approx(64 * 2**30 / 1e9, abs=1e-3)
    assert rec["disk_kv_gb"] > 60


def test_plot_is_written(tmp_path: Path, capsys: CapSys) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "memory.png"
    argv = ["plan", "--model", "smollm2-135m", "--context", "1M", "--gpu-memory", "4GiB", "--plot", str(out)]
    assert _main(argv) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plan_predicts_lossy_pcie_bytes(capsys: CapSys) -> None:
    """llama-3-8b at 512K, head-wise: int4 loads 16380 packed rows of 5120 B + 133 full tokens per
    slice; 50% head sparsity streams half the slices."""
    base = ["--model", "llama-3-8b", "--context", "512K", "--gpu", "h200", "--gpu-memory", "24GB"]
    int4 = _json(capsys, *base, "--policy", "head", "--kv-quant", "int4")["lossy"]
    assert int4["lossless_pcie_gb_per_token"] == 256 * 524288 * 512 / 1e9
    assert int4["pcie_gb_per_token"] == 256 * (16380 * 5120 + 128 * 512) / 1e9
    heads = _json(capsys, *base, "--policy", "head", "--head-sparsity", "0.5")["lossy"]
    assert heads["pcie_gb_per_token"] == int4["lossless_pcie_gb_per_token"] / 2
    # With auto, the packed plan keeps a larger share of the KV resident: fewer bytes stream
    # (than the lossless plan over the link alone: CPU attention off).
    out = _json(capsys, *base, "--kv-quant", "int4", "--cpu-attention", "off")
    rec, packed = out["recommended"], out["lossy"]
    assert packed["resident_slices"] / packed["num_slices"] > rec["resident_slices"] / rec["num_slices"]
    assert packed["pcie_gb_per_token"] < rec["pcie_gb_per_decode_token"] / 3.2
    assert _main(["plan", *base, "--kv-quant", "int4", "--head-sparsity", "0.5"]) == 2
    assert "cannot be combined" in capsys.readouterr().err
    assert packed["cpu_slices"] == 0 and packed["simulated_split_decode_s"] is None


def test_plan_splits_a_quantized_cache_with_the_cpu_at_the_presets_packed_rate(capsys: CapSys) -> None:
    """`--kv-quant int4 --cpu-attention auto` on the H200 preset (its measured packed CPU rates):
    a finer slicing whose CPU split the simulation makes faster than the link's floor, printed
    in the report (it was silent: the preset had no packed rate)."""
    base = ["--model", "llama-3-8b", "--context", "512K", "--gpu", "h200", "--gpu-memory", "24GiB"]
    packed = _json(capsys, *base, "--kv-quant", "int4", "--cpu-attention", "auto")["lossy"]
    assert packed["num_slices"] > 64 and 0 < packed["cpu_slices"] < packed["streamed_slices"]
    assert packed["simulated_split_decode_s"] < packed["decode_floor_s"]
    assert _main(["plan", *base, "--kv-quant", "int4", "--cpu-attention", "auto"]) == 0
    assert "streamed slices on the CPU over packed rows" in capsys.readouterr().out


def test_plan_hip_takes_the_widest_slices_that_hold_whole_slices(capsys: CapSys) -> None:
    """llama-3-8b on 24 GB of an H200: at 128K whole layers with the block cache of a whole
    refresh interval; at 512K whole layers, with a smaller cache when decode streams (a layer's
    two staging buffers take 4.3 GB); at 768K 4-head slices. Always whole slices in staging."""
    base = ["--model", "llama-3-8b", "--gpu", "h200", "--gpu-memory", "24GB", "--host-memory", "125GiB"]
    hips = {
        c: _json(capsys, *base, "--context", c, "--attention", "hip", "--hip-preset", "fast")["hip"]
        for c in ("128K", "512K", "768K")
    }
    assert (hips["128K"]["group_size"], hips["128K"]["cache_tokens_per_slice"]) == (8, None)
    assert hips["512K"]["group_size"] == 8 and hips["512K"]["per_layer"]
    # From 256K stage 0 reads host keys (`--hip-host-keys auto`): decode streams nothing, so the
    # caches also take the staging buffers' bytes and cover a refresh interval; streaming, the
    # staging buffers leave room for smaller ones.
    assert hips["512K"]["cache_tokens_per_slice"] is None
    streaming = _json(capsys, *base, "--context", "512K", "--attention", "hip", "--hip-preset", "fast",
                      "--hip-host-keys", "off")["hip"]  # fmt: skip
    assert streaming["group_size"] == 8 and 8192 <= streaming["cache_tokens_per_slice"] <= 16384
    assert hips["768K"]["group_size"] == 4 and not hips["768K"]["per_layer"]
    # Prefill chunks by HiP's roofline: 16K at 512K (dense's roofline: 4K), with layer slices still,
    # since decode's block caches and prefill's activations are planned as phases.
    assert hips["512K"]["chunk_size"] == 16384 and 4096 < hips["128K"]["chunk_size"] < 16384
    assert streaming["hip_gpu_gb"] < hips["128K"]["hip_gpu_gb"]
    assert hips["512K"]["host_keys"] and not hips["128K"]["host_keys"] and not streaming["host_keys"]
    # Errors before allocating: room for the weights but not for whole slices next to the caches;
    # or not even for the weights once HiP's GPU bytes are taken.
    small = ["--model", "llama-3-8b", "--gpu", "h200", "--context", "768K", "--attention", "hip"]
    assert _main(["plan", *small, "--gpu-memory", "19.5GB"]) == 2
    assert "needs every offloaded slice whole" in capsys.readouterr().err
    assert _main(["plan", *small, "--gpu-memory", "18.5GB"]) == 2
    err = capsys.readouterr().err
    assert "weights 16.06 GB" in err and "--attention hip first takes" in err
    # A --head-group too wide for whole slices: the message names it and the way out, and
    # without it the planner takes the widest that fits (4 KV heads at 1M over int4).
    wide = ["--model", "llama-3.1-8b", "--gpu", "h100-sxm", "--context", "1M", "--gpu-memory", "24GiB",
            "--host-memory", "120GiB", "--attention", "hip", "--kv-quant", "int4"]  # fmt: skip
    assert _main(["plan", *wide, "--head-group", "8"]) == 2
    err = capsys.readouterr().err
    assert "a slice of 8 KV heads take 8.59 GB" in err and "smaller --head-group" in err
    assert _json(capsys, *wide)["hip"]["group_size"] == 4
    # Short of host memory, not GPU memory: the planner's host message, nothing about HiP's bytes.
    assert _main(["plan", *small, "--gpu-memory", "24GB", "--host-memory", "64GiB"]) == 2
    err = capsys.readouterr().err
    assert "of host memory" in err and "--attention hip" not in err


def test_1m_tokens_fit_the_h200_host_only_as_hip_over_int4(capsys: CapSys) -> None:
    """Llama-3-8B at 1M on a 24 GiB cap with 120 GiB of host memory: lossless KV (~137 GB) and
    HiP over it do not fit the host; HiP over int4 KV does, in well under half of it, and the
    command plans it (exit 0) though the lossless recommendation is none."""
    base = ["--model", "llama-3-8b", "--context", "1M", "--gpu", "h200", "--gpu-memory", "24GiB"]
    base += ["--host-memory", "120GiB", "--hip-preset", "fast"]
    assert _main(["plan", *base]) == 2
    assert "of host memory" in capsys.readouterr().err
    assert _main(["plan", *base, "--attention", "hip"]) == 2
    assert "of host memory" in capsys.readouterr().err
    doc = _json(capsys, *base, "--attention", "hip", "--kv-quant", "int4")
    assert doc["recommended"] is None and "longest context that fits" in doc["error"]
    hip = doc["hip"]
    assert hip["kv_quant"] == "int4" and 0 < hip["host_kv_gb"] < 120 * 2**30 / 1e9 / 2
    assert _main(["plan", *base, "--attention", "hip", "--kv-quant", "int4"]) == 0
    out = capsys.readouterr().out
    assert "with --attention hip (fast) over --kv-quant int4" in out and "the method's plan does" in out
    # what HiP does not combine with is refused, not left out of the plan
    assert _main(["plan", *base, "--attention", "hip", "--head-sparsity", "0.5"]) == 2
    assert "cannot be combined" in capsys.readouterr().err


def test_plan_evict_keeps_every_slice_on_the_gpu(capsys: CapSys) -> None:
    """`--evict NAME --kv-budget N`: every slice on the GPU at its budget plus a chunk (SnapKV,
    which evicts in prefill only, plus `--max-new-tokens`), nothing on the host, where lossless
    at 256K under 24 GiB streams tens of GB; at 4M, which no host holds, it still plans."""
    base = ["--model", "llama-3-8b", "--context", "256K", "--gpu-memory", "24GiB"]
    out = _json(capsys, *base, "--evict", "h2o", "--kv-budget", "2k")
    ev = out["evict"]
    assert ev["host_kv_gb"] == 0 and ev["pcie_gb_per_token"] == 0 and not ev["keeps_new_tokens"]
    assert ev["tokens_per_slice"] == 2048 + ev["chunk_size"]
    token = 8 * 128 * 2 * 2  # a layer's slice: 8 KV heads x 128 x (K, V) x bf16
    assert round(ev["gpu_kv_gb"] * 1e9) == ev["num_slices"] * ev["tokens_per_slice"] * token
    snap = _json(capsys, *base, "--evict", "snapkv", "--kv-budget", "2k", "--max-new-tokens", "1k")["evict"]
    assert snap["keeps_new_tokens"] and snap["tokens_per_slice"] == 2048 + snap["chunk_size"] + 1024
    far = _json(capsys, "--model", "llama-3-8b", "--context", "4M", "--evict", "window", "--kv-budget", "2k")
    assert far["evict"]["host_kv_gb"] == 0


def test_plan_quest_keeps_its_page_bounds_off_the_budget(capsys: CapSys) -> None:
    """`--attention quest --kv-budget N`: the plan within the budget less Quest's page bounds
    (the registry's planner, as `LLM` plans it), and the bounds shrink with larger pages."""
    from kvtier.loading.presets import preset_config
    from kvtier.policies.quest import quest_gpu_bytes

    base = ["--model", "llama-3-8b", "--context", "256K", "--gpu-memory", "24GiB"]
    quest = _json(capsys, *base, "--attention", "quest", "--kv-budget", "2k")["quest"]
    bounds = quest_gpu_bytes(preset_config("llama-3-8b"), 262_144, 16, 2)
    assert round(quest["page_bounds_gb"] * 1e9) == bounds and quest["method"].endswith("--quest-page 16")
    assert 0 < quest["resident_slices"] < quest["num_slices"] and quest["host_kv_gb"] > 0
    wide = _json(capsys, *base, "--attention", "quest", "--kv-budget", "2k", "--quest-page", "64")["quest"]
    assert wide["page_bounds_gb"] < quest["page_bounds_gb"] / 3
    assert wide["resident_slices"] >= quest["resident_slices"]
    assert _main(["plan", *base, "--attention", "quest", "--kv-budget", "2k"]) == 0
    assert "page bounds 2.01 GB on the GPU" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--kv-budget", "2k"], "the budget of --evict NAME or --attention quest: add one"),
        (["--max-new-tokens", "1k"], "add --evict NAME"),
        (["--attention", "quest"], "give --kv-budget N"),
        (["--quest-page", "4"], "applies only with --attention quest"),
        (["--attention", "quest", "--kv-budget", "2k", "--kv-quant", "int4"], "one at a time"),
        (["--attention", "quest", "--kv-budget", "2k", "--evict", "h2o"], "one at a time"),
        (["--evict", "h2o"], "give --kv-budget N"),
        (["--evict", "h2o", "--kv-budget", "2k", "--kv-quant", "int4"], "one at a time"),
        (["--evict", "snapkv", "--kv-budget", "2k"], "give --max-new-tokens N"),
        (["--evict", "window", "--kv-budget", "2k", "--max-new-tokens", "1M"], "more than --context"),
    ],
)
def test_plan_evict_bad_input_says_what_to_do(argv: list[str], message: str, capsys: CapSys) -> None:
    base = ["--model", "llama-3-8b", "--context", "256K", "--gpu-memory", "24GiB"]
    assert _main(["plan", *base, *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
