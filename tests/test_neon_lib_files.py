"""The library file EDGELLM_NEON_LIB names, as users get it wrong: a truncated copy killed the
process with SIGBUS inside dlopen, no message; a library for another machine, an empty file and a
bare file name in the current folder all read "No such file or directory"; a base build loaded
this way was called the dotprod library. Each is now a NeonLibError in words (the unit is then
unavailable with that reason), or loads and says what it is."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from edgellm.backends import elf_check, neon_lib


def _installed(variant: str = "dotprod") -> Path:
    return Path(neon_lib.load(variant).path)


def _load_in_child(path: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    code = ("from edgellm.backends import neon_lib\n"
            "try:\n"
            f"    neon_lib.load('dotprod', path={str(path)!r})\n"
            "except neon_lib.NeonLibError as e:\n"
            "    print('refused:', e)\n")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=120)


@pytest.mark.parametrize("keep", (2000, 100_000, -1))
def test_a_truncated_library_is_refused_not_a_crash(tmp_path, keep):
    data = _installed().read_bytes()
    cut = tmp_path / "trunc.so"
    cut.write_bytes(data[:keep] if keep > 0 else data[:-1])
    r = _load_in_child(cut, tmp_path)          # (in a child: the old loader died of SIGBUS here)
    assert r.returncode == 0, r.stderr[-500:]
    assert f"refused: {cut} is truncated ({len(cut.read_bytes())} bytes" in r.stdout


def test_a_library_for_another_machine_says_which(tmp_path):
    data = bytearray(_installed().read_bytes())
    host = int.from_bytes(data[18:20], "little")
    other = 183 if host != 183 else 62       # aarch64 on x86, x86_64 on aarch64
    data[18:20] = other.to_bytes(2, "little")
    lib = tmp_path / "other.so"
    lib.write_bytes(bytes(data))
    with pytest.raises(neon_lib.NeonLibError, match=r"is a library for (aarch64|x86_64); this CPU is"):
        neon_lib.load("dotprod", path=lib)


def test_empty_text_and_directory(tmp_path):
    (tmp_path / "empty.so").write_bytes(b"")
    (tmp_path / "text.so").write_text("not a library\n" * 10)
    for name in ("empty.so", "text.so"):
        with pytest.raises(neon_lib.NeonLibError, match="is not a shared library"):
            neon_lib.load("dotprod", path=tmp_path / name)
    with pytest.raises(neon_lib.NeonLibError, match="Is a directory"):
        neon_lib.load("dotprod", path=tmp_path)
    assert elf_check.problem(_installed()) is None


def test_a_bare_file_name_is_this_folders_file(tmp_path, monkeypatch):
    shutil.copy(_installed(), tmp_path / "libmine.so")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("EDGELLM_NEON_LIB", "libmine.so")
    lib = neon_lib.load("dotprod")
    assert lib.path == tmp_path / "libmine.so"


def test_a_library_named_by_path_says_what_it_is(monkeypatch):
    base = _installed("base")
    monkeypatch.setenv("EDGELLM_NEON_LIB", str(base))
    monkeypatch.delenv("EDGELLM_NEON_VARIANT", raising=False)
    lib = neon_lib.load()                     # the CPU would pick dotprod off Arm
    assert lib.variant == "base" and lib.variant_reason == f"EDGELLM_NEON_LIB={base}"
    monkeypatch.setenv("EDGELLM_NEON_VARIANT", "dotprod")
    lib = neon_lib.load()
    assert lib.variant == "base"
    assert lib.variant_reason == f"EDGELLM_NEON_LIB={base}; EDGELLM_NEON_VARIANT=dotprod does not apply to it"


@pytest.mark.parametrize("phentsize", (0, 8))
def test_a_damaged_program_header_size_is_a_reason_not_a_struct_error(tmp_path, phentsize):
    data = bytearray(_installed().read_bytes())
    data[54:56] = phentsize.to_bytes(2, "little")          # e_phentsize
    lib = tmp_path / "damaged.so"
    lib.write_bytes(bytes(data))
    with pytest.raises(neon_lib.NeonLibError, match=f"is damaged \\(program header entries of {phentsize} bytes\\)"):
        neon_lib.load("dotprod", path=lib)
