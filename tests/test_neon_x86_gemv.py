"""The x86 GEMV choice (el_x86_gemv, neon_lib.choose_x86_gemv): a development build on an AVX-512
VNNI + VBMI CPU holds two GEMVs per path, the AVX-512 ones (qgemv_avx512.h) and the AVX2 ones;
the loader picks by CPU (Zen 4 runs 512-bit operations as two halves, and its AVX2 GEMVs decoded
faster there). Whichever runs, the outputs must match the reference; the choice itself is
tested against made-up /proc/cpuinfo files, so it runs on any machine."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from edgellm.backends import neon_lib, reference
from tests.test_neon_matmul import KS, NS, Errors, el_matmul, el_matmul_f32act, nmse, weights

# the two kernels sum a row in other orders: fp32 rounding apart, as the NEON / generic twins
NMSE_KERNELS = 1e-10


@pytest.fixture(scope="module")
def lib():
    lib = neon_lib.load("dotprod")
    if lib.el_x86_gemv(-1) < 0:
        pytest.skip("this build has no AVX-512 GEMVs (Arm, or x86 without AVX-512 VNNI + VBMI): "
                    "one GEMV per path, nothing to choose")
    before = lib.el_x86_gemv(-1)
    yield lib
    lib.el_x86_gemv(before)


def _gemv(lib, qtype, raw, x, mask):
    lib.el_x86_gemv(mask)
    rc, y = el_matmul_f32act(lib, qtype, [raw], x) if qtype == T.Q8_0 else el_matmul(lib, qtype, [raw], x)
    assert rc == 0
    return y


@pytest.mark.parametrize("mask", (0, 1, 2, 3))
@pytest.mark.parametrize("qtype", (T.Q4_0, T.Q4_1, T.Q8_0), ids=lambda t: t.name)
def test_either_gemv_matches_the_reference(lib, qtype, mask):
    """One x row (the GEMV paths), every K remainder of the 4-block groups, tails of rows.
    Q8_0 goes through el_matmul_f32act: that GEMV is the lm_head's."""
    rng = np.random.default_rng(mask)
    for K in KS:
        errs = Errors(qtype, fp32_x=qtype == T.Q8_0)   # (pooled per K: see Errors)
        for N in NS:
            raw, deq = weights(qtype, N, K)
            for _ in range(4):
                x = rng.standard_normal((1, K)).astype(np.float32)
                errs.add(_gemv(lib, qtype, raw, x, mask), reference.matmul(x, deq), f"K={K} N={N} mask={mask}")
        errs.check()


@pytest.mark.parametrize("qtype", (T.Q4_0, T.Q4_1, T.Q8_0), ids=lambda t: t.name)
def test_the_two_kernels_agree_and_the_mask_switches_them(lib, qtype):
    """Equal to fp32 rounding, and not bit for bit: so the switch did change the kernel (an
    ignored mask would give identical bits)."""
    K, N = 576, 960
    raw, _ = weights(qtype, N, K)
    x = np.random.default_rng(5).standard_normal((1, K)).astype(np.float32)
    wide, narrow = _gemv(lib, qtype, raw, x, 3), _gemv(lib, qtype, raw, x, 0)
    assert nmse(wide, narrow) < NMSE_KERNELS
    assert not np.array_equal(wide, narrow)


def test_the_mask_reads_back(lib):
    for m in (0, 1, 2, 3):
        assert lib.el_x86_gemv(m) == m and lib.el_x86_gemv(-1) == m


class _Lib:
    def __init__(self, built: bool = True):
        self.mask = 3 if built else -1

    def el_x86_gemv(self, set_):
        if self.mask >= 0 and set_ >= 0:
            self.mask = set_
        return self.mask


def _cpuinfo(tmp_path, vendor: str, family: int):
    f = tmp_path / "cpuinfo"
    f.write_text(f"processor\t: 0\nvendor_id\t: {vendor}\ncpu family\t: {family}\nmodel\t\t: 17\n"
                 f"flags\t\t: avx512f\n\nprocessor\t: 1\nvendor_id\t: {vendor}\ncpu family\t: {family}\n")
    return str(f)


@pytest.mark.parametrize("vendor, family, wide", [("AuthenticAMD", 25, False), ("AuthenticAMD", 26, True),
                                                  ("GenuineIntel", 6, True)])
def test_the_cpu_picks_the_kernels_and_says_why(tmp_path, monkeypatch, vendor, family, wide):
    monkeypatch.delenv("EDGELLM_X86_GEMV", raising=False)
    lib = _Lib()
    why = neon_lib.choose_x86_gemv(lib, _cpuinfo(tmp_path, vendor, family))
    assert lib.mask == (3 if wide else 0)
    if wide:
        assert why == "x86 GEMVs AVX-512 (default)"
    else:
        assert why == "x86 GEMVs AVX2 (AuthenticAMD family 19h: 512-bit operations run as two 256-bit halves)"


def test_an_unreadable_cpuinfo_keeps_the_default(tmp_path, monkeypatch):
    monkeypatch.delenv("EDGELLM_X86_GEMV", raising=False)
    lib = _Lib()
    assert neon_lib.choose_x86_gemv(lib, str(tmp_path / "missing")) == "x86 GEMVs AVX-512 (default)"
    assert lib.mask == 3
    assert neon_lib.cpu_vendor_family(str(tmp_path / "missing")) is None


def test_the_environment_overrides_the_cpu(tmp_path, monkeypatch):
    zen4 = _cpuinfo(tmp_path, "AuthenticAMD", 25)
    lib = _Lib()
    monkeypatch.setenv("EDGELLM_X86_GEMV", "avx512")
    assert neon_lib.choose_x86_gemv(lib, zen4) == "x86 GEMVs AVX-512 (EDGELLM_X86_GEMV)" and lib.mask == 3
    monkeypatch.setenv("EDGELLM_X86_GEMV", "avx2")
    assert neon_lib.choose_x86_gemv(lib, zen4) == "x86 GEMVs AVX2 (EDGELLM_X86_GEMV)" and lib.mask == 0
    monkeypatch.setenv("EDGELLM_X86_GEMV", "AVX2 ")
    with pytest.raises(neon_lib.NeonLibError, match="EDGELLM_X86_GEMV must be avx2 or avx512, got 'AVX2 '"):
        neon_lib.choose_x86_gemv(lib, zen4)


def test_a_build_without_the_choice_says_so_when_asked(tmp_path, monkeypatch):
    """The override was ignored without a word on a build without AVX-512 GEMVs, and a bad value
    went unnoticed there while it disabled the unit on an AVX-512 build."""
    lib, zen4 = _Lib(built=False), _cpuinfo(tmp_path, "AuthenticAMD", 25)
    monkeypatch.delenv("EDGELLM_X86_GEMV", raising=False)
    assert neon_lib.choose_x86_gemv(lib, zen4) == ""
    monkeypatch.setenv("EDGELLM_X86_GEMV", "avx512")
    assert neon_lib.choose_x86_gemv(lib, zen4) == "EDGELLM_X86_GEMV=avx512 ignored: this build has no AVX-512 GEMVs"
    monkeypatch.setenv("EDGELLM_X86_GEMV", "bogus")
    with pytest.raises(neon_lib.NeonLibError, match="must be avx2 or avx512, got 'bogus'"):
        neon_lib.choose_x86_gemv(lib, zen4)
    assert lib.mask == -1
