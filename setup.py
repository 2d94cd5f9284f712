"""Builds the NEON kernel library (neon/*.c) for the host, in two variants: `base` (Armv8.0
NEON) and `dotprod` (int8 dot products + fp16 arithmetic). On aarch64 the intrinsics are real;
elsewhere SIMDe (the `simde-py` build requirement) implements them, so x86 development machines
run the same code. The libraries are plain shared objects that edgellm/backends/neon_lib.py loads
with ctypes; a failed build leaves the neon unit unavailable with its reason, never a failed
install. Everything else is configured in pyproject.toml."""
import glob
import os
import platform

from setuptools import Extension, setup

ARM = platform.machine().lower() in ("aarch64", "arm64")
VARIANTS = {
    # name: (compile flags on aarch64, extra defines on other hosts)
    "base": (["-march=armv8-a"], []),
    "dotprod": (["-march=armv8.2-a+dotprod+fp16"], ["-DEL_SIMDE_DOTPROD", "-DEL_SIMDE_FP16"]),
}


def _simde_include():
    try:
        import simde_py
    except ImportError:
        return []
    return [simde_py.get_include()]


def neon_extensions():
    sources = sorted(s for s in glob.glob("neon/*.c") if not s.endswith("selftest.c"))
    # EDGELLM_NEON_CFLAGS replaces the host tuning flag (-march=native off ARM): set it to build
    # a library for a machine other than this one
    tune = os.environ.get("EDGELLM_NEON_CFLAGS", "" if ARM else "-march=native").split()
    exts = []
    for name, (arm_flags, simde_defs) in VARIANTS.items():
        # -fno-wrapv undoes the -fwrapv of Python's own CFLAGS, which setuptools puts first: with
        # wrapping signed arithmetic the kernels' loops lose optimizations (prefill 5-10% slower
        # than the same sources built by tools/build_neon.py, Zen 5)
        flags = ["-O3", "-fno-wrapv", "-std=gnu11", "-fvisibility=hidden", "-pthread", f"-DEL_VARIANT={name}"]
        flags += arm_flags if ARM else tune + simde_defs
        exts.append(Extension(f"edgellm._neon_{name}", sources=sources, include_dirs=["neon", *_simde_include()],
                              extra_compile_args=flags, extra_link_args=["-pthread", "-lm"], optional=True))
    return exts


setup(ext_modules=neon_extensions())
