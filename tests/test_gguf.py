"""GGUF -> Hugging Face folder conversion, checked against transformers' own GGUF loading.

The embedded SmolLM2-135M-Instruct GGUF is converted once per session (`embedded_hf_dir`);
the reference model and tokenizer are read straight from the GGUF by transformers.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors import safe_open

from kvtier.config import ModelConfig
from kvtier.errors import ModelLoadError
from kvtier.loading.embedded import EMBEDDED_MODEL_NAME, embedded_gguf_path
from kvtier.loading.gguf import gguf_cache_folder, gguf_to_hf_folder

HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB = 576, 30, 9, 3, 64, 1536, 49152


@pytest.fixture(scope="module")
def gguf_model() -> Any:
    """SmolLM2 built by transformers straight from the GGUF, in float32.

    NOTE: `from_pretrained(..., gguf_file=...)` refuses to run without `accelerate`, which kvtier
    does not depend on; for a llama GGUF it does exactly this (the legacy GGUF path of
    `GgufHfQuantizer.get_state_dict`): build the model from the GGUF's config and fill it with
    `load_gguf_checkpoint`'s tensors.
    """
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = embedded_gguf_path()
    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(
        str(path), return_tensors=True, model_to_load=model, torch_dtype=torch.float32
    )
    missing, unexpected = model.load_state_dict(tensors["tensors"], strict=False)
    assert (missing, unexpected) == (["lm_head.weight"], [])
    model.tie_weights()
    return model.eval()


@pytest.fixture(scope="module")
def gguf_tokenizer() -> Any:
    from transformers import AutoTokenizer

    path = embedded_gguf_path()
    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def _write_tiny_gguf(path: Path, arch: str) -> Path:
    """A minimal valid GGUF file of architecture `arch` with one tensor."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_context_length(16)
    writer.add_embedding_length(8)
    writer.add_head_count(2)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_embedded_gguf_is_installed() -> None:
    path = embedded_gguf_path()
    assert path.is_file()
    assert path.name == f"{EMBEDDED_MODEL_NAME}.Q4_1.gguf"
    assert path.read_bytes()[:4] == b"GGUF"


def test_folder_layout(embedded_hf_dir: Path) -> None:
    names = {p.name for p in embedded_hf_dir.iterdir()}
    assert names == {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    }
    assert embedded_hf_dir.name == gguf_cache_folder(embedded_gguf_path(), embedded_hf_dir.parent.parent).name
    assert not list(embedded_hf_dir.parent.glob(f".{embedded_hf_dir.name}.tmp-*"))  # no temp leftovers


def test_config_is_smollm2_135m(embedded_hf_dir: Path) -> None:
    cfg = json.loads((embedded_hf_dir / "config.json").read_text())
    assert cfg["model_type"] == "llama"
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert (cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (30, 9, 3)
    assert (cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]) == (HIDDEN, FFN, VOCAB)
    assert cfg["tie_word_embeddings"] is True
    assert cfg["rope_parameters"] == {"rope_theta": 100000.0, "rope_type": "default"}
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["dtype"]) == (1, 2, "float32")

    mc = ModelConfig.from_json(embedded_hf_dir / "config.json")
    assert (mc.num_layers, mc.num_heads, mc.num_kv_heads, mc.head_dim) == (LAYERS, HEADS, KV_HEADS, HEAD_DIM)
    assert mc.tie_word_embeddings and mc.eos_token_ids == (2,)
    assert mc.num_parameters() == 134_515_008

    gen = json.loads((embedded_hf_dir / "generation_config.json").read_text())
    assert (gen["bos_token_id"], gen["eos_token_id"], gen["pad_token_id"]) == (1, 2, 2)


def test_safetensors_names_and_shapes(embedded_hf_dir: Path) -> None:
    layer = {
        "input_layernorm.weight": (HIDDEN,),
        "post_attention_layernorm.weight": (HIDDEN,),
        "self_attn.q_proj.weight": (HEADS * HEAD_DIM, HIDDEN),
        "self_attn.k_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
        "self_attn.v_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
        "self_attn.o_proj.weight": (HIDDEN, HEADS * HEAD_DIM),
        "mlp.gate_proj.weight": (FFN, HIDDEN),
        "mlp.up_proj.weight": (FFN, HIDDEN),
        "mlp.down_proj.weight": (HIDDEN, FFN),
    }
    expected = {"model.embed_tokens.weight": (VOCAB, HIDDEN), "model.norm.weight": (HIDDEN,)}
    for i in range(LAYERS):
        expected.update({f"model.layers.{i}.{k}": v for k, v in layer.items()})

    with safe_open(str(embedded_hf_dir / "model.safetensors"), framework="pt") as f:
        assert f.metadata()["format"] == "pt"
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118
        dtypes = {f.get_slice(k).get_dtype() for k in f.keys()}  # noqa: SIM118
    assert shapes == expected  # tied: no lm_head.weight
    assert dtypes == {"F32"}


def test_weights_and_greedy_tokens_match_gguf_loading(embedded_hf_dir: Path, gguf_model: Any) -> None:
    from transformers import AutoModelForCausalLM

    ours = AutoModelForCausalLM.from_pretrained(embedded_hf_dir, dtype=torch.float32).eval()
    theirs_sd = gguf_model.state_dict()
    for name, tensor in ours.state_dict().items():
        assert torch.equal(tensor, theirs_sd[name]), name
    assert ours.lm_head.weight.data_ptr() == ours.model.embed_tokens.weight.data_ptr()

    prompt = torch.tensor([[504, 3575, 282, 4649, 314]])  # "The capital of France is"
    kw: dict[str, Any] = {"max_new_tokens": 8, "do_sample": False, "pad_token_id": 2}
    with torch.no_grad():
        a = ours.generate(prompt, attention_mask=torch.ones_like(prompt), **kw)
        b = gguf_model.generate(prompt, attention_mask=torch.ones_like(prompt), **kw)
    assert a.shape == (1, 13)
    assert a.tolist() == b.tolist()
    assert a[0, 5].item() == 7042  # " Paris": the weights are not just consistent but right


def test_q_k_rows_are_unpermuted(embedded_hf_dir: Path) -> None:
    """llama.cpp interleaves the rotary halves of each Q/K head; the folder has HF's order back.

    Checked against gguf-py's own dequantization: permuting our rows the way llama.cpp's
    converter does must give the GGUF tensor back exactly.
    """
    import gguf

    reader = gguf.GGUFReader(str(embedded_gguf_path()))
    raw = {t.name: t for t in reader.tensors if t.name in ("blk.3.attn_q.weight", "blk.3.attn_k.weight")}

    def to_llama_cpp(w: torch.Tensor, n_head: int) -> np.ndarray:
        # [n_head * D, H] -> per head [2, D/2] halves -> [D/2, 2] interleaved, as convert_hf_to_gguf
        return w.reshape(n_head, 2, HEAD_DIM // 2, HIDDEN).swapaxes(1, 2).reshape(-1, HIDDEN).numpy()

    with safe_open(str(embedded_hf_dir / "model.safetensors"), framework="pt") as f:
        for gguf_name, hf_name, n_head in (
            ("blk.3.attn_q.weight", "model.layers.3.self_attn.q_proj.weight", HEADS),
            ("blk.3.attn_k.weight", "model.layers.3.self_attn.k_proj.weight", KV_HEADS),
        ):
            t = raw[gguf_name]
            want = gguf.dequantize(t.data, t.tensor_type).reshape(n_head * HEAD_DIM, HIDDEN)
            np.testing.assert_array_equal(to_llama_cpp(f.get_tensor(hf_name), n_head), want)


def test_tokenizer_matches_gguf_tokenizer(embedded_hf_dir: Path, gguf_tokenizer: Any) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(embedded_hf_dir)
    assert tok("Hello world")["input_ids"] == gguf_tokenizer("Hello world")["input_ids"] == [19556, 905]
    assert tok("The capital of France is")["input_ids"] == [504, 3575, 282, 4649, 314]
    assert (tok.bos_token, tok.eos_token, tok.pad_token, tok.unk_token) == (
        "<|im_start|>",
        "<|im_end|>",
        "<|im_end|>",
        "<|endoftext|>",
    )
    assert (tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) == (1, 2, 0)
    assert tok.model_max_length == 8192
    assert tok.chat_template == gguf_tokenizer.chat_template
    messages = [{"role": "user", "content": "Hi"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert isinstance(text, str)
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert "chat_template" in json.loads((embedded_hf_dir / "tokenizer_config.json").read_text())


def test_second_call_hits_the_cache(embedded_hf_dir: Path) -> None:
    start = time.perf_counter()
    again = gguf_to_hf_folder(embedded_gguf_path(), embedded_hf_dir.parent.parent)
    assert time.perf_counter() - start < 0.5
    assert again == embedded_hf_dir


def test_cache_dir_from_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("KVTIER_CACHE_DIR", str(tmp_path))
    folder = gguf_cache_folder(embedded_gguf_path())
    assert folder.parent == tmp_path / "gguf"
    assert folder.name.startswith("SmolLM2-135M-Instruct.Q4_1-") and len(folder.name.rsplit("-", 1)[1]) == 16


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="not found"):
        gguf_to_hf_folder(tmp_path / "nope.gguf", tmp_path)


def test_not_a_gguf_file(tmp_path: Path) -> None:
    bogus = tmp_path / "bogus.gguf"
    bogus.write_bytes(b"PK\x03\x04 this is a zip, not a model")
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        gguf_to_hf_folder(bogus, tmp_path)
    with pytest.raises(ModelLoadError, match="not a file"):
        gguf_to_hf_folder(tmp_path, tmp_path)


@pytest.mark.parametrize(
    ("arch", "message"),
    [("foo", "architecture foo is not supported"), ("gpt2", "holds a 'gpt2' model; kvtier runs llama")],
)
def test_unsupported_architecture_leaves_nothing_behind(tmp_path: Path, arch: str, message: str) -> None:
    path = _write_tiny_gguf(tmp_path / f"tiny-{arch}.gguf", arch)
    cache = tmp_path / "cache"
    with pytest.raises(ModelLoadError, match=message):
        gguf_to_hf_folder(path, cache)
    assert list((cache / "gguf").iterdir()) == []


def test_unwritable_cache_dir(tmp_path: Path) -> None:
    path = _write_tiny_gguf(tmp_path / "tiny-llama.gguf", "llama")
    not_a_dir = tmp_path / "cache-is-a-file"
    not_a_dir.write_text("")
    with pytest.raises(ModelLoadError, match=r"cannot write the conversion cache.*KVTIER_CACHE_DIR"):
        gguf_to_hf_folder(path, not_a_dir)
