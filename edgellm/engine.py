"""The forward pass over layers: chunked prefill with batched GEMMs, and single-token decode.

Model code does not ask which unit it runs on: each op runs on the backend the dispatcher's plan
names for the step's phase (prefill chunk or single-token decode step), with that unit's weights.
"""
from __future__ import annotations

import threading

import numpy as np

from . import backends, interrupts
from .backends import reference
from .chunking import chunk_bounds
from .errors import Cancelled, ConfigError
from .model.loader import ModelFile


class CancelToken:
    """Cancellation handle: checked between prefill chunks (and between layers where a chunk
    runs op by op; a fused native chunk finishes first) and between tokens in decode."""

    def __init__(self):
        self._event = threading.Event()

    def cancel(self) -> None:
        self._event.set()

    @property
    def cancelled(self) -> bool:
        return self._event.is_set()

    def reset(self) -> None:
        self._event.clear()


class ModelRunner:
    """Weights, RoPE tables and the layer loop. KV state lives in per-sequence objects (a block
    pool sequence, a ring buffer) with one interface: n_tokens, reserve(n), write(layer, start,
    k, v), read(layer, n), commit(n, ids), truncate(n), can_truncate(n), max_chunk (None: no
    limit), pool and block_table (the arena attention reads in place) and slides: a ring's
    chunk is stored at cache positions chunk_start(T).. but rotated by its sequence positions
    rope_start(T).., and its sinks' keys are rotated on by sink_shift before attention."""

    def __init__(self, model: ModelFile, max_positions: int, prefill_chunk: int = 512, progress=None,
                 placement: dict[str, dict[str, str]] | None = None, compute=None, short_max: int = 0):
        """placement: phase ("prefill" | "decode") -> op name -> unit name, from the dispatcher's
        plan; None runs every op on the reference backend. compute: a precision_runtime.ComputeTable
        (what the precision plan asks each op to compute in); None: each unit's own precision.
        short_max: a call of 2..short_max tokens runs placement["prefill_short"] (when given)."""
        self.compute = compute
        self.decode_override = None   # a ComputeTable replacing `compute` in decode (quality guard)
        cfg = model.config
        if max_positions < 1:
            raise ConfigError(f"the context must hold >= 1 token, got {max_positions}")
        if prefill_chunk < 1:
            raise ConfigError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        self.cfg = cfg
        self.prefill_chunk = prefill_chunk
        self.placement = placement or {ph: {op: "reference" for op in _OP_NAMES} for ph in ("prefill", "decode")}
        self.short_max = short_max if "prefill_short" in self.placement else 0
        units = dict.fromkeys(u for ph in self.placement.values() for u in ph.values())
        mods = {}
        for u in units:
            mod, why = backends.get(u)
            if mod is None:
                raise ConfigError(f"the plan names unit {u!r}, which cannot be loaded: {why}")
            mods[u] = mod
        # each unit's resident weights, prepared once (progress is reported for the first only)
        runs = {u: {op for ops in self.placement.values() for op, v in ops.items() if v == u} for u in mods}
        weights = {u: m.prepare(model, progress=progress if i == 0 else None, ops=runs[u])
                   for i, (u, m) in enumerate(mods.items())}
        # phase -> op name -> (backend module, its prepared weights)
        self._ops = {ph: {op: (mods[u], weights[u]) for op, u in ops.items()} for ph, ops in self.placement.items()}
        # a unit that holds a phase's whole layer and has a native layer step runs a decode
        # token's (or a prefill chunk's) layers in one call (the dispatcher chose that placement
        # knowing it). _fused_phases: the phases that do.
        self._fused, self._fused_phases = None, set()
        for ph, ops in self.placement.items():
            lay = {ops[op] for op in _LAYER_OPS}
            unit = lay.pop() if len(lay) == 1 else None
            if unit is None or not hasattr(mods[unit], "fused_decode") or not self._native(mods[unit], ph):
                continue
            if self._fused is None:
                self._fused = mods[unit].fused_decode(weights[unit], cfg)
                self._fused_mod, self._fused_unit = mods[unit], unit
            if unit == self._fused_unit:
                self._fused_phases.add(ph)
        if "prefill" in self._fused_phases and not self._fused.chunk_fits(min(prefill_chunk, max_positions)):
            raise ConfigError(f"prefill_chunk {prefill_chunk}: the {self._fused_unit} unit's native step cannot "
                              f"take chunks that long for this model (d_ff {cfg.d_ff}); give a smaller one")
        # phases whose output norm and head the plan put on the fused unit too: they run in the
        # step's own call on the chunk's last row (DecodeStep.run_logits)
        self._fused_tail = {ph for ph in self._fused_phases
                            if self.placement[ph]["output_norm"] == self.placement[ph]["lm_head"] == self._fused_unit
                            and self._steady(ph, "lm_head")}
        # ... and whose embedding lookup it put there: the step starts from the token ids, in the
        # same call (DecodeStep.run_ids)
        self._fused_lead = {ph for ph in self._fused_phases if self.placement[ph]["embedding"] == self._fused_unit}
        rope_freqs = self._rope_freqs = reference.prepare_rope_freqs(model)
        self.cos, self.sin = reference.rope_tables(cfg, max_positions, rope_freqs)  # (positions, rope_dim/2)
        # K/V read buffers reused by every layer and step: (KVH, positions, hd) each. Fresh arrays
        # of this size per read would be returned to the OS and faulted in again each time.
        self._kv_bufs = tuple(np.empty((cfg.n_kv_heads, max_positions, cfg.head_dim), np.float32) for _ in range(2))

    def forward(self, seq, ids: np.ndarray | list[int], *, all_logits: bool = False,
                cancel: CancelToken | None = None, chunk: int | None = None,
                logits: bool = True) -> np.ndarray | None:
        """Append `ids` to `seq` in chunks and return logits: (vocab,) for the last position, or
        (len(ids), vocab) with all_logits; None with logits=False (a warm-up, or a prompt's part
        that more parts follow: the K/V alone, no head). ContextFull before anything is written
        if a chunk does not fit; on cancel the sequence is rolled back to where it was, so it
        stays usable. The last layer computes its output only for the rows whose logits are
        returned (out_rows of _layers): the K/V of every row are stored either way.

        A row's output does not depend on the chunk it runs in (on the fused neon path, bit for
        bit), except in a chunk of one row, which runs the decode kernels (GEMVs, the decode
        attention: another summation order): no chunk of a longer call is left with one row
        (chunk_bounds), and a prompt with one token left to compute takes its last cached one
        back first (take_back_last, in Engine._open_sequence)."""
        one = (isinstance(ids, (list, tuple)) or getattr(ids, "ndim", 0) == 1) and len(ids) == 1
        if (one and logits and not all_logits and "decode" in self._fused_phases
                and "decode" in self._fused_lead and "decode" in self._fused_tail and self.decode_override is None
                and self._fusable(seq)):
            return self._decode_fused(seq, ids, cancel)
        ids = np.asarray(ids, dtype=np.int64)
        if ids.ndim != 1 or len(ids) == 0:
            raise ConfigError("forward needs a non-empty 1-D list of token ids")
        if ids.min() < 0 or ids.max() >= self.cfg.vocab_size:
            bad = int(ids[(ids < 0) | (ids >= self.cfg.vocab_size)][0])
            raise ConfigError(f"token id {bad} is outside the vocabulary (0..{self.cfg.vocab_size - 1})")
        step = min(chunk or self.prefill_chunk, seq.max_chunk or len(ids))
        # one phase per call: a prompt's chunks (a short last one included) run the prefill
        # placement; a single-token call is a decode step
        phase = "decode" if len(ids) == 1 else ("prefill_short" if len(ids) <= self.short_max else "prefill")
        start0 = seq.n_tokens
        outs = []
        # all_logits: each chunk's rows go straight into the result (a list of the chunks' logits
        # and their concatenation, both alive at once, took twice the result: 1.8 GB at 4k tokens)
        every = np.empty((len(ids), self.cfg.vocab_size), np.float32) if all_logits and logits else None
        bounds = chunk_bounds(len(ids), step, seq.max_chunk)
        try:
            for c, c1 in zip(bounds, bounds[1:]):
                part = ids[c:c1]
                if cancel is not None and cancel.cancelled:
                    raise Cancelled("cancelled between prefill chunks")
                interrupts.checkpoint()    # a Ctrl-C held back by the engine's turn stops here
                seq.reserve(len(part))
                fused = phase in self._fused_phases and self._fusable(seq) \
                    and not (phase == "decode" and self.decode_override is not None)
                last = c1 >= len(ids)
                if fused and last and logits and not all_logits and phase in self._fused_tail:
                    outs.append(self._fused_step(seq, part, phase, logits=True)[None])
                    seq.commit(seq.n_tokens + len(part), part)
                    continue
                # the rows whose last-layer output the head reads
                out_rows = len(part) if all_logits else int(last and logits)
                h = self._fused_step(seq, part, phase, out_rows=out_rows) if fused \
                    else self._layers(seq, part, cancel, phase, out_rows=out_rows)
                seq.commit(seq.n_tokens + len(part), part)
                if out_rows and every is not None:
                    every[c:c1] = self._head(h, phase, seq.n_tokens)
                elif out_rows:
                    outs.append(self._head(h, phase, seq.n_tokens))
        except Cancelled:
            seq.truncate(seq.n_tokens)  # drop the pending chunk: always exact
            # earlier chunks of this call: a pool drops them; a ring that already evicted for them
            # cannot restore what it evicted, so it keeps them (the caller decides: the engine frees it)
            if seq.can_truncate(start0):
                seq.truncate(start0)
            raise
        if every is not None:
            return every
        if not outs:
            return None
        out = np.concatenate(outs) if len(outs) > 1 else outs[0]
        return out if all_logits else out[0]

    @staticmethod
    def take_back_last(seq) -> int | None:
        """Drop seq's last token and return its id, for a prompt that has one token left to
        compute (the rest from the prefix cache): computed alone, that token would run the
        decode kernels, so its logits, then the text, would differ from those of the same
        prompt computed at once; with the token before it, it runs the prefill's. None (nothing
        dropped) where that is not exact: an empty sequence, a ring that evicted, an id not
        recorded. (A shared last block is copied on the write, as any write into it is.)"""
        n = seq.n_tokens
        if n < 1 or getattr(seq, "total_tokens", n) != n:
            return None
        tokens = seq.tokens
        last = int(tokens[-1]) if len(tokens) == n else -1   # (before truncate: the list may be seq's own)
        if last < 0 or not seq.can_truncate(n - 1):
            return None
        seq.truncate(n - 1)
        return last

    def _decode_fused(self, seq, ids, cancel: CancelToken | None) -> np.ndarray:
        """forward's decode token when the whole step (lookup, layers, tail) is one fused call:
        the call the loop below would make, without its numpy work around it. That work cost
        ~80 us of a ~2.5 ms SmolLM2 token: the interpreter's code and data are cold after the
        step streams ~100 MB of weights, so each small numpy call costs several times its warm
        time."""
        t = int(ids[0])
        if not 0 <= t < self.cfg.vocab_size:
            raise ConfigError(f"token id {t} is outside the vocabulary (0..{self.cfg.vocab_size - 1})")
        if cancel is not None and cancel.cancelled:
            raise Cancelled("cancelled between prefill chunks")
        n = seq.n_tokens
        seq.reserve(1)
        if seq.slides:
            out = self._fused_step(seq, ids, "decode", logits=True)
            seq.commit(n + 1, (t,))
            return out
        out = self._fused.run_ids((t,), n, self.cos, self.sin, seq.pool, seq.block_table,
                                  f32act=self._head_f32act("decode"))
        seq.commit(n + 1, (t,))
        return out

    def can_decode_run(self, seq) -> bool:
        """Whether decode_run can run on `seq`: the decode step is one fused call from the token
        id to the logits (and the sequence a block pool's)."""
        return self.decode_run_blocker(seq) is None

    def decode_run_blocker(self, seq) -> str | None:
        """Why decode_run cannot run on `seq`, or None."""
        if "decode" not in self._fused_phases:
            return "decode is not one fused native step in this plan"
        if "decode" not in self._fused_lead or "decode" not in self._fused_tail:
            return "the plan puts decode's embedding or head on another unit than its layers"
        if self.decode_override is not None:
            return "decode runs at another precision than the plan's"
        if seq.slides:
            return "the ring buffer moves its window between tokens"
        if not self._fusable(seq):
            return "the fused step cannot read this KV cache"
        return None

    def decode_run(self, seq, tok: int, n_max: int, stop_ids=(), chain=None, uniforms=None,
                   history=()) -> tuple[list[int], np.ndarray]:
        """Feeds `tok`, then the tokens picked after it, up to n_max decode steps in one native
        call (no Python between the tokens): returns the tokens produced (each the argmax of the
        logits after the one before, or with a chain its pick: DecodeStep.run_tokens; it stops
        after one of stop_ids) and the last step's logits. The sequence commits the tokens
        fed: tok and every produced token but the last, which, as forward's caller does with a
        sampled token, the next call feeds. Nothing is committed when nothing was produced (the
        first logits could not be picked from: forward then reports them)."""
        if not 0 <= tok < self.cfg.vocab_size:
            raise ConfigError(f"token id {tok} is outside the vocabulary (0..{self.cfg.vocab_size - 1})")
        n0 = seq.n_tokens
        seq.reserve(n_max)
        ids, logits = self._fused.run_tokens(tok, n0, self.cos, self.sin, seq.pool, seq.block_table, n_max, stop_ids,
                                             f32act=self._head_f32act("decode"), chain=chain, uniforms=uniforms,
                                             history=history)
        fed = [tok] + ids[:-1] if ids else []
        seq.commit(n0 + len(fed), fed)
        return ids, logits

    def _rope_src(self, seq, T: int) -> tuple[np.ndarray, np.ndarray, int]:
        """(cos, sin, row): RoPE tables whose rows row..row+T-1 rotate the reserved chunk. A pool
        chunk's positions are its cache positions, in the tables; a ring's are its sequence
        positions, computed when they run past the tables (the chat goes on, the tables do not)."""
        if not seq.slides:
            return self.cos, self.sin, seq.n_tokens
        p = seq.rope_start(T)
        if p + T <= len(self.cos):
            return self.cos, self.sin, p
        cos, sin = reference.rope_rows(self.cfg, np.arange(p, p + T), self._rope_freqs)
        return cos, sin, 0

    def _shift_sinks(self, seq) -> None:
        """A ring's sinks sit sink_shift positions closer to its window than in the sequence:
        rotate their exact keys on by that much (once per shift; kv/ring.py's docstring)."""
        shift = seq.sink_shift
        if seq.sinks_at == shift:
            return
        k = seq.sink_keys()                                                    # (sinks, L, KVH, hd)
        if len(k) and shift:
            cfg = self.cfg
            cos, sin = reference.rope_rows(cfg, np.full(1, shift), self._rope_freqs, rotation_only=True)
            rows = k.reshape(-1, cfg.n_kv_heads, cfg.head_dim)
            k = reference.rope(rows, np.broadcast_to(cos, (len(rows), cos.shape[1])),
                               np.broadcast_to(sin, (len(rows), sin.shape[1])), cfg.rope_style).reshape(k.shape)
        seq.set_sink_keys(k, shift)

    def _layers(self, seq, ids: np.ndarray, cancel: CancelToken | None, phase: str = "prefill",
                out_rows: int | None = None) -> np.ndarray:
        """One chunk through every layer -> the last layer's output of the chunk's last out_rows
        rows (default all), (out_rows, d). The chunk is stored at cache positions (a pool's are its
        sequence positions; a ring's start at chunk_start) and rotated by its sequence positions.
        The last layer stores every row's K/V, then runs its attention output and FFN on the
        returned rows only, as the fused step does (el_chunk_step_out)."""
        cfg = self.cfg
        T = len(ids)
        out_rows = T if out_rows is None else out_rows
        P = self._ops[phase]
        start = seq.chunk_start(T) if seq.slides else seq.n_tokens            # cache position
        n = start + T                                                         # keys visible to the chunk
        kw = self._precision_kwargs(phase, n)                                 # op -> per-layer kwargs
        if seq.slides:
            self._shift_sinks(seq)
        ctab, stab, row = self._rope_src(seq, T)
        cos, sin = ctab[row:row + T], stab[row:row + T]
        be, w = P["embedding"]
        x = be.embedding(w.embedding, ids)                                   # (T, d)
        q_end, k_end = cfg.q_dim, cfg.q_dim + cfg.kv_dim
        (norm1, wn1), (mqkv, wqkv), (mrope, _), (matt, _), (mo, wo), (madd1, _), (norm2, wn2), \
            (mgu, wgu), (mswi, _), (mdown, wdown), (madd2, _) = (P[op] for op in _LAYER_OPS)
        # a unit that holds the FFN's three ops and has a fused FFN call (an NPU subgraph) runs them
        # in one call: the intermediate never comes back to the host
        ffn_fused = mgu is mswi is mdown and hasattr(mgu, "ffn")
        # a unit that reads the KV pool's blocks itself skips the gather into fp32 buffers
        from_pool = hasattr(matt, "attention_pool") and matt.can_read_pool(seq.pool)
        table = np.asarray(seq.block_table, dtype=np.int32) if from_pool else None
        for li in range(cfg.n_layers):
            if cancel is not None and cancel.cancelled:
                raise Cancelled("cancelled during prefill")
            h = norm1.rmsnorm(x, wn1.layers[li].attn_norm, cfg.norm_eps)
            lq = wqkv.layers[li]
            qkv = mqkv.matmul(h, lq.wqkv, lq.bqkv, **kw["qkv"][li])           # (T, q_dim + 2 kv_dim)
            q = mrope.rope(qkv[:, :q_end].reshape(T, cfg.n_heads, cfg.head_dim), cos, sin, cfg.rope_style)
            k = qkv[:, q_end:k_end].reshape(T, cfg.n_kv_heads, cfg.head_dim)
            v = qkv[:, k_end:].reshape(T, cfg.n_kv_heads, cfg.head_dim)
            seq.write(li, start, mrope.rope(k, cos, sin, cfg.rope_style), v)
            qs = start                                                        # the first query row's position
            if li == cfg.n_layers - 1 and out_rows < T:                       # only these rows go on
                if out_rows == 0:
                    return x[:0]
                q, x, qs = q[T - out_rows:], x[T - out_rows:], start + T - out_rows
            if from_pool:
                att = matt.attention_pool(q, seq.pool, table, li, qs)         # (rows, q_dim)
            else:
                kc, vc = seq.read(li, n, out=self._kv_bufs)                   # (KVH, n, hd) views
                att = matt.attention(q, kc, vc, qs)                           # (rows, q_dim)
            x = madd1.add(x, mo.matmul(att, wo.layers[li].wo, **kw["attn_out"][li]))
            h = norm2.rmsnorm(x, wn2.layers[li].ffn_norm, cfg.norm_eps)
            if ffn_fused:
                x = madd2.add(x, mgu.ffn(h, wgu.layers[li]))
            else:
                x = madd2.add(x, mdown.matmul(mswi.swiglu(mgu.matmul(h, wgu.layers[li].w_gate_up,
                                                                     **kw["ffn_gate_up"][li])),
                                              wdown.layers[li].w_down, **kw["ffn_down"][li]))
        return x

    def _fusable(self, seq) -> bool:
        return self._fused_mod.can_read_pool(seq.pool)

    def _fused_step(self, seq, ids: np.ndarray, phase: str, logits: bool = False,
                    out_rows: int | None = None) -> np.ndarray:
        """A decode token or a prefill chunk through every layer in one native call (positions
        reserved by the caller). Cancellation is checked between chunks, not inside one. logits:
        the model's tail (output norm, head) in the same call, returning the (vocab,) logits of
        the chunk's last position, the head computing in the precision the plan asks of it."""
        T = len(ids)
        pos = seq.chunk_start(T) if seq.slides else seq.n_tokens              # cache position
        if seq.slides:
            self._shift_sinks(seq)
        ctab, stab, row = self._rope_src(seq, T)
        if phase in self._fused_lead:
            return self._fused.run_ids(ids, pos, ctab, stab, seq.pool, seq.block_table, logits=logits,
                                       f32act=self._head_f32act(phase), out_rows=out_rows, rope_pos=row)
        cos, sin = ctab[row:row + T], stab[row:row + T]
        be, w = self._ops[phase]["embedding"]
        # a chunk's embeddings go straight into the step's input buffer: no (T, d) copy beside it
        x = be.embedding(w.embedding, ids, out=self._fused.chunk_input(T) if T > 1 else None)   # (T, d)
        if logits:
            return self._fused.run_logits(x, pos, cos, sin, seq.pool, seq.block_table,
                                          f32act=self._head_f32act(phase))
        if T == 1:
            return self._fused.run(x, pos, cos[0], sin[0], seq.pool, seq.block_table).copy()
        return self._fused.run_chunk(x, pos, cos, sin, seq.pool, seq.block_table, out_rows=out_rows)

    def _head_f32act(self, phase: str) -> bool:
        """Whether the fused step's head keeps its input row in fp32 (the plan's ask for lm_head)."""
        return self._precision_kwargs(phase, 0)["lm_head"][0].get("precision", "fp32") == "fp32"

    def _head(self, x: np.ndarray, phase: str, tokens: int) -> np.ndarray:
        """tokens: the sequence's length after the step (a precision plan's sequence policies)."""
        P = self._ops[phase]
        (mn, wn), (mh, wh) = P["output_norm"], P["lm_head"]
        kw = self._precision_kwargs(phase, tokens)["lm_head"][0]
        return mh.lm_head(mn.rmsnorm(x, wn.output_norm, self.cfg.norm_eps), wh.lm_head, **kw)

    def _table(self, phase: str):
        return self.decode_override if (phase == "decode" and self.decode_override is not None) else self.compute

    @staticmethod
    def _plan_phase(phase: str) -> str:
        return "prefill" if phase == "prefill_short" else phase

    def _precision_kwargs(self, phase: str, tokens: int) -> dict[str, list[dict]]:
        """matmul op -> per-layer keyword arguments: {"precision": p} for a unit with a choice of
        kernels (QUANT_COMPUTE), the plan's ask or the nearest above it; {} otherwise."""
        table = self._table(phase)
        key = (phase, id(table), table and sum(tokens >= s.min_tokens for s in table.plan.sequence))
        cache = self.__dict__.setdefault("_kw_cache", {})
        if key in cache:                   # per step: the table is resolved once per key
            return cache[key]
        from .precision_runtime import effective

        n = self.cfg.n_layers
        out = cache[key] = {}
        for op in _MATMUL_OPS:
            mod = self._ops[phase][op][0]
            choices = getattr(mod, "QUANT_COMPUTE", None)
            if table is None or choices is None:
                out[op] = [{}] * (n if op != "lm_head" else 1)
                continue
            out[op] = [{"precision": effective(a, choices) or choices[0]}
                       for a in table.asked(self._plan_phase(phase), op, tokens)]
        return out

    def _native(self, mod, phase: str) -> bool:
        """Whether the plan lets `mod`'s fused step (int8 activations in every layer matmul) run,
        at every sequence length: a sequence policy that raises a matmul past some length (its
        asks at 0 tokens said int8) kept the fused step at int8 there."""
        from .precision_runtime import effective

        choices = getattr(mod, "QUANT_COMPUTE", None)
        if self.compute is None or choices is None:
            return True
        return all(effective(a, choices) == choices[0] for op in _MATMUL_OPS if op != "lm_head"
                   for t in self._thresholds() for a in self.compute.asked(self._plan_phase(phase), op, t))

    def _thresholds(self) -> tuple[int, ...]:
        """The sequence lengths where the plan's asks can change: 0 and each policy's min_tokens."""
        return (0, *(s.min_tokens for s in self.compute.plan.sequence)) if self.compute is not None else (0,)

    def _steady(self, phase: str, op: str) -> bool:
        """Whether the plan asks the same of `op` at every sequence length (the fused step's head
        takes one precision for the whole call)."""
        if self.compute is None:
            return True
        return len({self.compute.asked(self._plan_phase(phase), op, t) for t in self._thresholds()}) == 1


# the engine's op sequence; the names are ops.layer_ops / ops.model_ops names
_LAYER_OPS = ("attn_norm", "qkv", "rope", "attention", "attn_out", "attn_add", "ffn_norm", "ffn_gate_up",
              "swiglu", "ffn_down", "ffn_add")
_OP_NAMES = ("embedding", *_LAYER_OPS, "output_norm", "lm_head")
_MATMUL_OPS = ("qkv", "attn_out", "ffn_gate_up", "ffn_down", "lm_head")
