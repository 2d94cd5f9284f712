"""The real model with every op on the opencl unit (PoCL here) against llama.cpp's goldens, with
the bounds of tests/test_golden_smollm2.py: the OpenCL kernels dequantize the Q4_1 weights in the
kernel and compute in fp32, as the reference unit does, so the issue's targets (top-1 >= 98%,
mean KL <= 0.02, greedy) are checked on the F32 golden, where llama.cpp computes in fp32 too, and
the Q4_1 golden (llama.cpp with 8-bit activations and an f16 KV cache) at the measured level that
file's docstring explains."""
import json
from dataclasses import replace
from pathlib import Path

import pytest

from tests.test_golden_smollm2 import CASES, _greedy, agreement

DATA = Path(__file__).parent / "data"
GOLDEN = json.loads((DATA / "golden_smollm2.json").read_text())
pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def cl_engine(real_model_path, tmp_path_factory):
    import edgellm
    from edgellm.device.host import estimate_host_profile
    from edgellm.device.profile import Gpu
    from edgellm.device.profile_yaml import write_profile

    # this machine, with its OpenCL device described (as `edgellm profile` would write it)
    gpu = Gpu("opencl device", "opencl", 2, {"fp32": 50e9}, False, True, 20e-6, 50e-6, 8, 32)
    path = write_profile(replace(estimate_host_profile(), name="host-with-gpu", gpu=gpu),
                         tmp_path_factory.mktemp("profile") / "host-with-gpu.yaml")
    eng = edgellm.load(real_model_path, device=str(path), n_ctx=1024, units=["opencl"])
    used = {p.op: p.unit for ph in (eng.plan.prefill, eng.plan.decode) for p in ph.placements}
    assert {used[op] for op in ("qkv", "attention", "attn_out", "ffn_gate_up", "ffn_down", "lm_head")} == {"opencl"}, used
    return eng


@pytest.fixture(scope="module", params=list(CASES))
def measured(cl_engine, request):
    golden, min_top1, max_kl, min_greedy = CASES[request.param]
    return {**agreement(cl_engine, golden), "name": request.param, "golden": golden, "min_top1": min_top1,
            "max_kl": max_kl, "min_greedy": min_greedy}


def test_opencl_top1_agreement_with_llama_cpp(measured):
    print(f"\n[opencl vs {measured['name']}] top-1 agreement {measured['top1']:.4f} over {measured['n']} "
          f"positions, mean KL {measured['kl'].mean():.5f}")
    assert measured["n"] >= 200
    assert measured["top1"] >= measured["min_top1"]


def test_opencl_mean_kl(measured):
    assert measured["kl"].mean() <= measured["max_kl"]


def test_opencl_greedy_continuations(cl_engine, measured):
    g = measured["golden"]["greedy"]
    identical = sum(_greedy(cl_engine, c["prompt_ids"], len(c["ids"])) == c["ids"] for c in g)
    print(f"\n[opencl vs {measured['name']}] greedy continuations identical: {identical} of {len(g)}")
    assert identical >= measured["min_greedy"]
