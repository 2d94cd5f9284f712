"""edgellm: an on-device LLM runtime for ARM SoCs with a Mali GPU and an NPU."""
from .errors import (Cancelled, ConfigError, ContextFull, EdgeLLMError, ModelFormatError,  # noqa: F401
                     ModelNotFoundError, PullError, UnsupportedModelError)

__version__ = "0.1.0"


def load(*args, **kwargs):
    """edgellm.load(model=None, device=None, ...) -> Engine; see edgellm.api.load."""
    # the OpenCL probe child runs while the runtime is imported (api.load discards it if the device
    # profile lists no OpenCL GPU)
    from .backends import opencl_child

    opencl_child.spawn()
    from .api import load as _load

    return _load(*args, **kwargs)
