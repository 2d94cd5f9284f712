"""A host profile edited or broken by hand (from a helper's probe of `edgellm profile`): every
case is a ConfigError naming the field or the file, never a traceback or a silent estimate."""
import os

import pytest
import yaml

from edgellm.device.host import host_profile
from edgellm.device.profile_yaml import load_profile
from edgellm.errors import ConfigError

SHIPPED = os.path.join(os.path.dirname(__file__), "..", "device_profiles", "rk3588.yaml")


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGELLM_HOME", str(tmp_path / "home"))
    (tmp_path / "home" / "profiles").mkdir(parents=True)
    return tmp_path / "home" / "profiles"


def test_a_broken_host_profile_is_an_error_not_the_estimate(home):
    """A host.yaml that is a folder or a dangling link fell back to the estimate without a word."""
    assert "estimate" in host_profile().name                        # none yet: the estimate
    (home / "host.yaml").mkdir()
    with pytest.raises(ConfigError, match="host.yaml: not a regular file"):
        host_profile()
    (home / "host.yaml").rmdir()
    (home / "host.yaml").symlink_to(home / "gone.yaml")
    with pytest.raises(ConfigError, match="host.yaml: no such device profile file"):
        host_profile()


def test_an_upper_case_suffix_is_a_path(tmp_path):
    """`profile --out Upper.YAML` was accepted, and the `--device Upper.YAML` it advised then
    failed as an unknown profile name."""
    p = tmp_path / "Upper.YAML"
    p.write_text(open(SHIPPED).read())
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        assert load_profile("Upper.YAML").soc == load_profile(SHIPPED).soc
    finally:
        os.chdir(cwd)


def test_hand_edited_measured_sections_are_named(tmp_path):
    """An elementwise op given as a list raised TypeError (unhashable); units: false read as no
    units."""
    base = yaml.safe_load(open(SHIPPED).read())
    measured = {"date": "2026-01-01", "tool": "edgellm profile", "memory_read_bandwidth": "10 GB/s",
                "clusters": {c["name"]: {"fp32": "10 GFLOPS"} for c in base["cpu"]["clusters"]}}
    for units, what in (({"reference": {"threads": 1, "call_overhead": "1 us", "gemm": [],
                                        "precision_flops": {"fp32": "1 GFLOPS"},
                                        "elementwise": [{"op": ["rmsnorm"], "tokens": 1, "flops": "1 GFLOPS"}]}},
                         r"elementwise\[0\]\.op"),
                        (False, r"measured\.units")):
        doc = dict(base, measured=dict(measured, units=units))
        p = tmp_path / "edited.yaml"
        p.write_text(yaml.safe_dump(doc))
        with pytest.raises(ConfigError, match=what):
            load_profile(p)


def test_a_profile_measured_on_other_cores_is_said(caplog):
    """`taskset -c 0 edgellm profile` wrote a 1-core profile that an unrestricted run then planned
    2 threads with, without a word (and the reverse)."""
    import logging
    from types import SimpleNamespace

    from edgellm.api import _warn_if_measured_elsewhere
    prof = SimpleNamespace(name="host", measured=object(), clusters=[SimpleNamespace(cores=(0,))])
    with caplog.at_level(logging.WARNING, logger="edgellm"):
        _warn_if_measured_elsewhere(prof, frozenset({0, 1}))
        _warn_if_measured_elsewhere(prof, frozenset({0}))                              # the same cores
        _warn_if_measured_elsewhere(SimpleNamespace(measured=None, clusters=[]), frozenset({0, 1}))  # shipped
    said = [r.getMessage() for r in caplog.records]
    assert said == ["profile host was measured on cores [0], but this process may run on [0, 1]: its figures "
                    "may not fit (run `edgellm profile` again under this process's cores)"]


def test_a_profile_measured_beside_busy_processes_says_so_at_every_load(tmp_path, caplog):
    """`edgellm profile` said "other processes used 81% of the CPUs" but wrote nothing of it: the
    profile then predicted decode at about half the quiet machine's speed, and load() planned
    from it without a word (a probe). The share is kept in the file, and a load warns."""
    import logging
    from dataclasses import replace

    from edgellm.api import _warn_if_measured_elsewhere
    from edgellm.device.host import estimate_host_profile
    from edgellm.device.profile import Measured
    from edgellm.device.profile_yaml import load_profile, write_profile

    est = estimate_host_profile()
    m = Measured(date="2026-11-28", tool="edgellm profile (test)", memory_read_bandwidth=20e9, clusters={},
                 others_cpu_share=0.81)
    busy = load_profile(write_profile(replace(est, name="host", measured=m), tmp_path / "busy.yaml"))
    assert busy.measured.others_cpu_share == 0.81
    quiet = load_profile(write_profile(replace(est, name="host", measured=replace(m, others_cpu_share=0.02)),
                                       tmp_path / "quiet.yaml"))
    old = load_profile(write_profile(replace(est, name="host", measured=replace(m, others_cpu_share=None)),
                                     tmp_path / "old.yaml"))
    assert old.measured.others_cpu_share is None and "others_cpu_share" not in (tmp_path / "old.yaml").read_text()
    usable = frozenset(c for cl in est.clusters for c in cl.cores)
    with caplog.at_level(logging.WARNING, logger="edgellm"):
        for p in (busy, quiet, old):
            _warn_if_measured_elsewhere(p, usable)
    said = [r.getMessage() for r in caplog.records]
    assert said == ["profile busy was measured while other processes used 81% of the CPUs: its figures are "
                    "probably low (run `edgellm profile` again on an idle machine)"], said
    text = (tmp_path / "busy.yaml").read_text().replace("others_cpu_share: 0.81", "others_cpu_share: 3")
    (tmp_path / "bad.yaml").write_text(text)
    import pytest

    from edgellm.errors import ConfigError
    with pytest.raises(ConfigError, match="others_cpu_share"):
        load_profile(tmp_path / "bad.yaml")


def test_a_host_profile_of_another_machine_is_said(tmp_path, monkeypatch, caplog):
    """rk3588.yaml saved as host.yaml (and a phone's Cortex-X1 profile) planned this x86 host as
    that device without a word (a probe). The host profile's CPU is compared with this one's."""
    import logging
    import shutil
    from dataclasses import replace

    from edgellm.device.host import estimate_host_profile, host_profile
    from edgellm.device.profile_yaml import shipped_profiles_dir, write_profile

    monkeypatch.setenv("EDGELLM_HOME", str(tmp_path))
    host_yaml = tmp_path / "profiles" / "host.yaml"
    host_yaml.parent.mkdir(parents=True)
    with caplog.at_level(logging.WARNING, logger="edgellm"):
        write_profile(replace(estimate_host_profile(), name="host"), host_yaml)
        host_profile()
        assert not caplog.records, [r.getMessage() for r in caplog.records]
        shutil.copy(shipped_profiles_dir() / "rk3588.yaml", host_yaml)
        host_profile()
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "describes another CPU" in said[0] and "run `edgellm profile`" in said[0], said
