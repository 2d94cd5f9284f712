"""The OpenCL runtime (backends/opencl_runtime.py): device choice, the program-binary cache, build
failures with their log. Runs on whatever OpenCL device this machine has (PoCL in CI)."""
from __future__ import annotations

import logging
import os

import numpy as np
import pytest

from edgellm.backends.opencl_runtime import ClRuntime, KernelBuildError, OpenCLUnavailable


def _fill(rt: ClRuntime, value: float) -> np.ndarray:
    buf = rt.empty(4 * 10)
    rt.launch(rt.kernel("probe_kernels", "el_fill"), (16,), None, buf, np.float32(value), np.int32(10))
    return rt.read(buf, (10,))


def test_second_runtime_builds_from_the_binary_cache(tmp_path):
    first = ClRuntime.create(cache_dir=tmp_path)
    assert np.all(_fill(first, 2.5) == 2.5)
    assert (first.stats.from_source, first.stats.from_cache) == (1, 0)
    assert len(list(tmp_path.glob("probe_kernels-*.bin"))) == 1
    second = ClRuntime.create(cache_dir=tmp_path)
    assert np.all(_fill(second, -1.0) == -1.0)
    assert (second.stats.from_source, second.stats.from_cache) == (0, 1)


def test_build_options_are_part_of_the_cache_key(tmp_path):
    rt = ClRuntime.create(cache_dir=tmp_path)
    rt.program("probe_kernels")
    rt.program("probe_kernels", {"EL_UNUSED": 1})
    assert rt.stats.from_source == 2
    assert len(list(tmp_path.glob("probe_kernels-*.bin"))) == 2


@pytest.mark.parametrize("damage", ["truncate", "flip", "empty", "fifo", "huge"])
def test_a_damaged_cache_file_is_rebuilt_with_a_warning(tmp_path, caplog, damage):
    ClRuntime.create(cache_dir=tmp_path).program("probe_kernels")
    (path,) = tmp_path.glob("probe_kernels-*.bin")
    data = bytearray(path.read_bytes())
    if damage in ("fifo", "huge"):       # read whole, a FIFO hung for ever, a 3 GB file took 6.4 GB
        path.unlink()
        if damage == "fifo":
            os.mkfifo(path)
        else:
            with open(path, "wb") as f:
                f.truncate(1 << 30)      # (sparse)
    else:
        if damage == "truncate":
            data = data[: len(data) // 2]
        elif damage == "flip":
            data[len(data) // 2] ^= 0x40
        else:
            data = bytearray()
        path.write_bytes(bytes(data))
    rt = ClRuntime.create(cache_dir=tmp_path)
    with caplog.at_level(logging.WARNING, logger="edgellm"):
        assert np.all(_fill(rt, 4.0) == 4.0)
    assert rt.stats.from_source == 1 and rt.stats.from_cache == 0
    assert "rebuilding" in caplog.text
    # and the rebuilt binary was written back, valid
    assert ClRuntime.create(cache_dir=tmp_path).program("probe_kernels") is not None


def test_a_kernel_that_fails_to_build_raises_with_its_log(tmp_path, kernels):
    (kernels / "probe_kernels.cl").write_text("__kernel void el_fill(__global float *out) { out[0] = undeclared_name; }\n")
    rt = ClRuntime.create(cache_dir=tmp_path)
    with pytest.raises(KernelBuildError) as e:
        rt.program("probe_kernels")
    assert "probe_kernels.cl" in str(e.value)
    assert "undeclared_name" in e.value.log
    assert e.value.log_path is not None and "undeclared_name" in e.value.log_path.read_text()
    assert not list(tmp_path.glob("*.bin"))       # nothing cached for a failed build


def test_no_matching_platform_names_what_was_found(monkeypatch):
    monkeypatch.setenv("EDGELLM_OPENCL_PLATFORM", "no-such-vendor")
    with pytest.raises(OpenCLUnavailable) as e:
        ClRuntime.create()
    msg = str(e.value)
    assert "no-such-vendor" in msg and "found:" in msg


def test_device_hint_selects_by_name(tmp_path):
    rt = ClRuntime.create(cache_dir=tmp_path)
    again = ClRuntime.create(device_hint=rt.name[:6], cache_dir=tmp_path)
    assert again.name == rt.name


def test_resident_buffer_round_trip(tmp_path):
    rt = ClRuntime.create(cache_dir=tmp_path)
    a = np.arange(1000, dtype=np.float32).reshape(10, 100)
    assert np.array_equal(rt.read(rt.resident(a), a.shape), a)
    assert np.array_equal(rt.read(rt.upload(a[:, :7]), (10, 7)), a[:, :7])


def test_profiling_events_record_kernel_times(tmp_path):
    rt = ClRuntime.create(cache_dir=tmp_path)
    rt.profiling = True
    _fill(rt, 1.0)
    _fill(rt, 1.0)
    times = rt.timings["el_fill"]
    assert len(times) == 2 and all(t > 0 for t in times)
