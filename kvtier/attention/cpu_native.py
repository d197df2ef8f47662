"""The native CPU decode kernel: `cpu_decode.cpp` with its thread pool `cpu_pool.cpp`, built by
the system compiler at first use into kvtier's cache folder (once per source, compiler and
machine) and called through ctypes (`kvtier.attention.cpu_decode.CpuDecoder` runs it). Without a
compiler, or when the build fails, `native_library()` is None and the torch backend is used.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from kvtier.attention.row_formats import ROW_KINDS

MAX_NATIVE_DIM = 512  # the largest head dim the native kernel takes
_SOURCES = tuple(Path(__file__).with_name(f) for f in ("cpu_decode.cpp", "cpu_pool.cpp"))
# NOTE: the headers cpu_decode.cpp includes (one translation unit): hashed into the cache key
# with the sources, so an edited header rebuilds the library, but never passed to the compiler.
_HEADERS = tuple(sorted(Path(__file__).parent.glob("*.h")))
_FLAGS = ("-O3", "-march=native", "-funroll-loops", "-pthread", "-shared", "-fPIC")
_KERNEL_ARGS = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_float]
_KERNEL_ARGS += [ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]


def _cache_dir() -> Path:
    # NOTE: the same folder as kvtier.loading.gguf.cache_root (not imported: the attention layer
    # may not import kvtier.loading).
    env = os.environ.get("KVTIER_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "kvtier"


@functools.cache
def native_library() -> ctypes.CDLL | None:
    """The compiled kernel and its thread pool, built once per source, compiler and machine;
    None when no C++ compiler is found or the build fails (the torch backend is used instead)."""
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        return None
    source = b"".join(f.read_bytes() for f in (*_SOURCES, *_HEADERS))
    key = hashlib.sha256(source + " ".join((cxx, *_FLAGS, os.uname().machine)).encode()).hexdigest()[:16]
    lib = _cache_dir() / "cpu_decode" / f"cpu_decode-{key}.so"
    if not lib.exists():
        lib.parent.mkdir(parents=True, exist_ok=True)
        # NOTE: built under a temporary name and renamed, so concurrent processes never load a
        # half-written library.
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=lib.parent)
        os.close(fd)
        try:
            cmd = [cxx, *_FLAGS, *map(str, _SOURCES), "-o", tmp]
            done = subprocess.run(cmd, capture_output=True, timeout=300)
            if done.returncode != 0:
                print(
                    f"kvtier: CPU attention kernel did not build, using torch: {done.stderr[-400:]!r}",
                    file=sys.stderr,
                )
                return None
            os.replace(tmp, lib)
        except (OSError, subprocess.TimeoutExpired):
            return None
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    dll = ctypes.CDLL(str(lib))
    for name in ("kvtier_decode_f32", "kvtier_decode_bf16", *(f"kvtier_decode_{f}" for f in ROW_KINDS)):
        fn = getattr(dll, name)
        fn.argtypes = _KERNEL_ARGS
        fn.restype = ctypes.c_int
    dll.kvtier_pool_new.argtypes = [ctypes.c_int]
    dll.kvtier_pool_new.restype = ctypes.c_void_p
    dll.kvtier_pool_free.argtypes = [ctypes.c_void_p]
    dll.kvtier_pool_free.restype = None
    dll.kvtier_pool_run.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
    dll.kvtier_pool_run.argtypes += [ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_float]
    dll.kvtier_pool_run.argtypes += [ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
    dll.kvtier_pool_run.restype = ctypes.c_int
    dll.kvtier_merge.argtypes = [ctypes.c_int64, ctypes.c_int, ctypes.c_int] + [ctypes.c_void_p] * 4
    dll.kvtier_merge.restype = None
    dll.kvtier_wide.argtypes = [ctypes.c_int]
    dll.kvtier_wide.restype = ctypes.c_int
    return dll


def wide_vectors(on: bool | None = None) -> bool | None:
    """Whether the native kernel attends bf16 tokens and 4-bit rows (head dims a multiple of 32)
    16 floats a vector (AVX-512 targets; on by default), after setting it when `on` is given (an
    A/B switch for checks and benchmarks: the 8-float paths give the same values up to fp32
    summation order). None: no native kernel, or its target has no such path."""
    lib = native_library()
    if lib is None:
        return None
    got = int(lib.kvtier_wide(-1 if on is None else int(on)))
    return None if got < 0 else bool(got)
