"""The npu unit's memory estimate and thread count (probe 23).

prepared_nbytes gave one byte a weight whatever the format and no runtime overhead (516 MiB for
SmolLM2-135M in int8, fp16 and fp32 alike, where the NPU placement peaked at 1.5-3.3 GiB RSS), and
every ONNX Runtime session / LiteRT interpreter started its own thread pool (368 threads on a
2-core machine)."""
from __future__ import annotations

import gc
import os
from dataclasses import replace

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from edgellm.backends import npu
from edgellm.device.host import estimate_host_profile
from edgellm.device.profile import Npu
from edgellm.model.loader import open_model
from tests.synthetic import write_tiny_model


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) * 1024
    pytest.skip("no VmRSS in /proc/self/status")


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


@pytest.fixture(params=("onnx", "tflite"))
def runtime(request, tmp_path, monkeypatch):
    monkeypatch.setenv("EDGELLM_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("EDGELLM_NPU_RUNTIME", request.param)
    monkeypatch.delenv("EDGELLM_NPU_FORMAT", raising=False)
    n = Npu("test npu", {"int8": 4e12}, ("CPUExecutionProvider",), None, True, (32, 64, 128, 256),
            frozenset({"matmul"}), 300e-6, 100e-6)
    npu.reset()
    npu.use_profile(replace(estimate_host_profile(), name="host-npu", npu=n))
    ok, why = npu.available()
    if not ok:
        pytest.skip(f"no {request.param} NPU runtime here: {why}")
    npu.configure(threads=2)
    yield request.param
    npu.reset()


def test_estimate_covers_the_rss_growth_and_threads_stay_bounded(runtime, tmp_path):
    tm = write_tiny_model(tmp_path / "m.gguf", tensor_type=QT.F32, n_layers=4, d_model=256, d_ff=512,
                          vocab_size=1024)
    model = open_model(tm.path)
    gc.collect()
    rss0, threads0 = _rss(), _threads()
    w = npu.prepare(model)
    gc.collect()
    grew, threads = _rss() - rss0, _threads()
    assert w.layers and w.lm_head is not None
    est = npu.prepared_nbytes(model.config)
    assert est >= grew, f"{runtime}: estimate {est / 2**20:.1f} MiB < RSS growth {grew / 2**20:.1f} MiB"
    # 4 layers x 3 subgraphs + the head, 4 buckets each: 52 pools before
    assert threads <= threads0 + 2, f"{runtime}: {threads0} -> {threads} threads"


def test_estimate_grows_with_the_formats_width(runtime, monkeypatch):
    cfg = open_model(write_tiny_model(os.path.join(os.environ["EDGELLM_HOME"], "w.gguf"), n_layers=2).path).config
    sizes = []
    for fmt in ("int8", "fp16", "fp32"):
        monkeypatch.setenv("EDGELLM_NPU_FORMAT", fmt)
        sizes.append(npu.prepared_nbytes(cfg))
    assert sizes[0] < sizes[1] < sizes[2], sizes
    # the int8 form: more than its one byte a weight per bucket (the runtimes' measured overhead)
    weights = cfg.n_layers * (cfg.d_model * (cfg.q_dim + 2 * cfg.kv_dim) + cfg.d_model * cfg.q_dim
                              + 3 * cfg.d_model * cfg.d_ff) + cfg.vocab_size * cfg.d_model
    assert sizes[0] > 2 * weights * len(npu.buckets())


def test_litert_keeps_one_interpreter_a_graph_and_the_estimate_covers_every_bucket_run(runtime, tmp_path):
    """LiteRT without a delegate: one interpreter per graph, resized to each bucket (each bucket's
    own interpreter held its own copy of the weights: SmolLM2-135M at 2.4 GiB after load, 0.7 GiB
    with one), giving each bucket's bits; the estimate covers the RSS once every bucket ran."""
    from edgellm.backends import npu_tflite

    if runtime != "tflite":
        pytest.skip("LiteRT's resized interpreters (ONNX Runtime's estimate counts the weights alone)")
    tm = write_tiny_model(tmp_path / "m.gguf", tensor_type=QT.F32, n_layers=4, d_model=256, d_ff=512,
                          vocab_size=1024)
    model = open_model(tm.path)
    gc.collect()
    rss0, made0 = _rss(), npu_tflite.stats.interpreters
    w = npu.prepare(model)
    mats = [m for L in w.layers for m in (L.wqkv, L.wo, L.ffn)] + [w.lm_head]
    assert npu_tflite.stats.interpreters - made0 == len(mats)
    for m in mats:
        assert len({id(getattr(g, "sub", g)) for g in m.graphs.values()}) == 1, m.name
    rng = np.random.default_rng(3)
    runs = [(m, rng.standard_normal((b, m.k)).astype(np.float32)) for b in npu.buckets() for m in mats]
    ys = [npu._run(m, x) for m, x in runs]
    gc.collect()
    grew = _rss() - rss0
    est = npu.prepared_nbytes(model.config)
    assert est >= grew, f"{runtime}: estimate {est / 2**20:.1f} MiB < RSS growth {grew / 2**20:.1f} MiB"
    for (m, x), y in zip(runs, ys):
        own = npu_tflite.compile(m.make(x.shape[0]), num_threads=1).run(x)
        assert np.array_equal(y.view(np.uint32), own.view(np.uint32)), (m.name, x.shape[0])


def test_requantized_weights_are_dropped_after_load_and_computed_again_to_the_same_bits(runtime, tmp_path,
                                                                                        monkeypatch):
    """prepare() held every projection's QLinear for the engine's life (SmolLM2-135M: 136 MiB) though
    the compiled subgraphs hold their own copies; it drops them, and a graph built after load (a
    fused FFN's projection alone) computes them again from the model: the same digests, so the
    same cache files and bits."""
    tm = write_tiny_model(tmp_path / "m.gguf", tensor_type=QT.Q8_0, n_layers=2, d_model=128, d_ff=256,
                          vocab_size=512)
    model = open_model(tm.path)
    dropped = []
    drop = npu._Requantized.drop
    monkeypatch.setattr(npu._Requantized, "drop", lambda self: (dropped.append(self), drop(self)))
    w = npu.prepare(model)
    assert dropped and all(q._q is None for q in dropped)
    monkeypatch.setattr(npu._Requantized, "drop", lambda self: None)
    kept = npu.prepare(model)

    def digests(ws):
        out = []
        for L in ws.layers:
            for m in (L.wqkv, L.wo, L.w_gate_up, L.w_down):
                out.append(m.make(32).w.digest())
            out += [L.ffn.make(32).gate_up.digest(), L.ffn.make(32).down.digest()]
        return out + [ws.lm_head.make(32).w.digest()]

    assert digests(w) == digests(kept)
    assert not w.layers[0].w_gate_up.graphs
    x = np.random.default_rng(2).standard_normal((40, 128)).astype(np.float32)
    np.testing.assert_array_equal(npu._run(w.layers[0].w_gate_up, x), npu._run(kept.layers[0].w_gate_up, x))
