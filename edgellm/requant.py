"""Requantization: fp32 weights into a target format with the error measured, and a GGUF writer.

Two halves:
  convert(w, fmt)      one (N, K) fp32 matrix -> the stored form + its dequantized fp32 twin + SQNR.
  requantize_gguf()    a GGUF -> a new GGUF (written with the gguf package's GGUFWriter) in which
                       the named tensors are dequantized and requantized; everything else (metadata,
                       tokenizer, untouched tensors) is copied as stored.

Formats (weights are (N, K): N output channels, K the row length = GGUF ne[0], the reduction axis):
  GGUF block/float types  "f32", "f16", "q8_0", "q4_0", "q4_1"   via quant.quantize (ggml's layout,
                          bit-exact with llama.cpp and the gguf package)
  runtime formats         "int8"      symmetric per output channel: s = max|row| / 127, q in [-127, 127]
                          "int4-G"    symmetric groups of G along K (G = 32, 64, 128): s = max|group| / 7
                                      stored as fp16, q = round(w / s) in [-7, 7]; no zero point, so the
                                      code -8 is unused (zero stays exactly representable)
The runtime formats have no GGUF type that llama.cpp reads, so a GGUF written here stores them as
the nearest block type (GGUF_TYPE_FOR): int8 -> Q8_0 (int8 values, one fp16 scale per 32 instead of
per row: never coarser), int4-G -> Q4_0 (4-bit, one fp16 scale per 32: never coarser than G). The
Report lists every such mapping.

SQNR (dB) = 10 log10(sum w^2 / sum (w - w_hat)^2), inf for an exact conversion. In a GGUF rewrite it
is measured against the *source's dequantized* weights: it is the error this conversion adds, not
the error against the original (pre-GGUF) checkpoint, which the file no longer has.
"""
from __future__ import annotations

import difflib
import logging
import math
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np
from gguf import GGUFWriter

from . import quant
from .model import layout
from .model.ggml_types import GGML_QUANT_SIZES, GGUFValueType
from .model.ggml_types import GGMLQuantizationType as T
from .errors import ConfigError, ModelFormatError, UnsupportedModelError
from .fileio import fsync_dir, os_error_text, remove_dead_writers, temp_beside
from .kquant_repack import REPACKS
from .model.gguf_file import read_tensor

log = logging.getLogger("edgellm")

__all__ = [
    "FORMATS", "GGUF_FORMATS", "GGUF_TYPE_FOR", "PLAN_OPS", "Converted", "TensorReport", "Report",
    "convert", "unpack_int4", "sqnr_db", "requantize_gguf", "plan_formats", "format_report",
]

GGUF_FORMATS: dict[str, T] = {"f32": T.F32, "f16": T.F16, "q8_0": T.Q8_0, "q4_0": T.Q4_0, "q4_1": T.Q4_1}
INT4_GROUPS = (32, 64, 128)
RUNTIME_FORMATS = ("int8",) + tuple(f"int4-{g}" for g in INT4_GROUPS)
FORMATS: tuple[str, ...] = tuple(GGUF_FORMATS) + RUNTIME_FORMATS

# format -> the GGUF type it is written as; for the runtime formats, the nearest block type
# llama.cpp reads (see the module doc for why it is never coarser)
GGUF_TYPE_FOR: dict[str, T] = dict(GGUF_FORMATS) | {"int8": T.Q8_0} | {f"int4-{g}": T.Q4_0 for g in INT4_GROUPS}

# ops of a precision plan whose weights live in tensors (plan_formats)
PLAN_OPS = ("qkv", "attn_out", "ffn_gate_up", "ffn_down", "lm_head", "embedding")
KEEP = "gguf"  # a plan's "keep the file's own format"

_SQNR_CHUNK = 1 << 22  # elements per chunk of the fp64 error sums (32 MiB of fp64 temporaries)


def _check_format(fmt: str, what: str) -> None:
    if fmt not in FORMATS:
        raise ConfigError(f"{what}: unknown weight format {fmt!r}; expected one of {', '.join(FORMATS)}")


def _block_size(fmt: str) -> int:
    """Row-length granularity the format needs (1: any K)."""
    if fmt.startswith("int4-"):
        return int(fmt.split("-")[1])
    if fmt == "int8":
        return 1
    return GGML_QUANT_SIZES[GGUF_FORMATS[fmt]][0]


# ---------------------------------------------------------------------------------------------
# error measure


def sqnr_db(w: np.ndarray, w_hat: np.ndarray) -> float:
    """10 log10(sum w^2 / sum (w - w_hat)^2) in dB; inf when w_hat == w exactly. Sums in fp64,
    in chunks (an fp32 sum of squares over 28M embedding values loses the small error terms)."""
    return _db(*_power_sums(w, w_hat))


def _power_sums(w: np.ndarray, w_hat: np.ndarray) -> tuple[float, float]:
    """(sum w^2, sum (w - w_hat)^2), in fp64"""
    a = np.asarray(w, dtype=np.float32).reshape(-1)
    b = np.asarray(w_hat, dtype=np.float32).reshape(-1)
    if a.shape != b.shape:
        raise ValueError(f"sqnr_db: {a.size} values against {b.size}")
    sig = err = 0.0
    for i in range(0, a.size, _SQNR_CHUNK):
        x = a[i:i + _SQNR_CHUNK].astype(np.float64)
        d = x - b[i:i + _SQNR_CHUNK]
        sig += float(np.dot(x, x))
        err += float(np.dot(d, d))
    return sig, err


def _db(sig: float, err: float) -> float:
    if not math.isfinite(err):      # (values past the format's range came back inf: no signal left)
        return -math.inf
    if err == 0.0:
        return math.inf
    if sig == 0.0:
        return -math.inf
    return 10.0 * math.log10(sig / err)


# ---------------------------------------------------------------------------------------------
# conversions of one matrix


@dataclass(frozen=True)
class Converted:
    fmt: str                      # the format converted to (a name in FORMATS)
    data: np.ndarray              # stored form. GGUF types: raw bytes (N, row_bytes) uint8 in ggml's
                                  # layout; int8: (N, K) int8; int4-G: (N, K/2) uint8, two 4-bit
                                  # two's-complement codes per byte (element 2j low nibble, 2j+1 high)
    scales: np.ndarray | None     # int8: (N,) fp32 per channel; int4-G: (N, K/G) fp16; GGUF: None
                                  # (the scales are inside the blocks)
    dequantized: np.ndarray       # (N, K) fp32: what a kernel computes with
    sqnr_db: float                # of dequantized against the input, dB (inf: exact)

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes + (0 if self.scales is None else self.scales.nbytes))


def _round_half_away(x: np.ndarray) -> np.ndarray:
    # ggml's roundf, so the runtime formats round like the block formats do
    return np.trunc(x + np.copysign(np.float32(0.5), x))


def _int8_channel(w: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    scale = (np.abs(w).max(axis=1) / np.float32(127.0)).astype(np.float32)        # (N,)
    with np.errstate(divide="ignore"):
        inv = np.where(scale != 0, np.float32(1.0) / scale, np.float32(0.0)).astype(np.float32)
    q = np.clip(_round_half_away(w * inv[:, None]), -127, 127).astype(np.int8)    # (N, K)
    return q, scale, q.astype(np.float32) * scale[:, None]


def _int4_groups(w: np.ndarray, g: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    n, k = w.shape
    wg = w.reshape(n, k // g, g)                                                   # (N, K/G, G)
    # the scale is rounded to fp16 first and the codes computed with the rounded scale, so
    # dequantization with the stored scale is what the codes were chosen for
    scale = (np.abs(wg).max(axis=2) / np.float32(7.0)).astype(np.float16)          # (N, K/G)
    s32 = scale.astype(np.float32)
    with np.errstate(divide="ignore"):
        inv = np.where(s32 != 0, np.float32(1.0) / s32, np.float32(0.0)).astype(np.float32)
    q = np.clip(_round_half_away(wg * inv[..., None]), -7, 7).astype(np.int8)      # (N, K/G, G)
    deq = (q.astype(np.float32) * s32[..., None]).reshape(n, k)
    nib = (q.reshape(n, k).view(np.uint8) & 0x0F)
    packed = (nib[:, 0::2] | (nib[:, 1::2] << 4)).astype(np.uint8)                 # (N, K/2)
    return packed, scale, deq


def unpack_int4(packed: np.ndarray) -> np.ndarray:
    """(N, K/2) packed int4 codes -> (N, K) int8 in [-8, 7] (the inverse of int4-G's packing)."""
    p = np.asarray(packed, dtype=np.uint8)
    lo = (p & 0x0F).astype(np.int8)
    hi = (p >> 4).astype(np.int8)
    out = np.empty((p.shape[0], p.shape[1] * 2), dtype=np.int8)
    out[:, 0::2], out[:, 1::2] = lo, hi
    out[out > 7] -= 16
    return out


def convert(w: np.ndarray, fmt: str, *, name: str = "weight") -> Converted:
    """One fp32 matrix (N, K) (any leading shape: rows are the last axis) -> `fmt`.
    ConfigError for an unknown format, a K the format's block/group size does not divide, or a
    NaN or infinite value (`name` is what the error calls the matrix)."""
    _check_format(fmt, name)
    w = np.ascontiguousarray(w, dtype=np.float32)
    if w.ndim == 0:
        raise ConfigError(f"{name}: expected a matrix, found a scalar")
    k = w.shape[-1]
    bs = _block_size(fmt)
    if k % bs:
        raise ConfigError(f"{name}: row length K = {k} is not a multiple of {fmt}'s block size {bs}")
    bad = ~np.isfinite(w)
    if bad.any():
        # a block's scale is max|w| / qmax: one NaN or inf poisons the whole block (its SQNR is
        # NaN and its dequantized values are NaN or 0), so the output would be a broken model
        first = np.unravel_index(int(np.argmax(bad)), w.shape)
        raise ConfigError(f"{name}: {int(bad.sum())} of {w.size} values are NaN or infinite (first at "
                          f"index {tuple(int(i) for i in first)}: {w[first]}); a damaged source tensor "
                          f"cannot be converted to {fmt}")
    if fmt in GGUF_FORMATS:
        qt = GGUF_FORMATS[fmt]
        raw = quant.quantize(w, qt)
        deq = quant.dequantize(raw.reshape(-1), qt, w.shape)
        return Converted(fmt, raw, None, deq, sqnr_db(w, deq))
    m = w.reshape(-1, k)
    if fmt == "int8":
        data, scales, deq = _int8_channel(m)
    else:
        data, scales, deq = _int4_groups(m, bs)
    return Converted(fmt, data, scales, deq.reshape(w.shape), sqnr_db(w, deq))


# ---------------------------------------------------------------------------------------------
# GGUF rewrite


@dataclass(frozen=True)
class TensorReport:
    name: str                     # tensor name
    from_type: str                # GGML type in the source ("Q4_1", "F32", ...)
    to_type: str                  # GGML type written
    requested: str | None         # the format asked for (None: not named, copied as stored)
    bytes_before: int             # data bytes in the source (unpadded)
    bytes_after: int              # data bytes written (unpadded)
    sqnr_db: float                # against the source's dequantized values; inf when copied
    note: str = ""                # why the written type differs from the request, or why copied

    @property
    def requantized(self) -> bool:
        return self.requested is not None and self.from_type != self.to_type


@dataclass(frozen=True)
class Report:
    src: str                              # source GGUF
    dst: str                              # written GGUF
    tensors: tuple[TensorReport, ...]     # every tensor, in file order
    mapped: tuple[tuple[str, str, str], ...]  # (format, GGUF type, why) for each runtime format used
    predicted_size: int                   # bytes: header + aligned tensor data, computed before writing
    actual_size: int                      # bytes of the file written

    @property
    def converted(self) -> tuple[TensorReport, ...]:
        """The tensors named in `formats` (requantized, or copied because the type already matched)."""
        return tuple(t for t in self.tensors if t.requested is not None)

    @property
    def bytes_before(self) -> int:
        return sum(t.bytes_before for t in self.tensors)

    @property
    def bytes_after(self) -> int:
        return sum(t.bytes_after for t in self.tensors)


class _Array:
    """A metadata array with its element type fixed, so that it is written with the type it was
    read with (GGUFWriter infers nested element types from Python values: UINT32 would come back
    INT32) and so that empty arrays, which GGUF allows and GGUFWriter refuses, survive."""

    __slots__ = ("elem_type", "items")

    def __init__(self, elem_type: GGUFValueType, items: Any):
        self.elem_type = elem_type
        self.items = items                    # list[str] | list[_Array] | 1-D numpy array

    def __len__(self) -> int:
        return len(self.items)


class _Writer(GGUFWriter):
    """GGUFWriter that packs _Array values itself (numeric ones in one tobytes) and defers all
    other values to the package. _pack_val is the package's internal packing hook (its signature as of gguf 0.17)."""

    def _pack_val(self, val: Any, vtype: GGUFValueType, add_vtype: bool,
                  sub_type: GGUFValueType | None = None) -> bytes:
        if not isinstance(val, _Array):
            return super()._pack_val(val, vtype, add_vtype, sub_type)
        out = bytearray()
        if add_vtype:
            out += self._pack("I", GGUFValueType.ARRAY)
        out += self._pack("I", val.elem_type)
        out += self._pack("Q", len(val))
        if isinstance(val.items, np.ndarray):
            dt = _NUMPY_ELEM[val.elem_type]
            out += np.ascontiguousarray(val.items).astype(dt, copy=False).tobytes()
        else:
            for item in val.items:
                out += self._pack_val(item, val.elem_type, add_vtype=False)
        return bytes(out)


_V = GGUFValueType
_NUMPY_ELEM = {_V.UINT8: "<u1", _V.INT8: "<i1", _V.UINT16: "<u2", _V.INT16: "<i2", _V.UINT32: "<u4",
               _V.INT32: "<i4", _V.FLOAT32: "<f4", _V.BOOL: "<u1", _V.UINT64: "<u8", _V.INT64: "<i8",
               _V.FLOAT64: "<f8"}
_SCALAR_BYTES = {t: np.dtype(d).itemsize for t, d in _NUMPY_ELEM.items()}


def _meta_value(value: Any, types: tuple[GGUFValueType, ...]) -> Any:
    """Loader value + its type path (GGUFFile.metadata_types) -> what _Writer packs identically."""
    if types[0] is not _V.ARRAY:
        return value
    elem = types[1] if len(types) > 1 else _V.ARRAY
    if elem is _V.ARRAY:
        return _Array(_V.ARRAY, [_meta_value(v, types[1:]) for v in value])
    if elem is _V.STRING:
        return _Array(_V.STRING, list(value))
    return _Array(elem, np.asarray(value))


def _encoded_size(value: Any, vtype: GGUFValueType) -> int:
    """Bytes of a value as GGUF encodes it (independent of any writer: the size prediction)."""
    if vtype is _V.STRING:
        return 8 + len(value.encode("utf-8"))
    if vtype is _V.ARRAY:
        assert isinstance(value, _Array)
        if value.elem_type in _SCALAR_BYTES:
            return 12 + len(value) * _SCALAR_BYTES[value.elem_type]
        return 12 + sum(_encoded_size(v, value.elem_type) for v in value.items)
    return _SCALAR_BYTES[vtype]


def _pad(n: int, align: int) -> int:
    return -(-n // align) * align


def _predicted_size(metadata: Mapping[str, tuple[Any, GGUFValueType]],
                        tensors: Sequence[tuple[str, int, int]], alignment: int) -> int:
    """GGUF v3 file size: 24-byte header, key/values (key -> (value, type), arrays as _Array),
    tensor infos ((name, n_dims, nbytes) each), padding to `alignment`, then each tensor's data
    padded to `alignment` (GGUFWriter pads after the last one too)."""
    header = 24
    for key, (value, vtype) in metadata.items():
        header += 8 + len(key.encode("utf-8")) + 4 + _encoded_size(value, vtype)
    for name, n_dims, _ in tensors:
        header += 8 + len(name.encode("utf-8")) + 4 + 8 * n_dims + 4 + 8
    return _pad(header, alignment) + sum(_pad(nbytes, alignment) for _, _, nbytes in tensors)


@dataclass(frozen=True)
class _Job:
    name: str
    src_type: T
    dst_type: T
    np_shape: tuple[int, ...]     # numpy order (GGUF ne reversed)
    requested: str | None
    nbytes_in: int
    nbytes_out: int
    note: str


def _plan_jobs(mf: Any, formats: Mapping[str, str]) -> list[_Job]:
    tensors = mf.gguf.tensors
    for name, fmt in formats.items():
        if name not in tensors:
            near = difflib.get_close_matches(name, list(tensors), n=3)
            hint = f" (similar: {', '.join(near)})" if near else ""
            raise ConfigError(f"formats: tensor {name!r} is not in {mf.path}{hint}")
        _check_format(fmt, f"formats[{name!r}]")
    jobs = []
    for name, info in tensors.items():
        np_shape = tuple(reversed(info.shape))
        fmt = formats.get(name)
        if fmt is None:
            jobs.append(_Job(name, info.ggml_type, info.ggml_type, np_shape, None, info.nbytes, info.nbytes, ""))
            continue
        dst = GGUF_TYPE_FOR[fmt]
        k = info.shape[0]
        block, type_size = GGML_QUANT_SIZES[dst]
        # the runtime format's own group must divide K as well: a plan that asks for int4-128
        # on K = 96 is wrong even though the Q4_0 it is written as would fit
        need = max(block, _block_size(fmt))
        if k % need:
            raise ConfigError(f"formats[{name!r}] = {fmt!r}: row length K = {k} is not a multiple of "
                              f"the block size {need}")
        if len(info.shape) == 1 and dst not in (T.F32, T.F16):
            raise ConfigError(f"formats[{name!r}] = {fmt!r}: a 1-D tensor (norm or bias) must stay "
                              "f32/f16; llama.cpp and edgellm reject block-quantized vectors")
        if info.ggml_type not in quant.SUPPORTED_TYPES + quant.CONVERTIBLE_TYPES:
            raise UnsupportedModelError(mf.path, f"tensor {name!r}", f"type {info.ggml_type.name} cannot "
                                        "be dequantized here, so it cannot be requantized")
        note = f"{fmt} written as {dst.name}" if fmt in RUNTIME_FORMATS else ""
        if dst == info.ggml_type:
            note = "; ".join(filter(None, [note, f"already {dst.name}: copied as stored "
                                                 "(requantizing could only add error)"]))
        nbytes = info.n_elements // block * type_size
        jobs.append(_Job(name, info.ggml_type, dst, np_shape, fmt, info.nbytes, nbytes, note))
    return jobs


# fp32 values dequantized at a time by _convert_rows: 4 MiB (the gguf package's K-quant readers
# take several times that in temporaries)
_CONVERT_VALUES = 1 << 20


def _convert_rows(raw: np.ndarray, j: "_Job", src_path: str) -> tuple[np.ndarray, float]:
    """(j's tensor in j.dst_type, the conversion's SQNR in dB), converted a few rows at a time (a
    GGUF type's rows are independent blocks): dequantized whole, a tensor took ~5x its fp32 size at
    once (Llama 3.2 1B's Q6_K token_embd, 128256 x 2048: ~5 GB on a phone, a probe)."""
    name = f"{src_path}: tensor {j.name}"
    k = j.np_shape[-1]
    n = int(np.prod(j.np_shape[:-1], dtype=np.int64))
    rows = np.asarray(raw).view(np.uint8).reshape(n, -1)
    step = max(1, _CONVERT_VALUES // k)
    repack = REPACKS.get((j.src_type, j.dst_type))   # (Q4_K -> Q4_1, Q5_0 -> Q8_0: no second rounding)
    out, sig, err = [], 0.0, 0.0
    for r0 in range(0, n, step):
        part = rows[r0:r0 + step]
        w = quant.dequantize(part, j.src_type, (len(part), k))
        # (a NaN / inf source value goes to convert(), which refuses the damaged tensor by name: the
        # Q5_0 repack copied a NaN scale into the model, a RuntimeWarning its only sign)
        data = repack(part) if repack is not None and np.isfinite(w).all() else None
        if data is not None:
            w_hat = quant.dequantize(data, j.dst_type, (len(part), k))
        else:
            with np.errstate(over="ignore", invalid="ignore"):   # (said below, by tensor name)
                c = convert(w, _gguf_name(j.dst_type), name=name)
            data, w_hat = np.ascontiguousarray(c.data).view(np.uint8).reshape(len(part), -1), c.dequantized
        if not np.isfinite(w_hat).all() and np.isfinite(w).all():
            # past fp16's 65504: an F16 value, or a block scale (values ~15-127x that): inf or nan
            raise UnsupportedModelError(src_path, f"tensor {j.name!r}", f"its values reach "
                                        f"{float(np.abs(w).max()):.3g}, past what {j.dst_type.name} holds (fp16 values "
                                        f"or scales); the {j.src_type.name} tensor cannot run here")
        s, e = _power_sums(w, w_hat)
        sig, err = sig + s, err + e
        out.append(data)
        del w, w_hat
    return np.concatenate(out) if len(out) > 1 else out[0], _db(sig, err)


def _file_key(st: os.stat_result) -> tuple[int, int, int, int, int]:
    """What changes when a file is replaced (device, inode) or written in place (size, mtime, and
    ctime, which a writer that sets mtime back cannot set back)."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _check_unchanged(path: str, key: tuple[int, int, int, int, int] | None, now: os.stat_result | None) -> None:
    """ModelFormatError unless the source is still the file `key` describes. A rewrite within one
    tick of a coarse file-system clock can keep mtime: that one goes unseen; a size change or a
    replacement does not."""
    changes = []
    if now is None:
        changes.append("it was removed")
    elif key is not None and _file_key(now) != key:
        dev, ino, size, mtime, ctime = key
        if (now.st_dev, now.st_ino) != (dev, ino):
            changes.append("it was replaced by another file")
        if now.st_size != size:
            changes.append(f"its size went from {size} to {now.st_size} bytes")
        if now.st_mtime_ns != mtime:
            changes.append("its modification time changed")
        elif now.st_ctime_ns != ctime and (now.st_dev, now.st_ino) == (dev, ino):
            changes.append("it was written or its times set (its ctime changed)")
    if changes:
        raise ModelFormatError(path, "file", f"expected it unchanged while quantize read it, found that "
                                             f"{', '.join(changes)} (another process changed it: a download "
                                             "restarting?); no output was written")


def _free_bytes(d: str) -> int | None:
    """The bytes free in folder d for this process; None where the file system gives no figure:
    an error, or no blocks at all (/proc, /sys: pseudo file systems report 0 of 0, and their
    refusal of a file was said as "the file needs 89.7 MiB but /proc has 0.0 MiB free")."""
    try:
        st = os.statvfs(d)
    except (OSError, AttributeError):   # (AttributeError: no statvfs here)
        try:
            return shutil.disk_usage(d).free
        except OSError:
            return None
    return st.f_bavail * st.f_frsize if st.f_blocks else None


def requantize_gguf(src_path: str | os.PathLike, dst_path: str | os.PathLike, formats: Mapping[str, str],
                    *, progress: Callable[[int, int], None] | None = None, replace: bool = True) -> Report:
    """Write a copy of the GGUF `src_path` to `dst_path` in which each tensor named in `formats`
    (tensor name -> a name in FORMATS) is dequantized to fp32 and requantized; every other tensor
    and every metadata key/value (tokenizer included, with its GGUF types) is copied as stored.

    The runtime formats "int8" and "int4-32/64/128" have no GGUF type llama.cpp reads: they are
    written as the nearest block type, int8 -> Q8_0 and int4-* -> Q4_0 (GGUF_TYPE_FOR); the Report
    says so (`mapped`, and each tensor's note). A tensor already of the target type is copied
    unchanged. Metadata is copied verbatim, general.file_type included (it then names the source's
    dominant type, which llama.cpp only displays).

    The file is written to a temporary file beside dst, fsynced, and renamed over dst: an
    interrupted write leaves dst as it was. progress(done, total) is called after each tensor.
    replace=False: dst must still not exist when the file is complete (ConfigError otherwise,
    dst left as it is): a file made there during the write (another quantize's output, a user's)
    is not replaced.

    Raises ConfigError for an unknown format, a tensor name not in the model, a row length K the
    target block size does not divide, a 1-D tensor asked for a block type, a tensor to convert
    that holds NaN or infinite values (checked as each is converted), or dst == src;
    ModelFormatError / UnsupportedModelError / ModelNotFoundError from the loader pass through.
    ModelFormatError too when the source changes while it is read: shorter than parsed (naming
    the tensor), or rewritten, replaced or removed (checked after the last tensor); dst is then
    left as it was.
    """
    from .model.loader import open_model

    src_path, dst_path = os.fspath(src_path), os.fspath(dst_path)
    try:   # before the parse: a rewrite from here on is seen (_check_unchanged below)
        src_key: tuple[int, int, int, int, int] | None = _file_key(os.stat(src_path))
    except OSError:
        src_key = None                          # (open_model says what is wrong)
    mf = open_model(src_path)
    if os.path.exists(dst_path) and os.path.samefile(src_path, dst_path):
        raise ConfigError(f"{dst_path}: the output must not be the source file")
    jobs = _plan_jobs(mf, formats)
    g = mf.gguf

    meta = {k: (_meta_value(v, g.metadata_types[k]), g.metadata_types[k][0]) for k, v in g.metadata.items()}
    predicted = _predicted_size(meta, [(j.name, len(j.np_shape), j.nbytes_out) for j in jobs], g.alignment)
    mapped = tuple(sorted({(f, GGUF_TYPE_FOR[f].name, "no GGUF type for this runtime format; the nearest "
                            "block type llama.cpp reads, with finer scales")
                           for f in formats.values() if f in RUNTIME_FORMATS}))

    d = os.path.dirname(os.path.abspath(dst_path))
    if not os.path.isdir(d):
        raise ConfigError(f"{dst_path}: the output directory {d} does not exist")
    if os.path.isdir(dst_path):
        raise ConfigError(f"{dst_path}: is a directory; give a file path")
    if os.path.exists(dst_path) and not os.path.isfile(dst_path):
        # the file is written beside it and renamed over it: a device (/dev/null as root) or a
        # pipe would be replaced by a regular file
        raise ConfigError(f"{dst_path}: is not a regular file (a device, pipe or socket)")
    # a temporary file whose writer has died (SIGKILL, a phone's low-memory killer: its lock is
    # gone) is an orphan the next writer in this folder removes (first: its room counts below)
    remove_dead_writers(d)
    # the temporary file first: a folder that refuses files (EACCES, EPERM, EROFS, /proc's
    # ENOENT) says so in the system's words, naming the user's path, before any free-space figure
    # (its own temp name failed for names past ~225 bytes). lock_fd holds the lock that tells
    # other processes' cleaners this write is alive: closed only after the rename or the removal
    try:
        lock_fd, tmp = temp_beside(Path(dst_path))
    except OSError as e:
        raise ConfigError(f"{dst_path}: cannot write a file in {d}: {os_error_text(e)}") from None

    def give_up() -> None:
        os.unlink(tmp)
        os.close(lock_fd)
    free = _free_bytes(d)
    if free is not None and free < predicted:   # known before any work: said now, not ~40 MB in
        give_up()
        raise ConfigError(f"{dst_path}: the file needs {predicted / 2**20:.1f} MiB but {d} has "
                          f"{free / 2**20:.1f} MiB free")
    # the tensors are read with plain reads, not through the loader's memmap: a source that
    # shrinks under a mapping (another process rewriting it, a download restarting) kills the
    # process with SIGBUS; a read past the end is a ModelFormatError naming the tensor
    # (gguf_file.read_tensor). The descriptor keeps the inode checked here, whatever the path
    # becomes later.
    try:
        src = open(src_path, "rb", buffering=0)
    except BaseException:
        give_up()
        raise
    try:
        _check_unchanged(src_path, src_key, os.fstat(src.fileno()))
        writer = _Writer(tmp, g.metadata.get("general.architecture", "llama"))
    except BaseException:
        src.close()
        give_up()
        raise
    reports: list[TensorReport] = []
    try:
        writer.kv_data[0].clear()               # the constructor's general.architecture: copied below, in order
        writer.data_alignment = g.alignment
        for key, (value, vtype) in meta.items():
            writer.add_key_value(key, value, vtype)
        for j in jobs:
            # raw_dtype with a non-uint8 dtype: the shape given is taken as the element shape
            writer.add_tensor_info(j.name, j.np_shape, np.dtype(np.float32), j.nbytes_out, raw_dtype=j.dst_type)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for i, j in enumerate(jobs):
            try:
                raw = read_tensor(src, g, g.tensors[j.name])
            except OSError as e:   # (the source's failure, not the output's: said as such below)
                raise ConfigError(f"{src_path}: cannot read tensor {j.name}: {os_error_text(e)}") from None
            sq = math.inf
            if j.dst_type != j.src_type:
                raw, sq = _convert_rows(raw, j, str(src_path))
            writer.write_tensor_data(np.ascontiguousarray(raw).view(np.uint8).reshape(-1))
            reports.append(TensorReport(j.name, j.src_type.name, j.dst_type.name, j.requested,
                                        j.nbytes_in, j.nbytes_out, sq, j.note))
            if progress is not None:
                progress(i + 1, len(jobs))
        writer.flush()
        assert writer.fout is not None
        os.fsync(writer.fout[0].fileno())
        writer.close()
        # a source rewritten in place (same size or grown back) reads without error, and the
        # output would mix its old and new tensors: seen here, before the rename
        try:
            now: os.stat_result | None = os.stat(src_path)
        except FileNotFoundError:
            now = None
        _check_unchanged(src_path, src_key, now)
        actual = os.path.getsize(tmp)
        # mkstemp makes the file owner-only; a model file gets the usual permissions (umask)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        if replace:
            os.replace(tmp, dst_path)
        else:
            _move_new(tmp, dst_path)
    except BaseException as e:
        writer.close()
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        if isinstance(e, OSError) and e.errno is None:
            # numpy's tofile reports a short write as "N requested and M written", no errno and no
            # path: a full disk or a file-size limit (ulimit -f)
            raise ConfigError(f"{dst_path}: cannot write it: {e} (the disk is full or a file-size limit "
                              f"was reached)") from None
        if isinstance(e, OSError):
            # the output's (the source's reads are said above): its errno's own words and the
            # user's path, not the temporary file's name or a bare "[Errno 28]"
            raise ConfigError(f"{dst_path}: cannot write it: {os_error_text(e)}") from None
        raise
    finally:
        src.close()
        os.close(lock_fd)
    fsync_dir(d)
    return Report(src=src_path, dst=dst_path, tensors=tuple(reports), mapped=mapped,
                  predicted_size=predicted, actual_size=actual)


def _move_new(tmp: str, dst: str) -> None:
    """Renames tmp to dst only if dst does not exist, atomically: os.replace took whatever had
    appeared at dst since the command checked it (two quantize on one -o both exited 0, the last
    one's file replacing the other's; a probe). A hard link fails on an existing name; where the
    file system has none (FAT on a phone's card), the check is made as close to the rename as
    Python allows."""
    try:
        os.link(tmp, dst)
    except FileExistsError:
        raise ConfigError(f"{dst}: a file appeared there while the model was written; it is left as it "
                          f"is: give another path, or pass --force to replace it") from None
    except OSError:   # (no hard links here: EPERM, ENOTSUP, EMLINK, EXDEV)
        if os.path.lexists(dst):
            raise ConfigError(f"{dst}: a file appeared there while the model was written; it is left "
                              f"as it is: give another path, or pass --force to replace it") from None
        os.replace(tmp, dst)
        return
    os.unlink(tmp)


def _gguf_name(t: T) -> str:
    return next(k for k, v in GGUF_FORMATS.items() if v == t)


# ---------------------------------------------------------------------------------------------
# precision plan -> tensor names


def plan_formats(model: Any, weight_format: Callable[[int | None, str], str]) -> dict[str, str]:
    """Map a plan's per-(layer, op) weight formats onto tensor names.

    model: a ModelFile (open_model) or a ModelConfig. weight_format(layer, op) -> a name in
    FORMATS, or "gguf" to keep the file's own; op in PLAN_OPS, layer None for lm_head and
    embedding. qkv -> blk.i.attn_q/k/v.weight, attn_out -> attn_output, ffn_gate_up -> ffn_gate +
    ffn_up, ffn_down -> ffn_down, embedding -> token_embd.weight, lm_head -> output.weight.

    Tied embeddings: the head IS token_embd.weight, one tensor serving a gather (embedding) and the
    largest matmul (lm_head). It takes whichever of the two choices is not "gguf"; when both name
    a format and they differ, ConfigError (one tensor cannot be stored twice)."""
    cfg = getattr(model, "config", model)
    out: dict[str, str] = {}

    def ask(layer: int | None, op: str) -> str:
        fmt = weight_format(layer, op)
        if fmt != KEEP:
            where = f"layer {layer} op {op!r}" if layer is not None else f"op {op!r}"
            _check_format(fmt, f"plan: {where}")
        return fmt

    for i in range(cfg.n_layers):
        p = f"blk.{i}."
        for op, names in layout.SEGMENTS.items():
            fmt = ask(i, op)
            if fmt != KEEP:
                out.update({f"{p}{n}.weight": fmt for n in names})
    emb, head = ask(None, "embedding"), ask(None, "lm_head")
    if cfg.tied_embeddings:
        if emb != KEEP and head != KEEP and emb != head:
            raise ConfigError(f"plan: embedding {emb!r} and lm_head {head!r} disagree, but this model ties "
                              "them: both are token_embd.weight; give them the same format")
        fmt = head if head != KEEP else emb
        if fmt != KEEP:
            out["token_embd.weight"] = fmt
    else:
        if emb != KEEP:
            out["token_embd.weight"] = emb
        if head != KEEP:
            out["output.weight"] = head
    return out


# ---------------------------------------------------------------------------------------------
# report text


def format_report(report: Report) -> str:
    """A few lines for the CLI: each converted tensor, SQNR per written type, sizes."""
    lines = [f"{report.src} -> {report.dst}"]
    conv = report.converted
    if conv:
        w = max(len(t.name) for t in conv)
        lines.append(f"  {'tensor':<{w}}  {'from':>5} -> {'to':<5} {'bytes before':>12} {'after':>12} {'SQNR dB':>8}")
        # layer order (blk.2 before blk.10), not the file's text order
        for t in sorted(conv, key=lambda t: [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", t.name)]):
            sq = "exact" if math.isinf(t.sqnr_db) else f"{t.sqnr_db:.2f}"
            lines.append(f"  {t.name:<{w}}  {t.from_type:>5} -> {t.to_type:<5} {t.bytes_before:>12} "
                         f"{t.bytes_after:>12} {sq:>8}" + (f"  ({t.note})" if t.note else ""))
        by_type: dict[str, list[float]] = {}
        for t in conv:
            if not math.isinf(t.sqnr_db):
                by_type.setdefault(t.to_type, []).append(t.sqnr_db)
        for typ, vals in sorted(by_type.items()):
            lines.append(f"  SQNR {typ}: {len(vals)} tensors, min {min(vals):.2f} dB, "
                         f"median {float(np.median(vals)):.2f} dB, max {max(vals):.2f} dB")
    else:
        lines.append("  no tensors converted (a verbatim copy)")
    for fmt, typ, why in report.mapped:
        lines.append(f"  note: {fmt} written as {typ} ({why})")
    lines.append(f"  tensor data: {report.bytes_before} -> {report.bytes_after} bytes; file: predicted "
                 f"{report.predicted_size}, written {report.actual_size} bytes"
                 + ("" if report.predicted_size == report.actual_size else "  (MISMATCH)"))
    return "\n".join(lines)
