"""A NEON library built with -march=native on one x86 machine (every development build and
wheel) ran its first kernel on an older x86 CPU and died of SIGILL: `edgellm info` included, since
the tokenizer's native code lives in the same library. The loader now compares the extensions
the build may use (el_build_isa) with the running CPU's and refuses the library with its reason;
the neon unit is then unavailable and the reference path runs."""
import pytest

from edgellm.backends import neon_lib


def _built_isa() -> int:
    return neon_lib.load("dotprod").el_build_isa()


def test_a_library_built_for_extensions_this_cpu_lacks_is_refused(monkeypatch):
    built = _built_isa()
    if not built:
        pytest.skip("not an x86 build: el_build_isa is 0 and there is nothing to compare")
    used = [(bit, name, key) for bit, (name, key) in enumerate(neon_lib.EL_X86_ISA) if built >> bit & 1]
    assert used[0][1] == "sse4_2"                 # (x86-64-v2 at least: a real bitmask came back)
    assert neon_lib.missing_isa(built) == []      # this machine built it
    _, last, key = next(u for u in reversed(used) if u[2])
    feats = {k: True for _, _, k in used if k}
    monkeypatch.setattr(neon_lib, "numpy_cpu_features", lambda: {**feats, key: False})
    with pytest.raises(neon_lib.NeonLibError, match=f"built for a CPU with {last}, which this one lacks"):
        neon_lib.load("dotprod")
    # numpy's probe unavailable: /proc/cpuinfo's flags decide (qemu-user shows the host's there,
    # hence numpy first)
    monkeypatch.setattr(neon_lib, "numpy_cpu_features", lambda: None)
    monkeypatch.setattr(neon_lib, "cpu_flags", lambda cpuinfo="/proc/cpuinfo": frozenset(n for _, n, _ in used) - {last})
    assert neon_lib.missing_isa(built) == [last]
    monkeypatch.setattr(neon_lib, "cpu_flags", lambda cpuinfo="/proc/cpuinfo": None)   # nothing to tell: no check
    assert neon_lib.missing_isa(built) == []


def test_cpu_flags_reads_the_flags_line(tmp_path):
    f = tmp_path / "cpuinfo"
    f.write_text("processor\t: 0\nmodel name\t: x\nflags\t\t: fpu sse4_2 avx2\nbugs\t: none\n")
    assert neon_lib.cpu_flags(str(f)) == {"fpu", "sse4_2", "avx2"}
    assert neon_lib.cpu_flags(str(tmp_path / "missing")) is None
