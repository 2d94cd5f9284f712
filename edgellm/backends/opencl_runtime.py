"""The OpenCL device the opencl unit runs on: platform and device choice, program builds with an
on-disk binary cache, resident buffers, and per-kernel timing from profiling events.

Device choice: EDGELLM_OPENCL_PLATFORM / EDGELLM_OPENCL_DEVICE (case-insensitive substrings of
the names) when set, else the first GPU device of any platform, else the first device of any type
(PoCL's CPU device on a dev machine: correct, not fast, and said so in the reason).

Kernel sources are opencl_kernels/<family>.cl (installed as edgellm/opencl_kernels/), or the
directory EDGELLM_OPENCL_KERNELS names (kernel development without reinstalling).

Binary cache: EDGELLM_HOME/cache/opencl/<family>-<key>.bin, key = sha256 of the device, platform
and driver versions, the source and the build options. The header carries the key too, so a file
holding another program's binary (copied or renamed into place) is a miss like one whose checksum
fails: rebuilt from source (one warning), never trusted. A program that fails to build raises
KernelBuildError with the build log, which is also kept in the cache directory.

Driver errors: every call into the driver after setup (buffers, copies, launches, kernel objects)
turns pyopencl's exceptions (cl.RuntimeError, cl.MemoryError, cl.LogicError: none of them an
EdgeLLMError, and cl.MemoryError is not Python's MemoryError) into ClDeviceError naming the call.
"""
from __future__ import annotations

import contextlib
import logging
import os
import struct
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..hashing import sha256
from ..errors import EdgeLLMError
from ..fileio import read_capped, write_atomic
from .opencl_probe_cache import kernel_dir

log = logging.getLogger("edgellm")

BUILD_OPTIONS = ("-cl-std=CL1.2",)      # no -cl-fast-relaxed-math: it licenses fp16-like error
_MAGIC = b"ELCLBIN2"
_MAGIC_V1 = b"ELCLBIN1"                  # the header before it carried the program's key
_HEADER = struct.Struct("<8s32s32sQ")    # magic, cache key (ascii hex), sha256 of the payload, payload length


class OpenCLUnavailable(EdgeLLMError):
    """No usable OpenCL platform or device, or the driver failed while setting it up."""


class ClDeviceError(OpenCLUnavailable):
    """The driver failed a call after setup: a launch, a copy, a buffer allocation (out of
    resources or memory, a lost device). An OpenCLUnavailable, so that prepare() drops the unit at
    load; mid-request it is the request's typed error (the engine stays usable)."""


@contextlib.contextmanager
def driver_call(what: str):
    """Runs a block of pyopencl calls; a pyopencl error becomes ClDeviceError naming `what`."""
    cl = _import_cl()
    try:
        yield
    except cl.Error as e:
        raise ClDeviceError(f"OpenCL {what} failed: {type(e).__name__}: {e}") from e


class KernelBuildError(EdgeLLMError):
    """An OpenCL program failed to build; `log` is the compiler's build log."""

    def __init__(self, family: str, options: str, build_log: str, log_path: Path | None):
        self.family, self.options, self.log, self.log_path = family, options, build_log, log_path
        first = next((ln for ln in build_log.splitlines() if "error" in ln.lower()), build_log.strip()[:200])
        where = f" (full log: {log_path})" if log_path else ""
        super().__init__(f"opencl_kernels/{family}.cl failed to build with {options!r}: {first}{where}")


def kernel_source(family: str) -> str:
    path = kernel_dir() / f"{family}.cl"
    try:
        return path.read_text()
    except OSError as e:
        raise OpenCLUnavailable(f"kernel source {path} cannot be read: {e}") from e


def sources_hash() -> str:
    """Hash of every kernel source: a change in any .cl invalidates tuning and probe results."""
    h = sha256()
    for p in sorted(kernel_dir().glob("*.cl")):
        h.update(p.name.encode() + b"\0" + p.read_bytes())
    return h.hexdigest()[:16]


def cache_root() -> Path:
    from ..model.registry import edgellm_home

    return edgellm_home() / "cache" / "opencl"


def _import_cl():
    try:
        import pyopencl as cl
    except ImportError as e:
        raise OpenCLUnavailable("pyopencl is not installed (pip install 'edgellm[opencl]')") from e
    return cl


def _matches(hint: str | None, name: str) -> bool:
    return not hint or hint.lower() in name.lower()


def select_device(platform_hint: str | None = None, device_hint: str | None = None):
    """(platform, device, why) under the hints (else the environment). Raises OpenCLUnavailable
    naming what was found when nothing matches."""
    cl = _import_cl()
    platform_hint = platform_hint or os.environ.get("EDGELLM_OPENCL_PLATFORM")
    device_hint = device_hint or os.environ.get("EDGELLM_OPENCL_DEVICE")
    try:
        platforms = cl.get_platforms()
    except cl.Error as e:      # the ICD loader reports "no platform" as an error code
        raise OpenCLUnavailable(f"no OpenCL platform: {e}") from e
    if not platforms:
        raise OpenCLUnavailable("no OpenCL platform is installed")
    found, gpus, others = [], [], []
    for p in platforms:
        try:
            devs = p.get_devices()
        except cl.Error:
            devs = []
        found.append(f"{p.name} [{', '.join(d.name for d in devs) or 'no devices'}]")
        if not _matches(platform_hint, p.name):
            continue
        for d in devs:
            if _matches(device_hint, d.name):
                (gpus if d.type & cl.device_type.GPU else others).append((p, d))
    if not gpus and not others:
        want = " and ".join(f"{k} matching {v!r}" for k, v in (("platform", platform_hint), ("device", device_hint)) if v)
        raise OpenCLUnavailable(f"no OpenCL device{' with ' + want if want else ''} (found: {'; '.join(found)})")
    if gpus:
        p, d = gpus[0]
        return p, d, f"GPU {d.name.strip()} on {p.name.strip()}"
    p, d = others[0]
    kind = "CPU" if d.type & cl.device_type.CPU else "accelerator"
    return p, d, f"{kind} device {d.name.strip()} on {p.name.strip()} (no OpenCL GPU found: correct, not fast)"


@dataclass
class BuildStats:
    from_source: int = 0
    from_cache: int = 0
    seconds: float = 0.0


@dataclass
class ClRuntime:
    """One context and in-order queue (profiling enabled) on the chosen device."""
    platform: object
    device: object
    ctx: object
    queue: object
    why: str
    stats: BuildStats = field(default_factory=BuildStats)
    cache_dir: Path | None = None                 # binary cache; None: cache_root()
    profiling: bool = False                       # record kernel times from events
    timings: dict = field(default_factory=dict)   # kernel name -> [seconds]
    _programs: dict = field(default_factory=dict)
    _kernels: dict = field(default_factory=dict)
    # launch's set_args + enqueue as one: the runtime (its cached kernel objects) is shared by
    # every engine of the process, and two threads setting one kernel's arguments at once
    # crashed PoCL or ran a kernel on the other thread's buffers
    _launch_lock: object = field(default_factory=threading.Lock)

    @classmethod
    def create(cls, platform_hint: str | None = None, device_hint: str | None = None,
               cache_dir: Path | None = None) -> "ClRuntime":
        cl = _import_cl()
        p, d, why = select_device(platform_hint, device_hint)
        try:
            ctx = cl.Context([d])
            queue = cl.CommandQueue(ctx, d, properties=cl.command_queue_properties.PROFILING_ENABLE)
        except cl.Error as e:
            raise OpenCLUnavailable(f"{d.name}: context or queue creation failed: {e}") from e
        return cls(p, d, ctx, queue, why, cache_dir=cache_dir)

    # -- device facts ------------------------------------------------------------------------
    @property
    def name(self) -> str:
        return self.device.name.strip()

    @property
    def is_gpu(self) -> bool:
        """A GPU device (PoCL's CPU device is not one: its kernels run on the host's cores)."""
        return bool(self.device.type & _import_cl().device_type.GPU)

    @property
    def unified_memory(self) -> bool:
        """Host and device share memory (Mali, PoCL): buffers are host-visible, no copies."""
        try:
            return bool(self.device.host_unified_memory)
        except Exception:
            return False

    @property
    def extensions(self) -> frozenset[str]:
        return frozenset(self.device.extensions.split())

    @property
    def int8_dot(self) -> bool:
        return bool({"cl_arm_integer_dot_product_int8", "cl_khr_integer_dot_product"} & self.extensions)

    @property
    def warp_width(self) -> int:
        """The work-group size multiple the driver prefers (16 on Mali-G78, 8 on PoCL here)."""
        k = self.kernel("probe_kernels", "el_fill")
        cl = _import_cl()
        return int(k.get_work_group_info(cl.kernel_work_group_info.PREFERRED_WORK_GROUP_SIZE_MULTIPLE, self.device))

    def identity(self) -> str:
        d = self.device
        return f"{d.vendor}|{d.name}|{d.version}|{d.driver_version}|{self.platform.version}"

    # -- programs ----------------------------------------------------------------------------
    def program(self, family: str, defines: dict[str, object] | None = None):
        """The built program of opencl_kernels/<family>.cl with -D defines: from memory, else the
        binary cache, else the compiler (and then cached)."""
        opts = BUILD_OPTIONS + tuple(f"-D{k}={v}" for k, v in sorted((defines or {}).items()))
        key = (family, opts)
        prog = self._programs.get(key)
        if prog is None:
            prog = self._programs[key] = self._build(family, opts)
        return prog

    def kernel(self, family: str, name: str, defines: dict[str, object] | None = None):
        """A kernel object, made once per (program, name): creating one per call costs driver time."""
        key = (family, tuple(sorted((defines or {}).items())), name)
        k = self._kernels.get(key)
        if k is None:
            cl = _import_cl()
            prog = self.program(family, defines)
            with driver_call(f"kernel {name} of opencl_kernels/{family}.cl"):
                k = self._kernels[key] = cl.Kernel(prog, name)
        return k

    def load_cached_binaries(self) -> int:
        """Loads every program binary in the cache once, as the engine's builds would: the guarded
        probe child's pass, so that a binary the driver dies on (PoCL asserts on a cut-short one
        whose header was made to match it) kills the child, and the parent clears the cache,
        rather than the engine's own process at every run. Unusable files are warned about and
        skipped, as _build would; one the driver rejects is removed (NVIDIA's refuses a cut-short
        one with an error instead of dying: kept, it was rejected again at every probe). Returns
        how many loaded."""
        cl = _import_cl()
        n = 0
        for path in sorted((self.cache_dir or cache_root()).glob("*.bin")):
            binary = _read_binary(path, path.stem.rsplit("-", 1)[-1])
            if binary is None:
                continue
            try:
                cl.Program(self.ctx, [self.device], [binary]).build()
                n += 1
            except cl.Error as e:
                path.unlink(missing_ok=True)
                log.warning("OpenCL binary cache %s rejected by the driver (%s); removed", path, e)
        return n

    def _build(self, family: str, opts: tuple[str, ...]):
        cl = _import_cl()
        src = kernel_source(family)
        options = " ".join(opts)
        key = sha256("\0".join((self.identity(), src, options)).encode()).hexdigest()[:32]
        cache = self.cache_dir or cache_root()
        path = cache / f"{family}-{key}.bin"
        t0 = time.perf_counter()
        binary = _read_binary(path, key)
        if binary is not None:
            try:
                prog = cl.Program(self.ctx, [self.device], [binary]).build(options=options)
                self.stats.from_cache += 1
                self.stats.seconds += time.perf_counter() - t0
                return prog
            except cl.Error as e:
                log.warning("OpenCL binary cache %s rejected by the driver (%s); rebuilding from source", path, e)
        prog = cl.Program(self.ctx, src)
        try:
            prog.build(options=options, devices=[self.device], cache_dir=False)
        except cl.Error as e:
            build_log = _build_log(prog, self.device) or str(e)
            raise KernelBuildError(family, options, build_log, _write_log(cache, family, key, build_log)) from e
        self.stats.from_source += 1
        self.stats.seconds += time.perf_counter() - t0
        try:
            (bin0,) = prog.get_info(cl.program_info.BINARIES)
            _write_binary(path, key, bytes(bin0))
        except Exception as e:     # a cache that cannot be written costs a rebuild next time, no more
            log.warning("OpenCL binary cache %s not written: %s", path, e)
        return prog

    # -- buffers -----------------------------------------------------------------------------
    def resident(self, arr: np.ndarray):
        """A read-only device buffer holding `arr`, written once (weights, at prepare()). On a
        unified-memory device it is allocated host-visible and filled through a map: no second
        copy in a driver staging area."""
        cl = _import_cl()
        arr = np.ascontiguousarray(arr)
        mf = cl.mem_flags
        with driver_call(f"resident buffer of {arr.nbytes} bytes"):
            if self.unified_memory:
                buf = cl.Buffer(self.ctx, mf.READ_ONLY | mf.ALLOC_HOST_PTR, size=max(arr.nbytes, 1))
                mapped, _ = cl.enqueue_map_buffer(self.queue, buf, cl.map_flags.WRITE_INVALIDATE_REGION, 0,
                                                  arr.shape, arr.dtype)
                mapped[...] = arr
                mapped.base.release(self.queue)
                return buf
            return cl.Buffer(self.ctx, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=arr)

    def upload(self, arr: np.ndarray):
        """A per-call input buffer with `arr`'s contents."""
        cl = _import_cl()
        arr = np.ascontiguousarray(arr)
        with driver_call(f"upload of {arr.nbytes} bytes"):
            return cl.Buffer(self.ctx, cl.mem_flags.READ_ONLY | cl.mem_flags.COPY_HOST_PTR, hostbuf=arr)

    def empty(self, nbytes: int):
        cl = _import_cl()
        with driver_call(f"buffer of {int(nbytes)} bytes"):
            return cl.Buffer(self.ctx, cl.mem_flags.READ_WRITE, size=max(int(nbytes), 1))

    def read(self, buf, shape, dtype=np.float32) -> np.ndarray:
        cl = _import_cl()
        out = np.empty(shape, dtype=dtype)
        # blocking, and the queue is in order: an earlier launch's failure can surface here too
        with driver_call(f"read-back of {out.nbytes} bytes"):
            cl.enqueue_copy(self.queue, out, buf)
        return out

    def launch(self, kernel, global_size, local_size, *args, name: str | None = None):
        """Set args, enqueue; with profiling on, the event's kernel time is recorded."""
        cl = _import_cl()
        with driver_call(f"launch of {name or kernel.function_name}"):
            with self._launch_lock:
                kernel.set_args(*args)
                ev = cl.enqueue_nd_range_kernel(self.queue, kernel, global_size, local_size)
            if self.profiling:
                ev.wait()
                self.timings.setdefault(name or kernel.function_name, []).append(
                    (ev.profile.end - ev.profile.start) * 1e-9)
        return ev


def round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def _build_log(prog, device) -> str:
    try:
        cl = _import_cl()
        return prog.get_build_info(device, cl.program_build_info.LOG) or ""
    except Exception:
        return ""


def _write_log(d: Path, family: str, key: str, text: str) -> Path | None:
    try:
        d.mkdir(parents=True, exist_ok=True)
        p = d / f"{family}-{key}.build.log"
        p.write_text(text)
        return p
    except OSError:
        return None


# a program binary is a few hundred KB (PoCL, Mali); one far larger is not one we wrote
_MAX_BINARY_BYTES = 64 << 20


def _read_binary(path: Path, key: str) -> bytes | None:
    """The cached binary of the program `key` names, or None (absent, or unusable: one warning)."""
    try:
        data = read_capped(path, _MAX_BINARY_BYTES)
    except FileNotFoundError:
        return None
    except OSError as e:   # (a FIFO, a folder, a file far too large: read_capped says which)
        log.warning("OpenCL binary cache %s is unusable (%s); rebuilding", path, e.strerror or e)
        return None
    if data.startswith(_MAGIC_V1):
        log.warning("OpenCL binary cache %s was written by an older edgellm (no program key in its header); "
                    "rebuilding", path)
        return None
    if len(data) < _HEADER.size:
        log.warning("OpenCL binary cache %s is truncated; rebuilding", path)
        return None
    magic, held_key, digest, n = _HEADER.unpack_from(data)
    payload = data[_HEADER.size:]
    if magic != _MAGIC or n != len(payload) or sha256(payload).digest() != digest:
        log.warning("OpenCL binary cache %s fails its checksum; rebuilding", path)
        return None
    if held_key != key.encode():
        # a valid file, of another program: a driver may load it and then lack this one's kernels
        log.warning("OpenCL binary cache %s holds the binary of another program (key %s); rebuilding",
                    path, held_key.decode(errors="replace"))
        return None
    return payload


def _write_binary(path: Path, key: str, payload: bytes) -> None:
    write_atomic(path, _HEADER.pack(_MAGIC, key.encode(), sha256(payload).digest(), len(payload)) + payload)
