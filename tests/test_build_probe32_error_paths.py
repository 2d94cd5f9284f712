"""`edgellm build`'s errors name what the user gave, not the build's temporary folders, which are
gone when the error is read: a compile error named /tmp/edgellm-src-XXXX/one.c and
.../.b.tmp-XXXX/libedgellm_neon_base.so, and a full disk said "[Errno 28] No space left on
device" with no path at all (a probe)."""
from __future__ import annotations

import errno
import re
import shutil

import pytest

from edgellm import toolchain as tc
from tests.test_neon_selftest import _tiny_src

needs_gcc = pytest.mark.skipif(shutil.which("aarch64-linux-gnu-gcc") is None,
                               reason="needs aarch64-linux-gnu-gcc (.ci/run)")
TEMP_NAMES = re.compile(r"edgellm-src-|\.tmp-")


@needs_gcc
def test_a_compile_error_names_the_sources_and_out(tmp_path):
    src = _tiny_src(tmp_path)
    (src / "one.c").write_text('#include "edgellm_neon.h"\nint el_one(void) { return }\n')
    out = tmp_path / "b"
    with pytest.raises(tc.BuildError) as e:
        tc.build_bundle(out=out, variants=["base"], src_dir=src, progress=None)
    text = str(e.value)
    assert not TEMP_NAMES.search(text), text
    assert f"{src / 'one.c'}:2:" in text                       # the compiler's own words, on the user's file
    assert f"-o {out / tc.LIB_NAME.format('base')}" in " ".join(e.value.cmd)
    assert not TEMP_NAMES.search(" ".join(e.value.cmd) + e.value.output)


@needs_gcc
def test_a_full_disk_names_out(tmp_path, monkeypatch):
    def full(path, seed):
        raise OSError(errno.ENOSPC, "No space left on device")   # as a write() says it: no file name

    monkeypatch.setattr(tc, "write_cases", full)
    out = tmp_path / "b"
    with pytest.raises(tc.ToolchainError, match=f"cannot write the bundle at {out}: No space left on device"):
        tc.build_bundle(out=out, variants=["base"], src_dir=_tiny_src(tmp_path), progress=None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]
