"""`edgellm profile`'s measurement core: time what the compute units of this machine really do,
and write the figures into the `host` device profile the cost model plans with.

measure_host() starts from the estimate of edgellm.device.host (clusters, caches, ISA features)
and measures, each step pinned to the cores it is about:
- per CPU cluster: GEMM throughput per precision (fp32 through BLAS sgemm; fp16 and int8 as
  numpy computes them, without BLAS: slow, and that is the true figure for the numpy unit), and
  the arithmetic peak of one core (the neon library's multiply-accumulate chains), which replaces
  the nominal peak_per_core of the estimate;
- DRAM read bandwidth with all big cores: the neon library's threads streaming a buffer many
  times the last-level cache, as decode streams its weights (numpy's sgemv without the library);
- every registered unit probe (register_probe): the reference (numpy) unit's GEMM-throughput-by-
  rows curve and call overhead come from here; native, OpenCL and NPU backends add their own.

Timing: time.perf_counter around single calls, a warm-up call first, the median of as many runs
as fit a time budget (bounded both ways). Medians, because the machines are shared and noisy.
"""
from __future__ import annotations

import contextlib
import datetime
import math
import os
import re
import statistics
import time
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Callable, Iterator, Optional

import numpy as np
import psutil

from ..errors import ConfigError, EdgeLLMError
from ..procmem import available_bytes
from .host import estimate_host_profile
from .profile import BUSY_SHARE, CpuCluster, DeviceProfile, GemmFigure, Measured, UnitMeasurement
from .topology import PinResult, current_affinity, pin_threads, select_big

__all__ = ["ProbeSizes", "FULL", "QUICK", "HostMeasurement", "Progress", "ProbeFn", "register_probe",
           "unregister_probe", "registered_probes", "measure_host", "probe_reference", "resolve_sizes", "median_seconds",
           "busy_note"]

Progress = Callable[[str, int, int], None]          # (stage, done, total); total never changes
# (quick, threads, progress) -> the unit's figures, or None when the unit is absent here
ProbeFn = Callable[[bool, int, Optional[Progress]], Optional[UnitMeasurement]]

MiB = 1 << 20
_FALLBACK_CACHE = 32 * MiB          # when sysfs reports no cache sizes at all
_FILL = 0.01                        # any non-zero value: calloc'd zero pages all map to one
                                    # physical page, and reading it measures the cache, not DRAM


@dataclass(frozen=True)
class ProbeSizes:
    """Shapes and run counts of one profiling run (FULL, QUICK, or tiny ones in tests)."""
    cluster_gemm: int                       # edge of the square fp32 GEMM for cluster peaks
    small_gemm: tuple[int, int, int]        # (m, k, n) of the numpy fp16 / int8 matmuls
    gemm_k: int                             # reference GEMM curve: input width (SmolLM2 d_model)
    gemm_n: int                             # and output width
    gemm_rows: tuple[int, ...]              # activation rows (tokens) of the curve, ascending
    runs: int                               # most timed runs per measurement
    min_runs: int                           # fewest timed runs, even over the time budget
    budget_s: float                         # time one measurement aims for (runs in between)
    overhead_batch: int = 200               # tiny-op calls per sample of the call overhead
    bandwidth_bytes: int | None = None      # weight matrix of the bandwidth probe; None: 8x the
                                            # caches, >= 256 MiB, <= max(512 MiB, 4x the caches)
    weight_bytes: int | None = None         # rotating GEMM weights in all; None: 3x the caches


FULL = ProbeSizes(cluster_gemm=1024, small_gemm=(64, 256, 256), gemm_k=576, gemm_n=1536,
                  gemm_rows=(1, 8, 16, 32, 64, 128, 256, 512, 1024), runs=301, min_runs=5,
                  budget_s=3.0)
# quick still measures every row count the chunk planner interpolates between: a curve with
# gaps moves the roof, and a sub-second median on a shared machine is too noisy to size chunks
QUICK = ProbeSizes(cluster_gemm=768, small_gemm=(64, 256, 256), gemm_k=576, gemm_n=1536,
                   gemm_rows=(1, 16, 32, 64, 128, 256, 512), runs=101, min_runs=3, budget_s=1.0)


class ProfileNotWritten(ConfigError):
    """The measured profile could not be written (a full disk, a read-only folder): `text` holds
    it, so the minute of measuring is not lost (the CLI prints it)."""

    def __init__(self, path: Path, text: str, cause: OSError):
        super().__init__(f"could not write the profile to {path}: {cause.strerror or cause}")
        self.path, self.text = path, text


@dataclass(frozen=True)
class HostMeasurement:
    """What measure_host returns; unpacks as (profile, path)."""
    profile: DeviceProfile              # as loaded back from `path` (so it validates)
    path: Path                          # the YAML written
    notes: tuple[str, ...]              # what was skipped or not pinned, and why
    seconds: float                      # wall time of the whole measurement

    def __iter__(self) -> Iterator:
        return iter((self.profile, self.path))


# ---- the probe registry ------------------------------------------------------------------------

_PROBES: dict[str, ProbeFn] = {}
_UNIT_NAME = re.compile(r"[a-z][a-z0-9_]*")


def register_probe(unit_name: str, fn: ProbeFn) -> None:
    """Add (or replace) the probe of a compute unit. fn(quick, threads, progress) runs pinned to
    the big cores with BLAS limited to `threads`, and returns the unit's figures, or None when the
    unit is not on this machine. An exception from it skips the unit with the reason in the
    notes; it never ends the run."""
    if not isinstance(unit_name, str) or not _UNIT_NAME.fullmatch(unit_name):
        raise ConfigError(f"probe unit name: expected a backend name such as 'neon' "
                          f"([a-z][a-z0-9_]*), got {unit_name!r}")
    if not callable(fn):
        raise ConfigError(f"probe for {unit_name!r}: expected a callable "
                          f"fn(quick, threads, progress), got {type(fn).__name__}")
    _PROBES[unit_name] = fn


def unregister_probe(unit_name: str) -> None:
    _PROBES.pop(unit_name, None)


def registered_probes() -> tuple[str, ...]:
    """Unit names in the order they are probed (registration order; reference first)."""
    return tuple(_PROBES)


# ---- timing ------------------------------------------------------------------------------------

def median_seconds(call: Callable[[], object], sizes: ProbeSizes) -> float:
    """Median seconds of one call, after a warm-up (first BLAS call starts its threads, the
    output's pages fault in). Runs: as many as fit the budget, within [min_runs, runs]."""
    call()
    t0 = time.perf_counter()
    call()
    once = time.perf_counter() - t0
    runs = max(sizes.min_runs, min(sizes.runs, int(sizes.budget_s / max(once, 1e-9))))
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return _positive(statistics.median(times), "a timed call")


def _positive(seconds: float, what: str) -> float:
    if not (seconds > 0 and math.isfinite(seconds)):
        raise EdgeLLMError(f"timing {what}: expected a positive time, got {seconds!r} "
                           "(is time.perf_counter working?)")
    return seconds


# ---- pinning -----------------------------------------------------------------------------------

def _thread_ids() -> list[int]:
    try:
        return [int(t) for t in os.listdir("/proc/self/task") if t.isdigit()]
    except OSError:
        return [0]                      # only the calling thread can be reached


@contextlib.contextmanager
def _pinned(cores: tuple[int, ...]) -> Iterator[PinResult]:
    """Every thread of the process pinned to `cores` for the block; each thread's own affinity
    put back afterwards, also when the block raises (a profile run must not leave the caller,
    e.g. an engine pinned to its big cores, somewhere else)."""
    if not hasattr(os, "sched_setaffinity"):
        yield pin_threads(cores)        # says why not; there is nothing to restore
        return
    caller = frozenset(os.sched_getaffinity(0))
    before = {}
    for tid in _thread_ids():
        with contextlib.suppress(OSError):
            before[tid] = frozenset(os.sched_getaffinity(tid))
    try:
        yield pin_threads(cores)
    finally:
        for tid in _thread_ids():       # threads started inside the block get the caller's set
            with contextlib.suppress(OSError, ValueError):
                os.sched_setaffinity(tid, before.get(tid, caller))


@contextlib.contextmanager
def _blas_threads(n: int) -> Iterator[None]:
    """BLAS limited to n threads for the block (the engine runs one per big core), then back."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:                 # a declared dependency; without it BLAS picks its own
        yield
        return
    with threadpool_limits(limits=n, user_api="blas"):
        yield


@contextlib.contextmanager
def _on_cores(cores: tuple[int, ...], what: str, notes: list[str], *,
              must_pin: bool) -> Iterator[bool]:
    """Pinned to `cores` with BLAS on len(cores) threads. Yields whether to measure: pinned, or
    not pinnable but the process runs on no other cores anyway, or not pinnable and must_pin
    is False (the engine itself then runs unpinned: that is the figure it sees)."""
    with _pinned(cores) as pin, _blas_threads(len(cores)):
        if pin.ok:
            yield True
            return
        go = not must_pin or current_affinity() <= frozenset(cores)
        notes.append(f"{what}: threads not pinned to cores {list(cores)} ({pin.reason})"
                     + ("; measured unpinned" if go else "; not measured"))
        yield go


# ---- a busy machine ---------------------------------------------------------------------------


def _cpu_seconds() -> tuple[float, float]:
    """(CPU-seconds all CPUs have been busy, CPU-seconds this process has run), since boot and
    since start; steal counts as busy (a VM's neighbours take those cycles from us)."""
    t = psutil.cpu_times()
    busy = sum(getattr(t, f, 0.0) for f in ("user", "nice", "system", "irq", "softirq", "steal"))
    own = psutil.Process().cpu_times()
    return busy, own.user + own.system


def busy_share(start: tuple[float, float], end: tuple[float, float], wall_s: float, cpus: int) -> float:
    """The share of the CPUs other processes used between start and end (_cpu_seconds)."""
    others = (end[0] - start[0]) - (end[1] - start[1])
    return max(others / max(wall_s * cpus, 1e-9), 0.0)


def busy_note(start: tuple[float, float], end: tuple[float, float], wall_s: float,
              cpus: int) -> str | None:
    """A note when other processes used more than BUSY_SHARE of the CPUs while we measured.
    BLAS splits each call across all big cores and waits for the slowest thread, so one foreign
    busy process can stretch a 0.1 ms call to a whole scheduler slice (4-8 ms): such figures
    are a measure of the neighbours, not of the machine."""
    share = busy_share(start, end, wall_s, cpus)
    if share <= BUSY_SHARE:
        return None
    return (f"other processes used {share:.0%} of the {cpus} CPUs during the measurement: the "
            f"figures are probably low; run `edgellm profile` again on an idle machine")


# ---- sizes -------------------------------------------------------------------------------------

def _cache_bytes(clusters: tuple[CpuCluster, ...]) -> int:
    """Bytes the caches of one cluster can hold: L3 + all L2s (AMD's L3 and Arm's DSU L3 are
    exclusive of L2, so a buffer must exceed both to be read from DRAM)."""
    return max((c.l3_bytes + c.l2_bytes * len(c.cores) for c in clusters), default=0) or _FALLBACK_CACHE


def _available_bytes() -> int:
    try:
        return available_bytes()
    except Exception:   # noqa: BLE001 - a sandbox may refuse /proc and psutil alike
        return 4 << 30


def resolve_sizes(sizes: ProbeSizes, clusters: tuple[CpuCluster, ...]) -> ProbeSizes:
    """Fill the cache-dependent sizes from the machine's caches, capped at a quarter of the
    available memory."""
    cache, cap = _cache_bytes(clusters), max(_available_bytes() // 4, 8 * MiB)
    bw = sizes.bandwidth_bytes or min(max(8 * cache, 256 * MiB), max(512 * MiB, 4 * cache))
    # each weight matrix must be evicted before it comes round again, as in a real model
    # (SmolLM2 is ~500 MB of fp32 weights): 3x the caches leaves LRU-like policies no chance
    wb = sizes.weight_bytes or 3 * cache
    return replace(sizes, bandwidth_bytes=min(bw, cap), weight_bytes=min(wb, cap))


# ---- the measurements ----------------------------------------------------------------------------

def _gemm_rate(m: int, k: int, n: int, dtype, sizes: ProbeSizes) -> float:
    """FLOP/s (op/s for int8) of numpy's x (m, k) @ w (n, k)^T in `dtype`, as the reference
    backend multiplies: fp32 goes to BLAS sgemm, fp16 and int8 to numpy's own loops."""
    rng = np.random.default_rng(0)
    if np.issubdtype(dtype, np.integer):
        x = rng.integers(-8, 8, (m, k), dtype=dtype)
        w = rng.integers(-8, 8, (n, k), dtype=dtype)     # int8 sums wrap: fine for timing
    else:
        x = rng.standard_normal((m, k), dtype=np.float32).astype(dtype)
        w = rng.standard_normal((n, k), dtype=np.float32).astype(dtype)
    return 2.0 * m * k * n / median_seconds(lambda: x @ w.T, sizes)


def measure_cluster(sizes: ProbeSizes) -> dict[str, float]:
    """precision -> FLOP/s (op/s for int8) on the cores the process runs on now."""
    e = sizes.cluster_gemm
    return {"fp32": _gemm_rate(e, e, e, np.float32, sizes),
            "fp16": _gemm_rate(*sizes.small_gemm, np.float16, sizes),
            "int8": _gemm_rate(*sizes.small_gemm, np.int8, sizes)}


def measure_peak_per_core(cluster: str, notes: list[str], sizes: ProbeSizes) -> dict[str, float] | None:
    """The arithmetic peak of one core of the cluster the caller is pinned to, per precision,
    from the neon library's multiply-accumulate chains (backends.neon_probe.peak_per_core);
    None, noted, when the library is not available (the profile keeps the nominal figures)."""
    try:
        from ..backends import neon_probe

        # runs of 20 ms: the chains reach their rate within microseconds, a run only has to
        # outlast the timer's resolution and a scheduler tick (tests' tiny budgets: shorter)
        got = neon_probe.peak_per_core(seconds=min(0.02, sizes.budget_s / 10), runs=max(sizes.min_runs, 5))
    except Exception as e:  # noqa: BLE001 - a broken library must not end the profile run
        notes.append(f"cluster {cluster}: peak per core not measured ({type(e).__name__}: {e}); nominal figures kept")
        return None
    if got is None:
        notes.append(f"cluster {cluster}: peak per core not measured (the neon library is not available); "
                     f"nominal figures kept")
        return None
    peaks, note = got
    if note:
        notes.append(f"cluster {cluster}: {note}")
    return peaks


# the precision a CPU unit's GEMM curve computes in (neon: int8 dot products of the Q4_1 path)
_GEMM_PRECISION = {"neon": "int8", "reference": "fp32"}


def gemm_peak_share(profile: DeviceProfile, unit: str, u: UnitMeasurement) -> str | None:
    """'best GEMM <G> at <m> rows = <x>% of <n> big cores' <precision> peak (<total>)' for a CPU
    unit (n: the threads it ran with), None for the others (a GPU's peak is its own measurement)."""
    from ..costmodel import big_cpu, cpu_peak

    precision = _GEMM_PRECISION.get(unit)
    if precision is None or not u.gemm:
        return None
    big = big_cpu(profile)
    n_big = sum(len(c.cores) for c in big)
    n = min(u.threads, n_big) if u.threads else n_big
    peak = cpu_peak(big, precision) * n / n_big
    if peak <= 0:
        return None
    best = max(u.gemm, key=lambda g: g.flops)
    return (f"best GEMM {best.flops / 1e9:.0f} G{'OPS' if precision == 'int8' else 'FLOPS'} at {best.m} rows = "
            f"{100 * best.flops / peak:.0f}% of {n} big cores' {precision} peak ({peak / 1e9:.0f})")


def measure_read_bandwidth(sizes: ProbeSizes, threads: int | None = None, notes: list[str] | None = None) -> float:
    """bytes/s read from a buffer far larger than the caches by `threads` threads (default: one
    per core the caller may run on), as decode streams its weights: the neon library's streaming
    read (el_read_probe). Without the library, numpy's sgemv of one row against a (rows, gemm_k)
    matrix of that size, noted: it measures the BLAS numpy has as much as the memory."""
    nbytes = sizes.bandwidth_bytes or 256 * MiB
    threads = threads or max(1, len(current_affinity()))
    why = "the neon library is not available"
    try:
        from ..backends import neon_probe

        got = neon_probe.read_bandwidth(nbytes, threads, sizes)
        if got is not None:
            return got
    except Exception as e:  # noqa: BLE001 - a broken library must not end the profile run
        why = f"the neon read probe failed ({type(e).__name__}: {e})"
    if notes is not None:
        notes.append(f"memory bandwidth: measured with numpy's sgemv ({why})")
    return _sgemv_read_bandwidth(nbytes, sizes)


def _sgemv_read_bandwidth(nbytes: int, sizes: ProbeSizes) -> float:
    """bytes/s: one row of activations against a (rows, gemm_k) fp32 matrix of ~nbytes through
    the reference backend's matmul (np.sum reads on one thread and under-reports)."""
    from ..backends import reference

    k = sizes.gemm_k
    rows = max(1, nbytes // (4 * k))
    w = np.empty((rows, k), dtype=np.float32)           # (rows, k), ~nbytes
    w.fill(_FILL)
    x = np.full((1, k), 1.0, dtype=np.float32)
    return w.nbytes / median_seconds(lambda: reference.matmul(x, w), sizes)


def measure_call_overhead(sizes: ProbeSizes) -> float:
    """Seconds of one tiny reference-backend op (add on (1, 8)), Python call included: timed in
    batches, since one call (~1 us) is near perf_counter's own cost."""
    from ..backends import reference

    a = np.ones((1, 8), dtype=np.float32)
    b = np.ones((1, 8), dtype=np.float32)
    batch = max(1, sizes.overhead_batch)
    add = reference.add

    def calls():
        for _ in range(batch):
            add(a, b)
    return median_seconds(calls, sizes) / batch


def measure_gemm_curve(sizes: ProbeSizes, call_overhead_s: float,
                       progress: Progress | None = None) -> tuple[GemmFigure, ...]:
    """fp32 FLOP/s of the reference backend's matmul at each of sizes.gemm_rows, K x N weights.

    Every call reads a different weight matrix, rotating over sizes.weight_bytes of them: a
    single 3.5 MB matrix would sit in L2/L3 and make m=1 look several times faster than decode,
    where each layer's weights come from DRAM. The call overhead is taken out of each time, as
    the cost model adds it back per op (so it predicts the probe's own shapes exactly)."""
    from ..backends import reference

    k, n = sizes.gemm_k, sizes.gemm_n
    count = max(2, math.ceil((sizes.weight_bytes or 0) / (4 * k * n)))
    weights = np.empty((count, n, k), dtype=np.float32)     # (matrices, out, in), as prepared
    weights.fill(_FILL)
    rng = np.random.default_rng(0)
    figures = []
    for i, m in enumerate(sizes.gemm_rows):
        if progress:
            progress(f"gemm {m}x{k}x{n}", i, len(sizes.gemm_rows))
        x = rng.standard_normal((m, k), dtype=np.float32)   # (m, k): activations stay in cache
        turn = iter(range(1 << 62))

        def call():
            return reference.matmul(x, weights[next(turn) % count])
        t = median_seconds(call, sizes)
        # never let a noisy overhead figure eat more than half of a measured time
        body = max(t - call_overhead_s, 0.5 * t)
        figures.append(GemmFigure(m=m, k=k, n=n, flops=2.0 * m * k * n / body))
    return tuple(figures)


def probe_reference(quick: bool, threads: int, progress: Progress | None = None, *,
                    sizes: ProbeSizes | None = None) -> UnitMeasurement:
    """The reference (numpy) unit: its GEMM curve by rows, fp32 peak (the curve's best), call
    overhead, and its attention and elementwise rates. `sizes` defaults to QUICK / FULL resolved
    against this machine's caches."""
    from ..backends import reference
    from . import op_probe

    if sizes is None or sizes.weight_bytes is None:
        sizes = resolve_sizes(sizes or (QUICK if quick else FULL), estimate_host_profile().clusters)
    if progress:
        progress("call overhead", 0, 1)
    overhead = measure_call_overhead(sizes)
    curve = measure_gemm_curve(sizes, overhead, progress)
    return UnitMeasurement(precision_flops={"fp32": max(g.flops for g in curve)}, gemm=curve,
                           call_overhead_s=overhead, threads=threads,
                           attention=_reference_attention(sizes, overhead, progress),
                           elementwise=op_probe.measure_elementwise(reference, sizes, overhead, progress))


def _reference_attention(sizes: ProbeSizes, call_overhead_s: float, progress: Progress | None):
    """numpy attention as the engine runs it: gather the pool's f16 blocks into fp32, then attend."""
    from ..backends import reference
    from . import op_probe as ap

    n = max(t + c for t, c in ap.SHAPES)
    bufs = tuple(np.empty((ap.KV_HEADS, n, ap.HEAD_DIM), np.float32) for _ in range(2))

    def run(q, seq, layer, start):
        k, v = seq.read(layer, start + len(q), out=bufs)
        return reference.attention(q, k, v, start)
    return ap.measure_attention(run, sizes, call_overhead_s, progress)


register_probe("reference", probe_reference)


def _probe_neon(quick: bool, threads: int, progress: Progress | None = None) -> UnitMeasurement | None:
    from ..backends import neon_probe

    sizes = resolve_sizes(QUICK if quick else FULL, estimate_host_profile().clusters)
    return neon_probe.probe(sizes, threads, progress)


register_probe("neon", _probe_neon)


def _probe_opencl(quick: bool, threads: int, progress: Progress | None = None) -> UnitMeasurement | None:
    from ..backends import opencl_profile

    sizes = resolve_sizes(QUICK if quick else FULL, estimate_host_profile().clusters)
    return opencl_profile.probe(sizes, threads, progress)


register_probe("opencl", _probe_opencl)


# ---- the whole run -------------------------------------------------------------------------------

def _unavailable_reason(name: str) -> str | None:
    """Why a unit's probe found nothing: the unit's own reason (a kernel that does not build, no
    platform matching EDGELLM_OPENCL_PLATFORM, ...), when it gives one."""
    from .. import backends

    try:
        mod, why = backends.get(name)
        if mod is None:
            return why
        ok, why = mod.available()
        return None if ok else why
    except Exception:   # noqa: BLE001 - only a better note is lost
        return None


def measure_host(out_path: str | os.PathLike | None = None, quick: bool = False,
                 progress: Progress | None = None, *, sizes: ProbeSizes | None = None) -> HostMeasurement:
    """Measure this machine and write the `host` profile to out_path (default:
    user_profiles_dir()/host.yaml). Returns HostMeasurement, which unpacks as (profile, path):
    the profile as loaded back from the file. progress(stage, done, total) is called before and
    after each step with the same total, and last with done == total."""
    from .. import __version__
    from .profile_yaml import _profile_from_text, dump_profile, load_profile, user_profiles_dir, write_profile

    started, cpu_start = time.perf_counter(), _cpu_seconds()
    est = estimate_host_profile()
    if not est.clusters:
        raise EdgeLLMError("edgellm profile: found no CPU cores this process may run on")
    path = Path(out_path) if out_path is not None else user_profiles_dir() / "host.yaml"
    # what the OS reports must make a valid profile (a board whose sysfs lists no caches gives
    # 0 B): say so now, with the field, rather than after minutes of measuring
    _profile_from_text(dump_profile(replace(est, name="host")), path.stem, str(path))
    sizes = resolve_sizes(sizes or (QUICK if quick else FULL), est.clusters)
    big = select_big(est.clusters)
    probes = dict(_PROBES)
    steps = ([f"cluster {c.name}" for c in est.clusters] + ["memory bandwidth"]
             + [f"unit {name}" for name in probes] + ["write profile"])
    total, notes = len(steps), []

    def report(i: int, stage: str | None = None, done: int | None = None):
        if progress:
            progress(stage or steps[i], i if done is None else done, total)

    step = iter(range(total))
    clusters: dict[str, dict[str, float]] = {}
    peaks: dict[str, dict[str, float]] = {}
    for c in est.clusters:
        i = next(step)
        report(i)
        # a cluster's figures are only about that cluster when its threads stay there
        with _on_cores(c.cores, f"cluster {c.name}", notes, must_pin=True) as usable:
            if usable:
                try:
                    clusters[c.name] = measure_cluster(sizes)
                except (MemoryError, ArithmeticError, EdgeLLMError) as e:
                    notes.append(f"cluster {c.name}: not measured ({type(e).__name__}: {e})")
                peak = measure_peak_per_core(c.name, notes, sizes)
                if peak:
                    peaks[c.name] = peak
        report(i, done=i + 1)

    i = next(step)
    report(i)
    with _on_cores(big, "memory bandwidth", notes, must_pin=False):
        bandwidth = measure_read_bandwidth(sizes, threads=len(big), notes=notes)
    report(i, done=i + 1)

    units: dict[str, UnitMeasurement] = {}
    for name, fn in probes.items():
        i = next(step)
        report(i)
        if fn is probe_reference:
            fn = partial(probe_reference, sizes=sizes)
        sub = (lambda stage, _d=0, _t=0, _i=i, _n=name: report(_i, f"unit {_n}: {stage}")) if progress else None
        try:
            with _on_cores(big, f"unit {name}", notes, must_pin=False):
                got = fn(quick, len(big), sub)
            if got is None:
                why = _unavailable_reason(name) or "its probe found no such unit on this machine"
                notes.append(f"unit {name}: skipped ({why})")
            elif not isinstance(got, UnitMeasurement):
                notes.append(f"unit {name}: skipped (its probe returned {type(got).__name__}, "
                             f"expected UnitMeasurement or None)")
            else:
                units[name] = got
        except Exception as e:  # noqa: BLE001 - a broken backend probe must not end the run
            notes.append(f"unit {name}: skipped ({type(e).__name__}: {e})")
        report(i, done=i + 1)

    gpu = None
    if "opencl" in units:
        # the gpu: section the cost model plans with comes from the device the unit opened
        try:
            from ..backends import opencl_profile

            gpu = opencl_profile.gpu_section(units["opencl"], sizes)
        except Exception as e:  # noqa: BLE001 - as for a unit probe: noted, never the end of the run
            notes.append(f"gpu section: not written ({type(e).__name__}: {e})")
            units.pop("opencl")

    i = next(step)
    report(i)
    cpu_end, wall = _cpu_seconds(), time.perf_counter() - started
    share = busy_share(cpu_start, cpu_end, wall, psutil.cpu_count() or 1)
    busy = busy_note(cpu_start, cpu_end, wall, psutil.cpu_count() or 1)
    if busy:
        notes.append(busy)
    tool = f"edgellm profile {__version__}" + (" --quick" if quick else "")
    # a measured peak stands in for the nominal one (clock x lanes x an assumed port count)
    est = replace(est, clusters=tuple(replace(c, peak_per_core={**c.peak_per_core, **peaks[c.name]})
                                      if c.name in peaks else c for c in est.clusters))
    profile = replace(
        est, name="host",
        soc=re.sub(r",\s*estimated$", "", est.soc),
        # a measured figure stands in for the datasheet one: it is what this machine reaches
        memory_bandwidth=bandwidth, gpu=gpu,
        measured=Measured(date=datetime.date.today().isoformat(), tool=tool,
                          memory_read_bandwidth=bandwidth, clusters=clusters, units=units,
                          others_cpu_share=round(min(share, 1.0), 3)),
        source="")
    try:
        path = write_profile(profile, path)
    except OSError as e:
        raise ProfileNotWritten(Path(path), dump_profile(profile), e) from None
    loaded = load_profile(path)
    report(i, done=total)
    return HostMeasurement(loaded, path, tuple(notes), time.perf_counter() - started)
