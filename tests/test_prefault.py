"""Paging the mapped weights in at load (model/prefault.py): the pages of the mapping become
resident (by MADV_POPULATE_READ, or by reading one byte per page where that is refused), and
load() does it only for a unit that reads the mapping in place (neon), unless turned off."""
import errno
import os

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

import edgellm
from edgellm.model import prefault

from .synthetic import write_tiny_model

MB = 2**20


def _mapped_rss(path) -> int:
    """Resident bytes of this process's mappings of `path` (/proc/self/smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            parts = line.split()
            if parts and "-" in parts[0] and not parts[0].endswith(":"):
                inside = len(parts) >= 6 and parts[5] == str(path)
            elif inside and parts[0] == "Rss:":
                total += int(parts[1]) * 1024
    return total


def _file(tmp_path, name, size=8 * MB):
    p = tmp_path / name
    p.write_bytes(np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8).tobytes())
    return p


pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="needs Linux /proc/self/smaps")


@pytest.mark.parametrize("madvise_works", [True, False], ids=["madvise", "touch"])
def test_start_makes_the_mapping_resident(tmp_path, monkeypatch, madvise_works):
    if not madvise_works:
        monkeypatch.setattr(prefault, "_madvise_populate", lambda addr, length: errno.EINVAL)
    p = _file(tmp_path, "w.bin")
    mm = np.memmap(p, dtype=np.uint8, mode="r")
    before = _mapped_rss(p)
    job = prefault.start(mm, 4096, mm.shape[0] - 4096)
    assert job.wait(30)
    after = _mapped_rss(p)
    assert before < 2 * MB, before                       # a fresh mapping: hardly anything resident
    assert after >= mm.shape[0] - 2 * 4096, (before, after)
    assert job.error is None and job.seconds is not None
    # a kernel before 5.14 refuses MADV_POPULATE_READ: then the thread reads the pages itself
    assert job.method in (("madvise", "touch") if madvise_works else ("touch",))


def test_a_file_shrunk_under_the_mapping_is_an_error_not_a_crash(tmp_path):
    """Pages past the file's new end cannot be read (a read would be SIGBUS): the madvise ends
    with EFAULT, the job says so, and nothing touches those pages."""
    p = _file(tmp_path, "s.bin")
    mm = np.memmap(p, dtype=np.uint8, mode="r")
    os.truncate(p, 1 * MB)
    job = prefault.start(mm, 0, mm.shape[0])
    assert job.wait(30)
    assert job.error, job
    assert ("Bad address" in job.error) if job.method == "madvise" else ("shorter than" in job.error)


def test_the_fallback_does_not_read_a_file_shrunk_under_the_mapping(tmp_path, monkeypatch):
    monkeypatch.setattr(prefault, "_madvise_populate", lambda addr, length: errno.EINVAL)
    p = _file(tmp_path, "t.bin")
    mm = np.memmap(p, dtype=np.uint8, mode="r")
    os.truncate(p, 1 * MB)
    job = prefault.start(mm, 0, mm.shape[0])
    assert job.wait(30)
    assert job.method == "touch" and "shorter than" in (job.error or ""), job


def test_start_with_nothing_to_do(tmp_path):
    p = _file(tmp_path, "e.bin", 4096)
    mm = np.memmap(p, dtype=np.uint8, mode="r")
    job = prefault.start(mm, 4096, 100)
    assert job.nbytes == 0 and job.wait(0) and job.seconds == 0.0


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("pf") / "tiny.gguf", tensor_type=QT.Q8_0, n_layers=2,
                            d_model=64, n_heads=4, n_kv_heads=2, seed=5).path


def test_load_pages_in_the_weights_a_mapping_unit_reads(tiny):
    eng = edgellm.load(tiny, n_ctx=64, units=["neon"])
    assert eng.prefault is not None
    assert eng.wait_loaded(30)
    g = eng.model.gguf
    assert eng.prefault.nbytes == g.file_size - g.data_offset
    assert eng.prefault.error is None and eng.prefault.method in ("madvise", "touch")
    assert _mapped_rss(os.path.realpath(tiny)) >= eng.prefault.nbytes - 2 * 4096
    assert eng.load_rss_mb > 0


def test_load_leaves_the_mapping_alone_when_told_or_when_no_unit_maps_it(tiny, monkeypatch):
    assert edgellm.load(tiny, n_ctx=64, units=["neon"], prefault=False).prefault is None
    assert edgellm.load(tiny, n_ctx=64, units=["reference"]).prefault is None   # it copies the weights
    monkeypatch.setenv("EDGELLM_PREFAULT", "0")
    eng = edgellm.load(tiny, n_ctx=64, units=["neon"])
    # (the KV pool's background commit may still run on a loaded machine: wait_loaded(0) was flaky)
    assert eng.prefault is None and eng.wait_loaded(30)


# ---- committing an anonymous array (the KV pool's arena) ------------------------------------------

def _resident_pages(a: np.ndarray) -> int:
    """Pages of `a`'s range resident now (mincore)."""
    import ctypes
    import mmap

    page = mmap.PAGESIZE
    start = a.ctypes.data & ~(page - 1)
    n = (a.ctypes.data + a.nbytes - start + page - 1) // page
    vec = (ctypes.c_ubyte * n)()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    assert libc.mincore(start, n * page, vec) == 0, os.strerror(ctypes.get_errno())
    return sum(v & 1 for v in vec)


def test_commit_makes_every_page_resident_and_keeps_what_was_written_meanwhile():
    a, b = np.zeros(48 * MB, np.uint8), np.zeros(16 * MB, np.uint8)
    job = prefault.commit((a, b), background=True)
    # written while the commit may still run: populating must not change any contents (a fill
    # racing these writes would wipe them)
    a[::4096] = 7
    b[-1] = 9
    assert job.wait(30)
    assert job.error is None and job.method in ("madvise", "fill"), (job.method, job.error)
    assert _resident_pages(a) >= a.nbytes // 4096
    assert _resident_pages(b) >= b.nbytes // 4096
    assert int(a[::4096].min()) == 7 and int(b[-1]) == 9 and int(a[1::4096].max()) == 0


def test_commit_fills_at_once_where_the_kernel_refuses_the_advice(monkeypatch):
    monkeypatch.setattr(prefault, "_madvise_populate", lambda *a: errno.EINVAL)
    a = np.empty(8 * MB, np.uint8)
    a[:] = 3
    job = prefault.commit((a,), background=True)
    assert job._thread is None and job.method == "fill" and job.seconds is not None   # done on return
    assert int(a.max()) == 0
    assert _resident_pages(a) >= a.nbytes // 4096


def test_the_engine_waits_for_its_kv_commit(tmp_path, monkeypatch):
    """wait_loaded() returns only once the KV arena's commit has: the commit is held open here
    until the test lets it go (a wait that ignored it would return True at once)."""
    import threading

    release = threading.Event()
    real = prefault._madvise_populate

    def held(addr, length, advice=prefault.MADV_POPULATE_READ):
        if advice == prefault.MADV_POPULATE_WRITE and length > 0:
            release.wait(30)
        return real(addr, length, advice)

    monkeypatch.setattr(prefault, "_madvise_populate", held)
    tm = write_tiny_model(tmp_path / "t.gguf", tensor_type=QT.Q8_0, n_layers=2)
    eng = edgellm.load(tm.path, n_ctx=512, threads=1, prefault=False)
    job = eng.kv.commit
    if job.method == "fill":     # a kernel without MADV_POPULATE_WRITE: filled during load
        assert eng.wait_loaded(0)
    else:
        assert job.method == "madvise"
        assert not eng.wait_loaded(0.2) and job.seconds is None
        release.set()
        assert eng.wait_loaded(30) and job.seconds is not None and job.error is None
    assert _resident_pages(eng.kv.pool.k) >= eng.kv.pool.k.nbytes // 4096
