"""Turning a GGUF file into a Hugging Face model folder, once, cached on disk.

kvtier's model runner loads Hugging Face folders (`config.json` + safetensors). A GGUF file is
converted with transformers' own GGUF support: the config, the tokenizer and the dequantized
tensors (with llama.cpp's Q/K row permutation already undone) come from transformers, so kvtier
carries no dequantization code of its own and matches `from_pretrained(..., gguf_file=...)`
bit for bit.

The folder it writes::

    <cache root>/gguf/<stem>-<key>/
        config.json              model_type, shapes, tie_word_embeddings, dtype "float32"
        generation_config.json   bos / eos / pad ids
        model.safetensors        HF names: model.embed_tokens.weight, model.layers.N.self_attn.
                                 q_proj.weight, ..., model.norm.weight (+ lm_head.weight if untied)
        tokenizer.json
        tokenizer_config.json    special tokens and the chat template

`<cache root>` is `cache_dir`, else `$KVTIER_CACHE_DIR`, else `~/.cache/kvtier`; `<key>` is the
first 16 hex digits of a hash of the file's size, mtime and name (and this converter's format
version), so an edited or replaced file converts again.

NOTE: weights are stored in float32, because that is what the dequantization yields (a Q4_1
value is `scale * q + min` computed in float32, which float16/bfloat16 cannot hold exactly). The
stored tensors are therefore exactly the ones transformers would load; the model runner casts
them to its compute dtype. It costs 4 bytes per parameter: 0.54 GB for a 135M model.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvtier.config import SUPPORTED_MODEL_TYPES, ModelConfig
from kvtier.errors import ModelLoadError

_FORMAT_VERSION = 1
"""Bump when the folder layout changes, so old cached folders are not reused."""

_GGUF_MAGIC = b"GGUF"
_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json")
_STALE_TEMP_S = 86400.0
"""A temp folder untouched for a day is a crashed conversion's leftover and is removed."""


def cache_root(cache_dir: Path | str | None = None) -> Path:
    """kvtier's cache folder: `cache_dir`, else `$KVTIER_CACHE_DIR`, else `~/.cache/kvtier`."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get("KVTIER_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "kvtier"


def gguf_cache_folder(path: Path | str, cache_dir: Path | str | None = None) -> Path:
    """Where `gguf_to_hf_folder` puts (or has put) the conversion of `path`. Creates nothing."""
    path = Path(path)
    st = path.stat()
    ident = f"v{_FORMAT_VERSION}:{st.st_size}:{st.st_mtime_ns}:{path.name}"
    key = hashlib.sha256(ident.encode()).hexdigest()[:16]
    return cache_root(cache_dir) / "gguf" / f"{path.stem}-{key}"


def gguf_to_hf_folder(path: Path | str, cache_dir: Path | str | None = None) -> Path:
    """The Hugging Face folder converted from the GGUF file at `path`, converting it if needed.

    The first call for a file converts it (tens of seconds for a 100 MB file on a CPU) and notes
    that on stderr; later calls find the cached folder and return at once, without importing
    transformers. The folder is written under a temp name and renamed into place, so a crash
    never leaves a half-written folder behind. Raises `ModelLoadError` when the file is missing,
    is not a GGUF file, or holds an architecture transformers or kvtier cannot run.
    """
    path = Path(path).expanduser()
    _check_gguf_file(path)
    final = gguf_cache_folder(path, cache_dir)
    if _is_complete(final):
        return final
    try:
        if final.exists():
            shutil.rmtree(final)  # an incomplete folder someone edited by hand; convert again
        final.parent.mkdir(parents=True, exist_ok=True)
        _remove_stale_temps(final)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    except OSError as e:
        raise ModelLoadError(
            f"cannot write the conversion cache at {final.parent}: {e}; "
            "set KVTIER_CACHE_DIR to a writable folder"
        ) from None

    size_mb = path.stat().st_size / 1e6
    print(
        f"kvtier: converting {path.name} to a cached HF folder (one time, ~{_estimate_s(size_mb):.0f} s)",
        file=sys.stderr,
    )
    try:
        _write_hf_folder(path, tmp)
        _make_readable(tmp)
        try:
            os.rename(tmp, final)
        except OSError as e:
            # A complete `final` means another process finished the same conversion first.
            if not _is_complete(final):
                raise ModelLoadError(f"cannot move the converted folder into {final}: {e}") from None
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def gguf_model_config(path: Path | str, cache_dir: Path | str | None = None) -> ModelConfig:
    """The model config of the GGUF file at `path`, without reading or converting its weights.

    From the converted folder's config.json when `gguf_to_hf_folder` has cached one, else from
    the file's metadata through transformers (the same config the conversion writes; a few
    seconds, no tensors read). Raises `ModelLoadError` like `gguf_to_hf_folder`.
    """
    path = Path(path).expanduser()
    _check_gguf_file(path)
    folder = gguf_cache_folder(path, cache_dir)
    if _is_complete(folder):
        return ModelConfig.from_json(folder / "config.json")
    from transformers import AutoConfig

    config = _from_transformers(
        path, "read the model config", AutoConfig.from_pretrained, str(path.parent), gguf_file=path.name
    )
    return ModelConfig.from_hf_dict(config.to_dict())


def is_gguf_file(path: Path) -> bool:
    """Whether `path` is a readable file that starts with GGUF's magic bytes."""
    try:
        with path.open("rb") as f:
            return f.read(4) == _GGUF_MAGIC
    except OSError:
        return False


def _check_gguf_file(path: Path) -> None:
    if not path.exists():
        raise ModelLoadError(f"GGUF file not found: {path}")
    if not path.is_file():
        raise ModelLoadError(f"{path} is not a file; pass the path of a .gguf file")
    try:
        with path.open("rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise ModelLoadError(f"cannot read {path}: {e}") from None
    if magic != _GGUF_MAGIC:
        raise ModelLoadError(
            f"{path} is not a GGUF file (it does not start with the bytes 'GGUF'); "
            "pass a .gguf file or a Hugging Face model folder"
        )


def _is_complete(folder: Path) -> bool:
    return all((folder / name).is_file() for name in _REQUIRED_FILES)


def _remove_stale_temps(final: Path) -> None:
    now = time.time()
    for leftover in final.parent.glob(f".{final.name}.tmp-*"):
        with contextlib.suppress(OSError):
            if now - leftover.stat().st_mtime > _STALE_TEMP_S:
                shutil.rmtree(leftover, ignore_errors=True)


def _estimate_s(size_mb: float) -> float:
    # Measured on a 2-core CPU: the 98 MB SmolLM2-135M Q4_1 takes 26 s idle, 38 s under load;
    # ~14 s of it is importing transformers and parsing the GGUF metadata twice.
    return 14.0 + 0.17 * size_mb


def _make_readable(folder: Path) -> None:
    # mkdtemp makes the folder 0700 and safetensors writes 0600; a shared cache wants 0755/0644.
    folder.chmod(0o755)
    for file in folder.iterdir():
        file.chmod(0o644)


def _write_hf_folder(path: Path, out: Path) -> None:
    """Write config, weights, tokenizer and generation config of the GGUF at `path` into `out`."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    folder, name = str(path.parent), path.name
    config = _from_transformers(
        path, "read the model config", AutoConfig.from_pretrained, folder, gguf_file=name
    )
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ModelLoadError(
            f"{name} holds a {model_type!r} model; kvtier runs {', '.join(SUPPORTED_MODEL_TYPES)} models"
        )

    # An empty model on the meta device gives transformers the GGUF -> HF name map at no cost.
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    # NOTE: load_gguf_checkpoint draws a tqdm bar on sys.stderr; it is silenced for the
    # conversion (our one-line note replaces it), which hides any other thread's stderr too.
    with contextlib.redirect_stderr(io.StringIO()):
        parsed = _from_transformers(
            path,
            "dequantize the weights",
            load_gguf_checkpoint,
            str(path),
            return_tensors=True,
            model_to_load=skeleton,
            torch_dtype=torch.float32,
        )
    tensors = _checked_tensors(parsed["tensors"], skeleton, config, name)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt", "source": name})
    del tensors, parsed

    config.architectures = [type(skeleton).__name__]
    config.dtype = torch.float32
    config.save_pretrained(out)
    GenerationConfig.from_model_config(config).save_pretrained(out)

    tokenizer = _from_transformers(
        path, "read the tokenizer", AutoTokenizer.from_pretrained, folder, gguf_file=name
    )
    tokenizer.model_max_length = config.max_position_embeddings
    # The chat template goes into tokenizer_config.json rather than a separate .jinja file.
    tokenizer.save_pretrained(out, save_jinja_files=False)


def _from_transformers(path: Path, what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Call transformers' GGUF code; its failures (corrupt file, unknown arch) become ModelLoadError."""
    try:
        return fn(*args, **kwargs)
    except ModelLoadError:
        raise
    except Exception as e:
        raise ModelLoadError(f"cannot {what} of {path.name} with transformers: {e}") from e


def _checked_tensors(tensors: dict[str, Any], skeleton: Any, config: Any, name: str) -> dict[str, Any]:
    """The tensors in HF names, checked against the model's parameters (tied lm_head dropped)."""
    expected = {k: tuple(v.shape) for k, v in skeleton.state_dict().items()}
    if getattr(config, "tie_word_embeddings", False):
        expected.pop("lm_head.weight", None)
        tensors.pop("lm_head.weight", None)
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise ModelLoadError(
            f"{name} lacks {len(missing)} tensor(s) the {config.model_type} model needs, e.g. {missing[:3]}"
        )
    for k, shape in expected.items():
        if tuple(tensors[k].shape) != shape:
            raise ModelLoadError(
                f"{name}: tensor {k} has shape {tuple(tensors[k].shape)}, the model expects {shape}"
            )
    return {k: tensors[k].contiguous() for k in sorted(expected)}
