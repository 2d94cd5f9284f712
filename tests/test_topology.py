"""CPU topology (edgellm/device/topology.py): cluster detection and big-core selection on fake
sysfs trees of real SoCs, and thread pinning on this machine.

Trees pass `online=` the full set so the host's own affinity does not matter. Frequencies are the
SoCs' maximum clocks in kHz (as cpuinfo_max_freq holds them). cpu_capacity is what the kernel
shows: capacity-dmips-mhz from the device tree, scaled by each core's max frequency when the DT
gives the CPUs clocks (normalised so the fastest core is 1024), unscaled when it does not.
"""
from __future__ import annotations

import os
import threading

import pytest

from edgellm.device import topology
from edgellm.device.topology import (DetectedCluster, big_cluster_cores, current_affinity,
                                     default_threads, detect_clusters, pin_threads, select_big)

linux_only = pytest.mark.skipif(
    not (hasattr(os, "sched_setaffinity") and os.path.isdir("/proc/self/task")),
    reason="pinning needs Linux sched_setaffinity and /proc")

# cpu -> (cpuinfo_max_freq kHz or None, cpu_capacity or None)
# Exynos 2100: 4x A55 2.0 GHz, 3x A78 2.8 GHz, 1x X1 2.91 GHz. No upstream DT: capacities are
# illustrative, scaled as Linux does from assumed dmips-mhz 250 / 820 / 1024.
EXYNOS_2100 = {**{c: (2002000, 172) for c in range(4)},
               **{c: (2800000, 789) for c in (4, 5, 6)}, 7: (2910000, 1024)}
# The same by clock alone, with the A55 at the 2.2 GHz of some listings (0.76 of the X1).
EXYNOS_2100_FREQ_ONLY = {c: (2200000 if c < 4 else khz, None)
                         for c, (khz, _) in EXYNOS_2100.items()}
# Google Tensor G1 (gs101.dtsi: capacity-dmips-mhz A55 250, A76 620, X1 1024).
G1_FREQ = {**{c: 1803000 for c in range(4)}, 4: 2253000, 5: 2253000, 6: 2802000, 7: 2802000}
G1_FREQ_ONLY = {c: (f, None) for c, f in G1_FREQ.items()}
G1_UNSCALED = {c: (f, (250, 620, 1024)[(c >= 4) + (c >= 6)]) for c, f in G1_FREQ.items()}
# Scaled by max frequency: A55 250*1.803/(1024*2.802)*1024 = 160, A76 620*2.253/2.802 = 498.
G1_SCALED = {c: (f, (160, 498, 1024)[(c >= 4) + (c >= 6)]) for c, f in G1_FREQ.items()}
# RK3588: 4x A55 1.8 GHz, 4x A76 2.4 GHz (rk3588s.dtsi capacity-dmips-mhz 530 / 1024, unscaled).
RK3588 = {**{c: (1800000, 530) for c in range(4)}, **{c: (2400000, 1024) for c in range(4, 8)}}
PI5 = {c: (2400000, 1024) for c in range(4)}          # 4x A76 2.4 GHz, one cluster
EVERYTHING = frozenset(range(64))


def make_tree(root, cpus: dict[int, tuple[object, object]]) -> str:
    """Write cpuN/cpufreq/cpuinfo_max_freq and cpuN/cpu_capacity (None: leave the file out)."""
    for name in ("cpufreq", "cpuidle", "vulnerabilities", "hotplug"):   # real non-cpu entries
        (root / name).mkdir(exist_ok=True)
    (root / "online").write_text(f"0-{max(cpus)}\n")
    (root / "kernel_max").write_text("8191\n")
    for cpu, (khz, capacity) in cpus.items():
        d = root / f"cpu{cpu}"
        d.mkdir()
        if khz is not None:
            (d / "cpufreq").mkdir()
            (d / "cpufreq" / "cpuinfo_max_freq").write_text(f"{khz}\n")
        if capacity is not None:
            (d / "cpu_capacity").write_text(f"{capacity}\n")
    return str(root)


@pytest.mark.parametrize("soc, clusters, big", [
    (EXYNOS_2100, [(7,), (4, 5, 6), (0, 1, 2, 3)], (4, 5, 6, 7)),
    (EXYNOS_2100_FREQ_ONLY, [(7,), (4, 5, 6), (0, 1, 2, 3)], (4, 5, 6, 7)),
    # by clock the A76 is 2.253/2.802 = 0.80 of the X1 and the A55 0.64, so the 0.6 rule alone
    # would keep the A55 too: the lowest-clocked cluster is dropped as LITTLE. Unscaled
    # capacity puts the A76 at 620/1024 = 0.605 of the X1: kept.
    (G1_FREQ_ONLY, [(6, 7), (4, 5), (0, 1, 2, 3)], (4, 5, 6, 7)),
    (G1_UNSCALED, [(6, 7), (4, 5), (0, 1, 2, 3)], (4, 5, 6, 7)),
    # Deliberate: with the kernel's frequency-scaled capacity the A76 is 498/1024 = 0.49 of the
    # X1, below the 0.5 at which 2 A76 threads beside 2 X1 threads pay for themselves under an
    # even split of the work, so only the X1 pair is used.
    (G1_SCALED, [(6, 7), (4, 5), (0, 1, 2, 3)], (6, 7)),
    (RK3588, [(4, 5, 6, 7), (0, 1, 2, 3)], (4, 5, 6, 7)),
    (PI5, [(0, 1, 2, 3)], (0, 1, 2, 3)),
], ids=["exynos2100", "exynos2100-freq", "tensor-g1-freq", "tensor-g1-dmips", "tensor-g1-scaled",
        "rk3588", "pi5"])
def test_socs(tmp_path, soc, clusters, big):
    root = make_tree(tmp_path, soc)
    found = detect_clusters(root, online=EVERYTHING)
    assert [c.cores for c in found] == clusters            # fastest first
    assert select_big(found) == big
    assert big_cluster_cores(root, online=EVERYTHING) == big
    assert default_threads(root, online=EVERYTHING) == len(big)


def test_units_and_fields(tmp_path):
    found = detect_clusters(make_tree(tmp_path, RK3588), online=range(8))
    assert found == (DetectedCluster((4, 5, 6, 7), 2.4e9, 1024),
                     DetectedCluster((0, 1, 2, 3), 1.8e9, 530))


def test_capacity_only(tmp_path):
    # no cpufreq driver: capacity alone still separates the clusters
    root = make_tree(tmp_path, {c: (None, cap) for c, (_, cap) in RK3588.items()})
    found = detect_clusters(root, online=EVERYTHING)
    assert [(c.cores, c.max_freq_hz) for c in found] == [((4, 5, 6, 7), None), ((0, 1, 2, 3), None)]
    assert select_big(found) == (4, 5, 6, 7)


def test_nothing_known_is_one_cluster_of_all(tmp_path):
    root = make_tree(tmp_path, {c: (None, None) for c in range(6)})
    found = detect_clusters(root, online=EVERYTHING)
    assert found == (DetectedCluster(tuple(range(6)), None, None),)
    assert select_big(found) == tuple(range(6))
    assert default_threads(root, online=EVERYTHING) == 6


def test_x86_like_tree(tmp_path):
    # x86 VMs: cpu_capacity 1024 everywhere, no cpufreq directory at all
    root = make_tree(tmp_path, {c: (None, 1024) for c in range(4)})
    (tmp_path / "cpu0" / "cache").mkdir()
    (tmp_path / "smt").mkdir()
    assert detect_clusters(root, online=EVERYTHING) == (DetectedCluster((0, 1, 2, 3), None, 1024),)
    assert big_cluster_cores(root, online=EVERYTHING) == (0, 1, 2, 3)


@pytest.mark.parametrize("junk", ["", "abc\n", "-5\n", "0\n", "1e3\n", "9" * 5000, b"\xff\xfe\x00"],
                         ids=["empty", "text", "negative", "zero", "float", "huge", "binary"])
@pytest.mark.parametrize("name", ["cpu_capacity", "cpufreq/cpuinfo_max_freq"])
def test_garbage_in_one_file_is_unknown_and_filled_from_siblings(tmp_path, junk, name):
    root = make_tree(tmp_path, RK3588)
    path = tmp_path / "cpu5" / name
    path.write_bytes(junk) if isinstance(junk, bytes) else path.write_text(junk)
    # cpu5 shares its other figure with cpu4/6/7, which agree on this one: it takes theirs
    # rather than forming a cluster of its own
    found = detect_clusters(root, online=EVERYTHING)
    assert [c.cores for c in found] == [(4, 5, 6, 7), (0, 1, 2, 3)]
    assert select_big(found) == (4, 5, 6, 7)


def test_garbage_everywhere_never_crashes(tmp_path):
    root = make_tree(tmp_path, {c: ("x", "y") for c in range(4)})
    (tmp_path / "cpu4" / "cpufreq").mkdir(parents=True)
    (tmp_path / "cpu4" / "cpufreq" / "cpuinfo_max_freq").mkdir()   # a directory, not a file
    (tmp_path / "cpu4" / "cpu_capacity").symlink_to(tmp_path / "nowhere")
    found = detect_clusters(root, online=EVERYTHING)
    assert found == (DetectedCluster((0, 1, 2, 3, 4), None, None),)
    assert select_big(found) == (0, 1, 2, 3, 4)


def test_uniform_capacity_ranks_by_clock(tmp_path):
    # a device tree without capacity-dmips-mhz: the kernel gives every core 1024
    root = make_tree(tmp_path, {c: (khz, 1024) for c, (khz, _) in RK3588.items()})
    assert big_cluster_cores(root, online=EVERYTHING) == (4, 5, 6, 7)


def test_favoured_core_turbo_is_not_big_little(tmp_path):
    # x86 with per-core max turbo (5.7 vs 5.5 GHz) and no cpu_capacity: one design, all cores
    root = make_tree(tmp_path, {c: (5700000 if c < 2 else 5500000, None) for c in range(8)})
    assert len(detect_clusters(root, online=EVERYTHING)) == 2
    assert big_cluster_cores(root, online=EVERYTHING) == tuple(range(8))


def test_one_core_with_no_figures_is_left_out(tmp_path):
    soc = dict(RK3588)
    soc[8] = (None, None)       # nothing readable: it may be a LITTLE core, so it is not used
    found = detect_clusters(make_tree(tmp_path, soc), online=EVERYTHING)
    assert [c.cores for c in found] == [(4, 5, 6, 7), (0, 1, 2, 3), (8,)]
    assert select_big(found) == (4, 5, 6, 7)


def test_online_filters_offline_and_unlisted_cpus(tmp_path):
    root = make_tree(tmp_path, EXYNOS_2100)
    # cpu4/cpu5 offline, cpu9 not in sysfs at all: the A78 left (cpu6) is still big
    found = detect_clusters(root, online={0, 1, 2, 3, 6, 7, 9})
    assert [c.cores for c in found] == [(7,), (6,), (0, 1, 2, 3)]
    assert select_big(found) == (6, 7)
    assert default_threads(root, online={0, 1, 2, 3, 6, 7, 9}) == 2
    # restricted to the LITTLE cores, they are the best there is
    assert big_cluster_cores(root, online={0, 1}) == (0, 1)


def test_default_online_is_this_process_affinity(tmp_path):
    allowed = current_affinity()
    root = make_tree(tmp_path, {c: (2400000, 1024) for c in range(max(allowed) + 3)})
    found = detect_clusters(root)
    assert found == (DetectedCluster(tuple(sorted(allowed)), 2.4e9, 1024),)
    assert default_threads(root) == len(allowed)


def test_no_cpu_dirs_falls_back_to_one_cluster_of_the_allowed_set(tmp_path):
    assert detect_clusters(str(tmp_path), online={0, 1, 2}) == (
        DetectedCluster((0, 1, 2), None, None),)
    missing = str(tmp_path / "no-such-dir")
    assert detect_clusters(missing) == (
        DetectedCluster(tuple(sorted(current_affinity())), None, None),)
    assert default_threads(missing) == len(current_affinity())


def test_select_big_takes_profile_clusters_and_nothing():
    from edgellm.device.profile import CpuCluster

    def cluster(name, cores, ghz, capacity):
        return CpuCluster(name=name, cores=cores, microarch="", max_freq_hz=ghz * 1e9,
                          features=frozenset(), peak_per_core={}, l1d_bytes=0, l2_bytes=0,
                          l3_bytes=0, capacity=capacity)

    assert select_big([cluster("little", (0, 1, 2, 3), 1.8, 530),
                       cluster("big", (4, 5, 6, 7), 2.4, 1024)]) == (4, 5, 6, 7)
    assert select_big([cluster("little", (0, 1, 2, 3), 1.8, None),      # clock only
                       cluster("big", (4, 5, 6, 7), 3.0, None)]) == (4, 5, 6, 7)
    assert select_big([]) == ()


# ---- pinning, on this machine ------------------------------------------------------------------

def _all_affinities() -> dict[int, frozenset[int]]:
    out = {}
    for tid in (int(t) for t in os.listdir("/proc/self/task")):
        try:
            out[tid] = frozenset(os.sched_getaffinity(tid))
        except ProcessLookupError:
            pass
    return out


def _unchanged(before: dict[int, frozenset[int]]) -> bool:
    # a thread joined by an earlier test may linger in /proc for a moment: compare the threads
    # present in both snapshots (the main thread always among them)
    after = _all_affinities()
    common = before.keys() & after.keys()
    return threading.get_native_id() in common and all(after[t] == before[t] for t in common)


@pytest.fixture
def restore_affinity():
    saved = _all_affinities()
    yield saved
    for tid, cores in saved.items():
        try:
            os.sched_setaffinity(tid, cores)
        except ProcessLookupError:
            pass


@pytest.fixture
def workers(restore_affinity):
    """Three idle threads started before pinning, as BLAS workers would be."""
    stop = threading.Event()
    started = [threading.Event() for _ in range(3)]
    threads = [threading.Thread(target=lambda e=e: (e.set(), stop.wait()), daemon=True)
               for e in started]
    for t in threads:
        t.start()
    for e in started:
        e.wait()
    yield threads
    stop.set()
    for t in threads:
        t.join()


@linux_only
def test_pin_to_current_affinity(workers):
    assert len(_all_affinities()) >= 1 + len(workers)
    want = current_affinity()
    result = pin_threads(want)
    assert result.ok, result.reason
    assert result.requested == result.readback == want
    assert result.mismatched == 0 and result.reason == ""
    assert result.threads >= 1 + len(workers)
    assert all(v == want for v in _all_affinities().values())


@linux_only
def test_pin_to_one_core_pins_existing_threads_and_new_ones_inherit(workers):
    core = min(current_affinity())
    result = pin_threads([core])
    assert result.ok, result.reason
    assert result.readback == {core}
    for t in workers:
        assert os.sched_getaffinity(t.native_id) == {core}
    seen = []
    late = threading.Thread(target=lambda: seen.append(os.sched_getaffinity(0)))
    late.start()
    late.join()
    assert seen == [{core}]


@linux_only
def test_pin_to_missing_core_fails_and_changes_nothing(workers):
    before = _all_affinities()
    result = pin_threads({4096})
    assert not result.ok
    assert "4096" in result.reason and "not available" in result.reason
    assert result.threads == 0
    assert result.readback == current_affinity() == before[threading.get_native_id()]
    assert _unchanged(before)


@linux_only
def test_pin_partly_missing_is_rolled_back(workers):
    # the kernel accepts {c, 4096} and silently keeps {c}: the read-back catches it
    before = _all_affinities()
    core = min(current_affinity())
    result = pin_threads({core, 4096})
    assert not result.ok
    assert result.mismatched >= 1 + len(workers)    # every thread read back, then put back
    assert "cores {4096} are not available" in result.reason
    assert _unchanged(before)


@linux_only
def test_pin_failure_midway_rolls_back(workers, monkeypatch):
    before = _all_affinities()
    real = os.sched_setaffinity
    calls = []

    def flaky(tid, cores):
        calls.append(tid)
        if len(calls) == 2:
            raise PermissionError(1, "Operation not permitted")
        real(tid, cores)

    monkeypatch.setattr(os, "sched_setaffinity", flaky)
    result = pin_threads({min(current_affinity())})
    monkeypatch.undo()
    assert not result.ok and "Operation not permitted" in result.reason
    assert len(calls) > 2                       # the first thread was pinned, then put back
    assert _unchanged(before)


@linux_only
def test_vanished_threads_are_skipped(workers, monkeypatch):
    gone = threading.Thread(target=lambda: None)
    gone.start()
    gone.join()
    real_ids = topology._thread_ids()
    monkeypatch.setattr(topology, "_thread_ids", lambda: real_ids + [gone.native_id, 2 ** 30])
    want = current_affinity()
    result = pin_threads(want)
    assert result.ok, result.reason
    # `gone` may still have been listed in real_ids a moment after join(); it is skipped too
    assert 1 + len(workers) <= result.threads <= len(real_ids)


@linux_only
@pytest.mark.parametrize("cores", [[], [-1]])
def test_pin_invalid_request(cores, restore_affinity):
    result = pin_threads(cores)
    assert not result.ok and "invalid core set" in result.reason
    assert _unchanged(restore_affinity)        # nothing was touched


def test_pin_without_affinity_api(monkeypatch):
    monkeypatch.delattr(os, "sched_setaffinity", raising=False)
    result = pin_threads({0})
    assert not result.ok and "no sched_setaffinity" in result.reason
    assert result.threads == 0


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs two cores to pin a thread to one of them")
def test_current_affinity_is_the_process_not_the_calling_thread():
    """An app that loads from a worker thread it pinned to one core gave the engine that core
    alone (and pin_threads then moved every thread of the process onto it)."""
    import threading
    from edgellm.device.topology import current_affinity
    whole, got = frozenset(os.sched_getaffinity(0)), []

    def worker():
        os.sched_setaffinity(0, {min(whole)})
        got.append(current_affinity())

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert got == [whole]
