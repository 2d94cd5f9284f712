"""The npu unit's ONNX Runtime path: the static-shape subgraphs of npu_graphs.py as ONNX models,
run through ONNX Runtime execution providers (an NPU EP in priority order, else the CPU EP).

Graph forms (x (tokens, K) float32 in, y float32 out, fp32 accumulation everywhere):
    int8  per-row symmetric int8 activations quantized in the graph (row absmax / 127), then
          MatMulInteger with the int8 per-channel weights stored (K, N), int32 -> float, times
          x_scale (tokens, 1) times w_scale (1, N), + bias. Why this form: see _int8_matmul.
    int4  com.microsoft MatMulNBits (bits 4, blocks of 32, accuracy_level 1 = fp32 activations).
    fp16  fp16 weights, Cast to float32, MatMul (no fp16 arithmetic: Mali/NPU fp16 accumulation
          overflows past 65504). The CPU EP folds the Cast at load, so there it holds fp32 weights.
    fp32  MatMul.
    FFN   gate_up matmul -> Split -> g * Sigmoid(g) * up -> down matmul, one model.
Every model passes onnx.checker and strict shape inference before a runtime sees it (RELIABILITY 16).

Model cache: <cache_dir>/<graph name>-<key hash>.onnx, the key hash over graph.key(), the weight
formats, the builder version, the opset and the onnx/onnxruntime versions. Files are plain ONNX
with inline weights (a per-graph model stays far below protobuf's 2 GB limit, one file is one
atomic rename, and no external-data path is ever followed: a cached file that names external
data is treated as damaged, RELIABILITY 15). Each file records its key and a sha256 of the whole
serialized model but that checksum's own metadata entry (nodes, attributes, inputs, outputs,
initializers, opset imports: one flipped bit in a node or an output name changes what the model
computes as surely as one in the weights); a file that fails to parse, the key, the checksum or
the checker is rebuilt with one warning. Files written before the whole-model checksum (weights
only) are rebuilt once, one warning for all of them. A cached model that onnxruntime still rejects
is compared with a fresh build: when they differ, the fresh one replaces it and gets the session.
Sessions load the file by path: from bytes, the Python InferenceSession keeps its own copy of the
serialized model (measured: 2x the weight bytes resident instead of 1x). Temporary files a killed
writer left in the cache folder are removed before a write. The folder is bounded in size
(least recently used files evicted after each write, EDGELLM_NPU_CACHE_MB): npu_cache.py.
"""
from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..hashing import bulk_sha256, sha256
from ..errors import ConfigError, EdgeLLMError
from ..fileio import write_atomic
from . import npu_cache
from .npu_graphs import FORMATS, INT4_BLOCK, FfnGraph, LinearGraph, NpuGraphError, NpuInputError, QLinear

log = logging.getLogger("edgellm")

OPSET = 17                  # ai.onnx opset: QuantizeLinear per-axis (13+), Split sizes as input (13+)
IR_VERSION = 8              # the IR that goes with opset 17: loads in onnxruntime >= 1.12
MS_OPSET = 1                # com.microsoft (MatMulNBits)
BUILDER_VERSION = 1         # bump when a graph form changes: old cache files then miss
KEY_PROP = "edgellm.key"                  # metadata: the cache key the model was built for
CHECKSUM_PROP = "edgellm.model_sha256"    # metadata: _model_sha of the model without this entry
_WEIGHTS_ONLY_PROP = "edgellm.weights_sha256"   # the checksum files carried before CHECKSUM_PROP
MIN_ORT = (1, 17)           # MatMulNBits first shipped in onnxruntime 1.17
CPU_EP = "CPUExecutionProvider"
# The smallest row absmax the int8 activation scale uses. A zero row (the padding of a short
# chunk) would otherwise get scale 0: QuantizeLinear would compute 0 / 0, and what a runtime makes
# of NaN -> int8 (or of a zero scale at all) is not specified. The CPU EP happens to give 0.
_ROW_AMAX_FLOOR = 1e-30


class NpuUnavailable(EdgeLLMError):
    """onnx or onnxruntime cannot be used here (not installed, fails to import, too old)."""


class SessionRejected(NpuGraphError):
    """onnxruntime could not create a session for the model (an execution provider failed to
    compile it, or the runtime rejected the model itself)."""


@dataclass
class CacheStats:
    built: int = 0           # models built from the spec (cache miss or damaged file)
    loaded: int = 0          # models taken from the on-disk cache
    damaged: int = 0         # cached files rejected (each rebuilt, one warning each)
    sessions: int = 0        # InferenceSessions created


stats = CacheStats()


def available() -> tuple[bool, str]:
    """(True, versions and providers) or (False, why): not installed, fails to import, too old."""
    try:
        _import()
    except NpuUnavailable as e:
        return False, str(e)
    import onnx
    import onnxruntime as ort
    return True, (f"onnx {onnx.__version__}, onnxruntime {ort.__version__}, "
                  f"providers: {', '.join(ort.get_available_providers())}")


def _import():
    mods = []
    for name in ("onnx", "onnxruntime"):
        try:
            mods.append(__import__(name))
        except ImportError as e:
            raise NpuUnavailable(f"{name} is not installed (pip install 'edgellm[npu]'): {e}") from e
        except Exception as e:       # a broken wheel or a missing shared library
            raise NpuUnavailable(f"{name} fails to import: {type(e).__name__}: {e}") from e
    ort = mods[1]
    version = tuple(int(p) for p in re.findall(r"\d+", ort.__version__)[:2])
    if version < MIN_ORT:
        raise NpuUnavailable(f"onnxruntime {ort.__version__} is too old: MatMulNBits needs "
                             f">= {'.'.join(map(str, MIN_ORT))}")
    return mods


# --- building ---------------------------------------------------------------------------------

def _check_qlinear(graph: str, role: str, w: QLinear, n: int | None = None, k: int | None = None):
    def bad(what):
        raise NpuGraphError(graph, f"{role} weights: {what}")
    if w.fmt not in FORMATS:
        bad(f"format {w.fmt!r}, expected one of {FORMATS}")
    if w.fmt == "int8s":
        bad("int8s is LiteRT's sliced hybrid form; this path builds int8b (blocks of 32) for int8 weights")
    if n is not None and w.n != n or k is not None and w.k != k:
        bad(f"expected (N, K) = ({n if n is not None else w.n}, {k if k is not None else w.k}), found ({w.n}, {w.k})")
    if w.n < 1 or w.k < 1 or tuple(w.q.shape) != (w.n, w.k):
        bad(f"q has shape {tuple(w.q.shape)}, expected ({w.n}, {w.k})")
    want = {"int8": (np.int8, (w.n,)), "int8b": (np.int8, (w.n, w.k // INT4_BLOCK)),
            "int4": (np.uint8, (w.n, w.k // INT4_BLOCK)),
            "fp16": (np.float16, None), "fp32": (np.float32, None)}[w.fmt]
    if w.q.dtype != want[0]:
        bad(f"q is {w.q.dtype}, expected {np.dtype(want[0])} for {w.fmt}")
    if w.fmt in ("int4", "int8b") and w.k % INT4_BLOCK:
        bad(f"{w.fmt} needs K a multiple of {INT4_BLOCK}, found K={w.k}")
    if want[1] is not None and (w.scale is None or tuple(w.scale.shape) != want[1]):
        bad(f"scale has shape {None if w.scale is None else tuple(w.scale.shape)}, expected {want[1]}")
    if w.bias is not None and tuple(w.bias.shape) != (w.n,):
        bad(f"bias has shape {tuple(w.bias.shape)}, expected ({w.n},)")


def _dims(graph) -> tuple[int, int]:
    """(K, N) of the subgraph after checking the spec's shapes."""
    if not isinstance(graph, (LinearGraph, FfnGraph)):
        raise NpuGraphError(getattr(graph, "name", "?"), f"not a LinearGraph or FfnGraph: {type(graph).__name__}")
    if not isinstance(graph.tokens, int) or graph.tokens < 1:
        raise NpuGraphError(graph.name, f"tokens must be a positive int, found {graph.tokens!r}")
    if isinstance(graph, LinearGraph):
        _check_qlinear(graph.name, "linear", graph.w)
        return graph.w.k, graph.w.n
    gu, down = graph.gate_up, graph.down
    _check_qlinear(graph.name, "gate_up", gu)
    if gu.n % 2:
        raise NpuGraphError(graph.name, f"gate_up has {gu.n} rows, expected an even count (gate then up)")
    _check_qlinear(graph.name, "down", down, n=gu.k, k=gu.n // 2)
    return gu.k, gu.k


class _Builder:
    """Nodes and initializers of one model; names are prefixed by the graph's name so that an
    error from a runtime points at the op."""

    def __init__(self, graph_name: str, tokens: int):
        import onnx
        self.onnx, self.h, self.nh = onnx, onnx.helper, onnx.numpy_helper
        self.graph, self.tokens = graph_name, tokens
        self.nodes: list = []
        self.inits: list = []

    def const(self, name: str, arr) -> str:
        self.inits.append(self.nh.from_array(np.asarray(arr), name))
        return name

    def op(self, op: str, inputs: list[str], out: str | list[str], domain: str = "", **attrs):
        outs = [out] if isinstance(out, str) else out
        self.nodes.append(self.h.make_node(op, inputs, outs, name=f"{self.graph}/{outs[0]}",
                                           domain=domain, **attrs))
        return out

    def matmul(self, tag: str, x: str, w: QLinear, out: str) -> str:
        """out = x W^T (+ b) for x (tokens, w.k), in the form of w.fmt."""
        mm = out if w.bias is None else f"{tag}.mm"
        if w.fmt == "int8":
            self._int8_matmul(tag, x, w, mm)
        elif w.fmt == "int4":
            self._int4_matmul(tag, x, w, mm)
        elif w.fmt == "int8b":
            self._int8b_matmul(tag, x, w, mm)
        else:
            wt = np.ascontiguousarray(w.q.T)                     # (K, N) fp16 / fp32
            if w.fmt == "fp16":
                # Cast before MatMul: the products and sums stay fp32 (fp16 accumulation overflows
                # past 65504 and loses 1e-3 relative per add).
                wt = self.op("Cast", [self.const(f"{tag}.w16", wt)], f"{tag}.w", to=self.onnx.TensorProto.FLOAT)
            else:
                wt = self.const(f"{tag}.w", wt)
            self.op("MatMul", [x, wt], mm)
        if w.bias is not None:
            self.op("Add", [mm, self.const(f"{tag}.b", w.bias.astype(np.float32))], out)
        return out

    def _int8_matmul(self, tag: str, x: str, w: QLinear, out: str) -> str:
        # Why this form (ONNX's integer matmul with in-graph per-row quantization):
        #  - An NPU runs int8 x int8 -> int32. MatMulInteger is the op that says so, and nothing in
        #    it is constant-foldable: the int8 weights stay the resident copy (measured: session
        #    RSS grows by 1.0x the int8 bytes). The QDQ form (DequantizeLinear on the weights before
        #    a float MatMul) is fused only with per-tensor activation scales; with per-row scales
        #    the CPU EP dequantizes the weights every run and keeps an fp32 copy (4x).
        #  - Per-row (per token) scales: rows stay independent (a padded chunk's real rows do not
        #    depend on the padding), and a row's error is set by its own absmax, not the chunk's
        #    largest outlier. DynamicQuantizeLinear is per tensor and uint8: in exact arithmetic its
        #    error measured 1.5x-3.5x the per-row error (Gaussian rows, and rows with outlier
        #    channels); in onnxruntime 3x-60x, because uint8 x int8 MatMulInteger saturates on AVX2
        #    without VNNI (u8*s8 pairs summed in int16: wrong int32 sums, measured). int8 x int8 is
        #    exact there.
        #  - Symmetric (zero point 0): w and x need no zero-point correction terms.
        t = self.tokens
        amax = self.op("ReduceMax", [self.op("Abs", [x], f"{tag}.xabs")], f"{tag}.amax", axes=[1], keepdims=1)
        amax = self.op("Max", [amax, self.const(f"{tag}.floor", np.float32(_ROW_AMAX_FLOOR))], f"{tag}.amaxf")
        xs = self.op("Div", [amax, self.const(f"{tag}.c127", np.float32(127.0))], f"{tag}.xs")   # (tokens, 1)
        xs1 = self.op("Reshape", [xs, self.const(f"{tag}.rows", np.array([t], np.int64))], f"{tag}.xs1")
        # round(x / s) lies in [-127, 127]: QuantizeLinear rounds half to even and saturates
        xq = self.op("QuantizeLinear", [x, xs1, self.const(f"{tag}.xzp", np.zeros(t, np.int8))], f"{tag}.xq", axis=0)
        wq = self.const(f"{tag}.wq", np.ascontiguousarray(w.q.T))                              # (K, N) int8
        acc = self.op("MatMulInteger", [xq, wq], f"{tag}.acc")                                 # (tokens, N) int32
        # int32 -> float32 is exact below 2^24 and 6e-8 relative above it (127 * 127 * K)
        accf = self.op("Cast", [acc], f"{tag}.accf", to=self.onnx.TensorProto.FLOAT)
        y = self.op("Mul", [accf, xs], f"{tag}.xsc")
        return self.op("Mul", [y, self.const(f"{tag}.ws", w.scale.astype(np.float32)[None, :])], out)

    def _int4_matmul(self, tag: str, x: str, w: QLinear, out: str) -> str:
        nb = w.k // INT4_BLOCK
        return self.op(
            "MatMulNBits", [x, self.const(f"{tag}.w4", pack_int4(w.q)),
                            self.const(f"{tag}.s4", w.scale.astype(np.float32).reshape(w.n * nb))],
            out, domain="com.microsoft", K=w.k, N=w.n, bits=4, block_size=INT4_BLOCK,
            # 1 = fp32 activations. 0 lets the EP choose (fp16 on some ARM builds), 4 quantizes the
            # activations to int8 per block (measured NMSE 3e-5 instead of 2e-13).
            accuracy_level=1)
        # no zero_points input: MatMulNBits' default zero point is 2^(bits-1) = 8, QLinear's too


    def _int8b_matmul(self, tag: str, x: str, w: QLinear, out: str) -> str:
        # MatMulNBits with 8 bits: int8 weight blocks stay the resident copy, activations fp32
        # (accuracy_level 1); B is unsigned with the default zero point 2^(8-1) = 128
        nb = w.k // INT4_BLOCK
        b = (w.q.astype(np.int16) + 128).astype(np.uint8).reshape(w.n, nb, INT4_BLOCK)
        return self.op(
            "MatMulNBits", [x, self.const(f"{tag}.w8", np.ascontiguousarray(b)),
                            self.const(f"{tag}.s8", w.scale.astype(np.float32).reshape(w.n * nb))],
            out, domain="com.microsoft", K=w.k, N=w.n, bits=8, block_size=INT4_BLOCK, accuracy_level=1)


def pack_int4(q: np.ndarray) -> np.ndarray:
    """QLinear int4 q (N, K) uint8 in 0..15 -> MatMulNBits' B (N, K / 32, 16) uint8: per block
    of 32 along K, element 2i in the low nibble and element 2i+1 in the high nibble of byte i."""
    n, k = q.shape
    blocks = q.astype(np.uint8).reshape(n, k // INT4_BLOCK, INT4_BLOCK)
    return np.ascontiguousarray(blocks[:, :, 0::2] | (blocks[:, :, 1::2] << 4))


def build_model(graph):
    """The ONNX model of a LinearGraph or FfnGraph: x (tokens, K) float32 -> y float32, checked
    (check_model) before it is returned. Raises NpuGraphError naming the graph."""
    _import()
    k, n = _dims(graph)
    b = _Builder(graph.name, graph.tokens)
    if isinstance(graph, LinearGraph):
        b.matmul("linear", "x", graph.w, "y")
    else:
        ff = graph.gate_up.n // 2
        gu = b.matmul("gate_up", "x", graph.gate_up, "gu")                        # (tokens, 2 ff)
        g, u = b.op("Split", [gu, b.const("ffn.split", np.array([ff, ff], np.int64))], ["ffn.g", "ffn.u"], axis=1)
        act = b.op("Mul", [g, b.op("Sigmoid", [g], "ffn.sig")], "ffn.silu")         # silu(g) = g * sigmoid(g)
        b.matmul("down", b.op("Mul", [act, u], "ffn.h"), graph.down, "y")
    h, tp = b.h, b.onnx.TensorProto
    g = h.make_graph(b.nodes, _safe(graph.name) or "graph",
                     [h.make_tensor_value_info("x", tp.FLOAT, [graph.tokens, k])],
                     [h.make_tensor_value_info("y", tp.FLOAT, [graph.tokens, n])], b.inits)
    model = h.make_model(g, opset_imports=[h.make_opsetid("", OPSET), h.make_opsetid("com.microsoft", MS_OPSET)],
                         producer_name="edgellm", producer_version=str(BUILDER_VERSION), doc_string=graph.key())
    model.ir_version = IR_VERSION
    h.set_model_props(model, {KEY_PROP: _cache_key(graph)})
    # the checksum entry goes in last, over everything else the file holds (see _model_sha)
    model.metadata_props.add(key=CHECKSUM_PROP, value=_model_sha(model))
    return check_model(model, graph.name)


def check_model(model, graph_name: str):
    """onnx.checker plus strict shape inference; the graph's output must be the declared static
    shape. Returns the model; raises NpuGraphError(graph_name, what was rejected)."""
    onnx, _ = _import()
    try:
        onnx.checker.check_model(model)
        inferred = onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=True, data_prop=True)
    except Exception as e:        # ValidationError, InferenceError, and protobuf errors alike
        raise NpuGraphError(graph_name, f"ONNX checker rejected the model: {type(e).__name__}: {e}") from e
    for vi in list(inferred.graph.input) + list(inferred.graph.output):
        dims = [d.dim_value if d.HasField("dim_value") else None for d in vi.type.tensor_type.shape.dim]
        if len(dims) != 2 or None in dims or min(dims) < 1:
            raise NpuGraphError(graph_name, f"{vi.name} has shape {dims}, expected a static 2-d shape")
    return model


def _model_sha(model) -> str:
    """sha256 of the serialized model, which must not hold CHECKSUM_PROP: every field a runtime
    reads (the graph's nodes, attributes, inputs, outputs and initializers, the opset imports)
    and the key. Serialization is by field number, so a model read back serializes as built."""
    return bulk_sha256(model.SerializeToString(deterministic=True)).hexdigest()


def _pop_checksums(model) -> list[str]:
    """Remove the CHECKSUM_PROP entries from `model` (read from a file) and return their values."""
    props = model.metadata_props
    found = [p.value for p in props if p.key == CHECKSUM_PROP]
    for i in reversed([i for i, p in enumerate(props) if p.key == CHECKSUM_PROP]):
        del props[i]
    return found


# --- cache ------------------------------------------------------------------------------------

def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", name)[:64].lstrip(".")


def _formats(graph) -> str:
    return graph.w.fmt if isinstance(graph, LinearGraph) else f"{graph.gate_up.fmt}+{graph.down.fmt}"


def _cache_key(graph) -> str:
    import onnx
    import onnxruntime as ort
    return (f"edgellm-onnx-v{BUILDER_VERSION}|{graph.key()}|{_formats(graph)}|opset{OPSET}|"
            f"onnx{onnx.__version__}|ort{ort.__version__}")


def cache_dir_default() -> Path:
    from ..model.registry import edgellm_home
    return edgellm_home() / "cache" / "npu" / "onnx"


def cache_path(graph, cache_dir: str | os.PathLike | None = None) -> Path:
    """Where the model of `graph` is cached (it may not exist yet)."""
    _import()
    d = Path(cache_dir) if cache_dir is not None else cache_dir_default()
    digest = sha256(_cache_key(graph).encode()).hexdigest()[:32]
    return d / f"{_safe(graph.name) or 'graph'}-{digest}.onnx"


_OLD_FORMAT = "was written by an older edgellm (its checksum covers the weights only)"
_warned_old_format: list = []


def _size_bound(graph) -> int:
    """The most bytes a model of `graph` can serialize to: every initializer comes from the
    weights' q, scale and bias arrays at their size or less (int4 packs two per byte), plus a few
    per-token constants, the graph's nodes and the metadata. Twice that plus 1 MiB is generous
    and still far under protobuf's 2 GB limit for any graph the NPU unit builds."""
    ws = [graph.w] if isinstance(graph, LinearGraph) else [graph.gate_up, graph.down]
    weights = sum(a.nbytes for w in ws for a in (w.q, w.scale, w.bias) if a is not None)
    return min(2 * weights + 16 * graph.tokens + (1 << 20), 2**31 - 1)


def _read_cached(path: Path, graph) -> str | None:
    """None when `path` holds a valid model of `graph`, else why it does not. Never raises: a
    file that trips up a check (a name that is not UTF-8 ...) is damaged like any other."""
    try:
        return _check_cached(path, graph)
    except Exception as e:   # a check that fails on a malformed field: damaged, with its reason
        return f"cannot be checked ({type(e).__name__}: {e})"


def _check_cached(path: Path, graph) -> str | None:
    onnx, _ = _import()
    try:
        if path.is_symlink():
            return "is a symlink (the cache writes plain files)"
        size = path.stat().st_size
        if size == 0:
            # protobuf parses zero bytes as an empty model, which would then fail the key check
            return "is empty"
        bound = _size_bound(graph)
        if size > bound:
            # read before any check, a multi-gigabyte file costs its size in memory and seconds
            return f"is {size} bytes, more than a model of this graph can be ({bound})"
        model = onnx.load_model_from_string(path.read_bytes())
    except Exception as e:
        return f"does not parse ({type(e).__name__}: {e})"
    for t in model.graph.initializer:
        if t.data_location == onnx.TensorProto.EXTERNAL or t.external_data:
            # our writer never uses external data: a file that names some is not ours, and the
            # path it names is never opened (RELIABILITY 15)
            return f"initializer {t.name!r} names external data"
    checksums = _pop_checksums(model)
    if not checksums:
        if any(p.key == _WEIGHTS_ONLY_PROP for p in model.metadata_props):
            return _OLD_FORMAT
        return "has no checksum (not written by this cache)"
    if len(checksums) > 1:
        return f"has {len(checksums)} checksum entries, expected 1"
    if checksums[0] != _model_sha(model):
        return "fails its checksum"
    if {p.key: p.value for p in model.metadata_props}.get(KEY_PROP) != _cache_key(graph):
        return "was built for another graph or version"
    try:
        check_model(model, graph.name)
    except NpuGraphError as e:
        return e.reason
    return None


def _report_rejected(path: Path, why: str) -> None:
    """One warning per damaged file; files of the older format get one warning for them all
    (an upgrade rebuilds every cached model once: hundreds of files on a real model)."""
    stats.damaged += 1
    if why == _OLD_FORMAT:
        level = logging.INFO if _warned_old_format else logging.WARNING
        _warned_old_format.append(path)
        log.log(level, "npu model cache %s %s; rebuilding it%s", path, why,
                "" if level == logging.INFO else " (and any other such file, said once)")
        return
    log.warning("npu model cache %s %s; rebuilding it", path, why)


def cached_model(graph, cache_dir: str | os.PathLike | None = None) -> Path | bytes:
    """The model of `graph` from the cache, else built and cached. A path (what a session should
    load), or the serialized bytes when the cache cannot be written (one warning)."""
    return _cached_model(graph, cache_dir)[0]


def _cached_model(graph, cache_dir) -> tuple[Path | bytes, bool]:
    """(cached_model's answer, whether it came from the cache as it was)."""
    path = cache_path(graph, cache_dir)
    if path.exists() or path.is_symlink():
        why = _read_cached(path, graph)
        if why is None:
            stats.loaded += 1
            npu_cache.touch(path)          # a hit: most recently used, last to be evicted
            return path, True
        _report_rejected(path, why)
    return _store(path, build_model(graph).SerializeToString()), False


def _store(path: Path, data: bytes) -> Path | bytes:
    """Write a freshly built model to the cache: its path, or the bytes when it cannot be written."""
    stats.built += 1
    try:   # (write_atomic first removes the temporary files killed writers left here)
        write_atomic(path, data)
    except OSError as e:
        log.warning("npu model cache %s cannot be written (%s); the session loads from memory", path, e)
        return data
    npu_cache.evict(path.parent, ".onnx", keep=path)
    return path


def _rebuilt_if_different(graph, path: Path) -> Path | bytes | None:
    """A cached model onnxruntime rejected, built afresh: the new model (now cached) when it
    differs from the file (damage the checks did not see), None when they are the same (the
    runtime rejects the model itself; a second try would fail the same way)."""
    data = build_model(graph).SerializeToString()
    try:
        same = path.read_bytes() == data
    except OSError:
        same = False
    if same:
        return None
    stats.damaged += 1
    log.warning("npu model cache %s: onnxruntime rejected the cached model, which differs from a fresh "
                "build; rebuilding it", path)
    return _store(path, data)


# --- sessions ---------------------------------------------------------------------------------

def select_providers(providers, provider_options=None):
    """(chosen [(name, options)], skipped [(name, reason)]) from the caller's EP names in priority
    order: names this onnxruntime does not know or did not build are skipped with the reason.
    When none is left the CPU EP is chosen."""
    _, ort = _import()
    if isinstance(providers, str):
        providers = [providers]
    provider_options = dict(provider_options or {})
    unused = set(provider_options) - set(providers)
    if unused:
        raise ConfigError(f"provider_options for {sorted(unused)}, which are not in providers {list(providers)}")
    known, avail = set(ort.get_all_providers()), ort.get_available_providers()
    chosen, skipped = [], []
    for name in providers:
        if not isinstance(name, str):
            raise ConfigError(f"provider names are strings, found {name!r}")
        if name not in known:
            skipped.append((name, "not an onnxruntime execution provider"))
        elif name not in avail:
            skipped.append((name, f"not in this onnxruntime build (available: {', '.join(avail)})"))
        elif name not in (c for c, _ in chosen):
            chosen.append((name, {str(k): str(v) for k, v in provider_options.get(name, {}).items()}))
    if not chosen:
        chosen = [(CPU_EP, {})]
    return chosen, skipped


_reported_skips: set = set()


class OnnxSubgraph:
    """One subgraph in one InferenceSession, created once. Not re-entrant: one run at a time
    (the input binding and output buffer are the subgraph's)."""

    def __init__(self, graph, model: str | os.PathLike | bytes, *, providers, provider_options=None):
        _, ort = _import()
        self.name = graph.name
        self.tokens = graph.tokens
        self.k, self.n = _dims(graph)
        chosen, self.skipped = select_providers(providers, provider_options)
        names = [c for c, _ in chosen]
        if self.skipped and (tuple(self.skipped), tuple(names)) not in _reported_skips:
            # once per provider list, not once per layer; every subgraph keeps it in .skipped
            _reported_skips.add((tuple(self.skipped), tuple(names)))
            log.warning("npu graph %r: skipped %s; using %s", self.name,
                        "; ".join(f"{n} ({r})" for n, r in self.skipped), names)
        # Only the listed providers may run the graph. Without the CPU EP in the list, a node
        # the NPU EP rejects is an error (the caller moves the whole op to its CPU unit) rather
        # than a silent split of the graph between the NPU and ORT's CPU EP.
        strict = CPU_EP not in names
        so = ort.SessionOptions()
        # no spin-waiting (spinning pools steal the cores from the next session and from the CPU
        # units between calls: measured, prefill 8x slower than one session alone suggests)
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
        so.log_severity_level = 3
        # Each session runs on the calling thread: no pool of its own. A model holds hundreds of
        # these sessions (layers x ops x buckets), and each one's own intra-op pool made 368
        # threads on a 2-core machine. The shared alternative, onnxruntime's global pools
        # (set_global_thread_pool_sizes + use_per_session_threads=False, in the Python API since
        # 1.2x only), spins between runs with no Python switch to stop it (measured on 1.32: CPU
        # time = wall time across 2 ms gaps between runs), taking a big core from the CPU units
        # between NPU calls. On an NPU EP the work is the accelerator's; on the CPU EP a
        # subgraph then uses one core.
        so.intra_op_num_threads = 1
        so.inter_op_num_threads = 1
        # No CPU memory arena per session: each of a model's hundreds of sessions kept its arena
        # at the high-water mark of its own runs (activations, MatMulNBits' per-run scratch) and
        # never gave it back. SmolLM2-135M on the CPU EP, 20 requests of 10-400 tokens: 2.3 GiB
        # resident after them with arenas, 1.7 GiB without; the same logits bit for bit.
        so.enable_cpu_mem_arena = False
        record = hasattr(ort.InferenceSession, "get_provider_graph_assignment_info")
        if record:
            so.add_session_config_entry("session.record_ep_graph_assignment_info", "1")
        elif strict:
            so.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
        self._sess = self._session(ort, model, so, chosen)
        stats.sessions += 1
        self.providers_used: list[str] = self._sess.get_providers()
        dropped = [n for n in names if n not in self.providers_used]
        if dropped:
            # an onnxruntime that retried on its fallback providers despite enable_fallback=0
            # (older releases ignore it): the graph would run where the profile did not say
            raise SessionRejected(self.name, f"onnxruntime left out {', '.join(dropped)} of {names} "
                                             f"(session providers: {self.providers_used})")
        # EP -> ["op_type node_name", ...] as onnxruntime placed the (optimized) nodes
        self.assignment: dict[str, list[str]] = {}
        if record:
            for sub in self._sess.get_provider_graph_assignment_info():
                self.assignment.setdefault(sub.ep_name, []).extend(f"{n.op_type} {n.name}" for n in sub.get_nodes())
        on_cpu = self.assignment.get(CPU_EP, [])
        if strict and on_cpu:
            total = sum(map(len, self.assignment.values()))
            ops = sorted({n.split(" ")[0] for n in on_cpu})
            raise NpuGraphError(self.name, f"{', '.join(names)} did not take {len(on_cpu)} of {total} nodes "
                                           f"(op types {', '.join(ops)}; first {on_cpu[0]!r})")
        ins, outs = self._sess.get_inputs(), self._sess.get_outputs()
        shapes = ([tuple(i.shape) for i in ins], [tuple(o.shape) for o in outs])
        if shapes != ([(self.tokens, self.k)], [(self.tokens, self.n)]):
            raise NpuGraphError(self.name, f"the session's shapes {shapes[0]} -> {shapes[1]} are not "
                                           f"({self.tokens}, {self.k}) -> ({self.tokens}, {self.n})")
        self._in, self._out_name = ins[0].name, outs[0].name
        self._out = np.empty((self.tokens, self.n), np.float32)          # (tokens, N): bound once
        self._io = self._sess.io_binding()
        self._io.bind_output(self._out_name, "cpu", 0, np.float32, list(self._out.shape), self._out.ctypes.data)

    def _session(self, ort, model, so, chosen):
        """The InferenceSession on exactly the chosen providers. enable_fallback=0: by default the
        Python InferenceSession answers a provider that fails to create the session by printing
        "EP Error ... Falling back to ['CPUExecutionProvider']" to stdout and retrying on the CPU
        EP, which would hide the provider's failure (the unit would claim ops the CPU EP runs);
        here the failure is the subgraph's, with the provider's own message."""
        names = [c for c, _ in chosen]
        source = model if isinstance(model, bytes) else str(model)
        try:
            sess = ort.InferenceSession(source, so, providers=names, provider_options=[o for _, o in chosen],
                                        enable_fallback=0)
        except Exception as e:
            raise SessionRejected(self.name, f"onnxruntime with {names} could not create a session: "
                                             f"{type(e).__name__}: {e}") from e
        if hasattr(sess, "disable_fallback"):
            sess.disable_fallback()      # nor a retry on other providers when a run fails
        return sess

    def run(self, x: np.ndarray) -> np.ndarray:
        """y for x (tokens, K) float32. Returns the subgraph's output buffer (tokens, N): the
        next run overwrites it; copy what must be kept."""
        if not isinstance(x, np.ndarray) or x.dtype != np.float32 or x.shape != (self.tokens, self.k):
            found = f"{x.dtype} {x.shape}" if isinstance(x, np.ndarray) else type(x).__name__
            raise NpuInputError(f"npu graph {self.name!r}: x must be float32 {(self.tokens, self.k)}, found {found}")
        x = np.ascontiguousarray(x)
        # binds the caller's memory as is (no copy); the binding is dropped before returning so
        # that no pointer to x outlives this call
        self._io.bind_input(self._in, "cpu", 0, np.float32, list(x.shape), x.ctypes.data)
        try:
            self._sess.run_with_iobinding(self._io)
        except Exception as e:
            raise NpuGraphError(self.name, f"run failed: {type(e).__name__}: {e}") from e
        finally:
            self._io.clear_binding_inputs()
        return self._out


def compile(graph, *, providers, provider_options=None,
            cache_dir: str | os.PathLike | None = None) -> OnnxSubgraph:
    """The subgraph of `graph`, its model from the cache (else built, checked and cached), in a
    session on the first available of `providers` (EP names in priority order; options per name
    in `provider_options`). Raises NpuUnavailable, NpuGraphError (the caller falls back to the
    CPU for this op) or ConfigError."""
    _dims(graph)
    npu_cache.cap_bytes()          # a bad EDGELLM_NPU_CACHE_MB is refused on a hit as on a miss
    model, from_cache = _cached_model(graph, cache_dir)

    def session(m):
        sub = OnnxSubgraph(graph, m, providers=providers, provider_options=provider_options)
        if not isinstance(m, bytes):
            npu_cache.hold(sub, m)     # its file is not evicted while the subgraph lives
        return sub

    try:
        return session(model)
    except SessionRejected:
        # a cached file can be damaged in a way its checks pass (a collision, or a bug in them);
        # before the op leaves the NPU, a fresh build gets the one more try
        fresh = _rebuilt_if_different(graph, model) if from_cache else None
        if fresh is None:
            raise
        return session(fresh)
