"""--units restricts probing and names the cause of a fallback (probe 23).

`run ... --units neon` on a profile with an NPU built the NPU's self-check graph and warned about
the NPU; with --units opencl and no OpenCL, each op's reason said 'none of --units opencl runs it'
while the cause (opencl unavailable, and why) was on another line."""
from __future__ import annotations

import logging
from dataclasses import replace

import edgellm
from edgellm.backends import npu, opencl
from edgellm.device.host import estimate_host_profile
from edgellm.device.profile import Npu
from edgellm.device.profile_yaml import write_profile
from edgellm.dispatch import Dispatcher
from tests.profiles import soc
from tests.synthetic import write_tiny_model
from tests.test_dispatch import CFG, Q41


def test_units_outside_the_restriction_are_neither_probed_nor_warned_about(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("EDGELLM_HOME", str(tmp_path / "home"))
    n = Npu("test npu", {"int8": 4e12}, ("CPUExecutionProvider",), None, True, (32,), frozenset({"matmul"}),
            300e-6, 100e-6)
    prof = write_profile(replace(estimate_host_profile(), name="host-npu", npu=n), tmp_path / "host-npu.yaml")
    probed = []

    def probe():
        probed.append("npu")
        return False, "injected: the NPU's self-check failed"

    monkeypatch.setattr(npu, "available", probe)
    tm = write_tiny_model(tmp_path / "m.gguf")
    npu.reset()
    try:
        with caplog.at_level(logging.INFO, logger="edgellm"):
            eng = edgellm.load(tm.path, device=str(prof), n_ctx=64, units=["reference"])
    finally:
        npu.reset()
    assert probed == []
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING and "npu" in r.getMessage()], \
        [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    units = {u.name: u for u in eng.plan.units}
    assert not units["npu"].available and "not in --units" in units["npu"].reason
    assert units["reference"].available


def test_fallback_reason_names_the_listed_units_cause(monkeypatch, caplog):
    monkeypatch.setattr(opencl, "available", lambda: (False, "injected: no OpenCL platform"))
    with caplog.at_level(logging.WARNING, logger="edgellm"):
        plan = Dispatcher(soc(), CFG, Q41, probe=True, override=["opencl"]).plan(
            prompt_tokens=64, n_ctx=256, memory_budget=512 * 2**20)
    want = "none of --units opencl runs it (opencl unavailable: injected: no OpenCL platform); using reference"
    for ph in (plan.prefill, plan.decode):
        for p in ph.placements:
            assert p.unit == "reference" and p.reason == want, (p.op, p.reason)
    # one warning for every op of that cause (one per op said it 14 times over)
    grouped = [w for w in plan.warnings if "none of --units" in w]
    assert len(grouped) == 1 and grouped[0].startswith("ops attn_norm, "), plan.warnings
    assert grouped[0].endswith(want.replace("runs it", "runs them")), grouped
    assert [r.getMessage() for r in caplog.records if "none of --units" in r.getMessage()] == grouped
