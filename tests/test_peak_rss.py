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
