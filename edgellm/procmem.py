"""This process's memory facts: the resident pages of one file's mappings (/proc/self/smaps), its
resident and peak memory (/proc/self/status), and the memory the system has available
(/proc/meminfo)."""
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
    """Memory new allocations can take: the least of the system's MemAvailable, this process's
    cgroup headroom (memory.max - memory.current; v1: limit_in_bytes - usage_in_bytes: a
    container's or an Android app's memcg) and its address-space rlimit headroom (RLIMIT_AS -
    VmSize: `ulimit -v`). MemAvailable alone let a limited process start a load that then
    failed with ENOMEM or a MemoryError traceback."""
    limits = [_meminfo(b"MemAvailable:", "available"), _cgroup_headroom(), _rlimit_headroom()]
    return max(0, min(x for x in limits if x is not None))


def _rlimit_headroom() -> int | None:
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_AS)
        if soft == resource.RLIM_INFINITY:
            return None
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(b"VmSize:"):
                    return soft - int(line.split()[1]) * 1024
    except (ImportError, OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_headroom(root: str = "/sys/fs/cgroup", proc: str = "/proc/self/cgroup") -> int | None:
    """memory.max - memory.current of this process's cgroup (v2), or limit - usage (v1); None
    when there is no limit or no cgroup to read."""
    try:
        with open(proc, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if controllers == "":                                   # v2: "0::/path"
            files = (f"{root}{path}/memory.max", f"{root}{path}/memory.current")
        elif "memory" in controllers.split(","):                # v1: "N:memory:/path"
            files = (f"{root}/memory{path}/memory.limit_in_bytes", f"{root}/memory{path}/memory.usage_in_bytes")
        else:
            continue
        try:
            with open(files[0], encoding="ascii") as f:
                limit = f.read().strip()
            with open(files[1], encoding="ascii") as f:
                used = int(f.read().strip())
        except (OSError, ValueError):
            continue
        if limit == "max" or not limit.isdigit() or int(limit) >= 1 << 60:   # (v1 writes a huge number)
            continue
        return int(limit) - used
    return None


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


def reset_peak_rss() -> bool:
    """Reset this process's peak resident memory (VmHWM) to the current RSS, so a later reading
    is the peak of what follows (Linux: /proc/self/clear_refs, 5); False where that cannot be
    done (the peak then stays the process's)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def status_mb(field: bytes) -> float | None:
    """A kB figure of /proc/self/status (b"VmRSS", b"VmHWM") in MB; None where it cannot be read."""
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(field + b":"):
                    return int(line.split()[1]) / 1024.0
    except (OSError, ValueError, IndexError):
        pass
    return None


def resident_mb() -> float:
    """This process's resident memory now, MB (2^20 bytes, as peak_rss_mb). Linux: VmRSS (load
    imports no psutil: its import footprint is checked); elsewhere psutil's."""
    now = status_mb(b"VmRSS")
    if now is not None:
        return now
    import psutil

    return psutil.Process().memory_info().rss / 2**20
