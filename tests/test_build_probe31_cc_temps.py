"""A stopped `edgellm build` leaves none of the compiler's temporary files behind: the compilers were
SIGKILLed, and gcc's driver, killed so, never removed its /tmp/cc*.s and *.o (7 to 28 files per
interrupted build). They are now sent SIGTERM first, to the driver's whole process group."""
from __future__ import annotations

import shutil

import pytest

from edgellm import toolchain as tc


@pytest.mark.skipif(shutil.which("aarch64-linux-gnu-gcc") is None, reason="needs aarch64-linux-gnu-gcc (.ci/run)")
def test_stopped_build_leaves_no_compiler_temporaries(tmp_path, monkeypatch):
    cctmp = tmp_path / "cctmp"
    cctmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(cctmp))     # where gcc puts its cc*.s and cc*.o

    def progress(msg: str) -> None:
        if msg.startswith("writing"):            # the compilers are running
            import time
            time.sleep(3)                        # well into cc1 and as
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        tc.build_bundle("aarch64-linux-gnu", out=tmp_path / "b", progress=progress)
    assert not (tmp_path / "b").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".b.tmp-")] == []
    left = sorted(p.name for p in cctmp.iterdir() if p.name.startswith("cc"))
    assert left == [], f"the compilers' temporary files were left behind: {left}"


def test_a_missing_cross_libc_says_what_to_install():
    """gcc without libc6-dev-arm64-cross failed the static self-test's link with the linker's raw
    'cannot find -lc' and no word of the package (a probe)."""
    from edgellm.toolchain import BuildError
    e = BuildError("link", ["aarch64-linux-gnu-gcc", "-static"], "ld: cannot find -lc: No such file or directory")
    assert "apt install libc6-dev-arm64-cross" in str(e)
    assert "hint" not in str(BuildError("compile", ["cc"], "attention.c:1: error: expected ';'"))
