"""Session / prefix-cache files (edgellm/kv/session_file.py) and the cache directory
(edgellm/kv/disk_cache.py).

Every malformed or mismatched file (RELIABILITY.md item 17) is built in code from a valid one and
must read as a cache miss with exactly one warning naming the reason. A hypothesis fuzz mutates
valid files (byte and bit flips, truncation, insertion, deletion, boundary integers written over
the binary fields and the JSON header's fields, optionally re-signed so the mutation gets past the
checksum) and requires SessionData or None: no exception, no hang (1 s per example).

EDGELLM_FUZZ_EXAMPLES sets the number of fuzz examples (default 1500)."""
from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
import tracemalloc
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edgellm.kv import disk_cache, session_file as sf
from edgellm.kv.session_file import SessionData, read_header, read_session, write_session

SHA = hashlib.sha256(b"model").hexdigest()
CFG = "cfg-1"
LAYOUT = "contiguous/fp16"
TOKENS = [1, 17, 2**31 - 1, 0, 5]
META = {"model_name": "tiny", "n_ctx": 64, "note": "héllo\nworld"}


def _arrays() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "k": rng.standard_normal((2, 3, 5, 4)).astype(np.float16),  # (layers, kvh, tokens, hd)
        "v": rng.standard_normal((2, 3, 5, 4)).astype(np.float32),
        "k_scale": rng.integers(-128, 127, (2, 3), dtype=np.int8),
        "pos": np.arange(7, dtype=np.int32),
        "mask": np.array([0, 1, 255], dtype=np.uint8),
        "empty": np.zeros((0, 3), dtype=np.float32),
    }


def _write(path, **over) -> Path:
    kw = dict(model_sha256=SHA, config_hash=CFG, kv_layout=LAYOUT, token_ids=TOKENS,
              arrays=_arrays(), meta=META)
    kw.update(over)
    write_session(path, **kw)
    return Path(path)


def _read(path, **over):
    kw = dict(model_sha256=SHA, config_hash=CFG, kv_layout=LAYOUT, max_tokens=64)
    kw.update(over)
    return read_session(path, **kw)


# -- helpers that take a valid file apart and put it back together ----------------------------


def _split(data: bytes) -> tuple[dict, bytes]:
    """(header, data section) of a valid file."""
    n = struct.unpack_from("<I", data, 12)[0]
    start = -(-(16 + n) // 64) * 64
    return json.loads(data[16:16 + n]), data[start:-32]


def _assemble(header, body: bytes, *, magic=b"EDGESESS", version=1, header_len=None,
              resign=True) -> bytes:
    """A file around `header` (a dict, or raw bytes) and a data section, with a correct checksum
    unless resign is false (then 32 zero bytes)."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    n = len(raw) if header_len is None else header_len
    head = magic + struct.pack("<II", version, n) + raw
    head += b"\0" * (-len(head) % 64)
    out = head + body
    return out + (hashlib.sha256(out).digest() if resign else b"\0" * 32)


def _resign(data: bytes) -> bytes:
    return data[:-32] + hashlib.sha256(data[:-32]).digest()


@pytest.fixture
def valid(tmp_path) -> tuple[Path, bytes]:
    p = _write(tmp_path / "s.edgesess")
    return p, p.read_bytes()


def _miss(caplog, path, data: bytes | None, reason: str, **over) -> None:
    """Reading `data` (written to `path`) is a miss with one warning that names file and reason."""
    if data is not None:
        Path(path).write_bytes(data)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="edgellm"):
        assert _read(path, **over) is None
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    msg = warnings[0].getMessage()
    assert str(path) in msg and reason in msg, msg
    assert "\n" not in msg
    assert warnings[0].name.startswith("edgellm")


# -- round trip -------------------------------------------------------------------------------


def test_round_trip_bit_exact(tmp_path, caplog) -> None:
    p = _write(tmp_path / "s.edgesess")
    with caplog.at_level(logging.DEBUG, logger="edgellm"):
        d = _read(p)
    assert isinstance(d, SessionData)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert d.token_ids.dtype == np.int32 and d.token_ids.tolist() == TOKENS
    want = _arrays()
    assert list(d.arrays) == list(want)
    for name, a in want.items():
        got = d.arrays[name]
        assert got.dtype == a.dtype and got.shape == a.shape
        assert got.tobytes() == a.tobytes(), name
    assert d.meta == META


def test_layout_is_aligned_and_signed(valid) -> None:
    _, data = valid
    assert data[:8] == b"EDGESESS" and struct.unpack_from("<I", data, 8)[0] == 1
    header, body = _split(data)
    assert header["n_tokens"] == len(TOKENS) and header["data_nbytes"] == len(body)
    assert np.frombuffer(body, "<i4", len(TOKENS)).tolist() == TOKENS
    assert all(a["offset"] % 64 == 0 for a in header["arrays"])
    assert (len(data) - 32 - len(body)) % 64 == 0  # data_start
    assert data[-32:] == hashlib.sha256(data[:-32]).digest()


def test_round_trip_odd_inputs(tmp_path) -> None:
    big_endian = np.arange(6, dtype=">f4").reshape(2, 3)
    strided = np.arange(24, dtype=np.float32).reshape(4, 6).T  # not C-contiguous
    scalar = np.array(7, dtype=np.int32)
    p = _write(tmp_path / "odd", token_ids=np.array([], dtype=np.int64),
               arrays={"be": big_endian, "t": strided, "s": scalar}, meta=None)
    d = _read(p, max_tokens=0)
    assert d.token_ids.shape == (0,) and d.meta == {}
    np.testing.assert_array_equal(d.arrays["be"], big_endian)
    np.testing.assert_array_equal(d.arrays["t"], strided)
    assert d.arrays["s"].shape == () and int(d.arrays["s"]) == 7
    p = _write(tmp_path / "none", arrays={})
    assert _read(p).arrays == {}


def test_round_trip_in_many_write_chunks(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(sf, "_CHUNK", 64)  # the slab of a real KV cache goes out in pieces
    p = _write(tmp_path / "s")
    for name, a in _arrays().items():
        assert _read(p).arrays[name].tobytes() == a.tobytes()


def test_overwrite_replaces(tmp_path) -> None:
    p = _write(tmp_path / "s")
    _write(p, token_ids=[9])
    assert _read(p).token_ids.tolist() == [9]
    assert sorted(x.name for x in tmp_path.iterdir()) == ["s"]


@pytest.mark.parametrize("over, exc", [
    (dict(model_sha256=""), TypeError),
    (dict(config_hash=None), TypeError),
    (dict(token_ids=[-1]), ValueError),
    (dict(token_ids=[2**31]), ValueError),
    (dict(token_ids=[[1, 2]]), ValueError),
    (dict(token_ids=[1.5]), TypeError),
    (dict(arrays={"x": np.zeros(2, np.float64)}), TypeError),
    (dict(arrays={"x": [1, 2]}), TypeError),
    (dict(arrays={"": np.zeros(2, np.int8)}), ValueError),
    (dict(arrays={"x": np.zeros((1,) * 9, np.int8)}), ValueError),
    (dict(meta={"x": object()}), TypeError),
    (dict(meta={"x": float("nan")}), TypeError),
    (dict(meta={"x": "a" * (1 << 20)}), ValueError),
    (dict(meta=[1]), TypeError),
])
def test_write_rejects_bad_arguments(tmp_path, over, exc) -> None:
    with pytest.raises(exc):
        _write(tmp_path / "s", **over)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("over, exc", [
    (dict(max_tokens=-1), ValueError), (dict(max_tokens=1.0), ValueError),
    (dict(max_bytes=-1), ValueError), (dict(model_sha256=None), TypeError),
])
def test_read_rejects_bad_arguments(valid, over, exc) -> None:
    with pytest.raises(exc):
        _read(valid[0], **over)


# -- atomic write -----------------------------------------------------------------------------


def _fail_on_call(n: int, exc: BaseException):
    calls = {"n": 0}

    def hook(*a, **k):
        calls["n"] += 1
        if calls["n"] >= n:
            raise exc
        return memoryview(*a, **k)
    return hook


@pytest.mark.parametrize("where", ["mid-write", "interrupt", "fsync", "replace"])
def test_atomic_write_failure_keeps_old_file(valid, monkeypatch, where) -> None:
    p, old = valid
    if where == "mid-write":  # the second array chunk fails: part of the data is already out
        monkeypatch.setattr(sf, "memoryview", _fail_on_call(2, OSError(28, "No space left")),
                            raising=False)
    elif where == "interrupt":  # Ctrl-C in the middle of an array
        monkeypatch.setattr(sf, "_CHUNK", 64)
        monkeypatch.setattr(sf, "memoryview", _fail_on_call(5, KeyboardInterrupt()),
                            raising=False)
    elif where == "fsync":
        def bad_fsync(fd):
            raise OSError(5, "I/O error")
        monkeypatch.setattr(sf.os, "fsync", bad_fsync)
    else:
        def bad_replace(a, b):
            raise OSError(18, "cross-device")
        monkeypatch.setattr(sf.os, "replace", bad_replace)
    with pytest.raises((OSError, KeyboardInterrupt)):
        _write(p, token_ids=[3, 3, 3], arrays={"a": np.ones(100, np.float32),
                                               "b": np.ones(100, np.float32)})
    monkeypatch.undo()
    assert p.read_bytes() == old
    assert [x.name for x in p.parent.iterdir()] == [p.name]  # no temp file left
    assert _read(p).token_ids.tolist() == TOKENS


def test_write_into_missing_directory_leaves_nothing(tmp_path) -> None:
    with pytest.raises(FileNotFoundError):
        _write(tmp_path / "no" / "s")
    assert list(tmp_path.iterdir()) == []


# -- every miss: None and exactly one warning naming the reason -------------------------------


def test_missing_file_is_a_silent_miss(tmp_path, caplog) -> None:
    with caplog.at_level(logging.DEBUG, logger="edgellm"):
        assert _read(tmp_path / "absent") is None
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_identity_mismatches(valid, caplog) -> None:
    p, _ = valid
    _miss(caplog, p, None, "model sha256 differs", model_sha256="0" * 64)
    _miss(caplog, p, None, "config hash differs", config_hash="cfg-2")
    _miss(caplog, p, None, "kv layout differs", kv_layout="contiguous/int8")
    # an engine whose KV precision differs has another layout and, with it, another config hash:
    # the warning names the layout (it said "config hash differs")
    _miss(caplog, p, None, "kv layout differs", kv_layout="contiguous/int8", config_hash="cfg-2")
    _miss(caplog, p, None, "more than the capacity of 4", max_tokens=4)
    _miss(caplog, p, None, "over the cap", max_bytes=len(p.read_bytes()) - 1)
    assert _read(p, max_tokens=len(TOKENS), max_bytes=len(p.read_bytes())) is not None


def test_fixed_header_corruption(valid, caplog) -> None:
    p, data = valid
    header, body = _split(data)
    _miss(caplog, p, b"", "truncated")
    _miss(caplog, p, b"EDGE", "truncated")
    _miss(caplog, p, b"GGUF" + data[4:], "wrong magic")
    _miss(caplog, p, b"NOTASESS" * 3, "wrong magic")
    for v in (0, 2, 2**32 - 1, 0x01000000):  # 0x01000000: version 1 byte-swapped
        _miss(caplog, p, data[:8] + struct.pack("<I", v) + data[12:], "unsupported format version")
    _miss(caplog, p, _assemble(header, body, header_len=0), "header length 0")
    _miss(caplog, p, _assemble(header, body, header_len=(1 << 20) + 1), "header length")
    _miss(caplog, p, _assemble(header, body, header_len=1 << 20), "truncated")


@pytest.mark.parametrize("raw, reason", [
    (b"{not json", "invalid JSON"),
    (b"\xff\xfe{}", "invalid JSON"),
    (b"[" * 100_000 + b"]" * 100_000, "invalid JSON"),  # recursion, not a crash
    (b'{"a": 1, "a": 2}', "invalid JSON"),  # duplicate key
    (b'{"n": 1' + b"0" * 5000 + b"}", "invalid JSON"),  # an integer literal over the cap
    (b"[1, 2]", "expected a JSON object"),
    (b"{}", "keys differ"),
], ids=["syntax", "utf8", "deep", "dup-key", "long-int", "list", "empty"])
def test_header_json_invalid(valid, caplog, raw, reason) -> None:
    p, data = valid
    _miss(caplog, p, _assemble(raw, _split(data)[1]), reason)


_DELETE = object()  # as a value for _edit: remove the field


def _edit(header: dict, path: tuple, value) -> dict:
    """A copy of the header with the field at `path` (keys and list indices) set to value."""
    h = json.loads(json.dumps(header))
    node = h
    for k in path[:-1]:
        node = node[k]
    if value is _DELETE:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return h



@pytest.mark.parametrize("path, value, reason", [
    (("model_sha256",), 5, "model_sha256 must be a string"),
    (("kv_layout",), None, "kv_layout must be a string"),
    (("n_tokens",), "5", "n_tokens must be a non-negative integer"),
    (("n_tokens",), True, "n_tokens must be a non-negative integer"),
    (("n_tokens",), -1, "n_tokens must be a non-negative integer"),
    (("n_tokens",), 5.0, "n_tokens must be a non-negative integer"),
    (("n_tokens",), 2**40, "needs"),  # more tokens than the data section holds
    (("data_nbytes",), 2**63, "size mismatch"),
    (("data_nbytes",), -64, "data_nbytes must be a non-negative integer"),
    (("meta",), [], "meta must be an object"),
    (("arrays",), {}, "arrays must be a list"),
    (("arrays",), [{}] * 4097, "at most 4096"),
    (("extra",), 1, "keys differ"),
    (("meta", "model_name"), _DELETE, None),  # still valid: meta is free-form
    (("arrays", 0), "k", "must be an object with keys"),
    (("arrays", 0, "extra"), 1, "must be an object with keys"),
])
def test_header_field_types(valid, caplog, path, value, reason) -> None:
    p, data = valid
    header, body = _split(data)
    h = _edit(header, path, value)
    if reason is None:
        Path(p).write_bytes(_assemble(h, body))
        assert _read(p) is not None
    else:
        _miss(caplog, p, _assemble(h, body), reason)


@pytest.mark.parametrize("field, value, reason", [
    ("dtype", "float64", "unknown dtype"),
    ("dtype", 7, "unknown dtype"),
    ("dtype", "<f4", "unknown dtype"),
    ("shape", [2, 3, -5, 4], "shape must be"),
    ("shape", [2, 3, 5, 4.0], "shape must be"),
    ("shape", [1] * 9, "shape must be"),
    ("shape", "2x3", "shape must be"),
    ("shape", [2**62, 2**62, 2**62], "does not match shape"),  # product overflows int64
    ("shape", [2, 3, 5, 5], "does not match shape"),
    ("nbytes", 0, "does not match shape"),
    ("nbytes", -240, "does not match shape"),
    ("offset", -64, "offset must be"),
    ("offset", 65, "multiple of 64"),
    ("offset", 2**64, "run past"),
    ("offset", 0, "overlaps"),  # on top of the token ids
    ("name", "", "name must be"),
    ("name", "v", "duplicate"),
    ("name", ["k"], "name must be"),
])
def test_array_table_inconsistent(valid, caplog, field, value, reason) -> None:
    p, data = valid
    header, body = _split(data)
    _miss(caplog, p, _assemble(_edit(header, ("arrays", 0, field), value), body), reason)


def test_arrays_overlapping_each_other(valid, caplog) -> None:
    p, data = valid
    header, body = _split(data)
    h = _edit(header, ("arrays", 1, "offset"), header["arrays"][0]["offset"] + 64)
    _miss(caplog, p, _assemble(h, body), "overlaps")


def test_truncation_and_extension(valid, caplog) -> None:
    p, data = valid
    header_end = 16 + struct.unpack_from("<I", data, 12)[0]
    for n in (8, 15, 16, 40, header_end - 1, header_end, header_end + 10, len(data) - 100,
              len(data) - 33, len(data) - 32, len(data) - 1):
        _miss(caplog, p, data[:n], "truncated" if n < header_end + 32 else "size mismatch")
    _miss(caplog, p, data + b"\0", "size mismatch")
    _miss(caplog, p, data + b"\0" * 64, "size mismatch")


def test_checksum_failures(valid, caplog) -> None:
    p, data = valid
    for pos in (len(data) - 1, len(data) - 40, len(data) // 2):
        bad = bytearray(data)
        bad[pos] ^= 0x10
        _miss(caplog, p, bytes(bad), "checksum mismatch")
    header, body = _split(data)
    _miss(caplog, p, _assemble(header, body, resign=False), "checksum mismatch")
    # a header edit that stays well-formed is caught by the checksum too
    h = _edit(header, ("meta", "note"), "other")
    _miss(caplog, p, _assemble(h, body)[:-32] + data[-32:], "checksum mismatch")


def test_negative_token_id_in_a_signed_file(valid, caplog) -> None:
    p, data = valid
    header, body = _split(data)
    body = struct.pack("<i", -7) + body[4:]
    _miss(caplog, p, _assemble(header, body), "negative token id")


def test_short_read_and_read_error(valid, caplog, monkeypatch) -> None:
    """A file that shrinks while it is read, and an I/O error, are misses too."""
    p, _ = valid
    monkeypatch.setattr(sf, "_read_into", lambda f, buf: len(buf) // 2)
    _miss(caplog, p, None, "short read of the data")
    monkeypatch.undo()

    def eio(*a):
        raise OSError(5, "Input/output error")
    monkeypatch.setattr(sf, "_read_into", eio)
    _miss(caplog, p, None, "read error: Input/output error")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs on this platform")
def test_fifo_is_not_opened_blocking(tmp_path, caplog) -> None:
    p = tmp_path / "fifo"
    os.mkfifo(p)
    _miss(caplog, p, None, "not a regular file")


def test_directory_is_a_miss(tmp_path, caplog) -> None:
    _miss(caplog, tmp_path, None, "not a regular file")


def test_declared_sizes_do_not_drive_allocation(tmp_path, caplog) -> None:
    """Huge declared counts in a small, well-signed file are refused before any allocation."""
    p = tmp_path / "s"
    data = _write(p).read_bytes()
    header, body = _split(data)
    cases = [
        _assemble(_edit(header, ("n_tokens",), 2**40), body),
        _assemble(_edit(header, ("data_nbytes",), 2**40), body),
        _assemble(_edit(header, ("arrays", 0, "shape"), [2**40, 2**40]), body),
        _assemble(header, body, header_len=2**32 - 1),
        _assemble(header, body, header_len=1 << 20),  # under the cap, past the end of file
    ]
    for bad in cases:
        p.write_bytes(bad)
        tracemalloc.start()
        try:
            with caplog.at_level(logging.WARNING, logger="edgellm"):
                assert _read(p, max_tokens=2**62) is None
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 256 * 1024, peak


# -- mutation fuzz ----------------------------------------------------------------------------


FUZZ = settings(
    max_examples=int(os.environ.get("EDGELLM_FUZZ_EXAMPLES", "1500")),
    deadline=timedelta(seconds=1),
    database=None,  # keep the checkout clean; a failure prints its falsifying example
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def _fuzz_bases() -> list[tuple[bytes, dict, bytes]]:
    import tempfile

    out = []
    with tempfile.TemporaryDirectory() as d:
        for i, kw in enumerate([{}, dict(arrays={}, token_ids=[]),
                                dict(arrays={"kv": np.ones((2, 2, 8, 4), np.float16)},
                                     token_ids=list(range(8)), meta={})]):
            data = _write(Path(d) / f"b{i}", **kw).read_bytes()
            header, body = _split(data)
            out.append((data, header, body))
    return out


BASES = _fuzz_bases()
BOUNDARY = (0, 1, 2, 3, 4, 7, 8, 15, 16, 31, 32, 33, 63, 64, 65, 255, 256, 2**16 - 1, 2**16,
            2**20, 2**20 + 1, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**53, 2**62, 2**63 - 1,
            2**63, 2**64 - 1, 2**64, 10**400)
_INT = st.one_of(st.sampled_from(BOUNDARY), st.integers(0, 2**64))
_SIGNED = st.tuples(_INT, st.sampled_from((1, -1)), st.sampled_from((0, 1, -1))).map(
    lambda t: t[0] * t[1] + t[2])
_ODD = st.sampled_from((None, True, False, "", "x", 1.5, -0.0, [], {}, [1], "float32",
                        float("inf")))
_JSON_VALUE = st.one_of(_SIGNED, _SIGNED, _ODD)
_FRACTION = st.integers(0, (1 << 16) - 1)  # a position as a fraction of a region, in 1/65536


def _json_paths(header: dict) -> list[tuple]:
    """Every field of the header, nested ones included (a dimension, an offset...)."""
    out = []

    def walk(node, prefix):
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for k, v in items:
            out.append(prefix + (k,))
            if isinstance(v, (dict, list)):
                walk(v, prefix + (k,))
    walk(header, ())
    return out


_PATHS = [st.sampled_from(_json_paths(h)) for _, h, _ in BASES]
# Strategies built once: building them inside each draw costs more than the read itself.
_BASE = st.integers(0, len(BASES) - 1)
_EDIT_JSON = st.integers(0, 3)  # 0: edit the header (a quarter of the examples)
_N_EDITS = st.integers(1, 3)
_N_BYTE_OPS = [st.integers(1, 4), st.integers(0, 4)]  # [plain, after a JSON edit]
# where a byte mutation lands: mostly the JSON header (where the reader decides) and the data
# (the magic and version are left to the fixtures, to the "fixed" kind below, and to insertions
# and deletions that shift them)
_REGION = st.sampled_from(("header", "header", "header", "data", "data", "trailer"))
_KIND = st.sampled_from(("fixed", "flip", "bit", "truncate", "insert", "delete"))
_FIXED_AT = st.sampled_from((8, 12))  # version, header length
_XOR = st.integers(1, 255)
_BIT = st.integers(0, 7)
_INSERT = st.binary(min_size=1, max_size=16)
_DELETE_N = st.integers(1, 16)


@st.composite
def mutated(draw) -> tuple[int, bytes, bool]:
    i = draw(_BASE)
    base, header, body = BASES[i]
    edit = draw(_EDIT_JSON) == 0
    if edit:  # boundary integers or odd types over header fields, then rebuild the file
        h = header
        for _ in range(draw(_N_EDITS)):
            path, value = draw(_PATHS[i]), draw(_JSON_VALUE)
            try:
                h = _edit(h, path, value)
            except (TypeError, KeyError, IndexError):
                pass  # an earlier edit replaced a container on this path
        data = bytearray(_assemble(json.dumps(h, allow_nan=True).encode(), body))
    else:
        data = bytearray(base)
    header_end = 16 + struct.unpack_from("<I", data, 12)[0]
    for _ in range(draw(_N_BYTE_OPS[edit])):
        n = len(data)
        lo, hi = {"header": (16, header_end), "data": (header_end, n - 32),
                  "trailer": (n - 32, n)}[draw(_REGION)]
        lo, hi = max(0, min(lo, n)), max(0, min(hi, n))
        pos = lo + (max(hi - lo, 0) * draw(_FRACTION) >> 16)
        kind = draw(_KIND)
        if kind == "fixed":  # boundary integer over the version or header length
            at = draw(_FIXED_AT)
            data[at:at + 4] = struct.pack("<I", draw(_INT) % 2**32)[:max(n - at, 0)]
        elif kind == "flip" and pos < n:
            data[pos] ^= draw(_XOR)
        elif kind == "bit" and pos < n:
            data[pos] ^= 1 << draw(_BIT)
        elif kind == "truncate":
            del data[pos:]
        elif kind == "insert":
            data[pos:pos] = draw(_INSERT)
        elif kind == "delete":
            del data[pos:pos + draw(_DELETE_N)]
    resign = draw(st.booleans()) and len(data) >= 32
    if resign:
        data = bytearray(_resign(bytes(data)))
    return i, bytes(data), resign or edit  # (base, bytes, signed after a mutation)


class _Count(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


@pytest.fixture(scope="module")
def fuzz_file(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fuzz") / "case.edgesess"


@FUZZ
@given(case=mutated())
def test_fuzz_read_session(fuzz_file, case) -> None:
    i, data, signed = case
    fuzz_file.write_bytes(data)
    counter = _Count()
    logger = logging.getLogger("edgellm")
    logger.addHandler(counter)
    try:
        d = _read(fuzz_file, max_tokens=1 << 20)
    finally:
        logger.removeHandler(counter)
    if d is None:
        assert len(counter.records) == 1
        assert str(fuzz_file) in counter.records[0].getMessage()
    else:
        assert counter.records == []
        # only a file whose checksum matches can load, and only a re-signed one can differ
        assert len(data) >= 32 and hashlib.sha256(data[:-32]).digest() == data[-32:]
        assert signed or data == BASES[i][0]
        assert d.token_ids.dtype == np.int32 and d.token_ids.ndim == 1
        assert d.token_ids.size <= 1 << 20 and (d.token_ids >= 0).all()
        for a in d.arrays.values():
            assert a.dtype.name in sf.DTYPES
        if data == BASES[i][0]:
            base = BASES[i]
            assert d.token_ids.tolist() == np.frombuffer(
                base[2], "<i4", base[1]["n_tokens"]).tolist()
    # the listing path reads the same header: a SessionHeader or a SessionFileError
    try:
        h = read_header(fuzz_file)
        assert h is not None and h.file_size == len(data)
    except sf.SessionFileError:
        assert d is None


def test_fuzz_bases_are_valid(tmp_path) -> None:
    for data, _, _ in BASES:
        (tmp_path / "b").write_bytes(data)
        assert _read(tmp_path / "b") is not None


# -- the cache directory ----------------------------------------------------------------------


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("EDGELLM_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


SHA_B = hashlib.sha256(b"other model").hexdigest()


def test_entry_path(home) -> None:
    p = disk_cache.entry_path(SHA, "abc_123-x")
    assert p == home / "cache" / f"{SHA[:16]}-abc_123-x.edgesess"
    for sha, key in ((SHA, "../x"), (SHA, "a/b"), (SHA, ""), (SHA, "k" * 129), (SHA, "a.b"),
                     (SHA.upper(), "k"), (SHA[:8], "k"), ("../" + SHA, "k"), (None, "k")):
        with pytest.raises(ValueError):
            disk_cache.entry_path(sha, key)


def test_empty_or_missing_cache(home) -> None:
    assert disk_cache.list_entries() == []
    assert disk_cache.clear() == 0
    info = disk_cache.info()
    assert info["entries"] == 0 and info["total_bytes"] == 0
    assert info["directory"] == str(home / "cache")
    assert not (home / "cache").exists()
    assert disk_cache.cache_dir(create=True).is_dir()


def test_list_clear_info(home) -> None:
    d = disk_cache.cache_dir(create=True)
    a1 = _write(disk_cache.entry_path(SHA, "p1"))
    a2 = _write(disk_cache.entry_path(SHA, "p2"), token_ids=[1, 2], meta={})
    b1 = _write(disk_cache.entry_path(SHA_B, "p1"), model_sha256=SHA_B, meta={"model_name": 3})
    garbage = d / f"{SHA_B[:16]}-junk.edgesess"
    garbage.write_bytes(b"EDGESESS" + b"\0" * 100)
    temp = d / f".{SHA[:16]}-p3.edgesess.x1y2.tmp"  # a writer killed mid-write, long ago
    temp.write_bytes(b"partial")
    os.utime(temp, (1e9, 1e9))
    live = d / f".{SHA[:16]}-p4.edgesess.z9.tmp"  # a writer still at work: clear() keeps it
    live.write_bytes(b"partial")
    (d / "notes.txt").write_text("mine")
    (d / "dir.edgesess").mkdir()
    if hasattr(os, "symlink"):
        os.symlink(a1, d / "link.edgesess")

    entries = {e.path.name: e for e in disk_cache.list_entries()}
    assert set(entries) >= {a1.name, a2.name, b1.name, garbage.name, temp.name, live.name,
                            "dir.edgesess"}
    assert "notes.txt" not in entries
    e = entries[a1.name]
    assert e.valid and e.model_sha256 == SHA and e.model_name == "tiny"
    assert e.model_short == "tiny" and e.n_tokens == len(TOKENS) and e.kv_layout == LAYOUT
    assert e.size == a1.stat().st_size and e.mtime == a1.stat().st_mtime
    assert entries[a2.name].model_name is None and entries[a2.name].model_short == SHA[:16]
    assert entries[b1.name].model_name is None  # a non-string name is not shown
    assert "unsupported format version" in entries[garbage.name].reason
    assert "temp file" in entries[temp.name].reason
    assert "not a regular file" in entries["dir.edgesess"].reason
    if hasattr(os, "symlink"):
        assert "not a regular file" in entries["link.edgesess"].reason

    info = disk_cache.info()
    assert info["valid"] == 3 and info["entries"] == len(entries)
    assert info["invalid"] == len(entries) - 3
    assert info["total_bytes"] == sum(e.size for e in entries.values())
    assert info["tokens"] == 2 * len(TOKENS) + 2

    # one model: its valid entries, plus unreadable files carrying its name prefix
    assert disk_cache.clear(SHA_B) == 2  # b1 and the garbage file
    assert a1.exists() and a2.exists() and not b1.exists() and not garbage.exists()
    n_left = len(disk_cache.list_entries())
    assert disk_cache.clear() == n_left - 2  # all but the directory and the live temp file
    assert (d / "notes.txt").read_text() == "mine" and (d / "dir.edgesess").is_dir()
    assert not a1.exists() and not temp.exists() and live.exists()
    assert sorted(e.path.name for e in disk_cache.list_entries()) == [live.name, "dir.edgesess"]
    with pytest.raises(TypeError):
        disk_cache.clear(b"sha")


def test_listing_reads_only_the_header(home) -> None:
    disk_cache.cache_dir(create=True)
    p = _write(disk_cache.entry_path(SHA, "big"),
               arrays={"kv": np.zeros((4 << 20) // 4, np.float32)})  # 4 MiB of data
    tracemalloc.start()
    try:
        entries = disk_cache.list_entries()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert entries[0].valid and entries[0].size > 4 << 20 and entries[0].path == p
    assert peak < 256 * 1024, peak


def test_listing_reports_a_corrupt_size(home) -> None:
    disk_cache.cache_dir(create=True)
    p = _write(disk_cache.entry_path(SHA, "t"))
    p.write_bytes(p.read_bytes()[:-10])
    (e,) = disk_cache.list_entries()
    assert not e.valid and "size mismatch" in e.reason and e.model_sha256 is None


def _dead_pid() -> int:
    """A pid no process has: a child that has exited and been reaped."""
    import subprocess
    import sys
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_a_killed_writers_temp_file_is_removed_by_the_next_save(tmp_path) -> None:
    """write_session's temporary file had no writer's pid in its name: one a killed save left
    (SIGKILL mid-save; 3 files, 54 MiB after 10 kills in a helper's probe) stayed for good."""
    path = tmp_path / "chat.edgesess"
    dead = tmp_path / f".chat.edgesess.pid{_dead_pid()}.k1ll3d.tmp"
    live = tmp_path / f".chat.edgesess.pid{os.getpid()}.w0rk1n.tmp"   # a writer still at work
    other = tmp_path / ".notes.pid1.txt"                                # not a temporary name of ours
    for f in (dead, live, other):
        f.write_bytes(b"partial")
    _write(path)
    assert not dead.exists() and live.exists() and other.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([path.name, live.name, other.name])


def test_cache_clear_removes_a_dead_writers_temp_file_at_once(home) -> None:
    d = disk_cache.cache_dir(create=True)
    dead = d / f".{SHA[:16]}-p5.edgesess.pid{_dead_pid()}.abc123.tmp"     # seconds old, writer gone
    live = d / f".{SHA[:16]}-p6.edgesess.pid{os.getpid()}.def456.tmp"     # hours old, writer running
    dead.write_bytes(b"partial")
    live.write_bytes(b"partial")
    os.utime(live, (1e9, 1e9))
    assert disk_cache.clear() == 1
    assert not dead.exists() and live.exists()
