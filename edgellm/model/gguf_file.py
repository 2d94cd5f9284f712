"""A validating walk over a GGUF v2/v3 header (little-endian), and zero-copy tensor views (or
checked copies, for a reader the file may shrink under: read_tensor).

Why our own parser: the `gguf` package's GGUFReader builds a numpy view per field and per array
element (seconds on a 49k-token vocabulary, which hurts cold start) and, in older versions,
trusts lengths read from the file. This walk checks every count, length, type, shape and offset
against caps and against the bytes actually left in the file *before* it allocates anything
proportional to them, and raises ModelFormatError(path, field, "expected ..., found ...").

File layout (all little-endian; v2 and v3 differ only in that v3 allows big-endian files, which
we reject as byte-swapped):

    magic "GGUF" | version u32 | tensor_count u64 | kv_count u64
    kv_count x  (key: string, value_type: u32, value)
    tensor_count x (name: string, n_dims: u32, ne[n_dims]: u64, ggml_type: u32, offset: u64)
    padding to `general.alignment` (default 32) | tensor data (offsets relative to its start)

    string = u64 length + UTF-8 bytes (no NUL); array value = elem_type u32 + count u64 + elems

Metadata values: scalars become Python int/float/bool/str; arrays of strings become GGUFStrings
(gguf_strings.py: a read-only sequence of str that keeps the array's bytes, not ~100k str
objects); arrays of numbers or bools become read-only 1-D numpy arrays whose dtype matches the
GGUF element type (uint8 ... float64, np.bool_); arrays of arrays (depth 2 at most) become lists
of those.
`string_arrays[key]` says where each top-level array of strings lies (with a crc32 of its bytes:
~0.3 ms per MB at parse), so that release_strings can drop one that is read once (open_model
drops the BPE merges) and have it re-read, checked, if it is read again.
`metadata_types[key]` keeps the GGUF type path, e.g. (STRING,), (ARRAY, INT32),
(ARRAY, ARRAY, UINT8), so that later code can reject a key stored with the wrong element type.
"""
from __future__ import annotations

import ctypes
import mmap
import os
import struct
import zlib
from array import array
from dataclasses import dataclass, field
from typing import Any, BinaryIO, Sequence

import numpy as np

from edgellm.errors import ModelFormatError, ModelNotFoundError, UnsupportedModelError
from edgellm.model.ggml_types import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from edgellm.model.gguf_strings import GGUFStrings, GGUFStringsOnDemand

__all__ = ["GGUFFile", "TensorInfo", "describe_value", "read_gguf", "read_tensor", "release_strings",
           "tensor_view"]

# Caps. Each is far above anything a real model needs and low enough that a hostile count
# cannot make the walk spend more than a moment or allocate more than about twice the file's
# own size (a string array: a copy of its bytes, then its starts; tests/test_gguf_fix_parse.py).
SUPPORTED_VERSIONS = (2, 3)
MAX_TENSORS = 1 << 16           # the largest MoE GGUFs have a few thousand tensors
MAX_KV = 1 << 16                # real files have tens of keys
MAX_KEY_LEN = 65535             # the GGUF spec caps keys at 2^16 - 1 bytes
MAX_STRING_LEN = 1 << 24        # 16 MiB: chat templates are tens of KiB
MAX_ARRAY_LEN = 1 << 22         # vocabularies and merge lists are well under a million entries;
                                # a cap, because a 9-byte string element becomes a ~60-byte str
MAX_NESTED_ARRAY_LEN = 1 << 12  # arrays of arrays: a 12-byte inner array becomes a ~100-byte object
MAX_ARRAY_DEPTH = 2             # an array of arrays of scalars/strings, no deeper
MAX_TENSOR_NAME_LEN = 63        # ggml's GGML_MAX_NAME is 64 bytes including the NUL
MAX_DIMS = 4                    # GGML_MAX_DIMS
MAX_ALIGNMENT = 1 << 20         # 1 MiB; llama.cpp writers use 32
DEFAULT_ALIGNMENT = 32
INT64_MAX = (1 << 63) - 1       # ggml holds counts and sizes in int64_t / size_t

_HEADER_BYTES = 24              # magic + version + tensor_count + kv_count
# Smallest possible encodings, used to bound counts by the bytes that remain.
_MIN_KV_BYTES = 8 + 1 + 4 + 1           # key length, 1-byte key, type, 1-byte value
_MIN_TENSOR_INFO_BYTES = 8 + 1 + 4 + 8 + 4 + 8  # name length, 1-byte name, n_dims, 1 dim, type, offset
_SMALL_FILE = 1 << 16           # below this, read() the file instead of mapping it

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")

_V = GGUFValueType
# scalar value type -> (struct, size, numpy dtype for arrays)
_SCALARS: dict[GGUFValueType, tuple[struct.Struct, int, np.dtype]] = {
    _V.UINT8: (struct.Struct("<B"), 1, np.dtype("<u1")),
    _V.INT8: (struct.Struct("<b"), 1, np.dtype("<i1")),
    _V.UINT16: (struct.Struct("<H"), 2, np.dtype("<u2")),
    _V.INT16: (struct.Struct("<h"), 2, np.dtype("<i2")),
    _V.UINT32: (struct.Struct("<I"), 4, np.dtype("<u4")),
    _V.INT32: (struct.Struct("<i"), 4, np.dtype("<i4")),
    _V.FLOAT32: (struct.Struct("<f"), 4, np.dtype("<f4")),
    _V.BOOL: (struct.Struct("<B"), 1, np.dtype("<u1")),  # checked to be 0/1, then viewed as bool
    _V.UINT64: (struct.Struct("<Q"), 8, np.dtype("<u8")),
    _V.INT64: (struct.Struct("<q"), 8, np.dtype("<i8")),
    _V.FLOAT64: (struct.Struct("<d"), 8, np.dtype("<f8")),
}
_VALUE_TYPES = {int(t): t for t in GGUFValueType}
# smallest encoding of one array element of each type: a string is at least its u64 length,
# an inner array at least its elem type + count
_MIN_ELEM_BYTES = {t: s[1] for t, s in _SCALARS.items()} | {_V.STRING: 8, _V.ARRAY: 12}

# tensor types that tensor_view returns as typed numpy arrays; all others come back as uint8 rows
_NUMPY_TENSOR_DTYPES = {
    GGMLQuantizationType.F32: np.dtype("<f4"),
    GGMLQuantizationType.F16: np.dtype("<f2"),
    GGMLQuantizationType.F64: np.dtype("<f8"),
    GGMLQuantizationType.I8: np.dtype("<i1"),
    GGMLQuantizationType.I16: np.dtype("<i2"),
    GGMLQuantizationType.I32: np.dtype("<i4"),
    GGMLQuantizationType.I64: np.dtype("<i8"),
}


@dataclass(frozen=True)
class TensorInfo:
    name: str                          # llama.cpp tensor name, e.g. "blk.0.attn_q.weight"
    ggml_type: GGMLQuantizationType    # storage type (F32, F16, Q8_0, Q4_1, ...)
    shape: tuple[int, ...]             # GGUF ne order: shape[0] is the row length (contiguous)
    offset: int                        # absolute byte offset of the data in the file
    nbytes: int                        # bytes of data (unpadded)
    n_elements: int                    # product of shape


@dataclass(frozen=True)
class StringArraySpan:
    field: str                         # the key as errors name it, e.g. "kv[17] 'tokenizer.ggml.merges'"
    start: int                         # absolute offset of the array's element type
    end: int                           # absolute offset just past its last string
    count: int                         # strings in the array
    crc32: int                         # zlib.crc32 of bytes [start, end) as parsed


@dataclass(frozen=True)
class GGUFFile:
    path: str                          # the file as given to read_gguf
    version: int                       # GGUF version (2 or 3)
    alignment: int                     # data alignment in bytes (general.alignment or 32)
    metadata: dict[str, Any]           # key -> value, in file order (see module doc for types)
    tensors: dict[str, TensorInfo]     # name -> info, in file order
    data_offset: int                   # absolute offset where the tensor data section starts
    file_size: int                     # bytes, at parse time
    metadata_types: dict[str, tuple[GGUFValueType, ...]] = field(default_factory=dict)
    # key -> where each top-level array of strings lies, so that release_strings can drop one
    string_arrays: dict[str, StringArraySpan] = field(default_factory=dict)
    # lazily opened np.memmap of the whole file, shared by every tensor_view call
    _cache: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)


def describe_value(value: Any) -> str:
    """A metadata value as an error names it: its GGUF-level kind (scalar, string, array of what)
    and a short excerpt, so that a key of the wrong type says what it holds."""
    if isinstance(value, (bool, np.bool_)):
        return f"a bool {bool(value)}"
    if isinstance(value, (int, np.integer)):
        return f"an integer {int(value)}"
    if isinstance(value, (float, np.floating)):
        return f"a float {float(value)!r}"
    if isinstance(value, str):
        return f"a string {value[:40]!r}"
    if isinstance(value, GGUFStrings):
        return f"an array of {len(value)} strings"
    if isinstance(value, np.ndarray):
        return f"an array of {len(value)} {value.dtype.name} values"
    if isinstance(value, (list, tuple)):
        if any(isinstance(v, (list, tuple, np.ndarray, GGUFStrings)) for v in value):
            return f"an array of {len(value)} arrays"
        kinds = sorted({type(v).__name__ for v in value})
        return f"an array of {len(value)} {'/'.join(kinds) or 'untyped'} values"
    return f"a {type(value).__name__}"


def _fmt_bytes(b: bytes) -> str:
    return repr(bytes(b))


def _q(key: str) -> str:
    """A key quoted for a field name; a hostile 64 KiB key is shortened to keep errors one line."""
    return repr(key) if len(key) <= 80 else f"{key[:60]!r}...({len(key)} chars)"


class _Walker:
    """Cursor over the file's bytes; every read checks that the bytes exist first."""

    def __init__(self, path: str, buf: Any, size: int):
        self.path = path
        self.buf = buf      # bytes or mmap: both support slicing and struct.unpack_from
        self.size = size
        self.pos = 0

    def fail(self, fld: str, msg: str) -> ModelFormatError:
        return ModelFormatError(self.path, fld, msg)

    def need(self, n: int, fld: str) -> None:
        if self.pos + n > self.size:
            raise self.fail(fld, f"truncated: expected {n} bytes at offset {self.pos}, "
                                 f"found {max(self.size - self.pos, 0)} before end of file "
                                 f"(file is {self.size} bytes)")

    def u32(self, fld: str) -> int:
        self.need(4, fld)
        v = _U32.unpack_from(self.buf, self.pos)[0]
        self.pos += 4
        return v

    def u64(self, fld: str) -> int:
        self.need(8, fld)
        v = _U64.unpack_from(self.buf, self.pos)[0]
        self.pos += 8
        return v

    def string(self, fld: str, cap: int) -> str:
        n = self.u64(f"{fld} length")
        if n > cap:
            raise self.fail(f"{fld} length", f"expected at most {cap} bytes, found {n}")
        self.need(n, f"{fld} length")
        raw = self.buf[self.pos:self.pos + n]
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise self.fail(fld, f"expected UTF-8, found invalid byte at {e.start}: "
                                 f"{_fmt_bytes(raw[:40])}") from None

    def remaining(self) -> int:
        return self.size - self.pos

    # ---- metadata values

    def value_type(self, fld: str) -> GGUFValueType:
        t = self.u32(fld)
        vt = _VALUE_TYPES.get(t)
        if vt is None:
            raise self.fail(fld, f"expected a GGUF value type 0..{max(_VALUE_TYPES)}, "
                                 f"found unknown type {t}")
        return vt

    def value(self, vt: GGUFValueType, fld: str) -> Any:
        if vt is _V.STRING:
            return self.string(fld, MAX_STRING_LEN)
        st, size, _ = _SCALARS[vt]
        self.need(size, fld)
        v = st.unpack_from(self.buf, self.pos)[0]
        self.pos += size
        if vt is _V.BOOL:
            if v > 1:
                raise self.fail(fld, f"expected a bool (0 or 1), found {v}")
            return bool(v)
        return v

    def array(self, fld: str, depth: int) -> tuple[Any, tuple[GGUFValueType, ...]]:
        """Reads elem type, count and elements of an array at nesting `depth` (outermost 1)."""
        et = self.value_type(f"{fld} array element type")
        if et is _V.ARRAY and depth + 1 > MAX_ARRAY_DEPTH:
            raise self.fail(f"{fld} array element type",
                            f"expected arrays nested at most {MAX_ARRAY_DEPTH} deep, found an array "
                            f"of arrays at depth {depth}")
        n = self.u64(f"{fld} array length")
        cap = MAX_NESTED_ARRAY_LEN if et is _V.ARRAY else MAX_ARRAY_LEN
        if n > cap:
            raise self.fail(f"{fld} array length", f"expected at most {cap} elements, found {n}")
        min_bytes = n * _MIN_ELEM_BYTES[et]
        if min_bytes > self.remaining():
            raise self.fail(f"{fld} array length",
                            f"{n} x {et.name} needs at least {min_bytes} bytes, found {self.remaining()} "
                            f"left in the file (file is {self.size} bytes)")
        if et is _V.STRING:
            return self._string_array(n, fld), (_V.ARRAY, _V.STRING)
        if et is _V.ARRAY:
            items = []
            inner_types: tuple[GGUFValueType, ...] | None = None
            for j in range(n):
                v, t = self.array(f"{fld}[{j}]", depth + 1)
                if inner_types is not None and t != inner_types:
                    raise self.fail(f"{fld}[{j}] array element type",
                                    f"expected {'/'.join(x.name for x in inner_types)} like element 0, "
                                    f"found {'/'.join(x.name for x in t)}")
                inner_types = t
                items.append(v)
            return items, (_V.ARRAY,) + (inner_types or (_V.ARRAY,))
        _, size, dt = _SCALARS[et]
        nbytes = n * size  # fits: checked against remaining() above
        arr = np.frombuffer(self.buf[self.pos:self.pos + nbytes], dtype=dt)  # read-only copy of the slice
        self.pos += nbytes
        if et is _V.BOOL:
            if n and int(arr.max()) > 1:
                j = int(np.argmax(arr > 1))
                raise self.fail(f"{fld}[{j}]", f"expected a bool (0 or 1), found {int(arr[j])}")
            arr = arr.view(np.bool_)
        return arr, (_V.ARRAY, et)

    def _string_array(self, n: int, fld: str) -> GGUFStrings:
        # The hot loop of the whole walk (49k tokens + 49k merges in a small model): in native
        # code where the library loads (_native_walk), else here with locals only, lengths only;
        # the UTF-8 of all the strings is checked in one decode afterwards.
        buf, size, pos = self.buf, self.size, self.pos
        base = pos
        walked = _native_walk(buf, size, pos, n) if n >= _NATIVE_WALK_MIN else None
        if walked is not None:
            starts_arr, end = walked
            strings = GGUFStrings.from_array_bytes(bytes(buf[base:end]), starts_arr)
            if strings is None:
                self._utf8_error(bytes(buf[base:end]), starts_arr.tolist(), fld)
            self.pos = end
            return strings
        unpack = _U64.unpack_from
        cap = MAX_STRING_LEN
        # 4 bytes per start (8 past 2 GiB), not a list of int objects (~36 bytes each: 4.5x the
        # 8-byte prefix of an empty string); n * 8 is within the file, checked by the caller
        starts = array("i" if size - base < 2**31 else "q", [0]) * n
        j = 0
        try:
            for j in range(n):
                ln = unpack(buf, pos)[0]
                end = pos + 8 + ln
                if end > size or ln > cap:
                    self.pos = pos + 8
                    if ln > cap:
                        raise self.fail(f"{fld}[{j}] string length", f"expected at most {cap} bytes, found {ln}")
                    self.need(ln, f"{fld}[{j}] string length")
                starts[j] = pos + 8 - base
                pos = end
        except struct.error:
            self.pos = pos
            self.need(8, f"{fld}[{j}] string length")
            raise  # unreachable: need() raised
        # the copy of the array's bytes is handed over, not kept: from_array_bytes frees it once
        # the prefixes are stripped (the error path copies them again)
        strings = GGUFStrings.from_array_bytes(bytes(buf[base:pos]), starts)
        if strings is None:
            self._utf8_error(bytes(buf[base:pos]), starts, fld)
        self.pos = pos
        return strings

    def _utf8_error(self, raw: bytes, starts: Sequence[int], fld: str) -> None:
        """Raises the error naming the first string of the array that is not UTF-8."""
        ends = [s - 8 for s in starts[1:]] + [len(raw)]
        for j, (s, e) in enumerate(zip(starts, ends)):
            try:
                raw[s:e].decode("utf-8")
            except UnicodeDecodeError as err:
                raise self.fail(f"{fld}[{j}]", f"expected UTF-8, found invalid byte at {err.start}: "
                                               f"{_fmt_bytes(err.object[:40])}") from None
        raise self.fail(fld, "expected UTF-8 strings")  # unreachable: some string failed to decode


# string arrays shorter than this are walked in Python: a native call is not worth it
_NATIVE_WALK_MIN = 1024
_native_lib: list = []       # [library or None], loaded on first use


def _native_walk(buf, size: int, pos: int, n: int) -> tuple[np.ndarray, int] | None:
    """(starts relative to pos, end) of a string array from neon/gguf_walk.c; None when the
    library is unavailable or the array is malformed (the Python walk then names the fault)."""
    if not _native_lib:
        try:
            from edgellm.backends import neon_lib
            _native_lib.append(neon_lib.load())
        except Exception:       # no native library (or an unloadable one): the Python walk
            _native_lib.append(None)
    lib = _native_lib[0]
    if lib is None:
        return None
    view = np.frombuffer(buf, dtype=np.uint8)
    starts = np.empty(n, dtype=np.int64)
    end = ctypes.c_uint64(0)
    rc = lib.el_gguf_string_walk(view.ctypes.data, size, pos, n, MAX_STRING_LEN, starts.ctypes.data,
                                 ctypes.byref(end))
    del view                    # an mmap with exported buffers cannot be closed
    return (starts, end.value) if rc == 0 else None


def read_gguf(path: str | os.PathLike[str]) -> GGUFFile:
    """Parses and validates a GGUF file's header. Raises ModelFormatError (UnsupportedModelError
    for a well-formed file edgellm cannot read: v1, newer versions, big-endian, unknown tensor
    types) naming the file and the field; ModelNotFoundError when the path does not exist."""
    spath = os.fspath(path)
    try:
        f = open(spath, "rb")
    except FileNotFoundError:
        raise ModelNotFoundError(f"{spath}: no such file") from None
    except IsADirectoryError:
        raise ModelFormatError(spath, "file", "expected a GGUF file, found a directory") from None
    with f:
        size = os.fstat(f.fileno()).st_size
        if size < _SMALL_FILE:
            try:
                data = f.read()
            except OSError as e:   # (/proc/self/mem: "[Errno 5] Input/output error", no file named)
                raise ModelFormatError(spath, "file", f"cannot be read: {e.strerror or e}") from None
            return _parse(spath, data, size)
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            return _parse(spath, mm, size)
        finally:
            mm.close()


def _parse(path: str, buf: Any, size: int) -> GGUFFile:
    w = _Walker(path, buf, size)
    if size == 0:
        raise w.fail("magic", "expected b'GGUF', found an empty file")

    # ---- fixed header
    w.need(4, "magic")
    magic = bytes(buf[0:4])
    if magic != b"GGUF":
        if magic == b"FUGG":
            raise UnsupportedModelError(path, "magic", "byte-swapped magic b'FUGG': a big-endian "
                                        "GGUF; edgellm reads little-endian files only")
        raise w.fail("magic", f"expected b'GGUF', found {_fmt_bytes(magic)}")
    w.pos = 4
    version = w.u32("version")
    if version not in SUPPORTED_VERSIONS:
        swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
        if version == 0:
            raise w.fail("version", "expected 2 or 3, found 0")
        if version == 1:
            raise UnsupportedModelError(path, "version", "expected 2 or 3, found 1 (GGUF v1, "
                                        "32-bit lengths; re-convert the model with current llama.cpp)")
        if version & 0xFFFF == 0 and 0 < swapped <= 0xFFFF:
            raise UnsupportedModelError(path, "version", f"found {version:#010x}, which is version "
                                        f"{swapped} byte-swapped: a big-endian GGUF; edgellm reads "
                                        "little-endian files only")
        if version <= 0xFFFF:
            raise UnsupportedModelError(path, "version", f"expected 2 or 3, found {version} "
                                        "(newer than this edgellm knows)")
        raise w.fail("version", f"expected 2 or 3, found {version:#010x}")
    tensor_count = w.u64("tensor_count")
    kv_count = w.u64("kv_count")
    rem = w.remaining()
    for name, count, cap, min_each, before in (
        ("tensor_count", tensor_count, MAX_TENSORS, _MIN_TENSOR_INFO_BYTES, 0),
        ("kv_count", kv_count, MAX_KV, _MIN_KV_BYTES, tensor_count * _MIN_TENSOR_INFO_BYTES),
    ):
        if count > INT64_MAX:
            raise w.fail(name, f"expected a non-negative count, found {count - (1 << 64)} (as int64)")
        if count > cap:
            raise w.fail(name, f"expected at most {cap}, found {count}")
        if before + count * min_each > rem:
            raise w.fail(name, f"{count} entries need at least {count * min_each} bytes, found "
                               f"{rem - before} left in the file (file is {size} bytes)")

    # ---- key/value metadata
    metadata: dict[str, Any] = {}
    metadata_types: dict[str, tuple[GGUFValueType, ...]] = {}
    string_arrays: dict[str, StringArraySpan] = {}
    key_index: dict[str, int] = {}
    for i in range(kv_count):
        key = w.string(f"kv[{i}] key", MAX_KEY_LEN)
        if not key:
            raise w.fail(f"kv[{i}] key", "expected a non-empty key, found an empty one")
        fld = f"kv[{i}] {_q(key)}"
        if key in key_index:
            raise w.fail(fld, f"expected unique keys, found a duplicate of kv[{key_index[key]}]")
        vt = w.value_type(f"{fld} type")
        if vt is _V.ARRAY:
            start = w.pos
            value, types = w.array(fld, 1)
            if types == (_V.ARRAY, _V.STRING):
                with memoryview(buf) as mv:     # (released before read_gguf closes the mmap)
                    crc = zlib.crc32(mv[start:w.pos])
                string_arrays[key] = StringArraySpan(fld, start, w.pos, len(value), crc)
        else:
            value, types = w.value(vt, fld), (vt,)
        key_index[key] = i
        metadata[key] = value
        metadata_types[key] = types

    alignment = DEFAULT_ALIGNMENT
    if "general.alignment" in metadata:
        fld = f"kv[{key_index['general.alignment']}] 'general.alignment'"
        types = metadata_types["general.alignment"]
        if types != (_V.UINT32,):
            raise w.fail(fld, f"expected type UINT32, found {'/'.join(t.name for t in types)}")
        alignment = metadata["general.alignment"]
        if alignment == 0 or alignment & (alignment - 1) or alignment > MAX_ALIGNMENT:
            raise w.fail(fld, f"expected a power of two in 1..{MAX_ALIGNMENT}, found {alignment}")

    # ---- tensor infos
    infos: list[tuple[str, GGMLQuantizationType, tuple[int, ...], int, int, int]] = []
    seen: dict[str, int] = {}
    for i in range(tensor_count):
        name = w.string(f"tensor[{i}] name", MAX_TENSOR_NAME_LEN)
        if not name:
            raise w.fail(f"tensor[{i}] name", "expected a non-empty name, found an empty one")
        if name in seen:
            raise w.fail(f"tensor[{i}] name", f"expected unique tensor names, found {name!r} again "
                                              f"(first at tensor[{seen[name]}])")
        seen[name] = i
        tf = f"tensor {_q(name)}"
        n_dims = w.u32(f"{tf} n_dims")
        if not 1 <= n_dims <= MAX_DIMS:
            raise w.fail(f"{tf} n_dims", f"expected 1..{MAX_DIMS} dimensions, found {n_dims}")
        shape = []
        for d in range(n_dims):
            ne = w.u64(f"{tf} shape")
            if ne > INT64_MAX:
                raise w.fail(f"{tf} shape", f"expected positive dimensions, found ne[{d}] = "
                                            f"{ne - (1 << 64)} (as int64)")
            if ne == 0:
                raise w.fail(f"{tf} shape", f"expected positive dimensions, found ne[{d}] = 0")
            shape.append(ne)
        raw_type = w.u32(f"{tf} type")
        try:
            gtype = GGMLQuantizationType(raw_type)
        except ValueError:
            raise UnsupportedModelError(path, f"{tf} type", f"unknown ggml tensor type {raw_type}") from None
        sizes = GGML_QUANT_SIZES.get(gtype)
        if sizes is None:
            raise UnsupportedModelError(path, f"{tf} type", f"ggml tensor type {gtype.name} has no known "
                                        "block size")
        block, type_size = sizes
        n_el = 1
        for ne in shape:
            n_el *= ne
            if n_el > INT64_MAX:
                raise w.fail(f"{tf} shape", f"element count of {shape} overflows int64")
        if shape[0] % block:
            raise w.fail(f"{tf} shape", f"expected row length ne[0] to be a multiple of {gtype.name}'s "
                                        f"block size {block}, found {shape[0]}")
        nbytes = n_el // block * type_size
        if nbytes > INT64_MAX:
            raise w.fail(f"{tf} shape", f"byte size of {shape} x {gtype.name} ({nbytes}) overflows int64")
        rel = w.u64(f"{tf} offset")
        if rel > INT64_MAX:
            raise w.fail(f"{tf} offset", f"expected a non-negative offset, found {rel - (1 << 64)} (as int64)")
        if rel % alignment:
            raise w.fail(f"{tf} offset", f"expected a multiple of the alignment {alignment}, found {rel}")
        infos.append((name, gtype, tuple(shape), rel, nbytes, n_el))

    # ---- tensor data placement
    data_offset = -(-w.pos // alignment) * alignment
    if not infos:
        # no tensors, no data section: the padding before it may be absent (llama.cpp reads such
        # a file); rounding up would put the section past the end of file, -N bytes long
        data_offset = min(data_offset, size)
    total = 0
    for name, gtype, shape, rel, nbytes, n_el in infos:
        end = data_offset + rel + nbytes
        if end > size:
            raise w.fail(f"tensor {name!r} offset",
                         f"data [{data_offset + rel}, {end}) runs past the end of file (file is {size} bytes)")
        total += nbytes
    if total > size - data_offset:
        raise w.fail("tensor data size", f"tensors need {total} bytes in all, found {size - data_offset} "
                                         f"bytes of data section")
    prev_name, prev_end = None, 0
    for name, gtype, shape, rel, nbytes, n_el in sorted(infos, key=lambda t: (t[3], t[4])):
        if rel < prev_end:
            raise w.fail(f"tensor {name!r} offset",
                         f"expected data at or after {data_offset + prev_end} (end of {prev_name!r}), "
                         f"found {data_offset + rel}: the tensors overlap")
        prev_name, prev_end = name, rel + nbytes

    tensors = {name: TensorInfo(name, gtype, shape, data_offset + rel, nbytes, n_el)
               for name, gtype, shape, rel, nbytes, n_el in infos}
    return GGUFFile(path=path, version=version, alignment=alignment, metadata=metadata,
                    tensors=tensors, data_offset=data_offset, file_size=size,
                    metadata_types=metadata_types, string_arrays=string_arrays)


def release_strings(gguf_file: GGUFFile, key: str) -> None:
    """Drops the decoded strings of the array `key` from the metadata; they are re-read from the
    file, and checked to be the bytes parsed, when next read (GGUFStringsOnDemand). For arrays
    that are read once at load (the BPE merges) and rarely after."""
    span = gguf_file.string_arrays.get(key)
    if span is None or not isinstance(gguf_file.metadata.get(key), GGUFStrings):
        return
    # (not gguf_file: no reference cycle; absolute: a later chdir must not lose the file)
    path, size = os.path.abspath(gguf_file.path), gguf_file.file_size
    gguf_file.metadata[key] = GGUFStringsOnDemand(span.count, lambda: _reread_strings(path, size, span))


def _reread_strings(path: str, file_size: int, span: StringArraySpan) -> GGUFStrings:
    """The array at `span` read again; ModelFormatError if the file is not as parsed."""
    changed = "the file changed after it was read"
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size != file_size:
                raise ModelFormatError(path, span.field, f"expected {file_size} bytes as parsed, "
                                                         f"found {size}: {changed}")
            f.seek(span.start)
            raw = f.read(span.end - span.start)
    except FileNotFoundError:
        raise ModelFormatError(path, span.field, "the file was removed after it was read") from None
    except OSError as e:     # (permissions changed, a folder in its place, an I/O error)
        raise ModelFormatError(path, span.field, f"cannot read it again: {e.strerror or e}") from None
    crc = zlib.crc32(raw)
    if crc != span.crc32:
        raise ModelFormatError(path, span.field, f"expected the bytes parsed (crc32 {span.crc32:08x}), "
                                                 f"found crc32 {crc:08x}: {changed}")
    value, _ = _Walker(path, raw, len(raw)).array(span.field, 1)   # the parse's own decoding
    return value


def file_memmap(gguf_file: GGUFFile) -> np.memmap:
    """The read-only memmap of the whole file that every tensor view shares (opened once)."""
    mm = gguf_file._cache.get("memmap")
    if mm is None:
        mm = np.memmap(gguf_file.path, dtype=np.uint8, mode="r")
        if mm.shape[0] != gguf_file.file_size:
            raise ModelFormatError(gguf_file.path, "file", f"expected {gguf_file.file_size} bytes as "
                                   f"parsed, found {mm.shape[0]}: the file changed after it was read")
        gguf_file._cache["memmap"] = mm
    return mm


def tensor_view(gguf_file: GGUFFile, info: TensorInfo) -> np.ndarray:
    """A read-only, zero-copy view of one tensor's data, backed by a memmap of the file that is
    opened once per GGUFFile.

    F32/F16/F64/I8/I16/I32/I64 come back typed, in numpy order (reversed ne: shape[-1] == ne[0]).
    Quantized and BF16 tensors come back as uint8 of shape (ne[3], ne[2], ne[1], row_bytes) (as
    many leading axes as the tensor has), row_bytes = ne[0] / block_size * type_size."""
    if gguf_file.tensors.get(info.name) != info:
        raise ValueError(f"tensor {info.name!r} is not a tensor of {gguf_file.path}")
    return _shaped(file_memmap(gguf_file)[info.offset:info.offset + info.nbytes], info)


def read_tensor(f: BinaryIO, gguf_file: GGUFFile, info: TensorInfo) -> np.ndarray:
    """A copy of one tensor's data, read from `f` (the file, opened unbuffered: open(path, "rb",
    buffering=0)) with plain reads, shaped as tensor_view shapes it.

    For a reader that must survive the file shrinking under it (requant): a mapped page past the
    file's new end is SIGBUS, the process killed without a word, and no check of the size before
    touching the mapping closes the race; a read past the end is a short count, which is a
    ModelFormatError naming the file and the tensor. The engine keeps tensor_view: zero copies."""
    if gguf_file.tensors.get(info.name) != info:
        raise ValueError(f"tensor {info.name!r} is not a tensor of {gguf_file.path}")
    buf = np.empty(info.nbytes, dtype=np.uint8)
    view, got = memoryview(buf), 0
    f.seek(info.offset)
    while got < info.nbytes:        # (one read returns at most ~2 GiB on Linux)
        n = f.readinto(view[got:])
        if not n:
            size = os.fstat(f.fileno()).st_size
            raise ModelFormatError(gguf_file.path, f"tensor {info.name!r}",
                                   f"expected {info.nbytes} bytes at offset {info.offset}, found {got}: the "
                                   f"file is now {size} bytes, not the {gguf_file.file_size} parsed; it "
                                   "changed after it was read")
        got += n
    buf.flags.writeable = False     # (as a view of the read-only mapping is)
    return _shaped(buf, info)


def _shaped(raw: np.ndarray, info: TensorInfo) -> np.ndarray:
    """A tensor's bytes (uint8, 1-D) as tensor_view returns them."""
    np_shape = tuple(reversed(info.shape))
    dt = _NUMPY_TENSOR_DTYPES.get(info.ggml_type)
    if dt is not None:
        return raw.view(dt).reshape(np_shape)
    block, type_size = GGML_QUANT_SIZES[info.ggml_type]
    return raw.reshape(np_shape[:-1] + (info.shape[0] // block * type_size,))
