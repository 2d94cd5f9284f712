"""A library EDGELLM_NEON_LIB names, and a library in an `edgellm build` bundle. A named library
that could not be loaded (another CPU's, cut short, missing) only made the neon unit unavailable:
the run went on with the numpy reference, 10x slower, exit 0. A bundle's library that was swapped
or cut short after the build was not noticed, though bundle.json records each file's sha256."""
import hashlib
import json
import shutil
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType as QT
from typer.testing import CliRunner

from edgellm.backends import neon_lib
from edgellm.cli import app
from tests.cli_checks import one_line_error
from tests.synthetic import write_tiny_model

runner = CliRunner()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("probe23n") / "tiny.gguf", tensor_type=QT.Q8_0, seed=5).path


def _installed(variant: str) -> Path:
    return Path(neon_lib.load(variant).path)


def _bundle(folder: Path, sizes: bool = True) -> Path:
    """A bundle folder as `edgellm build` writes one, holding this machine's dotprod library."""
    folder.mkdir()
    lib = folder / "libedgellm_neon_dotprod.so"
    shutil.copy(_installed("dotprod"), lib)
    meta = {"format": 1, "target": "aarch64-linux-gnu", "variants": {},
            "files": {lib.name: hashlib.sha256(lib.read_bytes()).hexdigest()}}
    if sizes:
        meta["sizes"] = {lib.name: lib.stat().st_size}
    (folder / "bundle.json").write_text(json.dumps(meta))
    return lib


def _swap(src: Path, dst: Path) -> None:
    """dst's content replaced by src's as a new file: overwriting a library in place under a
    process that has it mapped (an earlier load) crashes that process."""
    tmp = dst.with_name(dst.name + ".new")
    shutil.copy(src, tmp)
    tmp.replace(dst)


def _other_machine(tmp_path: Path) -> Path:
    data = bytearray(_installed("dotprod").read_bytes())
    host = int.from_bytes(data[18:20], "little")
    data[18:20] = (183 if host != 183 else 62).to_bytes(2, "little")   # e_machine: aarch64 <-> x86_64
    lib = tmp_path / "other.so"
    lib.write_bytes(bytes(data))
    return lib


@pytest.mark.parametrize("kind", ("other machine", "truncated", "missing", "swapped in a bundle"))
def test_a_named_library_that_cannot_be_used_is_an_error_not_a_fallback(tiny, tmp_path, monkeypatch, kind):
    monkeypatch.setenv("EDGELLM_HOME", str(tmp_path / "home"))
    if kind == "other machine":
        lib, why = _other_machine(tmp_path), "is a library for"
    elif kind == "truncated":
        lib, why = tmp_path / "trunc.so", "is truncated"
        lib.write_bytes(_installed("dotprod").read_bytes()[:100_000])
    elif kind == "missing":
        lib, why = tmp_path / "missing.so", "No such file"
    else:
        lib, why = _bundle(tmp_path / "bundle"), "bundle.json records"
        _swap(_installed("base"), lib)
    monkeypatch.setenv("EDGELLM_NEON_LIB", str(lib))
    for cmd in (["run", "hi", "-m", tiny, "-n", "1"], ["plan", "--model", tiny]):
        r = runner.invoke(app, cmd)
        one_line_error(r, f"EDGELLM_NEON_LIB={lib}: cannot use it: ")
        assert why in r.stderr, r.stderr
    # building a bundle uses no kernel: a device's library named there is not its concern
    import edgellm.toolchain

    monkeypatch.setattr(edgellm.toolchain, "build_bundle", lambda *a, **k: tmp_path / "b")
    assert runner.invoke(app, ["build", "--out", str(tmp_path / "b")]).exit_code == 0


@pytest.mark.parametrize("kind", ("other machine", "missing"))
def test_the_api_refuses_a_named_library_it_cannot_use(tiny, tmp_path, monkeypatch, kind):
    """edgellm.load() as the CLI: it warned, made the neon unit unavailable and ran the model on
    the numpy reference (session 22's probe: peak RSS 709 MiB, token by token)."""
    import edgellm
    from edgellm.errors import ConfigError

    monkeypatch.setenv("EDGELLM_HOME", str(tmp_path / "home"))
    usable = _installed("dotprod")
    lib = _other_machine(tmp_path) if kind == "other machine" else tmp_path / "missing.so"
    monkeypatch.setenv("EDGELLM_NEON_LIB", str(lib))
    with pytest.raises(ConfigError, match=f"EDGELLM_NEON_LIB={lib}: cannot use it: "):
        edgellm.load(tiny)
    monkeypatch.setenv("EDGELLM_NEON_LIB", str(usable))   # a usable one loads
    eng = edgellm.load(tiny, prefault=False)
    assert "neon" in eng.plan.units_used()


def test_a_bundles_library_is_checked_against_bundle_json(tmp_path):
    lib = _bundle(tmp_path / "bundle", sizes=False)                  # (the size check aside: the hash's)
    assert neon_lib.load("dotprod", path=lib).path == lib            # as built: loads
    link = tmp_path / "libmine.so"                                   # a link to it: checked as its bundle's
    link.symlink_to(lib)
    _swap(_installed("base"), lib)                             # a valid library, not the one built
    for p in (lib, link):
        with pytest.raises(neon_lib.NeonLibError, match=r"has sha256 [0-9a-f]{64}, but its bundle's .*bundle.json "
                                                        r"records [0-9a-f]{64}: the file was truncated or replaced"):
            neon_lib.load("dotprod", path=p)


def test_a_short_copy_is_named_by_its_size(tmp_path):
    lib = _bundle(tmp_path / "bundle")
    full = lib.stat().st_size
    lib.write_bytes(lib.read_bytes()[:-4096])         # (never loaded: written in place)
    with pytest.raises(neon_lib.NeonLibError, match=f"is {full - 4096} bytes, but its bundle's .* records {full}"):
        neon_lib.load("dotprod", path=lib)
    lib2 = _bundle(tmp_path / "old", sizes=False)                    # (a bundle from before sizes: the hash)
    lib2.write_bytes(lib2.read_bytes()[:-4096])
    with pytest.raises(neon_lib.NeonLibError, match="has sha256"):
        neon_lib.load("dotprod", path=lib2)


def test_another_projects_bundle_json_is_not_read(tmp_path):
    (tmp_path / "bundle.json").write_text(json.dumps({"name": "my app", "files": {"x.so": "0" * 64}}))
    lib = tmp_path / "x.so"
    shutil.copy(_installed("dotprod"), lib)
    assert neon_lib.load("dotprod", path=lib).path == lib
    assert neon_lib.bundle_problem(_installed("dotprod")) is None


@pytest.mark.parametrize("var, value", [("EDGELLM_X86_GEMV", "avx-512"), ("EDGELLM_NEON_VARIANT", "Dotprod")])
def test_a_mistyped_library_choice_is_an_error_not_a_fallback(tiny, tmp_path, monkeypatch, var, value):
    """A typo in EDGELLM_X86_GEMV or EDGELLM_NEON_VARIANT made the neon unit unavailable: the run
    went on with the numpy reference (0.8 tok/s instead of ~160, 709 MiB peak RSS), exit 0 (a
    helper's probe of the docs). The CLI and load() refuse it, naming the variable."""
    import edgellm
    from edgellm.errors import ConfigError

    monkeypatch.setenv("EDGELLM_HOME", str(tmp_path / "home"))
    monkeypatch.setenv(var, value)
    allowed = " or ".join(neon_lib._CHOICES[var])
    for cmd in (["run", "hi", "-m", tiny, "-n", "1"], ["plan", "--model", tiny]):
        one_line_error(runner.invoke(app, cmd), f"{var} must be {allowed}, got {value!r} (unset it to let edgellm "
                                                f"choose)")
    with pytest.raises(ConfigError, match=f"{var} must be {allowed}"):
        edgellm.load(tiny)
    monkeypatch.setenv(var, neon_lib._CHOICES[var][1])    # a valid choice still runs
    assert runner.invoke(app, ["run", "hi", "-m", tiny, "-n", "1"]).exit_code == 0
