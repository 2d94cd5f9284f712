"""`edgellm bench --device rk3588` on another machine times this machine on the plan made for the
RK3588, and said only "profile rk3588": the figures read as the RK3588's (a probe). The header
now says so, and the JSON record carries the profile and whether it may describe this machine;
the default host profile adds no words."""
import json

import pytest
from gguf import GGMLQuantizationType as QT
from typer.testing import CliRunner

from edgellm.cli import app
from edgellm.device import host
from edgellm.device.profile import load_profile

from .synthetic import write_tiny_model

runner = CliRunner()
X86 = "processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu sse2 avx2 fma f16c\n"
RK3588 = "processor\t: 0\nFeatures\t: fp asimd aes crc32 atomics fphp asimdhp asimddp\nCPU part\t: 0xd05\n"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("dev") / "tiny.gguf", tensor_type=QT.Q8_0, seed=3,
                            context_length=512).path


def test_another_devices_profile_is_told_from_this_machines(monkeypatch):
    rk = load_profile("rk3588")
    monkeypatch.setattr(host, "_cpuinfo", lambda: X86)
    assert "neon" in host.another_machine(rk)
    assert host.another_machine(host.estimate_host_profile()) is None
    # on the board itself, the shipped profile is this machine's (its cpuinfo names no cortex-a76)
    monkeypatch.setattr(host, "_cpuinfo", lambda: RK3588)
    monkeypatch.setattr(host.os, "cpu_count", lambda: 8)
    assert host.another_machine(rk) is None
    monkeypatch.setattr(host.os, "cpu_count", lambda: 4)          # a Raspberry Pi 5's four A76s
    assert host.another_machine(rk) == "it has 8 cores, this machine 4"
    monkeypatch.setattr(host, "_cpuinfo", lambda: "")             # no /proc/cpuinfo: nothing to say
    assert host.another_machine(rk) is None


@pytest.mark.parametrize("device", [None, "rk3588"])
def test_bench_says_whose_figures_it_prints(tiny, tmp_path, monkeypatch, device):
    monkeypatch.setenv("EDGELLM_HOME", str(tmp_path / "home"))   # the estimated host profile
    monkeypatch.setattr(host, "_cpuinfo", lambda: X86)
    out = tmp_path / "b.json"
    r = runner.invoke(app, ["bench", "--model", tiny, "--prompt-tokens", "8", "--gen-tokens", "2", "--runs", "1",
                            "--no-floor", "--units", "neon,reference", "--json", str(out),
                            *(["--device", device] if device else [])])
    assert r.exit_code == 0, r.output
    rec = json.loads(out.read_text())[0]
    header = next(ln for ln in r.stderr.splitlines() if ln.startswith("model "))
    if device is None:
        assert rec["profile"] == host.ESTIMATE_NAME and rec["profile_of_this_machine"] is True
        assert "ANOTHER" not in r.stderr and "not this machine" not in r.stderr
    else:
        assert rec["profile"] == "rk3588" and rec["profile_of_this_machine"] is False
        assert "profile rk3588 (ANOTHER DEVICE)" in header
        assert ("the profile rk3588 describes Rockchip RK3588, not this machine (it names dotprod, fp16, neon, "
                "which this CPU lacks): the figures below are this machine's (AMD EPYC, ") in r.stderr
