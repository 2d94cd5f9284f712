"""Session / prefix-cache files: the KV state of a token prefix, saved so a later process can skip
its prefill.

Layout (all integers little-endian; offsets in bytes):

    0        magic            8 bytes, b"EDGESESS"
    8        version          u32, VERSION
    12       header_len       u32, 1..MAX_HEADER_BYTES
    16       header           header_len bytes of UTF-8 JSON (one object, keys below)
    ...      zero padding to data_start = align64(16 + header_len)
    data_start
             token ids        n_tokens x int32 (<i4), at data offset 0
             arrays           each at a 64-aligned data offset, C order, little-endian
    data_start + data_nbytes
             sha256           32 bytes: digest of every byte before it

    header = {"model_sha256": str, "config_hash": str, "kv_layout": str, "n_tokens": int,
              "data_nbytes": int,
              "arrays": [{"name": str, "dtype": one of DTYPES, "shape": [int, ...],
                          "offset": int (from data_start), "nbytes": int}, ...],
              "meta": {...}}

A reader never trusts the file: the fixed fields, the header and the array table are checked
against caps and against the file's actual size before anything proportional to a declared size
is allocated; the checksum is verified (one streaming read) before any array is handed out. Any
mismatch or corruption is a cache miss: read_session returns None and logs one warning line.
"""
from __future__ import annotations

import json
import logging
import os
import stat
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ..errors import EdgeLLMError
from ..fileio import fsync_dir, temp_beside
from ..hashing import bulk_sha256

__all__ = [
    "MAGIC", "VERSION", "ALIGN", "DTYPES", "MAX_HEADER_BYTES", "MAX_ARRAYS", "MAX_NDIM",
    "SessionData", "SessionHeader", "SessionFileError", "write_session", "read_session",
    "read_header",
]

log = logging.getLogger(__name__)  # a child of "edgellm"

MAGIC = b"EDGESESS"
VERSION = 1
ALIGN = 64  # data alignment: a cache line, and enough for any SIMD load of the arrays
DTYPES = ("float32", "float16", "int8", "int32", "uint8")
MAX_HEADER_BYTES = 1 << 20  # the JSON header; a real one is a few KiB
MAX_ARRAYS = 4096  # entries in the array table
MAX_NDIM = 8
MAX_NAME_CHARS = 256  # array names
_HEAD = struct.Struct("<8sII")  # magic, version, header_len
_SUM = 32  # sha256 digest size
_MIN_SIZE = _HEAD.size + _SUM  # an empty header still cannot be smaller than this
_CHUNK = 1 << 20  # bytes per write when streaming arrays out
_TOKEN_MAX = 2**31 - 1
_HEADER_KEYS = frozenset(
    ("model_sha256", "config_hash", "kv_layout", "n_tokens", "data_nbytes", "arrays", "meta"))
_ARRAY_KEYS = frozenset(("name", "dtype", "shape", "offset", "nbytes"))


class SessionFileError(EdgeLLMError):
    """A session file that cannot be used: names the file and says why. read_session turns it
    into a cache miss; read_header (used for listing) raises it."""

    def __init__(self, path: str | os.PathLike, reason: str):
        self.path = str(path)
        self.reason = reason
        super().__init__(f"{self.path}: {reason}")


@dataclass(frozen=True)
class ArrayEntry:
    name: str  # key in SessionData.arrays
    dtype: str  # one of DTYPES; stored little-endian
    shape: tuple[int, ...]  # element counts per dimension, C order
    offset: int  # bytes from data_start; a multiple of ALIGN
    nbytes: int  # prod(shape) * itemsize


@dataclass(frozen=True)
class SessionHeader:
    """The validated header of a session file (no data read yet)."""
    model_sha256: str  # hex digest of the model file the KV was computed with
    config_hash: str  # hash of the engine configuration that shapes the KV
    kv_layout: str  # KV layout and precision, e.g. "contiguous/fp32"
    n_tokens: int  # token ids stored
    arrays: tuple[ArrayEntry, ...]
    meta: dict  # free-form JSON object from the writer
    data_start: int  # file offset of the data section
    data_nbytes: int  # bytes of the data section (tokens + arrays + padding)
    file_size: int  # bytes, checksum included


@dataclass(frozen=True)
class SessionData:
    token_ids: np.ndarray  # (n_tokens,) int32
    arrays: dict[str, np.ndarray] = field(default_factory=dict)  # views into one read buffer
    meta: dict = field(default_factory=dict)


# -- writing -----------------------------------------------------------------------------------


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _check_args(model_sha256, config_hash, kv_layout, token_ids, arrays, meta):
    for name, v in (("model_sha256", model_sha256), ("config_hash", config_hash),
                    ("kv_layout", kv_layout)):
        if not isinstance(v, str) or not v:
            raise TypeError(f"write_session: {name} must be a non-empty str, got {v!r}")
    tok = np.asarray(token_ids)
    if tok.ndim != 1:
        raise ValueError(f"write_session: token_ids must be 1-D, got shape {tok.shape}")
    if tok.size and tok.dtype.kind not in "iu":
        raise TypeError(f"write_session: token_ids must be integers, got {tok.dtype}")
    if tok.size and (int(tok.min()) < 0 or int(tok.max()) > _TOKEN_MAX):
        raise ValueError(f"write_session: token ids must lie in [0, {_TOKEN_MAX}], "
                         f"got [{int(tok.min())}, {int(tok.max())}]")
    if not isinstance(arrays, dict):
        raise TypeError(f"write_session: arrays must be a dict, got {type(arrays).__name__}")
    if len(arrays) > MAX_ARRAYS:
        raise ValueError(f"write_session: {len(arrays)} arrays, at most {MAX_ARRAYS}")
    out = {}
    for name, a in arrays.items():
        if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME_CHARS:
            raise ValueError(f"write_session: array name {name!r} must be a str of "
                             f"1..{MAX_NAME_CHARS} characters")
        if not isinstance(a, np.ndarray):
            raise TypeError(f"write_session: arrays[{name!r}] must be a numpy array, "
                            f"got {type(a).__name__}")
        if a.dtype.name not in DTYPES:
            raise TypeError(f"write_session: arrays[{name!r}] has dtype {a.dtype}, "
                            f"expected one of {', '.join(DTYPES)}")
        if a.ndim > MAX_NDIM:
            raise ValueError(f"write_session: arrays[{name!r}] has {a.ndim} dimensions, "
                             f"at most {MAX_NDIM}")
        # asarray, not ascontiguousarray: the latter turns a 0-d array into shape (1,)
        out[name] = np.asarray(a, dtype=a.dtype.newbyteorder("<"), order="C")
    if meta is None:
        meta = {}
    if not isinstance(meta, dict):
        raise TypeError(f"write_session: meta must be a dict, got {type(meta).__name__}")
    return tok.astype("<i4"), out, meta


FOREIGN = "exists and is not an edgellm session file"   # foreign_file's word for another format


def foreign_file(path: str | os.PathLike) -> str | None:
    """Why `path` must not be overwritten by a session: it exists and is not a session file (a
    user's document given as --session by mistake), or it is not a regular file. None when it is
    absent or a session file (a stale or corrupt one may be replaced)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    except OSError as e:
        return f"cannot be checked ({e.strerror})"
    if stat.S_ISDIR(st.st_mode):
        return "is a directory"
    if not stat.S_ISREG(st.st_mode):
        return "is not a regular file"
    if st.st_size == 0:
        return None
    try:
        with open(path, "rb") as f:
            head = f.read(len(MAGIC))
    except OSError as e:
        return f"cannot be read ({e.strerror})"
    return None if head == MAGIC else FOREIGN


def write_session(path: str | os.PathLike, *, model_sha256: str, config_hash: str,
                  kv_layout: str, token_ids: Sequence[int], arrays: dict[str, np.ndarray],
                  meta: dict | None = None) -> None:
    """Write a session file atomically: a temp file beside `path`, fsync, rename, fsync of the
    directory. On any error the temp file is removed and an existing `path` is left as it was.
    Bad arguments raise TypeError/ValueError; I/O failures raise OSError. The parent directory
    must exist. The file is created with mode 0600 (it holds the user's conversation)."""
    path = Path(path)
    tok, arrays, meta = _check_args(model_sha256, config_hash, kv_layout, token_ids, arrays, meta)
    table, off = [], tok.nbytes
    for name, a in arrays.items():
        off = _align(off)
        table.append({"name": name, "dtype": a.dtype.name, "shape": list(a.shape),
                      "offset": off, "nbytes": a.nbytes})
        off += a.nbytes
    header = {"model_sha256": model_sha256, "config_hash": config_hash, "kv_layout": kv_layout,
              "n_tokens": int(tok.size), "data_nbytes": off, "arrays": table, "meta": meta}
    try:
        hbytes = json.dumps(header, allow_nan=False, ensure_ascii=False,
                            separators=(",", ":")).encode("utf-8")
    except (TypeError, ValueError) as e:
        raise TypeError(f"write_session: meta is not JSON-serializable: {e}") from None
    if len(hbytes) > MAX_HEADER_BYTES:
        raise ValueError(f"write_session: header is {len(hbytes)} bytes, at most "
                         f"{MAX_HEADER_BYTES} (meta too large?)")
    head = _HEAD.pack(MAGIC, VERSION, len(hbytes)) + hbytes
    head += b"\0" * (_align(len(head)) - len(head))

    # (locked by this writer: one a killed save left is removed by the next save here; its
    # lock, which tells other processes' cleaners the save is alive, lasts until f is closed)
    fd, tmp = temp_beside(path)
    try:
        with os.fdopen(fd, "wb") as f:
            h = bulk_sha256()

            def put(b) -> None:
                h.update(b)
                f.write(b)

            put(head)
            put(tok.tobytes())
            pos = tok.nbytes
            for entry, a in zip(table, arrays.values()):
                put(b"\0" * (entry["offset"] - pos))
                flat = a.reshape(-1).view(np.uint8)
                for i in range(0, flat.size, _CHUNK):  # no full copy of a large KV slab
                    put(memoryview(flat[i:i + _CHUNK]))
                pos = entry["offset"] + entry["nbytes"]
            f.write(h.digest())
            f.flush()
            os.fsync(f.fileno())
            os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    fsync_dir(path.parent)



# -- reading -----------------------------------------------------------------------------------


def _short(v: Any, n: int = 40) -> str:
    """A value from the file, quoted for a one-line message (repr escapes newlines)."""
    r = repr(v)
    return r if len(r) <= n else r[:n] + "..."


def _is_int(v) -> bool:
    return type(v) is int  # bool is an int subclass and JSON true must not pass as 1


def _no_dup_keys(pairs):
    d = {}
    for k, v in pairs:
        if k in d:
            raise ValueError(f"duplicate key {_short(k)}")
        d[k] = v
    return d


def _open(path: Path):
    """Open for reading without blocking (a FIFO planted at the path must not hang us) and
    insist on a regular file. Returns (file object, size); None when the file is absent."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
    except FileNotFoundError:
        return None
    except OSError as e:
        raise SessionFileError(path, f"cannot open: {e.strerror or e}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise SessionFileError(path, "not a regular file")
        return os.fdopen(fd, "rb"), st.st_size
    except BaseException:
        os.close(fd)
        raise


def _read_exact(f, n: int, path, what: str) -> bytes:
    b = f.read(n)
    if b is None or len(b) != n:
        raise SessionFileError(path, f"short read of the {what}: expected {n} bytes, "
                                     f"got {0 if b is None else len(b)}")
    return b


def _read_into(f, buf: bytearray) -> int:
    """Fill buf from f; returns the bytes read (less than len(buf) only at end of file). One
    read(2) returns at most ~2 GiB on Linux, so a large KV section takes several."""
    view, done = memoryview(buf), 0
    while done < len(buf):
        n = f.readinto(view[done:])
        if not n:
            break
        done += n
    return done


def _parse_header(path, raw: bytes, header_len: int, file_size: int, whole: bool = True) -> SessionHeader:
    """Validate the JSON header against the caps and the real file size (whole=False: the data
    section it declares may be cut short or followed by more)."""
    def bad(msg: str):
        return SessionFileError(path, f"header: {msg}")

    try:
        h = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_dup_keys)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        # ValueError covers JSONDecodeError, duplicate keys and over-long integer literals
        raise bad(f"invalid JSON ({_short(str(e), 80)})") from None
    if not isinstance(h, dict):
        raise bad(f"expected a JSON object, found {type(h).__name__}")
    if set(h) != _HEADER_KEYS:
        missing, extra = sorted(_HEADER_KEYS - set(h)), sorted(set(h) - _HEADER_KEYS)
        raise bad(f"keys differ from the format (missing {missing}, unexpected "
                  f"{_short(extra, 80)})")
    for k in ("model_sha256", "config_hash", "kv_layout"):
        if not isinstance(h[k], str):
            raise bad(f"{k} must be a string, found {_short(h[k])}")
    for k in ("n_tokens", "data_nbytes"):
        if not _is_int(h[k]) or h[k] < 0:
            raise bad(f"{k} must be a non-negative integer, found {_short(h[k])}")
    if not isinstance(h["meta"], dict):
        raise bad(f"meta must be an object, found {_short(h['meta'])}")
    if not isinstance(h["arrays"], list):
        raise bad(f"arrays must be a list, found {_short(h['arrays'])}")
    if len(h["arrays"]) > MAX_ARRAYS:
        raise bad(f"{len(h['arrays'])} arrays, at most {MAX_ARRAYS}")

    data_start = _align(_HEAD.size + header_len)
    data_nbytes = h["data_nbytes"]
    if whole and data_start + data_nbytes + _SUM != file_size:
        raise SessionFileError(
            path, f"size mismatch (truncated?): the header declares {data_nbytes} data bytes, "
                  f"so {data_start + data_nbytes + _SUM} bytes in all, but the file has "
                  f"{file_size}")
    n_tokens = h["n_tokens"]
    regions = [(0, 4 * n_tokens, "token ids")]
    if regions[0][1] > data_nbytes:
        raise bad(f"n_tokens {n_tokens} needs {4 * n_tokens} bytes, the data section has "
                  f"{data_nbytes}")

    arrays, names = [], set()
    for i, a in enumerate(h["arrays"]):
        where = f"arrays[{i}]"
        if not isinstance(a, dict) or set(a) != _ARRAY_KEYS:
            raise bad(f"{where} must be an object with keys {sorted(_ARRAY_KEYS)}, "
                      f"found {_short(a)}")
        name, dtype, shape, off, nb = a["name"], a["dtype"], a["shape"], a["offset"], a["nbytes"]
        if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME_CHARS:
            raise bad(f"{where}.name must be a string of 1..{MAX_NAME_CHARS} characters, "
                      f"found {_short(name)}")
        if name in names:
            raise bad(f"{where}.name {_short(name)} is a duplicate")
        names.add(name)
        if dtype not in DTYPES:  # a non-string never equals an allowed name
            raise bad(f"{where} ({_short(name)}) has unknown dtype {_short(dtype)}, "
                      f"expected one of {', '.join(DTYPES)}")
        if (not isinstance(shape, list) or len(shape) > MAX_NDIM
                or not all(_is_int(d) and d >= 0 for d in shape)):
            raise bad(f"{where} ({_short(name)}) shape must be a list of at most {MAX_NDIM} "
                      f"non-negative integers, found {_short(shape)}")
        if not _is_int(off) or off < 0 or off % ALIGN:
            raise bad(f"{where} ({_short(name)}) offset must be a non-negative multiple of "
                      f"{ALIGN}, found {_short(off)}")
        count = 0 if 0 in shape else 1   # (a 0 after the early stop: (2, 0, ...) was "more")
        for d in shape:  # Python ints: no overflow; stop early once past any real size
            count *= d
            if count > data_nbytes:
                break
        need = count * np.dtype(dtype).itemsize
        if not _is_int(nb) or nb != need:
            raise bad(f"{where} ({_short(name)}) nbytes {_short(nb)} does not match shape "
                      f"{_short(shape)} x {dtype} ({need if count <= data_nbytes else 'more'})")
        if off + nb > data_nbytes:
            raise bad(f"{where} ({_short(name)}) bytes {off}..{off + nb} run past the data "
                      f"section ({data_nbytes} bytes)")
        regions.append((off, off + nb, repr(name)))
        arrays.append(ArrayEntry(name, dtype, tuple(shape), off, nb))
    regions.sort()
    for (_, end0, n0), (start1, _, n1) in zip(regions, regions[1:]):
        if start1 < end0:
            raise bad(f"{n1} (from byte {start1}) overlaps {n0} (up to byte {end0})")
    return SessionHeader(h["model_sha256"], h["config_hash"], h["kv_layout"], n_tokens,
                         tuple(arrays), h["meta"], data_start, data_nbytes, file_size)


def _read_head(f, path, size: int, hasher=None, whole: bool = True) -> SessionHeader:
    if size < _MIN_SIZE:
        if size >= len(MAGIC) and _read_exact(f, len(MAGIC), path, "magic") != MAGIC:
            raise SessionFileError(path, "wrong magic: not an edgellm session file")
        raise SessionFileError(path, f"truncated: {size} bytes, the smallest session file "
                                     f"has {_MIN_SIZE}")
    fixed = _read_exact(f, _HEAD.size, path, "fixed header")
    magic, version, header_len = _HEAD.unpack(fixed)
    if magic != MAGIC:
        raise SessionFileError(path, f"wrong magic {_short(magic)}: not an edgellm session file")
    if version != VERSION:
        raise SessionFileError(path, f"unsupported format version {version} "
                                     f"(this build reads {VERSION})")
    if not 0 < header_len <= MAX_HEADER_BYTES:
        raise SessionFileError(path, f"header length {header_len} outside 1..{MAX_HEADER_BYTES}")
    if _HEAD.size + header_len + (_SUM if whole else 0) > size:
        raise SessionFileError(path, f"truncated: header length {header_len} runs past the "
                                     f"end of the {size}-byte file")
    raw = _read_exact(f, header_len, path, "header")
    if hasher is not None:
        hasher.update(fixed)
        hasher.update(raw)
    return _parse_header(path, raw, header_len, size, whole)


def read_header(path: str | os.PathLike, *, whole: bool = True) -> SessionHeader | None:
    """The validated header of a session file, reading at most MAX_HEADER_BYTES + 16 bytes (the
    data and checksum are not read). None when the file does not exist; SessionFileError when
    it is not a usable session file.

    whole=False reads the header of a file whose data section is cut short (truncated in a
    copy, a full disk): its KV is a cache miss, but the conversation its meta holds is intact and
    continues, prefilled again, as a checksum mismatch's does (README: "the conversation the file
    holds still continues"). A listing keeps whole=True: such a file is not a usable entry."""
    if not isinstance(whole, bool):
        raise TypeError(f"read_header: whole must be True or False, got {whole!r}")
    path = Path(path)
    opened = _open(path)
    if opened is None:
        return None
    f, size = opened
    try:
        with f:
            return _read_head(f, path, size, whole=whole)
    except OSError as e:
        raise SessionFileError(path, f"read error: {e.strerror or e}") from None


def _check_args_read(model_sha256, config_hash, kv_layout, max_tokens, max_bytes) -> None:
    for name, v in (("model_sha256", model_sha256), ("config_hash", config_hash),
                    ("kv_layout", kv_layout)):
        if not isinstance(v, str):
            raise TypeError(f"read_session: {name} must be a str, got {v!r}")
    if not _is_int(max_tokens) or max_tokens < 0:
        raise ValueError(f"read_session: max_tokens must be an int >= 0, got {max_tokens!r}")
    if max_bytes is not None and (not _is_int(max_bytes) or max_bytes < 0):
        raise ValueError(f"read_session: max_bytes must be None or an int >= 0, "
                         f"got {max_bytes!r}")


def _load(path: Path, model_sha256, config_hash, kv_layout, max_tokens, max_bytes):
    opened = _open(path)
    if opened is None:
        return None
    f, size = opened
    with f:
        if max_bytes is not None and size > max_bytes:
            raise SessionFileError(path, f"file is {size} bytes, over the cap of {max_bytes}")
        h = bulk_sha256()
        hd = _read_head(f, path, size, h)
        # the layout first: it is part of the config hash too, and "kv layout differs" says why
        for what, got, want in (("model sha256", hd.model_sha256, model_sha256),
                                ("kv layout", hd.kv_layout, kv_layout),
                                ("config hash", hd.config_hash, config_hash)):
            if got != want:
                # (a precision plan that requantizes the weights runs another file: the same
                # model under `fast` and `balanced` read as two models without a word of why)
                why = " (another model file, or a precision plan that requantizes it)" if what == "model sha256" else ""
                raise SessionFileError(path, f"{what} differs{why}: file has {_short(got, 24)}, "
                                             f"expected {_short(want, 24)}")
        if hd.n_tokens > max_tokens:
            raise SessionFileError(path, f"holds {hd.n_tokens} tokens, more than the capacity "
                                         f"of {max_tokens}")
        # Sizes are now bounded by the real file size: read the rest once, hashing as we go.
        h.update(_read_exact(f, hd.data_start - f.tell(), path, "padding"))
        buf = bytearray(hd.data_nbytes)
        got = _read_into(f, buf)
        if got != hd.data_nbytes:
            raise SessionFileError(path, f"short read of the data: expected {hd.data_nbytes} "
                                         f"bytes, got {got} (file changed while reading?)")
        h.update(buf)
        digest = _read_exact(f, _SUM, path, "checksum")
    if h.digest() != digest:
        raise SessionFileError(path, "checksum mismatch: the file is corrupt")
    tokens = _view(buf, np.dtype("<i4"), 0, (hd.n_tokens,))
    if tokens.size and int(tokens.min()) < 0:  # only a hand-made file signs such ids
        raise SessionFileError(path, f"negative token id {int(tokens.min())}")
    arrays = {a.name: _view(buf, np.dtype(a.dtype).newbyteorder("<"), a.offset, a.shape)
              for a in hd.arrays}
    return SessionData(tokens, arrays, hd.meta)


def _view(buf: bytearray, dt: np.dtype, offset: int, shape: tuple[int, ...]) -> np.ndarray:
    """An array over the read buffer, in native byte order (no copy on little-endian hosts)."""
    count = 1
    for d in shape:
        count *= d
    if count == 0:  # frombuffer refuses an offset at the very end of the buffer
        arr = np.empty(shape, dt)
    else:
        arr = np.frombuffer(buf, dtype=dt, count=count, offset=offset).reshape(shape)
    return arr.astype(dt.newbyteorder("="), copy=False)


def read_session(path: str | os.PathLike, *, model_sha256: str, config_hash: str,
                 kv_layout: str, max_tokens: int,
                 max_bytes: int | None = None) -> SessionData | None:
    """Load a session file written for this model, configuration and KV layout.

    Returns None on a cache miss: silently when the file does not exist, and with exactly one
    warning line (file and reason) for a mismatch (model, config, layout, more than max_tokens
    tokens, larger than max_bytes) or a malformed, truncated, unreadable or corrupt file.
    Raises only for bad arguments (TypeError/ValueError), never for the file's content."""
    _check_args_read(model_sha256, config_hash, kv_layout, max_tokens, max_bytes)
    path = Path(path)
    try:
        data = _load(path, model_sha256, config_hash, kv_layout, max_tokens, max_bytes)
    except SessionFileError as e:
        log.warning("session cache miss: %s", e)
        return None
    except MemoryError:
        log.warning("session cache miss: %s: not enough memory to load it", path)
        return None
    except OSError as e:
        log.warning("session cache miss: %s: read error: %s", path, e.strerror or e)
        return None
    if data is None:
        log.debug("session cache miss: %s does not exist", path)
    return data
