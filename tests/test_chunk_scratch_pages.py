"""Which pages of a fused chunk step's scratch get touched (el_chunk_step_out, neon/decode_step.c).

The scratch's slice-sized regions are sized for a full slice whatever the chunk's T, so they lie
at the same offsets for every chunk, and a chunk touches only their first rows: the pages ever
resident are those of the largest chunk run. With block-quantized weights the fp32 `h` region
(the projections' inputs, quantized straight into `xq_h` instead) stays untouched. Both are
seen with mincore on a fresh anonymous mapping, whose pages are resident only once written."""
from __future__ import annotations

import ctypes
import mmap

import numpy as np
import pytest

from edgellm.backends import neon, neon_lib
from edgellm.backends.neon_fused import DecodeStep
from edgellm.kv.pool import KVPool
from tests.test_neon_fused import BT, engine, installed_library  # noqa: F401

PAGE = mmap.PAGESIZE


def resident_pages(buf: np.ndarray) -> set[int]:
    """Indices of the buffer's pages in memory (buf starts on a page: an mmap)."""
    n = (buf.nbytes + PAGE - 1) // PAGE
    vec = (ctypes.c_ubyte * n)()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    assert libc.mincore(buf.ctypes.data, n * PAGE, vec) == 0, ctypes.get_errno()
    return {i for i in range(n) if vec[i] & 1}


def test_a_smaller_chunk_touches_no_page_the_largest_left_untouched(tmp_path_factory):
    eng, w = engine("llama-Q4_1", tmp_path_factory)
    r, cfg = eng.runner, eng.config
    step = DecodeStep.build(w, cfg)
    lib = neon._lib()
    big, small = 300, 40               # 300: two slices (256 + 44) and three FFN pieces
    size = lib.el_chunk_scratch(step._dims_p, big)
    assert size >= lib.el_chunk_scratch(step._dims_p, small)
    mem = mmap.mmap(-1, size)          # fresh zero pages: resident only once written
    scratch = np.frombuffer(mem, np.uint8)
    ids = np.random.default_rng(7).integers(3, cfg.vocab_size, big)

    def run(T: int) -> None:
        seq = KVPool(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, big // BT + 2, BT, "f16").new_sequence()
        seq.reserve(T)
        x = neon.embedding(w.embedding, ids[:T])
        cos, sin = np.ascontiguousarray(r.cos[:T]), np.ascontiguousarray(r.sin[:T])
        table = np.asarray(seq.block_table, np.int32)
        rc = lib.el_chunk_step_out(neon.thread_pool().ptr, step._layers_p, cfg.n_layers, step._dims_p,
                                   x.ctypes.data, T, 0, cos.ctypes.data, sin.ctypes.data,
                                   seq.pool.k.ctypes.data, seq.pool.v.ctypes.data, neon_lib.EL_F16,
                                   table.ctypes.data, len(table), BT, seq.pool.n_blocks,
                                   scratch.ctypes.data, scratch.nbytes, T)
        assert rc == 0

    run(big)
    after_big = resident_pages(scratch)
    # h, T rows of d fp32 at the end of the layout, is never written with Q4_1 projections
    h_pages = (big * cfg.d_model * 4) // PAGE
    assert h_pages >= 4 and len(after_big) <= -(-size // PAGE) - h_pages, (len(after_big), size // PAGE)
    run(small)
    assert resident_pages(scratch) == after_big
    del scratch
    mem.close()
