"""GGUF header walk: one fixture per malformed-file case (RELIABILITY.md items 1-12), each built
by corrupting a valid synthetic file in code; valid synthetic files of each tensor type; and the
real model checked against the gguf package's own reader."""
from __future__ import annotations

import struct
import sys
import time
from pathlib import Path
from typing import Callable

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf import GGUFValueType as VT

sys.path.insert(0, str(Path(__file__).parent))
from synthetic import (  # noqa: E402
    encode_array, encode_kv, encode_string, gguf_layout, patch_bytes, patch_u32, patch_u64,
    splice_header, write_tiny_model,
)

from edgellm.errors import ModelFormatError, ModelNotFoundError, UnsupportedModelError  # noqa: E402
from edgellm.model import gguf_file  # noqa: E402
from edgellm.model.gguf_file import read_gguf, tensor_view  # noqa: E402

TIME_LIMIT_S = 1.0
SMALL = dict(n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, d_ff=64)  # ~310-token vocab


@pytest.fixture(scope="module")
def bases(tmp_path_factory) -> dict[str, bytes]:
    """Valid small files to corrupt: F32, Q8_0, and F32 with an explicit general.alignment."""
    d = tmp_path_factory.mktemp("bases")
    out = {}
    for name, kw in {"f32": {}, "q8_0": {"tensor_type": QT.Q8_0},
                     "aligned": {"extra_metadata": {"general.alignment": 64}}}.items():
        m = write_tiny_model(d / f"{name}.gguf", **SMALL, **kw)
        out[name] = Path(m.path).read_bytes()
    return out


# ---------------------------------------------------------------------------------------------
# corruptions: each takes the base file's bytes and returns corrupted bytes

def kv(data: bytes, key: str):
    return gguf_layout(data).kvs[key]


def ti(data: bytes, name: str):
    return gguf_layout(data).tensors[name]


def last_tensor_in_data(data: bytes):
    return max(gguf_layout(data).tensors.values(), key=lambda t: t.rel_offset)


def truncate_mid_string_value(d):
    k = kv(d, "tokenizer.chat_template")
    return d[:k.value_at + 8 + 10]


def truncate_mid_tensor_infos(d):
    t = ti(d, "blk.1.attn_q.weight")
    return d[:t.n_dims_at + 6]  # inside the first dimension


def truncate_data(d):
    return d[:len(d) - 64]


def splice_kv(d, entry: bytes):
    """Appends a raw key/value entry at the end of the key/value section."""
    lay = gguf_layout(d)
    return splice_header(d, lay.kv_end, lay.kv_end, entry, kv_delta=1)


def rename_tensor(d, old: str, new: str):
    t = ti(d, old)
    return splice_header(d, t.start, t.name_at + len(old.encode()), encode_string(new))


def big_endian_file(tmp: Path) -> bytes:
    w = gguf.GGUFWriter(tmp / "be.gguf", "llama", endianess=gguf.GGUFEndian.BIG)
    w.add_uint32("llama.block_count", 1)
    w.add_tensor("output_norm.weight", np.ones(32, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return (tmp / "be.gguf").read_bytes()


MFE, UNS = ModelFormatError, UnsupportedModelError
CAP_T, CAP_KV = gguf_file.MAX_TENSORS, gguf_file.MAX_KV

# (id, base, corrupt(data) -> data, exception, field (exact, or a callable on the data), message part)
CASES: list[tuple[str, str, Callable[[bytes], bytes], type, object, str]] = [
    # 1. truncated file or header; wrong magic
    ("1-empty-file", "f32", lambda d: b"", MFE, "magic", "empty"),
    ("1-truncated-magic", "f32", lambda d: d[:3], MFE, "magic", "truncated"),
    ("1-truncated-fixed-header", "f32", lambda d: d[:13], MFE, "tensor_count", "truncated"),
    ("1-truncated-string-value", "f32", truncate_mid_string_value, MFE,
     lambda d: f"kv[{kv(d, 'tokenizer.chat_template').index}] 'tokenizer.chat_template' length", "truncated"),
    ("1-truncated-tensor-infos", "f32", truncate_mid_tensor_infos, MFE,
     "tensor 'blk.1.attn_q.weight' shape", "truncated"),
    ("1-truncated-tensor-data", "f32", truncate_data, MFE,
     lambda d: f"tensor {last_tensor_in_data(d).name!r} offset", "past the end"),
    ("1-wrong-magic", "f32", lambda d: b"GGML" + d[4:], MFE, "magic", "expected b'GGUF'"),
    # 2. unsupported version; byte-swapped
    ("2-version-0", "f32", lambda d: patch_u32(d, 4, 0), MFE, "version", "found 0"),
    ("2-version-1", "f32", lambda d: patch_u32(d, 4, 1), UNS, "version", "found 1"),
    ("2-version-newer", "f32", lambda d: patch_u32(d, 4, 4), UNS, "version", "newer"),
    ("2-version-garbage", "f32", lambda d: patch_u32(d, 4, 0xDEADBEEF), MFE, "version", "expected 2 or 3"),
    ("2-byte-swapped-version", "f32", lambda d: patch_bytes(d, 4, struct.pack(">I", 3)), UNS, "version",
     "byte-swapped"),
    ("2-byte-swapped-magic", "f32", lambda d: b"FUGG" + d[4:], UNS, "magic", "byte-swapped"),
    # 3. tensor / kv counts: negative, over a cap, more than the remaining bytes allow
    ("3-tensor-count-negative", "f32", lambda d: patch_u64(d, 8, -1), MFE, "tensor_count", "non-negative"),
    ("3-tensor-count-over-cap", "f32", lambda d: patch_u64(d, 8, CAP_T + 1), MFE, "tensor_count", "at most"),
    ("3-tensor-count-past-eof", "f32", lambda d: patch_u64(d, 8, (len(d) - 24) // 33 + 1), MFE,
     "tensor_count", "left in the file"),
    ("3-kv-count-negative", "f32", lambda d: patch_u64(d, 16, -(2 ** 62)), MFE, "kv_count", "non-negative"),
    ("3-kv-count-over-cap", "f32", lambda d: patch_u64(d, 16, CAP_KV + 1), MFE, "kv_count", "at most"),
    ("3-kv-count-past-eof", "f32", lambda d: patch_u64(d, 16, (len(d) - 24) // 14), MFE,
     "kv_count", "left in the file"),
    # 4. string length over a cap or past EOF; empty or duplicate keys
    ("4-key-length-over-cap", "f32", lambda d: patch_u64(d, kv(d, "general.name").start, 65536), MFE,
     lambda d: f"kv[{kv(d, 'general.name').index}] key length", "at most 65535"),
    ("4-string-length-over-cap", "f32",
     lambda d: patch_u64(d, kv(d, "general.name").value_at, gguf_file.MAX_STRING_LEN + 1), MFE,
     lambda d: f"kv[{kv(d, 'general.name').index}] 'general.name' length", "at most"),
    ("4-string-length-past-eof", "f32", lambda d: patch_u64(d, kv(d, "general.name").value_at, len(d)), MFE,
     lambda d: f"kv[{kv(d, 'general.name').index}] 'general.name' length", "truncated"),
    ("4-array-string-length-past-eof", "f32",
     lambda d: patch_u64(d, kv(d, "tokenizer.ggml.tokens").array_len_at + 8, 2 ** 40), MFE,
     lambda d: f"kv[{kv(d, 'tokenizer.ggml.tokens').index}] 'tokenizer.ggml.tokens'[0] string length",
     "at most"),
    ("4-empty-key", "f32",
     lambda d: splice_header(d, kv(d, "general.name").start, kv(d, "general.name").type_at, encode_string("")),
     MFE, lambda d: f"kv[{kv(d, 'general.name').index}] key", "non-empty"),
    ("4-duplicate-key", "f32",
     lambda d: splice_kv(d, d[kv(d, "llama.block_count").start:kv(d, "llama.block_count").end]), MFE,
     lambda d: f"kv[{len(gguf_layout(d).kvs)}] 'llama.block_count'", "duplicate"),
    ("4-key-not-utf8", "f32", lambda d: patch_bytes(d, kv(d, "general.name").key_at, b"\xff"), MFE,
     lambda d: f"kv[{kv(d, 'general.name').index}] key", "UTF-8"),
    # 5. array count x element size past EOF; arrays nested too deep
    ("5-array-count-past-eof", "f32",
     lambda d: patch_u64(d, kv(d, "tokenizer.ggml.token_type").array_len_at, len(d) // 4), MFE,
     lambda d: f"kv[{kv(d, 'tokenizer.ggml.token_type').index}] 'tokenizer.ggml.token_type' array length",
     "left in the file"),
    ("5-string-array-count-past-eof", "f32",
     lambda d: patch_u64(d, kv(d, "tokenizer.ggml.tokens").array_len_at, len(d) // 8), MFE,
     lambda d: f"kv[{kv(d, 'tokenizer.ggml.tokens').index}] 'tokenizer.ggml.tokens' array length",
     "left in the file"),
    ("5-array-count-over-cap", "f32",
     lambda d: patch_u64(d, kv(d, "tokenizer.ggml.tokens").array_len_at, 2 ** 64 - 1), MFE,
     lambda d: f"kv[{kv(d, 'tokenizer.ggml.tokens').index}] 'tokenizer.ggml.tokens' array length", "at most"),
    ("5-array-nested-too-deep", "f32",
     lambda d: splice_kv(d, encode_kv("x.deep", VT.ARRAY, encode_array(VT.ARRAY, 1, encode_array(
         VT.ARRAY, 1, encode_array(VT.UINT8, 1, b"\1"))))), MFE,
     lambda d: f"kv[{len(gguf_layout(d).kvs)}] 'x.deep'[0] array element type", "nested at most 2"),
    ("5-array-of-arrays-count-over-cap", "f32",
     lambda d: splice_kv(d, encode_kv("x.many", VT.ARRAY, encode_array(
         VT.ARRAY, gguf_file.MAX_NESTED_ARRAY_LEN + 1, encode_array(VT.UINT8, 0, b"") * 5000))), MFE,
     lambda d: f"kv[{len(gguf_layout(d).kvs)}] 'x.many' array length", "at most 4096"),
    # 6. unknown value type; unknown tensor type
    ("6-unknown-value-type", "f32", lambda d: patch_u32(d, kv(d, "general.name").type_at, 13), MFE,
     lambda d: f"kv[{kv(d, 'general.name').index}] 'general.name' type", "unknown type 13"),
    ("6-unknown-value-type-max", "f32", lambda d: patch_u32(d, kv(d, "general.name").type_at, -1), MFE,
     lambda d: f"kv[{kv(d, 'general.name').index}] 'general.name' type", "unknown type"),
    ("6-unknown-array-element-type", "f32",
     lambda d: patch_u32(d, kv(d, "tokenizer.ggml.tokens").value_at, 99), MFE,
     lambda d: f"kv[{kv(d, 'tokenizer.ggml.tokens').index}] 'tokenizer.ggml.tokens' array element type",
     "unknown type 99"),
    ("6-bool-not-0-or-1", "f32", lambda d: patch_bytes(d, kv(d, "tokenizer.ggml.add_bos_token").value_at, b"\7"),
     MFE, lambda d: f"kv[{kv(d, 'tokenizer.ggml.add_bos_token').index}] 'tokenizer.ggml.add_bos_token'", "bool"),
    ("6-unknown-tensor-type", "f32", lambda d: patch_u32(d, ti(d, "blk.0.attn_q.weight").type_at, 200), UNS,
     "tensor 'blk.0.attn_q.weight' type", "unknown ggml tensor type 200"),
    ("6-removed-tensor-type", "f32", lambda d: patch_u32(d, ti(d, "blk.0.attn_q.weight").type_at, 4), UNS,
     "tensor 'blk.0.attn_q.weight' type", "unknown ggml tensor type 4"),
    # 7. duplicate tensor names; over-long names
    ("7-duplicate-tensor-name", "f32",
     lambda d: patch_bytes(d, ti(d, "blk.0.attn_k.weight").name_at, b"blk.0.attn_q.weight"), MFE,
     lambda d: f"tensor[{ti(d, 'blk.0.attn_k.weight').index}] name", "again"),
    ("7-tensor-name-too-long", "f32", lambda d: rename_tensor(d, "output_norm.weight", "x" * 64), MFE,
     lambda d: f"tensor[{ti(d, 'output_norm.weight').index}] name length", "at most 63"),
    ("7-tensor-name-empty", "f32", lambda d: rename_tensor(d, "output_norm.weight", ""), MFE,
     lambda d: f"tensor[{ti(d, 'output_norm.weight').index}] name", "non-empty"),
    # 8. more than 4 dimensions; zero or negative dimensions
    ("8-five-dims", "f32", lambda d: patch_u32(d, ti(d, "blk.0.ffn_up.weight").n_dims_at, 5), MFE,
     "tensor 'blk.0.ffn_up.weight' n_dims", "found 5"),
    ("8-zero-n-dims", "f32", lambda d: patch_u32(d, ti(d, "blk.0.ffn_up.weight").n_dims_at, 0), MFE,
     "tensor 'blk.0.ffn_up.weight' n_dims", "found 0"),
    ("8-zero-dim", "f32", lambda d: patch_u64(d, ti(d, "blk.0.ffn_up.weight").dims_at[1], 0), MFE,
     "tensor 'blk.0.ffn_up.weight' shape", "ne[1] = 0"),
    ("8-negative-dim", "f32", lambda d: patch_u64(d, ti(d, "blk.0.ffn_up.weight").dims_at[0], -32), MFE,
     "tensor 'blk.0.ffn_up.weight' shape", "ne[0] = -32"),
    # 9. element count / byte size overflow (quantized too); row length not a block multiple
    ("9-element-count-overflow", "f32",
     lambda d: patch_u64(patch_u64(d, ti(d, "blk.0.ffn_up.weight").dims_at[0], 2 ** 40),
                         ti(d, "blk.0.ffn_up.weight").dims_at[1], 2 ** 40), MFE,
     "tensor 'blk.0.ffn_up.weight' shape", "element count"),
    ("9-byte-size-overflow", "f32",
     lambda d: patch_u64(patch_u64(d, ti(d, "blk.0.ffn_up.weight").dims_at[0], 2 ** 61),
                         ti(d, "blk.0.ffn_up.weight").dims_at[1], 2), MFE,
     "tensor 'blk.0.ffn_up.weight' shape", "byte size"),
    ("9-quantized-byte-size-overflow", "q8_0",
     lambda d: patch_u64(patch_u64(d, ti(d, "blk.0.ffn_up.weight").dims_at[0], 2 ** 63 - 32),
                         ti(d, "blk.0.ffn_up.weight").dims_at[1], 1), MFE,
     "tensor 'blk.0.ffn_up.weight' shape", "byte size"),
    ("9-row-not-block-multiple", "q8_0", lambda d: patch_u64(d, ti(d, "blk.0.ffn_up.weight").dims_at[0], 48),
     MFE, "tensor 'blk.0.ffn_up.weight' shape", "multiple of Q8_0's block size 32"),
    # 10. alignment zero, not a power of two, absurd, wrong type
    ("10-alignment-zero", "aligned", lambda d: patch_u32(d, kv(d, "general.alignment").value_at, 0), MFE,
     lambda d: f"kv[{kv(d, 'general.alignment').index}] 'general.alignment'", "found 0"),
    ("10-alignment-not-pow2", "aligned", lambda d: patch_u32(d, kv(d, "general.alignment").value_at, 48), MFE,
     lambda d: f"kv[{kv(d, 'general.alignment').index}] 'general.alignment'", "power of two"),
    ("10-alignment-absurd", "aligned", lambda d: patch_u32(d, kv(d, "general.alignment").value_at, 1 << 21),
     MFE, lambda d: f"kv[{kv(d, 'general.alignment').index}] 'general.alignment'", "found 2097152"),
    ("10-alignment-wrong-type", "aligned",
     lambda d: patch_u32(d, kv(d, "general.alignment").type_at, VT.INT32), MFE,
     lambda d: f"kv[{kv(d, 'general.alignment').index}] 'general.alignment'", "UINT32"),
    # 11. tensor data offset misaligned, overlapping, past EOF
    ("11-offset-misaligned", "f32",
     lambda d: patch_u64(d, ti(d, "blk.0.ffn_up.weight").offset_at, ti(d, "blk.0.ffn_up.weight").rel_offset + 4),
     MFE, "tensor 'blk.0.ffn_up.weight' offset", "multiple of the alignment 32"),
    ("11-offset-misaligned-custom-alignment", "aligned",
     lambda d: patch_u64(d, ti(d, "blk.0.ffn_up.weight").offset_at, ti(d, "blk.0.ffn_up.weight").rel_offset + 32),
     MFE, "tensor 'blk.0.ffn_up.weight' offset", "multiple of the alignment 64"),
    ("11-offset-overlap", "f32", lambda d: patch_u64(d, ti(d, "output_norm.weight").offset_at, 64), MFE,
     "tensor 'output_norm.weight' offset", "overlap"),
    ("11-offset-past-eof", "f32",
     lambda d: patch_u64(d, ti(d, "output_norm.weight").offset_at, ti(d, "output_norm.weight").rel_offset + 2 ** 20),
     MFE, "tensor 'output_norm.weight' offset", "past the end"),
    ("11-offset-negative", "f32", lambda d: patch_u64(d, ti(d, "output_norm.weight").offset_at, -32), MFE,
     "tensor 'output_norm.weight' offset", "non-negative"),
    # 12. total data size overflow: every tensor fits alone, all together do not
    ("12-total-data-size", "f32", lambda d: _add_tensor_copies(d, 1), MFE, "tensor data size", "in all"),
    ("12-total-data-size-many", "f32", lambda d: _add_tensor_copies(d, 1000), MFE, "tensor data size", "in all"),
]


def _add_tensor_copies(d: bytes, n: int) -> bytes:
    """Adds n more tensor infos that reuse token_embd.weight's shape, type and offset."""
    lay = gguf_layout(d)
    t = lay.tensors["token_embd.weight"]
    rest = d[t.n_dims_at:t.end]
    extra = b"".join(encode_string(f"copy{i}.weight") + rest for i in range(n))
    return splice_header(d, lay.header_end, lay.header_end, extra, tensor_delta=n)


@pytest.fixture(params=["python-walk", "native-walk"])
def walk(request, monkeypatch):
    """String arrays walked in Python, or by neon/gguf_walk.c for every array (by default only
    arrays of 1024+ strings go native): both must accept and reject the same files, with the
    same errors (the native walk leaves a malformed array to the Python one to name)."""
    if request.param == "native-walk":
        assert gguf_file._native_walk(b"\0" * 8, 8, 0, 0) is not None, "the native library does not load"
        monkeypatch.setattr(gguf_file, "_NATIVE_WALK_MIN", 0)
    return request.param


@pytest.mark.parametrize("base,corrupt,exc,field,msg", [pytest.param(*c[1:], id=c[0]) for c in CASES])
def test_malformed(bases, tmp_path, base, corrupt, exc, field, msg, walk):
    data = bases[base]
    expected_field = field(data) if callable(field) else field
    bad = corrupt(data)
    assert bad != data
    path = tmp_path / "bad.gguf"
    path.write_bytes(bad)
    t0 = time.perf_counter()
    with pytest.raises(ModelFormatError) as ei:
        read_gguf(path)
    elapsed = time.perf_counter() - t0
    err = ei.value
    assert isinstance(err, exc), f"expected {exc.__name__}, got {type(err).__name__}: {err}"
    if exc is ModelFormatError:
        assert not isinstance(err, UnsupportedModelError), f"malformed, not unsupported: {err}"
    assert err.path == str(path)
    assert err.field == expected_field, str(err)
    assert msg in err.message, str(err)
    assert str(path) in str(err) and expected_field in str(err)
    assert elapsed < TIME_LIMIT_S, f"{elapsed:.3f} s"


def test_big_endian_file_written_by_gguf(tmp_path):
    path = tmp_path / "x.gguf"
    path.write_bytes(big_endian_file(tmp_path))
    with pytest.raises(UnsupportedModelError) as ei:
        read_gguf(path)
    assert ei.value.field == "version" and "byte-swapped" in ei.value.message


def test_missing_file(tmp_path):
    with pytest.raises(ModelNotFoundError):
        read_gguf(tmp_path / "nope.gguf")


# ---------------------------------------------------------------------------------------------
# boundaries that must still parse


def test_boundaries_accepted(bases, tmp_path):
    d = bases["f32"]
    # a 63-byte tensor name (GGML_MAX_NAME - 1)
    ok = rename_tensor(d, "output_norm.weight", "y" * 63)
    # an array of arrays (depth 2) and an empty array
    ok = splice_kv(ok, encode_kv("x.nested", VT.ARRAY, encode_array(VT.ARRAY, 2, encode_array(
        VT.INT32, 2, struct.pack("<ii", 1, -2)) + encode_array(VT.INT32, 0, b""))))
    ok = splice_kv(ok, encode_kv("x.empty", VT.ARRAY, encode_array(VT.STRING, 0, b"")))
    path = tmp_path / "ok.gguf"
    path.write_bytes(ok)
    g = read_gguf(path)
    assert "y" * 63 in g.tensors
    nested = g.metadata["x.nested"]
    assert [a.tolist() for a in nested] == [[1, -2], []]
    assert g.metadata_types["x.nested"] == (VT.ARRAY, VT.ARRAY, VT.INT32)
    assert g.metadata["x.empty"] == [] and g.metadata_types["x.empty"] == (VT.ARRAY, VT.STRING)


def test_alignment_honoured(bases, tmp_path):
    path = tmp_path / "a.gguf"
    path.write_bytes(bases["aligned"])
    g = read_gguf(path)
    assert g.alignment == 64 and g.data_offset % 64 == 0
    assert all(t.offset % 64 == 0 for t in g.tensors.values())


# ---------------------------------------------------------------------------------------------
# valid synthetic files


def _compare_with_gguf_reader(g, path, keys):
    r = gguf.GGUFReader(path)
    assert list(g.tensors) == [t.name for t in r.tensors]
    for t in r.tensors:
        info = g.tensors[t.name]
        assert info.ggml_type == t.tensor_type
        assert info.shape == tuple(int(x) for x in t.shape)
        assert info.offset == t.data_offset
        assert info.nbytes == t.n_bytes
        assert info.n_elements == t.n_elements
    assert g.data_offset == r.data_offset and g.alignment == r.alignment
    fields = {k: f for k, f in r.fields.items() if not k.startswith("GGUF.")}
    assert list(g.metadata) == list(fields)
    for k in keys:
        f = fields[k]
        assert g.metadata_types[k] == tuple(f.types), k
        want = f.contents()
        got = g.metadata[k]
        if isinstance(got, np.ndarray):
            assert got.tolist() == list(want), k
        elif isinstance(got, float):
            assert got == pytest.approx(want), k
        else:
            assert got == want, k
    return r


SYNTH = [
    pytest.param(dict(tensor_type=QT.F32), id="F32"),
    pytest.param(dict(tensor_type=QT.F16), id="F16"),
    pytest.param(dict(tensor_type=QT.Q8_0), id="Q8_0"),
    pytest.param(dict(tensor_type=QT.Q4_0), id="Q4_0"),
    pytest.param(dict(tensor_type=QT.Q4_1), id="Q4_1"),
    pytest.param(dict(arch="qwen2", tensor_type=QT.Q8_0, tied_embeddings=False), id="qwen2-bias-untied"),
]


@pytest.mark.parametrize("kw", SYNTH)
def test_synthetic_valid(tmp_path, kw, walk):
    m = write_tiny_model(tmp_path / "m.gguf", **kw)
    g = read_gguf(m.path)
    arch = m.arch
    assert g.version == 3 and g.metadata["general.architecture"] == arch
    for key, want in {"block_count": m.n_layers, "embedding_length": m.d_model,
                      "feed_forward_length": m.d_ff, "attention.head_count": m.n_heads,
                      "attention.head_count_kv": m.n_kv_heads, "rope.dimension_count": m.head_dim}.items():
        assert g.metadata[f"{arch}.{key}"] == want
    assert g.metadata["tokenizer.ggml.tokens"] == m.tokens
    assert g.metadata["tokenizer.ggml.merges"] == m.merges
    assert g.metadata["tokenizer.ggml.add_bos_token"] is False
    tt = g.metadata["tokenizer.ggml.token_type"]
    assert tt.dtype == np.int32 and not tt.flags.writeable and (tt[:3] == 3).all()
    _compare_with_gguf_reader(g, m.path, list(g.metadata))
    assert set(g.tensors) == set(m.weights)
    assert ("blk.0.attn_q.bias" in g.tensors) == (arch == "qwen2")
    assert ("output.weight" in g.tensors) == (not kw.get("tied_embeddings", True))
    for name, w in m.weights.items():
        info = g.tensors[name]
        v = tensor_view(g, info)
        assert not v.flags.writeable and isinstance(v, np.memmap)
        if w.ndim == 1 or m.tensor_type == QT.F32:
            assert info.ggml_type == QT.F32 and v.dtype == np.float32
            np.testing.assert_array_equal(v, w)
        elif m.tensor_type == QT.F16:
            np.testing.assert_array_equal(v, w.astype(np.float16))
        else:
            assert v.dtype == np.uint8 and v.shape[0] == w.shape[0]
            deq = gguf.quants.dequantize(np.asarray(v), info.ggml_type)
            np.testing.assert_allclose(deq, w, atol=0.02 if m.tensor_type != QT.Q8_0 else 0.002)
    assert g._cache["memmap"] is not None  # opened once, reused


def test_omit(tmp_path):
    m = write_tiny_model(tmp_path / "m.gguf", **SMALL, omit=("blk.1.ffn_down.weight", "llama.block_count"))
    g = read_gguf(m.path)
    assert "blk.1.ffn_down.weight" not in g.tensors and "llama.block_count" not in g.metadata


def test_tensor_view_rejects_foreign_info(tmp_path, bases):
    (tmp_path / "a.gguf").write_bytes(bases["f32"])
    g = read_gguf(tmp_path / "a.gguf")
    info = g.tensors["output_norm.weight"]
    bogus = type(info)(info.name, info.ggml_type, info.shape, 0, info.nbytes, info.n_elements)
    with pytest.raises(ValueError):
        tensor_view(g, bogus)


# ---------------------------------------------------------------------------------------------
# the real model


@pytest.mark.model
def test_real_model_matches_gguf_reader(real_model_path):
    REAL_MODEL = real_model_path
    t0 = time.perf_counter()
    g = read_gguf(REAL_MODEL)
    elapsed = time.perf_counter() - t0
    assert elapsed < 1.0, f"header walk took {elapsed:.3f} s"  # ~0.05-0.1 s; GGUFReader takes seconds
    r = _compare_with_gguf_reader(g, REAL_MODEL, [
        "general.architecture", "llama.block_count", "llama.embedding_length", "llama.rope.freq_base",
        "llama.attention.layer_norm_rms_epsilon", "tokenizer.ggml.model", "tokenizer.ggml.tokens",
        "tokenizer.ggml.token_type", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.add_bos_token",
        "tokenizer.chat_template", "general.languages"])
    assert len(g.metadata["tokenizer.ggml.merges"]) == len(r.fields["tokenizer.ggml.merges"].data)
    assert g.metadata["tokenizer.ggml.merges"][:100] == r.fields["tokenizer.ggml.merges"].contents()[:100]
    norm = next(t for t in r.tensors if t.name == "output_norm.weight")
    np.testing.assert_array_equal(tensor_view(g, g.tensors["output_norm.weight"]), norm.data)
    emb = next(t for t in r.tensors if t.name == "token_embd.weight")
    np.testing.assert_array_equal(tensor_view(g, g.tensors["token_embd.weight"]), emb.data)
