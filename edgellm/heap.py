"""Hands back to the OS the heap pages that load's temporary objects left free; keeps huge pages
out of sparse scratch."""
from __future__ import annotations

import ctypes
import errno


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


MADV_NOHUGEPAGE = 15    # linux/mman.h


def madvise(addr: int, length: int, advice: int) -> int:
    """madvise(2): 0 when taken, else the errno (EINVAL where the C library has no madvise)."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return errno.EINVAL
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return 0 if fn(addr, length, advice) == 0 else ctypes.get_errno()


def no_huge_pages(arr) -> bool:
    """Keeps transparent huge pages out of a large, sparsely touched array (a native step's
    scratch, whose regions for fp32 inputs stay untouched with quantized weights). numpy advises
    huge pages for arrays of 4 MiB and more, and one touched byte then makes a whole 2 MiB
    resident. True if the kernel took the advice; False without madvise (or for an array under
    a page), where nothing changes."""
    page = 4096
    start = (arr.ctypes.data + page - 1) & ~(page - 1)
    end = (arr.ctypes.data + arr.nbytes) & ~(page - 1)
    return end > start and madvise(start, end - start, MADV_NOHUGEPAGE) == 0
