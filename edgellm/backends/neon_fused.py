"""The neon unit's fused steps: one decode token, or one prefill chunk, through every layer in
one native call.

The per-op decode path makes ~12 ctypes calls per layer; at ~10 us of Python and ctypes work
each, that is milliseconds per token outside any kernel. DecodeStep describes the model to
el_decode_step (neon/decode_step.c) once, as C structs pointing at the prepared weights, and a
step is then one call: the same kernels in the same order as the per-op path, so the logits and
the K/V rows written are the same bit for bit.

    step = DecodeStep.build(weights, cfg)     # weights: neon.PreparedWeights, once at load
    seq.reserve(1)                            # room for position pos = seq.n_tokens (copy-on-write)
    x = embedding(token)                      # (1, d) float32
    x = step.run(x, pos, cos[pos], sin[pos], seq.pool, seq.block_table)
    seq.commit(pos + 1, [token])
    logits = lm_head(output_norm(x))
    # a prefill chunk of T tokens: seq.reserve(T); step.run_chunk(x (T, d), pos, cos[pos:pos+T], ...)
    # or the model's tail in the same call (when the plan puts the output norm and head on neon):
    logits = step.run_logits(x (T, d), pos, cos[pos:pos+T], sin[pos:pos+T], seq.pool, seq.block_table)

    # or from the token ids, the embedding lookup inside the same call (el_chunk_ids: when the
    # plan puts the embedding on neon too):
    logits = step.run_ids(ids (T,), pos, cos, sin, seq.pool, seq.block_table)   # the whole tables

run() returns its own (1, d) buffer: valid until the next run (copy it to keep it).
"""
from __future__ import annotations

import ctypes
from ctypes import c_float, c_int, c_void_p

import numpy as np

from ..errors import EdgeLLMError
from ..heap import no_huge_pages, release_free_pages
from ..model.config import ModelConfig
from . import neon
from .neon import PreparedWeights, QMatrix

_ERRORS = {-1: "EL_EINVAL (an argument is out of range)", -2: "EL_ENOMEM", -3: "EL_EUNSUPPORTED",
           -4: "EL_ENONFINITE (logits with a NaN or an infinite maximum)"}


class DecodeStepError(EdgeLLMError, RuntimeError):
    """el_decode_step refused its arguments (nothing was written) or the model cannot be fused."""


# ---- the C structs of neon/edgellm_neon.h -----------------------------------------------------

class ElMatrix(ctypes.Structure):
    _fields_ = [("wtype", c_int), ("n_seg", c_int),
                ("seg_ptr", c_void_p),     # const void *const * (n_seg,)
                ("seg_rows", c_void_p)]    # const int * (n_seg,)


class ElLayer(ctypes.Structure):
    _fields_ = [("attn_norm", c_void_p), ("ffn_norm", c_void_p), ("bqkv", c_void_p),
                ("qkv", ElMatrix), ("attn_out", ElMatrix), ("gate_up", ElMatrix), ("down", ElMatrix)]


class ElModelDims(ctypes.Structure):
    _fields_ = [("d", c_int), ("H", c_int), ("KVH", c_int), ("hd", c_int), ("ff", c_int),
                ("rope_dim", c_int), ("neox", c_int), ("eps", c_float)]


def _matrix(w: QMatrix) -> ElMatrix:
    return ElMatrix(w.wtype, len(w.rows), ctypes.addressof(w.ptrs), ctypes.addressof(w.rows_c))


def _f32(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32)


class DecodeStep:
    """A model's decode step as one el_decode_step call. Build once per (weights, cfg); run
    once per token. Not thread-safe (its buffers are reused): one engine loop drives it."""

    def __init__(self, weights: PreparedWeights, cfg: ModelConfig):
        if cfg.rope_style not in ("norm", "neox"):
            raise DecodeStepError(f"rope_style must be 'norm' or 'neox', got {cfg.rope_style!r}")
        if len(weights.layers) != cfg.n_layers:
            raise DecodeStepError(f"{len(weights.layers)} prepared layers for a {cfg.n_layers}-layer model")
        self._lib = neon._lib()
        self.cfg = cfg
        self._weights = weights        # the QMatrix segment arrays the structs point into
        self._keep = []                # every other array a struct points at
        self._layers = (ElLayer * cfg.n_layers)()
        for i, lw in enumerate(weights.layers):
            n1, n2 = _f32(lw.attn_norm), _f32(lw.ffn_norm)
            bias = None if lw.bqkv is None else _f32(lw.bqkv)
            self._keep += [n1, n2, bias]
            self._layers[i] = ElLayer(n1.ctypes.data, n2.ctypes.data, None if bias is None else bias.ctypes.data,
                                      _matrix(lw.wqkv), _matrix(lw.wo), _matrix(lw.w_gate_up), _matrix(lw.w_down))
        self._dims = ElModelDims(cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_ff, cfg.rope_dim,
                                 1 if cfg.rope_style == "neox" else 0, cfg.norm_eps)
        need = self._lib.el_decode_scratch(ctypes.addressof(self._dims))
        if need == 0:
            raise DecodeStepError(f"el_decode_scratch rejects the model's dimensions {self._dims_text()}")
        half = cfg.rope_dim // 2
        self._scratch = np.empty(need, np.uint8)
        self._x = np.empty((1, cfg.d_model), np.float32)        # (1, d) residual stream, in and out
        self._rope = np.empty((2, half), np.float32)            # (cos | sin, rope_dim/2) of the position
        self._tbl = np.empty(0, np.int32)                       # the block table, copied in per step
        # addresses passed on every call, computed once
        self._layers_p, self._dims_p = ctypes.addressof(self._layers), ctypes.addressof(self._dims)
        self._scratch_p, self._scratch_n = self._scratch.ctypes.data, self._scratch.nbytes
        self._x_p = self._x.ctypes.data
        self._cos_p = self._rope.ctypes.data
        self._sin_p = self._cos_p + 4 * half
        self._fn = self._lib.el_decode_step
        # the model's tail (run_logits): the output norm and the head over the chunk's last row
        self._onorm = _f32(weights.output_norm)
        self._head = _matrix(weights.lm_head)
        self._head_p, self._n_vocab = ctypes.addressof(self._head), weights.lm_head.n
        # the token table, for steps that start from token ids (run_ids)
        self._emb = neon.embedding_desc(weights.embedding)
        self._emb_p = ctypes.addressof(self._emb)
        self._ids = np.empty(1, np.int32)              # a step's ids, copied in as int32
        self._ids_p = self._ids.ctypes.data
        self._rope_tabs = (None, None, 0, 0, 0, 0)     # (cos, sin, their addresses, rows, row bytes)
        self._pool = None              # the KVPool bound by _bind (arena addresses below)
        # the thread pool of the engine this step serves, held: another engine's load may
        # configure the module for other threads, and must neither change nor free this one
        self._npool = neon.thread_pool()
        # run_chunk's buffers: (T, d) residual stream, (cos | sin, T, rope_dim/2), scratch
        self._alloc_chunk_buffers(0, 0)
        self._chunk_need: dict[int, int] = {}   # T -> el_chunk_scratch bytes
        self._chunk_ptrs, self._chunk_scratch_p = (0, 0, 0), 0   # their addresses, set when they grow

    @classmethod
    def build(cls, weights: PreparedWeights, cfg: ModelConfig) -> "DecodeStep":
        return cls(weights, cfg)

    def _dims_text(self) -> str:
        return ", ".join(f"{n}={getattr(self._dims, n)}" for n, _ in ElModelDims._fields_)

    def _bind(self, pool) -> None:
        """Reads a KV pool's arena addresses once (the arrays of a KVPool never move)."""
        c = self.cfg
        if pool.k.dtype not in neon.KV_TYPES:
            raise DecodeStepError(f"the fused decode step reads f32, f16 or int8 KV pools, not {pool.k.dtype}")
        want = (pool.n_blocks, c.n_layers, pool.block_tokens, c.n_kv_heads, c.head_dim)
        for a in (pool.k, pool.v):
            if a.shape != want or a.dtype != pool.k.dtype or not a.flags.c_contiguous:
                raise DecodeStepError(f"KV arena {a.dtype} {a.shape} does not match the model: expected a "
                                      f"C-contiguous {pool.k.dtype} (n_blocks, n_layers, block_tokens, "
                                      f"kv_heads, head_dim) = {want}")
        # int8: the library takes an el_kv_i8 (arena, scales) for each of K and V
        try:
            self._kv_desc = neon.kv_arena_args(pool)
        except ValueError as e:
            raise DecodeStepError(str(e)) from None
        self._k_p, self._v_p = self._kv_desc[0], self._kv_desc[1]
        self._kv_type, self._bt, self._nb = neon.KV_TYPES[pool.k.dtype], pool.block_tokens, pool.n_blocks
        if self._tbl.size < pool.n_blocks:
            self._tbl = np.empty(pool.n_blocks, np.int32)
            self._tbl_p = self._tbl.ctypes.data
        self._pool = pool

    def run(self, x: np.ndarray, pos: int, cos_row: np.ndarray, sin_row: np.ndarray, pool, table) -> np.ndarray:
        """x (1, d) float32: the token's embedding -> (1, d), the last layer's output (this
        object's buffer, overwritten by the next run). pos: the token's position (the
        sequence's n_tokens; reserved). cos_row, sin_row (rope_dim/2,) or (1, rope_dim/2): the
        RoPE tables' row pos. pool: the sequence's KVPool (f16 or f32). table: its block table
        (a list or int array); the block of pos must be exclusively owned (seq.reserve did
        that). Writes the token's K/V into every layer of the pool; raises DecodeStepError,
        writing nothing, when the library refuses the arguments."""
        n = self._take(pool, table)
        self._x[...] = x
        self._rope[0] = cos_row
        self._rope[1] = sin_row
        rc = self._fn(self._npool.ptr, self._layers_p, self.cfg.n_layers, self._dims_p, self._x_p, pos, self._cos_p,
                      self._sin_p, self._k_p, self._v_p, self._kv_type, self._tbl_p, n, self._bt, self._nb,
                      self._scratch_p, self._scratch_n)
        self._check(rc, "el_decode_step", f"position {pos}", n)
        return self._x

    def _take(self, pool, table) -> int:
        """Binds `pool` (when it changed) and copies the block table in; returns its length."""
        if pool is not self._pool:
            self._bind(pool)
        n = len(table)
        if n > self._tbl.size:
            raise DecodeStepError(f"a block table of {n} entries for a pool of {self._tbl.size} blocks")
        self._tbl[:n] = table
        return n

    def _check(self, rc: int, fn: str, where: str, n_table: int) -> None:
        if rc != 0:
            raise DecodeStepError(f"{fn} failed with {_ERRORS.get(rc, rc)}: {where}, {n_table} table entries of "
                                  f"{self._bt} tokens, pool of {self._nb} blocks; dims {self._dims_text()}")

    def run_chunk(self, x: np.ndarray, pos: int, cos: np.ndarray, sin: np.ndarray, pool, table,
                  out_rows: int | None = None) -> np.ndarray:
        """A prefill chunk: x (T, d) float32 embeddings of positions pos..pos+T-1 (reserved,
        their blocks exclusively owned) -> the last layer's output of the chunk's last out_rows
        rows (default all T), (out_rows, d) in this object's buffer, overwritten by the next
        run_chunk. Every row's K/V are stored whatever out_rows is; the last layer computes its
        output for the returned rows only (el_chunk_step_out). cos, sin (T, rope_dim/2): the RoPE
        rows of those positions. Same contract and errors as run."""
        T = x.shape[0]
        out_rows = T if out_rows is None else out_rows
        if not 0 <= out_rows <= T:
            raise ValueError(f"out_rows must be in 0..{T} for a chunk of {T} tokens, got {out_rows}")
        return self._chunk(x, pos, cos, sin, pool, table, None, True, out_rows)[T - out_rows:]

    def run_logits(self, x: np.ndarray, pos: int, cos: np.ndarray, sin: np.ndarray, pool, table,
                   f32act: bool = True) -> np.ndarray:
        """run_chunk (a decode token is T = 1) and the model's tail in the same native call:
        (vocab,) logits of the last position, a new array = lm_head(output_norm(x[-1])) with the
        normed row kept in fp32 (f32act, neon.lm_head's default) or quantized to int8. Same
        contract and errors as run; the step's K/V are written only when the head's arguments
        pass too."""
        logits = np.empty(self._n_vocab, np.float32)
        self._chunk(x, pos, cos, sin, pool, table, logits, f32act)
        return logits

    def run_ids(self, ids, pos: int, cos: np.ndarray, sin: np.ndarray, pool, table,
                logits: bool = True, f32act: bool = True, out_rows: int | None = None,
                rope_pos: int | None = None) -> np.ndarray:
        """run_logits (logits=True) or run_chunk (logits=False, out_rows) of a step given as its
        token ids (T,): the rows of the embedding table are looked up inside the same native call
        (el_chunk_ids), bit-identical to reference.embedding's, so the results equal those of
        run_logits / run_chunk on the looked-up rows. cos, sin: the RoPE tables (positions,
        rope_dim/2), of which rows pos..pos+T-1 are read in place (rope_pos..rope_pos+T-1 when
        given: a ring buffer stores a token at its cache position and rotates it by its position
        in the sequence). An id outside the table raises DecodeStepError and writes nothing.

        A decode token's Python work here is kept to a few attribute reads: after the step has
        streamed ~100 MB of weights the interpreter runs cold, and checking two row slices'
        dtype and flags took ~15 us of a ~2.5 ms token."""
        T = len(ids)
        if T == 0:
            raise ValueError("run_ids needs at least one token id")
        out_rows = 1 if logits else (T if out_rows is None else out_rows)
        if not 0 <= out_rows <= T:
            raise ValueError(f"out_rows must be in 0..{T} for a chunk of {T} tokens, got {out_rows}")
        if self._ids.size < T:
            self._ids = np.empty(max(T, 2 * self._ids.size), np.int32)
            self._ids_p = self._ids.ctypes.data
        if T == 1:    # a decode token: no numpy reductions
            v = int(ids[0])
            if not -2 ** 31 <= v < 2 ** 31:
                raise DecodeStepError(f"token id {v} does not fit int32")
            self._ids[0] = v
        else:
            a = np.asarray(ids)
            if a.dtype != np.int32 and bool((a < -2 ** 31).any() or (a >= 2 ** 31).any()):
                raise DecodeStepError(f"a token id of {a[:8].tolist()} does not fit int32")
            self._ids[:T] = a
        cos_p, sin_p = self._rope_rows(cos, sin, pos if rope_pos is None else rope_pos, T)
        n = self._take(pool, table)
        self._fit_chunk(T)
        out = np.empty(self._n_vocab, np.float32) if logits else None
        rc = self._lib.el_chunk_ids(self._npool.ptr, self._layers_p, self.cfg.n_layers, self._dims_p, self._emb_p,
                                    self._ids_p, self._chunk_ptrs[0], T, pos, cos_p, sin_p,
                                    self._k_p, self._v_p, self._kv_type, self._tbl_p, n, self._bt, self._nb,
                                    self._chunk_scratch_p, self._chunk_scratch.nbytes, out_rows,
                                    self._onorm.ctypes.data, self._head_p, self._n_vocab, int(f32act),
                                    None if out is None else out.ctypes.data)
        self._check(rc, "el_chunk_ids", f"{T} tokens at position {pos}", n)
        return out if logits else self._chunk_x[T - out_rows:T]

    def run_tokens(self, first_id: int, pos: int, cos: np.ndarray, sin: np.ndarray, pool, table, n_max: int,
                   stop_ids=(), f32act: bool = True, chain=None, uniforms=None,
                   history=()) -> tuple[list[int], np.ndarray]:
        """Up to n_max decode tokens in one native call: token first_id at position pos, then
        each step's pick fed to the next. The pick is the argmax (numpy's: the first maximum;
        el_decode_greedy), or with chain (a sampling_native.NativeChain) the chain's pick after
        its repetition penalty over `history` (the tokens before first_id's step, as many as
        the penalty covers) and the run's own tokens: a draw with uniforms[i] (n_max of them),
        or a greedy chain's argmax (el_decode_sample). Returns (the ids produced, the last
        step's logits as computed): fewer than n_max after one of stop_ids, or before logits the
        pick cannot use (a NaN; a draw: any non-finite maximum), none when the first step's are.
        Positions pos..pos+n_max-1 must be reserved; cos, sin: the RoPE tables, read in place."""
        if n_max < 1:
            raise ValueError(f"run_tokens needs n_max >= 1, got {n_max}")
        v = int(first_id)
        if not -2 ** 31 <= v < 2 ** 31:
            raise DecodeStepError(f"token id {v} does not fit int32")
        cos_p, sin_p = self._rope_rows(cos, sin, pos, n_max)
        n = self._take(pool, table)
        self._fit_chunk(1)
        stop = np.asarray(stop_ids, np.int32)
        out_ids = np.empty(n_max, np.int32)
        logits = np.empty(self._n_vocab, np.float32)
        args = (self._npool.ptr, self._layers_p, self.cfg.n_layers, self._dims_p, self._emb_p, v, self._chunk_ptrs[0], pos,
                n_max, cos_p, sin_p, self._k_p, self._v_p, self._kv_type, self._tbl_p, n, self._bt, self._nb,
                self._chunk_scratch_p, self._chunk_scratch.nbytes, self._onorm.ctypes.data, self._head_p,
                self._n_vocab, int(f32act), logits.ctypes.data, stop.ctypes.data if stop.size else None,
                int(stop.size), out_ids.ctypes.data)
        if chain is None:
            fn = "el_decode_greedy"
            rc = self._lib.el_decode_greedy(*args)
        else:
            u = None
            if uniforms is not None:
                u = np.ascontiguousarray(uniforms, dtype=np.float64)
                if u.shape != (n_max,):
                    raise ValueError(f"run_tokens needs {n_max} uniforms, got shape {u.shape}")
            hist = np.asarray(history, dtype=np.int64)
            if hist.size and (hist.min() < 0 or hist.max() >= self._n_vocab):
                raise DecodeStepError(f"a history token id of {hist[:8].tolist()} is outside 0..{self._n_vocab - 1}")
            hist = hist.astype(np.int32)
            scratch = chain.scratch(self._n_vocab, hist.size, n_max)
            fn = "el_decode_sample"
            rc = self._lib.el_decode_sample(*args, chain.params_p, None if u is None else u.ctypes.data,
                                            hist.ctypes.data if hist.size else None, int(hist.size),
                                            scratch.ctypes.data, scratch.nbytes)
        if rc < 0:
            self._check(rc, fn, f"{n_max} tokens from position {pos}", n)
        return out_ids[:rc].tolist(), logits

    def _rope_rows(self, cos: np.ndarray, sin: np.ndarray, pos: int, T: int) -> tuple[int, int]:
        """Addresses of rows pos..pos+T-1 of the RoPE tables (positions, rope_dim/2): read in
        place. The pair of tables is checked once (C-contiguous float32 of that width), then
        reused while the same two objects come back (the engine's tables, every step)."""
        if self._rope_tabs[0] is not cos or self._rope_tabs[1] is not sin:
            half = self.cfg.rope_dim // 2
            for name, a in (("cos", cos), ("sin", sin)):
                if not (isinstance(a, np.ndarray) and a.dtype == np.float32 and a.ndim == 2 and a.shape[1] == half
                        and a.flags.c_contiguous):
                    raise ValueError(f"run_ids needs the RoPE tables as C-contiguous float32 (positions, {half}); "
                                     f"{name} is {getattr(a, 'dtype', type(a))} {getattr(a, 'shape', '')}")
            if cos.shape != sin.shape:
                raise ValueError(f"RoPE tables of different shapes {cos.shape}, {sin.shape}")
            self._rope_tabs = (cos, sin, cos.ctypes.data, sin.ctypes.data, len(cos), 4 * half)
        _, _, c0, s0, rows, row_bytes = self._rope_tabs
        if pos < 0 or pos + T > rows:
            raise ValueError(f"positions {pos}..{pos + T - 1} are past the RoPE tables' {rows} rows")
        return c0 + pos * row_bytes, s0 + pos * row_bytes

    def _grow_chunk_buffers(self, T: int, need: int) -> None:
        """The chunk buffers, grown to T rows and `need` scratch bytes and then reused. The old
        ones go first and their freed heap pages back to the OS: glibc serves these sizes from the
        heap once a larger block has been freed, and growing 32 -> 128 -> 256 -> 512 rows left
        ~2 MB of dead buffers resident (SmolLM2)."""
        T = max(T, self._chunk_x.shape[0])
        need = max(need, self._chunk_scratch.nbytes)
        # (empty, not None: an allocation that fails below leaves buffers the next call regrows)
        self._alloc_chunk_buffers(0, 0)
        release_free_pages()
        self._alloc_chunk_buffers(T, need)

    def _alloc_chunk_buffers(self, T: int, need: int) -> None:
        self._chunk_x = np.empty((T, self.cfg.d_model), np.float32)
        self._chunk_rope = np.empty((2, T, self.cfg.rope_dim // 2), np.float32)
        self._chunk_scratch = np.empty(need, np.uint8)
        no_huge_pages(self._chunk_scratch)   # (its fp32 h / act regions are not written for block weights)
        self._chunk_ptrs = (self._chunk_x.ctypes.data, self._chunk_rope[0].ctypes.data,
                            self._chunk_rope[1].ctypes.data)   # rows 0..T-1's first addresses
        self._chunk_scratch_p = self._chunk_scratch.ctypes.data

    def chunk_input(self, T: int) -> np.ndarray:
        """The (T, d) buffer a chunk of T tokens runs in: the caller may write the embeddings
        there (no copy), valid until the next chunk."""
        self._fit_chunk(T)
        return self._chunk_x[:T]

    def chunk_fits(self, T: int) -> bool:
        """Whether the native step takes chunks of T tokens of this model (its buffers' int32
        sizes: T * max(2 ff, qkv width) < 2^31)."""
        return self._lib.el_chunk_scratch(self._dims_p, T) != 0

    def _fit_chunk(self, T: int) -> None:
        """The chunk buffers, grown when T rows need more."""
        need = self._chunk_need.get(T)
        if need is None:   # one ctypes call per chunk size, not per token
            need = self._chunk_need[T] = self._lib.el_chunk_scratch(self._dims_p, T)
        if need == 0:
            raise DecodeStepError(f"el_chunk_scratch rejects a chunk of {T} tokens with dims {self._dims_text()}")
        if self._chunk_x.shape[0] < T or self._chunk_scratch.nbytes < need:
            self._grow_chunk_buffers(T, need)

    def _chunk(self, x, pos, cos, sin, pool, table, logits, f32act, out_rows: int = 1) -> np.ndarray:
        n = self._take(pool, table)
        T = x.shape[0]
        self._fit_chunk(T)
        xb, rope = self._chunk_x[:T], self._chunk_rope[:, :T]
        if x.ctypes.data != xb.ctypes.data:    # (not already written there: chunk_input)
            xb[...] = x
        rope[0], rope[1] = cos, sin
        x_p, cos_p, sin_p = self._chunk_ptrs     # rows 0..T-1 of the buffers: their first addresses
        args = (self._npool.ptr, self._layers_p, self.cfg.n_layers, self._dims_p, x_p, T, pos, cos_p, sin_p,
                self._k_p, self._v_p, self._kv_type, self._tbl_p, n, self._bt, self._nb, self._chunk_scratch_p,
                self._chunk_scratch.nbytes)
        if logits is None:
            rc, fn = self._lib.el_chunk_step_out(*args, out_rows), "el_chunk_step_out"
        else:
            rc, fn = self._lib.el_chunk_logits(*args, self._onorm.ctypes.data, self._head_p, self._n_vocab,
                                               int(f32act), logits.ctypes.data), "el_chunk_logits"
        self._check(rc, fn, f"{T} tokens at position {pos}", n)
        return xb
