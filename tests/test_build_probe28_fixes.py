"""`build` and the library loader read a bundle.json someone else may have put there: a FIFO hung
`build` and, beside EDGELLM_NEON_LIB, every command; a link to /dev/zero grew the process to 24 GB
(a probe). A rebuild stopped between its two renames left no bundle at all."""
import os
import shutil
import threading
from pathlib import Path

import pytest

from edgellm import toolchain as tc
from edgellm.backends import neon_lib


def _returns_within(fn, seconds=10):
    out = {}

    def run():
        try:
            out["v"] = fn()
        except BaseException as e:   # noqa: BLE001 - raised again in the test's thread
            out["e"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"{fn} did not return within {seconds} s"
    if "e" in out:
        raise out["e"]
    return out["v"]


@pytest.mark.parametrize("kind", ["fifo", "dev-zero"])
def test_a_bundle_json_that_is_not_a_file_is_not_a_bundle(tmp_path, kind):
    out = tmp_path / "o"
    out.mkdir()
    if kind == "fifo":
        os.mkfifo(out / "bundle.json")
    else:
        (out / "bundle.json").symlink_to("/dev/zero")
    assert _returns_within(lambda: tc._is_bundle(out)) is False
    with pytest.raises(tc.ToolchainError, match="not an edgellm bundle"):
        _returns_within(lambda: tc.build_bundle(out=out, variants=["base"], progress=None))


def test_a_fifo_beside_the_library_is_no_bundle_to_check(tmp_path):
    lib = next(Path(neon_lib.__file__).resolve().parent.parent.glob("_neon_base*.so"), None)
    if lib is None:
        pytest.skip("the installed library is not built here")
    copy = tmp_path / "libedgellm_neon_base.so"
    shutil.copy(lib, copy)
    os.mkfifo(tmp_path / "bundle.json")
    assert _returns_within(lambda: neon_lib.bundle_problem(copy)) is None


def test_a_rebuild_stopped_between_its_renames_keeps_the_old_bundle(tmp_path, monkeypatch):
    from tests.test_neon_selftest import _tiny_src

    src = _tiny_src(tmp_path)
    out = tmp_path / "out"
    tc.build_bundle(out=out, variants=["base"], src_dir=src, progress=None)
    before = sorted(p.name for p in out.iterdir())
    real, calls = os.replace, []

    def replace(a, b):
        if Path(b) == out and Path(a).name.startswith(".out.tmp-"):
            calls.append(a)             # the new bundle into place: a Ctrl-C there
            raise KeyboardInterrupt
        return real(a, b)

    monkeypatch.setattr(tc.os, "replace", replace)
    with pytest.raises(KeyboardInterrupt):
        tc.build_bundle(out=out, variants=["base"], src_dir=src, progress=None)
    monkeypatch.setattr(tc.os, "replace", real)
    assert calls, "the build never got to its last rename"
    assert sorted(p.name for p in out.iterdir()) == before
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "temporary folders left behind"


def test_loading_a_model_does_not_import_the_toolchain(tmp_path):
    """The bundle check imported edgellm.toolchain to read bundle.json: 4.5 MiB more RSS for
    every run, which put bench's peak (187 MiB) over its memory bound (185.7 MiB)."""
    import subprocess
    import sys

    from gguf import GGMLQuantizationType as QT

    from tests.synthetic import write_tiny_model

    path = write_tiny_model(tmp_path / "t.gguf", tensor_type=QT.Q4_0, seed=1).path
    code = ("import sys, edgellm; e = edgellm.load(sys.argv[1], n_ctx=64, threads=1); e.generate('hi', max_tokens=2); "
            "print(sorted(m for m in sys.modules if m.startswith('edgellm.toolchain')))")
    r = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"
