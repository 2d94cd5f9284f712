"""Faults of the opencl unit, each injected for real: no platform, a kernel that fails to build, a
numeric self-check that fails, a driver crash while probing. In every case the unit is
unavailable with its reason, `edgellm plan` and the log show that reason, and generation completes
on the CPU with exactly the tokens a CPU-only engine produces."""
from __future__ import annotations

import logging
import re
from dataclasses import replace

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from typer.testing import CliRunner

import edgellm
from edgellm.backends import opencl, opencl_runtime
from edgellm.cli import app
from edgellm.device.host import estimate_host_profile
from edgellm.device.profile import Gpu
from edgellm.device.profile_yaml import write_profile
from tests.synthetic import write_tiny_model


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A fresh EDGELLM_HOME whose host profile lists an OpenCL GPU (as `edgellm profile` writes
    one on a machine that has it), and a fresh probe."""
    monkeypatch.setenv("EDGELLM_HOME", str(tmp_path / "home"))
    gpu = Gpu("test gpu", "opencl", 2, {"fp32": 50e9}, False, True, 20e-6, 50e-6, 8, 32)
    write_profile(replace(estimate_host_profile(), name="host", gpu=gpu),
                  tmp_path / "home" / "profiles" / "host.yaml")
    opencl.reset()
    yield tmp_path
    opencl.reset()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    tm = write_tiny_model(tmp_path_factory.mktemp("m") / "tiny.gguf", tensor_type=QT.Q8_0, n_layers=2, seed=3)
    ref = edgellm.load(tm.path, n_ctx=128, units=["reference"])
    return tm.path, ref.generate("hello", max_tokens=6, temperature=0)


def _break_build(kernels):
    p = kernels / "elementwise.cl"
    p.write_text(p.read_text() + "\n__kernel void el_broken(__global float *y) { y[0] = not_declared_here; }\n")


def _break_numerics(kernels):
    # a kernel that builds and runs but computes the wrong thing: rmsnorm's output scaled by 2
    p = kernels / "elementwise.cl"
    src = p.read_text()
    m = re.search(r"__kernel void (el_)?rmsnorm\w*\s*\(", src)
    assert m, "elementwise.cl has no rmsnorm kernel to break"
    p.write_text("#define EL_FAULT_SCALE 2.0f\n" + src.replace("rsqrt(", "EL_FAULT_SCALE * rsqrt("))
    assert "EL_FAULT_SCALE * rsqrt(" in p.read_text(), "rmsnorm no longer uses rsqrt: update this fault"


def _crash_driver(kernels):
    # the probe's first kernel writes far outside any buffer: the process running it dies (SIGSEGV)
    p = kernels / "probe_kernels.cl"
    p.write_text(p.read_text().replace("if (i < n) out[i] = value;",
                                       "if (i < n) out[i] = value; ((__global float *)0x10)[i * 4096] = value;"))


FAULTS = {
    "no platform": (lambda k, mp: mp.setenv("EDGELLM_OPENCL_PLATFORM", "no-such-platform"),
                    "no OpenCL device with platform matching 'no-such-platform'"),
    "build failure": (lambda k, mp: _break_build(k), "failed to build"),
    "self-check": (lambda k, mp: _break_numerics(k), "numeric self-check failed"),
    # PoCL dies of the stray write; a GPU driver (NVIDIA's, seen on an H200) reports it as an
    # error of the next call instead: both must turn the unit off with the reason
    "probe crash": (lambda k, mp: _crash_driver(k), r"crashed|read-back of \d+ bytes failed"),
}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_fault_falls_back_to_the_cpu_with_the_reason_shown(fault, home, kernels, tiny, monkeypatch, caplog):
    inject, expect = FAULTS[fault]
    inject(kernels, monkeypatch)
    path, cpu_text = tiny

    ok, why = opencl.available()
    assert not ok and re.search(expect, why), why

    # the plan shows the unit unavailable with the reason
    res = CliRunner().invoke(app, ["plan", "--model", path, "--prompt-tokens", "32", "--ctx", "128"])
    assert res.exit_code == 0, res.output
    assert re.search(expect, " ".join(res.output.split())), res.output

    # the log says so, and generation completes on the CPU with the CPU's tokens
    with caplog.at_level(logging.WARNING, logger="edgellm"):
        eng = edgellm.load(path, n_ctx=128, units=["opencl", "reference"])
    assert "opencl" not in eng.plan.units_used()
    assert "unit opencl unavailable" in caplog.text and re.search(expect, caplog.text)
    assert eng.generate("hello", max_tokens=6, temperature=0) == cpu_text


def test_healthy_unit_runs_the_model_like_the_cpu(home, tiny):
    path, _ = tiny
    ok, why = opencl.available()
    assert ok, why
    eng = edgellm.load(path, n_ctx=128, units=["opencl"])
    used = {p.op: p.unit for p in eng.plan.prefill.placements}
    assert {used[op] for op in ("attn_norm", "qkv", "rope", "attention", "swiglu", "ffn_down", "lm_head")} \
        == {"opencl"}, used
    ref = edgellm.load(path, n_ctx=128, units=["reference"])
    ids = ref.tokenize("hello there, a test")
    got, want = eng.logits(ids), ref.logits(ids)
    nmse = float(((got - want) ** 2).mean() / (want ** 2).mean())
    assert nmse < 1e-6, nmse    # fp32 throughout; only summation order differs


def test_a_model_specific_kernel_failure_at_load_replans_without_the_unit(home, tiny, monkeypatch, caplog):
    """The probe passed, then the model's own kernel variant fails while preparing: the engine
    re-plans without the unit and still generates."""
    from edgellm.backends import opencl_elementwise

    path, cpu_text = tiny
    assert opencl.available()[0]

    def broken(*a, **k):
        raise opencl_runtime.KernelBuildError("elementwise", "-DHEAD_DIM=16", "error: injected", None)
    monkeypatch.setattr(opencl_elementwise, "rope", broken)
    with caplog.at_level(logging.WARNING, logger="edgellm"):
        eng = edgellm.load(path, n_ctx=128, units=["opencl", "reference"])
    assert "opencl" not in eng.plan.units_used()
    assert any("failed at load" in w for w in eng.plan.warnings)
    assert "injected" in caplog.text
    assert eng.generate("hello", max_tokens=6, temperature=0) == cpu_text


def test_norms_and_qkv_bias_are_resident_and_correct(home):
    """The norm gains and the QKV bias are device buffers made once at prepare() (not uploaded per
    call), and a qwen2-style model (QKV bias) gives the reference's logits with every op on OpenCL."""
    tm = write_tiny_model(home / "q.gguf", arch="qwen2", tensor_type=QT.Q8_0, n_layers=2, seed=7)
    ids = list(range(3, 30))
    ref = edgellm.load(tm.path, n_ctx=128, units=["reference"]).logits(ids)
    eng = edgellm.load(tm.path, n_ctx=128, units=["opencl"])
    mod, w = eng.runner._ops["prefill"]["qkv"]
    assert mod is opencl
    lw = w.layers[0]
    assert isinstance(lw.attn_norm, opencl.ResidentVector) and isinstance(lw.bqkv, opencl.ResidentVector)
    got = eng.logits(ids)
    assert float(np.abs(got - ref).max()) < 1e-3 * float(np.abs(ref).max())


def test_a_head_dim_above_the_attention_kernels_bound_moves_attention_alone(home):
    """head_dim 512 (the kernel takes 256): load raised a ValueError from the warm-up; now the
    attention moves, said so, and the text is the CPU's."""
    tm = write_tiny_model(home / "hd.gguf", d_model=64, n_heads=2, n_kv_heads=1, head_dim=512, n_layers=1, seed=5)
    eng = edgellm.load(tm.path, n_ctx=64, units=["opencl", "reference"])
    assert any("head_dim 512 is above its attention kernel's 256" in w for w in eng.plan.warnings), eng.plan.warnings
    assert {ph["attention"] for ph in eng.runner.placement.values()} == {"reference"}
    ref = edgellm.load(tm.path, n_ctx=64, units=["reference"])
    assert eng.generate("hello", max_tokens=6, temperature=0) == ref.generate("hello", max_tokens=6, temperature=0)


def test_profile_notes_say_why_the_opencl_unit_was_skipped(home, monkeypatch):
    """`edgellm profile` said "its probe found no such unit on this machine" whatever the cause;
    its note now carries the unit's reason."""
    from edgellm.device.probes import _unavailable_reason

    monkeypatch.setenv("EDGELLM_OPENCL_PLATFORM", "zzz")
    opencl.reset()
    why = _unavailable_reason("opencl")
    assert why is not None and "platform matching 'zzz'" in why
    monkeypatch.delenv("EDGELLM_OPENCL_PLATFORM")
    opencl.reset()
    assert _unavailable_reason("opencl") is None


def test_a_profile_gpu_reached_only_as_a_cpu_device_is_said_once(home, tiny, caplog):
    """A profile that describes a GPU (tensor-g1's Mali, or this home's 'test gpu') on a machine
    whose only OpenCL device is a CPU (PoCL): the unit works, but the plan costs its ops at the
    GPU's figures. The NPU says the same of CPU kernels; the opencl unit said nothing, and on
    this host `bench --device tensor-g1` placed the whole prefill layer there: TTFT 15 s for 512
    tokens against a predicted 137 ms (0.66 s with --units neon), without a word (a probe)."""
    path, _ = tiny
    ok, why = opencl.available()
    assert ok, why
    import pyopencl as cl

    if opencl_runtime.select_device(None, None)[1].type & cl.device_type.GPU:
        pytest.skip("an OpenCL GPU is here: nothing to say")
    with caplog.at_level(logging.WARNING, logger="edgellm"):
        eng = edgellm.load(path, n_ctx=128, units=["opencl"])
    assert "opencl" in eng.plan.units_used()
    lines = [r.getMessage() for r in caplog.records if "no OpenCL GPU here" in r.getMessage()]
    assert len(lines) == 1, caplog.text
    assert "test gpu" in lines[0] and "50 GFLOPS" in lines[0] and "--units" in lines[0], lines[0]
    assert any("no OpenCL GPU here" in w for w in eng.plan.warnings), eng.plan.warnings


def test_a_cpu_opencl_device_the_profile_measured_is_not_warned_about(home, tiny, caplog):
    """`edgellm profile` on a machine with PoCL measures that device into the host profile: the
    plan then costs it at its own figures, and there is nothing to warn about."""
    from edgellm.device.profile import GemmFigure, Measured, UnitMeasurement
    from edgellm.device.profile_yaml import load_profile

    path, _ = tiny
    prof_path = home / "home" / "profiles" / "host.yaml"
    prof = load_profile(prof_path)
    um = UnitMeasurement({"fp32": 50e9}, (GemmFigure(64, 64, 64, 50e9),), 20e-6, 2)
    write_profile(replace(prof, measured=Measured("2026-11-28", "test", 10e9, {}, {"opencl": um})), prof_path)
    assert opencl.available()[0]
    with caplog.at_level(logging.WARNING, logger="edgellm"):
        eng = edgellm.load(path, n_ctx=128, units=["opencl"])
    assert "opencl" in eng.plan.units_used()
    assert "no OpenCL GPU here" not in caplog.text
