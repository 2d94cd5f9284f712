"""Cross-compile the NEON kernel library and its self-test into a bundle for a device (the same
as `edgellm build`; edgellm/toolchain.py does the work).

    python tools/cross_build.py [--target aarch64-linux-gnu|aarch64-linux-android[API]] [--cpu cortex-a78] [--out DIR]

Then copy DIR to the device and run `./selftest_dotprod selftest_cases.bin` (or selftest_base).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from edgellm import toolchain  # noqa: E402
from edgellm.cli import check_out_folder  # noqa: E402
from edgellm.errors import ConfigError  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--target", default="aarch64-linux-gnu",
                    help="aarch64-linux-gnu (default) or aarch64-linux-android[API] (API default 28)")
    ap.add_argument("--cpu", help="build the dotprod variant for this core (-mcpu), tune base for it (-mtune)")
    ap.add_argument("--out", type=Path, help="bundle folder (default ./edgellm-bundle-<target>): a new or empty "
                    "folder, or an earlier bundle, which is replaced whole; the folder it goes in must exist and be "
                    "writable (checked before compiling)")
    ap.add_argument("--variant", action="append", choices=toolchain.VARIANTS,
                    help="build only this variant (repeatable; default both)")
    a = ap.parse_args(argv)
    try:
        if a.out is not None:   # (as `edgellm build`: a missing parent is refused, not made)
            check_out_folder(a.out.expanduser().parent, "--out", a.out)
        with toolchain.stop_on_sigterm():
            toolchain.build_bundle(a.target, a.cpu, a.out, a.variant or toolchain.VARIANTS)
    except (toolchain.ToolchainError, ConfigError, OSError) as e:   # (OSError: an unwritable --out, a full disk)
        print(f"cross_build: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
