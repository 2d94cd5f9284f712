"""The npu unit reads the precision plan: a projection the plan keeps in a float format runs as
an fp16-weights subgraph (through the engine, both runtimes), every other one in the runtime's
int8 form, and the logits show the difference."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

import edgellm
from edgellm.backends import npu
from edgellm.device.host import estimate_host_profile
from edgellm.device.profile import Npu
from edgellm.device.profile_yaml import write_profile
from edgellm.precision import parse_plan
from tests.synthetic import write_tiny_model

PLAN = """
schema: 1
kv_cache: f16
defaults:           # the NPU computes in int8: a plan that asks fp32 keeps it out (test_precision_runtime)
  qkv: {compute: int8}
  attn_out: {compute: int8}
  ffn_gate_up: {compute: int8}
  ffn_down: {compute: int8}
layers:
  1: {ffn_down: {weights: f16}, qkv: {weights: f16}}
"""


@pytest.fixture(params=("onnx", "tflite"))
def setup(request, tmp_path, monkeypatch):
    monkeypatch.setenv("EDGELLM_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("EDGELLM_NPU_RUNTIME", request.param)
    n = Npu("test npu", {"int8": 4e12}, ("CPUExecutionProvider",), None, True, (32,), frozenset({"matmul"}),
            300e-6, 100e-6)
    prof = write_profile(replace(estimate_host_profile(), name="host-npu", npu=n), tmp_path / "host-npu.yaml")
    npu.reset()
    tm = write_tiny_model(tmp_path / "m.gguf", tensor_type=QT.Q8_0, n_layers=3, seed=5)
    yield tm.path, str(prof)
    npu.reset()


def _formats(eng, layer):
    for ph in eng.runner._ops.values():
        mod, w = ph["ffn_down"]
        if mod is npu:
            lw = w.layers[layer]
            ffn = lw.ffn.make(32) if lw.ffn is not None else None
            down = ffn.down if ffn is not None else lw.w_down.make(32).w
            return lw.wqkv.make(32).w.fmt, down.fmt
    raise AssertionError("ffn_down is not on the npu")


def test_npu_takes_the_plans_float_layers(setup):
    path, prof = setup
    plan = parse_plan(PLAN, name="f16-layer1")
    eng = edgellm.load(path, device=prof, n_ctx=128, units=["npu", "reference"], precision=plan)
    base = edgellm.load(path, device=prof, n_ctx=128, units=["npu", "reference"])
    int8 = npu.weight_format()
    assert _formats(eng, 1) == ("fp16", "fp16")
    assert _formats(eng, 0) == (int8, int8) == _formats(base, 1)
    # fp16 weights are closer to the fp32 reference than int8 ones: the plan made a difference.
    # RMS over all logits: on LiteRT the int8 input rounding of the other layers dominates both
    # engines' error, and its largest logit error is noise (int8s: max 0.0077 with the plan vs
    # 0.0073 without, RMS 0.00145 vs 0.00179).
    ref = edgellm.load(path, n_ctx=128, units=["reference"], precision=plan).logits(list(range(3, 40)))
    ids = list(range(3, 40))

    def rms(e):
        return float(np.sqrt(np.mean((e.logits(ids) - ref).astype(np.float64) ** 2)))

    assert rms(eng) < rms(base)


def test_int8s_falls_back_to_int8_where_the_slices_do_not_divide_k(tmp_path, monkeypatch):
    """d = 96: LiteRT's 64-column slices do not divide K, so those projections load as int8 per
    channel (logged) instead of failing the unit."""
    monkeypatch.setenv("EDGELLM_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("EDGELLM_NPU_RUNTIME", "tflite")
    n = Npu("test npu", {"int8": 4e12}, ("CPUExecutionProvider",), None, True, (32,), frozenset({"matmul"}),
            300e-6, 100e-6)
    prof = write_profile(replace(estimate_host_profile(), name="host-npu", npu=n), tmp_path / "host-npu.yaml")
    npu.reset()
    try:
        tm = write_tiny_model(tmp_path / "m.gguf", tensor_type=QT.Q8_0, n_layers=2, d_model=96, d_ff=128,
                              n_heads=4, n_kv_heads=2, seed=5)
        eng = edgellm.load(tm.path, device=str(prof), n_ctx=128, units=["npu", "reference"])
        assert "npu" in eng.plan.units_used()
        fmts = _formats(eng, 0)
        assert fmts == ("int8", "int8s")          # qkv: K = 96 -> int8; ffn_down: K = 128 -> int8s
    finally:
        npu.reset()
