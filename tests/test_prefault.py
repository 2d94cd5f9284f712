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
    assert eng.prefault is None and eng.wait_loaded(0)
