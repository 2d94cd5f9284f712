"""The OpenCL probe child process (backends/opencl_probe.py), startable before the rest of
edgellm is imported. This module imports nothing heavy (no numpy, no pyopencl): edgellm.load()
calls spawn() first, so that the child (~0.4 s with PoCL here: its own imports, the driver, the
cached kernels, a self-check) runs while this process imports the runtime (~0.25 s) and parses
the model; opencl.available() then takes the child's answer instead of waiting for a new one.
A child that turns out not to be needed (the device profile lists no OpenCL GPU, or the units
asked for exclude it) is killed by discard(). When the probe passed before on the same driver and
kernels (backends/opencl_probe_cache.py), spawn() takes that answer instead and starts nothing.
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import threading
import time

from . import opencl_probe_cache

_lock = threading.Lock()
_child: list = []          # [(Popen, start time)] while one runs unclaimed
_answered = [False]        # this process has the probe's answer (opencl.available): no more children
_cached: list = []         # [answer] found in the probe cache by spawn(), until take_cached()


def has_pyopencl() -> bool:
    return importlib.util.find_spec("pyopencl") is not None


def spawn() -> str | None:
    """Starts the child unless one runs already, its answer is cached, or pyopencl is missing;
    returns why it could not start (an OSError's text), else None."""
    with _lock:
        if _child or _cached or _answered[0] or not has_pyopencl():
            return None
        answer = opencl_probe_cache.load()
        if answer is not None:
            _cached.append(answer)
            return None
        try:
            proc = subprocess.Popen([sys.executable, "-m", "edgellm.backends.opencl_probe"],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        except OSError as e:
            return str(e)
        _child.append((proc, time.monotonic()))
        return None


def take():
    """(Popen, start time) of the running child, handed over (forgotten here); None if none."""
    with _lock:
        return _child.pop() if _child else None


def take_cached() -> dict | None:
    """The cached answer spawn() found instead of starting a child, handed over; None if none."""
    with _lock:
        return _cached.pop() if _cached else None


def set_answered(answered: bool) -> None:
    """opencl.available() has its answer (True), or forgot it (opencl.reset: False)."""
    with _lock:
        _answered[0] = answered
        if not answered:
            _cached.clear()


def discard() -> None:
    """Kills and reaps an unclaimed child."""
    child = take()
    if child is not None:
        child[0].kill()
        child[0].communicate()


def _after_fork_in_child() -> None:
    # every load() spawns under _lock: a fork while another thread held it left it held for good
    # in the child, whose every load() then waited forever (a probe forking beside a loading
    # thread). A running probe child is the parent's to reap.
    global _lock
    _lock = threading.Lock()
    _child.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
