"""numpy's BLAS runs on one thread where the reference unit runs attention but not the large
GEMMs: attention's matmuls are small, and OpenBLAS's caller spin-waits for its workers at each.
Beside one CPU-bound process, a 400-token prompt on units npu,reference took 0.9-1.3 s at 2 BLAS
threads, 0.44 s at 1 (a probe). Where reference runs the projections too (units=["reference"]),
2 threads were 1.7x faster idle: they keep the engine's threads. (load sets the count from the
plan the engine runs, after the runner's build: a UnitFailed there re-plans.)"""
from gguf import GGMLQuantizationType as QT
from threadpoolctl import threadpool_info

import edgellm
from tests.synthetic import write_tiny_model


def _blas_threads() -> set[int]:
    return {p["num_threads"] for p in threadpool_info() if p.get("user_api") == "blas"}


def _attention_units(e) -> set[str]:
    return {p.unit for ph in e.plan.phases().values() for p in ph.placements if p.op == "attention"}


def test_blas_threads_follow_where_attention_and_the_gemms_run(tmp_path, monkeypatch):
    from dataclasses import replace

    from edgellm.backends import npu
    from edgellm.device.host import estimate_host_profile
    from edgellm.device.profile import Npu
    from edgellm.device.profile_yaml import write_profile

    monkeypatch.setenv("EDGELLM_NPU_RUNTIME", "onnx")
    n = Npu("test npu", {"int8": 4e12}, ("CPUExecutionProvider",), None, True, (32,), frozenset({"matmul"}),
            300e-6, 100e-6)
    prof = str(write_profile(replace(estimate_host_profile(), name="withnpu", npu=n), tmp_path / "withnpu.yaml"))
    path = write_tiny_model(tmp_path / "t.gguf", tensor_type=QT.Q8_0, n_layers=2, seed=4).path
    npu.reset()
    try:
        e = edgellm.load(path, device=prof, threads=2, n_ctx=128, units=["npu", "reference"])
        on_ref = {p.op: p.kind for ph in e.plan.phases().values() for p in ph.placements if p.unit == "reference"}
        assert "attention" in on_ref and not {"matmul", "lm_head"} & set(on_ref.values()), on_ref
        assert _blas_threads() == {1}
        e.generate("alpha beta", max_tokens=2, temperature=0)
    finally:
        npu.reset()
    # reference running the projections too keeps the engine's threads (its large GEMMs gain)
    ref = edgellm.load(path, threads=2, n_ctx=64, units=["reference"])
    assert _attention_units(ref) == {"reference"} and _blas_threads() == {2}
    neon = edgellm.load(path, threads=2, n_ctx=64)
    assert _attention_units(neon) == {"neon"} and _blas_threads() == {2}
