"""Typed errors. Each says what was expected and what was found, and names the file/field."""
from __future__ import annotations


class EdgeLLMError(Exception):
    """Base of every error edgellm raises on purpose; the CLI prints these as one line."""


class ModelFormatError(EdgeLLMError):
    """A model file is malformed or inconsistent. Raised before any large allocation."""

    def __init__(self, path: str, field: str, message: str):
        self.path = str(path)
        self.field = field
        self.message = message
        super().__init__(f"{self.path}: {field}: {message}")


class UnsupportedModelError(ModelFormatError):
    """A well-formed model that edgellm cannot run (architecture, tensor type)."""


class ModelNotFoundError(EdgeLLMError):
    """A model name or path that resolves to nothing."""


class PullError(EdgeLLMError):
    """Fetching or verifying a model package failed."""


class ConfigError(EdgeLLMError):
    """A bad argument or setting (sampling parameter, thread count, ...)."""


class OpArgumentError(ConfigError, ValueError):
    """A kernel op's arguments do not fit together (shapes, dtypes, ranges): refused before the
    native code reads them (a ValueError too, as numpy raises for mismatched shapes)."""


class KernelError(EdgeLLMError, RuntimeError):
    """A native kernel refused its arguments or ran out of memory; nothing was written."""


class TokenIdError(ConfigError, IndexError):
    """A token id outside the vocabulary (an IndexError too, as for any sequence)."""


class ContextFull(EdgeLLMError):
    """The request needs more KV positions than the cache holds."""


class Cancelled(EdgeLLMError):
    """Raised by the engine's runner (ModelRunner.forward) when a CancelToken fires between
    prefill chunks; the engine stays reusable. A cancelled generate / stream / Scheduler request
    does not raise it: it ends with the text so far and stop_reason "cancelled"."""


def shown(value: object, limit: int = 200) -> str:
    """A bad value as an error message shows it: its repr, cut at `limit` characters, or its
    type's name where repr itself fails (an app's object whose __repr__ raised turned a typed
    refusal into its own exception)."""
    try:
        text = repr(value)
    except Exception:   # noqa: BLE001 - any failure of someone else's __repr__
        return f"<{type(value).__name__} object>"
    return text if len(text) <= limit else text[:limit] + "..."
