"""The OpenCL probe's passing answer kept per driver and kernel set (backends/opencl_probe_cache.py):
a later load takes it instead of starting a probe child; anything its answer depends on that
changes, a damaged file, or a failing probe means a new probe."""
import json
import os
import subprocess

import pytest

from edgellm.backends import opencl, opencl_child, opencl_probe_cache


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGELLM_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("EDGELLM_OPENCL_PROBE_CACHE", raising=False)
    opencl.reset()
    yield tmp_path / "home"
    opencl.reset()


@pytest.fixture
def children(monkeypatch):
    """The probe children started from here on."""
    started = []
    real = subprocess.Popen
    monkeypatch.setattr(opencl_child.subprocess, "Popen", lambda *a, **k: started.append(a) or real(*a, **k))
    return started


def _answer_file(home):
    return home / "cache" / "opencl" / f"probe-answer-{opencl_probe_cache.identity()[:24]}.json"


def test_a_passing_answer_is_reused_by_the_next_load_without_a_child(home, children):
    ok, why = opencl.available()
    assert ok, why
    assert len(children) == 1 and _answer_file(home).exists()
    probed = opencl.probe_report()

    opencl.reset()                   # as a new process: nothing known in memory
    opencl_child.spawn()             # what edgellm.load does first
    assert opencl_child._child == [] and len(children) == 1
    ok, why = opencl.available()
    assert ok and "the probe's answer of" in why and "EDGELLM_OPENCL_PROBE_CACHE=0" in why, why
    report = opencl.probe_report()
    assert report["cached"] is True and report["device"] == probed["device"]
    assert report["int8_dot"] == probed["int8_dot"]
    assert len(children) == 1


def test_what_the_answer_depends_on_changing_means_a_new_probe(home, children, kernels, monkeypatch):
    assert opencl.available()[0]
    assert opencl_probe_cache.load() is not None

    monkeypatch.setenv("POCL_DEVICES", "cpu")          # the driver's environment
    assert opencl_probe_cache.load() is None
    monkeypatch.delenv("POCL_DEVICES")
    assert opencl_probe_cache.load() is not None

    k = kernels / "elementwise.cl"                     # a kernel source edited
    st = k.stat()
    os.utime(k, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert opencl_probe_cache.load() is None
    opencl.reset()
    assert opencl.available()[0] and len(children) == 2    # probed again, and kept again
    assert opencl_probe_cache.load() is not None


@pytest.mark.parametrize("damage", [b"", b"{", b"[]", b'{"identity": 3}', b"\xff\xfe",
                                    {"ok": False}, {"written": 1e300}, {"written": "yesterday"}, {"written": None}])
def test_a_damaged_answer_file_is_a_miss(home, children, damage):
    assert opencl.available()[0]
    f = _answer_file(home)
    if isinstance(damage, dict):     # the right identity, an answer that did not pass or a bad date
        data = json.loads(f.read_text())
        if "ok" in damage:
            data["answer"].update(damage)
        else:
            data.update(damage)
        f.write_text(json.dumps(data))
    else:
        f.write_bytes(damage)
    assert opencl_probe_cache.load() is None
    opencl.reset()
    ok, why = opencl.available()
    assert ok and "the probe's answer of" not in why and len(children) == 2
    assert opencl_probe_cache.load() is not None       # rewritten by the new probe


def test_a_failing_probe_is_not_kept(home, children, kernels):
    p = kernels / "elementwise.cl"
    p.write_text(p.read_text() + "\n__kernel void el_broken(__global float *y) { y[0] = not_declared_here; }\n")
    ok, why = opencl.available()
    assert not ok and "failed to build" in why
    assert not list((home / "cache" / "opencl").glob("probe-answer*"))
    opencl.reset()
    assert not opencl.available()[0] and len(children) == 2    # probed again


def test_the_cache_can_be_turned_off(home, children, monkeypatch):
    monkeypatch.setenv("EDGELLM_OPENCL_PROBE_CACHE", "0")
    assert opencl.available()[0]
    assert not list((home / "cache" / "opencl").glob("probe-answer*"))
    opencl.reset()
    assert opencl.available()[0] and len(children) == 2
