"""The real model with its projections (QKV, attention output, FFN gate/up and down, head) on the
npu unit with int8 weights, through both runtimes (ONNX Runtime's CPU provider and LiteRT here),
against llama.cpp's goldens. Issue 7 asks top-1 >= 95% and mean KL <= 0.05 against llama.cpp;
both goldens are reported and checked. The int8 form is each runtime's default
(npu.weight_format): ONNX Runtime int8 weight blocks of 32 with float activations (int8b);
LiteRT int8s, one int8 FULLY_CONNECTED per 64-column slice of K, each with its own per-output-
channel scales and its own int8 rounding of the input rows by the kernel, the slices summed.

The FFN runs as one subgraph (gate/up, swiglu, down) per bucket. Measured (2026-11-21), top-1 /
mean KL against the F32 and Q4_1 goldens:
  onnx   int8b: int8 blocks, float activations       98.55% / 0.0011    96.36% / 0.0036
  tflite int8:  per channel, int8 rows (before)      93.09% / 0.0213    93.82% / 0.0231
  tflite int8s: per channel per 64-column slice      98.55% / 0.0038    96.36% / 0.0060
LiteRT's unsliced int8 missed the issue's 95%: one scale per output row over the whole of K, and
one int8 step per input row, cost it 2.5-5.5 points; per 64-column slice both are set by 64 values
(see npu_graphs.INT8S_SLICE). Its bound below is the measured level less one position of the 275
(top-1) and under 2x the measured KL, so a regression fails."""
from dataclasses import replace
from pathlib import Path

import pytest

from tests.test_golden_smollm2 import CASES, agreement

pytestmark = pytest.mark.model
RUNTIMES = ("onnx", "tflite")
# runtime -> (min top-1, max mean KL) on either golden
BOUNDS = {"onnx": (0.95, 0.05), "tflite": (0.96, 0.01)}


def npu_profile(path: Path, buckets=(32, 128)) -> Path:
    """This machine's CPU figures plus an NPU section whose providers exist here (the CPU EP)."""
    from edgellm.device.host import estimate_host_profile
    from edgellm.device.profile import Npu
    from edgellm.device.profile_yaml import write_profile

    npu = Npu("test npu", {"int8": 4e12}, ("CPUExecutionProvider",), None, True, tuple(buckets),
              frozenset({"matmul"}), 300e-6, 100e-6)
    return write_profile(replace(estimate_host_profile(), name="host-with-npu", npu=npu), path)


@pytest.fixture(scope="module", params=RUNTIMES)
def npu_engine(request, real_model_path, tmp_path_factory):
    import edgellm
    from edgellm.backends import npu

    mp = pytest.MonkeyPatch()
    mp.setenv("EDGELLM_NPU_RUNTIME", request.param)
    mp.setenv("EDGELLM_HOME", str(tmp_path_factory.mktemp("npu_home")))
    npu.reset()
    prof = npu_profile(tmp_path_factory.mktemp("profile") / "host-with-npu.yaml")
    eng = edgellm.load(real_model_path, device=str(prof), n_ctx=1024, units=["npu", "reference"])
    used = {p.op: p.unit for p in eng.plan.prefill.placements}
    assert {used[op] for op in ("qkv", "attn_out", "ffn_gate_up", "swiglu", "ffn_down")} == {"npu"}, used
    yield request.param, eng
    mp.undo()
    npu.reset()


@pytest.mark.parametrize("golden", list(CASES))
def test_npu_int8_agreement_with_llama_cpp(npu_engine, golden):
    from edgellm.backends import npu

    runtime, eng = npu_engine
    m = agreement(eng, CASES[golden][0])
    print(f"\n[npu {runtime} {npu.weight_format()} vs {golden}] top-1 {m['top1']:.4f} over {m['n']} positions, "
          f"mean KL {m['kl'].mean():.5f}")
    assert m["n"] >= 200
    assert m["top1"] >= BOUNDS[runtime][0]
    assert m["kl"].mean() <= BOUNDS[runtime][1]
