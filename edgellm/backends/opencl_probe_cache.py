"""The OpenCL probe's last passing answer, kept on disk per driver and kernel set, so that a load
does not wait for a probe child whose answer cannot have changed.

The child (backends/opencl_probe.py) costs a load its own Python start, the driver, the kernel
binaries and a self-check: ~0.15-0.35 s on the critical path of every load on this host (PoCL),
whose profile lists a GPU. Its answer depends only on what `identity()` digests: the Python and
edgellm running, the kernel (OS) release, every environment variable the OpenCL loader, PoCL,
pyopencl or edgellm's OpenCL unit reads, the ICD files and the driver libraries they name (path,
size, mtime, inode), pyopencl's own libraries, and the probe's inputs in edgellm (the kernel
sources, the unit's Python files), and the program binaries in the cache. A driver update, a new
kernel, an edited probe or a changed binary is a new identity and so a new probe. Only passing
answers are kept: a failure, a crash or a timeout is probed again at the next load. EDGELLM_OPENCL_PROBE_CACHE=0 turns the cache off.

Stdlib only, like opencl_child.py: it runs before the runtime is imported.
"""
from __future__ import annotations

import glob
import json
import os
import sys
import time
from pathlib import Path

from .. import __version__
from ..fileio import read_capped, write_atomic
from ..hashing import sha256
from ..model.registry import edgellm_home

_ENV_PREFIXES = ("OCL_", "OPENCL_", "POCL_", "PYOPENCL_", "EDGELLM_OPENCL_")
# where ICD loaders look for *.icd files (Linux, then Android vendor partitions)
_VENDOR_DIRS = ("/etc/OpenCL/vendors", "/vendor/etc/OpenCL/vendors", "/system/vendor/etc/OpenCL/vendors")
# where a library an .icd names without a path, or an Android libOpenCL, is found
_LIB_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/lib",
             "/vendor/lib64", "/vendor/lib64/egl", "/system/vendor/lib64", "/system/vendor/lib64/egl",
             "/system/lib64")
_ANDROID_LIBS = ("libOpenCL.so", "libGLES_mali.so", "libmali.so")
_BACKENDS = Path(__file__).resolve().parent


def enabled() -> bool:
    return os.environ.get("EDGELLM_OPENCL_PROBE_CACHE", "1") != "0"


def kernel_dir() -> Path:
    """The .cl sources the unit builds: $EDGELLM_OPENCL_KERNELS, else the shipped folder."""
    env = os.environ.get("EDGELLM_OPENCL_KERNELS")
    if env:
        return Path(env)
    shipped = _BACKENDS.parent / "opencl_kernels"
    if shipped.is_dir():
        return shipped
    return _BACKENDS.parents[1] / "opencl_kernels"    # editable install: the repo folder


def _stat(path: str) -> tuple:
    try:
        st = os.stat(path)
    except OSError:
        return (path, None)
    return (path, st.st_size, st.st_mtime_ns, st.st_ino)


def _icd_entries() -> list:
    dirs = [os.environ["OCL_ICD_VENDORS"]] if os.environ.get("OCL_ICD_VENDORS") else list(_VENDOR_DIRS)
    out = []
    for d in dirs:
        files = [d] if os.path.isfile(d) else sorted(glob.glob(os.path.join(d, "*.icd")))
        for icd in files:
            try:
                lib = Path(icd).read_text(errors="replace").strip()
            except OSError:
                continue
            named = [lib] if os.path.isabs(lib) else [os.path.join(x, lib) for x in _LIB_DIRS]
            out.append((icd, lib, [_stat(p) for p in named if os.path.exists(p)]))
    return out


def _pyopencl_libs() -> list:
    import importlib.util

    spec = importlib.util.find_spec("pyopencl")
    if spec is None or not spec.origin:
        return []
    pkg = Path(spec.origin).parent
    libs = sorted(glob.glob(str(pkg / "*.so*")) + glob.glob(str(pkg.parent / "pyopencl.libs" / "*")))
    return [_stat(p) for p in libs]


def identity() -> str:
    """A digest of everything the probe's answer depends on (see the module's docstring)."""
    uname = os.uname()
    parts = [
        sys.executable, sys.version, __version__, uname.release, uname.machine,
        sorted((k, v) for k, v in os.environ.items() if k.startswith(_ENV_PREFIXES)),
        _icd_entries(),
        [_stat(os.path.join(d, n)) for d in _LIB_DIRS for n in _ANDROID_LIBS if os.path.exists(os.path.join(d, n))],
        _pyopencl_libs(),
        [_stat(str(p)) for p in sorted(kernel_dir().glob("*.cl"))],
        [_stat(str(p)) for p in sorted(_BACKENDS.glob("opencl*.py"))] + [_stat(str(_BACKENDS / "reference.py")),
                                                                          _stat(str(_BACKENDS.parent / "quant.py"))],
        # the program binaries the child loaded: one changed since (damaged, replaced) is probed in
        # the child again; kept answers skipped the child, and a bad binary crashed the engine itself
        [_stat(str(p)) for p in sorted((edgellm_home() / "cache" / "opencl").glob("*.bin"))],
    ]
    return sha256(repr(parts).encode()).hexdigest()


def _path(ident: str) -> Path:
    # one file per identity: two Python environments sharing EDGELLM_HOME keep an answer each
    return edgellm_home() / "cache" / "opencl" / f"probe-answer-{ident[:24]}.json"


def load() -> dict | None:
    """The passing answer stored for this identity, with "cached_at" (when it was kept, local
    time, "YYYY-MM-DD HH:MM") added; None when there is none, the cache is off, or the file is
    unreadable in any way (a miss)."""
    if not enabled():
        return None
    try:
        ident = identity()
        # (~400 bytes; read_capped: a FIFO there hung every edgellm.load(), an 8 GB file was read whole)
        data = json.loads(read_capped(_path(ident), _MAX_ANSWER_BYTES))
        if data.get("identity") != ident:
            return None
        answer = data["answer"]
        if not (isinstance(answer, dict) and answer.get("ok") is True and _typed(answer)):
            return None
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(float(data["written"])))
        return dict(answer, cached_at=when)
    except (OSError, ValueError, KeyError, TypeError, AttributeError, OverflowError, RecursionError):
        return None


_MAX_ANSWER_BYTES = 64 << 10
# the probe child's fields (opencl_probe.main) and their types: an answer the child did not
# write ({"ok": true} alone, "int8_dot": "yes") would stand in for a probe that never ran
_ANSWER_TYPES = {"ok": bool, "reason": str, "device": str, "build_s": (int, float), "int8_dot": bool,
                 "seconds": (int, float)}


def _typed(answer: dict) -> bool:
    return all(isinstance(answer.get(k), t) for k, t in _ANSWER_TYPES.items())


def store(answer: dict) -> None:
    """Keeps a passing answer for this identity (atomically; a write that fails is only a miss
    next time)."""
    if not enabled() or answer.get("ok") is not True:
        return
    ident = identity()
    payload = {"identity": ident, "written": time.time(),
               "answer": {k: v for k, v in answer.items() if k != "cached_at"}}
    try:
        write_atomic(_path(ident), json.dumps(payload).encode())
    except OSError:
        pass
