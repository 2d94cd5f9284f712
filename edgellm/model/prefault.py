"""Pages a model's tensor data into the process's page tables in the background, at load.

Why: units that read the weights in place (neon) read them from the memory-mapped GGUF, so the
first request takes a page fault for every page it touches. On SmolLM2-135M (94 MB) on the x86
development machine the first request after load had a TTFT of 22-31 ms against 15 ms for the
next; with the mapping paged in first, 16-17 ms. A 1-3B model has 5-30x the pages, and on a phone
those faults may also read the file from flash. So load() starts a thread that populates the
mapping while load finishes and the user types; the first request then finds its pages mapped
(or, if it comes sooner, shares the work with the thread).

Nothing is allocated: the pages are the file's own (page cache). RSS counts them now instead of
during the first request. MADV_POPULATE_READ (Linux >= 5.14) does it in one system call, which
releases the GIL; elsewhere the thread reads one byte per page, in slices, so other Python
threads keep running between them. A page that cannot be read (the file shrank after it was
parsed) ends the madvise with EFAULT, reported with a warning; before reading pages itself the
thread checks the file's size (a file cut short would make the read a SIGBUS).
EDGELLM_PREFAULT=0 (or load(prefault=False)) turns it off.

commit() does the same for an anonymous array the process allocated (the KV pool's arena): its
pages are faulted in writable so that the memory is committed at load. Filling the 45 MB arena
took 3-5 ms in most loads here and 85-105 ms in about one in five, where the kernel compacted
memory for its transparent huge pages. MADV_POPULATE_WRITE changes no contents, so it runs on a
background thread while the array is already in use; without it the array is filled at once,
in the caller's thread.
"""
from __future__ import annotations

import errno
import logging
import mmap
import os
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from ..heap import madvise
from ..threads import start_quietly

log = logging.getLogger("edgellm.load")

MADV_POPULATE_READ = 22          # linux/mman.h: populate (prefault) page tables, readable
MADV_POPULATE_WRITE = 23         # the same, writable: anonymous pages committed, contents untouched
_TOUCH_SLICE = 4 << 20           # bytes read per numpy call in the fallback (1024 pages)


def enabled_by_env() -> bool:
    return os.environ.get("EDGELLM_PREFAULT", "1").strip().lower() not in ("0", "false", "no", "off")


@dataclass
class Prefault:
    """A running (or finished) paging-in of [offset, offset + nbytes) of a mapping, or commit of
    nbytes of arrays."""
    nbytes: int
    method: str = ""                  # "madvise" or "touch", once known
    seconds: float | None = None      # wall time, once done
    error: str | None = None          # why it stopped early (the mapping stays usable)
    _thread: threading.Thread | None = field(default=None, repr=False)

    def wait(self, timeout: float | None = None) -> bool:
        """True once the pages are in (or the attempt ended)."""
        if self._thread is not None:
            self._thread.join(timeout)
            return not self._thread.is_alive()
        return True


def _madvise_populate(addr: int, length: int, advice: int = MADV_POPULATE_READ) -> int:
    """0 when done, else the errno: EINVAL where the kernel lacks MADV_POPULATE_* (before 5.14,
    or no madvise at all); EFAULT where a page cannot be read (the file shrank under the
    mapping: reading it would be a SIGBUS)."""
    return madvise(addr, length, advice)


def _touch(mm: np.ndarray, start: int, end: int) -> None:
    page = mmap.PAGESIZE
    for s in range(start, end, _TOUCH_SLICE):
        int(mm[s:min(s + _TOUCH_SLICE, end):page].max())


def _run(job: Prefault, mm: np.ndarray, start: int, end: int) -> None:
    t0 = time.perf_counter()
    try:
        page = mmap.PAGESIZE
        addr = mm.ctypes.data + start
        aligned = addr & ~(page - 1)
        err = _madvise_populate(aligned, addr + (end - start) - aligned)
        if err == 0:
            job.method = "madvise"
        elif err in (errno.EINVAL, errno.ENOSYS, errno.EPERM):
            job.method = "touch"     # the kernel refuses the advice: read the pages instead
            path = getattr(mm, "filename", None)
            if path is not None and os.path.getsize(path) < mm.shape[0]:
                job.error = f"{path} is shorter than when it was read: not reading its pages"
            else:
                _touch(mm, start, end)
        else:
            job.method = "madvise"
            job.error = f"madvise(MADV_POPULATE_READ): {os.strerror(err)}"
    except (OSError, ValueError) as e:
        job.error = f"{type(e).__name__}: {e}"
    job.seconds = time.perf_counter() - t0
    if job.error:
        log.warning("paging in the weights stopped: %s (they load on first use instead)", job.error)
    else:
        log.info("weights paged in: %.0f MiB in %.0f ms (%s, in the background)", job.nbytes / 2**20,
                 job.seconds * 1e3, job.method)


def start(mm: np.ndarray, offset: int, nbytes: int) -> Prefault:
    """Pages in mm[offset:offset + nbytes] on a daemon thread; returns at once."""
    end = min(offset + max(nbytes, 0), mm.shape[0])
    job = Prefault(nbytes=max(end - offset, 0))
    if job.nbytes == 0:
        job.seconds = 0.0
        return job
    job._thread = threading.Thread(target=_run, args=(job, mm, offset, end), name="edgellm-prefault", daemon=True)
    start_quietly(job._thread)
    return job


def _spans(arrays) -> list[tuple[int, int]]:
    page = mmap.PAGESIZE
    out = []
    for a in arrays:
        addr = a.ctypes.data & ~(page - 1)
        out.append((addr, a.ctypes.data + a.nbytes - addr))
    return out


def _run_commit(job: Prefault, arrays, spans) -> None:
    # arrays: held here so that their memory outlives the thread, whoever drops them meanwhile
    t0 = time.perf_counter()
    for addr, length in spans:
        err = _madvise_populate(addr, length, MADV_POPULATE_WRITE)
        if err:
            job.error = f"madvise(MADV_POPULATE_WRITE): {os.strerror(err)}"
            log.warning("committing the KV cache's memory stopped: %s (its pages are taken on first use)", job.error)
            break
    job.seconds = time.perf_counter() - t0
    if not job.error:
        log.info("KV cache committed: %.0f MiB in %.0f ms (in the background)", job.nbytes / 2**20, job.seconds * 1e3)


def commit(arrays, background: bool = True) -> Prefault:
    """Faults in every page of `arrays` (C-contiguous arrays of anonymous memory) writable,
    committing them. With background and a kernel that has MADV_POPULATE_WRITE, on one daemon
    thread (the arrays may be used meanwhile: no contents change; one thread, since a second
    one's stack would wait for the first's populating to let go of the address space); else
    a.fill(0) for each, now (method "fill")."""
    job = Prefault(nbytes=sum(a.nbytes for a in arrays))
    spans = [sp for sp in _spans(arrays) if sp[1] > 0]
    # the advice on no bytes first, here (the kernel checks the advice, then returns at once):
    # where it is refused the fill must happen before the arrays' first writer, not racing it
    if background and spans and _madvise_populate(spans[0][0], 0, MADV_POPULATE_WRITE) == 0:
        job.method = "madvise"
        job._thread = threading.Thread(target=_run_commit, args=(job, list(arrays), spans), name="edgellm-commit",
                                       daemon=True)
        start_quietly(job._thread)
        return job
    t0 = time.perf_counter()
    for a in arrays:
        a.fill(0)
    job.method, job.seconds = "fill", time.perf_counter() - t0
    return job
