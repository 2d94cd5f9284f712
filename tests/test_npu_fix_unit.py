"""The npu unit's runtime choice and run-time failures, and the LiteRT cache's leftovers: a
profile whose ONNX providers are missing says so when LiteRT takes over; a subgraph failing after
load says what happened and what to do; a killed writer's temporary file in the LiteRT cache is
removed."""
from __future__ import annotations

import logging
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest

from edgellm.backends import npu, npu_graphs
from edgellm.device.host import estimate_host_profile
from edgellm.device.profile import Npu


@pytest.fixture(autouse=True)
def _fresh():
    npu.reset()
    yield
    npu.reset()


def _use(providers=("CPUExecutionProvider",), delegate=None):
    n = Npu("test npu", {"int8": 4e12}, tuple(providers), delegate, True, (32,), frozenset({"matmul"}),
            300e-6, 100e-6)
    npu.use_profile(replace(estimate_host_profile(), name="host", npu=n))


def test_litert_taking_over_from_missing_onnx_providers_says_why(monkeypatch, caplog):
    """A profile naming only QNNExecutionProvider (not in this onnxruntime) switched silently to
    LiteRT's CPU kernels: no warning, and the unit's reason named only LiteRT."""
    from edgellm.backends import npu_tflite

    ok, why = npu_tflite.available()
    if not ok:
        pytest.skip(f"no TFLite runtime to take over: {why}")
    monkeypatch.delenv("EDGELLM_NPU_RUNTIME", raising=False)
    _use(providers=("QNNExecutionProvider",))
    with caplog.at_level(logging.WARNING, logger="edgellm"):
        mod, why = npu._choose_runtime()
    assert mod is npu_tflite
    assert why.startswith("LiteRT") and "ONNX Runtime skipped" in why and "QNNExecutionProvider" in why, why
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "QNNExecutionProvider" in warned[0] and "LiteRT" in warned[0], warned


def test_litert_chosen_by_name_has_nothing_to_explain(monkeypatch, caplog):
    from edgellm.backends import npu_tflite

    if not npu_tflite.available()[0]:
        pytest.skip("no TFLite runtime")
    monkeypatch.setenv("EDGELLM_NPU_RUNTIME", "tflite")
    _use(providers=("QNNExecutionProvider",))
    with caplog.at_level(logging.WARNING, logger="edgellm"):
        mod, why = npu._choose_runtime()
    assert mod is npu_tflite and "skipped" not in why and not caplog.records


class _LostDevice:
    def run(self, x):
        raise npu_graphs.NpuGraphError("blk.0.qkv", "run failed: RuntimeError: device lost")


def test_a_subgraph_failing_after_load_says_what_to_do():
    """A provider failing at run time raised only "run failed: ... device lost" on every generate;
    the engine cannot re-plan then, so the error says so and how to load without the unit."""
    w = npu.NpuMatrix("blk.0.qkv", 8, 16, {b: _LostDevice() for b in npu.DEFAULT_BUCKETS}, None, ("qkv",))
    with pytest.raises(npu_graphs.NpuGraphError) as e:
        npu.matmul(np.zeros((5, 16), np.float32), w)
    msg = str(e.value)
    assert "blk.0.qkv" in msg and "device lost" in msg and "--units reference" in msg, msg
    assert e.value.graph == "blk.0.qkv"


def test_a_killed_writers_temporary_file_is_removed_from_the_litert_cache(tmp_path):
    """A writer killed mid-write left .<name>.pidNNNN.<rand>.tmp in cache/npu/tflite for good; the
    next write removes it, as the model cache does."""
    pytest.importorskip("tflite", reason="the tflite schema package (the [npu] extra) writes the models")
    from edgellm.backends import npu_tflite

    rng = np.random.default_rng(3)
    graph = npu_graphs.LinearGraph("blk.0.attn_out", npu_graphs.quantize(rng.standard_normal((8, 64)).astype(
        np.float32), "int8s"), 4)
    dead = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True, check=True).stdout)
    path = npu_tflite.cache_path(graph, tmp_path)
    tmp_path.mkdir(exist_ok=True)
    part = tmp_path / f".{path.name}.pid{dead}.x1y2z3.tmp"
    part.write_bytes(b"half a model")
    npu_tflite.load_or_build(graph, tmp_path)
    assert not part.exists() and path.exists()
