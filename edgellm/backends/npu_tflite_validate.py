"""The npu unit's LiteRT/TFLite model validator: validate() checks a .tflite flatbuffer the way
npu_tflite_writer writes it, before any runtime reads it. Every table, vtable, vector and string is
bounds-checked before the schema package's accessors read it; only the fields the writer sets may
be present; indices, shapes, types, constant data sizes, quantization, each operator's signature
and the dataflow order are checked. Every model, built or loaded from the cache, passes validate()
before an interpreter sees it (RELIABILITY.md item 16); TfliteModelError names the field.
"""
from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import numpy as np

from ..errors import ModelFormatError
from .npu_graphs import INT4_BLOCK, INT8S_SLICE
from .npu_tflite_writer import (SCHEMA_VERSION, _ADD, _BLOCKWISE, _DEQ, _FC, _INT4, _LOGISTIC,
                                _MAX_DIM, _MAX_ELEMENTS, _MAX_SLICES, _MUL, _OPTIONS, _SPLIT, _TT,
                                _Opt, _schema)

_MAX_BYTES = (1 << 31) - 1  # flatbuffers' own limit (uoffset_t); larger models use offset buffers
# Caps on counts, checked before anything is iterated: an FFN of two int8s FCs of _MAX_SLICES
# slices each (4 tensors, 1 buffer, 2 ops a slice), plus the few tensors and ops around them.
_MAX_TENSORS = 8 * _MAX_SLICES + 64
_MAX_OPS = 4 * _MAX_SLICES + 32
_MAX_BUFFERS = 2 * _MAX_SLICES + 64
_MAX_OPCODES = 8
_MAX_OP_OUTPUTS = _MAX_SLICES  # a SPLIT writes one output per int8s slice
_MAX_NAME = 256


class TfliteModelError(ModelFormatError):
    """A .tflite flatbuffer (built here or read from the cache) that fails validate(); `path` is
    the file or "<memory>", `field` the schema path of what is wrong."""


_OP_NAME = {_FC: "FULLY_CONNECTED", _DEQ: "DEQUANTIZE", _SPLIT: "SPLIT", _LOGISTIC: "LOGISTIC",
            _MUL: "MUL", _ADD: "ADD"}
_MAX_VERSION = {_FC: 12, _DEQ: 3, _SPLIT: 1, _LOGISTIC: 1, _MUL: 1, _ADD: 1}   # the versions written
_BITS = {_TT.FLOAT32: 32, _TT.FLOAT16: 16, _TT.INT8: 8, _TT.INT32: 32, _INT4: 4}
_TYPE_NAME = {_TT.FLOAT32: "FLOAT32", _TT.FLOAT16: "FLOAT16", _TT.INT8: "INT8", _TT.INT32: "INT32",
              _INT4: "INT4"}


def _nbytes(ttype: int, shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return (n * _BITS[ttype] + 7) // 8


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
    "AddOptions": {0: _U8},                                   # fused activation (pot_scale_int16 never)
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
        op_in, op_out = r.ints(op, 1, 8, f"{f}.inputs"), r.ints(op, 2, _MAX_OP_OUTPUTS, f"{f}.outputs")
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
    want_in = {_FC: 3, _DEQ: 1, _SPLIT: 2, _LOGISTIC: 1, _MUL: 2, _ADD: 2}[code]
    # SPLIT: 2 outputs (the FFN's gate / up) or one per int8s slice, checked with its options
    want_out = len(outs) if code == _SPLIT else {_FC: 1, _DEQ: 1, _LOGISTIC: 1, _MUL: 1, _ADD: 1}[code]
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
                _MUL: "MulOptions", _ADD: "AddOptions"}[code]
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
        ns = opts.NumSplits()
        # the FFN's gate / up halves, or an int8s FC's 64-column slices (two or more)
        if not ((ns == 2 and c % 2 == 0) or (ns >= 2 and c == ns * INT8S_SLICE)):
            r.fail(f"{f}.builtin_options", f"num_splits {ns} on {c} columns, expected 2 or "
                                           f"columns / {INT8S_SLICE}")
        if len(outs) != ns:
            r.fail(f"{f}.outputs", f"{len(outs)} outputs, num_splits {ns}")
        for j in range(ns):
            if f32_2d(O[j], "output") != (t_, c // ns):
                r.fail(f"{f}.outputs[{j}]", f"{O[j].shape}, expected {(t_, c // ns)}")
    elif code == _LOGISTIC:
        if f32_2d(O[0], "output") != f32_2d(T[0], "input"):
            r.fail(f"{f}.outputs[0]", f"{O[0].shape}, expected {T[0].shape}")
    else:   # MUL and ADD, without broadcasting
        if opts.FusedActivationFunction() != 0:
            r.fail(f"{f}.builtin_options", f"{name}: only no activation is written")
        s = f32_2d(T[0], "input 0")
        if f32_2d(T[1], "input 1") != s or f32_2d(O[0], "output") != s:
            r.fail(f, f"{name} shapes {T[0].shape}, {T[1].shape} -> {O[0].shape}: expected all equal")

