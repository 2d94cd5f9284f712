"""`edgellm plan` and the --device / --units options, on a tiny synthetic model and the shipped
profiles; big-core selection on fake sysfs trees built from each shipped profile."""
import json

import pytest
from gguf import GGMLQuantizationType as QT
from typer.testing import CliRunner

from edgellm.cli import app
from edgellm.device.profile import list_profiles, load_profile
from edgellm.device.topology import detect_clusters, select_big
from tests.synthetic import write_tiny_model

runner = CliRunner()
SHIPPED = ("exynos2100", "tensor-g1", "rk3588", "raspberry-pi-5")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("plan") / "tiny.gguf", tensor_type=QT.Q8_0, seed=5).path


@pytest.mark.parametrize("device", SHIPPED)
def test_plan_json_for_every_shipped_profile(tiny, device):
    r = runner.invoke(app, ["plan", "--device", device, "--model", tiny, "--prompt-tokens", "200", "--json"])
    assert r.exit_code == 0, r.output
    j = json.loads(r.stdout)
    assert j["predicted_ttft_ms"] > 0 and j["predicted_decode_tps"] > 0 and j["chunk_tokens"] >= 1
    ops = j["ops"]
    phases = {o["phase"] for o in ops}
    assert {"prefill", "decode"} <= phases <= {"prefill", "decode", "prefill_short"}
    # a short-prefill placement comes with the step length it serves, and only then
    assert ("prefill_short" in phases) == (j["short_prefill_max_tokens"] > 0)
    for o in ops:
        assert o["unit"] in ("neon", "opencl", "npu", "reference") and o["reason"]
        assert o["flops"] >= 0 and o["bytes"] > 0 and o["predicted_ms"] > 0
    units = {u["name"]: u for u in j["units"]}
    prof = load_profile(device)
    assert units["opencl"]["available"] == (prof.gpu is not None)
    assert units["npu"]["available"] == (prof.npu is not None)


def test_plan_text_shows_units_chunk_and_predictions(tiny):
    r = runner.invoke(app, ["plan", "--device", "rk3588", "--model", tiny, "--prompt-tokens", "100"])
    assert r.exit_code == 0, r.output
    for needle in ("units:", "prefill chunk:", "roof:", "prefill:", "decode:", "predicted: TTFT", "reason"):
        assert needle in r.stdout
    assert "assumed from the rk3588 profile" in r.stdout


def test_plan_on_the_host_probes_units(tiny, tmp_path, monkeypatch):
    # a fresh home: no measured host profile (one written by `edgellm profile` on a machine with
    # PoCL lists that OpenCL device)
    monkeypatch.setenv("EDGELLM_HOME", str(tmp_path / "home"))
    r = runner.invoke(app, ["plan", "--model", tiny, "--json"])
    assert r.exit_code == 0, r.output
    j = json.loads(r.stdout)
    units = {u["name"]: u for u in j["units"]}
    assert {o["unit"] for o in j["ops"]} <= {n for n, u in units.items() if u["available"]}
    assert not units["opencl"]["available"] and units["opencl"]["reason"]


def test_plan_units_override_warns_for_unsupported_ops(tiny):
    r = runner.invoke(app, ["plan", "--device", "rk3588", "--model", tiny, "--units", "npu", "--json"])
    assert r.exit_code == 0, r.output
    j = json.loads(r.stdout)
    by = {(o["op"], o["phase"]): o["unit"] for o in j["ops"]}
    assert by[("qkv", "prefill")] == "npu" and by[("rope", "prefill")] == "reference"
    assert any("rope" in w for w in j["warnings"])


def test_plan_plot_writes_a_png(tiny, tmp_path):
    out = tmp_path / "roof.png"
    r = runner.invoke(app, ["plan", "--device", "exynos2100", "--model", tiny, "--plot", str(out)])
    assert r.exit_code == 0, r.output
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


@pytest.mark.parametrize("args,needle", [
    (["plan", "--device", "no-such-soc"], "no-such-soc"),
    (["plan", "--units", "tpu"], "unknown unit"),
    (["plan", "--prompt-tokens", "0"], "prompt-tokens"),
    (["plan", "--ctx", "0"], "--ctx must be >= 1"),            # accepted before (n_ctx = max(ctx, prompt))
    (["plan", "--ctx", "-5"], "--ctx must be >= 1"),
    (["plan", "--prompt-tokens", "300"], "trained context of 256"),   # past the trained context
    (["run", "hi", "--units", "gpu9"], "unknown unit"),
])
def test_plan_and_run_errors_are_one_line(tiny, args, needle):
    r = runner.invoke(app, [*args, "--model", tiny])
    assert r.exit_code == 1
    assert needle in r.stderr and "Traceback" not in r.output


def test_plan_caps_ctx_at_the_trained_context_as_run_does(tiny):
    """plan predicted for a context the model was not trained for, while load() caps it."""
    r = runner.invoke(app, ["plan", "--model", tiny, "--ctx", "9000", "--prompt-tokens", "100", "--device", "rk3588",
                            "--json"])
    assert r.exit_code == 0, r.output
    assert "trained context: using 256" in r.stderr
    capped = runner.invoke(app, ["plan", "--model", tiny, "--ctx", "256", "--prompt-tokens", "100", "--device",
                                 "rk3588", "--json"])
    assert json.loads(r.stdout) == json.loads(capped.stdout)


def test_run_with_units_and_device(tiny):
    r = runner.invoke(app, ["run", "hi", "--model", tiny, "-n", "3", "--temperature", "0", "--device", "rk3588",
                            "--units", "reference", "--no-stats"])
    assert r.exit_code == 0, r.output


@pytest.mark.parametrize("device,big", [("exynos2100", {4, 5, 6, 7}), ("tensor-g1", {6, 7}),
                                         ("rk3588", {4, 5, 6, 7}), ("raspberry-pi-5", {0, 1, 2, 3})])
def test_fake_sysfs_of_each_shipped_soc_picks_its_big_cores(tmp_path, device, big):
    """The sysfs tree a kernel on that SoC shows (max frequency, and cpu_capacity where the
    profile knows it), written from the shipped profile; detection must find the big cores."""
    prof = load_profile(device)
    assert device in list_profiles()
    for c in prof.clusters:
        for cpu in c.cores:
            d = tmp_path / f"cpu{cpu}"
            (d / "cpufreq").mkdir(parents=True)
            (d / "cpufreq" / "cpuinfo_max_freq").write_text(f"{round(c.max_freq_hz / 1e3)}\n")
            if c.capacity is not None:
                (d / "cpu_capacity").write_text(f"{c.capacity}\n")
    all_cores = {cpu for c in prof.clusters for cpu in c.cores}
    clusters = detect_clusters(str(tmp_path), online=all_cores)
    assert len(clusters) == len(prof.clusters)
    assert set(select_big(clusters)) == big
    assert set(select_big(prof.clusters)) == big          # the cost model's view agrees


def test_plan_warns_when_the_model_does_not_fit_the_devices_memory(tiny, tmp_path):
    """A profile with 16 KiB of memory got a full prediction and a silent 16 MiB chunk budget
    (a probe: 64 MiB against a 140 MiB load)."""
    from edgellm.device.profile_yaml import shipped_profiles_dir

    text = (shipped_profiles_dir() / "rk3588.yaml").read_text().replace("total: 16 GiB", "total: 16 KiB")
    small = tmp_path / "small.yaml"
    small.write_text(text)
    r = runner.invoke(app, ["plan", "--device", str(small), "--model", tiny, "--prompt-tokens", "32"])
    assert r.exit_code == 0, r.output
    assert "more than half of" in r.stderr and "may not load there" in r.stderr
    r = runner.invoke(app, ["plan", "--device", "rk3588", "--model", tiny, "--prompt-tokens", "32"])
    assert "may not load there" not in r.stderr


def test_plan_says_what_run_says_of_a_profile_measured_on_other_cores(tiny, tmp_path, monkeypatch, caplog):
    """`run` warned that host.yaml was measured on cores [0, 1, 2, 3] while this process may run
    on [0, 1]; `plan`, which plans the same threads from the same figures, said nothing (a probe)."""
    import logging
    from dataclasses import replace

    from edgellm.device.host import estimate_host_profile
    from edgellm.device.profile import Measured
    from edgellm.device.profile_yaml import write_profile
    from edgellm.device.topology import current_affinity

    monkeypatch.setenv("EDGELLM_HOME", str(tmp_path / "home"))
    est = estimate_host_profile()
    usable = sorted(current_affinity())
    other = [*usable, max(c for cl in est.clusters for c in cl.cores) + 1]   # one core more than here
    clusters = (replace(est.clusters[0], cores=tuple(other)),)
    m = Measured(date="2026-11-28", tool="edgellm profile (test)", memory_read_bandwidth=20e9, clusters={})
    write_profile(replace(est, name="host", clusters=clusters, measured=m), tmp_path / "home" / "profiles" / "host.yaml")
    with caplog.at_level(logging.WARNING, logger="edgellm"):
        r = runner.invoke(app, ["plan", "--model", tiny, "--json"])
    assert r.exit_code == 0, r.output
    said = [x.getMessage() for x in caplog.records]
    assert f"profile host was measured on cores {other}, but this process may run on {usable}: its figures may " \
           f"not fit (run `edgellm profile` again under this process's cores)" in said, said
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="edgellm"):   # another device's plan is that device's
        assert runner.invoke(app, ["plan", "--device", "rk3588", "--model", tiny, "--json"]).exit_code == 0
    assert not [x for x in caplog.records if "measured on cores" in x.getMessage()]
