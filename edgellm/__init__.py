"""edgellm: an on-device LLM runtime for ARM SoCs with a Mali GPU and an NPU."""
from .errors import (Cancelled, ConfigError, ContextFull, EdgeLLMError, ModelFormatError,  # noqa: F401
                     ModelNotFoundError, PullError, UnsupportedModelError)

__version__ = "0.1.0"


def load(*args, **kwargs):
    """edgellm.load(model=None, device=None, *, n_ctx=None, threads=None, prefill_chunk=None,
    kv="pool", kv_precision=None, window=None, sinks=None, units=None, precision=None,
    quality_guard=None, prefault=None, pin=True, progress=None) -> Engine. Every parameter is
    described at edgellm.api.load (help(edgellm.api.load))."""
    # the OpenCL probe child runs while the runtime is imported (api.load discards it if the device
    # profile lists no OpenCL GPU)
    from .backends import opencl_child

    opencl_child.spawn()
    try:
        from .api import load as _load

        return _load(*args, **kwargs)
    except BaseException:
        # a load that fails before the probe's answer is collected (a missing model, a bad
        # argument, Ctrl-C) must not leave the child running past this process
        opencl_child.discard()
        raise


def __getattr__(name: str):
    """edgellm.CancelToken, Engine, GenerationConfig and Scheduler, imported on first use (the
    package itself stays light to import)."""
    if name == "CancelToken":
        from .engine import CancelToken
        return CancelToken
    if name in ("Engine", "GenerationConfig"):
        from . import api
        return getattr(api, name)
    if name == "Scheduler":
        from .scheduler import Scheduler
        return Scheduler
    raise AttributeError(f"module 'edgellm' has no attribute {name!r}")
