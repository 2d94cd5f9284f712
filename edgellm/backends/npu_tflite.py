"""The npu unit's LiteRT/TFLite path: static-shape prefill subgraphs (npu_graphs.LinearGraph,
FfnGraph) written as .tflite flatbuffers by edgellm itself, checked, cached on disk, and run by a
LiteRT interpreter with the external delegate the caller names (an NPU vendor's .so), or on the
default CPU path (XNNPACK) when it names none.

Flatbuffer forms, per weight format (x is (tokens, K) float32, y float32):
    fp32  FULLY_CONNECTED(x, W f32 (N, K), b f32 (N,) or omitted)
    fp16  W f16 (N, K) -> DEQUANTIZE -> f32, then FULLY_CONNECTED: the standard fp16-weights form
          the converter writes and delegates recognize (f16 -> f32 is exact)
    int8  FULLY_CONNECTED(x f32, W int8 (N, K) with per-output-channel scales (N,), zero points 0,
          quantized_dimension 0, b f32): the "dynamic range" (hybrid) form. The kernel quantizes
          each row of x to int8 on the fly; asymmetric_quantize_inputs is set (see _ASYMMETRIC).
    int4  FULLY_CONNECTED(x f32, W INT4 (N, K), b f32): W packed two values a byte, low nibble
          first, signed (q - 8); its quantization is BlockwiseQuantization {scales: an f16
          (N, K / 32) constant tensor, zero_points: -1, block_size: 32}. Scales are stored f16 (with
          f32 or bf16 scale tensors this runtime's kernels refuse the model or misread it): the
          builtin kernel uses them as they are, XNNPACK rounds them once more to bf16. Inputs are
          quantized per row, asymmetric, by both kernels.
          Runs only where the runtime's self-check passes (int4_supported()).
FfnGraph: FC(gate_up) -> SPLIT(axis 1) -> g, u; LOGISTIC(g) -> s; MUL(g, s) -> silu;
          MUL(silu, u) -> h; FC(down, h) -> y. One graph, one invoke.

Cache: <cache_dir>/<name>-<sha256(writer version, key)[:32]>.tflc = a header (magic, cache format,
writer version, payload length, sha256 of the payload, digest of the graph key) and the .tflite
bytes. A file that fails any check is rebuilt with one warning, never trusted. Every model, built
or loaded, passes validate() before an interpreter sees it (RELIABILITY.md item 16).
"""
from __future__ import annotations

import ctypes
import hashlib
import importlib
import logging
import math
import os
import re
import struct
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import ConfigError, EdgeLLMError, ModelFormatError
from ..fileio import fsync_dir
from .npu_graphs import INT4_BLOCK, FfnGraph, LinearGraph, NpuGraphError, NpuInputError, QLinear, reference

log = logging.getLogger("edgellm")

WRITER_VERSION = 1          # bump when build_flatbuffer's output changes: old cache files miss
SCHEMA_VERSION = 3          # the TFLite schema version the file declares ("TFL3")
FORMATS = ("int8", "int4", "fp16", "fp32")
# Dynamic-range FC quantizes each input row to int8. Asymmetric (scale (max - min) / 255 and a
# zero point; the range always holds 0) never wastes half the int8 range on a row whose values
# are one-sided (rows of mean 1.5: NMSE 1.0e-5 against 2.3e-5 symmetric, measured on the builtin
# kernel), and XNNPACK's dynamically quantized FC is asymmetric whatever this flag says: with it
# set, the builtin kernel and XNNPACK compute the same thing (tests check both bit-for-bit
# against an emulation of this scheme).
_ASYMMETRIC = True

_MAX_BYTES = (1 << 31) - 1  # flatbuffers' own limit (uoffset_t); larger models use offset buffers
_MAX_TENSORS = 64           # caps on counts, checked before anything is iterated
_MAX_OPS = 32
_MAX_BUFFERS = 64
_MAX_OPCODES = 8
_MAX_NAME = 256
_MAX_DIM = 1 << 24
_MAX_ELEMENTS = 1 << 28     # per tensor: 1 GiB of f32


# -- errors ------------------------------------------------------------------------------------
class TfliteModelError(ModelFormatError):
    """A .tflite flatbuffer (built here or read from the cache) that fails validate(); `path` is
    the file or "<memory>", `field` the schema path of what is wrong."""


class TfliteUnavailable(EdgeLLMError):
    """Neither ai_edge_litert nor tflite_runtime can run a model in this process."""


class TfliteDelegateError(EdgeLLMError):
    """The named external delegate could not be loaded, or refused the subgraph."""

    def __init__(self, delegate: str, reason: str):
        self.delegate, self.reason = delegate, reason
        super().__init__(f"TFLite delegate {delegate!r}: {reason}")


# -- counters ----------------------------------------------------------------------------------
@dataclass
class TfliteStats:
    built: int = 0            # flatbuffers written by build_flatbuffer through the cache (misses)
    loaded: int = 0           # flatbuffers read back from the disk cache (hits)
    rebuilt: int = 0          # cache files rejected (damaged, stale) and rebuilt; each warned once
    interpreters: int = 0     # interpreters created for TfliteSubgraphs (probes not counted)

    def reset(self) -> None:
        self.built = self.loaded = self.rebuilt = self.interpreters = 0


stats = TfliteStats()


# -- schema: the tflite package's modules, and the enum values used ---------------------------
def _schema(name: str):
    """The tflite package's module for one table, imported when first needed (this module loads
    without it; available() says what is missing). `from tflite import Model` would give the
    class: the package re-exports every module's names, and the short aliases (Start,
    AddShape...) collide across tables, so only the prefixed builder functions are used."""
    try:
        return importlib.import_module(f"tflite.{name}")
    except ImportError as e:
        raise TfliteUnavailable(f"the tflite schema package is needed to write and check models "
                                f"(pip install tflite): {e}") from e


class _TT:                  # TensorType values used (schema.fbs; tests compare with the package)
    FLOAT32, FLOAT16, INT32, INT8, INT4 = 0, 1, 2, 9, 17


class _Opt:                 # BuiltinOptions union tags used
    NONE, FullyConnectedOptions, MulOptions, SplitOptions, DequantizeOptions = 0, 8, 21, 35, 38


_FC, _DEQ, _SPLIT, _LOGISTIC, _MUL = 9, 6, 49, 14, 18          # BuiltinOperator values used
_OP_NAME = {_FC: "FULLY_CONNECTED", _DEQ: "DEQUANTIZE", _SPLIT: "SPLIT", _LOGISTIC: "LOGISTIC",
            _MUL: "MUL"}
_OPTIONS = {_FC: _Opt.FullyConnectedOptions, _DEQ: _Opt.DequantizeOptions,
            _SPLIT: _Opt.SplitOptions, _LOGISTIC: _Opt.NONE, _MUL: _Opt.MulOptions}
_MAX_VERSION = {_FC: 12, _DEQ: 3, _SPLIT: 1, _LOGISTIC: 1, _MUL: 1}    # the versions written
_INT4 = _TT.INT4
_BITS = {_TT.FLOAT32: 32, _TT.FLOAT16: 16, _TT.INT8: 8, _TT.INT32: 32, _INT4: 4}
_TYPE_NAME = {_TT.FLOAT32: "FLOAT32", _TT.FLOAT16: "FLOAT16", _TT.INT8: "INT8", _TT.INT32: "INT32",
              _INT4: "INT4"}
_BLOCKWISE = 2              # QuantizationDetails.BlockwiseQuantization (newer than tflite 2.18)


def _nbytes(ttype: int, shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return (n * _BITS[ttype] + 7) // 8


# -- the writer --------------------------------------------------------------------------------
@dataclass
class _Tensor:
    name: str
    shape: tuple[int, ...]
    type: int
    data: bytes | None = None             # constant tensors only
    scale: np.ndarray | None = None       # int8: per-channel scales along dim 0
    blockwise: int | None = None          # int4: index of the f16 (N, K / 32) scale tensor


@dataclass
class _Node:
    code: int
    version: int
    inputs: list[int]                     # -1: the omitted optional FC bias
    outputs: list[int]
    options: dict


class _Graph:
    def __init__(self):
        self.tensors: list[_Tensor] = []
        self.nodes: list[_Node] = []

    def tensor(self, name, shape, ttype, data=None, **quant) -> int:
        self.tensors.append(_Tensor(name, tuple(int(d) for d in shape), ttype, data, **quant))
        return len(self.tensors) - 1

    def op(self, code, version, inputs, outputs, **options) -> None:
        self.nodes.append(_Node(code, version, list(inputs), list(outputs), options))

    def fully_connected(self, name: str, x: int, w: QLinear, tokens: int) -> int:
        """x (tokens, K) f32 -> (tokens, N) f32 through W in w's format."""
        hybrid = w.fmt in ("int8", "int4")
        if w.fmt == "fp32":
            wt = self.tensor(f"{name}.weight", (w.n, w.k), _TT.FLOAT32, _le(w.q, "<f4"))
        elif w.fmt == "fp16":
            w16 = self.tensor(f"{name}.weight_f16", (w.n, w.k), _TT.FLOAT16, _le(w.q, "<f2"))
            wt = self.tensor(f"{name}.weight", (w.n, w.k), _TT.FLOAT32)
            self.op(_DEQ, 3, [w16], [wt])
        elif w.fmt == "int8":
            q, scale = _nonzero_scales(w.q, w.scale, 0)
            wt = self.tensor(f"{name}.weight", (w.n, w.k), _TT.INT8, _le(q, "i1"),
                             scale=np.ascontiguousarray(scale, "<f4"))
        else:
            q, scale = _nonzero_scales(w.q, w.scale, 8)
            sc = self.tensor(f"{name}.weight_scales", (w.n, w.k // INT4_BLOCK), _TT.FLOAT16,
                             _le(scale, "<f2"))
            nib = (np.asarray(q, np.uint8) ^ 8).reshape(-1)      # q - 8 as a 4-bit two's complement
            wt = self.tensor(f"{name}.weight", (w.n, w.k), _INT4,
                             (nib[0::2] | (nib[1::2] << 4)).astype(np.uint8).tobytes(), blockwise=sc)
        b = -1
        if w.bias is not None:
            b = self.tensor(f"{name}.bias", (w.n,), _TT.FLOAT32, _le(w.bias, "<f4"))
        # op versions as TFLite's op_version.cc assigns them: per-channel hybrid 12, no bias 6
        version = 12 if hybrid else (1 if b >= 0 else 6)
        y = self.tensor(f"{name}.out", (tokens, w.n), _TT.FLOAT32)
        self.op(_FC, version, [x, wt, b], [y], asymmetric=hybrid and _ASYMMETRIC)
        return y


def _nonzero_scales(q: np.ndarray, scale: np.ndarray, zero_q: int):
    """XNNPACK refuses a quantized tensor with a zero (or subnormal) scale, and quantize() gives
    an all-zero row (int8) or block (int4) scale 0. Those weights are exactly 0 whatever the
    scale: write them as q = zero_q with scale 1, the same dequantized values."""
    scale = np.asarray(scale, np.float32)
    zero = scale == 0
    if not zero.any():
        return q, scale
    wide = zero if zero.ndim == 1 else np.repeat(zero, INT4_BLOCK, axis=1)   # (N,) or (N, K)
    q = np.where(wide if wide.ndim == 2 else wide[:, None], q.dtype.type(zero_q), q)
    return q, np.where(zero, np.float32(1), scale)


def _le(a, dtype: str) -> bytes:
    return np.ascontiguousarray(a, dtype=dtype).tobytes()


def supports(graph) -> tuple[bool, str]:
    """(True, "") when build_flatbuffer can write `graph`, else (False, why). Whether this
    process's runtime can run int4 is a separate question: int4_supported()."""
    if isinstance(graph, LinearGraph):
        mats = [("w", graph.w)]
    elif isinstance(graph, FfnGraph):
        mats = [("gate_up", graph.gate_up), ("down", graph.down)]
    else:
        return False, f"not an npu_graphs LinearGraph or FfnGraph: {type(graph).__name__}"
    if isinstance(graph.tokens, bool) or not isinstance(graph.tokens, (int, np.integer)) \
            or not 1 <= graph.tokens <= _MAX_DIM:
        return False, f"tokens must be an int in 1..{_MAX_DIM}, got {graph.tokens!r}"
    for field, w in mats:
        if not isinstance(w, QLinear) or w.fmt not in FORMATS:
            return False, f"{field}: weight format {getattr(w, 'fmt', w)!r}, expected one of {FORMATS}"
        if not (1 <= w.n <= _MAX_DIM and 1 <= w.k <= _MAX_DIM) or w.n * w.k > _MAX_ELEMENTS \
                or tuple(np.shape(w.q)) != (w.n, w.k):
            return False, f"{field}: weights {np.shape(w.q)} do not match (N, K) = ({w.n}, {w.k})"
        if w.bias is not None and tuple(np.shape(w.bias)) != (w.n,):
            return False, f"{field}: bias {np.shape(w.bias)}, expected ({w.n},)"
        q = np.asarray(w.q)
        if w.fmt == "int8" and q.dtype != np.int8:
            return False, f"{field}: int8 weights stored as {q.dtype}, expected int8"
        if w.fmt == "int4" and (q.dtype != np.uint8 or (q.size and int(q.max()) > 15)):
            return False, f"{field}: int4 weights must be uint8 values in 0..15 (one per byte)"
        if w.fmt == "int8":
            if w.scale is None or tuple(np.shape(w.scale)) != (w.n,):
                return False, f"{field}: int8 needs scale (N,) = ({w.n},), got {np.shape(w.scale)}"
            s = np.asarray(w.scale, np.float32)
            # zero is fine (rewritten, see _nonzero_scales); XNNPACK needs the rest normal, > 0
            bad = (s != 0) & ~((s >= np.finfo(np.float32).tiny) & np.isfinite(s))
            if bad.any():
                return False, (f"{field}: {int(bad.sum())} int8 scales are negative, subnormal "
                               f"or not finite (e.g. {float(s[bad][0]):.3g})")
        if w.fmt == "int4":
            if w.k % INT4_BLOCK or w.scale is None or tuple(np.shape(w.scale)) != (w.n, w.k // INT4_BLOCK):
                return False, f"{field}: int4 needs K % {INT4_BLOCK} == 0 and scale (N, K / {INT4_BLOCK})"
            s = np.asarray(w.scale, np.float32)
            with np.errstate(over="ignore"):
                s16 = s.astype(np.float16).astype(np.float32)
            # the runtime reads f16 scales: refuse rather than silently lose a block's weights
            bad = (s != 0) & ~((s > 0) & np.isfinite(s16) & (np.abs(s16 - s) <= 2.0 ** -11 * s))
            if bad.any():
                return False, (f"{field}: {int(bad.sum())} int4 block scales are negative or do not "
                               f"fit float16 (e.g. {float(s[bad][0]):.3g}); this path stores them f16")
    if isinstance(graph, FfnGraph):
        gu, dn = graph.gate_up, graph.down
        if gu.n % 2 or dn.k != gu.n // 2 or dn.n != gu.k:
            return False, (f"gate_up ({gu.n}, {gu.k}) and down ({dn.n}, {dn.k}) are not "
                           "(2 * ff, d) and (d, ff)")
    return True, ""


def build_flatbuffer(graph) -> bytes:
    """The .tflite model for `graph`: input (tokens, K) f32, output f32. NpuGraphError if rejected."""
    ok, why = supports(graph)
    if not ok:
        raise NpuGraphError(getattr(graph, "name", "?"), why)
    g = _Graph()
    T = int(graph.tokens)
    if isinstance(graph, LinearGraph):
        x = g.tensor("x", (T, graph.w.k), _TT.FLOAT32)
        y = g.fully_connected("linear", x, graph.w, T)
    else:
        d, ff = graph.gate_up.k, graph.gate_up.n // 2
        x = g.tensor("x", (T, d), _TT.FLOAT32)
        gu = g.fully_connected("gate_up", x, graph.gate_up, T)            # (T, 2 ff)
        axis = g.tensor("split_axis", (), _TT.INT32, np.array(1, "<i4").tobytes())
        gate = g.tensor("gate", (T, ff), _TT.FLOAT32)
        up = g.tensor("up", (T, ff), _TT.FLOAT32)
        g.op(_SPLIT, 1, [axis, gu], [gate, up], num_splits=2)
        sig = g.tensor("sigmoid", (T, ff), _TT.FLOAT32)
        g.op(_LOGISTIC, 1, [gate], [sig])
        silu = g.tensor("silu", (T, ff), _TT.FLOAT32)
        g.op(_MUL, 1, [gate, sig], [silu])
        h = g.tensor("h", (T, ff), _TT.FLOAT32)
        g.op(_MUL, 1, [silu, up], [h])
        y = g.fully_connected("down", h, graph.down, T)                 # (T, d)
    return _serialize(g, x, y, f"edgellm npu subgraph {graph.name[:64]} (writer {WRITER_VERSION})")


def _serialize(g: _Graph, x: int, y: int, description: str) -> bytes:
    (Buffer, FullyConnectedOptions, Model, MulOptions, Operator, OperatorCode,
     QuantizationParameters, SplitOptions, SubGraph, Tensor) = map(_schema, (
        "Buffer", "FullyConnectedOptions", "Model", "MulOptions", "Operator", "OperatorCode",
        "QuantizationParameters", "SplitOptions", "SubGraph", "Tensor"))
    import flatbuffers

    data_bytes = sum(len(t.data) for t in g.tensors if t.data)
    b = flatbuffers.Builder(data_bytes + 16 * len(g.tensors) + 8192)   # one allocation, no regrowth

    def ivec(values, start):
        start(b, len(values))
        for v in reversed(values):
            b.PrependInt32(int(v))
        return b.EndVector()

    def tvec(offs, start):
        start(b, len(offs))
        for o in reversed(offs):
            b.PrependUOffsetTRelative(o)
        return b.EndVector()

    # buffers: 0 is the empty sentinel every non-constant tensor points at
    buf_of, buf_offs = {}, []
    Buffer.BufferStart(b)
    buf_offs.append(Buffer.BufferEnd(b))
    for i, t in enumerate(g.tensors):
        if t.data is None:
            continue
        # 16-byte aligned data, as the converter writes it: kernels may read weights in place
        b.StartVector(1, len(t.data), 16)
        b.head -= len(t.data)
        b.Bytes[b.head:b.head + len(t.data)] = t.data
        vec = b.EndVector()
        Buffer.BufferStart(b)
        Buffer.BufferAddData(b, vec)
        buf_of[i] = len(buf_offs)
        buf_offs.append(Buffer.BufferEnd(b))

    tensor_offs = []
    for i, t in enumerate(g.tensors):
        name = b.CreateString(t.name)
        shape = ivec(t.shape, Tensor.TensorStartShapeVector)
        quant = None
        if t.scale is not None:
            scale = b.CreateNumpyVector(t.scale.astype("<f4"))
            zp = b.CreateNumpyVector(np.zeros(len(t.scale), "<i8"))
            QuantizationParameters.QuantizationParametersStart(b)
            QuantizationParameters.QuantizationParametersAddScale(b, scale)
            QuantizationParameters.QuantizationParametersAddZeroPoint(b, zp)
            QuantizationParameters.QuantizationParametersAddQuantizedDimension(b, 0)
            quant = QuantizationParameters.QuantizationParametersEnd(b)
        elif t.blockwise is not None:
            # BlockwiseQuantization {scales: int32, zero_points: int32, block_size: int32,
            # block_shape: [int32]}: not in the tflite 2.18 package, so written field by field
            b.StartObject(4)
            b.PrependInt32Slot(0, t.blockwise, 0)
            b.PrependInt32Slot(1, -1, 0)                   # no zero-point tensor: symmetric
            b.PrependInt32Slot(2, INT4_BLOCK, 0)
            details = b.EndObject()
            QuantizationParameters.QuantizationParametersStart(b)
            QuantizationParameters.QuantizationParametersAddDetailsType(b, _BLOCKWISE)
            QuantizationParameters.QuantizationParametersAddDetails(b, details)
            QuantizationParameters.QuantizationParametersAddQuantizedDimension(b, 0)
            quant = QuantizationParameters.QuantizationParametersEnd(b)
        Tensor.TensorStart(b)
        Tensor.TensorAddShape(b, shape)
        Tensor.TensorAddType(b, t.type)
        Tensor.TensorAddBuffer(b, buf_of.get(i, 0))
        Tensor.TensorAddName(b, name)
        if quant is not None:
            Tensor.TensorAddQuantization(b, quant)
        tensor_offs.append(Tensor.TensorEnd(b))

    codes = []                                         # (builtin code, version), first-use order
    for n in g.nodes:
        if (n.code, n.version) not in codes:
            codes.append((n.code, n.version))
    op_offs = []
    for n in g.nodes:
        ins = ivec(n.inputs, Operator.OperatorStartInputsVector)
        outs = ivec(n.outputs, Operator.OperatorStartOutputsVector)
        opt = None
        if n.code == _FC:
            FullyConnectedOptions.FullyConnectedOptionsStart(b)
            FullyConnectedOptions.FullyConnectedOptionsAddAsymmetricQuantizeInputs(b, n.options["asymmetric"])
            opt = FullyConnectedOptions.FullyConnectedOptionsEnd(b)
        elif n.code == _SPLIT:
            SplitOptions.SplitOptionsStart(b)
            SplitOptions.SplitOptionsAddNumSplits(b, n.options["num_splits"])
            opt = SplitOptions.SplitOptionsEnd(b)
        elif n.code == _MUL:
            MulOptions.MulOptionsStart(b)
            opt = MulOptions.MulOptionsEnd(b)
        elif n.code == _DEQ:
            b.StartObject(0)                           # DequantizeOptions: an empty table
            opt = b.EndObject()
        Operator.OperatorStart(b)
        Operator.OperatorAddOpcodeIndex(b, codes.index((n.code, n.version)))
        Operator.OperatorAddInputs(b, ins)
        Operator.OperatorAddOutputs(b, outs)
        if opt is not None:
            Operator.OperatorAddBuiltinOptionsType(b, _OPTIONS[n.code])
            Operator.OperatorAddBuiltinOptions(b, opt)
        op_offs.append(Operator.OperatorEnd(b))

    tensors = tvec(tensor_offs, SubGraph.SubGraphStartTensorsVector)
    ops = tvec(op_offs, SubGraph.SubGraphStartOperatorsVector)
    inputs = ivec([x], SubGraph.SubGraphStartInputsVector)
    outputs = ivec([y], SubGraph.SubGraphStartOutputsVector)
    sg_name = b.CreateString("main")
    SubGraph.SubGraphStart(b)
    SubGraph.SubGraphAddTensors(b, tensors)
    SubGraph.SubGraphAddInputs(b, inputs)
    SubGraph.SubGraphAddOutputs(b, outputs)
    SubGraph.SubGraphAddOperators(b, ops)
    SubGraph.SubGraphAddName(b, sg_name)
    sg = SubGraph.SubGraphEnd(b)

    code_offs = []
    for code, version in codes:
        OperatorCode.OperatorCodeStart(b)
        # deprecated_builtin_code is an int8: codes past 127 put 127 there (the placeholder)
        OperatorCode.OperatorCodeAddDeprecatedBuiltinCode(b, min(code, 127))
        OperatorCode.OperatorCodeAddBuiltinCode(b, code)
        OperatorCode.OperatorCodeAddVersion(b, version)
        code_offs.append(OperatorCode.OperatorCodeEnd(b))
    opcodes = tvec(code_offs, Model.ModelStartOperatorCodesVector)
    subgraphs = tvec([sg], Model.ModelStartSubgraphsVector)
    buffers = tvec(buf_offs, Model.ModelStartBuffersVector)
    desc = b.CreateString(description)
    Model.ModelStart(b)
    Model.ModelAddVersion(b, SCHEMA_VERSION)
    Model.ModelAddOperatorCodes(b, opcodes)
    Model.ModelAddSubgraphs(b, subgraphs)
    Model.ModelAddDescription(b, desc)
    Model.ModelAddBuffers(b, buffers)
    b.Finish(Model.ModelEnd(b), file_identifier=b"TFL3")
    return bytes(b.Output())


# -- the validator -----------------------------------------------------------------------------
# Field slots each table may carry (slot: byte size of the inline field; 4 for offsets). Anything
# else present is an error: these are edgellm's own files, and the interpreter would read it.
_U8, _I32, _OFF = 1, 4, 4
_FIELDS = {
    "Model": {0: _I32, 1: _OFF, 2: _OFF, 3: _OFF, 4: _OFF},   # version, codes, subgraphs, desc, buffers
    "SubGraph": {0: _OFF, 1: _OFF, 2: _OFF, 3: _OFF, 4: _OFF},  # tensors, inputs, outputs, ops, name
    "Tensor": {0: _OFF, 1: _U8, 2: _I32, 3: _OFF, 4: _OFF},   # shape, type, buffer, name, quant
    "Buffer": {0: _OFF},                                      # data
    "Operator": {0: _I32, 1: _OFF, 2: _OFF, 3: _U8, 4: _OFF},  # opcode, ins, outs, options
    "OperatorCode": {0: _U8, 2: _I32, 3: _I32},               # deprecated code, version, code
    "QuantizationParameters": {2: _OFF, 3: _OFF, 4: _U8, 5: _OFF, 6: _I32},
    "BlockwiseQuantization": {0: _I32, 1: _I32, 2: _I32},
    "FullyConnectedOptions": {0: _U8, 1: _U8, 2: _U8, 3: _U8},
    "SplitOptions": {0: _I32},
    "MulOptions": {0: _U8},
    "DequantizeOptions": {},
}


class _Reader:
    """Bounds-checked access to a flatbuffer: every table, vtable, vector and string is checked
    to lie inside the buffer (and aligned) before the schema package's accessors read it."""

    def __init__(self, buf: bytes, source: str):
        self.buf, self.n, self.source = buf, len(buf), source

    def fail(self, field: str, message: str):
        raise TfliteModelError(self.source, field, message)

    def u16(self, pos):
        return struct.unpack_from("<H", self.buf, pos)[0]

    def u32(self, pos):
        return struct.unpack_from("<I", self.buf, pos)[0]

    def i32(self, pos):
        return struct.unpack_from("<i", self.buf, pos)[0]

    def span(self, pos: int, size: int, field: str, align: int = 1):
        if pos < 0 or size < 0 or pos + size > self.n:
            self.fail(field, f"bytes {pos}..{pos + size} lie outside the {self.n}-byte buffer")
        if pos % align:
            self.fail(field, f"offset {pos} is not {align}-byte aligned")

    def table(self, cls, pos: int, kind: str, field: str):
        """A `cls` (schema class) at `pos`, after checking its vtable and allowed fields."""
        self.span(pos, 4, field, 4)
        vt = pos - self.i32(pos)
        self.span(vt, 4, f"{field} (vtable)", 2)
        vt_size, obj_size = self.u16(vt), self.u16(vt + 2)
        if vt_size < 4 or vt_size % 2:
            self.fail(f"{field} (vtable)", f"vtable size {vt_size}")
        self.span(vt, vt_size, f"{field} (vtable)")
        if obj_size < 4:
            self.fail(field, f"table size {obj_size}")
        self.span(pos, obj_size, field)
        allowed = _FIELDS[kind]
        for slot in range((vt_size - 4) // 2):
            off = self.u16(vt + 4 + 2 * slot)
            if not off:
                continue
            if slot not in allowed:
                self.fail(field, f"{kind} field #{slot} is set: this writer never sets it")
            if off < 4 or off + allowed[slot] > obj_size:
                self.fail(field, f"{kind} field #{slot} at {off} runs past the table ({obj_size} bytes)")
        obj = cls()
        obj.Init(self.buf, pos)
        return obj

    def target(self, obj, slot: int, field: str) -> int | None:
        """Absolute position an offset field points at, or None when the field is absent."""
        o = obj._tab.Offset(4 + 2 * slot)
        if not o:
            return None
        at = obj._tab.Pos + o
        rel = self.u32(at)
        if not 0 < rel < 1 << 31:               # as flatbuffers' verifier: forward, non-zero
            self.fail(field, f"offset {rel} at byte {at}")
        return at + rel

    def vector(self, obj, slot: int, elem: int, cap: int, field: str) -> tuple[int, int]:
        """(first element position, length) of a vector field; (0, 0) when absent."""
        at = self.target(obj, slot, field)
        if at is None:
            return 0, 0
        self.span(at, 4, field, 4)
        count = self.u32(at)
        if count > cap:
            self.fail(field, f"{count} entries, more than the {cap} allowed")
        self.span(at + 4, count * elem, field, min(elem, 8))
        return at + 4, count

    def ints(self, obj, slot: int, cap: int, field: str) -> list[int]:
        start, count = self.vector(obj, slot, 4, cap, field)
        return [self.i32(start + 4 * i) for i in range(count)]

    def tables(self, obj, slot: int, cls, kind: str, cap: int, field: str) -> list:
        start, count = self.vector(obj, slot, 4, cap, field)
        out = []
        for i in range(count):
            rel = self.u32(start + 4 * i)
            if not 0 < rel < 1 << 31:
                self.fail(f"{field}[{i}]", f"offset {rel}")
            out.append(self.table(cls, start + 4 * i + rel, kind, f"{field}[{i}]"))
        return out

    def string(self, obj, slot: int, field: str) -> str:
        start, count = self.vector(obj, slot, 1, _MAX_NAME, field)
        if not start:
            return ""
        self.span(start + count, 1, field)
        if self.buf[start + count] != 0:
            self.fail(field, "string is not NUL-terminated")
        raw = bytes(self.buf[start:start + count])
        if any(c < 0x20 or c > 0x7E for c in raw):        # the runtime decodes names as UTF-8
            self.fail(field, f"{raw[:32]!r}: only printable ASCII is written")
        return raw.decode("ascii")


class _RawTable:
    """A table the tflite 2.18 package has no class for (BlockwiseQuantization): raw slot reads."""

    def Init(self, buf, pos):
        from flatbuffers.table import Table

        self._tab = Table(buf, pos)


@dataclass
class _TInfo:                # what validate() learned about one tensor
    shape: tuple[int, ...]
    type: int
    data: tuple[int, int] | None      # (position, length) of its constant data
    quant: str                        # "", "per_channel" or "blockwise"
    scale: np.ndarray | None = None
    zero_point: np.ndarray | None = None
    blockwise: tuple[int, int, int] | None = None   # scales tensor, zero-point tensor, block size


def validate(buf: bytes, *, source: str = "<memory>") -> None:
    """Check a .tflite flatbuffer the way edgellm writes it, before any runtime reads it: the
    structure (every table, vector and string inside the buffer, only the fields this writer
    sets), indices (tensors, buffers, operator codes), shapes, types, constant data sizes, and
    each operator's signature and the dataflow order. TfliteModelError names the field."""
    if not isinstance(buf, (bytes, bytearray)):
        raise TfliteModelError(source, "model", f"expected bytes, got {type(buf).__name__}")
    r = _Reader(buf, source)
    try:
        _validate(r)
    except TfliteModelError:
        raise
    except (struct.error, IndexError, ValueError, TypeError, OverflowError, UnicodeError) as e:
        r.fail("flatbuffer", f"unreadable ({type(e).__name__}: {e})")


def _validate(r: _Reader) -> None:
    Model, SubGraph, Tensor, Buffer, Operator, OperatorCode, Quant = (
        getattr(_schema(n), n) for n in ("Model", "SubGraph", "Tensor", "Buffer", "Operator",
                                         "OperatorCode", "QuantizationParameters"))
    if r.n < 8:
        r.fail("header", f"{r.n} bytes: too short for a flatbuffer")
    if r.n > _MAX_BYTES:
        r.fail("header", f"{r.n} bytes: over the 2 GiB flatbuffer limit")
    if bytes(r.buf[4:8]) != b"TFL3":
        r.fail("file_identifier", f"{bytes(r.buf[4:8])!r}, expected b'TFL3'")
    model = r.table(Model, r.u32(0), "Model", "model")
    if model.Version() != SCHEMA_VERSION:
        r.fail("model.version", f"{model.Version()}, expected {SCHEMA_VERSION}")
    r.string(model, 3, "model.description")

    codes = []
    for i, oc in enumerate(r.tables(model, 1, OperatorCode, "OperatorCode", _MAX_OPCODES,
                                    "model.operator_codes")):
        # The tflite package's BuiltinCode() returns the deprecated int8 field for codes < 127,
        # hiding the int32 one; the runtime takes max(builtin_code, deprecated): read both raw.
        o = oc._tab.Offset(10)
        code = r.i32(oc._tab.Pos + o) if o else 0
        dep = oc.DeprecatedBuiltinCode()
        if code not in _OP_NAME or dep != min(code, 127):
            r.fail(f"model.operator_codes[{i}].builtin_code",
                   f"{code} (deprecated field {dep}): expected one of the operators this writer "
                   f"emits {sorted(_OP_NAME)}, written in both fields")
        if not 1 <= oc.Version() <= _MAX_VERSION[code]:
            r.fail(f"model.operator_codes[{i}].version",
                   f"{_OP_NAME[code]} version {oc.Version()}, expected 1..{_MAX_VERSION[code]}")
        codes.append(code)
    if not codes:
        r.fail("model.operator_codes", "empty")

    buffers = []                         # (data position, length) per buffer
    for i, bf in enumerate(r.tables(model, 4, Buffer, "Buffer", _MAX_BUFFERS, "model.buffers")):
        buffers.append(r.vector(bf, 0, 1, _MAX_BYTES, f"model.buffers[{i}].data"))
    if not buffers or buffers[0][1]:
        r.fail("model.buffers[0]", "missing or not empty (buffer 0 is the empty sentinel)")

    subgraphs = r.tables(model, 2, SubGraph, "SubGraph", 1, "model.subgraphs")
    if len(subgraphs) != 1:
        r.fail("model.subgraphs", f"{len(subgraphs)} subgraphs, expected 1")
    sg = subgraphs[0]
    r.string(sg, 4, "subgraphs[0].name")

    tensors: list[_TInfo] = []
    for i, t in enumerate(r.tables(sg, 0, Tensor, "Tensor", _MAX_TENSORS, "subgraphs[0].tensors")):
        f = f"tensors[{i}]"
        r.string(t, 3, f"{f}.name")
        shape = tuple(r.ints(t, 0, 4, f"{f}.shape"))
        if any(not 1 <= d <= _MAX_DIM for d in shape):
            r.fail(f"{f}.shape", f"{shape}: dimensions must be in 1..{_MAX_DIM}")
        if math.prod(shape) > _MAX_ELEMENTS:
            r.fail(f"{f}.shape", f"{shape}: more than {_MAX_ELEMENTS} elements")
        ttype = t.Type()
        if ttype not in _BITS:
            r.fail(f"{f}.type", f"{ttype} is not one of {sorted(_TYPE_NAME.values())}")
        bi = t.Buffer()
        if not 0 <= bi < len(buffers):
            r.fail(f"{f}.buffer", f"{bi} is out of range: the model has {len(buffers)} buffers")
        data = buffers[bi] if buffers[bi][1] else None
        if data is not None and data[1] != _nbytes(ttype, shape):
            r.fail(f"{f}.buffer", f"buffer {bi} holds {data[1]} bytes, shape {shape} of "
                                  f"{_TYPE_NAME[ttype]} needs {_nbytes(ttype, shape)}")
        info = _TInfo(shape, ttype, data, "")
        qpos = r.target(t, 4, f"{f}.quantization")
        if qpos is not None:
            _quantization(r, r.table(Quant, qpos, "QuantizationParameters", f"{f}.quantization"),
                          info, f"{f}.quantization")
        tensors.append(info)

    nt = len(tensors)
    ins, outs = r.ints(sg, 1, 4, "subgraphs[0].inputs"), r.ints(sg, 2, 4, "subgraphs[0].outputs")
    if len(ins) != 1 or len(outs) != 1:
        r.fail("subgraphs[0].inputs", f"{len(ins)} inputs and {len(outs)} outputs, expected 1 and 1")
    for field, ti in (("inputs", ins[0]), ("outputs", outs[0])):
        if not 0 <= ti < nt:
            r.fail(f"subgraphs[0].{field}", f"tensor {ti} is out of range: {nt} tensors")
        t = tensors[ti]
        if t.type != _TT.FLOAT32 or len(t.shape) != 2 or t.data is not None:
            r.fail(f"subgraphs[0].{field}", f"tensor {ti} must be a 2-D FLOAT32 activation")
    for i, t in enumerate(tensors):
        if t.quant == "blockwise":
            s, zp, block = t.blockwise
            if not 0 <= s < nt or zp != -1:
                r.fail(f"tensors[{i}].quantization.details", f"scales tensor {s}, zero points {zp}: "
                                                             f"expected a tensor index and -1")
            st = tensors[s]
            if t.type != _INT4 or len(t.shape) != 2 or block != INT4_BLOCK or t.shape[1] % block:
                r.fail(f"tensors[{i}].quantization.details", f"blockwise {_TYPE_NAME[t.type]} "
                                                             f"{t.shape}, block {block}")
            if st.type != _TT.FLOAT16 or st.data is None or st.quant \
                    or st.shape != (t.shape[0], t.shape[1] // block):
                r.fail(f"tensors[{s}]", f"blockwise scales must be a constant FLOAT16 "
                                        f"{(t.shape[0], t.shape[1] // block)}")
            sv = np.frombuffer(r.buf, "<f2", st.data[1] // 2, st.data[0])
            if not np.all(np.isfinite(sv) & (sv > 0)):
                r.fail(f"tensors[{s}]", "blockwise scales must be finite and > 0")

    ready = {ins[0]} | {i for i, t in enumerate(tensors) if t.data is not None}
    produced: set[int] = set()
    ops = r.tables(sg, 3, Operator, "Operator", _MAX_OPS, "subgraphs[0].operators")
    if not ops:
        r.fail("subgraphs[0].operators", "empty")
    for k, op in enumerate(ops):
        f = f"operators[{k}]"
        ci = op.OpcodeIndex()
        if not 0 <= ci < len(codes):
            r.fail(f"{f}.opcode_index", f"{ci} is out of range: {len(codes)} operator codes")
        code = codes[ci]
        op_in, op_out = r.ints(op, 1, 8, f"{f}.inputs"), r.ints(op, 2, 8, f"{f}.outputs")
        for j, ti in enumerate(op_in):
            if ti == -1 and code == _FC and j == 2:
                continue                                     # the optional bias
            if not 0 <= ti < nt:
                r.fail(f"{f}.inputs[{j}]", f"tensor {ti} is out of range: {nt} tensors")
            if ti not in ready:
                r.fail(f"{f}.inputs[{j}]", f"tensor {ti} is read before any operator writes it")
        for j, ti in enumerate(op_out):
            if not 0 <= ti < nt:
                r.fail(f"{f}.outputs[{j}]", f"tensor {ti} is out of range: {nt} tensors")
            if ti in ready:
                r.fail(f"{f}.outputs[{j}]", f"tensor {ti} is a constant, the input, or already written")
            ready.add(ti)
            produced.add(ti)
        _check_op(r, op, code, op_in, op_out, tensors, f)
    if outs[0] not in produced:
        r.fail("subgraphs[0].outputs", f"tensor {outs[0]} is written by no operator")


def _quantization(r: _Reader, q, info: _TInfo, f: str) -> None:
    dtype = q.DetailsType()
    if dtype == _BLOCKWISE:
        pos = r.target(q, 5, f"{f}.details")
        if pos is None or r.target(q, 2, f) is not None or r.target(q, 3, f) is not None:
            r.fail(f"{f}.details", "blockwise quantization must have details and no scale/zero_point")
        bw = r.table(_RawTable, pos, "BlockwiseQuantization", f"{f}.details")
        vals = [r.i32(bw._tab.Pos + o) if o else 0
                for o in (bw._tab.Offset(4), bw._tab.Offset(6), bw._tab.Offset(8))]
        info.quant, info.blockwise = "blockwise", tuple(vals)
        return
    if dtype != 0 or r.target(q, 5, f) is not None:
        r.fail(f"{f}.details_type", f"{dtype}: only none or blockwise quantization is written")
    s0, ns = r.vector(q, 2, 4, _MAX_DIM, f"{f}.scale")
    z0, nz = r.vector(q, 3, 8, _MAX_DIM, f"{f}.zero_point")
    if info.type != _TT.INT8 or len(info.shape) != 2:
        r.fail(f, f"per-channel quantization on a {_TYPE_NAME[info.type]} {info.shape} tensor")
    n = info.shape[0]
    if q.QuantizedDimension() != 0 or ns != n or nz != n:
        r.fail(f, f"quantized_dimension {q.QuantizedDimension()}, {ns} scales, {nz} zero points: "
                  f"expected dimension 0 and {n} of each")
    scale = np.frombuffer(r.buf, "<f4", ns, s0)
    zp = np.frombuffer(r.buf, "<i8", nz, z0)
    if not np.all(np.isfinite(scale) & (scale >= np.finfo(np.float32).tiny)):
        r.fail(f"{f}.scale", "scales must be finite, normal and > 0")
    if np.any(zp != 0):
        r.fail(f"{f}.zero_point", "int8 weights are symmetric: zero points must be 0")
    info.quant, info.scale, info.zero_point = "per_channel", scale, zp


def _check_op(r: _Reader, op, code: int, ins: list[int], outs: list[int], tensors, f: str) -> None:
    name = _OP_NAME[code]
    want_in, want_out = {_FC: 3, _DEQ: 1, _SPLIT: 2, _LOGISTIC: 1, _MUL: 2}[code], \
        {_FC: 1, _DEQ: 1, _SPLIT: 2, _LOGISTIC: 1, _MUL: 1}[code]
    if len(ins) != want_in or len(outs) != want_out:
        r.fail(f, f"{name} with {len(ins)} inputs and {len(outs)} outputs, expected {want_in} and {want_out}")
    otype = op.BuiltinOptionsType()
    if otype != _OPTIONS[code]:
        r.fail(f"{f}.builtin_options_type", f"{otype} for {name}, expected {_OPTIONS[code]}")
    opos = r.target(op, 4, f"{f}.builtin_options")
    if (opos is None) != (otype == _Opt.NONE):
        r.fail(f"{f}.builtin_options", f"present/absent does not match its type {otype}")
    opts = None
    if opos is not None:
        kind = {_FC: "FullyConnectedOptions", _DEQ: "DequantizeOptions", _SPLIT: "SplitOptions",
                _MUL: "MulOptions"}[code]
        opts = r.table(getattr(_schema(kind), kind), opos, kind, f"{f}.builtin_options")
    T = [tensors[i] if i >= 0 else None for i in ins]
    O = [tensors[i] for i in outs]

    def f32_2d(t, what):
        if t.type != _TT.FLOAT32 or len(t.shape) != 2 or t.quant:
            r.fail(f, f"{name} {what}: {_TYPE_NAME[t.type]} {t.shape}, expected 2-D FLOAT32")
        return t.shape

    if code == _FC:
        if opts.FusedActivationFunction() != 0 or opts.WeightsFormat() != 0 or opts.KeepNumDims():
            r.fail(f"{f}.builtin_options", "FULLY_CONNECTED: only no activation, default weights, "
                                          "keep_num_dims false are written")
        (t_, k), w, b = f32_2d(T[0], "input"), T[1], T[2]
        if len(w.shape) != 2 or w.shape[1] != k:
            r.fail(f"{f}.inputs[1]", f"weights {w.shape} do not match input (.., {k})")
        n = w.shape[0]
        if w.type == _TT.FLOAT32:
            if w.quant:
                r.fail(f"{f}.inputs[1]", "FLOAT32 weights carry quantization")
        elif w.type == _TT.INT8:
            if w.quant != "per_channel" or w.data is None:
                r.fail(f"{f}.inputs[1]", "INT8 weights must be constant with per-channel scales")
        elif w.type == _INT4:
            if w.quant != "blockwise" or w.data is None:
                r.fail(f"{f}.inputs[1]", "INT4 weights must be constant with blockwise scales")
        else:
            r.fail(f"{f}.inputs[1]", f"{_TYPE_NAME[w.type]} weights")
        if b is not None and (b.type != _TT.FLOAT32 or b.shape != (n,) or b.data is None or b.quant):
            r.fail(f"{f}.inputs[2]", f"bias {_TYPE_NAME[b.type]} {b.shape}, expected constant FLOAT32 ({n},)")
        if f32_2d(O[0], "output") != (t_, n):
            r.fail(f"{f}.outputs[0]", f"{O[0].shape}, expected {(t_, n)}")
    elif code == _DEQ:
        if T[0].type != _TT.FLOAT16 or T[0].data is None or T[0].quant:
            r.fail(f"{f}.inputs[0]", "DEQUANTIZE reads a constant FLOAT16 tensor here")
        if O[0].type != _TT.FLOAT32 or O[0].shape != T[0].shape or O[0].quant:
            r.fail(f"{f}.outputs[0]", f"{O[0].shape}, expected FLOAT32 {T[0].shape}")
    elif code == _SPLIT:
        axis = T[0]
        if axis.type != _TT.INT32 or axis.data is None or axis.shape not in ((), (1,)):
            r.fail(f"{f}.inputs[0]", "SPLIT axis must be a constant INT32 scalar")
        a = r.i32(axis.data[0])
        if a not in (1, -1):
            r.fail(f"{f}.inputs[0]", f"SPLIT axis {a}, expected 1")
        t_, c = f32_2d(T[1], "input")
        if opts.NumSplits() != 2 or c % 2:
            r.fail(f"{f}.builtin_options", f"num_splits {opts.NumSplits()} on {c} columns, expected 2")
        for j in range(2):
            if f32_2d(O[j], "output") != (t_, c // 2):
                r.fail(f"{f}.outputs[{j}]", f"{O[j].shape}, expected {(t_, c // 2)}")
    elif code == _LOGISTIC:
        if f32_2d(O[0], "output") != f32_2d(T[0], "input"):
            r.fail(f"{f}.outputs[0]", f"{O[0].shape}, expected {T[0].shape}")
    else:   # MUL, without broadcasting
        if opts.FusedActivationFunction() != 0:
            r.fail(f"{f}.builtin_options", "MUL: only no activation is written")
        s = f32_2d(T[0], "input 0")
        if f32_2d(T[1], "input 1") != s or f32_2d(O[0], "output") != s:
            r.fail(f, f"MUL shapes {T[0].shape} * {T[1].shape} -> {O[0].shape}: expected all equal")


# -- the cache ---------------------------------------------------------------------------------
_MAGIC = b"ELTFLC01"
_CACHE_FORMAT = 1
_HEADER = struct.Struct("<8sIIQ32s16s")   # magic, cache format, writer version, payload length,
#                                           sha256 of the payload, sha256 of the graph key [:16]


def cache_root() -> Path:
    from ..model.registry import edgellm_home

    return edgellm_home() / "cache" / "npu" / "tflite"


def cache_path(graph, cache_dir: str | os.PathLike | None = None) -> Path:
    h = hashlib.sha256(f"{WRITER_VERSION}|{graph.key()}".encode()).hexdigest()[:32]
    stem = re.sub(r"[^A-Za-z0-9._-]", "_", graph.name)[:64]
    return Path(cache_dir if cache_dir is not None else cache_root()) / f"{stem}-{h}.tflc"


def load_or_build(graph, cache_dir: str | os.PathLike | None = None) -> bytes:
    """The validated .tflite bytes for `graph`: from the cache when a sound file is there, else
    built, validated and written (atomically). A damaged or stale file: one warning, rebuilt."""
    path = cache_path(graph, cache_dir)
    key_digest = hashlib.sha256(graph.key().encode()).digest()[:16]
    payload = _read_cache(path, key_digest)
    if payload is not None:
        stats.loaded += 1
        return payload
    payload = build_flatbuffer(graph)
    try:
        validate(payload, source=f"<built {graph.name}>")
    except TfliteModelError as e:        # a writer bug: never cached, never run
        raise NpuGraphError(graph.name, f"the writer produced an invalid model: {e}") from e
    stats.built += 1
    try:
        _write_cache(path, payload, key_digest)
    except OSError as e:                 # an unwritable cache costs a rebuild next time, no more
        log.warning("TFLite cache %s not written: %s", path, e)
    return payload


def _read_cache(path: Path, key_digest: bytes) -> bytes | None:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:
        return _reject(path, f"unreadable ({e})")
    if len(data) < _HEADER.size:
        return _reject(path, "truncated header")
    magic, fmt, writer, n, digest, key = _HEADER.unpack_from(data)
    payload = data[_HEADER.size:]
    if magic != _MAGIC or fmt != _CACHE_FORMAT:
        return _reject(path, "not an edgellm TFLite cache file of this format")
    if writer != WRITER_VERSION:
        return _reject(path, f"written by writer {writer}, this is writer {WRITER_VERSION}")
    if key != key_digest:
        return _reject(path, "built for another graph")
    if n != len(payload) or hashlib.sha256(payload).digest() != digest:
        return _reject(path, "fails its checksum")
    try:
        validate(payload, source=str(path))
    except TfliteModelError as e:
        return _reject(path, str(e))
    return payload


def _reject(path: Path, why: str) -> None:
    log.warning("TFLite cache %s: %s; rebuilding", path, why)
    stats.rebuilt += 1
    return None


def _write_cache(path: Path, payload: bytes, key_digest: bytes) -> None:
    """Atomic: a temp file in the same directory, fsync, rename, fsync the directory."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".tflc")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(_HEADER.pack(_MAGIC, _CACHE_FORMAT, WRITER_VERSION, len(payload),
                                 hashlib.sha256(payload).digest(), key_digest))
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# -- the runtime -------------------------------------------------------------------------------
_RUNTIMES = (("ai_edge_litert", "ai_edge_litert.interpreter"),
             ("tflite_runtime", "tflite_runtime.interpreter"))
_state_lock = threading.Lock()
_runtime_state: tuple | None = None      # (Interpreter, load_delegate, name) or (None, None, why)
_int4_state: tuple[bool, str] | None = None


def _probe_graph(fmt: str) -> LinearGraph:
    from .npu_graphs import quantize

    rng = np.random.default_rng(7)
    w = rng.standard_normal((8, 64)).astype(np.float32)
    return LinearGraph(f"probe-{fmt}", quantize(w, fmt, rng.standard_normal(8).astype(np.float32)), 4)


def _self_check(Interpreter, graph, bound: float) -> None:
    """Build, validate and run `graph` on the default CPU path; raise unless it matches the
    reference within NMSE `bound`."""
    buf = build_flatbuffer(graph)
    validate(buf)
    it = Interpreter(model_content=buf)
    it.allocate_tensors()
    x = np.random.default_rng(8).standard_normal((graph.tokens, graph.w.k)).astype(np.float32)
    it.set_tensor(it.get_input_details()[0]["index"], x)
    it.invoke()
    y = it.get_tensor(it.get_output_details()[0]["index"])
    ref = reference(graph, x)
    err = float(np.sum((y.astype(np.float64) - ref) ** 2) / np.sum(ref.astype(np.float64) ** 2))
    if not err <= bound:
        raise RuntimeError(f"{graph.w.fmt} self-check: NMSE {err:.3g} against the reference, "
                           f"bound {bound:.3g}")


def _runtime():
    """(Interpreter, load_delegate, name): the first runtime that imports AND runs a tiny fp32
    model correctly under this numpy. Raises TfliteUnavailable with every runtime's reason."""
    global _runtime_state
    with _state_lock:
        if _runtime_state is None:
            reasons = []
            try:
                _schema("Model")
                runtimes = _RUNTIMES
            except TfliteUnavailable as e:        # no writer, nothing to run
                reasons, runtimes = [str(e)], ()
            for name, module in runtimes:
                try:
                    mod = importlib.import_module(module)
                    _self_check(mod.Interpreter, _probe_graph("fp32"), 1e-10)
                    _runtime_state = (mod.Interpreter, mod.load_delegate, name)
                    break
                except ModuleNotFoundError as e:
                    if not (e.name and module.startswith(e.name)):
                        reasons.append(f"{name}: cannot be imported: {e}")   # a broken install
                    else:
                        reasons.append(f"{name}: not installed")
                except Exception as e:        # noqa: BLE001 - a runtime that fails is reported
                    hint = ""
                    if name == "tflite_runtime" and int(np.__version__.split(".")[0]) >= 2:
                        hint = (" (tflite_runtime wheels up to 2.14 are built against numpy 1.x "
                                "and fail under numpy 2; install ai-edge-litert)")
                    reasons.append(f"{name}: cannot run a model under numpy {np.__version__}: "
                                   f"{type(e).__name__}: {e}{hint}")
            else:
                _runtime_state = (None, None, "; ".join(reasons))
        if _runtime_state[0] is None:
            raise TfliteUnavailable(f"no usable TFLite runtime: {_runtime_state[2]}")
        return _runtime_state


def available() -> tuple[bool, str]:
    """(True, runtime name) when a TFLite runtime imports and passes a numeric self-check in this
    process; else (False, reason). Never raises; the result is cached for the process."""
    try:
        _, _, name = _runtime()
    except TfliteUnavailable as e:
        return False, str(e)
    return True, name


def int4_supported() -> tuple[bool, str]:
    """Whether this runtime's FULLY_CONNECTED runs blockwise INT4 weights correctly (an older
    runtime may not know the blockwise schema field and misread the weights): a self-check on a
    tiny model against the reference, once per process."""
    global _int4_state
    ok, why = available()
    if not ok:
        return False, why
    with _state_lock:
        if _int4_state is None:
            Interpreter = _runtime_state[0]
            try:
                # dynamic int8 input quantization alone gives NMSE ~3e-5 here
                _self_check(Interpreter, _probe_graph("int4"), 1e-3)
                _int4_state = (True, "")
            except Exception as e:            # noqa: BLE001 - any failure means "not here"
                _int4_state = (False, f"int4 weights are not supported by this TFLite runtime "
                                      f"({_runtime_state[2]}): {type(e).__name__}: {e}")
        return _int4_state


def _formats(graph) -> set[str]:
    if isinstance(graph, LinearGraph):
        return {graph.w.fmt}
    return {graph.gate_up.fmt, graph.down.fmt}


def _open_delegate(load_delegate, delegate: str, options: dict | None):
    opts = {}
    for k, v in (options or {}).items():
        if not isinstance(k, str) or not isinstance(v, (str, int, float, bool)):
            raise ConfigError(f"delegate_options: {k!r}: {v!r}: keys must be str, values str/int/float/bool")
        opts[k] = v
    if os.sep in delegate or (os.altsep and os.altsep in delegate):
        if not Path(delegate).is_file():
            raise TfliteDelegateError(delegate, "no such file")
    # Open it with ctypes first: a missing library or one that is not an external delegate gets
    # its own reason (load_delegate's failure there leaves a half-built object behind).
    try:
        lib = ctypes.CDLL(delegate)
    except OSError as e:
        raise TfliteDelegateError(delegate, f"cannot be loaded: {e}") from e
    if not hasattr(lib, "tflite_plugin_create_delegate"):
        raise TfliteDelegateError(delegate, "not a TFLite external delegate (no "
                                            "tflite_plugin_create_delegate symbol)")
    try:
        return load_delegate(delegate, opts)
    except (ValueError, RuntimeError, OSError, AttributeError) as e:
        raise TfliteDelegateError(delegate, f"failed to create the delegate with options {opts}: {e}") from e


class TfliteSubgraph:
    """One compiled subgraph: an interpreter created once (tensors allocated), run per chunk.
    Not re-entrant: run() holds a lock (an interpreter runs one invoke at a time)."""

    def __init__(self, graph, model: bytes, *, delegate: str | None = None,
                 delegate_options: dict | None = None, num_threads: int | None = None):
        ok, why = supports(graph)
        if not ok:
            raise NpuGraphError(getattr(graph, "name", "?"), why)
        if num_threads is not None and (isinstance(num_threads, bool) or not isinstance(num_threads, int)
                                        or num_threads < 1):
            raise ConfigError(f"num_threads: {num_threads!r}, expected an int >= 1 or None "
                              "(None: the runtime's default, one thread for ai_edge_litert)")
        self.graph = graph
        self.name = graph.name
        self.delegate = delegate
        self.num_threads = num_threads
        validate(model, source=f"<{graph.name}>")            # whoever built it: checked here
        Interpreter, load_delegate, self.runtime = _runtime()
        delegates = [_open_delegate(load_delegate, delegate, delegate_options)] if delegate else None
        try:
            it = Interpreter(model_content=model, experimental_delegates=delegates,
                             num_threads=num_threads)
            stats.interpreters += 1
            it.allocate_tensors()
        except (ValueError, RuntimeError) as e:
            if delegate:
                raise TfliteDelegateError(delegate, f"refused subgraph {graph.name!r}: {e}") from e
            raise NpuGraphError(graph.name, f"the TFLite runtime rejected the model: {e}") from e
        (inp,), (out,) = it.get_input_details(), it.get_output_details()
        k_in = graph.w.k if isinstance(graph, LinearGraph) else graph.gate_up.k
        n_out = graph.w.n if isinstance(graph, LinearGraph) else graph.down.n
        self.input_shape = (int(graph.tokens), k_in)       # (tokens, K)
        self.output_shape = (int(graph.tokens), n_out)     # (tokens, N)
        got_in, got_out = tuple(map(int, inp["shape"])), tuple(map(int, out["shape"]))
        if got_in != self.input_shape or got_out != self.output_shape \
                or inp["dtype"] != np.float32 or out["dtype"] != np.float32:
            raise NpuGraphError(graph.name, f"the model's input {got_in} / output {got_out} do not "
                                            f"match the graph's {self.input_shape} / {self.output_shape}")
        self._it, self._in, self._out = it, inp["index"], out["index"]
        self._delegates = delegates          # kept alive as long as the interpreter
        self._model = model
        self._lock = threading.Lock()

    def run(self, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """y = graph(x) for x (tokens, K) float32 -> (tokens, N) float32, a new array (or `out`).
        x is copied once into the interpreter's input; y once out of its output."""
        if not isinstance(x, np.ndarray) or x.dtype != np.float32 or x.shape != self.input_shape:
            raise NpuInputError(
                f"npu subgraph {self.name!r}: input must be float32 {self.input_shape}, got "
                f"{getattr(x, 'dtype', type(x).__name__)} {getattr(x, 'shape', '')}")
        if out is not None and (not isinstance(out, np.ndarray) or out.dtype != np.float32
                                or out.shape != self.output_shape):
            raise NpuInputError(f"npu subgraph {self.name!r}: out must be float32 {self.output_shape}")
        with self._lock:
            self._it.set_tensor(self._in, x if x.flags.c_contiguous else np.ascontiguousarray(x))
            try:
                self._it.invoke()
            except (RuntimeError, ValueError) as e:      # a delegate failing at run time
                raise NpuGraphError(self.name, f"invoke failed ({self.delegate or 'default CPU'}): {e}") from e
            if out is None:
                return self._it.get_tensor(self._out)
            np.copyto(out, self._it.tensor(self._out)())    # the view is dropped before the next invoke
            return out

    def __repr__(self) -> str:
        return (f"TfliteSubgraph({self.name!r}, {self.input_shape} -> {self.output_shape}, "
                f"runtime={self.runtime}, delegate={self.delegate or 'default CPU'})")


def compile(graph, *, delegate: str | None = None, delegate_options: dict | None = None,
            num_threads: int | None = None, cache_dir: str | os.PathLike | None = None) -> TfliteSubgraph:
    """A ready-to-run TfliteSubgraph for `graph`. NpuGraphError when this path rejects the graph
    (int4 included where the runtime cannot run it), TfliteUnavailable without a runtime,
    TfliteDelegateError when the named delegate cannot be loaded or refuses the subgraph: the
    caller decides the fallback."""
    ok, why = supports(graph)
    if not ok:
        raise NpuGraphError(getattr(graph, "name", "?"), why)
    _runtime()
    if "int4" in _formats(graph):
        ok, why = int4_supported()
        if not ok:
            raise NpuGraphError(graph.name, why)
    return TfliteSubgraph(graph, load_or_build(graph, cache_dir), delegate=delegate,
                          delegate_options=delegate_options, num_threads=num_threads)
