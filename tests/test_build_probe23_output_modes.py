"""A user's output files get the usual permissions: profiles were written 0600 (write_atomic's
mode for caches), unreadable to the other tools and users that read a device profile, and an
explicit mode ignored the umask (0644 under a umask of 077)."""
import os
import stat

import pytest

from edgellm.api import device_profile
from edgellm.device.profile_yaml import load_profile, write_profile
from edgellm.fileio import write_atomic


@pytest.fixture
def umask():
    old = os.umask(0o022)
    yield lambda m: os.umask(m)
    os.umask(old)


def _mode(p) -> int:
    return stat.S_IMODE(os.stat(p).st_mode)


def test_a_profile_is_written_0644_less_the_umask(tmp_path, umask):
    prof = device_profile("rk3588")
    p = write_profile(prof, tmp_path / "dev.yaml")
    assert _mode(p) == 0o644
    assert load_profile(p).soc == prof.soc
    umask(0o077)
    assert _mode(write_profile(prof, tmp_path / "private.yaml")) == 0o600


def test_write_atomic_mode_respects_the_umask(tmp_path, umask):
    umask(0o027)
    write_atomic(tmp_path / "a", b"x", mode=0o644)
    assert _mode(tmp_path / "a") == 0o640
    write_atomic(tmp_path / "b", b"x")                 # (no mode: a cache's owner-only temp file)
    assert _mode(tmp_path / "b") == 0o600
