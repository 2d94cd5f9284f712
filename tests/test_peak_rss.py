"""Peak RSS as bench reports it is the process's own, not its parent's (getrusage's ru_maxrss
survives fork and exec: a bench started by a large parent reported the parent's peak)."""
import subprocess
import sys

import numpy as np
import pytest


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="VmHWM is Linux's")
def test_child_reports_its_own_peak_not_the_parents():
    from edgellm.generation import peak_rss_mb

    big = np.ones(400 * 2**20 // 8)                 # 400 MB resident in this process
    assert peak_rss_mb() >= 400
    code = "from edgellm.generation import peak_rss_mb; print(peak_rss_mb())"
    child = float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    assert child < 300, child                       # an interpreter with edgellm imported: tens of MB
    del big


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/smaps is Linux's")
def test_file_rss_counts_the_pages_of_that_file_this_process_touched(tmp_path):
    from edgellm.procmem import file_rss_mb

    path = tmp_path / "w.bin"
    path.write_bytes(b"\1" * (8 * 2**20))
    other = tmp_path / "other.bin"
    other.write_bytes(b"\2" * 2**20)
    assert file_rss_mb(path) == 0.0                 # not mapped yet
    m = np.memmap(path, dtype=np.uint8, mode="r")
    o = np.memmap(other, dtype=np.uint8, mode="r")
    assert int(o[::4096].sum()) == 2 * 256          # the other file's pages do not count
    assert int(m[: 4 * 2**20: 4096].sum()) == 1024  # half the file touched
    assert 3.9 <= file_rss_mb(path) <= 8.0 + 0.01
    assert int(m[::4096].sum()) == 2048
    assert 7.9 <= file_rss_mb(path) <= 8.0 + 0.01
    del m, o


def test_meminfo_figures_are_what_psutil_reports():
    import psutil

    from edgellm.procmem import available_bytes, total_bytes

    got, want = available_bytes(), psutil.virtual_memory().available
    assert got > 0 and abs(got - want) <= max(64 * 2**20, want // 20), (got, want)
    assert total_bytes() == psutil.virtual_memory().total
