"""Device profiles: unit parsing, validation (each error names file and field), name lookup,
the shipped profiles, and dump/write round trips."""
import copy
import dataclasses
import re
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edgellm.device.profile import (
    AttentionFigure, DeviceProfile, ElementwiseFigure, GemmFigure, Measured, UnitMeasurement, dump_profile,
    list_profiles, load_profile, parse_quantity, write_profile,
)
from edgellm.device.profile_yaml import (
    MAX_PROFILE_BYTES, _profile_from_text, format_quantity, shipped_profiles_dir,
)
from edgellm.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = ("exynos2100", "raspberry-pi-5", "rk3588", "tensor-g1")


@pytest.fixture(autouse=True)
def _home(tmp_path, monkeypatch):
    """Keep the user's own $EDGELLM_HOME/profiles (a real `host`) out of every test."""
    monkeypatch.setenv("EDGELLM_HOME", str(tmp_path / "home"))


def _shipped_dict(name="rk3588") -> dict:
    return yaml.safe_load((shipped_profiles_dir() / f"{name}.yaml").read_text())


# -- units -------------------------------------------------------------------------------------


@pytest.mark.parametrize("text, kind, value", [
    ("64 KiB", "size", 65536), ("1 MiB", "size", 1 << 20), ("8 GiB", "size", 8 << 30),
    ("4 GB", "size", 4e9), ("512 B", "size", 512), ("3 KB", "size", 3000),
    ("51.2 GB/s", "bandwidth", 51.2e9), ("800 MB/s", "bandwidth", 800e6), ("2 GiB/s", "bandwidth", 2 << 30),
    ("2.84 GHz", "frequency", 2.84e9), ("1800 MHz", "frequency", 1.8e9),
    ("20 us", "time", 20e-6), ("20 \u00b5s", "time", 20e-6), ("0.5 ms", "time", 5e-4), ("1 s", "time", 1.0),
    ("38.4 GFLOPS", "compute", 38.4e9), ("1.2 TFLOPS", "compute", 1.2e12), ("26 TOPS", "compute", 26e12),
    ("153.6 GOPS", "compute", 153.6e9), ("1e3 MHz", "frequency", 1e9), ("51.2GB/s", "bandwidth", 51.2e9),
])
def test_parse_quantity_to_si(text, kind, value):
    assert parse_quantity(text, kind, "x.yaml: f") == pytest.approx(value, rel=1e-12)


@pytest.mark.parametrize("text, kind, found", [
    ("51.2 GHz", "bandwidth", "GHz is a frequency unit"),       # wrong kind
    ("64 KiB/s", "size", "KiB/s is a bandwidth unit"),
    ("2.4 GB/s", "frequency", "GB/s is a bandwidth unit"),
    ("38.4 GB/s", "compute", "GB/s is a bandwidth unit"),
    ("20 MHz", "time", "MHz is a frequency unit"),
    (51.2, "bandwidth", "bare number 51.2"),                     # bare numbers
    (64, "size", "bare number 64"),
    ("64", "size", "'64'"),
    ("51.2 GBps", "bandwidth", "unknown unit 'GBps'"),           # unknown units
    ("51.2 Gb/s", "bandwidth", "unknown unit 'Gb/s'"),          # gigabits are not bytes
    ("2 ghz", "frequency", "unknown unit 'ghz'"),
    ("-1 GB/s", "bandwidth", "must be > 0"),
    ("0 GHz", "frequency", "must be > 0"),
    ("1e-999 GB/s", "bandwidth", "must be at least 1 B/s"),      # rounded to 0.0: a ZeroDivisionError in the plan
    ("1e-300 B/s", "bandwidth", "must be at least 1 B/s"),       # TTFT inf, 'Infinity' in plan --json
    ("1e-999 GFLOPS", "compute", "must be at least 1 FLOPS"),
    ("1e-999 GHz", "frequency", "must be at least 1 Hz"),
    ("0.4 B", "size", "must be at least 1 B"),                   # 0 whole bytes
    ("1e-999 s", "time", "must be at least 0.001 ns"),
    ("fast", "bandwidth", "'fast'"),
    (True, "size", "a boolean"),
    (None, "time", "nothing (null)"),
    (["1 s"], "time", "a list"),
])
def test_parse_quantity_rejects(text, kind, found):
    with pytest.raises(ConfigError) as e:
        parse_quantity(text, kind, "rk3588.yaml: some.field")
    msg = str(e.value)
    assert msg.startswith("rk3588.yaml: some.field: expected a ")
    assert found in msg


def test_parse_quantity_message_names_file_field_expected_and_found():
    with pytest.raises(ConfigError, match=re.escape(
            "rk3588.yaml: memory.bandwidth: expected a bandwidth such as '51.2 GB/s', got '51.2 GHz'")):
        parse_quantity("51.2 GHz", "bandwidth", "rk3588.yaml: memory.bandwidth")


def test_overflow_and_non_finite_values_are_config_errors():
    for text in ("1e999 GB/s", "1e9999 GB/s", "9" * 400 + " GB/s"):
        with pytest.raises(ConfigError, match="expected a bandwidth"):
            parse_quantity(text, "bandwidth", "x.yaml: memory.bandwidth")
    with pytest.raises(ConfigError, match="cannot write nan"):
        format_quantity(float("nan"), "size")


def test_zero_allowed_only_where_asked():
    assert parse_quantity("0 us", "time", "x", allow_zero=True) == 0.0
    with pytest.raises(ConfigError, match="must be >= 0"):
        parse_quantity("-1 us", "time", "x", allow_zero=True)


@pytest.mark.parametrize("value, kind, kw, text", [
    (51.2e9, "bandwidth", {}, "51.2 GB/s"), (2.8e9, "frequency", {}, "2.8 GHz"),
    (1 << 20, "size", {}, "1 MiB"), (12e-6, "time", {}, "12 us"), (96.3e9, "compute", {}, "96.3 GFLOPS"),
    (26e12, "compute", {"ops": True}, "26 TOPS"), (3_000_000, "size", {}, "3 MB"),
    (1000001, "size", {}, "1000001 B"),
    (0, "size", {}, "0 B"), (0.0005, "time", {}, "500 us"),
])
def test_format_quantity_is_readable(value, kind, kw, text):
    assert format_quantity(value, kind, **kw) == text
    assert parse_quantity(text, kind, "x", allow_zero=True) == pytest.approx(value, rel=1e-9)


# -- shipped profiles -------------------------------------------------------------------------


def test_list_profiles_has_the_shipped_four():
    assert set(SHIPPED) <= set(list_profiles())


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_profile_loads_and_is_consistent(name):
    p = load_profile(name)
    assert p.name == name and Path(p.source).name == f"{name}.yaml"
    assert p.memory_total_bytes >= 1 << 30 and 10e9 <= p.memory_bandwidth <= 100e9
    cores = [c for cl in p.clusters for c in cl.cores]
    assert sorted(cores) == list(range(len(cores)))  # ids 0..n-1, each in one cluster
    for c in p.clusters:
        # peaks are derived as FLOP/cycle x max_freq: 8 (A55), 16 (A76/A78), 32 (X1) fp32 FLOP/cycle
        per_cycle = c.peak_per_core["fp32"] / c.max_freq_hz
        assert per_cycle == pytest.approx({"cortex-a55": 8, "cortex-a76": 16, "cortex-a78": 16,
                                           "cortex-x1": 32}[c.microarch], rel=1e-6)
        assert c.peak_per_core["fp16"] == pytest.approx(2 * c.peak_per_core["fp32"], rel=1e-6)
        assert c.peak_per_core["int8"] == pytest.approx(4 * c.peak_per_core["fp32"], rel=1e-6)
        assert {"neon", "fp16", "dotprod"} <= c.features
        assert 0 < c.l1d_bytes < c.l2_bytes < c.l3_bytes
    fastest = max(p.clusters, key=lambda c: c.max_freq_hz)
    assert fastest.cores[-1] == len(cores) - 1  # the big/prime cores have the highest ids
    if p.gpu:
        assert p.gpu.peak["fp16"] == pytest.approx(2 * p.gpu.peak["fp32"], rel=1e-3)
        assert p.gpu.work_group_size % p.gpu.warp_width == 0
    if p.npu:
        assert p.npu.supported_ops == {"matmul"} and p.npu.chunk_buckets == (32, 64, 128, 256)
        assert p.npu.onnx_providers[-1] == "CPUExecutionProvider"


def test_shipped_profile_specifics():
    rk = load_profile("rk3588")
    assert rk.memory_bandwidth == pytest.approx(34.1e9)
    assert [(c.name, c.cores, c.capacity) for c in rk.clusters] == [
        ("little", (0, 1, 2, 3), 397), ("big", (4, 5, 6, 7), 1024)]
    assert rk.npu.peak == {"int8": 6e12} and rk.npu.onnx_providers == ("CPUExecutionProvider",)
    assert rk.npu.tflite_delegate is None
    assert rk.gpu.compute_units == 4
    pi = load_profile("raspberry-pi-5")
    assert pi.gpu is None and pi.npu is None and pi.clusters[0].cores == (0, 1, 2, 3)
    assert pi.clusters[0].max_freq_hz == 2.4e9
    g1 = load_profile("tensor-g1")
    assert [(c.microarch, c.cores, c.capacity) for c in g1.clusters] == [
        ("cortex-a55", (0, 1, 2, 3), 160), ("cortex-a76", (4, 5), 498), ("cortex-x1", (6, 7), 1024)]
    assert g1.gpu.compute_units == 20
    ex = load_profile("exynos2100")
    assert [(c.microarch, c.cores) for c in ex.clusters] == [
        ("cortex-a55", (0, 1, 2, 3)), ("cortex-a78", (4, 5, 6)), ("cortex-x1", (7,))]
    assert ex.npu.peak["int8"] == 26e12 and ex.gpu.compute_units == 14
    for p in (g1, ex):
        assert p.npu.onnx_providers == (
            "NnapiExecutionProvider", "XnnpackExecutionProvider", "CPUExecutionProvider")


_FIGURE = re.compile(r"^\s*(?:- )?(\w+):\s*\[?[-+.\d]")


@pytest.mark.parametrize("name", SHIPPED)
def test_every_shipped_figure_has_a_comment(name):
    """Each figure carries a source comment: on its line, or in the comment block right above a
    run of figures."""
    covered = False
    for n, line in enumerate((shipped_profiles_dir() / f"{name}.yaml").read_text().splitlines(), 1):
        stripped = line.strip()
        if stripped.startswith("#"):
            covered = True
            continue
        m = _FIGURE.match(line)
        if m and m.group(1) != "schema":
            assert "#" in line or covered, f"{name}.yaml line {n} has no source comment: {stripped}"
        elif stripped and "#" not in line:
            covered = False


def test_shipped_profiles_are_packaged():
    """pyproject lists packages explicitly (to map device_profiles/ into the wheel), so a new
    subpackage must be added there; and the profiles must be mapped as package data."""
    tomllib = pytest.importorskip("tomllib")
    conf = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    on_disk = {".".join(d.relative_to(ROOT).parts) for d in (ROOT / "edgellm").rglob("*")
               if d.is_dir() and (d / "__init__.py").exists()} | {"edgellm"}
    assert on_disk <= set(conf["packages"]), f"add {sorted(on_disk - set(conf['packages']))} to pyproject"
    assert conf["package-dir"]["edgellm.device_profiles"] == "device_profiles"
    assert "*.yaml" in conf["package-data"]["edgellm.device_profiles"]
    assert {p.stem for p in (ROOT / "device_profiles").glob("*.yaml")} == set(SHIPPED)


# -- validation: each error names the file and the field ----------------------------------------


def _gpu(d):
    return d["gpu"]


def _cl(d, i=0):
    return d["cpu"]["clusters"][i]


BAD = [
    # (edit of the rk3588 dict, field named in the error, what the message says)
    (lambda d: d.update(colour="red"), "colour", "unknown key 'colour'; allowed here: schema, soc"),
    (lambda d: _gpu(d).update(clock="1 GHz"), "gpu.clock", "unknown key 'clock'"),
    (lambda d: _cl(d)["cache"].update(l4="8 MiB"), "cpu.clusters[0].cache.l4", "allowed here: l1d, l2, l3"),
    (lambda d: d["memory"].pop("bandwidth"), "memory", "missing required field 'bandwidth'"),
    (lambda d: d.pop("schema"), "bad.yaml", "missing required field 'schema'"),
    (lambda d: _gpu(d).pop("warp_width"), "gpu", "missing required field 'warp_width'"),
    (lambda d: _cl(d).update(cores="0-3"), "cpu.clusters[0].cores", "expected a non-empty list, got '0-3'"),
    (lambda d: _cl(d).update(cores=[0, "x"]), "cpu.clusters[0].cores[1]", "expected an integer, got 'x'"),
    (lambda d: _cl(d).update(cores=[0, 1.5]), "cpu.clusters[0].cores[1]", "expected an integer"),
    (lambda d: _cl(d).update(cores=[0, 0]), "cpu.clusters[0].cores", "listed twice"),
    (lambda d: _cl(d).update(capacity=2048), "cpu.clusters[0].capacity", "in [1, 1024]"),
    (lambda d: _cl(d).update(features="neon"), "cpu.clusters[0].features", "expected a list"),
    (lambda d: d["memory"].update(bandwidth="51.2 GHz"), "memory.bandwidth",
     "expected a bandwidth such as '51.2 GB/s', got '51.2 GHz'"),
    (lambda d: d["memory"].update(total=16), "memory.total", "bare number 16"),
    (lambda d: d["memory"].update(total="0 GiB"), "memory.total", "must be > 0"),
    (lambda d: _cl(d).update(max_freq="1.8 GB"), "cpu.clusters[0].max_freq", "expected a frequency"),
    (lambda d: _gpu(d).update(launch_overhead="-2 us"), "gpu.launch_overhead", "must be >= 0"),
    (lambda d: _cl(d, 0).update(cores=[0, 1, 2, 4]), "cpu.clusters[1].cores",
     "core 4 is already in cluster 'little'"),
    (lambda d: _cl(d, 1).update(name="little"), "cpu.clusters[1].name", "duplicate cluster name 'little'"),
    (lambda d: d["cpu"].update(clusters=[]), "cpu.clusters",
     "expected a non-empty list, got an empty list"),
    (lambda d: _cl(d)["peak_per_core"].update(fp64="1 GFLOPS"), "cpu.clusters[0].peak_per_core.fp64",
     "allowed here: fp32, fp16, int8, int4"),
    (lambda d: _gpu(d).update(peak={"bf16": "1 TFLOPS"}), "gpu.peak.bf16", "unknown key 'bf16'"),
    (lambda d: _gpu(d).update(peak={}), "gpu.peak", "expected a non-empty mapping"),
    (lambda d: d["npu"].update(chunk_buckets=[64, 32]), "npu.chunk_buckets", "strictly ascending"),
    (lambda d: d["npu"].update(chunk_buckets=[32, 32]), "npu.chunk_buckets", "strictly ascending"),
    (lambda d: d["npu"].update(chunk_buckets=[0, 32]), "npu.chunk_buckets[0]",
     "expected an integer in [1,"),
    (lambda d: d["npu"].update(chunk_buckets=[32, "64"]), "npu.chunk_buckets[1]", "expected an integer"),
    (lambda d: d["npu"].update(chunk_buckets=[]), "npu.chunk_buckets", "non-empty list"),
    (lambda d: d["npu"].update(static_shapes="yes please"), "npu.static_shapes", "expected true or false"),
    (lambda d: _gpu(d).update(work_group_size=40), "gpu.work_group_size",
     "expected a multiple of warp_width (16), got 40"),
    (lambda d: _gpu(d).update(api="vulkan"), "gpu.api", "expected 'opencl'"),
    (lambda d: d.update(schema=2), "schema", "expected schema version 1, got 2"),
    (lambda d: d.update(schema="1"), "schema", "expected schema version 1"),
    (lambda d: d.update(schema=1.0), "schema", "expected schema version 1, got 1.0"),
    (lambda d: d.update(gpu=["Mali"]), "gpu", "expected a mapping"),
    (lambda d: d.update(measured={"date": "2026-11-21", "tool": "t", "memory_read_bandwidth": "10 GB/s",
                                  "clusters": {"huge": {"fp32": "1 GFLOPS"}}}),
     "measured.clusters.huge", "unknown key 'huge'; allowed here: little, big"),
    (lambda d: d.update(measured={"date": "2026-11-21", "tool": "t", "memory_read_bandwidth": "10 GB/s",
                                  "clusters": {}, "units": {"reference": {"threads": 0, "call_overhead": "1 us",
                                                                    "precision_flops": {"fp32": "1 GFLOPS"},
                                                                    "gemm": []}}}),
     "measured.units.reference.threads", "expected an integer in [1,"),
    (lambda d: d.update(measured={"date": "2026-11-21", "tool": "t", "memory_read_bandwidth": "10 GB/s",
                                  "clusters": {}, "units": {"reference": {"threads": 1, "call_overhead": "1 us",
                                                                    "precision_flops": {"fp32": "1 GFLOPS"},
                                                                    "gemm": [{"m": 1, "k": 2, "n": 3}]}}}),
     "measured.units.reference.gemm[0]", "missing required field 'flops'"),
    (lambda d: d.update(measured={"date": "2026-11-21", "tool": "t", "memory_read_bandwidth": "10 GB/s",
                                  "clusters": {}, "units": {"reference": {"threads": 1, "call_overhead": "1 us",
                                                                    "precision_flops": {"fp32": "1 GFLOPS"},
                                                                    "gemm": [], "attention": [
                                                                        {"tokens": 0, "context": 5,
                                                                         "flops": "1 GFLOPS"}]}}}),
     "measured.units.reference.attention[0].tokens", "expected an integer in [1,"),
    (lambda d: d.update(measured={"date": "2026-11-21", "tool": "t", "memory_read_bandwidth": "10 GB/s",
                                  "clusters": {}, "units": {"reference": {"threads": 1, "call_overhead": "1 us",
                                                                    "precision_flops": {"fp32": "1 GFLOPS"},
                                                                    "gemm": [], "elementwise": [
                                                                        {"op": "softmax", "tokens": 5,
                                                                         "flops": "1 GFLOPS"}]}}}),
     "measured.units.reference.elementwise[0].op", "expected one of rmsnorm, rope, add, swiglu"),
    # typos that were read without a word: the entry ignored, or the NPU available and never placed
    (lambda d: d.update(measured={"date": "2026-11-21", "tool": "t", "memory_read_bandwidth": "10 GB/s",
                                  "clusters": {}, "units": {"neonn": {"threads": 1, "call_overhead": "1 us",
                                                                      "precision_flops": {"fp32": "1 GFLOPS"},
                                                                      "gemm": []}}}),
     "measured.units.neonn", "expected a unit name (neon, opencl, npu, reference)"),
    (lambda d: d["npu"].update(supported_ops=["matmull"]), "npu.supported_ops[0]", "expected an op kind"),
    # more threads than the profile has cores: neon's figures were scaled by cores / threads (2/64
    # on the 2-core host) and every op went to reference, without a word (a probe)
    (lambda d: d.update(measured={"date": "2026-11-21", "tool": "t", "memory_read_bandwidth": "10 GB/s",
                                  "clusters": {}, "units": {"neon": {"threads": 9, "call_overhead": "1 us",
                                                                     "precision_flops": {"int8": "1 TOPS"},
                                                                     "gemm": []}}}),
     "measured.units.neon.threads", "expected at most the 8 core(s) cpu.clusters lists, got 9"),
]


@pytest.mark.parametrize("edit, field, says", BAD)
def test_invalid_profile_names_file_and_field(tmp_path, edit, field, says):
    d = copy.deepcopy(_shipped_dict())
    edit(d)
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(d, sort_keys=False))
    with pytest.raises(ConfigError) as e:
        load_profile(path)
    msg = str(e.value)
    assert msg.startswith("bad.yaml: ")
    assert f" {field}: " in f" {msg}" or field == "bad.yaml", msg
    assert says in msg, msg


@pytest.mark.parametrize("text, says", [
    ("- just\n- a list\n", "bad.yaml: expected a mapping with keys schema, soc, memory, cpu"),
    ("", "bad.yaml: expected a mapping"),
    ("schema: 1\nsoc: [unclosed\nmemory: {}\n", "bad.yaml: line 3"),
    ("schema: 1\n  soc: x\n", "YAML syntax error"),
    ("schema: 1\nsoc: a\nsoc: b\n", "bad.yaml: line 3: duplicate key 'soc'"),
    ("schema: 1\nsoc: &s x\nmemory: *s\n", "YAML aliases are not allowed"),
    ("a: 1\n---\nb: 2\n", "YAML syntax error"),
    # (our 100-level check's words, or those of a libyaml that stops at its own 1000 levels)
    ("x: " + "[" * 5000 + "]" * 5000 + "\n", "YAML nested too deeply"),
    ("schema: 1\nsoc: !!int neon\n", "bad.yaml: YAML value cannot be read"),   # PyYAML leaks ValueError
    ("schema: !!float \n", "bad.yaml: YAML value cannot be read"),               # ... IndexError
    ("soc: !!timestamp x\n", "bad.yaml: YAML value cannot be read"),              # ... AttributeError
    ("soc: !!python/object/apply:os.system ['true']\n", "bad.yaml: line 1"),      # safe_load refuses it
])
def test_malformed_yaml(tmp_path, text, says):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=re.escape(says)):
        load_profile(path)


def test_oversized_and_binary_files_are_refused_before_parsing(tmp_path):
    big = tmp_path / "big.yaml"
    big.write_text("#" * MAX_PROFILE_BYTES + "\n")
    with pytest.raises(ConfigError, match="at most"):
        load_profile(big)
    binary = tmp_path / "bin.yaml"
    binary.write_bytes(b"schema: 1\nsoc: \xff\xfe\n")
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_profile(binary)
    with pytest.raises(ConfigError, match="not a regular file"):
        load_profile(tmp_path)
    with pytest.raises(ConfigError, match="no such device profile file"):
        load_profile(tmp_path / "missing.yaml")


def test_optional_units_may_be_null_or_absent(tmp_path):
    d = _shipped_dict()
    d["gpu"] = None
    del d["npu"]
    del d["cpu"]["clusters"][0]["capacity"]
    del d["cpu"]["clusters"][0]["cache"]["l3"]
    path = tmp_path / "bare.yaml"
    path.write_text(yaml.safe_dump(d))
    p = load_profile(path)
    assert p.gpu is None and p.npu is None and p.measured is None
    assert p.clusters[0].capacity is None and p.clusters[0].l3_bytes == 0
    assert p.name == "bare" and p.source == str(path)


# -- name lookup -------------------------------------------------------------------------------


def test_user_profile_in_edgellm_home(tmp_path, monkeypatch):
    home = tmp_path / "custom-home"
    monkeypatch.setenv("EDGELLM_HOME", str(home))
    (home / "profiles").mkdir(parents=True)
    d = _shipped_dict()
    d["soc"] = "My RK3588 board"
    (home / "profiles" / "myboard.yaml").write_text(yaml.safe_dump(d))
    p = load_profile("myboard")
    assert p.soc == "My RK3588 board" and p.name == "myboard"
    assert Path(p.source) == home / "profiles" / "myboard.yaml"
    assert "myboard" in list_profiles() and set(SHIPPED) <= set(list_profiles())
    # a user profile shadows a shipped one of the same name
    d["soc"] = "Overclocked"
    (home / "profiles" / "rk3588.yaml").write_text(yaml.safe_dump(d))
    assert load_profile("rk3588").soc == "Overclocked"


def test_unknown_name_lists_available_and_host_gets_a_hint():
    with pytest.raises(ConfigError) as e:
        load_profile("snapdragon-9000")
    assert "unknown device profile 'snapdragon-9000'" in str(e.value)
    assert all(n in str(e.value) for n in SHIPPED)
    with pytest.raises(ConfigError, match=re.escape("run `edgellm profile` to measure this machine")):
        load_profile("host")


def test_load_by_path_string_and_path(tmp_path):
    src = shipped_profiles_dir() / "raspberry-pi-5.yaml"
    assert load_profile(str(src)).name == "raspberry-pi-5"
    assert load_profile(src).soc == "Broadcom BCM2712"


# -- dump / write round trip ------------------------------------------------------------------


def _assert_close(a, b, path="profile"):
    """Dataclasses equal field by field, floats to 1e-3 relative."""
    if dataclasses.is_dataclass(a):
        assert type(a) is type(b), path
        for f in dataclasses.fields(a):
            if f.name != "source":
                _assert_close(getattr(a, f.name), getattr(b, f.name), f"{path}.{f.name}")
    elif isinstance(a, dict):
        assert set(a) == set(b), path
        for k in a:
            _assert_close(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, tuple):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_close(x, y, f"{path}[{i}]")
    elif isinstance(a, float):
        assert b == pytest.approx(a, rel=1e-3), path
    else:
        assert a == b, path


@pytest.mark.parametrize("name", SHIPPED)
def test_dump_load_round_trip(tmp_path, name):
    p = load_profile(name)
    out = write_profile(p, tmp_path / f"{name}.yaml")
    assert out == tmp_path / f"{name}.yaml"
    _assert_close(p, load_profile(out))


def _measured_host() -> DeviceProfile:
    p = load_profile("rk3588")
    m = Measured(
        date="2026-11-21", tool="edgellm profile 0.1.0 --quick",
        memory_read_bandwidth=12.345678e9,
        clusters={"big": {"fp32": 96.2345678e9, "fp16": 1.1e9}, "little": {"fp32": 7.7777e9}},
        units={"reference": UnitMeasurement(
            precision_flops={"fp32": 96.2345678e9, "int8": 123.456e9},
            gemm=(GemmFigure(512, 576, 1536, 96.2e9), GemmFigure(1, 576, 1536, 3.21e9)),
            call_overhead_s=4.1234e-6, threads=2,
            attention=(AttentionFigure(1, 512, 1.9e9), AttentionFigure(32, 400, 17.6e9)),
            elementwise=(ElementwiseFigure("swiglu", 32, 1.47e9), ElementwiseFigure("rope", 256, 7.5e9)))},
    )
    return dataclasses.replace(p, name="host", measured=m)


def test_measured_section_round_trips_with_units(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGELLM_HOME", str(tmp_path))
    host = _measured_host()
    path = write_profile(host, tmp_path / "profiles" / "host.yaml")  # creates the folder
    text = path.read_text()
    assert "memory_read_bandwidth: 12.3457 GB/s" in text
    assert "call_overhead: 4.1234 us" in text
    assert "{m: 512, k: 576, n: 1536, flops: 96.2 GFLOPS}" in text
    assert "int8: 123.456 GOPS" in text and "bandwidth: 34.1 GB/s" in text
    assert "{tokens: 32, context: 400, flops: 17.6 GFLOPS}" in text
    assert "{op: swiglu, tokens: 32, flops: 1.47 GFLOPS}" in text
    back = load_profile("host")  # found by name in $EDGELLM_HOME/profiles
    assert back.name == "host" and back.measured.date == "2026-11-21"
    _assert_close(host, back)
    assert dump_profile(back) == dump_profile(host)  # stable: a second round trip changes nothing


def test_write_is_atomic_and_refuses_a_profile_it_could_not_read_back(tmp_path):
    host = _measured_host()
    path = write_profile(host, tmp_path / "host.yaml")
    before = path.read_text()
    bad_gpu = dataclasses.replace(host.gpu, work_group_size=40)  # not a multiple of 16
    with pytest.raises(ConfigError, match="gpu.work_group_size"):
        write_profile(dataclasses.replace(host, gpu=bad_gpu), path)
    assert path.read_text() == before  # the old file is untouched
    faster = dataclasses.replace(host, memory_bandwidth=40e9)
    write_profile(faster, path)
    assert load_profile(path).memory_bandwidth == pytest.approx(40e9)
    assert [f.name for f in tmp_path.iterdir()] == ["host.yaml"]  # no temp files left behind


# -- fuzz: a mutated profile is a ConfigError or a valid profile, never a crash ---------------

_TOKENS = ["-", ":", "[", "]", "{", "}", ",", "&a ", "*a", "<<: *a", "? ", "!!python/object:os.system ",
           "!!binary ", "!!int ", "!!float ", "!!bool ", "!!timestamp ", "%YAML 1.1\n---\n", "0", "-1",
           "1e999", ".nan", "null", "true", "~", "\t", "\n", "  ", "#", "'", '"', "GHz", "GB/s", "KiB",
           "\u00b5s", "\x00", "\ufeff"]


@settings(max_examples=300, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.lists(st.tuples(st.floats(0, 1), st.integers(0, 8),  # (where, chars cut, text inserted)
                          st.one_of(st.sampled_from(_TOKENS), st.text(max_size=8))),
                min_size=1, max_size=6))
def test_fuzz_mutated_profile(edits):
    text = (shipped_profiles_dir() / "rk3588.yaml").read_text()
    for where, cut, insert in edits:
        i = int(where * len(text))
        text = text[:i] + insert + text[i + cut:]
    try:
        p = _profile_from_text(text, "fuzz", "fuzz.yaml")
    except ConfigError as e:
        assert str(e).startswith("fuzz.yaml: ")
    else:
        assert isinstance(p, DeviceProfile) and p.clusters


@pytest.mark.parametrize("text", ["[" * 30000 + "]" * 30000, "- " * 60000 + "1", "{a: " * 60000 + "1" + "}" * 60000,
                                  "[" * 101 + "]" * 101], ids=["brackets", "block", "braces", "101"])
def test_deep_nesting_is_refused_not_a_crash(tmp_path, text):
    """libyaml 0.2.5's composer recursed once per level with no limit: a 60 KB profile of
    brackets overflowed the C stack (a segfault, exit 139). In a child, so a crash fails the test."""
    import subprocess
    import sys
    path = tmp_path / "deep.yaml"
    path.write_text(text + "\n")
    code = ("from edgellm.device.profile_yaml import load_profile\nfrom edgellm.errors import ConfigError\n"
            f"try:\n    load_profile({str(path)!r})\nexcept ConfigError as e:\n    print(e)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, (r.returncode, r.stderr[-500:])
    assert r.stdout.startswith("deep.yaml: ") and "YAML nested too deeply" in r.stdout, r.stdout


@pytest.mark.parametrize("bad, says", [("a\0b.yaml", "is not a usable path (embedded null byte)"),
                                       ("/tmp/\ud800.yaml", "is not a usable path"),
                                       ("a" * 300, "unknown device profile 'aaaa")], ids=["nul", "surrogate", "long"])
def test_a_path_the_system_cannot_open_is_a_config_error(bad, says):
    """ValueError, UnicodeEncodeError and ENAMETOOLONG's OSError reached edgellm.load(device=)."""
    with pytest.raises(ConfigError, match=re.escape(says)):
        load_profile(bad)


@pytest.mark.parametrize("bad", [123, b"rk3588", ["rk3588"]])
def test_a_device_that_is_not_a_name_or_path_is_a_config_error(bad):
    """load(device=123) was a TypeError, device=b'rk3588' "a bytes-like object is required"."""
    from edgellm.api import device_profile
    with pytest.raises(ConfigError, match="device: expected a profile name or a path"):
        device_profile(bad)


def test_a_written_profile_cut_short_is_refused(tmp_path):
    """A measured profile cut at a line boundary parsed, and plans used what was left (a
    probing helper, session 25: TTFT predicted 0.3 ms instead of 1.5). A profile written now
    promises its end on its first line; one without the promise reads as before."""
    from edgellm.device.profile_yaml import write_profile
    path = write_profile(load_profile("rk3588"), tmp_path / "dev.yaml")
    text = path.read_text()
    assert text.rstrip().endswith("# end of profile") and load_profile(path)
    cut = text[: len(text) // 2]
    path.write_text(cut[: cut.rindex("\n") + 1])
    with pytest.raises(ConfigError, match="dev.yaml: cut short"):
        load_profile(path)
    old = text.split("\n", 1)[1].replace("# end of profile\n", "")   # no first-line promise: as before
    path.write_text("# a hand-written profile\n" + old)
    assert load_profile(path).soc == load_profile("rk3588").soc


def test_a_note_after_the_end_of_a_written_profile_is_not_called_cut_short(tmp_path, monkeypatch):
    """A comment added after '# end of profile' said 'cut short ... write it again', which sends
    the user to measure again; a broken copy in EDGELLM_HOME/profiles was named like the shipped
    profile it shadows (a probe)."""
    from edgellm.device.profile_yaml import user_profiles_dir, write_profile
    path = write_profile(load_profile("rk3588"), tmp_path / "dev.yaml")
    path.write_text(path.read_text() + "# my note\n")
    with pytest.raises(ConfigError, match=r"dev\.yaml: has lines after '# end of profile'"):
        load_profile(path)
    monkeypatch.setenv("EDGELLM_HOME", str(tmp_path / "home"))
    mine = user_profiles_dir() / "rk3588.yaml"
    mine.parent.mkdir(parents=True)
    mine.write_text("schema: 1\nsoc: x\n")
    with pytest.raises(ConfigError, match=re.escape(str(mine)) + ": "):
        load_profile("rk3588")


@pytest.mark.parametrize("old, new, message", [
    ("compute_units: 4 ", "compute_units: 1:30 ", "reads as a base-60 number"),
    ("bandwidth: 34.1 GB/s", "bandwidth: ３４ GB/s", "memory.bandwidth: expected"),
    ("soc: Rockchip RK3588", 'soc: "Rock\\achip"', "soc: expected printable text"),
    ("soc: Rockchip RK3588", "soc: " + "x" * 300, "soc: expected at most 200 characters"),
])
def test_yaml_quirks_and_odd_text_in_a_profile_are_refused(tmp_path, old, new, message):
    """A probe's finds: YAML 1.1 read `compute_units: 1:30` as 90, full-width digits passed as
    a bandwidth, and a soc with control characters or 900 KB was printed as it was."""
    from edgellm.device.profile_yaml import shipped_profiles_dir
    text = (shipped_profiles_dir() / "rk3588.yaml").read_text()
    assert old in text
    path = tmp_path / "odd.yaml"
    path.write_text(text.replace(old, new, 1))
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_profile(path)


def test_a_control_character_in_the_yaml_is_a_one_line_error(tmp_path):
    """libyaml's reader error carried a second line ('in "<unicode string>", position N')."""
    path = tmp_path / "nul.yaml"
    path.write_text("schema: 1\nsoc: a\x00b\n")
    with pytest.raises(ConfigError) as e:
        load_profile(path)
    assert "\n" not in str(e.value) and "control characters are not allowed" in str(e.value)


def test_yaml_merge_keys_are_refused(tmp_path):
    from edgellm.device.profile_yaml import shipped_profiles_dir
    text = (shipped_profiles_dir() / "rk3588.yaml").read_text()
    path = tmp_path / "merge.yaml"
    path.write_text(text.replace("memory:\n", "memory:\n  <<: {total: 1 GiB}\n", 1))
    with pytest.raises(ConfigError, match="merge keys"):
        load_profile(path)


def test_a_number_of_thousands_of_digits_is_refused_in_our_words(tmp_path):
    path = tmp_path / "big.yaml"
    path.write_text("schema: " + "9" * 5000 + "\n")
    with pytest.raises(ConfigError, match="thousands of digits") as e:
        load_profile(path)
    assert "set_int_max_str_digits" not in str(e.value)


def test_review_of_the_profile_checks(tmp_path):
    """A review probe's finds: a no-break space before a unit (a datasheet copy) was refused
    after the digits went ASCII; a block-scalar soc (ends in a newline) read as a control
    character; bidi overrides passed; '# end of profile  ' with trailing spaces and a CRLF copy
    slipped past the end check."""
    from edgellm.device.profile_yaml import shipped_profiles_dir, write_profile
    text = (shipped_profiles_dir() / "rk3588.yaml").read_text()
    ok = tmp_path / "ok.yaml"
    ok.write_text(text.replace("bandwidth: 34.1 GB/s", "bandwidth: 34.1\u00a0GB/s", 1)
                  .replace("soc: Rockchip RK3588", "soc: |\n  Rockchip RK3588", 1))
    p = load_profile(ok)
    assert p.memory_bandwidth == 34.1e9 and p.soc == "Rockchip RK3588"
    bidi = tmp_path / "bidi.yaml"
    bidi.write_text(text.replace("soc: Rockchip RK3588", 'soc: "RK\\u202e3588"', 1))
    with pytest.raises(ConfigError, match="soc: expected printable text"):
        load_profile(bidi)
    written = write_profile(load_profile("rk3588"), tmp_path / "w.yaml").read_text()
    spaced = tmp_path / "spaced.yaml"
    spaced.write_text(written.rstrip("\n") + "  \n# my note\n")
    with pytest.raises(ConfigError, match="has lines after"):
        load_profile(spaced)
    crlf = tmp_path / "crlf.yaml"
    cut = written[: len(written) // 2]
    crlf.write_bytes(cut[: cut.rindex("\n") + 1].replace("\n", "\r\n").encode())
    with pytest.raises(ConfigError, match="cut short"):
        load_profile(crlf)


def test_implausible_bandwidth_and_peaks_are_warned_once_naming_file_field_and_value(tmp_path, caplog):
    """memory.bandwidth: 1 B/s (schema-valid) planned TTFT 1615483392000.8 ms and decode 0.0 tok/s
    without a word (a probe). Such figures load (a user may experiment), with one warning each."""
    import logging

    d = _shipped_dict()
    d["memory"]["bandwidth"] = "1 B/s"
    _gpu(d)["peak"]["fp32"] = "1e290 TFLOPS"
    _cl(d)["peak_per_core"]["fp32"] = "1 FLOPS"
    d["npu"]["peak"]["int8"] = "1e6 TOPS"
    d["measured"] = {"date": "2026-11-21", "tool": "t", "memory_read_bandwidth": "1e15 GB/s", "clusters": {},
                     "units": {"neon": {"threads": 4, "call_overhead": "1 us", "gemm": [],
                                        "precision_flops": {"int8": "1 MOPS"}}}}
    path = tmp_path / "odd.yaml"
    path.write_text(yaml.safe_dump(d, sort_keys=False))
    with caplog.at_level(logging.WARNING, logger="edgellm"):
        p = load_profile(path)
        load_profile(path)                               # once, not at every load
    assert p.memory_bandwidth == 1.0
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 6, said
    for field, value in (("memory.bandwidth", "'1 B/s'"), ("gpu.peak.fp32", "'1e290 TFLOPS'"),
                         ("cpu.clusters[0].peak_per_core.fp32", "'1 FLOPS'"), ("npu.peak.int8", "'1e6 TOPS'"),
                         ("measured.memory_read_bandwidth", "'1e15 GB/s'"),
                         ("measured.units.neon.precision_flops.int8", "'1 MOPS'")):
        assert any(s.startswith(f"odd.yaml: {field}: {value} is outside ") for s in said), (field, said)
    assert "0.1 GB/s to 10 TB/s" in " ".join(said) and "0.1 GFLOPS (GOPS) to 100000 TFLOPS (TOPS)" in " ".join(said)
    caplog.clear()
    d = _shipped_dict()
    d["memory"]["bandwidth"], _gpu(d)["peak"]["fp32"] = "0.1 GB/s", "100000 TFLOPS"   # the bounds: plausible
    path.write_text(yaml.safe_dump(d, sort_keys=False))
    with caplog.at_level(logging.WARNING, logger="edgellm"):
        load_profile(path)
        for name in SHIPPED:
            load_profile(name)
    assert not caplog.records, [r.getMessage() for r in caplog.records]
