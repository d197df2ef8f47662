"""Exceptions that carry a message a user can act on.

Every error kvtier raises on bad input is a :class:`KvtierError`; the CLI prints its message
on one line and exits non-zero instead of showing a traceback.
"""

from __future__ import annotations


class KvtierError(Exception):
    """Base class: the message says what was wrong and what to do about it."""


class ConfigError(KvtierError):
    """An option or a combination of options is invalid."""


class ModelLoadError(KvtierError):
    """A model folder, file or preset could not be loaded."""


class PromptError(KvtierError):
    """A prompt is empty or longer than the model can take."""


class CapacityError(KvtierError):
    """A context does not fit the GPU or host memory budget."""


class HostCapacityError(CapacityError):
    """A context does not fit the host memory budget (whatever the GPU budget)."""


def raised_at(exc: BaseException, package: str = "kvtier") -> str:
    """Where in `package` `exc` was raised: 'path/file.py:line in function' of the innermost
    traceback frame under the package (so an out-of-memory error names the allocation that did
    not fit, not torch's internals); '' when no frame is."""
    import traceback

    site = ""
    for frame in traceback.extract_tb(exc.__traceback__):
        parts = frame.filename.replace("\\", "/").split("/")
        if package in parts[:-1]:
            rel = "/".join(parts[len(parts) - 1 - parts[::-1].index(package) :])
            site = f"{rel}:{frame.lineno} in {frame.name}"
    return site
