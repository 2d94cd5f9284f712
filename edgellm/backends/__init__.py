"""The compute units edgellm knows, and how to get each one's backend module.

A backend module exposes NAME, KIND ("cpu" | "gpu" | "npu"), available() -> (bool, reason),
supports(op_kind, precision) -> (bool, reason), prepare(model, precision, progress) -> weights,
and one function per op kind (embedding, rmsnorm, matmul, rope, attention, swiglu, add, lm_head).
"""
from __future__ import annotations

import importlib
from types import ModuleType

from ..errors import EdgeLLMError

# Units in the order the dispatcher lists them; reference last: it runs everything, slowly.
KNOWN = ("neon", "opencl", "npu", "reference")
_REGISTERED: dict[str, ModuleType] = {}


class UnitFailed(EdgeLLMError):
    """A unit whose probe passed failed while preparing this model (a model-specific kernel that
    does not build, a subgraph its runtime rejects). `ops`: the engine ops concerned, when only
    they are affected (the engine re-plans them elsewhere); empty: the whole unit is out."""

    def __init__(self, unit: str, reason: str, ops: tuple[str, ...] = ()):
        self.unit, self.reason, self.ops = unit, reason, tuple(ops)
        where = f" ({', '.join(self.ops)})" if self.ops else ""
        super().__init__(f"unit {unit}{where}: {reason}")


def register(module) -> None:
    """Add a backend (tests register fakes; a plug-in may register its own)."""
    _REGISTERED[module.NAME] = module


def unregister(name: str) -> None:
    _REGISTERED.pop(name, None)


def names() -> tuple[str, ...]:
    return tuple(dict.fromkeys((*KNOWN, *_REGISTERED)))


def get(name: str):
    """(module, "") or (None, why not). Never raises for a known or registered name: a backend
    whose module is absent or fails to import is simply unavailable, with the reason."""
    if name in _REGISTERED:
        return _REGISTERED[name], ""
    if name not in KNOWN:
        return None, f"unknown unit {name!r} (known: {', '.join(names())})"
    try:
        return importlib.import_module(f"{__name__}.{name}"), ""
    except ModuleNotFoundError as e:
        if e.name == f"{__name__}.{name}":
            return None, f"the {name} backend is not part of this build yet"
        return None, f"the {name} backend needs the missing module {e.name!r}"
    except Exception as e:  # a broken optional dependency must not take the engine down
        return None, f"the {name} backend failed to import: {type(e).__name__}: {e}"
