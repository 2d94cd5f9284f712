"""A writer killed mid-write (SIGKILL, a phone's low-memory killer) leaves its temporary file
beside a cache file; the next writer in that folder removes it. The OpenCL binary cache never
did (a helper's probe, session 26)."""
import os
import subprocess
import sys

from edgellm.backends import opencl_runtime


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_the_opencl_binary_cache_removes_a_killed_writers_temp_file(tmp_path):
    dead = tmp_path / f".prog.bin.pid{_dead_pid()}.x1y2z3.tmp"
    live = tmp_path / f".prog.bin.pid{os.getpid()}.a1b2c3.tmp"
    dead.write_bytes(b"half a binary")
    live.write_bytes(b"being written")
    opencl_runtime._write_binary(tmp_path / "prog.bin", "key", b"payload")
    assert not dead.exists() and live.exists() and (tmp_path / "prog.bin").is_file()
