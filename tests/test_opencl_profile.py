"""`edgellm profile` with the opencl unit: its figures, and the host profile's gpu: section."""
from __future__ import annotations


import pytest

from edgellm.backends import opencl, opencl_profile
from edgellm.device import probes
from tests.test_probes import TINY


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGELLM_HOME", str(tmp_path / "home"))
    opencl.reset()
    yield
    opencl.reset()


def test_opencl_probe_measures_a_gemm_curve_and_overhead():
    um = opencl_profile.probe(TINY, 2, tune=False)
    assert um is not None
    assert [g.m for g in um.gemm] == list(TINY.gemm_rows)
    assert all(g.flops > 0 for g in um.gemm) and um.call_overhead_s > 0
    assert um.precision_flops["fp32"] == max(g.flops for g in um.gemm)


def test_measure_host_writes_the_gpu_section(tmp_path, monkeypatch):
    monkeypatch.setattr(probes, "_PROBES", {
        "reference": probes.probe_reference,
        "opencl": lambda quick, threads, progress=None: opencl_profile.probe(TINY, threads, progress, tune=False)})
    result = probes.measure_host(out_path=tmp_path / "h.yaml", quick=True, sizes=TINY)
    g = result.profile.gpu
    assert g is not None and g.api == "opencl" and g.name == opencl.runtime().name
    assert g.launch_overhead_s > 0 and g.transfer_overhead_s > 0
    assert g.peak["fp32"] == result.profile.measured.units["opencl"].precision_flops["fp32"]
    assert g.work_group_size % g.warp_width == 0
    # and the cost model plans with the measured unit
    from edgellm.costmodel import gpu_unit

    u = gpu_unit(result.profile)
    assert u.gemm_curve and u.launch_s == result.profile.measured.units["opencl"].call_overhead_s


def test_an_unavailable_unit_is_skipped(monkeypatch):
    monkeypatch.setattr(opencl, "available", lambda: (False, "injected"))
    assert opencl_profile.probe(TINY, 2, tune=False) is None


