"""Faults of the opencl unit a bug probe found past the probe: driver errors at run time and at
load, a device that fails to open after the probe passed, the f16-KV attention program built only
mid-request, self-check gaps, a probe child left running, a binary cache file of another program,
bad tuning-cache keys and a bad probe timeout. Each is injected for real on this machine's device
(PoCL in CI)."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pyopencl as cl
import pytest

import edgellm
from edgellm.backends import opencl, opencl_child, opencl_probe, opencl_tune
from edgellm.backends.opencl_matmul import TileConfig, default_config
from edgellm.backends.opencl_runtime import ClRuntime
# the fixtures of the fault tests: an EDGELLM_HOME whose profile lists a GPU, and a tiny model
from tests.test_opencl_faults import home, tiny  # noqa: F401


def _failing(exc):
    def call(*a, **k):
        raise exc
    return call


def _failing_buffer():
    real = cl.Buffer

    class Refused(real):
        def __init__(self, *a, **k):
            raise cl.MemoryError("clCreateBuffer failed: MEM_OBJECT_ALLOCATION_FAILURE (test)")
    return Refused


# ---- driver errors are typed ---------------------------------------------------------------------

def test_driver_errors_after_setup_are_typed(cl_runtime, monkeypatch):
    """A launch, a read-back or a buffer the driver refused escaped as pyopencl's own exceptions
    (cl.RuntimeError, cl.MemoryError: neither an EdgeLLMError nor Python's MemoryError); each is now
    a ClDeviceError naming the call."""
    from edgellm.backends.opencl_runtime import ClDeviceError

    rt = cl_runtime
    k = rt.kernel("probe_kernels", "el_fill")
    buf = rt.empty(4 * 16)
    with monkeypatch.context() as m:
        m.setattr(cl, "enqueue_nd_range_kernel", _failing(cl.RuntimeError("OUT_OF_RESOURCES (test)")))
        with pytest.raises(ClDeviceError, match="launch of el_fill failed: RuntimeError: OUT_OF_RESOURCES"):
            rt.launch(k, (16,), None, buf, np.float32(1.0), np.int32(16))
    with monkeypatch.context() as m:
        m.setattr(cl, "enqueue_copy", _failing(cl.RuntimeError("DEVICE_NOT_AVAILABLE (test)")))
        with pytest.raises(ClDeviceError, match="read-back of 64 bytes failed"):
            rt.read(buf, (16,))
    with monkeypatch.context() as m:
        m.setattr(cl, "Buffer", _failing_buffer())
        for make in (lambda: rt.empty(64), lambda: rt.upload(np.ones(4, np.float32)),
                     lambda: rt.resident(np.ones(4, np.float32))):
            with pytest.raises(ClDeviceError, match="MEM_OBJECT_ALLOCATION_FAILURE"):
                make()
    assert issubclass(ClDeviceError, edgellm.EdgeLLMError)


def test_a_launch_failure_mid_request_is_typed_and_the_engine_stays_usable(home, tiny, monkeypatch):
    """A kernel launch the driver refused mid-generation raised pyopencl._cl.RuntimeError (a full
    traceback in the CLI); it is now an EdgeLLMError, and the next request runs normally."""
    path, _ = tiny
    eng = edgellm.load(path, n_ctx=128, units=["opencl"])
    want = eng.generate("hello", max_tokens=6, temperature=0)
    with monkeypatch.context() as m:
        m.setattr(cl, "enqueue_nd_range_kernel", _failing(cl.RuntimeError("OUT_OF_RESOURCES (test)")))
        with pytest.raises(edgellm.EdgeLLMError, match="OUT_OF_RESOURCES"):
            eng.generate("hello", max_tokens=6, temperature=0)
    assert eng.generate("hello", max_tokens=6, temperature=0) == want


def test_out_of_device_memory_while_loading_drops_the_unit(home, tiny, monkeypatch):
    """cl.MemoryError while uploading the weights aborted the load (prepare only caught
    KernelBuildError and OpenCLUnavailable); now the unit is out with that reason and the CPU
    runs the model."""
    path, cpu_text = tiny
    assert opencl.available()[0]
    monkeypatch.setattr(cl, "Buffer", _failing_buffer())
    eng = edgellm.load(path, n_ctx=128, units=["opencl", "reference"])
    assert "opencl" not in eng.plan.units_used()
    assert any("failed at load" in w and "MEM_OBJECT_ALLOCATION_FAILURE" in w for w in eng.plan.warnings), \
        eng.plan.warnings
    assert eng.generate("hello", max_tokens=6, temperature=0) == cpu_text


def test_a_device_that_fails_to_open_after_the_probe_falls_back(home, tiny, monkeypatch):
    """The probe passed in its child, then creating the context in this process failed: the load
    aborted with OpenCLUnavailable. Now the unit is unavailable with that reason."""
    path, cpu_text = tiny
    assert opencl.available()[0]
    monkeypatch.setattr(cl, "Context", _failing(cl.RuntimeError("clCreateContext failed: DEVICE_NOT_AVAILABLE")))
    eng = edgellm.load(path, n_ctx=128, units=["opencl", "reference"])
    assert "opencl" not in eng.plan.units_used()
    assert any("context or queue creation failed" in w for w in eng.plan.warnings), eng.plan.warnings
    assert eng.generate("hello", max_tokens=6, temperature=0) == cpu_text


# ---- the f16-KV attention program is built at load -----------------------------------------------

def test_an_f16_kv_attention_build_failure_moves_attention_at_load(home, tiny, kernels, monkeypatch):
    """The warm-up built attention with float32 K/V only; the default f16 KV pool's program
    (KV_F16=1) was first built mid-request, and its build failure killed that request. Now it fails
    at load and attention alone moves (the probe is taken as passed, as a cached answer would be)."""
    path, cpu_text = tiny
    src = kernels / "attention.cl"
    src.write_text("#if KV_F16\n#error injected failure for f16 KV\n#endif\n" + src.read_text())
    monkeypatch.setitem(opencl._state, "probe", (True, "taken as passed by the test"))
    eng = edgellm.load(path, n_ctx=128, units=["opencl", "reference"])
    assert {ph["attention"] for ph in eng.runner.placement.values()} == {"reference"}
    assert {ph["qkv"] for ph in eng.runner.placement.values()} == {"opencl"}
    assert any("injected failure for f16 KV" in w for w in eng.plan.warnings), eng.plan.warnings
    assert eng.generate("hello", max_tokens=6, temperature=0) == cpu_text


# ---- the probe's self-check covers what the engine runs ------------------------------------------

_F16_FAULTS = {
    # vload_half read as half its value: a driver miscompiling f16 loads
    "f16 K/V attention": ("attention.cl", "#define LOAD4(p) vload_half4(0, (p))",
                          "#define LOAD4(p) (vload_half4(0, (p)) * 0.5f)", "attention (float16 K/V)"),
    "F16 weights": ("matmul_float.cl", "#define LOAD_W(i) vload_half8((i), w)",
                    "#define LOAD_W(i) (vload_half8((i), w) * 0.5f)", "F16 GEMM"),
}


@pytest.mark.parametrize("fault", list(_F16_FAULTS))
def test_the_self_check_catches_wrong_f16_paths(fault, kernels, tmp_path):
    """The self-check ran f32 dense attention and Q4/Q8 matmuls only: f16 K/V (the default pool)
    and F16/F32 weights could compute garbage with the probe passing."""
    name, old, new, expect = _F16_FAULTS[fault]
    p = kernels / name
    assert old in p.read_text(), f"{name} no longer has {old!r}: update this fault"
    p.write_text(p.read_text().replace(old, new))
    err = opencl_probe.self_check(ClRuntime.create(cache_dir=tmp_path))
    assert expect in err, err


def test_the_self_check_passes_on_healthy_kernels(cl_runtime):
    assert opencl_probe.self_check(cl_runtime) == ""


# ---- the probe child does not outlive a failed load ----------------------------------------------

def test_a_failed_load_stops_the_probe_child(tmp_path, monkeypatch):
    """edgellm.load started the probe child, then api.load raised (a model that does not exist):
    the child was left running after the caller's process exited."""
    monkeypatch.setenv("EDGELLM_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("EDGELLM_OPENCL_PROBE_CACHE", "0")
    opencl.reset()
    children = []
    real_spawn = opencl_child.spawn
    monkeypatch.setattr(opencl_child, "spawn", lambda: real_spawn() or children.extend(opencl_child._child))
    try:
        with pytest.raises(edgellm.ModelNotFoundError):
            # a profile that lists a GPU: load() keeps the child for it
            edgellm.load(str(tmp_path / "missing.gguf"), device="rk3588", units=["opencl"])
        procs = {id(proc): proc for proc, _ in children}     # spawn() runs again in api.load: one child
        assert len(procs) == 1
        assert opencl_child._child == [] and all(proc.returncode is not None for proc in procs.values())
    finally:
        opencl.reset()


# ---- caches and settings -------------------------------------------------------------------------

def test_a_cache_file_holding_another_programs_binary_is_rebuilt(tmp_path, caplog):
    """A well-formed cache file around the wrong program passed the checksum; the driver loaded it
    and creating a kernel failed with LogicError INVALID_KERNEL_NAME, with no rebuild."""
    from edgellm.backends import opencl_elementwise

    rt = ClRuntime.create(cache_dir=tmp_path)
    rt.kernel("probe_kernels", "el_fill")
    x = np.random.default_rng(0).standard_normal((3, 70)).astype(np.float32)
    opencl_elementwise.add(rt, x, x)
    (other,) = tmp_path.glob("probe_kernels-*.bin")
    (target,) = tmp_path.glob("elementwise-*.bin")
    target.write_bytes(other.read_bytes())
    rt = ClRuntime.create(cache_dir=tmp_path)
    with caplog.at_level("WARNING", logger="edgellm"):
        assert np.array_equal(opencl_elementwise.add(rt, x, x), x + x)
    assert (rt.stats.from_source, rt.stats.from_cache) == (1, 0)
    assert "another program" in caplog.text


@pytest.mark.parametrize("t", ["0", "x", "-3"])
def test_a_bad_shape_in_a_tuning_cache_key_ignores_the_file(t, tmp_path, caplog):
    """A tuning-cache entry keyed with T = 0 or T = x (checksum valid) gave an untyped ValueError
    on every matmul of that weight type and kind; the file is now ignored with a warning naming
    the entry, and the default tiles are used."""
    rt = ClRuntime.create(cache_dir=tmp_path)
    opencl_tune._save(rt, {f"Q4_1|gemm|{t}|64|96": {"config": TileConfig("gemm", 32, tm=2, tn=4)}})
    with caplog.at_level("WARNING", logger="edgellm"):
        assert opencl_tune.best_config(rt, "Q4_1", 4, 64, 96) == default_config(rt, "gemm")
    assert "T must be a positive integer" in caplog.text


@pytest.mark.parametrize("value", ["0", "-5", "nan", "abc"])
def test_an_invalid_probe_timeout_is_named(value, home, monkeypatch):
    """EDGELLM_OPENCL_PROBE_TIMEOUT=0/-5/nan reported 'the OpenCL probe did not finish in -5 s
    (driver hung?)', and abc failed the backend's import with a bare ValueError."""
    monkeypatch.setenv("EDGELLM_OPENCL_PROBE_TIMEOUT", value)
    opencl.reset()
    ok, why = opencl.available()
    assert not ok and f"EDGELLM_OPENCL_PROBE_TIMEOUT={value!r} is invalid" in why, why
    assert opencl_child._child == []          # the early child, if any, was not left running


def test_the_backend_imports_with_an_invalid_probe_timeout():
    env = dict(os.environ, EDGELLM_OPENCL_PROBE_TIMEOUT="abc")
    r = subprocess.run([sys.executable, "-c", "import edgellm.backends.opencl"], env=env, capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stderr
