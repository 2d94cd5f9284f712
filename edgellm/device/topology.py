"""CPU topology: find the big cores, size the thread pool to them, pin every thread there.

On big.LITTLE / DynamIQ SoCs a compute thread that lands on a LITTLE core sets the pace for all
the others, so edgellm runs one thread per big core, pins them, and reads the affinity back.
Sources: /sys/devices/system/cpu/cpuN/cpu_capacity (the kernel's per-core throughput figure,
1024 = the fastest core in the system) and cpuN/cpufreq/cpuinfo_max_freq (kHz).
"""
from __future__ import annotations

import errno
import os
import re
from dataclasses import dataclass
from typing import Iterable, Protocol

SYSFS_CPU = "/sys/devices/system/cpu"
BIG_FRACTION = 0.6          # a cluster is "big" if its score is >= this fraction of the best
CLOCK_SPREAD = 0.9          # ranking by clock: a lowest cluster under this fraction is LITTLE

_CPU_DIR = re.compile(r"cpu(\d+)")


@dataclass(frozen=True)
class DetectedCluster:
    cores: tuple[int, ...]          # logical CPU ids (cpuN), ascending
    max_freq_hz: float | None       # cpuinfo_max_freq converted to Hz; None if unknown
    capacity: int | None            # cpu_capacity (1024 = the fastest core); None if unknown


class _ClusterLike(Protocol):       # DetectedCluster, or profile.CpuCluster from a device profile
    cores: tuple[int, ...]
    max_freq_hz: float | None
    capacity: int | None


@dataclass(frozen=True)
class PinResult:
    requested: frozenset[int]       # cores asked for
    threads: int                    # threads of this process left pinned to `requested`
    readback: frozenset[int]        # calling thread's affinity, read back as pin_threads returns
    mismatched: int                 # threads whose read-back affinity differed from `requested`
    ok: bool                        # every thread runs on exactly `requested`
    reason: str                     # why not, when ok is False; "" when ok


def current_affinity() -> frozenset[int]:
    """The cores this process may run on: its main thread's affinity (all cores where the OS has
    no affinity API). Not the calling thread's: an app that loads from a worker thread it pinned
    to one core gave the engine that core alone, and then every thread of the process."""
    if hasattr(os, "sched_getaffinity"):
        try:
            return frozenset(os.sched_getaffinity(os.getpid()))
        except OSError:
            return frozenset(os.sched_getaffinity(0))
    return frozenset(range(os.cpu_count() or 1))


def _read_positive_int(path: str) -> int | None:
    try:
        with open(path, encoding="ascii") as f:
            text = f.read(65)
        value = int(text) if len(text) <= 64 else 0
    except (OSError, ValueError):       # missing, unreadable, a directory, garbage, non-ASCII
        return None
    return value if value > 0 else None


def detect_clusters(sysfs_root: str = SYSFS_CPU,
                    online: Iterable[int] | None = None) -> tuple[DetectedCluster, ...]:
    """Group the usable cores by (capacity, max frequency), fastest cluster first."""
    allowed = frozenset(online) if online is not None else current_affinity()
    try:
        listed = {int(m.group(1)) for name in os.listdir(sysfs_root)
                  if (m := _CPU_DIR.fullmatch(name))
                  and os.path.isdir(os.path.join(sysfs_root, name))}
    except OSError:
        listed = set()
    cores = sorted(listed & allowed) if listed else sorted(allowed)
    if not cores:
        # sysfs and the allowed set disagree (a container with the host's sysfs): trust the latter
        cores = sorted(allowed)
    if not cores:
        return ()

    figures: dict[int, list[int | None]] = {}     # core -> [capacity, max_freq_khz]
    for cpu in cores:
        base = os.path.join(sysfs_root, f"cpu{cpu}")
        figures[cpu] = [_read_positive_int(os.path.join(base, "cpu_capacity")),
                        _read_positive_int(os.path.join(base, "cpufreq", "cpuinfo_max_freq"))]
    _fill_from_siblings(figures)

    groups: dict[tuple[int | None, int | None], list[int]] = {}
    for cpu in cores:
        groups.setdefault((figures[cpu][0], figures[cpu][1]), []).append(cpu)
    clusters = [DetectedCluster(tuple(cs), None if khz is None else khz * 1e3, cap)
                for (cap, khz), cs in groups.items()]
    clusters.sort(key=lambda c: (c.capacity or -1, c.max_freq_hz or -1.0, -c.cores[0]),
                  reverse=True)
    return tuple(clusters)


def _fill_from_siblings(figures: dict[int, list[int | None]]) -> None:
    # One unreadable file must not split a cluster off (and so change which metric select_big
    # ranks by): a core missing one figure takes it from the cores that share its other figure,
    # when those all agree. Cores in one cpufreq policy share a max frequency by construction.
    for missing, shared in ((0, 1), (1, 0)):
        for cpu, fig in figures.items():
            if fig[missing] is None and fig[shared] is not None:
                known = {f[missing] for f in figures.values()
                         if f[shared] == fig[shared] and f[missing] is not None}
                if len(known) == 1:
                    fig[missing] = known.pop()


def select_big(clusters: Iterable[_ClusterLike]) -> tuple[int, ...]:
    """The cores to run compute threads on, ascending."""
    clusters = tuple(clusters)
    # Rank by cpu_capacity: it folds in the microarchitecture, which clock speed does not (an
    # in-order A55 at 1.8 GHz has 0.64 of a 2.8 GHz X1's clock but 0.16 of its capacity). Clock
    # speed ranks only where it covers more clusters, or where every capacity reads the same
    # (a device tree without capacity-dmips-mhz gives every core 1024).
    def coverage(attr: str) -> tuple[int, bool]:
        known = [v for c in clusters if (v := getattr(c, attr)) is not None]
        return len(known), len(set(known)) > 1
    metric = "capacity" if coverage("capacity") >= coverage("max_freq_hz") else "max_freq_hz"
    scored = sorted(((s, c) for c in clusters if (s := getattr(c, metric)) is not None),
                    key=lambda sc: sc[0], reverse=True)
    if not scored:          # nothing known: every core
        return tuple(sorted(core for c in clusters for core in c.cores))
    # BLAS and ggml-style kernels split each op's rows evenly across threads and wait for the
    # slowest, so adding m cores of relative speed r to n fast ones pays only if r > n / (n + m)
    # (0.5 for equal counts: Tensor G1's A76, capacity 498 beside the X1's 1024, is break-even).
    # LITTLE cores (A53/A55/A510/A520) have 15-50% of the prime core's capacity, mid cores of
    # tri-cluster parts (A78 beside an X1) ~75%: >= 0.6 of the best keeps prime + big only.
    # A cluster with no score is left out: a big core lost costs 1/n, a LITTLE one let in ~half.
    best, lowest = scored[0][0], scored[-1][0]
    # Clocks cannot see the microarchitecture (LITTLE A55s run at 0.6-0.8 of the prime core's
    # clock), but every big.LITTLE part clocks its LITTLE cluster lowest, while cores of one
    # design differ by a few % at most (x86 favoured-core turbo): by clock, drop the lowest.
    drop_lowest = metric == "max_freq_hz" and lowest < CLOCK_SPREAD * best
    return tuple(sorted(core for s, c in scored
                        if s >= BIG_FRACTION * best and not (drop_lowest and s == lowest)
                        for core in c.cores))


def big_cluster_cores(sysfs_root: str = SYSFS_CPU,
                      online: Iterable[int] | None = None) -> tuple[int, ...]:
    return select_big(detect_clusters(sysfs_root, online))


def default_threads(sysfs_root: str = SYSFS_CPU, online: Iterable[int] | None = None) -> int:
    """One compute thread per big core: more threads than big cores spill onto LITTLE ones."""
    return max(1, len(big_cluster_cores(sysfs_root, online)))


def _thread_ids() -> list[int]:
    try:
        return sorted(int(t) for t in os.listdir("/proc/self/task") if t.isdigit())
    except OSError:
        return [0]          # no procfs: only the calling thread can be reached


def pin_threads(cores: Iterable[int], skip: Iterable[int] = ()) -> PinResult:
    """Pin every thread of this process to `cores` and read each back; all or nothing. skip:
    thread ids left alone (the workers of native pools already running, each on its own core:
    a second engine's load moved another engine's workers onto the whole core set).

    Linux affinity is per thread and only new threads inherit it from their creator, so BLAS
    or OpenMP workers started before this call are pinned one by one through /proc/self/task.
    On any failure every thread pinned here is put back where it was.
    """
    requested = frozenset(int(c) for c in cores)
    skip = frozenset(skip)
    if not hasattr(os, "sched_setaffinity"):
        return PinResult(requested, 0, current_affinity(), 0, False,
                         "this platform has no sched_setaffinity (e.g. macOS): threads not pinned")
    if not requested or min(requested) < 0:
        return PinResult(requested, 0, current_affinity(), 0, False,
                         f"invalid core set {_fmt(requested)}")
    allowed = current_affinity()
    before: dict[int, set[int]] = {}        # tid -> affinity before pinning
    mismatched, error = 0, ""
    for _ in range(3):      # threads started mid-pin by an unpinned thread are caught next pass
        fresh = [t for t in _thread_ids() if t not in before and t not in skip]
        for tid in fresh:
            try:
                old = os.sched_getaffinity(tid)
                os.sched_setaffinity(tid, requested)
                got = frozenset(os.sched_getaffinity(tid))
            except ProcessLookupError:
                continue        # the thread exited between listing and pinning
            except (OSError, ValueError, OverflowError) as e:
                error = _explain(requested, allowed, err=e)     # stop here and undo
                break
            before[tid] = old
            if got != requested:    # the kernel silently drops cores outside the cpuset
                mismatched += 1
                error = error or _explain(requested, allowed, got=got)
        if error or not fresh:
            break
    if error:
        for tid, old in before.items():
            try:
                os.sched_setaffinity(tid, old)
            except (OSError, ValueError):
                pass
        return PinResult(requested, 0, current_affinity(), mismatched, False, error)
    return PinResult(requested, len(before), current_affinity(), 0, True, "")


def _fmt(cores: Iterable[int]) -> str:
    return "{" + ", ".join(str(c) for c in sorted(cores)) + "}"


def _explain(requested: frozenset[int], allowed: frozenset[int], *,
             got: frozenset[int] | None = None, err: BaseException | None = None) -> str:
    if isinstance(err, OSError) and err.errno != errno.EINVAL:
        return f"sched_setaffinity failed ({err}); threads left as they were"
    unavailable = (requested - (allowed if got is None else got)) or requested
    text = (f"cores {_fmt(unavailable)} are not available to this process "
            f"(allowed: {_fmt(allowed)})")
    if got is not None:
        text += f"; the kernel gave {_fmt(got)}"
    return text + "; threads left as they were"
