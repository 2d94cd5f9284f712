"""The OpenCL probe's passing answer kept per driver and kernel set (backends/opencl_probe_cache.py):
a later load takes it instead of starting a probe child; anything its answer depends on that
changes, a damaged file, or a failing probe means a new probe."""
import json
import os
import re
import subprocess
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

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


@pytest.mark.parametrize("damage", [b"", b"{", b"[]", b'{"identity": 3}', b"\xff\xfe", b"[" * 200_000,
                                    "fifo", "huge", {"ok": False}, {"int8_dot": "yes"}, {"reason": 5},
                                    {"written": 1e300}, {"written": "yesterday"}, {"written": None}],
                         ids=lambda d: repr(d)[:24])
def test_a_damaged_answer_file_is_a_miss(home, children, damage):
    # (a FIFO hung every load, an 8 GB file was read whole, deep JSON raised RecursionError, and
    # an answer with fields the child never writes stood in for a probe)
    assert opencl.available()[0]
    f = _answer_file(home)
    if isinstance(damage, dict):     # the right identity, an answer that did not pass or a bad date
        data = json.loads(f.read_text())
        if set(damage) & {"ok", "int8_dot", "reason"}:
            data["answer"].update(damage)
        else:
            data.update(damage)
        f.write_text(json.dumps(data))
    elif damage == "fifo":
        f.unlink()
        os.mkfifo(f)
    elif damage == "huge":
        with open(f, "wb") as out:
            out.truncate(1 << 30)     # (sparse)
    else:
        f.write_bytes(damage)
    assert opencl_probe_cache.load() is None
    opencl.reset()
    ok, why = opencl.available()
    assert ok and "the probe's answer of" not in why and len(children) == 2
    # rewritten by the new probe (a FIFO is left alone: write_atomic replaces no pipe or device)
    assert (opencl_probe_cache.load() is not None) == (damage != "fifo")


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


def test_mutated_answer_files_are_answers_or_misses_never_errors(home):
    """Random byte flips, truncations and JSON values in a kept answer: load() returns a
    passing answer or None (a miss), and never raises."""
    assert opencl.available()[0]
    f = _answer_file(home)
    good = f.read_bytes()

    json_values = st.recursive(st.none() | st.booleans() | st.floats() | st.integers() | st.text(max_size=8),
                               lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=8), c, max_size=3),
                               max_leaves=8)

    # the date gets its own numbers: far past, far future, NaN, infinities
    dates = st.floats() | st.integers(-2**70, 2**70) | st.sampled_from([1e300, -1e300, 2.0**63])

    @settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(flips=st.lists(st.tuples(st.integers(0, len(good) - 1), st.integers(0, 255)), max_size=6),
           cut=st.integers(0, len(good)), field=st.sampled_from(["identity", "written", "answer", "ok", "reason"]),
           value=json_values, date=dates, mode=st.sampled_from(["bytes", "json", "date"]))
    def check(flips, cut, field, value, date, mode):
        if mode == "bytes":
            b = bytearray(good)
            for i, v in flips:
                b[i] = v
            f.write_bytes(bytes(b[:cut]) if cut < len(good) // 2 else bytes(b))
        elif mode == "json":
            data = json.loads(good)
            (data["answer"] if field in ("ok", "reason") else data)[field] = value
            f.write_text(json.dumps(data))
        else:
            f.write_text(json.dumps(dict(json.loads(good), written=date)))
        got = opencl_probe_cache.load()
        assert got is None or (isinstance(got, dict) and got["ok"] is True and isinstance(got["cached_at"], str))

    check()


def test_a_changed_program_binary_is_probed_again(home, children):
    """A cut-short binary whose header was made to match it passed the engine's checks, and with
    the probe's answer kept no child loaded it first: the engine's own process died (SIGSEGV)."""
    assert opencl.available()[0]
    bins = sorted((home / "cache" / "opencl").glob("*.bin"))
    assert bins and opencl_probe_cache.load() is not None
    data = bins[0].read_bytes()
    bins[0].write_bytes(data[: len(data) // 2])
    assert opencl_probe_cache.load() is None           # a new identity: the child loads it first


def test_a_probe_that_crashes_clears_the_binaries_and_probes_once_more(home, children, kernels, caplog):
    """A binary the driver dies on crashed every probe: the binary cache is cleared and the
    sources built again, once (a driver that dies anyway still falls back with its reason)."""
    import logging

    assert opencl.available()[0]
    binary_dir = home / "cache" / "opencl"
    assert list(binary_dir.glob("*.bin")) and len(children) == 1
    p = kernels / "probe_kernels.cl"                    # now every probe dies (as test_opencl_faults)
    p.write_text(p.read_text().replace("if (i < n) out[i] = value;",
                                       "if (i < n) out[i] = value; ((__global float *)0x10)[i * 4096] = value;"))
    opencl.reset()
    with caplog.at_level(logging.WARNING, logger="edgellm"):
        ok, why = opencl.available()
    # PoCL dies of the stray write: the cache goes and one probe more runs, not a loop. NVIDIA's
    # driver reports it as an error of the read-back (seen on an H200), before any program came
    # from the cache: nothing there to blame, no probe more
    assert not ok and re.search(r"crashed|read-back of \d+ bytes failed", why), why
    crashed = "crashed" in why
    assert len(children) == (3 if crashed else 2)
    assert crashed == any("program-binary cache" in r.getMessage() and "cleared" in r.getMessage()
                          for r in caplog.records)


@pytest.mark.parametrize("value", ["2147484", "1e10", "86400000"])
def test_a_probe_timeout_past_what_a_wait_can_take_is_invalid(home, monkeypatch, value):
    """2147484 s and more raised an untyped OverflowError from the wait, probing again each call."""
    monkeypatch.setenv("EDGELLM_OPENCL_PROBE_TIMEOUT", value)
    for _ in range(2):
        ok, why = opencl.available()
        assert not ok and f"EDGELLM_OPENCL_PROBE_TIMEOUT={value!r} is invalid" in why, why


def _copy_binary(src, dst, cut=False):
    """dst: src's program binary under another key, its header made to match (cut: half of it)."""
    from edgellm.backends.opencl_runtime import _HEADER
    from edgellm.hashing import sha256

    data = src.read_bytes()
    magic, _, _, n = _HEADER.unpack_from(data)
    payload = data[_HEADER.size:][: n // 2 if cut else n]
    key = dst.stem.rsplit("-", 1)[-1].encode()
    dst.write_bytes(_HEADER.pack(magic, key, sha256(payload).digest(), len(payload)) + payload)


def test_the_probe_loads_the_binaries_the_engine_built_too(home, children):
    """The engine builds variants for its shapes that the probe never builds: a damaged one was
    loaded first by the engine's own process (PoCL: abort, at every run; a review)."""
    assert opencl.available()[0]
    d = home / "cache" / "opencl"
    _copy_binary(sorted(d.glob("*.bin"))[0], d / f"attention-{'e' * 32}.bin")   # as the engine would add
    opencl.reset()
    assert opencl.available()[0] and len(children) == 2
    assert opencl.probe_report()["binaries_loaded"] == len(list(d.glob("*.bin")))


def test_a_cut_short_engine_binary_is_cleared_in_the_child(home, children, caplog):
    import logging

    assert opencl.available()[0]
    d = home / "cache" / "opencl"
    bad = d / f"attention-{'f' * 32}.bin"
    _copy_binary(sorted(d.glob("*.bin"))[0], bad, cut=True)
    opencl.reset()
    with caplog.at_level(logging.WARNING, logger="edgellm"):
        ok, why = opencl.available()
    assert ok, why
    # PoCL dies on it (an assertion in pocl_binary_deserialize): the child, not this process, and
    # a probe more follows; NVIDIA's driver rejects it with an error and the child removes it
    assert not bad.exists() and len(children) in (2, 3), [r.getMessage() for r in caplog.records]


def test_a_binary_the_driver_rejects_is_removed(home, monkeypatch, caplog):
    """A driver that refuses a cached binary with an error (NVIDIA's, for a cut-short one) rather
    than dying on it: the file goes, not rejected again at every probe."""
    import logging

    import pyopencl as cl

    from edgellm.backends import opencl_runtime

    assert opencl.available()[0]
    d = home / "cache" / "opencl"
    bad = d / f"attention-{'f' * 32}.bin"
    _copy_binary(sorted(d.glob("*.bin"))[0], bad, cut=True)
    payload = bad.read_bytes()[_header_size():]

    class Program:          # the driver's answer to that one binary: an error, not a crash
        def __init__(self, ctx, devices, binaries):
            self.rejected = binaries[0] == payload       # (PoCL itself would abort on it)
            self.real = None if self.rejected else cl.Program(ctx, devices, binaries)

        def build(self, *a, **k):
            if self.rejected:
                raise cl.RuntimeError("clBuildProgram failed: INVALID_BINARY")
            return self.real.build(*a, **k)
    rt = opencl_runtime.ClRuntime.create(cache_dir=d)
    monkeypatch.setattr(opencl_runtime, "_import_cl", lambda: SimpleNamespace(Program=Program, Error=cl.Error))
    kept = len(list(d.glob("*.bin"))) - 1
    with caplog.at_level(logging.WARNING, logger="edgellm"):
        assert rt.load_cached_binaries() == kept
    assert not bad.exists() and "rejected by the driver" in caplog.text and "removed" in caplog.text


def _header_size():
    from edgellm.backends.opencl_runtime import _HEADER
    return _HEADER.size


def test_a_failing_probe_from_cached_binaries_probes_again_from_source(home, children, caplog):
    """A cached binary the driver takes but that is another program (or runs wrong) failed every
    probe, the unit off until the user cleared the cache: the cache goes and the sources are built
    once more, as after a crash."""
    import logging

    assert opencl.available()[0] and len(children) == 1
    d = home / "cache" / "opencl"
    (elementwise,) = [p for p in d.glob("elementwise-*.bin")][:1]
    other = sorted(d.glob("attention-*.bin"))[0]
    _copy_binary(other, elementwise)                   # elementwise's key, attention's program
    opencl.reset()
    with caplog.at_level(logging.WARNING, logger="edgellm"):
        ok, why = opencl.available()
    assert ok, why
    assert len(children) == 3                           # the failure, then one probe from source
    assert any("program-binary cache" in r.getMessage() and "cleared" in r.getMessage() for r in caplog.records)
