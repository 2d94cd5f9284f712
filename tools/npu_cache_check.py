"""Measure what the npu unit's graph cache saves: two fresh processes one after the other on an
empty EDGELLM_HOME; each loads the model with its projections on the npu unit (buckets 32, 64,
128, 256) and reports its load time and how many subgraphs it built vs loaded from the cache.

    python tools/npu_cache_check.py [--model PATH] [--runtime onnx|tflite] [--starts 2]
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
from edgellm.backends import npu
from edgellm.device.host import estimate_host_profile
from edgellm.device.profile import Npu
from edgellm.device.profile_yaml import write_profile
n = Npu("npu", {"int8": 4e12}, ("CPUExecutionProvider",), None, True, (32, 64, 128, 256), frozenset({"matmul"}),
        300e-6, 100e-6)
prof = write_profile(replace(estimate_host_profile(), name="npu-cache-check", npu=n), sys.argv[2])
eng = edgellm.load(sys.argv[1], device=str(prof), n_ctx=512, units=["npu", "reference"])
t_load = time.perf_counter() - t0
mod = npu._state["runtime"]
st = mod.stats
print(json.dumps({"runtime": mod.__name__.rsplit(".", 1)[1], "format": npu.weight_format(),
                  "load_s": round(t_load, 2), "stats": {k: v for k, v in vars(st).items()}}))
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--runtime", choices=("onnx", "tflite"), default="onnx")
    ap.add_argument("--starts", type=int, default=2)
    args = ap.parse_args()
    from edgellm.model.registry import resolve_model

    model = str(args.model or resolve_model(None, pull_if_missing=True))
    with tempfile.TemporaryDirectory() as home:
        env = {**os.environ, "EDGELLM_HOME": home, "EDGELLM_NPU_RUNTIME": args.runtime}
        rows = []
        for i in range(args.starts):
            r = subprocess.run([sys.executable, "-c", CHILD, model, str(Path(home) / "p.yaml")], env=env,
                               capture_output=True, text=True)
            if r.returncode:
                print(r.stderr[-2000:], file=sys.stderr)
                return 1
            rows.append(json.loads(r.stdout.strip().splitlines()[-1]))
            print(f"start {i + 1}: {json.dumps(rows[-1])}")
    print(f"load: first start {rows[0]['load_s']:.2f} s, second start {rows[1]['load_s']:.2f} s "
          f"({rows[0]['load_s'] / rows[1]['load_s']:.1f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
