"""Measure what the OpenCL program-binary cache saves: start two fresh processes one after the
other on an empty cache; each loads the model with every op on the opencl unit and reports its
kernel build time (the guarded probe's builds plus the model's own kernel variants) and its load
time. PoCL's own kernel cache is switched off (POCL_KERNEL_CACHE=0) so that only edgellm's cache
is measured.

    python tools/opencl_cache_check.py [--model PATH] [--starts 2]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = r"""
import json, sys, time
from dataclasses import replace
t0 = time.perf_counter()
import edgellm
from edgellm.backends import opencl
from edgellm.device.host import estimate_host_profile
from edgellm.device.profile import Gpu
from edgellm.device.profile_yaml import write_profile
gpu = Gpu("opencl device", "opencl", 2, {"fp32": 50e9}, False, True, 20e-6, 50e-6, 8, 32)
prof = write_profile(replace(estimate_host_profile(), name="cache-check", gpu=gpu), sys.argv[2])
eng = edgellm.load(sys.argv[1], device=str(prof), n_ctx=256, units=["opencl"])
t_load = time.perf_counter() - t0
t1 = time.perf_counter()
eng.generate("Hello", max_tokens=2, temperature=0)
t_first = time.perf_counter() - t1
st = opencl.runtime().stats
rep = opencl.probe_report()
print(json.dumps({"probe_build_s": rep.get("build_s"), "probe_s": rep.get("seconds"),
                  "engine_build_s": round(st.seconds, 3), "from_source": st.from_source,
                  "from_cache": st.from_cache, "load_s": round(t_load, 3),
                  "first_generate_s": round(t_first, 3)}))
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="GGUF path (default: the default model, pulled if missing)")
    ap.add_argument("--starts", type=int, default=2)
    args = ap.parse_args()
    from edgellm.model.registry import resolve_model

    model = str(args.model or resolve_model(None, pull_if_missing=True))
    with tempfile.TemporaryDirectory() as home:
        env = {**os.environ, "EDGELLM_HOME": home, "POCL_KERNEL_CACHE": "0"}
        rows = []
        for i in range(args.starts):
            r = subprocess.run([sys.executable, "-c", CHILD, model, str(Path(home) / "p.yaml")], env=env,
                               capture_output=True, text=True, check=True)
            row = json.loads(r.stdout.strip().splitlines()[-1])
            row["compile_s"] = round((row["probe_build_s"] or 0) + row["engine_build_s"], 3)
            rows.append(row)
            print(f"start {i + 1}: {json.dumps(row)}")
    first, second = rows[0]["compile_s"], rows[1]["compile_s"]
    print(f"kernel build time: first start {first:.3f} s, second start {second:.3f} s: "
          f"{first / max(second, 1e-9):.1f}x faster with the binary cache")
    return 0


if __name__ == "__main__":
    sys.exit(main())
