"""`edgellm build` checks that its --out can be written before anything compiles: a read-only
mount given as --out compiled every variant (minutes on a small machine) and then failed with
"Device or resource busy" (a probe). Root writes through any mode bits, so the tests stand a
mount point and an unwritable folder in with monkeypatch."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from edgellm import toolchain as tc
from tests.test_neon_selftest import _tiny_src

needs_gcc = pytest.mark.skipif(shutil.which("aarch64-linux-gnu-gcc") is None,
                               reason="needs aarch64-linux-gnu-gcc (.ci/run)")


@needs_gcc
def test_a_mount_point_as_out_is_refused_before_compiling(tmp_path, monkeypatch):
    src, said = _tiny_src(tmp_path), []
    out = tmp_path / "usb"
    out.mkdir()                      # empty: a folder a bundle may replace, were it not mounted
    real = os.path.ismount
    monkeypatch.setattr(tc.os.path, "ismount", lambda p: Path(p) == out or real(p))
    with pytest.raises(tc.ToolchainError, match=f"{out}: it is a mount point.*{out / 'edgellm-bundle'}"):
        tc.build_bundle(out=out, variants=["base"], src_dir=src, progress=said.append)
    assert not [m for m in said if m.startswith("compiling")], said
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src", "usb"]


@needs_gcc
@pytest.mark.parametrize("where", ["parent", "grandparent", "out"])
def test_an_unwritable_folder_is_named_before_compiling(tmp_path, monkeypatch, where):
    src, said = _tiny_src(tmp_path), []
    ro = tmp_path / "ro"
    ro.mkdir()
    out = {"parent": ro / "b", "grandparent": ro / "new" / "b", "out": ro}[where]
    real = os.access
    monkeypatch.setattr(tc.os, "access", lambda p, mode, **k: Path(p) != ro and real(p, mode, **k))
    with pytest.raises(tc.ToolchainError, match=f"cannot write the bundle at {out}: the folder "
                       f"{'' if where == 'out' else f'{ro} '}is not writable"):
        tc.build_bundle(out=out, variants=["base"], src_dir=src, progress=said.append)
    assert not [m for m in said if m.startswith("compiling")], said
    assert list(ro.iterdir()) == []
