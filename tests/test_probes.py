"""`edgellm profile`'s measurement core (edgellm/device/probes.py) with tiny shapes: the probe
registry, skipping a broken probe with its reason, the written profile validating, pinning per
cluster and the affinity put back, and the progress callback."""
from __future__ import annotations

import dataclasses
import os

import pytest
import yaml

from edgellm.device import probes
from edgellm.device.host import estimate_host_profile
from edgellm.device.profile import CpuCluster, DeviceProfile, UnitMeasurement, load_profile
from edgellm.device.topology import current_affinity
from edgellm.errors import ConfigError

MiB = 1 << 20
TINY = probes.ProbeSizes(cluster_gemm=64, small_gemm=(4, 16, 16), gemm_k=32, gemm_n=64,
                         gemm_rows=(1, 4, 16), runs=3, min_runs=1, budget_s=0.005, overhead_batch=10,
                         bandwidth_bytes=2 * MiB, weight_bytes=1 * MiB)

can_pin = pytest.mark.skipif(
    not (hasattr(os, "sched_setaffinity") and os.path.isdir("/proc/self/task")
         and len(current_affinity()) >= 2),
    reason="needs Linux sched_setaffinity, /proc and at least two usable cores")


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    """No test writes to the user's real profile folder, and each starts with only the built-in
    reference probe registered."""
    monkeypatch.setenv("EDGELLM_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(probes, "_PROBES", {"reference": probes.probe_reference})


def _thread_affinities() -> dict[int, frozenset[int]]:
    return {int(t): frozenset(os.sched_getaffinity(int(t))) for t in os.listdir("/proc/self/task")}


def _still_alive(affinities: dict, other: dict) -> dict:
    """The threads of both snapshots: a thread that ended in between (an earlier test's pool or
    scheduler worker finishing) has no affinity to restore; comparing against the whole first
    snapshot failed the test on it."""
    return {t: a for t, a in affinities.items() if t in other}


def _two_clusters(monkeypatch) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Make the estimate report the first usable core as a fast 'big' cluster and the others as
    a slow 'little' one, so pinning per cluster really moves the threads."""
    cores = sorted(current_affinity())
    real = estimate_host_profile()
    c0 = real.clusters[0]
    big = dataclasses.replace(c0, name="big", cores=(cores[0],), max_freq_hz=3.0e9, capacity=None)
    little = dataclasses.replace(c0, name="little", cores=tuple(cores[1:]), max_freq_hz=1.0e9,
                                 capacity=None)
    fake = dataclasses.replace(real, clusters=(big, little))
    monkeypatch.setattr(probes, "estimate_host_profile", lambda: fake)
    return big.cores, little.cores


# -- registry -----------------------------------------------------------------------------------


def test_reference_probe_is_registered_by_the_module():
    assert probes.registered_probes() == ("reference",)


def test_register_and_unregister_keep_order():
    def fn(quick, threads, progress):
        return None

    probes.register_probe("neon", fn)
    probes.register_probe("opencl", fn)
    assert probes.registered_probes() == ("reference", "neon", "opencl")
    probes.register_probe("neon", fn)       # re-registering replaces in place
    assert probes.registered_probes() == ("reference", "neon", "opencl")
    probes.unregister_probe("neon")
    assert probes.registered_probes() == ("reference", "opencl")


@pytest.mark.parametrize("name, fn, says", [
    ("", lambda q, t, p: None, "backend name"),
    ("Neon GPU", lambda q, t, p: None, "backend name"),
    (3, lambda q, t, p: None, "backend name"),
    ("neon", "not callable", "expected a callable"),
])
def test_register_rejects_bad_names_and_functions(name, fn, says):
    with pytest.raises(ConfigError, match=says):
        probes.register_probe(name, fn)
    assert probes.registered_probes() == ("reference",)


# -- measure_host ----------------------------------------------------------------------------------


def test_measure_host_writes_a_profile_that_validates(tmp_path):
    from edgellm.backends import neon
    neon_ok = neon.available()[0]
    out = tmp_path / "host.yaml"
    calls = []
    result = probes.measure_host(out_path=out, quick=True, sizes=TINY,
                                 progress=lambda s, d, t: calls.append((s, d, t)))
    profile, path = result                      # unpacks as (profile, path)
    assert path == out and out.is_file()
    again = load_profile(out)                   # validates; the returned one is the loaded one
    assert again.measured == profile.measured and profile.source == str(out)

    est = estimate_host_profile()
    m = profile.measured
    assert profile.soc.startswith("this machine (") and "estimated" not in profile.soc
    assert profile.memory_bandwidth == m.memory_read_bandwidth > 0
    assert m.tool.startswith("edgellm profile ") and m.tool.endswith("--quick")
    assert set(m.clusters) == {c.name for c in est.clusters}
    for figures in m.clusters.values():
        assert set(figures) == {"fp32", "fp16", "int8"} and all(v > 0 for v in figures.values())
    # each cluster's peak per core is measured (the neon library's chains) where the library
    # loads, else the estimate's nominal figure stays, and a note says so
    for got, nominal in zip(profile.clusters, est.clusters, strict=True):
        assert set(got.peak_per_core) == set(nominal.peak_per_core)
        assert all(v > 0 for v in got.peak_per_core.values())
        if not neon_ok:
            assert dict(got.peak_per_core) == pytest.approx(dict(nominal.peak_per_core), rel=1e-5)

    ref = m.units["reference"]
    assert [(g.m, g.k, g.n) for g in ref.gemm] == [(r, 32, 64) for r in TINY.gemm_rows]
    assert all(g.flops > 0 for g in ref.gemm)
    assert ref.precision_flops["fp32"] == pytest.approx(max(g.flops for g in ref.gemm), rel=1e-5)
    assert 0 < ref.call_overhead_s < 1e-3
    assert ref.threads == len(probes.select_big(est.clusters))
    # attention and the elementwise ops as the engine runs them on the unit, at the probe's shapes
    from edgellm.device import op_probe
    assert [(a.tokens, a.context) for a in ref.attention] == list(op_probe.SHAPES)
    assert all(a.flops > 0 for a in ref.attention)
    assert sorted((e.op, e.tokens) for e in ref.elementwise) == sorted(
        (op, t) for op in ("rmsnorm", "rope", "swiglu", "add") for t in op_probe.ELEMENTWISE_TOKENS)
    assert all(e.flops > 0 for e in ref.elementwise)
    # nothing skipped (a shared test machine may be flagged as busy, a CPU without fp16 vector
    # arithmetic is named, a missing neon library leaves the nominal peaks: that is all)
    assert [n for n in result.notes if not n.startswith("other processes used")
            and "no native fp16 arithmetic" not in n
            and (neon_ok or "nominal figures kept" not in n)] == []

    # the YAML carries units, as every profile does
    doc = yaml.safe_load(out.read_text())
    assert doc["measured"]["memory_read_bandwidth"].endswith("B/s")
    assert doc["measured"]["units"]["reference"]["gemm"][0]["flops"].endswith("FLOPS")


def test_default_path_is_the_user_profile_dir(tmp_path):
    profile, path = probes.measure_host(quick=True, sizes=TINY)
    assert path == tmp_path / "home" / "profiles" / "host.yaml"
    assert load_profile("host").measured == profile.measured   # what host_profile() will read


def test_progress_total_is_stable_and_ends_done(tmp_path):
    calls = []
    probes.register_probe("fake", lambda q, t, p: (p("inner stage", 0, 7), None)[1])
    probes.measure_host(out_path=tmp_path / "h.yaml", quick=True, sizes=TINY,
                        progress=lambda s, d, t: calls.append((s, d, t)))
    totals = {t for _, _, t in calls}
    n_clusters = len(estimate_host_profile().clusters)
    assert totals == {n_clusters + 1 + 2 + 1}   # clusters, bandwidth, 2 probes, write
    done = [d for _, d, _ in calls]
    assert done == sorted(done) and done[0] == 0 and calls[-1][1] == calls[-1][2]
    stages = [s for s, _, _ in calls]
    assert "memory bandwidth" in stages and "unit fake: inner stage" in stages
    assert any(s.startswith("unit reference: gemm 16x32x64") for s in stages)


def test_a_probe_that_raises_is_skipped_with_its_reason(tmp_path):
    def broken(quick, threads, progress):
        raise RuntimeError("no OpenCL platform found")

    good = UnitMeasurement(precision_flops={"fp32": 1e9}, gemm=(), call_overhead_s=2e-6, threads=1)
    probes.register_probe("opencl", broken)
    probes.register_probe("npu", lambda q, t, p: None)
    probes.register_probe("neon", lambda q, t, p: good)
    result = probes.measure_host(out_path=tmp_path / "h.yaml", quick=True, sizes=TINY)
    units = result.profile.measured.units
    assert set(units) == {"reference", "neon"}
    assert units["neon"].precision_flops == {"fp32": 1e9}
    assert "unit opencl: skipped (RuntimeError: no OpenCL platform found)" in result.notes
    assert any(n.startswith("unit npu: skipped") for n in result.notes)


def test_probes_get_quick_and_the_big_core_count(tmp_path):
    seen = []
    probes.register_probe("fake", lambda q, t, p: seen.append((q, t)))
    probes.measure_host(out_path=tmp_path / "h.yaml", quick=True, sizes=TINY)
    assert seen == [(True, len(probes.select_big(estimate_host_profile().clusters)))]


@can_pin
def test_clusters_are_measured_pinned_and_affinity_is_restored(tmp_path, monkeypatch):
    big, little = _two_clusters(monkeypatch)
    seen_clusters, seen_probe = [], []
    real_measure = probes.measure_cluster
    monkeypatch.setattr(probes, "measure_cluster",
                        lambda s: (seen_clusters.append(_thread_affinities()), real_measure(s))[1])
    probes.register_probe("fake", lambda q, t, p: seen_probe.append((t, current_affinity())))
    before = _thread_affinities()
    result = probes.measure_host(out_path=tmp_path / "h.yaml", quick=True, sizes=TINY)

    # every thread (BLAS workers included) ran on the cluster being measured
    assert [set(a.values()) for a in seen_clusters] == [{frozenset(big)}, {frozenset(little)}]
    assert seen_probe == [(1, frozenset(big))]      # probes run on the big cores only
    assert set(result.profile.measured.clusters) == {"big", "little"}
    after = _thread_affinities()
    assert _still_alive(after, before) == _still_alive(before, after)


@can_pin
def test_affinity_is_restored_when_a_measurement_raises(tmp_path, monkeypatch):
    big, _ = _two_clusters(monkeypatch)
    pinned = []

    def fail(sizes, **_):
        pinned.append(current_affinity())
        raise RuntimeError("simulated failure")

    monkeypatch.setattr(probes, "measure_read_bandwidth", fail)
    before = _thread_affinities()
    with pytest.raises(RuntimeError, match="simulated"):
        probes.measure_host(out_path=tmp_path / "h.yaml", quick=True, sizes=TINY)
    assert pinned == [frozenset(big)]
    after = _thread_affinities()
    assert _still_alive(after, before) == _still_alive(before, after)
    assert not (tmp_path / "h.yaml").exists()


@can_pin
def test_affinity_is_restored_after_a_probe_that_raises(tmp_path, monkeypatch):
    big, _ = _two_clusters(monkeypatch)

    def broken(q, t, p):
        assert current_affinity() == frozenset(big)
        raise OSError("device node vanished")

    probes.register_probe("npu", broken)
    before = _thread_affinities()
    result = probes.measure_host(out_path=tmp_path / "h.yaml", quick=True, sizes=TINY)
    assert "unit npu: skipped (OSError: device node vanished)" in result.notes
    after = _thread_affinities()
    assert _still_alive(after, before) == _still_alive(before, after)


def test_unpinnable_cluster_is_skipped_with_its_reason(tmp_path, monkeypatch):
    est = estimate_host_profile()
    ghost = CpuCluster(name="ghost", cores=(4000,), microarch="x", max_freq_hz=1e8, features=frozenset(),
                       peak_per_core={"fp32": 1e9}, l1d_bytes=32 * 1024, l2_bytes=MiB, l3_bytes=0,
                       capacity=None)
    fake: DeviceProfile = dataclasses.replace(est, clusters=est.clusters + (ghost,))
    monkeypatch.setattr(probes, "estimate_host_profile", lambda: fake)
    result = probes.measure_host(out_path=tmp_path / "h.yaml", quick=True, sizes=TINY)
    assert "ghost" not in result.profile.measured.clusters
    assert set(result.profile.measured.clusters) == {c.name for c in est.clusters}
    assert any(n.startswith("cluster ghost: threads not pinned") and n.endswith("not measured")
               for n in result.notes)


# -- sizes ---------------------------------------------------------------------------------------


def test_sizes_follow_the_caches(monkeypatch):
    c = estimate_host_profile().clusters[0]
    c = dataclasses.replace(c, cores=(0, 1), l2_bytes=1 * MiB, l3_bytes=32 * MiB)   # 34 MiB in all
    monkeypatch.setattr(probes, "_available_bytes", lambda: 64 << 30)
    s = probes.resolve_sizes(probes.QUICK, (c,))
    assert s.weight_bytes == 3 * 34 * MiB           # every GEMM call reads its weights from DRAM
    assert s.bandwidth_bytes == 8 * 34 * MiB
    small = dataclasses.replace(c, l2_bytes=256 * 1024, l3_bytes=0)                  # a phone-sized one
    assert probes.resolve_sizes(probes.QUICK, (small,)).bandwidth_bytes == 256 * MiB
    monkeypatch.setattr(probes, "_available_bytes", lambda: 400 * MiB)               # short of memory
    s = probes.resolve_sizes(probes.QUICK, (c,))
    assert s.weight_bytes == s.bandwidth_bytes == 100 * MiB
    assert probes.resolve_sizes(TINY, (c,)) == TINY                                  # explicit sizes win


def test_default_shapes_are_smollm2s():
    # decode (1 row) and the prefill chunks the planner chooses between must be measured points
    for sizes in (probes.QUICK, probes.FULL):
        assert {1, 32, 64, 128, 256, 512} <= set(sizes.gemm_rows)
        assert list(sizes.gemm_rows) == sorted(set(sizes.gemm_rows))
    assert (probes.FULL.gemm_k, probes.FULL.gemm_n) == (576, 1536)


def test_an_estimate_that_cannot_be_written_fails_before_measuring(tmp_path, monkeypatch):
    est = estimate_host_profile()
    no_caches = dataclasses.replace(est, clusters=tuple(dataclasses.replace(c, l1d_bytes=0)
                                                        for c in est.clusters))
    monkeypatch.setattr(probes, "estimate_host_profile", lambda: no_caches)
    measured = []
    monkeypatch.setattr(probes, "measure_cluster", lambda s: measured.append(s))
    with pytest.raises(ConfigError, match=r"cpu\.clusters\[0\]\.cache\.l1d"):
        probes.measure_host(out_path=tmp_path / "h.yaml", quick=True, sizes=TINY)
    assert measured == [] and not (tmp_path / "h.yaml").exists()


def test_a_busy_machine_is_flagged():
    # 2 CPUs for 10 s = 20 CPU-seconds; we used 12 of them
    assert probes.busy_note((100.0, 5.0), (113.0, 17.0), 10.0, 2) is None          # others 1 s: 5%
    note = probes.busy_note((100.0, 5.0), (120.0, 17.0), 10.0, 2)                  # others 8 s: 40%
    assert note is not None and "40% of the 2 CPUs" in note and "idle machine" in note


def test_units_and_bandwidth_are_measured_unpinned_when_the_big_cores_cannot_be_pinned(tmp_path, monkeypatch):
    est = estimate_host_profile()
    ghost = dataclasses.replace(est.clusters[0], name="big", cores=(4000,))     # not ours to run on
    monkeypatch.setattr(probes, "estimate_host_profile",
                        lambda: dataclasses.replace(est, clusters=(ghost,)))
    before = current_affinity()
    result = probes.measure_host(out_path=tmp_path / "h.yaml", quick=True, sizes=TINY)
    m = result.profile.measured
    assert m.clusters == {}                              # a cluster's figures need its cores
    assert m.memory_read_bandwidth > 0 and m.units["reference"].gemm[0].flops > 0
    assert any(n.startswith("cluster big: threads not pinned") and n.endswith("not measured")
               for n in result.notes)
    assert any(n.startswith("memory bandwidth: threads not pinned") and n.endswith("measured unpinned")
               for n in result.notes)
    assert current_affinity() == before


# -- peak per core --------------------------------------------------------------------------------


def test_measured_peaks_replace_the_nominal_ones(tmp_path, monkeypatch):
    from edgellm.backends import neon_probe
    fake = {"fp32": 1.5e11, "fp16": 3.0e11, "int8": 6.0e11}
    seen = []
    monkeypatch.setattr(neon_probe, "peak_per_core", lambda **kw: seen.append(kw) or (dict(fake), "a note"))
    result = probes.measure_host(out_path=tmp_path / "host.yaml", quick=True, sizes=TINY)
    assert all(dict(c.peak_per_core) == pytest.approx(fake) for c in result.profile.clusters)
    assert len(seen) == len(result.profile.clusters)          # once per cluster, pinned there
    assert all(f"cluster {c.name}: a note" in result.notes for c in result.profile.clusters)
    # and they are what the cost model's CPU peak reads
    from edgellm.costmodel import big_cpu, cpu_peak
    cores = sum(len(c.cores) for c in big_cpu(result.profile))
    assert cpu_peak(big_cpu(result.profile), "int8") == pytest.approx(6.0e11 * cores)


def test_without_the_neon_library_the_nominal_peaks_stay_with_a_note(tmp_path, monkeypatch):
    from edgellm.backends import neon_probe
    monkeypatch.setattr(neon_probe, "peak_per_core", lambda **kw: None)
    result = probes.measure_host(out_path=tmp_path / "host.yaml", quick=True, sizes=TINY)
    for got, nominal in zip(result.profile.clusters, estimate_host_profile().clusters, strict=True):
        assert dict(got.peak_per_core) == pytest.approx(dict(nominal.peak_per_core), rel=1e-5)
        assert any(n.startswith(f"cluster {got.name}: peak per core not measured (the neon library")
                   for n in result.notes)


def test_a_failing_peak_probe_is_noted_not_fatal(tmp_path, monkeypatch):
    from edgellm.backends import neon_probe

    def broken(**kw):
        raise OSError("library vanished")
    monkeypatch.setattr(neon_probe, "peak_per_core", broken)
    result = probes.measure_host(out_path=tmp_path / "host.yaml", quick=True, sizes=TINY)
    assert any("peak per core not measured (OSError: library vanished); nominal figures kept" in n
               for n in result.notes)


def test_gemm_peak_share_names_the_precision_and_the_cores():
    est = estimate_host_profile()
    big = probes.select_big(est.clusters)
    c0 = dataclasses.replace(est.clusters[0], cores=tuple(big), peak_per_core={"fp32": 1e11, "fp16": 1e11,
                                                                                "int8": 4e11})
    prof = dataclasses.replace(est, clusters=(c0,))
    from edgellm.device.profile import GemmFigure
    n = len(big)
    u = UnitMeasurement(threads=n, call_overhead_s=1e-6, precision_flops={"int8": 2e11 * n},
                        gemm=(GemmFigure(m=1, k=8, n=8, flops=1e10), GemmFigure(m=64, k=8, n=8, flops=2e11 * n)))
    assert probes.gemm_peak_share(prof, "neon", u) == (
        f"best GEMM {200 * n:.0f} GOPS at 64 rows = 50% of {n} big cores' int8 peak ({400 * n:.0f})")
    ref = dataclasses.replace(u, precision_flops={"fp32": 5e10})
    assert "fp32 peak" in probes.gemm_peak_share(prof, "reference", ref)
    assert probes.gemm_peak_share(prof, "opencl", u) is None      # a GPU's peak is its own


def test_profile_command_prints_peaks_and_each_cpu_units_share_of_them(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from edgellm.cli import app
    real = probes.measure_host
    monkeypatch.setattr(probes, "measure_host", lambda out, quick, progress: real(out, quick, progress, sizes=TINY))
    r = CliRunner().invoke(app, ["profile", "--out", str(tmp_path / "p.yaml")])
    assert r.exit_code == 0, r.output
    prof = load_profile(tmp_path / "p.yaml")
    for c in prof.clusters:
        assert f"cluster {c.name}: peak per core fp32 {c.peak_per_core['fp32'] / 1e9:.0f} GFLOPS" in r.stdout
    ref = prof.measured.units["reference"]
    assert probes.gemm_peak_share(prof, "reference", ref) in r.stdout
    assert "unit reference: best GEMM" in r.stdout and "fp32 peak" in r.stdout


def test_a_profile_that_cannot_be_written_keeps_its_measurement(tmp_path, monkeypatch):
    """A full disk at the end lost the whole measurement: '[Errno 28] No space left on device',
    no file named, nothing printed (a probe). The error now names the file and carries the text,
    which the CLI prints."""
    import errno

    from edgellm.device import profile_yaml

    def full(path, data, mode=0o600):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(profile_yaml, "write_atomic", full)
    out = tmp_path / "host.yaml"
    with pytest.raises(probes.ProfileNotWritten) as ei:
        probes.measure_host(out_path=out, quick=True, sizes=TINY)
    assert str(out) in str(ei.value) and "No space left" in str(ei.value)
    saved = tmp_path / "saved.yaml"
    saved.write_text(ei.value.text)
    assert load_profile(saved).measured.memory_read_bandwidth > 0     # the measurement, whole
    assert not out.exists()


def test_the_cli_prints_a_profile_it_could_not_write(tmp_path, monkeypatch):
    import errno

    from typer.testing import CliRunner

    from edgellm.cli import app

    def measure(out, quick=False, progress=None):
        raise probes.ProfileNotWritten(out, "name: host\nsoc: measured\n", OSError(errno.ENOSPC, "No space left on device"))

    monkeypatch.setattr(probes, "measure_host", measure)
    r = CliRunner().invoke(app, ["profile", "--quick", "--out", str(tmp_path / "p.yaml")])
    assert r.exit_code == 1
    assert r.stdout.startswith("name: host\nsoc: measured\n")
    assert "could not write the profile to" in r.stderr and "printed above" in r.stderr


def test_the_default_profile_path_keeps_a_hand_written_file_and_says_what_is_not_a_folder(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from edgellm.cli import app

    def measure(out, quick=False, progress=None):
        raise AssertionError("measured before the output path was checked")

    monkeypatch.setattr(probes, "measure_host", measure)
    monkeypatch.setenv("EDGELLM_HOME", str(tmp_path / "home"))
    (tmp_path / "home" / "profiles").mkdir(parents=True)
    mine = tmp_path / "home" / "profiles" / "host.yaml"
    mine.write_text("name: host\n# my own figures\n")
    r = CliRunner().invoke(app, ["profile", "--quick"])
    assert r.exit_code == 1 and "exists and is not a profile edgellm wrote" in r.stderr, r.output
    assert mine.read_text() == "name: host\n# my own figures\n"
    monkeypatch.setenv("EDGELLM_HOME", str(tmp_path / "home2"))
    (tmp_path / "home2").mkdir()
    (tmp_path / "home2" / "profiles").write_text("")
    r = CliRunner().invoke(app, ["profile", "--quick"])
    assert r.exit_code == 1 and "it is not a folder" in r.stderr, r.output
