"""Compile the NEON kernel library by hand: for kernel development (a few sources into a
scratch .so) and as the compile step the cross-compile tool builds on. The installed library
is built by setup.py with the same flags.

    python tools/build_neon.py --variant dotprod --out /tmp/el.so [neon/quant_matmul.c ...]
"""
from __future__ import annotations

import argparse
import glob
import platform
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ARM_FLAGS = {"base": ["-march=armv8-a"], "dotprod": ["-march=armv8.2-a+dotprod+fp16"]}
SIMDE_DEFS = {"base": [], "dotprod": ["-DEL_SIMDE_DOTPROD", "-DEL_SIMDE_FP16"]}


def library_sources() -> list[str]:
    return sorted(s for s in glob.glob(str(ROOT / "neon" / "*.c")) if not s.endswith("selftest.c"))


def compile_flags(variant: str, arm: bool, tune: list[str] | None = None) -> list[str]:
    flags = ["-O3", "-std=gnu11", "-fvisibility=hidden", "-pthread", f"-DEL_VARIANT={variant}", f"-I{ROOT / 'neon'}"]
    if arm:
        return flags + (tune if tune is not None else ARM_FLAGS[variant])
    import simde_py

    return flags + (tune if tune is not None else ["-march=native"]) + SIMDE_DEFS[variant] + [f"-I{simde_py.get_include()}"]


def build(out: str | Path, variant: str = "dotprod", sources: list[str] | None = None, cc: str = "cc",
          arm: bool | None = None, extra: list[str] = (), shared: bool = True) -> Path:
    """Compile `sources` (default: the whole library) into `out`; raises CalledProcessError with
    the compiler's output on failure."""
    arm = platform.machine().lower() in ("aarch64", "arm64") if arm is None else arm
    srcs = [str(s) for s in (sources or library_sources())]
    cmd = [cc, *compile_flags(variant, arm), *extra, *(["-shared", "-fPIC"] if shared else []),
           "-o", str(out), *srcs, "-lm"]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return Path(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variant", choices=["base", "dotprod"], default="dotprod")
    ap.add_argument("--out", required=True)
    ap.add_argument("--cc", default="cc")
    ap.add_argument("sources", nargs="*")
    a = ap.parse_args()
    try:
        print(build(a.out, a.variant, a.sources or None, a.cc))
    except subprocess.CalledProcessError as e:
        sys.exit(f"compile failed:\n{e.stderr}")


if __name__ == "__main__":
    main()
