"""requant.py: conversions of one matrix (bit-exact with quant.quantize for the GGUF types, the
runtime int8/int4 formats, SQNR), the GGUF rewrite (metadata and untouched tensors verbatim,
requantized tensors equal to quantize(dequantize(source)), size predicted before writing, atomic
write), its typed errors, and plan_formats."""
from __future__ import annotations

import math
import os
import struct
import sys
from pathlib import Path

import gguf
import gguf.quants
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf import GGUFValueType as VT

sys.path.insert(0, str(Path(__file__).parent))
from synthetic import encode_array, encode_kv, gguf_layout, splice_header, write_tiny_model  # noqa: E402

from edgellm import quant, requant  # noqa: E402
from edgellm.errors import ConfigError, ModelFormatError  # noqa: E402
from edgellm.model.loader import open_model  # noqa: E402
from edgellm.requant import (  # noqa: E402
    FORMATS, GGUF_FORMATS, GGUF_TYPE_FOR, convert, plan_formats, requantize_gguf, sqnr_db, unpack_int4,
)

SMALL = dict(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, d_ff=128)


def gaussian(rows=64, cols=256, seed=0):
    return np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)


# ---------------------------------------------------------------------------------------------
# conversions of one matrix


@pytest.mark.parametrize("fmt", list(GGUF_FORMATS))
def test_gguf_conversions_are_quant_quantize_bit_for_bit(fmt):
    w = gaussian(seed=1)
    w[0, :32] = 0.0  # an all-zero block: scale 0, no NaN
    qt = GGUF_FORMATS[fmt]
    c = convert(w, fmt)
    np.testing.assert_array_equal(c.data, quant.quantize(w, qt))
    theirs = np.ascontiguousarray(gguf.quants.quantize(w, qt)).view(np.uint8).reshape(w.shape[0], -1)
    np.testing.assert_array_equal(c.data, theirs)
    np.testing.assert_array_equal(c.dequantized, quant.dequantize(c.data.reshape(-1), qt, w.shape))
    assert c.scales is None and c.nbytes == w.shape[0] * quant.bytes_per_row(qt, w.shape[1])
    assert np.isfinite(c.dequantized).all()


def test_int8_is_symmetric_per_output_channel():
    w = gaussian(seed=2)
    w[3] = 0.0
    w[5] *= 100.0  # one loud channel must not coarsen the others
    c = convert(w, "int8")
    assert c.data.dtype == np.int8 and c.data.shape == w.shape and c.scales.shape == (w.shape[0],)
    np.testing.assert_array_equal(c.dequantized, c.data.astype(np.float32) * c.scales[:, None])
    assert np.abs(c.data).max() <= 127
    live = np.abs(w).max(axis=1) > 0
    assert (np.abs(c.data[live]).max(axis=1) == 127).all()      # each row uses its full range
    assert (c.data[3] == 0).all() and c.scales[3] == 0
    per_row = [sqnr_db(w[i], c.dequantized[i]) for i in range(w.shape[0]) if live[i]]
    assert min(per_row) > 38.0


@pytest.mark.parametrize("g", [32, 64, 128])
def test_int4_groups_are_symmetric_along_k(g):
    w = gaussian(seed=3)
    w[0, :g] = 0.0
    c = convert(w, f"int4-{g}")
    n, k = w.shape
    assert c.data.dtype == np.uint8 and c.data.shape == (n, k // 2)
    assert c.scales.dtype == np.float16 and c.scales.shape == (n, k // g)
    codes = unpack_int4(c.data)
    assert codes.min() >= -7 and codes.max() <= 7
    want = codes.astype(np.float32) * np.repeat(c.scales.astype(np.float32), g, axis=1)
    np.testing.assert_array_equal(c.dequantized, want)
    assert (c.dequantized[0, :g] == 0).all()
    # every code is the nearest level of its group's scale (up to the fp16 scale's clip at +-7)
    s = np.repeat(c.scales.astype(np.float32), g, axis=1)
    assert (np.abs(w - c.dequantized) <= s * 0.5 + 1e-6 + np.abs(w) * 1e-3).all()


def test_sqnr_db_definition():
    w = np.ones(100, np.float32)
    assert sqnr_db(w, w) == math.inf
    assert sqnr_db(w, w * np.float32(0.9)) == pytest.approx(20.0, abs=1e-4)
    assert sqnr_db(np.zeros(4, np.float32), np.ones(4, np.float32)) == -math.inf
    with pytest.raises(ValueError):
        sqnr_db(w, w[:10])


def test_sqnr_on_gaussian_is_sane_and_monotone_in_bits():
    w = gaussian(rows=128, cols=512, seed=4)
    s = {f: convert(w, f).sqnr_db for f in FORMATS}
    assert s["f32"] == math.inf
    assert s["f16"] > 60.0
    assert s["q8_0"] > 35.0 and s["int8"] > 35.0
    assert 18.0 < s["q4_0"] < 24.0 and 18.0 < s["int4-32"] < 24.0
    assert s["f32"] > s["f16"] > s["q8_0"] > s["q4_1"] > s["q4_0"]
    assert s["q8_0"] > s["int8"] > s["int4-32"] > s["int4-64"] > s["int4-128"]   # finer groups, less error
    # bits per weight track the same order
    b = {f: convert(w, f).nbytes for f in FORMATS}
    assert b["f32"] > b["f16"] > b["q8_0"] > b["int8"] > b["q4_1"] > b["q4_0"] == b["int4-32"]
    assert b["int4-32"] > b["int4-64"] > b["int4-128"]


def test_convert_rejects_bad_format_and_k():
    w = gaussian(rows=4, cols=48)
    with pytest.raises(ConfigError, match="q5_k"):
        convert(w, "q5_k")
    with pytest.raises(ConfigError, match=r"my\.w.*K = 48"):
        convert(w, "q8_0", name="my.w")
    with pytest.raises(ConfigError, match="K = 48"):
        convert(w, "int4-32")
    assert convert(w, "int8").sqnr_db > 35.0       # per channel: any K
    assert convert(w, "f16").data.shape == (4, 96)


# ---------------------------------------------------------------------------------------------
# GGUF rewrite

FORMATS_TINY = {
    "blk.0.ffn_down.weight": "q8_0",
    "blk.1.ffn_gate.weight": "q4_0",
    "blk.1.attn_q.weight": "int8",         # -> Q8_0
    "blk.0.attn_k.weight": "f16",
    "token_embd.weight": "int4-32",        # -> Q4_0 (tied: the head too)
    "blk.0.attn_norm.weight": "f16",       # a vector may become F16
    "blk.1.ffn_up.weight": "q4_1",         # already Q4_1: copied as stored
}


def _with_odd_metadata(path: Path) -> None:
    """Adds keys whose types GGUFWriter would not preserve from Python values: an empty array,
    a nested array of UINT16, a UINT64 and a FLOAT64 scalar, an INT8 array."""
    data = path.read_bytes()
    lay = gguf_layout(data)
    new = (encode_kv("test.empty", VT.ARRAY, encode_array(VT.UINT32, 0, b""))
           + encode_kv("test.nested_u16", VT.ARRAY, encode_array(
               VT.ARRAY, 2, encode_array(VT.UINT16, 2, struct.pack("<2H", 1, 65535))
               + encode_array(VT.UINT16, 1, struct.pack("<H", 7))))
           + encode_kv("test.u64", VT.UINT64, struct.pack("<Q", 1 << 40))
           + encode_kv("test.f64", VT.FLOAT64, struct.pack("<d", math.pi))
           + encode_kv("test.i8s", VT.ARRAY, encode_array(VT.INT8, 3, struct.pack("<3b", -1, 0, 5))))
    path.write_bytes(splice_header(data, lay.kv_end, lay.kv_end, new, kv_delta=5))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("requant")
    m = write_tiny_model(d / "src.gguf", tensor_type=QT.Q4_1, seed=7, **SMALL,
                         extra_metadata={"test.f32s": ([0.1, -2.5, 3.0], VT.ARRAY, VT.FLOAT32),
                                         "test.bools": ([True, False], VT.ARRAY, VT.BOOL)})
    _with_odd_metadata(Path(m.path))
    calls = []
    rep = requantize_gguf(m.path, d / "dst.gguf", FORMATS_TINY, progress=lambda a, b: calls.append((a, b)))
    return m, rep, calls


def _meta_equal(a, b):
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(_meta_equal(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def test_rewrite_keeps_metadata_with_types(tiny):
    m, rep, _ = tiny
    src, dst = open_model(m.path), open_model(rep.dst)
    assert list(src.metadata) == list(dst.metadata)                       # same keys, same order
    assert src.gguf.metadata_types == dst.gguf.metadata_types
    for k in src.metadata:
        assert _meta_equal(src.metadata[k], dst.metadata[k]), k
    assert dst.metadata["test.u64"] == 1 << 40 and len(dst.metadata["test.empty"]) == 0
    assert dst.gguf.metadata_types["test.nested_u16"] == (VT.ARRAY, VT.ARRAY, VT.UINT16)
    assert dst.tokenizer.encode("hello world") == src.tokenizer.encode("hello world")


def test_rewrite_tensors(tiny):
    m, rep, _ = tiny
    src, dst = open_model(m.path), open_model(rep.dst)
    assert list(src.gguf.tensors) == list(dst.gguf.tensors)
    for name, info in src.gguf.tensors.items():
        out = dst.gguf.tensors[name]
        assert out.shape == info.shape
        fmt = FORMATS_TINY.get(name)
        if fmt is None or GGUF_TYPE_FOR[fmt] == info.ggml_type:
            assert out.ggml_type == info.ggml_type
            assert bytes(src.raw(name)) == bytes(dst.raw(name)), name         # verbatim
            continue
        qt = GGUF_TYPE_FOR[fmt]
        assert out.ggml_type == qt, name
        w = quant.dequantize(src.raw(name), info.ggml_type, tuple(reversed(info.shape)))
        want = quant.quantize(w, qt).reshape(-1)
        assert bytes(np.ascontiguousarray(dst.raw(name)).view(np.uint8).reshape(-1)) == want.tobytes(), name


def test_rewrite_report(tiny):
    m, rep, calls = tiny
    n = len(rep.tensors)
    assert calls == [(i, n) for i in range(1, n + 1)]
    assert rep.predicted_size == rep.actual_size == os.path.getsize(rep.dst)
    by = {t.name: t for t in rep.tensors}
    assert {t.name for t in rep.converted} == set(FORMATS_TINY)
    src, dst = open_model(m.path), open_model(rep.dst)
    for name, fmt in FORMATS_TINY.items():
        t = by[name]
        assert t.requested == fmt and t.to_type == GGUF_TYPE_FOR[fmt].name
        assert t.bytes_before == src.gguf.tensors[name].nbytes and t.bytes_after == dst.gguf.tensors[name].nbytes
        if name == "blk.1.ffn_up.weight":
            assert t.sqnr_db == math.inf and not t.requantized and "copied" in t.note
            continue
        shape = tuple(reversed(src.gguf.tensors[name].shape))
        a = quant.dequantize(src.raw(name), src.tensor_type(name), shape)
        b = quant.dequantize(dst.raw(name), dst.tensor_type(name), shape)
        assert t.sqnr_db == pytest.approx(sqnr_db(a, b), rel=1e-9)
        assert t.requantized
    assert by["blk.1.attn_q.weight"].note == "int8 written as Q8_0"
    assert {f for f, _, _ in rep.mapped} == {"int8", "int4-32"}
    assert all(t.sqnr_db == math.inf and t.requested is None for t in rep.tensors if t.name not in FORMATS_TINY)
    text = requant.format_report(rep)
    assert "int4-32 written as Q4_0" in text and str(rep.actual_size) in text


def test_rewrite_reads_with_gguf_reader(tiny):
    m, rep, _ = tiny
    r = gguf.GGUFReader(rep.dst)
    types = {t.name: t.tensor_type for t in r.tensors}
    for name, fmt in FORMATS_TINY.items():
        assert types[name] == GGUF_TYPE_FOR[fmt]
    src = gguf.GGUFReader(m.path)
    assert list(src.fields) == list(r.fields)
    for k, f in src.fields.items():
        if k.startswith("GGUF."):
            continue
        assert f.types == r.fields[k].types, k
        assert [bytes(p) for p in f.parts] == [bytes(p) for p in r.fields[k].parts], k
    q = r.tensors[[t.name for t in r.tensors].index("blk.0.ffn_down.weight")]
    deq = gguf.quants.dequantize(q.data, q.tensor_type)
    mine = quant.dequantize(open_model(rep.dst).raw("blk.0.ffn_down.weight"), QT.Q8_0, deq.shape)
    np.testing.assert_array_equal(deq, mine)


def test_rewrite_runs_in_edgellm(tiny):
    import edgellm

    m, rep, _ = tiny
    eng = edgellm.load(rep.dst, units=["reference"], n_ctx=64)
    out = eng.generate("hello world", max_tokens=4, temperature=0)
    assert isinstance(out, str)


def test_no_formats_is_a_byte_identical_copy(tmp_path):
    # the source was written by the same GGUFWriter, so a rewrite with nothing to convert must
    # reproduce it byte for byte (header, padding, data)
    m = write_tiny_model(tmp_path / "src.gguf", tensor_type=QT.Q8_0, **SMALL)
    rep = requantize_gguf(m.path, tmp_path / "dst.gguf", {})
    assert Path(rep.dst).read_bytes() == Path(m.path).read_bytes()
    assert rep.predicted_size == rep.actual_size and not rep.converted


def test_custom_alignment_is_kept(tmp_path):
    m = write_tiny_model(tmp_path / "src.gguf", **SMALL, extra_metadata={"general.alignment": 64})
    rep = requantize_gguf(m.path, tmp_path / "dst.gguf", {"blk.0.ffn_up.weight": "q4_1"})
    out = open_model(rep.dst)
    assert out.gguf.alignment == 64 and rep.predicted_size == rep.actual_size
    assert all((t.offset - out.gguf.data_offset) % 64 == 0 for t in out.gguf.tensors.values())


# ---------------------------------------------------------------------------------------------
# errors and interrupted writes


@pytest.fixture
def f32_src(tmp_path):
    return write_tiny_model(tmp_path / "src.gguf", **SMALL)


def _leftovers(d: Path, keep: set[str]) -> list[str]:
    return sorted(p.name for p in d.iterdir() if p.name not in keep)


@pytest.mark.parametrize("formats,match", [
    ({"blk.0.ffn_up.weight": "q5_k"}, r"formats\['blk\.0\.ffn_up\.weight'\].*'q5_k'"),
    ({"blk.0.ffn_upp.weight": "q8_0"}, r"'blk\.0\.ffn_upp\.weight' is not in .*similar: blk\.0\.ffn_up\.weight"),
    ({"blk.0.attn_q.weight": "int4-128"}, r"K = 64 .*block size 128"),
    ({"blk.0.attn_norm.weight": "q8_0"}, r"1-D tensor"),
])
def test_bad_requests_are_config_errors(f32_src, tmp_path, formats, match):
    with pytest.raises(ConfigError, match=match):
        requantize_gguf(f32_src.path, tmp_path / "dst.gguf", formats)
    assert _leftovers(tmp_path, {"src.gguf"}) == []


def test_k_not_multiple_of_block_names_tensor_and_k(tmp_path):
    m = write_tiny_model(tmp_path / "src.gguf", n_layers=1, d_model=48, n_heads=4, n_kv_heads=2, d_ff=96)
    with pytest.raises(ConfigError, match=r"blk\.0\.attn_q\.weight.*K = 48"):
        requantize_gguf(m.path, tmp_path / "dst.gguf", {"blk.0.attn_q.weight": "q8_0"})
    # f16 and the per-channel int8 -> Q8_0? Q8_0 needs K % 32 too: only f16/f32 pass
    requantize_gguf(m.path, tmp_path / "ok.gguf", {"blk.0.attn_q.weight": "f16"})
    with pytest.raises(ConfigError, match="K = 48"):
        requantize_gguf(m.path, tmp_path / "dst.gguf", {"blk.0.attn_q.weight": "int8"})


def test_loader_errors_pass_through(tmp_path, f32_src):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUX" + Path(f32_src.path).read_bytes()[4:])
    with pytest.raises(ModelFormatError, match="magic"):
        requantize_gguf(bad, tmp_path / "dst.gguf", {})
    with pytest.raises(ConfigError, match="must not be the source"):
        requantize_gguf(f32_src.path, f32_src.path, {})
    with pytest.raises(ConfigError, match="does not exist"):
        requantize_gguf(f32_src.path, tmp_path / "nodir" / "dst.gguf", {})


@pytest.mark.parametrize("exc", [RuntimeError("disk on fire"), KeyboardInterrupt()])
@pytest.mark.parametrize("existing", [False, True])
def test_interrupted_write_leaves_no_partial_file(f32_src, tmp_path, monkeypatch, exc, existing):
    dst = tmp_path / "dst.gguf"
    if existing:
        dst.write_bytes(b"previous contents")
    real = requant._Writer.write_tensor_data
    calls = []

    def flaky(self, tensor, *a, **k):
        calls.append(1)
        if len(calls) == 5:        # mid-data: header, metadata and four tensors already written
            raise exc
        return real(self, tensor, *a, **k)

    monkeypatch.setattr(requant._Writer, "write_tensor_data", flaky)
    with pytest.raises(type(exc)):
        requantize_gguf(f32_src.path, dst, {"blk.0.ffn_down.weight": "q4_0", "blk.1.ffn_down.weight": "q4_0"})
    assert len(calls) == 5
    assert _leftovers(tmp_path, {"src.gguf", "dst.gguf"}) == []       # no temporary left behind
    if existing:
        assert dst.read_bytes() == b"previous contents"
    else:
        assert not dst.exists()


def test_failing_conversion_leaves_no_partial_file(f32_src, tmp_path, monkeypatch):
    def boom(*a, **k):
        raise MemoryError("no room for the fp32 copy")

    monkeypatch.setattr(requant, "convert", boom)
    with pytest.raises(MemoryError):
        requantize_gguf(f32_src.path, tmp_path / "dst.gguf", {"blk.1.ffn_up.weight": "q8_0"})
    assert _leftovers(tmp_path, {"src.gguf"}) == []


# ---------------------------------------------------------------------------------------------
# plan -> tensor names


def _plan(table, default="gguf"):
    return lambda layer, op: table.get((layer, op), table.get(op, default))


def test_plan_formats_maps_ops_to_tensors(tmp_path):
    m = open_model(write_tiny_model(tmp_path / "m.gguf", tied_embeddings=False, **SMALL).path)
    got = plan_formats(m, _plan({"qkv": "int8", (1, "ffn_gate_up"): "int4-64", "ffn_down": "q8_0",
                                 "lm_head": "q4_0", "embedding": "f16", (0, "attn_out"): "q4_1"}))
    want = {}
    for i in range(2):
        want.update({f"blk.{i}.attn_{x}.weight": "int8" for x in "qkv"})
        want[f"blk.{i}.ffn_down.weight"] = "q8_0"
    want.update({"blk.1.ffn_gate.weight": "int4-64", "blk.1.ffn_up.weight": "int4-64",
                 "blk.0.attn_output.weight": "q4_1", "output.weight": "q4_0", "token_embd.weight": "f16"})
    assert got == want
    assert plan_formats(m.config, _plan({})) == {}          # a ModelConfig works too; "gguf" keeps
    assert set(got) <= set(m.gguf.tensors)


def test_plan_formats_tied_head_is_token_embd(tmp_path):
    m = open_model(write_tiny_model(tmp_path / "m.gguf", **SMALL).path)
    assert m.config.tied_embeddings
    asked = []

    def wf(layer, op):
        asked.append((layer, op))
        return "q8_0" if op == "lm_head" else "gguf"

    assert plan_formats(m, wf) == {"token_embd.weight": "q8_0"}
    assert (None, "lm_head") in asked and (None, "embedding") in asked and (0, "qkv") in asked
    assert plan_formats(m, _plan({"embedding": "q4_0"})) == {"token_embd.weight": "q4_0"}
    assert plan_formats(m, _plan({"embedding": "q4_0", "lm_head": "q4_0"})) == {"token_embd.weight": "q4_0"}
    with pytest.raises(ConfigError, match="ties"):
        plan_formats(m, _plan({"embedding": "f16", "lm_head": "q4_0"}))


def test_plan_formats_rejects_unknown_format(tmp_path):
    m = open_model(write_tiny_model(tmp_path / "m.gguf", **SMALL).path)
    with pytest.raises(ConfigError, match=r"layer 1 op 'ffn_down'.*'int3'"):
        plan_formats(m, _plan({(1, "ffn_down"): "int3"}))


def test_plan_to_file(tmp_path):
    m = write_tiny_model(tmp_path / "m.gguf", **SMALL)
    formats = plan_formats(open_model(m.path), _plan({"ffn_down": "int8", "ffn_gate_up": "int4-32"}))
    rep = requantize_gguf(m.path, tmp_path / "out.gguf", formats)
    out = open_model(rep.dst)
    assert out.tensor_type_counts == {"F32": 2 + 2 * 6, "Q8_0": 2, "Q4_0": 4}  # embd, out norm; 2 norms + q k v o
    assert rep.predicted_size == rep.actual_size


@pytest.mark.model
def test_real_model_ffn_recipe(real_model_path, tmp_path):
    """SmolLM2 (Q4_1): ffn_down -> q8_0, ffn_gate/up -> q4_0. The output loads in edgellm and
    the gguf package, its size is the predicted one, and the SQNR of each conversion is what the
    formats give on real weights (measured: Q8_0 44.8-45.4 dB, Q4_0 21.0-21.5 dB)."""
    src = open_model(real_model_path)
    recipe = {"ffn_down": "q8_0", "ffn_gate_up": "q4_0"}
    formats = plan_formats(src, lambda layer, op: recipe.get(op, "gguf"))
    assert len(formats) == 3 * src.config.n_layers
    rep = requantize_gguf(real_model_path, tmp_path / "out.gguf", formats)
    assert rep.predicted_size == rep.actual_size == os.path.getsize(rep.dst)
    out = open_model(rep.dst)
    n = src.config.n_layers
    assert out.tensor_type_counts == {"F32": src.tensor_type_counts["F32"], "Q8_0": 1 + n, "Q4_0": 2 * n,
                                      "Q4_1": src.tensor_type_counts["Q4_1"] - 3 * n}
    for t in rep.converted:
        assert (40.0 if t.to_type == "Q8_0" else 19.0) < t.sqnr_db < (50.0 if t.to_type == "Q8_0" else 24.0), t
    assert len(gguf.GGUFReader(rep.dst).tensors) == len(src.gguf.tensors)


def test_a_killed_writers_temporary_file_is_removed_by_the_next_write(tmp_path):
    """SIGTERM or the low-memory killer mid-requantize left a ~57 MiB `.NAME.XXXX.tmp` in the
    precision cache for good. Temporary names carry their writer's pid; the next write in the
    folder removes those whose writer is gone, whatever output they were for, and leaves a
    running writer's alone."""
    import subprocess
    m = write_tiny_model(tmp_path / "src.gguf", tensor_type=QT.Q8_0, **SMALL)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True).stdout.strip()
    orphan = tmp_path / f".dst.gguf.pid{dead}.abc123.tmp"
    orphan.write_bytes(b"x" * 1000)
    other = tmp_path / f".other.gguf.pid{dead}.abc123.tmp"
    other.write_bytes(b"z")
    live = tmp_path / f".dst.gguf.pid{os.getppid()}.def456.tmp"
    live.write_bytes(b"y")
    untagged = tmp_path / ".notes.tmp"
    untagged.write_bytes(b"w")
    rep = requantize_gguf(m.path, tmp_path / "dst.gguf", {})
    assert Path(rep.dst).is_file() and not orphan.exists() and not other.exists()
    assert live.exists() and untagged.exists()          # a running writer's; not a writer's at all


def test_the_next_write_leaves_a_users_own_dot_files_alone(tmp_path):
    """The orphan sweep matched '.pidN.' or '-pidN-' anywhere in a hidden name: quantize -o into a
    user's folder deleted their '.notes.pid999999.txt' and, with rmtree, a '.backup-pid999998-old'
    folder (from a helper's probe of the written GGUF files)."""
    import subprocess
    m = write_tiny_model(tmp_path / "src.gguf", tensor_type=QT.Q8_0, **SMALL)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True).stdout.strip()
    notes = tmp_path / f".notes.pid{dead}.txt"
    notes.write_text("mine")
    backup = tmp_path / f".backup-pid{dead}-old"
    backup.mkdir()
    (backup / "data").write_text("mine too")
    not_a_folder_we_make = tmp_path / f".x.pid{dead}.abc.tmp"
    not_a_folder_we_make.mkdir()
    requantize_gguf(m.path, tmp_path / "dst.gguf", {})
    assert notes.exists() and (backup / "data").exists() and not_a_folder_we_make.exists()


def test_a_full_disk_is_said_up_front_or_named(tmp_path, monkeypatch):
    """A full disk ended quantize with "69120 requested and 40640 written" and no path, ~40 MB in
    (from a helper's probe of the written GGUF files). The predicted size is checked against the
    free space first, and a short write still names the file and the likely cause."""
    import edgellm.requant as rq
    m = write_tiny_model(tmp_path / "src.gguf", tensor_type=QT.Q8_0, **SMALL)
    monkeypatch.setattr(rq, "_free_bytes", lambda d: 1000)
    with pytest.raises(ConfigError, match=r"dst.gguf: the file needs .* MiB but .* has 0.0 MiB free"):
        requantize_gguf(m.path, tmp_path / "dst.gguf", {})
    monkeypatch.setattr(rq, "_free_bytes", lambda d: None)

    def short_write(self, *a, **k):
        raise OSError("69120 requested and 40640 written")
    monkeypatch.setattr(rq._Writer, "write_tensor_data", short_write)
    with pytest.raises(ConfigError, match=r"dst.gguf: cannot write it: .*the disk is full or a file-size limit"):
        requantize_gguf(m.path, tmp_path / "dst.gguf", {})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src.gguf"]


def test_an_orphans_room_counts_as_free(tmp_path, monkeypatch):
    """The free-space check ran before the orphan sweep: a killed write's part file, often the
    room the new file needs, still counted as used (from a review of the day's change)."""
    import subprocess
    import edgellm.requant as rq
    m = write_tiny_model(tmp_path / "src.gguf", tensor_type=QT.Q8_0, **SMALL)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True).stdout.strip()
    orphan = tmp_path / f".dst.gguf.pid{dead}.abc123.tmp"
    orphan.write_bytes(b"x")
    monkeypatch.setattr(rq, "_free_bytes", lambda d: 0 if orphan.exists() else 1 << 40)
    requantize_gguf(m.path, tmp_path / "dst.gguf", {})
    assert (tmp_path / "dst.gguf").is_file() and not orphan.exists()


def test_the_report_lists_tensors_in_layer_order():
    """The file's text order put blk.10 before blk.9 (a CLI probe)."""
    names = ["blk.10.attn_q.weight", "blk.9.attn_q.weight", "blk.2.ffn_up.weight", "output.weight"]
    rep = requant.Report("a.gguf", "b.gguf", tuple(requant.TensorReport(n, "Q4_1", "Q8_0", "int8", 10, 20, 30.0)
                                                   for n in names), (), 100, 100)
    lines = [ln.split()[0] for ln in requant.format_report(rep).splitlines()[2:6]]
    assert lines == ["blk.2.ffn_up.weight", "blk.9.attn_q.weight", "blk.10.attn_q.weight", "output.weight"]
