"""The ONNX model cache of the npu unit against damage its checks used to miss, and the session
it hands a subgraph: a cached file changed anywhere (an output name, a node attribute, an opset
import, an initializer's name) is rebuilt with one warning; files of the older weights-only
checksum are rebuilt once with one warning for them all; a cached model onnxruntime rejects gets
one fresh build; a provider that fails to create a session is the subgraph's error, not a silent
retry on the CPU EP; a killed writer's temporary file is removed."""
from __future__ import annotations

import logging
import subprocess
import sys

import numpy as np
import pytest

onnx = pytest.importorskip("onnx", reason="onnx is not installed (the npu extra)")
ort = pytest.importorskip("onnxruntime", reason="onnxruntime is not installed (the npu extra)")

from edgellm.backends import npu_onnx  # noqa: E402
from edgellm.backends.npu_graphs import FfnGraph, LinearGraph, quantize, reference  # noqa: E402

CPU = ["CPUExecutionProvider"]
K, N, FF = 64, 96, 128


def _weights(rng, n, k, fmt):
    return quantize((rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32), fmt)


def _ffn(seed=0, name="blk.0.ffn"):
    rng = np.random.default_rng(seed)
    return FfnGraph(name, _weights(rng, 2 * FF, K, "int8b"), _weights(rng, K, FF, "int8b"), 32)


def _linear(seed=1, name="blk.0.qkv"):
    return LinearGraph(name, _weights(np.random.default_rng(seed), N, K, "int8b"), 32)


def _stats():
    return npu_onnx.CacheStats(**vars(npu_onnx.stats))


def _delta(before):
    s = npu_onnx.stats
    return s.damaged - before.damaged, s.built - before.built, s.loaded - before.loaded


def _edit(path, change):
    """Change the cached model as a bit flip could, keeping its metadata (checksum included)."""
    model = onnx.load_model_from_string(path.read_bytes())
    change(model)
    path.write_bytes(model.SerializeToString())


def _output_is_input(model):
    model.graph.output[0].name = "x"          # y -> x: the graph returns its input


def _block_size(model):
    node = next(n for n in model.graph.node if n.op_type == "MatMulNBits")
    next(a for a in node.attribute if a.name == "block_size").i = 96


def _opset(model):
    next(o for o in model.opset_import if o.domain == "").version = 13


def _flip_output_name_byte(path):
    data = bytearray(path.read_bytes())
    at = bytes(data).rfind(b"b\x13\n\x01y")   # GraphProto.output: ValueInfoProto named "y"
    assert at > 0
    data[at + 4] ^= 0x01                      # 'y' -> 'x', one bit
    path.write_bytes(bytes(data))


def _non_utf8_initializer_name(path):
    data = bytearray(path.read_bytes())
    at = bytes(data).rfind(b"down.s8")
    assert at > 0
    data[at] ^= 0x80                          # 'd' -> 0xe4: the name is no longer UTF-8
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", [
    lambda p: _edit(p, _output_is_input), lambda p: _edit(p, _block_size), lambda p: _edit(p, _opset),
    _flip_output_name_byte, _non_utf8_initializer_name,
], ids=["output_renamed", "node_attribute", "opset_import", "output_name_bit", "initializer_name_not_utf8"])
def test_damage_outside_the_weights_is_rebuilt(damage, tmp_path, caplog):
    """The checksum covered the initializers only: renaming the graph output y to x (one bit) made
    the cached FFN the identity and it loaded with no warning; a flipped MatMulNBits block_size or
    opset import passed too, and a non-UTF-8 initializer name raised AttributeError out of the
    check ('bytes' object has no attribute 'encode'). Now each is rebuilt with one warning."""
    graph = _ffn()
    npu_onnx.compile(graph, providers=CPU, cache_dir=tmp_path)
    path = npu_onnx.cache_path(graph, tmp_path)
    damage(path)
    before = _stats()
    with caplog.at_level(logging.WARNING, logger="edgellm"):
        sub = npu_onnx.compile(graph, providers=CPU, cache_dir=tmp_path)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and str(path) in warnings[0] and "rebuilding" in warnings[0], warnings
    assert _delta(before) == (1, 1, 0)
    x = np.random.default_rng(5).standard_normal((32, K)).astype(np.float32)
    ref = reference(graph, x)
    assert np.mean((sub.run(x) - ref) ** 2) / np.mean(ref ** 2) < 1e-4


def test_an_empty_file_is_called_empty(tmp_path, caplog):
    """An empty file parses as an empty ModelProto and was reported as "was built for another
    graph or version"."""
    graph = _linear()
    path = npu_onnx.cache_path(graph, tmp_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"")
    with caplog.at_level(logging.WARNING, logger="edgellm"):
        npu_onnx.compile(graph, providers=CPU, cache_dir=tmp_path)
    assert [r.getMessage() for r in caplog.records] == [f"npu model cache {path} is empty; rebuilding it"]


def test_a_file_larger_than_any_model_of_the_graph_is_refused_unread(tmp_path, caplog, monkeypatch):
    """A 1.9 GB (sparse) file in place of a cached model was read whole, 2 GB of memory and
    seconds, before protobuf's parse rejected it: its size alone now says it is not the model."""
    graph = _linear()
    path = npu_onnx.cache_path(graph, tmp_path)
    npu_onnx.compile(graph, providers=CPU, cache_dir=tmp_path)
    real, bound = path.stat().st_size, npu_onnx._size_bound(graph)
    assert real <= bound < 4 * real + (2 << 20)
    with open(path, "r+b") as f:
        f.truncate(1_900_000_000)
    reads, read_bytes = [], type(path).read_bytes
    monkeypatch.setattr(type(path), "read_bytes", lambda p: reads.append(p) or read_bytes(p))
    with caplog.at_level(logging.WARNING, logger="edgellm"):
        sub = npu_onnx.compile(graph, providers=CPU, cache_dir=tmp_path)
    assert path not in reads
    assert [r.getMessage() for r in caplog.records] == [
        f"npu model cache {path} is 1900000000 bytes, more than a model of this graph can be ({bound}); "
        "rebuilding it"]
    assert path.stat().st_size == real
    x = np.random.default_rng(6).standard_normal((32, K)).astype(np.float32)
    ref = reference(graph, x)
    assert np.mean((sub.run(x) - ref) ** 2) / np.mean(ref ** 2) < 1e-4


def _weights_only_format(path):
    """The file as edgellm wrote it before the whole-model checksum."""
    model = onnx.load_model_from_string(path.read_bytes())
    props = {p.key: p.value for p in model.metadata_props}
    del props[npu_onnx.CHECKSUM_PROP]
    props["edgellm.weights_sha256"] = "0" * 64
    onnx.helper.set_model_props(model, props)
    path.write_bytes(model.SerializeToString())


def test_files_of_the_weights_only_format_are_rebuilt_once_with_one_warning(tmp_path, caplog, monkeypatch):
    """Files written before the whole-model checksum are rebuilt (their checksum does not cover
    what changed), with one warning for all of them instead of one per file (hundreds on a real
    model); the rebuilt files load without a word."""
    monkeypatch.setattr(npu_onnx, "_warned_old_format", [])
    graphs = [_linear(1, "blk.0.qkv"), _linear(2, "blk.1.qkv"), _ffn(3, "blk.0.ffn")]
    for g in graphs:
        npu_onnx.compile(g, providers=CPU, cache_dir=tmp_path)
        _weights_only_format(npu_onnx.cache_path(g, tmp_path))
    before = _stats()
    with caplog.at_level(logging.INFO, logger="edgellm"):
        for g in graphs:
            npu_onnx.compile(g, providers=CPU, cache_dir=tmp_path)
    old = [r for r in caplog.records if "older edgellm" in r.getMessage()]
    assert [r.levelno for r in old] == [logging.WARNING, logging.INFO, logging.INFO]
    assert _delta(before) == (3, 3, 0)
    caplog.clear()
    before = _stats()
    with caplog.at_level(logging.INFO, logger="edgellm"):
        for g in graphs:
            npu_onnx.compile(g, providers=CPU, cache_dir=tmp_path)
    assert not caplog.records and _delta(before) == (0, 0, 3)


def test_a_cached_model_onnxruntime_rejects_gets_one_fresh_build(tmp_path, caplog, monkeypatch):
    """A damaged file that passed the checks (here: checks that say yes to anything) failed its
    session on every later load, and the op left the NPU for good; now the model is built afresh,
    found different, cached in its place, and the session is made from it."""
    graph = _linear()
    npu_onnx.compile(graph, providers=CPU, cache_dir=tmp_path)
    path = npu_onnx.cache_path(graph, tmp_path)
    _edit(path, _block_size)
    monkeypatch.setattr(npu_onnx, "_read_cached", lambda p, g: None)
    before = _stats()
    with caplog.at_level(logging.WARNING, logger="edgellm"):
        sub = npu_onnx.compile(graph, providers=CPU, cache_dir=tmp_path)
    assert len(caplog.records) == 1 and "onnxruntime rejected the cached model" in caplog.text
    assert _delta(before) == (1, 1, 1)
    assert path.read_bytes() == npu_onnx.build_model(graph).SerializeToString()
    x = np.random.default_rng(6).standard_normal((32, K)).astype(np.float32)
    ref = reference(graph, x)
    assert np.mean((sub.run(x) - ref) ** 2) / np.mean(ref ** 2) < 1e-4


def test_a_model_onnxruntime_rejects_as_built_is_not_retried(tmp_path, caplog, monkeypatch):
    """When the cached model is what a fresh build gives, the runtime rejects the model itself:
    the error is raised as is, with no second session and no rewrite of the file."""
    graph = _linear()
    npu_onnx.compile(graph, providers=CPU, cache_dir=tmp_path)
    tries = []

    def rejecting(self, ort_, model, so, chosen):
        tries.append(model)
        raise npu_onnx.SessionRejected(self.name, "injected: the EP cannot compile it")

    monkeypatch.setattr(npu_onnx.OnnxSubgraph, "_session", rejecting)
    before = _stats()
    with caplog.at_level(logging.WARNING, logger="edgellm"), \
            pytest.raises(npu_onnx.SessionRejected, match="injected"):
        npu_onnx.compile(graph, providers=CPU, cache_dir=tmp_path)
    assert len(tries) == 1 and not caplog.records and _delta(before) == (0, 0, 1)


def test_a_provider_that_fails_to_create_the_session_is_the_subgraphs_error(tmp_path, capsys):
    """onnxruntime's own fallback printed "EP Error ... Falling back to ['CPUExecutionProvider']"
    to stdout and made the session on the CPU EP: the subgraph claimed to be on the NPU while the
    CPU EP ran it, and the provider's error was lost. Now the provider's error is the subgraph's
    (the unit moves the op with it as the reason) and nothing is printed."""
    if "AzureExecutionProvider" not in ort.get_available_providers():
        pytest.skip("this onnxruntime build has no AzureExecutionProvider to stand in for an NPU EP")
    from onnxruntime.capi import onnxruntime_inference_collection as oic
    if not hasattr(oic.InferenceSession, "_create_inference_session"):
        pytest.skip("this onnxruntime creates sessions differently; the injection needs _create_inference_session")
    real = oic.InferenceSession._create_inference_session

    def failing(self, providers, provider_options, *a, **k):
        if any((p if isinstance(p, str) else p[0]) != "CPUExecutionProvider" for p in providers or ()):
            self._fallback_providers = ["CPUExecutionProvider"]     # as onnxruntime sets it
            raise RuntimeError("injected: NPU EP failed to compile the graph")
        return real(self, providers, provider_options, *a, **k)

    graph = _linear()
    mp = pytest.MonkeyPatch()
    mp.setattr(oic.InferenceSession, "_create_inference_session", failing)
    try:
        with pytest.raises(npu_onnx.NpuGraphError, match="injected: NPU EP failed to compile"):
            npu_onnx.compile(graph, providers=["AzureExecutionProvider", "CPUExecutionProvider"], cache_dir=tmp_path)
    finally:
        mp.undo()
    assert "EP Error" not in capsys.readouterr().out


def _dead_pid() -> int:
    return int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True, check=True).stdout)


def test_a_killed_writers_temporary_file_is_removed(tmp_path):
    """A writer killed mid-write left .<name>.pidNNNN.<rand>.tmp in the cache folder for good
    (28 MB for a small model's lm_head); the next write removes it, as the model cache does."""
    graph = _linear()
    path = npu_onnx.cache_path(graph, tmp_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    part = path.parent / f".{path.name}.pid{_dead_pid()}.x1y2z3.tmp"
    part.write_bytes(b"half a model")
    npu_onnx.compile(graph, providers=CPU, cache_dir=tmp_path)
    assert not part.exists() and path.exists()
