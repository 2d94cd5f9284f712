"""The fused decode step and prefill chunk (neon/decode_step.c through backends/neon_fused.py)
against the per-op neon path they replace, on tiny synthetic models (F32, Q8_0, Q4_0, Q4_1; llama with GQA 2:1,
qwen2 with qkv bias, neox RoPE and MQA 4:1), with f16 and f32 KV pools.

Both paths run the same kernels in the same order on the same thread pool, so the bound (logits
NMSE <= 1e-10) is far looser than what is observed: 0.0, bit-identical logits, in every case
(the tests print it). The K/V rows the fused step writes are compared bit for bit with those
PoolSequence.write stored for the per-op path, and the fp16 rounding itself with numpy's
astype(float16) over a sweep of float32 bit patterns.

The installed library (edgellm/_neon_*.so, rebuilt by `pip install -e .`) is what runs: the
same one edgellm.load(units=["neon"]) uses.
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

import edgellm
from edgellm.backends import neon, neon_lib
from edgellm.backends.neon_fused import DecodeStep, DecodeStepError, ElLayer, ElMatrix, ElModelDims
from edgellm.kv.pool import KVPool
from tests.synthetic import write_tiny_model

ROOT = Path(__file__).resolve().parent.parent
BOUND = 1e-10          # logits NMSE, fused vs per-op
BT = 16                # KV block tokens: the decode runs below cross block boundaries
THREADS = 2
EINVAL, EUNSUPPORTED = -1, -3

MODELS = {
    # name: write_tiny_model arguments
    "llama-F32": dict(arch="llama", tensor_type=QT.F32),
    "llama-Q8_0": dict(arch="llama", tensor_type=QT.Q8_0),
    "llama-Q4_0": dict(arch="llama", tensor_type=QT.Q4_0),
    "llama-Q4_1": dict(arch="llama", tensor_type=QT.Q4_1),
    "qwen2-F32": dict(arch="qwen2", tensor_type=QT.F32, n_kv_heads=1),
    "qwen2-Q8_0": dict(arch="qwen2", tensor_type=QT.Q8_0, n_kv_heads=1),
    "qwen2-Q4_0": dict(arch="qwen2", tensor_type=QT.Q4_0, n_kv_heads=1),
    "qwen2-Q4_1": dict(arch="qwen2", tensor_type=QT.Q4_1, n_kv_heads=1),
}


@pytest.fixture(scope="module", autouse=True)
def installed_library():
    ok, why = neon.available()
    assert ok, f"the neon unit is unavailable: {why}"
    lib = neon._lib()
    newest = max(p.stat().st_mtime for p in (ROOT / "neon").glob("*.[ch]"))
    assert Path(lib.path).stat().st_mtime >= newest, \
        f"{lib.path} is older than neon/: rebuild it (pip install -e .)"
    return lib


_engines: dict[str, tuple] = {}


# beside MODELS, not in the tests parametrized over them: an FFN as wide as K = 576 (18 blocks a
# row, which the GEMV sums in another order than the GEMM tile)
WIDE = {"llama-Q4_1-wide": dict(arch="llama", tensor_type=QT.Q4_1, d_model=128, d_ff=576)}


def engine(name: str, tmp_path_factory):
    """(an engine with every op on neon: the per-op path, the model's neon.PreparedWeights), one
    per model, kept for the module."""
    if name not in _engines:
        path = tmp_path_factory.mktemp("fused") / f"{name}.gguf"
        write_tiny_model(path, **{"n_layers": 3, "d_model": 64, "n_heads": 4, "d_ff": 128, "seed": 3,
                                  "context_length": 1024, "n_kv_heads": 2, **{**MODELS, **WIDE}[name]})
        eng = edgellm.load(str(path), n_ctx=1024, units=["neon"], threads=THREADS)
        assert set(eng.runner.placement["decode"].values()) == {"neon"}, eng.runner.placement
        _engines[name] = eng, neon.prepare(eng.model)
    return _engines[name]


def nmse(got: np.ndarray, ref: np.ndarray) -> float:
    return float(np.mean((got.astype(np.float64) - ref) ** 2) / np.mean(ref.astype(np.float64) ** 2))


def fused_token(step: DecodeStep, w, runner, seq, token: int) -> np.ndarray:
    """One decode token the way the engine drives the fused step (w: neon.PreparedWeights;
    runner: the RoPE tables' owner); returns the logits."""
    pos = seq.n_tokens
    seq.reserve(1)
    x = neon.embedding(w.embedding, np.array([token]))
    x = step.run(x, pos, runner.cos[pos], runner.sin[pos], seq.pool, seq.block_table)
    seq.commit(pos + 1, [token])
    return neon.lm_head(neon.rmsnorm(x, w.output_norm, step.cfg.norm_eps), w.lm_head)[0]


def kv_rows(seq) -> tuple[np.ndarray, ...]:
    """The raw bytes of every committed K and V row: (positions, layers, bytes); an int8 pool's
    K and V scales of those rows too."""
    pool, n = seq.pool, seq.n_tokens
    p = np.arange(n)
    blk = np.asarray(seq.block_table)[p // pool.block_tokens]
    arrays = (pool.k, pool.v) + ((pool.k_scale, pool.v_scale) if pool.k_scale is not None else ())
    return tuple(np.ascontiguousarray(a[blk, :, p % pool.block_tokens]).reshape(n, pool.n_layers, -1).view(np.uint8)
                 for a in arrays)


class per_op:
    """Within the block, the runner takes its per-op path in every phase (the path the fused
    steps replace), whatever the placement."""

    def __init__(self, runner):
        self.runner = runner

    def __enter__(self):
        self.saved, self.runner._fused_phases = self.runner._fused_phases, set()

    def __exit__(self, *exc):
        self.runner._fused_phases = self.saved


def compare(model, precision: str, prompt: int, decode: int, seed: int = 0) -> float:
    """Prefill `prompt` random tokens per-op into two pools, then decode `decode` more: per-op in
    one (ModelRunner.forward with its fused steps off), fused in the other. Asserts the logits
    within BOUND and the K/V rows bit-identical; returns the worst logits NMSE."""
    eng, w = model
    r, cfg = eng.runner, eng.config
    step = DecodeStep.build(w, cfg)
    ids = np.random.default_rng(seed).integers(3, cfg.vocab_size, prompt + decode)
    n_blocks = -(-(prompt + decode) // BT)
    seqs = [KVPool(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, n_blocks, BT, precision).new_sequence()
            for _ in range(2)]
    for s in seqs:
        with per_op(r):
            r.forward(s, ids[:prompt])
    worst = 0.0
    for t in ids[prompt:]:
        with per_op(r):
            ref = r.forward(seqs[0], [t])
        got = fused_token(step, w, r, seqs[1], int(t))
        worst = max(worst, nmse(got, ref))
    assert worst <= BOUND
    for a, b in zip(kv_rows(seqs[0]), kv_rows(seqs[1]), strict=True):
        np.testing.assert_array_equal(b, a)
    return worst


@pytest.mark.parametrize("precision", ["f16", "f32", "int8"])
@pytest.mark.parametrize("name", list(MODELS))
def test_fused_step_equals_per_op_path(name, precision, tmp_path_factory):
    worst = compare(engine(name, tmp_path_factory), precision, prompt=20, decode=40)
    print(f"\n[{name} kv {precision}] worst logits NMSE fused vs per-op: {worst:.3g}")


@pytest.mark.parametrize("precision", ["f16", "f32", "int8"])
@pytest.mark.parametrize("name", ["llama-Q4_1", "qwen2-Q4_1", "llama-F32"])
def test_fused_prefill_chunks_equal_per_op_path(name, precision, tmp_path_factory):
    """Prefill through el_chunk_step in four calls (7 tokens; 64 after them; 30 in chunks of 8,
    ending in a 6-token tail; 300 in one chunk) against the per-op path: every position's logits
    within BOUND, the K/V rows bit-identical. The step runs a chunk's layers in row slices of 256
    (each attending to the K/V rows the slices before it stored), so its 300-token chunk is
    compared with per-op chunks of 256 and 44: the attention's work split, and with it its
    rounding, follows the number of query rows in a call."""
    eng, _ = engine(name, tmp_path_factory)
    r, cfg = eng.runner, eng.config
    assert "prefill" in r._fused_phases, r.placement
    ids = np.random.default_rng(7).integers(3, cfg.vocab_size, 7 + 64 + 30 + 300)
    n_blocks = -(-len(ids) // BT) + 1
    seqs = [KVPool(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, n_blocks, BT, precision).new_sequence()
            for _ in range(2)]
    worst = 0.0
    for lo, hi, chunk, ref_chunk in ((0, 7, None, None), (7, 71, None, None), (71, 101, 8, 8), (101, 401, 300, 256)):
        with per_op(r):
            ref = r.forward(seqs[0], ids[lo:hi], all_logits=True, chunk=ref_chunk)
        got = r.forward(seqs[1], ids[lo:hi], all_logits=True, chunk=chunk)
        worst = max(worst, nmse(got, ref))
    assert worst <= BOUND
    for a, b in zip(kv_rows(seqs[0]), kv_rows(seqs[1])):
        np.testing.assert_array_equal(b, a)
    print(f"\n[{name} kv {precision}] worst prefill logits NMSE fused vs per-op: {worst:.3g}")


@pytest.mark.parametrize("T", [129, 130, 200, 256, 257])
def test_fused_ffn_pieces_equal_per_op_path(T, tmp_path_factory):
    """A slice's FFN runs in pieces of 128 rows: chunks around those sizes give the per-op
    path's K/V bit for bit and its logits within BOUND (257 tokens: slices of 256 and 1, against
    per-op chunks of 256 and 1). On the wide FFN, a row on another kernel than the per-op
    path's would show."""
    eng, _ = engine("llama-Q4_1-wide", tmp_path_factory)
    r, cfg = eng.runner, eng.config
    ids = np.random.default_rng(T).integers(3, cfg.vocab_size, T)
    n_blocks = -(-T // BT) + 1
    # fp32 K/V: a last-bit difference in a row's FFN output shows in the next layer's K/V
    seqs = [KVPool(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, n_blocks, BT, "f32").new_sequence() for _ in range(2)]
    with per_op(r):
        ref = r.forward(seqs[0], ids, all_logits=True, chunk=256)
    got = r.forward(seqs[1], ids, all_logits=True, chunk=T)
    assert nmse(got, ref) <= BOUND
    for a, b in zip(kv_rows(seqs[0]), kv_rows(seqs[1])):
        np.testing.assert_array_equal(b, a)


def test_chunk_buffers_grow_to_the_largest_chunk_and_hand_back_the_old_ones(tmp_path_factory, monkeypatch):
    """The chunk buffers grow only when a chunk needs more, to the largest seen, and each growth
    hands the freed heap pages back to the OS (malloc_trim) before allocating."""
    from edgellm.backends import neon_fused

    eng, _ = engine("llama-Q4_1", tmp_path_factory)
    r, cfg = eng.runner, eng.config
    step = r._fused
    trims = []
    monkeypatch.setattr(neon_fused, "release_free_pages", lambda: trims.append(step._chunk_x.shape[0]) or True)
    step._chunk_x = np.empty((0, cfg.d_model), np.float32)    # as a fresh step
    step._chunk_scratch = np.empty(0, np.uint8)
    seq = KVPool(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, 8, BT).new_sequence()
    ids = np.random.default_rng(5).integers(3, cfg.vocab_size, 100)
    for lo, hi in ((0, 12), (12, 20), (20, 60), (60, 70)):      # 12, 8, 40, 10 tokens
        r.forward(seq, ids[lo:hi], chunk=64)
    assert trims == [0, 0] and step._chunk_x.shape[0] == 40     # grown at 12 and at 40, old ones gone first
    assert step._chunk_scratch.nbytes == step._lib.el_chunk_scratch(step._dims_p, 40)


@pytest.mark.parametrize("precision", ["f16", "int8"])
def test_fused_step_long_context(precision, tmp_path_factory):
    """Past 512 keys with 2 threads the attention kernel also splits the keys of each head and
    merges partial softmax states: the fused step takes the same branch."""
    worst = compare(engine("llama-Q4_1", tmp_path_factory), precision, prompt=530, decode=6)
    print(f"\n[llama-Q4_1 kv {precision}, 530+ keys] worst logits NMSE: {worst:.3g}")


@pytest.mark.parametrize("precision", ["f16", "int8"])
def test_fused_step_generic_twins(precision, tmp_path_factory):
    lib = neon._lib()
    lib.el_use_generic(1)
    try:
        worst = compare(engine("qwen2-Q4_0", tmp_path_factory), precision, prompt=20, decode=12, seed=1)
    finally:
        lib.el_use_generic(0)
    print(f"\n[qwen2-Q4_0 kv {precision} generic twins] worst logits NMSE: {worst:.3g}")


# ---- the fp16 rounding of the K/V store --------------------------------------------------------

def _f16_cases() -> np.ndarray:
    sweep = np.arange(0, 1 << 32, 4093, dtype=np.uint64).astype(np.uint32).view(np.float32)
    ulp = np.float32(2.0 ** -24)                      # the smallest fp16 subnormal
    special = np.array([
        0.0, -0.0, np.inf, -np.inf, 1.0, -1.0, 65504.0, 65519.99, 65520.0, -65520.0, 1e9,
        ulp, ulp / 2, ulp / 2 * np.float32(1.0000001), 3 * ulp / 2, 5 * ulp / 2, 2.0 ** -14, 2.0 ** -15,
        1.0 + 2.0 ** -11, 1.0 + 3 * 2.0 ** -11, 1.0 + 2.0 ** -11 + 2.0 ** -23,   # ties, and just past one
        2.0 ** -14 - 2.0 ** -25, 6.1e-5, 1e-8, -1e-8, 3.0e-45], dtype=np.float32)
    return np.concatenate([special, -special, sweep, [np.float32(0.1)] * 3])   # odd length: a scalar tail


@pytest.mark.parametrize("generic", [0, 1], ids=["native", "generic"])
def test_f16_store_rounds_like_numpy(generic):
    lib = neon._lib()
    x = np.ascontiguousarray(_f16_cases())
    y = np.empty(x.size, np.uint16)
    lib.el_use_generic(generic)
    try:
        assert lib.el_f32_to_f16(x.ctypes.data, y.ctypes.data, x.size) == 0
    finally:
        lib.el_use_generic(0)
    with np.errstate(over="ignore"):
        ref = x.astype(np.float16).view(np.uint16)
    nan = np.isnan(x)
    assert np.isnan(y[nan].view(np.float16)).all()
    bad = np.flatnonzero(y[~nan] != ref[~nan])
    assert bad.size == 0, [(float(x[~nan][i]), hex(y[~nan][i]), hex(ref[~nan][i])) for i in bad[:5]]


# ---- bad arguments --------------------------------------------------------------------------------

@pytest.fixture()
def rig(tmp_path_factory):
    """A built step, a pool with position 0 reserved, and the valid argument list of a call."""
    eng, w = engine("llama-Q8_0", tmp_path_factory)
    cfg = eng.config
    step = DecodeStep.build(w, cfg)
    pool = KVPool(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, 4, BT, "f16")
    seq = pool.new_sequence()
    seq.reserve(1)
    step._bind(pool)
    step._tbl[:1] = seq.block_table
    step._x[...] = 1.0
    step._rope[0], step._rope[1] = 1.0, 0.0
    args = dict(pool=None, layers=step._layers_p, n_layers=cfg.n_layers, dims=step._dims_p, x=step._x_p, pos=0,
                cos=step._cos_p, sin=step._sin_p, k=step._k_p, v=step._v_p, kv_type=neon_lib.EL_F16,
                table=step._tbl_p, n_table=1, bt=BT, n_blocks=pool.n_blocks, scratch=step._scratch_p,
                scratch_n=step._scratch_n)
    return step, pool, seq, args


def _call(lib, args: dict) -> int:
    return lib.el_decode_step(*args.values())


def _bad_dims(step, **change) -> ElModelDims:
    d = ElModelDims.from_buffer_copy(step._dims)
    for k, v in change.items():
        setattr(d, k, v)
    return d


def _bad_layers(step, edit) -> ctypes.Array:
    layers = (ElLayer * len(step._layers)).from_buffer_copy(step._layers)
    edit(layers)
    return layers


def test_bad_arguments_return_negative_codes_and_write_nothing(rig):
    step, pool, _, good = rig
    lib = neon._lib()
    x0, k0, v0 = step._x.copy(), pool.k.copy(), pool.v.copy()
    keep = []

    def dims(**c):
        keep.append(_bad_dims(step, **c))
        return ctypes.addressof(keep[-1])

    def layers(edit):
        keep.append(_bad_layers(step, edit))
        return ctypes.addressof(keep[-1])

    rows = (ctypes.c_int * 3)(64, 32, 16)     # qkv rows summing to 112, not 128
    keep.append(rows)
    cases = {
        "layers NULL": (dict(layers=None), EINVAL),
        "n_layers 0": (dict(n_layers=0), EINVAL),
        "n_layers -1": (dict(n_layers=-1), EINVAL),
        "dims NULL": (dict(dims=None), EINVAL),
        "x NULL": (dict(x=None), EINVAL),
        "pos -1": (dict(pos=-1), EINVAL),
        "pos INT_MAX": (dict(pos=2**31 - 1), EINVAL),
        "pos past the table": (dict(pos=BT), EINVAL),
        "cos NULL": (dict(cos=None), EINVAL),
        "sin NULL": (dict(sin=None), EINVAL),
        "k NULL": (dict(k=None), EINVAL),
        "v NULL": (dict(v=None), EINVAL),
        "kv int8": (dict(kv_type=neon_lib.EL_Q8_0), EUNSUPPORTED),
        "kv type -5": (dict(kv_type=-5), EUNSUPPORTED),
        "table NULL": (dict(table=None), EINVAL),
        "n_table 0": (dict(n_table=0), EINVAL),
        "block_tokens 0": (dict(bt=0), EINVAL),
        "n_blocks 0": (dict(n_blocks=0), EINVAL),
        "scratch NULL": (dict(scratch=None), EINVAL),
        "scratch short": (dict(scratch_n=step._scratch_n - 1), EINVAL),
        "x inside scratch": (dict(x=step._scratch_p + 64), EINVAL),
        "d 0": (dict(dims=dims(d=0)), EINVAL),
        "H % KVH": (dict(dims=dims(KVH=3)), EINVAL),
        "rope_dim odd": (dict(dims=dims(rope_dim=7)), EINVAL),
        "rope_dim > hd": (dict(dims=dims(rope_dim=32)), EINVAL),
        "rope_dim 0": (dict(dims=dims(rope_dim=0)), EINVAL),
        "neox 2": (dict(dims=dims(neox=2)), EINVAL),
        "eps -1": (dict(dims=dims(eps=-1.0)), EINVAL),
        "eps NaN": (dict(dims=dims(eps=float("nan"))), EINVAL),
        "hd 1024": (dict(dims=dims(H=1, KVH=1, hd=1024, rope_dim=2)), EUNSUPPORTED),
        "ff differs from the matrices": (dict(dims=dims(ff=96)), EINVAL),
        "attn_norm NULL": (dict(layers=layers(lambda L: setattr(L[1], "attn_norm", None))), EINVAL),
        "ffn_norm NULL": (dict(layers=layers(lambda L: setattr(L[2], "ffn_norm", None))), EINVAL),
        "wtype 7": (dict(layers=layers(lambda L: setattr(L[0].qkv, "wtype", 7))), EUNSUPPORTED),
        "n_seg 0": (dict(layers=layers(lambda L: setattr(L[0].down, "n_seg", 0))), EINVAL),
        "seg_ptr NULL": (dict(layers=layers(lambda L: setattr(L[2].gate_up, "seg_ptr", None))), EINVAL),
        "rows do not sum to N": (dict(layers=layers(lambda L: setattr(L[1].qkv, "seg_rows", ctypes.addressof(rows)))),
                                 EINVAL),
    }
    for what, (change, code) in cases.items():
        rc = _call(lib, {**good, **change})
        assert rc == code, f"{what}: expected {code}, got {rc}"
    block = int(step._tbl[0])
    for bad_id in (-1, pool.n_blocks):                  # block ids outside the arena
        step._tbl[0] = bad_id
        assert _call(lib, good) == EINVAL, bad_id
    step._tbl[0] = block
    assert np.array_equal(step._x, x0)
    assert np.array_equal(pool.k.view(np.uint16), k0.view(np.uint16))
    assert np.array_equal(pool.v.view(np.uint16), v0.view(np.uint16))
    # the valid call itself succeeds (the rig is sound) and writes position 0
    assert _call(lib, good) == 0
    assert pool.k.view(np.uint16)[block, :, 0].any()


def test_scratch_size_and_f16_entry_reject_bad_input(rig):
    step, *_ = rig
    lib = neon._lib()
    assert lib.el_decode_scratch(None) == 0
    bad = _bad_dims(step, KVH=3)
    assert lib.el_decode_scratch(ctypes.addressof(bad)) == 0
    assert lib.el_decode_scratch(step._dims_p) == step._scratch_n
    assert lib.el_f32_to_f16(None, None, 4) == EINVAL
    assert lib.el_f32_to_f16(None, None, 0) == 0


def test_python_side_refuses_what_it_cannot_run(rig, tmp_path_factory):
    step, pool, seq, _ = rig
    cfg = step.cfg
    x = np.ones((1, cfg.d_model), np.float32)
    c, s = np.ones(cfg.rope_dim // 2, np.float32), np.zeros(cfg.rope_dim // 2, np.float32)
    i8 = KVPool(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, 4, BT, "int8")
    i8.k_scale = i8.k_scale.astype(np.float64)                # scales the library cannot read
    with pytest.raises(DecodeStepError, match="scales must be C-contiguous float32"):
        step.run(x, 0, c, s, i8, [0])
    with pytest.raises(DecodeStepError, match="does not match the model"):
        step.run(x, 0, c, s, KVPool(cfg.n_layers + 1, cfg.n_kv_heads, cfg.head_dim, 4, BT, "f16"), [0])
    with pytest.raises(DecodeStepError, match="block table of 5 entries"):
        step.run(x, 0, c, s, pool, [0, 1, 2, 3, 0])
    before = pool.k.copy()
    with pytest.raises(DecodeStepError, match="EL_EINVAL"):
        step.run(x, BT, c, s, pool, seq.block_table)      # position 16 lies past the reserved block
    assert np.array_equal(pool.k.view(np.uint16), before.view(np.uint16))
    out = step.run(x, 0, c, s, pool, seq.block_table)
    assert out.shape == (1, cfg.d_model) and np.isfinite(out).all()


def test_chunk_step_bad_token_counts_and_tables_write_nothing(rig):
    """el_chunk_step's own arguments: the token count, and a table that must cover the chunk's
    last position (not only its first); a refused call leaves x and the pool untouched."""
    step, pool, seq, good = rig
    lib = neon._lib()
    cfg = step.cfg
    T = BT + 3                                          # the chunk crosses into a second block
    assert lib.el_chunk_scratch(step._dims_p, 0) == 0
    assert lib.el_chunk_scratch(step._dims_p, -1) == 0
    assert lib.el_chunk_scratch(step._dims_p, 1) == lib.el_decode_scratch(step._dims_p)
    need = lib.el_chunk_scratch(step._dims_p, T)
    assert need > lib.el_decode_scratch(step._dims_p)
    scratch = np.empty(need, np.uint8)
    x = np.ones((T, cfg.d_model), np.float32)
    rope = np.zeros((2, T, cfg.rope_dim // 2), np.float32)
    rope[0] = 1.0
    seq.reserve(T)                                      # two blocks now
    table = np.asarray(seq.block_table, np.int32)
    assert len(table) == 2
    x0, k0 = x.copy(), pool.k.copy()

    def call(T_=T, n_table=2, scratch_n=need, tbl=table):
        return lib.el_chunk_step(None, good["layers"], good["n_layers"], good["dims"], x.ctypes.data, T_, 0,
                                 rope[0].ctypes.data, rope[1].ctypes.data, good["k"], good["v"], good["kv_type"],
                                 tbl.ctypes.data, n_table, BT, pool.n_blocks, scratch.ctypes.data, scratch_n)
    assert call(T_=0) == EINVAL
    assert call(T_=-3) == EINVAL
    assert call(n_table=1) == EINVAL                    # the chunk's last position lies in block 2
    assert call(scratch_n=need - 1) == EINVAL           # scratch for fewer tokens
    bad = table.copy()
    bad[1] = pool.n_blocks                              # the second block outside the arena
    assert call(tbl=bad) == EINVAL

    def call_out(out_rows):
        return lib.el_chunk_step_out(None, good["layers"], good["n_layers"], good["dims"], x.ctypes.data, T, 0,
                                     rope[0].ctypes.data, rope[1].ctypes.data, good["k"], good["v"],
                                     good["kv_type"], table.ctypes.data, 2, BT, pool.n_blocks, scratch.ctypes.data,
                                     need, out_rows)
    assert call_out(-1) == EINVAL
    assert call_out(T + 1) == EINVAL
    assert np.array_equal(x, x0)
    assert np.array_equal(pool.k.view(np.uint16), k0.view(np.uint16))
    assert call() == 0                                  # the rig is sound: the valid call runs
    assert pool.k.view(np.uint16)[table[1], :, T - BT - 1].any()


# ---- the model's tail in the same call (el_chunk_logits) ------------------------------------------

@pytest.mark.parametrize("f32act", [True, False], ids=["fp32-x", "int8-x"])
@pytest.mark.parametrize("name", ["llama-Q4_1", "qwen2-Q4_0", "llama-F32"])
def test_tail_in_the_step_equals_step_then_norm_and_head(name, f32act, tmp_path_factory):
    """run_logits = run_chunk of the last row (out_rows=1), then neon.rmsnorm and the head (fp32
    or int8 x) as separate calls, on a prefill chunk and on decode tokens: the same kernels on
    the same rows, so the logits are equal bit for bit, and so are the K/V rows written."""
    eng, w = engine(name, tmp_path_factory)
    r, cfg = eng.runner, eng.config
    steps = [DecodeStep.build(w, cfg) for _ in range(2)]
    ids = np.random.default_rng(11).integers(3, cfg.vocab_size, 40)
    seqs = [KVPool(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, 4, BT, "f16").new_sequence() for _ in range(2)]
    precision = "fp32" if f32act else "int8"

    def tail(x):
        return neon.matmul(neon.rmsnorm(x[-1:], w.output_norm, cfg.norm_eps), w.lm_head, precision=precision)[0]

    for lo, hi in ((0, 33), *((i, i + 1) for i in range(33, 40))):   # a 33-token chunk, then 7 tokens
        x = neon.embedding(w.embedding, ids[lo:hi])
        cos, sin = r.cos[lo:hi], r.sin[lo:hi]
        for s in seqs:
            s.reserve(hi - lo)
        ref = tail(steps[0].run_chunk(x, lo, cos, sin, seqs[0].pool, seqs[0].block_table, out_rows=1))
        got = steps[1].run_logits(x, lo, cos, sin, seqs[1].pool, seqs[1].block_table, f32act=f32act)
        for s in seqs:
            s.commit(hi, ids[lo:hi])
        assert got.shape == (cfg.vocab_size,)
        np.testing.assert_array_equal(got, ref)
    for a, b in zip(kv_rows(seqs[0]), kv_rows(seqs[1])):
        np.testing.assert_array_equal(b, a)


def test_tail_bad_arguments_write_nothing(rig):
    """el_chunk_logits checks the head's arguments with the step's: a refused call leaves x, the
    pool and the logits buffer untouched."""
    step, pool, _, good = rig
    lib = neon._lib()
    V = step._n_vocab
    logits = np.full(V, 7.0, np.float32)
    head = ElMatrix.from_buffer_copy(step._head)
    x0, k0 = step._x.copy(), pool.k.copy()

    def call(onorm=step._onorm.ctypes.data, head_p=step._head_p, n_vocab=V, f32act=1, out=logits.ctypes.data,
             **change):
        a = {**good, **change}
        return lib.el_chunk_logits(a["pool"], a["layers"], a["n_layers"], a["dims"], a["x"], 1, a["pos"], a["cos"],
                                   a["sin"], a["k"], a["v"], a["kv_type"], a["table"], a["n_table"], a["bt"],
                                   a["n_blocks"], a["scratch"], a["scratch_n"], onorm, head_p, n_vocab, f32act, out)
    head.wtype = 7
    cases = {
        "out_norm NULL": (dict(onorm=None), EINVAL),
        "head NULL": (dict(head_p=None), EINVAL),
        "logits NULL": (dict(out=None), EINVAL),
        "n_vocab 0": (dict(n_vocab=0), EINVAL),
        "n_vocab off by one": (dict(n_vocab=V - 1), EINVAL),
        "f32act 2": (dict(f32act=2), EINVAL),
        "logits over x": (dict(out=step._x_p), EINVAL),
        "logits inside scratch": (dict(out=step._scratch_p), EINVAL),
        "head type 7": (dict(head_p=ctypes.addressof(head)), EUNSUPPORTED),
        "the step's own check (pos past the table)": (dict(pos=BT), EINVAL),
    }
    for what, (change, code) in cases.items():
        rc = call(**change)
        assert rc == code, f"{what}: expected {code}, got {rc}"
    assert np.array_equal(step._x, x0)
    assert np.array_equal(pool.k.view(np.uint16), k0.view(np.uint16))
    assert (logits == 7.0).all()
    assert call() == 0 and np.isfinite(logits).all() and not (logits == 7.0).all()


# ---- the embedding lookup in the same call (el_chunk_ids) -------------------------------------------

@pytest.mark.parametrize("name", ["llama-Q4_1", "qwen2-Q4_0", "llama-F32", "llama-Q8_0"])
def test_step_from_ids_equals_lookup_then_step(name, tmp_path_factory):
    """run_ids = neon.embedding of the ids, then run_logits (logits) or run_chunk (out_rows), on
    prefill chunks and decode tokens: the lookup is bit-identical and the step the same, so the
    logits, the returned rows and every K/V row are equal bit for bit."""
    eng, w = engine(name, tmp_path_factory)
    r, cfg = eng.runner, eng.config
    steps = [DecodeStep.build(w, cfg) for _ in range(2)]
    ids = np.random.default_rng(12).integers(3, cfg.vocab_size, 60)
    seqs = [KVPool(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, 5, BT, "f16").new_sequence() for _ in range(2)]
    # (lo, hi, logits, out_rows): a chunk without logits, one returning 3 rows, one with logits,
    # then decode tokens with and without logits
    parts = [(0, 20, False, 0), (20, 37, False, 3), (37, 50, True, 1),
             *((i, i + 1, i % 2 == 0, 1) for i in range(50, 60))]
    for lo, hi, logits, out_rows in parts:
        cos, sin = r.cos[lo:hi], r.sin[lo:hi]
        for s in seqs:
            s.reserve(hi - lo)
        x = neon.embedding(w.embedding, ids[lo:hi])
        if logits:
            ref = steps[0].run_logits(x, lo, cos, sin, seqs[0].pool, seqs[0].block_table)
        else:
            ref = steps[0].run_chunk(x, lo, cos, sin, seqs[0].pool, seqs[0].block_table, out_rows=out_rows).copy()
        got = steps[1].run_ids(ids[lo:hi], lo, r.cos, r.sin, seqs[1].pool, seqs[1].block_table, logits=logits,
                               out_rows=out_rows)
        for s in seqs:
            s.commit(hi, ids[lo:hi])
        assert got.shape == ref.shape
        np.testing.assert_array_equal(got, ref)
    for a, b in zip(kv_rows(seqs[0]), kv_rows(seqs[1])):
        np.testing.assert_array_equal(b, a)


def test_step_from_ids_refuses_bad_ids_and_writes_nothing(tmp_path_factory):
    """An id outside the table (or one that does not fit int32) is refused before the step: a
    DecodeStepError, the pool untouched; el_chunk_ids also refuses logits with out_rows != 1 and
    an embedding table whose rows are not the model's width."""
    eng, w = engine("llama-Q4_1", tmp_path_factory)
    r, cfg = eng.runner, eng.config
    step = DecodeStep.build(w, cfg)
    seq = KVPool(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, 4, BT, "f16").new_sequence()
    seq.reserve(3)
    k0 = seq.pool.k.copy()
    for bad in ([1, cfg.vocab_size, 2], [-1, 1, 2], [1, 2, 2 ** 32 + 1]):
        with pytest.raises(DecodeStepError, match="el_chunk_ids failed with EL_EINVAL|does not fit int32"):
            step.run_ids(np.array(bad), 0, r.cos, r.sin, seq.pool, seq.block_table)
        assert np.array_equal(seq.pool.k.view(np.uint16), k0.view(np.uint16))
    rows = len(r.cos)
    for cos, sin, pos, what in ((r.cos, r.sin, rows - 2, "past the RoPE tables"),
                                (r.cos.astype(np.float64), r.sin, 0, "C-contiguous float32"),
                                (r.cos[:, :2], r.sin, 0, "C-contiguous float32"),
                                (r.cos, r.sin[:5], 0, "different shapes")):
        with pytest.raises(ValueError, match=what):
            step.run_ids(np.array([1, 2, 3]), pos, cos, sin, seq.pool, seq.block_table)
        assert np.array_equal(seq.pool.k.view(np.uint16), k0.view(np.uint16))
    lib, ids = neon._lib(), np.array([1, 2, 3], np.int32)
    step.run_ids(ids, 0, r.cos, r.sin, seq.pool, seq.block_table, logits=False)   # binds, sizes buffers
    logits = np.full(step._n_vocab, 7.0, np.float32)
    emb = neon.ElEmbedding.from_buffer_copy(step._emb)

    def call(emb_p=step._emb_p, out_rows=1, x=step._chunk_ptrs[0], kv_type=step._kv_type):
        return lib.el_chunk_ids(None, step._layers_p, cfg.n_layers, step._dims_p, emb_p, ids.ctypes.data,
                                x, 3, 0, r.cos.ctypes.data, r.sin.ctypes.data, step._k_p, step._v_p,
                                kv_type, step._tbl_p, 1, step._bt, step._nb, step._chunk_scratch_p,
                                step._chunk_scratch.nbytes, out_rows, step._onorm.ctypes.data, step._head_p,
                                step._n_vocab, 1, logits.ctypes.data)
    emb.row_len = cfg.d_model // 2
    k1, v1 = seq.pool.k.copy(), seq.pool.v.copy()
    assert call(out_rows=3) == EINVAL
    assert call(emb_p=ctypes.addressof(emb)) == EINVAL
    assert call(emb_p=None) == EINVAL
    assert call(kv_type=7) == EUNSUPPORTED
    # x inside the K or V arena (its last row or its first): refused before the lookup writes it
    assert call(x=step._k_p + seq.pool.k.nbytes - 4) == EINVAL
    assert call(x=step._v_p) == EINVAL
    assert np.array_equal(seq.pool.v.view(np.uint16), v1.view(np.uint16))
    assert (logits == 7.0).all() and np.array_equal(seq.pool.k.view(np.uint16), k1.view(np.uint16))
    assert call() == 0 and np.isfinite(logits).all()


def test_int8_pool_descriptors_are_checked_and_nothing_is_written(tmp_path_factory):
    """kv_type EL_KV_I8: K and V each name an el_kv_i8. One with a NULL arena or scales, or an x
    inside an arena's scales, is refused (EL_EINVAL) with the arena, the scales and the logits
    untouched; the valid call then stores the chunk's rows."""
    eng, w = engine("llama-Q4_1", tmp_path_factory)
    r, cfg = eng.runner, eng.config
    step = DecodeStep.build(w, cfg)
    seq = KVPool(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, 4, BT, "int8").new_sequence()
    seq.reserve(3)
    pool, lib, ids = seq.pool, neon._lib(), np.array([1, 2, 3], np.int32)
    step.run_ids(ids, 0, r.cos, r.sin, pool, seq.block_table, logits=False)    # binds, sizes buffers
    pool.k[...] = 5
    pool.k_scale[...] = 0.5
    before = [a.copy() for a in (pool.k, pool.v, pool.k_scale, pool.v_scale)]
    logits = np.full(step._n_vocab, 7.0, np.float32)

    def call(k=step._k_p, v=step._v_p, x=step._chunk_ptrs[0]):
        return lib.el_chunk_ids(None, step._layers_p, cfg.n_layers, step._dims_p, step._emb_p, ids.ctypes.data,
                                x, 3, 0, r.cos.ctypes.data, r.sin.ctypes.data, k, v, neon_lib.EL_KV_I8,
                                step._tbl_p, 1, step._bt, step._nb, step._chunk_scratch_p,
                                step._chunk_scratch.nbytes, 1, step._onorm.ctypes.data, step._head_p,
                                step._n_vocab, 1, logits.ctypes.data)
    bad = [neon_lib.ElKvI8(None, pool.k_scale.ctypes.data), neon_lib.ElKvI8(pool.k.ctypes.data, None)]
    for d in bad:
        assert call(k=ctypes.addressof(d)) == EINVAL
        assert call(v=ctypes.addressof(d)) == EINVAL
    assert call(x=pool.k_scale.ctypes.data + 8) == EINVAL
    assert call(x=pool.v_scale.ctypes.data) == EINVAL
    assert call(x=pool.v.ctypes.data + 16) == EINVAL
    assert (logits == 7.0).all()
    for a, b in zip((pool.k, pool.v, pool.k_scale, pool.v_scale), before):
        assert np.array_equal(a, b)
    assert call() == 0 and np.isfinite(logits).all()
    blk = seq.block_table[0]
    assert (pool.k_scale[blk, :, :3] != 0.5).all() and (pool.k_scale[blk, :, 3:] == 0.5).all()


def test_engine_runs_the_tail_in_the_step_when_the_plan_puts_it_there(tmp_path_factory, monkeypatch):
    """The engine's forward (last position's logits) takes run_ids with logits when the plan puts
    the embedding, the output norm and the head on the fused unit: its logits match the per-op
    path's within BOUND and greedy picks the same tokens."""
    eng, _ = engine("llama-Q4_1", tmp_path_factory)
    r, cfg = eng.runner, eng.config
    assert r._fused_tail == r._fused_lead == {"prefill", "decode"}, r.placement
    calls = []
    orig = DecodeStep.run_ids
    monkeypatch.setattr(DecodeStep, "run_ids",
                        lambda self, *a, **k: calls.append(k.get("logits", True)) or orig(self, *a, **k))
    ids = np.random.default_rng(5).integers(3, cfg.vocab_size, 20)
    seqs = [KVPool(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, 4, BT, "f16").new_sequence() for _ in range(2)]
    with per_op(r):
        ref = r.forward(seqs[0], ids)
    got = r.forward(seqs[1], ids)
    assert len(calls) == 1 and nmse(got, ref) <= BOUND
    for _ in range(10):
        t = int(np.argmax(got))
        assert t == int(np.argmax(ref))
        with per_op(r):
            ref = r.forward(seqs[0], [t])
        got = r.forward(seqs[1], [t])
        assert nmse(got, ref) <= BOUND
    assert calls == [True] * 11


def test_decode_token_fast_path_checks_like_the_loop(tmp_path_factory, monkeypatch):
    """forward's one-token case takes the single fused call (Runner._decode_fused) and returns the
    same logits as the general loop does for that token (bit for bit: the same run_ids call);
    a bad id is a ConfigError and a cancelled token a Cancelled, each leaving the sequence and the
    pool as they were."""
    from edgellm.engine import CancelToken
    from edgellm.errors import Cancelled, ConfigError

    eng, _ = engine("llama-Q4_1", tmp_path_factory)
    r, cfg = eng.runner, eng.config
    used = []
    orig = type(r)._decode_fused
    monkeypatch.setattr(type(r), "_decode_fused", lambda self, *a: used.append(1) or orig(self, *a))
    ids = np.random.default_rng(6).integers(3, cfg.vocab_size, 9)
    seqs = [KVPool(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, 4, BT, "f16").new_sequence() for _ in range(2)]
    for s in seqs:
        r.forward(s, ids)
    for t in (5, 17, 3):
        fast = r.forward(seqs[0], [t])
        seqs[1].reserve(1)                       # what the loop does for the token
        loop = r._fused_step(seqs[1], np.array([t]), "decode", logits=True)
        seqs[1].commit(seqs[1].n_tokens + 1, [t])
        np.testing.assert_array_equal(fast, loop)
    assert len(used) == 3
    n, k0 = seqs[0].n_tokens, seqs[0].pool.k.copy()
    for bad in (cfg.vocab_size, -1):
        with pytest.raises(ConfigError, match=f"token id {bad} is outside the vocabulary"):
            r.forward(seqs[0], [bad])
    for bad in (5, np.array(5), np.array([[5]]), []):   # not a 1-D list of ids: the loop's error
        with pytest.raises(ConfigError, match="non-empty 1-D list of token ids"):
            r.forward(seqs[0], bad)
    token = CancelToken()
    token.cancel()
    with pytest.raises(Cancelled):
        r.forward(seqs[0], [5], cancel=token)
    assert seqs[0].n_tokens == n and np.array_equal(seqs[0].pool.k.view(np.uint16), k0.view(np.uint16))
    assert len(used) == 6
