"""Request validation and the `kvtier serve` command line, without loading a model."""

from __future__ import annotations

from typing import Any

import pytest

from kvtier.cli.main import build_parser, main
from kvtier.engine.batch.stopping import check_stop
from kvtier.engine.sampling import SamplingParams
from kvtier.errors import ConfigError
from kvtier.serve.app import AppSettings
from kvtier.serve.engine import ServeConfig
from kvtier.serve.metrics import _escape
from kvtier.serve.protocol import APIError, parse_request


def test_completion_body_becomes_sampling_params() -> None:
    req = parse_request(
        {"prompt": "Hi", "max_tokens": 3, "temperature": 0, "stop": "\n", "seed": 7}, chat=False
    )
    assert req.prompt == "Hi" and req.messages is None and not req.stream
    assert (req.params.max_tokens, req.params.temperature, req.params.stop, req.params.seed) == (
        3,
        0.0,
        ("\n",),
        7,
    )
    assert parse_request({"prompt": [[1, 2, 3]]}, chat=False).prompt == [1, 2, 3]
    assert parse_request({"prompt": "x"}, chat=False).params.max_tokens == 16


def test_chat_body_accepts_text_parts_and_max_completion_tokens() -> None:
    body = {
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
        ],
        "max_completion_tokens": 5,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    req = parse_request(body, chat=True)
    assert req.messages == [{"role": "user", "content": "ab"}]
    assert req.params.max_tokens == 5 and req.stream and req.include_usage and req.max_tokens_given


@pytest.mark.parametrize(
    "body,param",
    [
        ({"prompt": ""}, "prompt"),
        ({"prompt": "x", "temperature": 2.5}, "temperature"),
        ({"prompt": "x", "temperature": "hot"}, "temperature"),
        ({"prompt": "x", "top_p": 0}, None),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "x", "max_tokens": True}, "max_tokens"),
        ({"prompt": "x", "n": 2}, "n"),
        ({"prompt": "x", "logprobs": 3}, "logprobs"),
        ({"prompt": "x", "stop": ["a", ""]}, "stop"),
        ({"prompt": "x", "stream": "yes"}, "stream"),
        ({"prompt": ["a", "b"]}, "prompt"),
        ({"prompt": "x", "echo": True}, "echo"),
        ({"prompt": "x", "presence_penalty": 0.5}, "presence_penalty"),
        ({"prompt": "x", "seed": 2**64}, "seed"),  # torch.Generator.manual_seed would overflow
        ({"prompt": "x", "seed": -1}, "seed"),
        ({"prompt": "a\ud800b"}, "prompt"),  # a lone surrogate: not encodable as UTF-8
        ({"prompt": "x", "stop": ["\udfff"]}, "stop"),
        ({"prompt": "x", "cache_salt": "\ud800"}, "cache_salt"),
        ({"prompt": "x", "user": {"\ud800": 1}}, "user"),
    ],
)
def test_bad_values_are_400_with_the_parameter(body: dict[str, Any], param: str | None) -> None:
    with pytest.raises(APIError) as e:
        parse_request(body, chat=False)
    assert e.value.status == 400 and e.value.param == param and e.value.message
    assert e.value.body()["error"]["type"] == "invalid_request_error"


def test_seed_range_and_lone_surrogates_in_chat() -> None:
    assert parse_request({"prompt": "x", "seed": 2**64 - 1}, chat=False).params.seed == 2**64 - 1
    assert parse_request({"prompt": "x", "seed": 0}, chat=False).params.seed == 0
    for msg in ({"role": "user", "content": "a\ud800b"}, {"role": "\udc00", "content": "hi"}):
        with pytest.raises(APIError) as e:
            parse_request({"messages": [msg]}, chat=True)
        assert e.value.status == 400 and e.value.param == "messages"
        assert "lone surrogate" in e.value.message
    with pytest.raises(APIError) as e:
        parse_request({"prompt": "x", "\ud800": 1}, chat=False)
    assert e.value.param is None  # the bad key is not echoed back (it cannot be encoded either)
    assert parse_request({"prompt": "a\U0001f600b"}, chat=False).prompt == "a\U0001f600b"  # a pair is fine


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"api_key": ""}, "--api-key must not be empty"),
        ({"max_body_bytes": 0}, "--max-body-bytes must be at least 1, got 0"),
        ({"max_prompt_tokens": 0}, "--max-prompt-tokens must be at least 1, got 0"),
        ({"model_name": ""}, "--served-model-name must not be empty"),
    ],
)
def test_app_settings_reject_values_that_would_lock_out_every_request(
    kwargs: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        AppSettings(**{"model_name": "m", **kwargs})


def test_serve_config_names_the_flag() -> None:
    with pytest.raises(ConfigError, match="--max-num-batched-tokens must be at least 1, got 0"):
        ServeConfig(max_num_batched_tokens=0)
    with pytest.raises(ConfigError, match="--num-pages must be at least 1"):
        ServeConfig(num_pages=0)


def test_chat_needs_messages() -> None:
    with pytest.raises(APIError, match="messages"):
        parse_request({"messages": []}, chat=True)
    with pytest.raises(APIError, match="JSON object"):
        parse_request([1, 2], chat=True)


def test_serve_subcommand_parses_and_rejects_bad_sizes_before_loading(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = build_parser().parse_args(["serve", "--port", "9001", "--page-size", "32", "--max-num-seqs", "8"])
    assert (args.host, args.port, args.page_size, args.max_num_seqs) == ("127.0.0.1", 9001, 32, 8)
    assert main(["serve", "--page-size", "0"]) == 2
    assert capsys.readouterr().err.strip() == "kvtier: error: --page-size must be at least 1, got 0"
    assert main(["serve", "--port", "70000"]) == 2


def test_metric_labels_are_escaped() -> None:
    assert _escape('a"b\\c') == 'a\\"b\\\\c'


def test_check_stop_holds_back_a_possible_stop_string() -> None:
    p = SamplingParams(max_tokens=5, stop=("END",))
    assert check_stop([1], "abcE", p, {9}, False) == ("ab", None)  # "cE" could begin "END"
    assert check_stop([1, 2], "abcEND!", p, {9}, False) == ("abc", "stop")
    assert check_stop([9], "ab", SamplingParams(), {9}, False) == ("ab", "stop")
    assert check_stop([9], "ab", SamplingParams(ignore_eos=True), {9}, True) == ("ab", "length")
    assert check_stop([1], "a\ufffd", SamplingParams(), {9}, False) == (None, None)
    assert check_stop([1] * 5, "abcEN", p, {9}, False) == ("abcEN", "length")


def test_serve_takes_8k_token_steps_on_cuda_and_512_on_the_cpu_unless_told() -> None:
    from kvtier.cli.serve_cmd import CPU_STEP_TOKENS, GPU_STEP_TOKENS, step_tokens

    assert (GPU_STEP_TOKENS, CPU_STEP_TOKENS) == (8192, 512)
    assert step_tokens(None, "cuda") == 8192 and step_tokens(None, "cpu") == 512
    assert step_tokens(2048, "cuda") == 2048 and step_tokens(2048, "cpu") == 2048
