"""`kvtier eval` from the command line: bad input exits 2 with one line; one tiny real run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtier.cli.main import main


@pytest.mark.parametrize(
    "argv,message",
    [
        (["lost"], "unknown task 'lost'; choose one of passkey, niah, ruler"),
        (
            ["passkey", "--method", "magic"],
            "unknown method 'magic'; choose one of auto, gpu, layer, head, hip",
        ),
        (["passkey", "--method", "h2o"], "--method h2o needs kv_budget; e.g. --method h2o,kv_budget=1k"),
        (["passkey", "--method", "head,bits=4"], "unknown key 'bits'; valid keys: kv, head_group"),
        (["passkey", "--lengths", "2k;4k"], "--lengths"),
        (["niah", "--depths", "0:150:10"], "depths are percentages within 0..100"),
        (["niah", "--depths", "zero"], "write start:stop:step"),
        (["ruler", "--depths", "50"], "drop --depths"),
        (["ruler", "--subtasks", "qa"], "unknown ruler subtask(s) qa"),
        (["passkey", "--samples", "0"], "--samples must be at least 1"),
        (["passkey", "--first-sample", "-1"], "--first-sample must be 0 or more"),
        (["passkey", "--resume"], "--resume continues the run saved in --out F.json: give --out"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["eval", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("kvtier: error: ") and "\n" not in err
    assert message in err


def test_passkey_end_to_end_on_the_embedded_model(
    embedded_hf_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out, png = tmp_path / "r.json", tmp_path / "p.png"
    model = ["--model", str(embedded_hf_dir), "--device", "cpu"]
    grid = ["--lengths", "1k", "--samples", "1"]
    outputs = ["--json", "--out", str(out), "--plot", str(png), "--no-progress"]
    argv = ["eval", "passkey", *model, *grid, *outputs]
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["task"] == "passkey" and summary["methods"][0]["label"] == "auto"
    assert summary["overall"][0]["n"] == 1
    saved = json.loads(out.read_text())
    (record,) = saved["records"]
    assert record["length"] == 1024 and 1014 <= record["prompt_tokens"] <= 1014 + 10
    assert record["score"] == float(record["answer"].strip().startswith(record["expected"][0]))
    assert saved["command"].startswith("kvtier eval passkey --model")
    assert saved["kvtier_version"] and saved["machine"]["device"] == "cpu"
    assert png.stat().st_size > 1000
    assert saved["complete"] is True and saved["resumed"] == 0
    # the same command with --resume keeps the finished sample instead of running it again
    assert main([*argv, "--resume"]) == 0
    again = json.loads(out.read_text())
    assert again["resumed"] == 1 and again["records"] == saved["records"]


def test_resume_refuses_a_file_of_another_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--resume` continues only the command `--out` was saved by, before loading a model."""
    out = tmp_path / "r.json"
    out.write_text(json.dumps({"command": "kvtier eval passkey --lengths 2k", "records": []}))
    assert main(["eval", "passkey", "--lengths", "1k", "--out", str(out), "--resume"]) == 2
    err = capsys.readouterr().err
    assert "holds a run of another command ('kvtier eval passkey --lengths 2k')" in err
    assert "give the same options, another --out, or drop --resume" in err
