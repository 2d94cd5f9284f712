"""The npu unit's LiteRT/TFLite flatbuffer writer: npu_graphs.LinearGraph and FfnGraph as .tflite
models (schema version 3, "TFL3"), written by edgellm itself through the tflite schema package's
builder functions. supports() says whether a graph can be written; build_flatbuffer() writes it.
Every model it writes is checked by npu_tflite_validate.validate() before a runtime sees it.

Flatbuffer forms, per weight format (x is (tokens, K) float32, y float32):
    fp32  FULLY_CONNECTED(x, W f32 (N, K), b f32 (N,) or omitted)
    fp16  W f16 (N, K) -> DEQUANTIZE -> f32, then FULLY_CONNECTED: the standard fp16-weights form
          the converter writes and delegates recognize (f16 -> f32 is exact)
    int8  FULLY_CONNECTED(x f32, W int8 (N, K) with per-output-channel scales (N,), zero points 0,
          quantized_dimension 0, b f32): the "dynamic range" (hybrid) form. The kernel quantizes
          each row of x to int8 on the fly; asymmetric_quantize_inputs is set (see _ASYMMETRIC).
    int8s SPLIT(axis 1) x into K / 64 slices (tokens, 64); per slice j an int8 FULLY_CONNECTED as
          above with W[:, 64j:64j+64] INT8 (N, 64) and its own per-channel scales, so the kernel
          quantizes each row's slice on its own; bias on the first FC only; ADD ops sum the
          partial (tokens, N) outputs in order. K = 64: the one FC on x, no SPLIT, no ADD.
          Why 64: npu_graphs.INT8S_SLICE. The cost: SmolLM2's FFN at bucket 128 runs 1.46x the
          int8 time on XNNPACK (one thread, measured). This runtime's XNNPACK leaves a SPLIT of
          more than 4 outputs to the builtin kernel: the FFN runs as two XNNPACK partitions.
    int4  FULLY_CONNECTED(x f32, W INT4 (N, K), b f32): W packed two values a byte, low nibble
          first, signed (q - 8); its quantization is BlockwiseQuantization {scales: an f16
          (N, K / 32) constant tensor, zero_points: -1, block_size: 32}. Scales are stored f16 (with
          f32 or bf16 scale tensors this runtime's kernels refuse the model or misread it): the
          builtin kernel uses them as they are, XNNPACK rounds them once more to bf16. Inputs are
          quantized per row, asymmetric, by both kernels.
          Runs only where the runtime's self-check passes (int4_supported()).
FfnGraph: FC(gate_up) -> SPLIT(axis 1) -> g, u; LOGISTIC(g) -> s; MUL(g, s) -> silu;
          MUL(silu, u) -> h; FC(down, h) -> y. One graph, one invoke.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass

import numpy as np

from ..errors import EdgeLLMError
from .npu_graphs import INT4_BLOCK, INT8S_SLICE, FfnGraph, LinearGraph, NpuGraphError, QLinear

WRITER_VERSION = 2          # bump when build_flatbuffer's output changes: old cache files miss
SCHEMA_VERSION = 3          # the TFLite schema version the file declares ("TFL3")
FORMATS = ("int8", "int8s", "int4", "fp16", "fp32")
# Dynamic-range FC quantizes each input row to int8. Asymmetric (scale (max - min) / 255 and a
# zero point; the range always holds 0) never wastes half the int8 range on a row whose values
# are one-sided (rows of mean 1.5: NMSE 1.0e-5 against 2.3e-5 symmetric, measured on the builtin
# kernel), and XNNPACK's dynamically quantized FC is asymmetric whatever this flag says: with it
# set, the builtin kernel and XNNPACK compute the same thing (tests check both bit-for-bit
# against an emulation of this scheme).
_ASYMMETRIC = True

_MAX_DIM = 1 << 24          # caps shared with the validator (npu_tflite_validate)
_MAX_ELEMENTS = 1 << 28     # per tensor: 1 GiB of f32
# int8s slices per FULLY_CONNECTED (K up to 65536): each slice is 4 tensors, a buffer and 2 ops,
# and the validator sizes its count caps from this.
_MAX_SLICES = 1024


class TfliteUnavailable(EdgeLLMError):
    """Neither ai_edge_litert nor tflite_runtime can run a model in this process."""


# -- schema: the tflite package's modules, and the enum values used ---------------------------
def _schema(name: str):
    """The tflite package's module for one table, imported when first needed (this module loads
    without it; npu_tflite.available() says what is missing). `from tflite import Model` would
    give the class: the package re-exports every module's names, and the short aliases (Start,
    AddShape...) collide across tables, so only the prefixed builder functions are used."""
    try:
        return importlib.import_module(f"tflite.{name}")
    except ImportError as e:
        raise TfliteUnavailable(f"the tflite schema package is needed to write and check models "
                                f"(pip install tflite): {e}") from e


class _TT:                  # TensorType values used (schema.fbs; tests compare with the package)
    FLOAT32, FLOAT16, INT32, INT8, INT4 = 0, 1, 2, 9, 17


class _Opt:                 # BuiltinOptions union tags used
    NONE, FullyConnectedOptions, AddOptions, MulOptions, SplitOptions, DequantizeOptions = \
        0, 8, 11, 21, 35, 38


_FC, _DEQ, _SPLIT, _LOGISTIC, _MUL, _ADD = 9, 6, 49, 14, 18, 0   # BuiltinOperator values used
_OPTIONS = {_FC: _Opt.FullyConnectedOptions, _DEQ: _Opt.DequantizeOptions,
            _SPLIT: _Opt.SplitOptions, _LOGISTIC: _Opt.NONE, _MUL: _Opt.MulOptions,
            _ADD: _Opt.AddOptions}
_INT4 = _TT.INT4
_BLOCKWISE = 2              # QuantizationDetails.BlockwiseQuantization (newer than tflite 2.18)


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
        if w.fmt == "int8s":
            return self._sliced_fc(name, x, w, tokens)
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

    def _sliced_fc(self, name: str, x: int, w: QLinear, tokens: int) -> int:
        """int8s: one hybrid FC per 64-column slice of x, partial outputs summed by ADD."""
        n_sl = w.k // INT8S_SLICE
        if n_sl > 1:
            axis = self.tensor(f"{name}.split_axis", (), _TT.INT32, np.array(1, "<i4").tobytes())
            xs = [self.tensor(f"{name}.x{j}", (tokens, INT8S_SLICE), _TT.FLOAT32) for j in range(n_sl)]
            self.op(_SPLIT, 1, [axis, x], xs, num_splits=n_sl)
        else:
            xs = [x]
        acc = -1
        for j, xj in enumerate(xs):
            cols = slice(j * INT8S_SLICE, (j + 1) * INT8S_SLICE)
            q, scale = _nonzero_scales(w.q[:, cols], w.scale[:, j], 0)
            wt = self.tensor(f"{name}.weight{j}", (w.n, INT8S_SLICE), _TT.INT8, _le(q, "i1"),
                             scale=np.ascontiguousarray(scale, "<f4"))
            b = -1
            if j == 0 and w.bias is not None:
                b = self.tensor(f"{name}.bias", (w.n,), _TT.FLOAT32, _le(w.bias, "<f4"))
            last = j == n_sl - 1
            y = self.tensor(f"{name}.out" if last and n_sl == 1 else f"{name}.part{j}",
                            (tokens, w.n), _TT.FLOAT32)
            self.op(_FC, 12, [xj, wt, b], [y], asymmetric=_ASYMMETRIC)
            if acc < 0:
                acc = y
                continue
            total = self.tensor(f"{name}.out" if last else f"{name}.sum{j}", (tokens, w.n), _TT.FLOAT32)
            self.op(_ADD, 1, [acc, y], [total])
            acc = total
        return acc


def _nonzero_scales(q: np.ndarray, scale: np.ndarray, zero_q: int):
    """XNNPACK refuses a quantized tensor with a zero (or subnormal) scale, and quantize() gives
    an all-zero row (int8, or an int8s row's slice) or block (int4) scale 0. Those weights are
    exactly 0 whatever the scale: write them as q = zero_q with scale 1, the same dequantized
    values."""
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
        if w.fmt in ("int8", "int8s") and q.dtype != np.int8:
            return False, f"{field}: {w.fmt} weights stored as {q.dtype}, expected int8"
        if w.fmt == "int4" and (q.dtype != np.uint8 or (q.size and int(q.max()) > 15)):
            return False, f"{field}: int4 weights must be uint8 values in 0..15 (one per byte)"
        if w.fmt == "int8s" and (w.k % INT8S_SLICE or w.k // INT8S_SLICE > _MAX_SLICES):
            return False, (f"{field}: int8s needs K a multiple of {INT8S_SLICE} and at most "
                           f"{_MAX_SLICES * INT8S_SLICE}, got (N, K) = ({w.n}, {w.k})")
        if w.fmt in ("int8", "int8s"):
            want = (w.n,) if w.fmt == "int8" else (w.n, w.k // INT8S_SLICE)
            if w.scale is None or tuple(np.shape(w.scale)) != want:
                return False, f"{field}: {w.fmt} needs scale {want}, got {np.shape(w.scale)}"
            s = np.asarray(w.scale, np.float32)
            # zero is fine (rewritten, see _nonzero_scales); XNNPACK needs the rest normal, > 0
            bad = (s != 0) & ~((s >= np.finfo(np.float32).tiny) & np.isfinite(s))
            if bad.any():
                return False, (f"{field}: {int(bad.sum())} {w.fmt} scales are negative, subnormal "
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
    (AddOptions, Buffer, FullyConnectedOptions, Model, MulOptions, Operator, OperatorCode,
     QuantizationParameters, SplitOptions, SubGraph, Tensor) = map(_schema, (
        "AddOptions", "Buffer", "FullyConnectedOptions", "Model", "MulOptions", "Operator",
        "OperatorCode", "QuantizationParameters", "SplitOptions", "SubGraph", "Tensor"))
    import flatbuffers

    data_bytes = sum(len(t.data) for t in g.tensors if t.data)
    quant_bytes = sum(12 * len(t.scale) for t in g.tensors if t.scale is not None)   # f32 + i64 each
    b = flatbuffers.Builder(data_bytes + quant_bytes + 64 * len(g.tensors) + 8192)   # no regrowth

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
        elif n.code == _ADD:
            AddOptions.AddOptionsStart(b)
            opt = AddOptions.AddOptionsEnd(b)
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

