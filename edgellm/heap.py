"""Hands back to the OS the heap pages that load's temporary objects left free."""
from __future__ import annotations

import ctypes


def release_free_pages() -> bool:
    """glibc keeps freed heap memory mapped until it is reused: building the tokenizer frees
    ~2.5 MB of temporaries on SmolLM2 that would otherwise stay resident for the life of the
    engine. malloc_trim(0) returns every free page. True if it released any; False where the C
    library has no malloc_trim (bionic, musl), which is then a no-op."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return False
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return bool(trim(0))
