"""The profile of the machine we run on: the measured `host` profile when `edgellm profile` has
written one, else an estimate from what the OS reports (topology, ISA flags, caches) with nominal
throughput figures. The estimate is labelled as such wherever it is shown."""
from __future__ import annotations

import logging
import os
import re
from pathlib import Path

from ..errors import ConfigError
from ..procmem import total_bytes
from .profile import CpuCluster, DeviceProfile
from .topology import detect_clusters

log = logging.getLogger("edgellm")

ESTIMATE_NAME = "host-estimate"
# Without a measurement: FLOPs per cycle per core of a 2 x 128-bit FMA machine (Cortex-A76/A78
# class: 8 fp32 FMA lanes), doubled for fp16 and quadrupled for int8 dot products; x86 with AVX2
# and FMA has 2 x 256-bit FMA ports. DRAM bandwidth: a conservative LPDDR4X phone figure.
_FLOP_PER_CYCLE = {"fp32": 16, "fp16": 32, "int8": 64}
_NOMINAL_BANDWIDTH = 10e9
_NOMINAL_FREQ = 2.0e9
_ARM_FLAGS = {"asimd": "neon", "asimddp": "dotprod", "asimdhp": "fp16", "i8mm": "i8mm"}
_X86_FLAGS = {"avx2": "avx2", "fma": "fma", "avx512f": "avx512f", "f16c": "f16c"}


def host_profile() -> DeviceProfile:
    """The measured host profile if there is one, else the estimate (logged once)."""
    from .profile import load_profile
    from .profile_yaml import user_profiles_dir

    path = user_profiles_dir() / "host.yaml"
    # decided by the file's presence, not by an error's text: a host.yaml that is a folder, a
    # dangling link, or holds a value mentioning "edgellm profile" fell back to the estimate unsaid
    if os.path.lexists(path):
        prof = load_profile(path)   # a host profile that exists but is broken is an error
        _warn_if_another_machine(prof)
        return prof
    log.info("no measured host profile; using estimated figures (run `edgellm profile` to measure)")
    return estimate_host_profile()


def _warn_if_another_machine(prof: DeviceProfile) -> None:
    """The host profile describes this machine's CPU, as `edgellm profile` wrote it (the model name
    and the instruction-set features it read here). A copy of another device's (rk3588.yaml saved
    as host.yaml, a phone's Cortex-X1 profile on an x86 host) was planned from without a word."""
    info = _cpuinfo()
    here_model, here_feats = _model_name(info), _features(info)
    theirs = [c for c in prof.clusters if c.microarch != here_model or (c.features and c.features != here_feats)]
    if info and theirs:
        c = theirs[0]
        log.warning("the host profile %s describes another CPU (%s, features %s), not this machine's (%s, "
                    "features %s): its figures do not fit (run `edgellm profile` to measure this one)",
                    prof.source or prof.name, c.microarch, ",".join(sorted(c.features)) or "none", here_model,
                    ",".join(sorted(here_feats)) or "none")


def another_machine(prof: DeviceProfile) -> str | None:
    """How `prof` differs from this machine when it cannot describe it: it names instruction-set
    features this CPU lacks (a phone's neon and dotprod on an x86 host), or a different number of
    cores. None when it may describe it (this machine's own profile, or a shipped one run on that
    very board), or when /proc/cpuinfo cannot say. Looser than _warn_if_another_machine's rule:
    a shipped profile names the core (cortex-a76), not the model name this machine reports."""
    info = _cpuinfo()
    if not info:
        return None
    lacks = sorted({f for c in prof.clusters for f in c.features} - _features(info))
    n_prof, n_here = len({i for c in prof.clusters for i in c.cores}), os.cpu_count() or 0
    if lacks:
        return f"it names {', '.join(lacks)}, which this CPU lacks"
    if n_prof != n_here:
        return f"it has {n_prof} cores, this machine {n_here}"
    return None


def machine_name() -> str:
    """This machine's CPU in a few words: "AMD EPYC, 2 cores"."""
    return f"{_model_name(_cpuinfo())}, {os.cpu_count() or '?'} cores"


def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return ""


def _features(info: str) -> frozenset[str]:
    m = re.search(r"^(?:flags|Features)\s*:\s*(.*)$", info, re.M)
    flags = set(m.group(1).split()) if m else set()
    table = {**_ARM_FLAGS, **_X86_FLAGS}
    return frozenset(table[f] for f in flags if f in table)


def _model_name(info: str) -> str:
    for key in ("model name", "Model", "Hardware", "CPU part"):
        m = re.search(rf"^{key}\s*:\s*(.+)$", info, re.M)
        if m:
            return m.group(1).strip()
    return os.uname().machine


def _cache_sizes(cpu: int, root: str = "/sys/devices/system/cpu") -> dict[str, int]:
    """{"l1d": bytes, "l2": ..., "l3": ...} from sysfs; missing levels are 0."""
    out = {"l1d": 0, "l2": 0, "l3": 0}
    for idx in sorted(Path(root, f"cpu{cpu}", "cache").glob("index*")):
        try:
            level = (idx / "level").read_text().strip()
            kind = (idx / "type").read_text().strip()
            size = (idx / "size").read_text().strip()
        except OSError:
            continue
        m = re.fullmatch(r"(\d+)([KMG]?)", size)
        if not m:
            continue
        nbytes = int(m.group(1)) * {"": 1, "K": 1024, "M": 2**20, "G": 2**30}[m.group(2)]
        if level == "1" and kind in ("Data", "Unified"):
            out["l1d"] = nbytes
        elif level in ("2", "3"):
            out["l" + level] = nbytes
    return out


def estimate_host_profile() -> DeviceProfile:
    info = _cpuinfo()
    feats = _features(info)
    wide = 2 if {"avx2", "fma"} <= feats else 1     # 256-bit FMA ports do twice a 128-bit core's work
    clusters = []
    for i, c in enumerate(detect_clusters()):
        f = c.max_freq_hz or _cpu_mhz(info) or _NOMINAL_FREQ
        caches = _cache_sizes(c.cores[0])
        clusters.append(CpuCluster(
            name=f"cluster{i}" if i else "big", cores=c.cores, microarch=_model_name(info), max_freq_hz=f,
            features=feats, peak_per_core={p: n * wide * f for p, n in _FLOP_PER_CYCLE.items()},
            l1d_bytes=caches["l1d"], l2_bytes=caches["l2"], l3_bytes=caches["l3"], capacity=c.capacity))
    return DeviceProfile(name=ESTIMATE_NAME, soc=f"this machine ({_model_name(info)}), estimated",
                         memory_total_bytes=total_bytes(), memory_bandwidth=_NOMINAL_BANDWIDTH,
                         clusters=tuple(clusters), gpu=None, npu=None, source="estimated at run time")


def _cpu_mhz(info: str) -> float | None:
    m = re.search(r"^cpu MHz\s*:\s*([\d.]+)", info, re.M)
    return float(m.group(1)) * 1e6 if m else None
