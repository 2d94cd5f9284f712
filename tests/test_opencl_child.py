"""The OpenCL probe child started before the runtime is imported (backends/opencl_child.py):
available() takes that child's answer instead of starting another, and a child nobody needs (the
device profile lists no GPU) is killed."""
import subprocess

import pytest
from gguf import GGMLQuantizationType as QT

import edgellm
from edgellm.backends import opencl, opencl_child

from .synthetic import write_tiny_model


@pytest.fixture(autouse=True)
def fresh(tmp_path, monkeypatch):
    # an empty EDGELLM_HOME: no probe answer kept from an earlier load (opencl_probe_cache.py)
    monkeypatch.setenv("EDGELLM_HOME", str(tmp_path / "home"))
    opencl.reset()
    yield
    opencl.reset()


def test_available_takes_the_child_started_early(monkeypatch):
    opencl_child.spawn()
    opencl_child.spawn()                  # idempotent: still one child
    assert len(opencl_child._child) == 1
    proc = opencl_child._child[0][0]
    started = []
    real = subprocess.Popen
    monkeypatch.setattr(opencl_child.subprocess, "Popen", lambda *a, **k: started.append(a) or real(*a, **k))
    ok, why = opencl.available()
    assert ok, why
    assert started == [] and opencl_child._child == [] and proc.returncode == 0


def test_no_child_once_the_answer_is_known():
    """A second load in the same process reuses the probe's answer: nothing to start."""
    ok, _ = opencl.available()
    opencl_child.spawn()
    assert opencl_child._child == []


def test_discard_kills_an_unclaimed_child():
    opencl_child.spawn()
    proc = opencl_child._child[0][0]
    opencl_child.discard()
    assert opencl_child._child == [] and proc.returncode is not None
    opencl_child.discard()                # nothing to do: no error


def test_a_child_that_cannot_start_says_why(monkeypatch):
    def refuse(*a, **k):
        raise OSError("Resource temporarily unavailable")
    monkeypatch.setattr(opencl_child.subprocess, "Popen", refuse)
    assert opencl_child.spawn() == "Resource temporarily unavailable"
    ok, why = opencl.available()
    assert not ok and why == "the OpenCL probe could not start: Resource temporarily unavailable"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("cc") / "tiny.gguf", tensor_type=QT.Q8_0, n_layers=1,
                            d_model=64, n_heads=4, n_kv_heads=2, seed=7).path


def test_load_discards_the_early_child_when_the_profile_has_no_gpu(tiny, monkeypatch):
    spawned = []
    real_spawn = opencl_child.spawn
    monkeypatch.setattr(opencl_child, "spawn", lambda: spawned.append(1) or real_spawn())
    eng = edgellm.load(tiny, device="raspberry-pi-5", n_ctx=64)   # its profile lists no GPU
    assert spawned == [1] and opencl_child._child == []      # started early, then killed
    (gpu,) = [u for u in eng.plan.units if u.name == "opencl"]
    assert not gpu.available and "no OpenCL GPU" in gpu.reason


def test_a_command_that_fails_before_loading_stops_its_child(monkeypatch):
    from typer.testing import CliRunner

    from edgellm.cli import app

    spawned = []
    real_spawn = opencl_child.spawn
    monkeypatch.setattr(opencl_child, "spawn", lambda: spawned.append(1) or real_spawn())
    r = CliRunner().invoke(app, ["run", "x", "--temperature", "-1"])
    assert r.exit_code == 1 and "temperature" in r.output
    assert spawned == [1] and opencl_child._child == []
