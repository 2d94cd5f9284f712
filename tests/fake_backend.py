"""A second backend for dispatcher tests: a pretend GPU that runs matmuls only, with the
reference backend's numpy code (so outputs must match bit for bit) and a call counter (so a test
can see the plan was followed). Register it with edgellm.backends.register(fake_backend)."""
from __future__ import annotations

from collections import Counter

from edgellm.backends import reference
from edgellm.costmodel import Unit

NAME = "fake"
KIND = "gpu"
calls: Counter = Counter()
state = {"available": (True, "fake unit for tests"), "peak": 1e15, "transfer_s": 1e-7,
         "curve": ()}      # (tokens, FLOP/s) GEMM curve; () = the peak at every size


def available():
    return state["available"]


def supports(op_kind: str, precision: str = "fp32"):
    if op_kind in ("matmul", "lm_head"):
        return True, "fake runs matmuls"
    return False, f"fake runs only matmuls, not {op_kind}"


def prepare(model, precision: str = "fp32", progress=None, ops=None):
    return reference.prepare(model, precision, progress, ops)


def cost_unit(profile) -> Unit:
    """A unit far faster than the CPU at GEMMs, cheap to hand data to (tests change `state`)."""
    return Unit(NAME, KIND, {"fp32": state["peak"]}, profile.memory_bandwidth * 10, 1e-7,
                transfer_s=state["transfer_s"], zero_copy=True, op_kinds=frozenset({"matmul", "lm_head"}),
                gemm_curve=tuple(state["curve"]))


def matmul(x, w, b=None):
    calls["matmul"] += 1
    return reference.matmul(x, w, b)


def lm_head(x, w):
    calls["lm_head"] += 1
    return reference.lm_head(x, w)
