"""The last layer computes its output only for the rows whose logits are read: one row for a
prompt's last chunk, none for the chunks before it, a warm-up or a prompt part that more parts
follow. Every row's K/V are still stored in every layer.

Fused step (el_chunk_step_out) and per-op path (ModelRunner._layers) skip the same rows with the
same kernels, so they stay equal to each other; against the full computation the kept row
differs only by the kernels' rounding (its last layer runs with 1 query row, not T)."""
from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as QT
import pytest

import edgellm
from edgellm.backends import neon, neon_lib
from edgellm.backends.neon_fused import DecodeStep
from edgellm.kv.pool import KVPool
from tests.test_neon_fused import BOUND, BT, engine, installed_library, kv_rows, nmse, per_op  # noqa: F401


def _pools(cfg, n, layers=None, n_blocks=8):
    return [KVPool(layers or cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, n_blocks, BT, "f16").new_sequence()
            for _ in range(n)]


@pytest.mark.parametrize("name", ["llama-Q4_1", "qwen2-Q4_1", "llama-F32"])
def test_step_out_rows_leave_the_last_layers_input_and_every_kv_row(name, tmp_path_factory):
    """el_chunk_step_out with out_rows = r: the chunk's first T - r rows of x hold exactly what
    the first n_layers - 1 layers make of them (the step over those layers alone, bit for bit),
    the last r rows match the full step's within BOUND, and the K/V rows of every layer equal
    the full step's bit for bit."""
    eng, w = engine(name, tmp_path_factory)
    r, cfg = eng.runner, eng.config
    step = DecodeStep.build(w, cfg)
    lib = neon._lib()
    T = 40                                                 # crosses two block boundaries
    x0 = neon.embedding(w.embedding, np.random.default_rng(3).integers(3, cfg.vocab_size, T))
    cos, sin = np.ascontiguousarray(r.cos[:T]), np.ascontiguousarray(r.sin[:T])
    scratch = np.empty(lib.el_chunk_scratch(step._dims_p, T), np.uint8)

    def run(seq, n_layers, out_rows):
        seq.reserve(T)
        x = x0.copy()
        table = np.asarray(seq.block_table, np.int32)
        tp = neon.thread_pool()
        rc = lib.el_chunk_step_out(tp.ptr, step._layers_p, n_layers, step._dims_p, x.ctypes.data, T, 0,
                                   cos.ctypes.data, sin.ctypes.data, seq.pool.k.ctypes.data, seq.pool.v.ctypes.data,
                                   neon_lib.EL_F16, table.ctypes.data, len(table), BT, seq.pool.n_blocks,
                                   scratch.ctypes.data, scratch.nbytes, out_rows)
        assert rc == 0
        seq.commit(T, list(range(T)))
        return x

    [shorter] = _pools(cfg, 1, layers=cfg.n_layers - 1)
    below = run(shorter, cfg.n_layers - 1, T)              # the last layer's input, every row
    [full_seq] = _pools(cfg, 1)
    full = run(full_seq, cfg.n_layers, T)
    assert not np.array_equal(below, full)                 # the last layer changes x
    for out_rows in (0, 1, 5, T):
        [seq] = _pools(cfg, 1)
        got = run(seq, cfg.n_layers, out_rows)
        np.testing.assert_array_equal(got[:T - out_rows], below[:T - out_rows])
        if out_rows:
            assert nmse(got[T - out_rows:], full[T - out_rows:]) <= BOUND
        for a, b in zip(kv_rows(full_seq), kv_rows(seq)):
            np.testing.assert_array_equal(b, a)
    # the layers below the last store the same K/V as the shorter model
    for a, b in zip(kv_rows(shorter), kv_rows(full_seq)):
        np.testing.assert_array_equal(b[:, :cfg.n_layers - 1], a)


@pytest.mark.parametrize("chunk", [None, 7, 16])
@pytest.mark.parametrize("name", ["llama-Q4_1", "qwen2-Q4_0"])
def test_forward_last_logits_fused_equal_per_op_and_full(name, chunk, tmp_path_factory):
    """forward's last-position logits (out_rows 1 in the last chunk, 0 before it): fused and
    per-op within BOUND of each other and of the full computation's last row (all_logits), and
    the K/V rows of the three bit-identical."""
    eng, _ = engine(name, tmp_path_factory)
    r, cfg = eng.runner, eng.config
    ids = np.random.default_rng(9).integers(3, cfg.vocab_size, 45)
    seqs = _pools(cfg, 3)
    full = r.forward(seqs[0], ids, all_logits=True, chunk=chunk)[-1]
    got = r.forward(seqs[1], ids, chunk=chunk)
    with per_op(r):
        ref = r.forward(seqs[2], ids, chunk=chunk)
    assert got.shape == (cfg.vocab_size,)
    assert nmse(got, ref) <= BOUND and nmse(got, full) <= BOUND
    for s in seqs[1:]:
        for a, b in zip(kv_rows(seqs[0]), kv_rows(s)):
            np.testing.assert_array_equal(b, a)


def test_per_op_last_layer_attends_only_the_rows_read(tmp_path_factory, monkeypatch):
    """The per-op path hands the last layer's attention only the rows whose logits are read:
    none for a chunk before the last, one for the last; every other layer gets the whole chunk."""
    eng, _ = engine("llama-Q4_1", tmp_path_factory)
    r, cfg = eng.runner, eng.config
    calls = []
    orig = neon.attention_pool
    monkeypatch.setattr(neon, "attention_pool",
                        lambda q, pool, table, layer, start: calls.append((layer, q.shape[0], start))
                        or orig(q, pool, table, layer, start))
    [seq] = _pools(cfg, 1)
    with per_op(r):
        r.forward(seq, np.arange(3, 23), chunk=16)         # chunks of 16 and 4
    last = cfg.n_layers - 1
    assert calls == [(li, 16, 0) for li in range(last)] + [(li, 4, 16) for li in range(last)] + [(last, 1, 19)]


def test_forward_without_logits_stores_the_same_kv_and_reads_no_head(tmp_path_factory, monkeypatch):
    """logits=False (a warm-up, a prompt part that more parts follow): returns None, never runs
    the head, and stores the K/V rows a forward with logits stores."""
    eng, _ = engine("llama-Q4_1", tmp_path_factory)
    r, cfg = eng.runner, eng.config
    heads = []
    orig = type(r)._head
    monkeypatch.setattr(type(r), "_head", lambda self, *a, **k: heads.append(1) or orig(self, *a, **k))
    ids = np.random.default_rng(4).integers(3, cfg.vocab_size, 30)
    seqs = _pools(cfg, 2)
    assert r.forward(seqs[0], ids, logits=False, chunk=8) is None
    assert r.forward(seqs[0], ids[:1], logits=False) is None        # a single token too
    assert heads == []
    r.forward(seqs[1], ids, chunk=8)
    r.forward(seqs[1], ids[:1])
    for a, b in zip(kv_rows(seqs[0]), kv_rows(seqs[1])):
        np.testing.assert_array_equal(b, a)


def test_run_chunk_rejects_out_rows_outside_the_chunk(tmp_path_factory):
    eng, w = engine("llama-Q4_1", tmp_path_factory)
    r, cfg = eng.runner, eng.config
    step = DecodeStep.build(w, cfg)
    [seq] = _pools(cfg, 1)
    seq.reserve(4)
    x = neon.embedding(w.embedding, np.arange(3, 7))
    for bad in (-1, 5):
        with pytest.raises(ValueError, match="out_rows"):
            step.run_chunk(x, 0, r.cos[:4], r.sin[:4], seq.pool, seq.block_table, out_rows=bad)
    assert step.run_chunk(x, 0, r.cos[:4], r.sin[:4], seq.pool, seq.block_table, out_rows=2).shape == (2, cfg.d_model)


def test_ring_past_its_window_keeps_the_last_row_and_every_kv_row(tmp_path):
    """A ring (keys stored unrotated, rotated at attention, positions past its window) takes the
    per-op path: its last-position logits match the full computation's last row, and the ring
    holds the same K/V rows either way."""
    from tests.synthetic import write_tiny_model

    path = write_tiny_model(tmp_path / "r.gguf", n_layers=3, tensor_type=QT.Q8_0, seed=2, context_length=512).path
    engines = [edgellm.load(str(path), n_ctx=512, threads=1, kv="ring", window=32, sinks=4, prefill_chunk=8)
               for _ in range(2)]
    ids = np.random.default_rng(8).integers(3, engines[0].config.vocab_size, 70)   # past the 32-token window
    seqs = [e._new_sequence() for e in engines]
    full = engines[0].runner.forward(seqs[0], ids, all_logits=True)[-1]
    got = engines[1].runner.forward(seqs[1], ids)
    assert got.shape == full.shape and nmse(got, full) <= 1e-10
    a, b = seqs                                            # RingKV: (layers, KVH, window, hd) by slot
    assert a.n_tokens == b.n_tokens == 32 and np.abs(a.k).sum() > 0
    for x, y in zip((a.k, a.v), (b.k, b.v)):
        np.testing.assert_array_equal(x, y)


def test_chunk_embeddings_written_into_the_step_buffer_run_as_a_copied_input(tmp_path_factory):
    """The engine writes a chunk's embeddings straight into the step's input buffer
    (chunk_input): the chunk then runs as one whose input is copied in, bit for bit."""
    eng, w = engine("llama-Q4_1", tmp_path_factory)
    r, cfg = eng.runner, eng.config
    ids = np.random.default_rng(6).integers(3, cfg.vocab_size, 21)
    outs = []
    for direct in (False, True):
        step = DecodeStep.build(w, cfg)
        [seq] = _pools(cfg, 1)
        seq.reserve(len(ids))
        if direct:
            x = neon.embedding(w.embedding, ids, out=step.chunk_input(len(ids)))
            assert x.ctypes.data == step._chunk_x.ctypes.data
        else:
            x = neon.embedding(w.embedding, ids)
        outs.append((step.run_chunk(x, 0, r.cos[:21], r.sin[:21], seq.pool, seq.block_table).copy(), seq))
        seq.commit(len(ids), ids)
    (a, sa), (b, sb) = outs
    np.testing.assert_array_equal(b, a)
    for u, v in zip(kv_rows(sa), kv_rows(sb)):
        np.testing.assert_array_equal(v, u)
