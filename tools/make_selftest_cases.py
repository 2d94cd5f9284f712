"""Write the NEON self-test cases file (edgellm.selftest_cases.write_cases; format in neon/selftest.c).
For kernel work on the host:

    python tools/make_selftest_cases.py /tmp/cases.bin
    cc -O2 -std=gnu11 -pthread -DEL_VARIANT=dotprod -DEL_SIMDE_DOTPROD -DEL_SIMDE_FP16 -march=native \\
       -Ineon -I$(python -c 'import simde_py; print(simde_py.get_include())') -o /tmp/st neon/*.c -lm
    /tmp/st /tmp/cases.bin          # -k NAME runs the cases whose name contains NAME

(neon/*.c includes selftest.c: the self-test is the library plus its main.)
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from edgellm import selftest_cases  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--seed", type=int, default=20240531)
    a = ap.parse_args()
    n = selftest_cases.write_cases(a.out, a.seed)
    print(f"{a.out}: {n} cases")


if __name__ == "__main__":
    main()
