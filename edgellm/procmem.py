"""This process's memory facts: the resident pages of one file's mappings (/proc/self/smaps), and
the memory the system has available (/proc/meminfo)."""
from __future__ import annotations

import os


def file_rss_mb(path: str | os.PathLike) -> float | None:
    """MB (2^20 bytes) of `path`'s pages resident in this process's mappings of it: for a model,
    the part of its weights paged in. None where /proc/self/smaps cannot be read (not Linux)."""
    want = os.path.realpath(path).encode()
    kb = 0
    mine = False
    try:
        with open("/proc/self/smaps", "rb") as f:
            for line in f:
                if line[:1] in b"0123456789abcdef" and b"-" in line.split(b" ", 1)[0]:
                    # a mapping's header: "start-end perms offset dev inode   path"
                    fields = line.split(None, 5)
                    mine = len(fields) == 6 and fields[5].rstrip(b"\n") == want
                elif mine and line.startswith(b"Rss:"):
                    kb += int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return kb / 1024.0


def available_bytes() -> int:
    """Memory available to new allocations without swapping (MemAvailable)."""
    return _meminfo(b"MemAvailable:", "available")


def total_bytes() -> int:
    """The system's memory (MemTotal)."""
    return _meminfo(b"MemTotal:", "total")


def _meminfo(key: bytes, psutil_field: str) -> int:
    """A /proc/meminfo figure in bytes, or psutil's where that cannot be read. psutil is imported
    only then: on Linux a load would otherwise carry its ~1.8 MB of resident modules for it."""
    try:
        with open("/proc/meminfo", "rb") as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    import psutil

    return int(getattr(psutil.virtual_memory(), psutil_field))
