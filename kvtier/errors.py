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
