"""Sensitivity measurement: how much each layer/op's quantization moves the next-token distribution.

For one (layer, op) at a time, analyze() replaces that op's weight matrix in the reference unit's
prepared fp32 weights by `requant.convert(W, fmt).dequantized` (the values a kernel reading
`fmt` computes with), runs the calibration tokens through the model, and records the mean over
positions of KL(reference || quantized) of the next-token distributions, plus the conversion's
SQNR. Activation sensitivity wraps the op's matmul so that its input is fake-quantized (int8:
symmetric blocks of 32, d = max|x| / 127, round to nearest even, as the neon unit's el_quant_row
does) and measures the same KL. Every other op stays as loaded, so each entry is the error of one
change alone; summing entries is the (first-order) estimate the precision search uses.

The reference is the engine as loaded: weights in the GGUF's own format, dequantized to fp32,
and fp32 activations. A swap never writes into an array: the runner's (module, weights) entry for
the op is replaced by a copy of the PreparedWeights that differs in one matrix, and the original
entry is put back in a `finally`, so the engine is bit-for-bit what it was afterwards.

Results are cached per model under edgellm_home()/cache/precision/, keyed by the model file's
sha256, the calibration text's sha256 and the analysis parameters.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Sequence

import numpy as np

from . import requant
from .backends import reference
from .errors import ConfigError
from .fileio import read_capped, write_atomic
from .model.ggml_types import GGMLQuantizationType

__all__ = ["analyze", "Sensitivity", "Entry", "Skipped", "cache_dir", "cache_path", "forward_passes",
           "fake_quant_int8", "ANALYZED_OPS", "ACTIVATION_FORMATS", "DEFAULT_FORMATS", "DEFAULT_OPS"]

log = logging.getLogger("edgellm")

# 2: lm_head weight entries of a model with tied embeddings quantize the embedding lookup too
# (schema 1 measured the head's matmul alone and understated them); entries are checked on read
SCHEMA_VERSION = 2
# op name (precision plan / engine) -> the field of the reference unit's prepared weights holding
# its matrix: a LayerWeights field, or the PreparedWeights field for lm_head (a model op)
_WEIGHT_FIELD = {"qkv": "wqkv", "attn_out": "wo", "ffn_gate_up": "w_gate_up", "ffn_down": "w_down",
                 "lm_head": "lm_head"}
ANALYZED_OPS = tuple(_WEIGHT_FIELD)
MODEL_LEVEL_OPS = ("lm_head",)        # measured once, layer None
ACTIVATION_FORMATS = ("int8", "fp16")
DEFAULT_FORMATS = ("q8_0", "int8", "q4_0", "int4-32")
DEFAULT_OPS = ANALYZED_OPS
ACT_BLOCK = 32                        # int8 activation block along K, as the neon unit's kernels
# A mean KL below zero is fp64 rounding of a sum over the vocabulary (at most ~1e-15 nats for
# identical distributions); further below, it is no measurement.
KL_ROUNDING = 1e-9


# -- results -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Entry:
    layer: int | None        # decoder layer index; None for lm_head
    op: str                  # a name in ANALYZED_OPS
    kind: str                # "weights" (the matrix converted) | "activations" (the op's input)
    format: str              # weights: a requant.FORMATS name; activations: ACTIVATION_FORMATS
    kl: float                # mean over positions of KL(reference || changed), nats
    sqnr_db: float           # weights: of the converted matrix; activations: of the op's inputs
                             # over the whole run (dB; inf = exact)


@dataclass(frozen=True)
class Skipped:
    layer: int | None        # as Entry
    op: str
    kind: str
    format: str
    reason: str              # why it was not measured (e.g. K not a multiple of the group size)


@dataclass(frozen=True)
class Sensitivity:
    model_sha256: str                    # sha256 of the GGUF file the engine loaded
    calibration_sha256: str              # sha256 of the calibration text (UTF-8)
    n_layers: int                        # decoder layers of the model
    n_tokens: int                        # calibration tokens run per forward pass
    formats: tuple[str, ...]             # candidate weight formats
    ops: tuple[str, ...]                 # ops analyzed
    activations: tuple[str, ...]         # candidate activation formats
    entries: tuple[Entry, ...]           # one per measurement, in measurement order
    skipped: tuple[Skipped, ...] = ()    # combinations that could not be measured, with reasons
    forward_passes: int = 0              # forward passes the analysis ran (baseline included)
    from_cache: bool = dataclasses.field(default=False, compare=False)   # this call read it back (not stored)
    seconds: float = 0.0                 # wall time of the analysis (not of a cache read)
    tied_embeddings: bool = False        # the head is the embedding table: its weight entries
                                         # quantized the lookup too (one tensor holds both)

    def get(self, layer: int | None, op: str, fmt: str, kind: str = "weights") -> Entry:
        for e in self.entries:
            if (e.layer, e.op, e.format, e.kind) == (layer, op, fmt, kind):
                return e
        raise KeyError(f"no {kind} entry for layer {layer} op {op} format {fmt}")

    def ranked(self, kind: str = "weights") -> list[Entry]:
        """Entries of `kind`, most sensitive (largest KL) first."""
        return sorted((e for e in self.entries if e.kind == kind), key=lambda e: -e.kl)

    def to_json(self) -> str:
        d = dataclasses.asdict(self)
        d.pop("from_cache")
        d["schema"] = SCHEMA_VERSION
        for e in d["entries"]:
            e["sqnr_db"] = _enc_float(e["sqnr_db"])
            e["kl"] = _enc_float(e["kl"])
        return json.dumps(d, indent=1, allow_nan=False)

    @classmethod
    def from_json(cls, text: str) -> "Sensitivity":
        """Parse to_json()'s output; ValueError naming the field for anything else."""
        d = json.loads(text)
        if not isinstance(d, dict):
            raise ValueError(f"expected a JSON object, found {type(d).__name__}")
        if d.get("schema") != SCHEMA_VERSION:
            raise ValueError(f"schema: expected {SCHEMA_VERSION}, found {d.get('schema')!r}")

        def field(obj: dict, name: str, types: type | tuple, where: str):
            if name not in obj:
                raise ValueError(f"{where}{name}: missing")
            v = obj[name]
            if isinstance(v, bool) or not isinstance(v, types):
                raise ValueError(f"{where}{name}: expected {types}, found {v!r}")
            return v

        def strs(name: str) -> tuple[str, ...]:
            v = field(d, name, list, "")
            if not all(isinstance(s, str) for s in v):
                raise ValueError(f"{name}: expected a list of strings")
            return tuple(v)

        def layer(obj: dict, where: str) -> int | None:
            v = obj.get("layer", "missing")
            if v is None or (isinstance(v, int) and not isinstance(v, bool) and v >= 0):
                return v
            raise ValueError(f"{where}layer: expected an integer >= 0 or null, found {v!r}")

        entries = []
        for i, e in enumerate(field(d, "entries", list, "")):
            w = f"entries.{i}."
            if not isinstance(e, dict):
                raise ValueError(f"{w[:-1]}: expected an object")
            kind = field(e, "kind", str, w)
            if kind not in ("weights", "activations"):
                raise ValueError(f"{w}kind: expected weights or activations, found {kind!r}")
            entries.append(Entry(layer(e, w), field(e, "op", str, w), kind, field(e, "format", str, w),
                                 _dec_float(field(e, "kl", (int, float, str), w), w + "kl"),
                                 _dec_float(field(e, "sqnr_db", (int, float, str), w), w + "sqnr_db")))
        skipped = []
        for i, s in enumerate(field(d, "skipped", list, "")):
            w = f"skipped.{i}."
            if not isinstance(s, dict):
                raise ValueError(f"{w[:-1]}: expected an object")
            skipped.append(Skipped(layer(s, w), field(s, "op", str, w), field(s, "kind", str, w),
                                   field(s, "format", str, w), field(s, "reason", str, w)))
        tied = d.get("tied_embeddings", "missing")
        if not isinstance(tied, bool):
            raise ValueError(f"tied_embeddings: expected a boolean, found {tied!r}")
        s = cls(model_sha256=field(d, "model_sha256", str, ""),
                   calibration_sha256=field(d, "calibration_sha256", str, ""),
                   n_layers=field(d, "n_layers", int, ""), n_tokens=field(d, "n_tokens", int, ""),
                   formats=strs("formats"), ops=strs("ops"), activations=strs("activations"),
                   entries=tuple(entries), skipped=tuple(skipped),
                   forward_passes=field(d, "forward_passes", int, ""),
                   seconds=float(field(d, "seconds", (int, float), "")), tied_embeddings=tied)
        _check_measured(s)
        return s


def _check_measured(s: Sensitivity) -> None:
    """ValueError unless the entries are the measurements the header claims: exactly one entry
    (or skip) per (layer, op, kind, format) of its n_layers, ops, formats and activations, each
    with a finite KL >= 0 and an SQNR that is a number. The search trusts them: a NaN KL made it
    ignore its budget, and a missing entry reads as a change it may not make, silently."""
    claimed = {(li, op, kind, fmt)
               for op in s.ops for li in ((None,) if op in MODEL_LEVEL_OPS else range(s.n_layers))
               for kind, fmts in (("weights", s.formats), ("activations", s.activations)) for fmt in fmts}
    seen = set()
    for where, items in (("entries", s.entries), ("skipped", s.skipped)):
        for i, e in enumerate(items):
            key = (e.layer, e.op, e.kind, e.format)
            if key not in claimed:
                raise ValueError(f"{where}.{i}: layer {e.layer} op {e.op} {e.kind} {e.format} is outside the "
                                 f"analysis ({s.n_layers} layers; ops {', '.join(s.ops)}; formats "
                                 f"{', '.join(s.formats)}; activations {', '.join(s.activations) or 'none'})")
            if key in seen:
                raise ValueError(f"{where}.{i}: layer {e.layer} op {e.op} {e.kind} {e.format} appears twice")
            seen.add(key)
            if where == "entries" and not (math.isfinite(e.kl) and e.kl >= -KL_ROUNDING):
                raise ValueError(f"{where}.{i}.kl: expected a finite KL >= 0, found {e.kl!r}")
            if where == "entries" and math.isnan(e.sqnr_db):
                raise ValueError(f"{where}.{i}.sqnr_db: expected a number, found nan")
    missing = sorted(claimed - seen, key=lambda k: (k[0] is None, k[0] or 0, k[1:]))
    if missing:
        li, op, kind, fmt = missing[0]
        raise ValueError(f"{len(missing)} of the {len(claimed)} measurements it claims are missing "
                         f"(first: layer {li} op {op} {kind} {fmt})")


def _enc_float(x: float):
    # JSON has no inf/nan; an exact conversion's SQNR is inf
    return x if math.isfinite(x) else repr(float(x))


def _dec_float(v, where: str) -> float:
    if isinstance(v, str):
        if v not in ("inf", "-inf", "nan"):
            raise ValueError(f"{where}: expected a number, 'inf' or '-inf', found {v!r}")
        return float(v)
    return float(v)


# -- cost --------------------------------------------------------------------------------------


def forward_passes(n_layers: int, ops: Sequence[str], formats: Sequence[str],
                   activations: Sequence[str]) -> int:
    """Forward passes analyze() runs (each over the whole calibration text, all logits):
    1 baseline + (n_layers * layer ops + model ops) * (len(formats) + len(activations)).
    Skipped combinations (a format whose block does not divide K) cost none."""
    sites = n_layers * sum(op not in MODEL_LEVEL_OPS for op in ops) + sum(op in MODEL_LEVEL_OPS for op in ops)
    return 1 + sites * (len(formats) + len(activations))


# -- cache -------------------------------------------------------------------------------------


def cache_dir() -> Path:
    from .model.registry import edgellm_home

    return edgellm_home() / "cache" / "precision"


def _cache_key(model_sha: str, calib_sha: str, formats, ops, activations, n_tokens: int) -> str:
    desc = json.dumps({"schema": SCHEMA_VERSION, "model": model_sha, "calibration": calib_sha,
                       "formats": list(formats), "ops": list(ops), "activations": list(activations),
                       "n_tokens": n_tokens}, sort_keys=True)
    return hashlib.sha256(desc.encode()).hexdigest()


_MAX_CACHE_BYTES = 64 << 20   # a table is a few hundred KB (layers x ops x formats)


def cache_path(model_sha: str, key: str) -> Path:
    return cache_dir() / f"{model_sha[:16]}-{key[:24]}.json"


def _read_cache(path: Path, expect: dict) -> Sensitivity | None:
    """The cached result, or None for a miss. A file that cannot be parsed or describes another
    analysis is a miss with one warning line (it is recomputed and overwritten), never an error."""
    try:
        # capped and non-blocking: a FIFO there hung `precision analyze`, /dev/zero ran out of memory
        raw = read_capped(path, _MAX_CACHE_BYTES)
        digest, _, body = raw.partition(b"\n")
        text = body.decode("utf-8")
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as e:
        log.warning("sensitivity cache miss: %s: unreadable (%s); recomputing", path, e)
        return None
    if digest != hashlib.sha256(body).hexdigest().encode():
        # (a table with every KL edited to 99 was read as measured, and plans were made from it)
        log.warning("sensitivity cache miss: %s: its checksum does not match (edited, damaged, or written by an "
                    "older edgellm); recomputing", path)
        return None
    try:
        s = Sensitivity.from_json(text)
        for k, v in expect.items():
            if getattr(s, k) != v:
                raise ValueError(f"{k}: expected {v!r}, found {getattr(s, k)!r}")
    except (ValueError, TypeError) as e:   # json.JSONDecodeError is a ValueError
        log.warning("sensitivity cache miss: %s: corrupt or stale (%s); recomputing", path, e)
        return None
    except (RecursionError, MemoryError, KeyError, AttributeError, OverflowError) as e:
        # json.loads recurses once per nesting level: a file of '[' * 200000 exhausts the
        # interpreter stack. Whatever the cache file holds, it is only a cache: a miss.
        log.warning("sensitivity cache miss: %s: corrupt (%s: %s); recomputing", path,
                    type(e).__name__, str(e)[:200])
        return None
    return s


def _write_cache(path: Path, s: Sensitivity) -> None:
    """Atomic: a reader sees the old file or the whole new one. A failure to write is logged and
    ignored (the result is still returned; the cache only saves time)."""
    body = s.to_json().encode("utf-8")
    try:   # (its sha256 on the first line, then the table)
        write_atomic(path, hashlib.sha256(body).hexdigest().encode() + b"\n" + body)
    except OSError as e:
        log.warning("sensitivity cache not written: %s: %s", path, e)


# -- activation fake quantization --------------------------------------------------------------


def fake_quant_int8(x: np.ndarray, block: int = ACT_BLOCK) -> np.ndarray:
    """x (T, K) fp32 -> the fp32 values an int8 kernel sees: per block of `block` along K,
    d = max|x| / 127 (fp32), q = round-to-nearest-even(x / d) clipped to [-127, 127], x' = q d.
    The multiply by 1/d (not a divide) and the rounding rule are the neon unit's el_quant_row.
    A last partial block (K not a multiple of `block`) is its own block."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    t, k = x.shape
    pad = (-k) % block
    xp = np.pad(x, ((0, 0), (0, pad))) if pad else x
    xb = xp.reshape(t, -1, block)                                            # (T, K/block, block)
    d = (np.abs(xb).max(axis=2) / np.float32(127.0)).astype(np.float32)     # (T, K/block)
    with np.errstate(divide="ignore"):
        inv = np.where(d != 0, np.float32(1.0) / d, np.float32(0.0)).astype(np.float32)
    q = np.clip(np.rint(xb * inv[..., None]), -127, 127)
    out = (q * d[..., None]).astype(np.float32).reshape(t, -1)
    return out[:, :k] if pad else out


def _fake_quant(x: np.ndarray, fmt: str) -> np.ndarray:
    if fmt == "int8":
        return fake_quant_int8(x)
    return np.asarray(x, dtype=np.float32).astype(np.float16).astype(np.float32)  # fp16


class _ActQuantUnit:
    """Stands in for the reference module on one op: fake-quantizes the input of the matmul whose
    weight is `target` (the engine calls one module for every layer's op, so the weight's identity
    picks the layer) and accumulates the input SQNR."""

    def __init__(self, base, target: np.ndarray, fmt: str):
        self._base, self._target, self._fmt = base, target, fmt
        self.signal = self.error = 0.0

    def _q(self, x: np.ndarray, w: np.ndarray) -> np.ndarray:
        if w is not self._target:
            return x
        xq = _fake_quant(x, self._fmt)
        d = x.astype(np.float64) - xq
        self.signal += float(np.sum(np.square(x, dtype=np.float64)))
        self.error += float(np.sum(d * d))
        return xq

    def matmul(self, x, w, b=None):
        return self._base.matmul(self._q(x, w), w, b)

    def lm_head(self, x, w):
        return self._base.lm_head(self._q(x, w), w)

    def sqnr_db(self) -> float:
        if self.error == 0.0:
            return math.inf
        return -math.inf if self.signal == 0.0 else 10.0 * math.log10(self.signal / self.error)


# -- the analysis ------------------------------------------------------------------------------


def _log_softmax64(logits: np.ndarray) -> np.ndarray:
    x = np.asarray(logits, dtype=np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def _mean_kl(ref_lp: np.ndarray, ref_p: np.ndarray, logits: np.ndarray) -> float:
    """mean over positions of sum_v p(v) (log p(v) - log q(v)); exactly 0 for identical logits."""
    return float(np.mean(np.sum(ref_p * (ref_lp - _log_softmax64(logits)), axis=-1)))


def mean_kl(ref_logits: np.ndarray, logits: np.ndarray) -> float:
    """Mean over positions of KL(softmax(ref_logits) || softmax(logits)), in float64."""
    ref_lp = _log_softmax64(ref_logits)
    return _mean_kl(ref_lp, np.exp(ref_lp), logits)


def _check_names(values: Iterable[str], allowed: Sequence[str], what: str) -> tuple[str, ...]:
    if isinstance(values, str):
        values = (values,)
    out = tuple(values)
    bad = [v for v in out if v not in allowed]
    if bad:
        raise ConfigError(f"unknown {what} {bad[0]!r}; expected some of {', '.join(allowed)}")
    if len(set(out)) != len(out):
        raise ConfigError(f"{what}s listed twice: {', '.join(out)}")
    return out


def analyze(engine, text: str, *, formats: Sequence[str] = DEFAULT_FORMATS,
            ops: Sequence[str] = DEFAULT_OPS, activations: Sequence[str] = ("int8",),
            max_tokens: int = 256, progress: Callable[[int, int], None] | None = None,
            cache: bool = True) -> Sensitivity:
    """Measure each (layer, op)'s sensitivity to each weight format and activation format.

    engine: an edgellm Engine whose ops in `ops` run on the reference unit (load with
    units=["reference"]); it is left exactly as it was. text: the calibration text
    (edgellm.calibration.load_calibration()); its first `max_tokens` tokens are used (fewer if
    the context is smaller). formats: requant.FORMATS names ("f32" measures the harness: KL 0);
    ops: names in ANALYZED_OPS (lm_head is measured once, layer None; for a model with tied
    embeddings its weight formats change the embedding lookup too, which reads the same tensor:
    requant.plan_formats stores the one token_embd.weight in the head's format; its activation
    formats change the head's input only); activations: names in ACTIVATION_FORMATS.
    progress(done, total) is called after each measurement.

    Cost: forward_passes(n_layers, ops, formats, activations) forward passes over n_tokens
    tokens with all logits, i.e. 1 + (n_layers * layer_ops + model_ops) * (formats +
    activations); SmolLM2-135M (30 layers), the 5 default ops, 4 formats and int8 activations:
    1 + (30*4 + 1) * 5 = 606 passes. Measured on a shared 2-core x86 host, reference unit, 128
    tokens: ~1.2 s per forward pass plus ~0.6 s for the fp64 KL over the 49152-token vocabulary
    when idle, ~5 s per pass under load (121 passes in 654 s). Plus one requant.convert per
    (matrix, format), ~20 ms for a SmolLM2-135M layer matrix. A cached
    result (same model file, calibration text and parameters) costs none: it is read from
    cache_dir() unless cache=False.
    """
    formats = _check_names(formats, requant.FORMATS, "weight format")
    ops = _check_names(ops, ANALYZED_OPS, "op")
    activations = _check_names(activations, ACTIVATION_FORMATS, "activation format")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 2:
        raise ConfigError(f"max_tokens must be an integer >= 2, got {max_tokens!r}")
    if not isinstance(text, str) or not text.strip():
        raise ConfigError("the calibration text is empty")
    runner = engine.runner
    cfg = runner.cfg
    tied = cfg.tied_embeddings and "lm_head" in ops
    for op in ops + (("embedding",) if tied else ()):
        for phase, table in runner._ops.items():
            mod, w = table[op]
            if mod is not reference:
                raise ConfigError(f"sensitivity analysis swaps weights in the reference unit's fp32 copy, but "
                                  f"{op} runs on {getattr(mod, 'NAME', mod)!r} in {phase}; load the model "
                                  f"with units=['reference']")
            if op != "embedding" and _matrix(w, op, 0 if op not in MODEL_LEVEL_OPS else None) is None:
                raise ConfigError(f"the reference unit holds no {op} weights (placement left them out)")
    ids = engine.tokenize(text)[: min(max_tokens, engine.n_ctx)]
    if len(ids) < 2:
        raise ConfigError(f"the calibration text gives {len(ids)} token(s); at least 2 are needed")
    ids = np.asarray(ids, dtype=np.int64)

    model_sha = engine.model_sha256()
    calib_sha = hashlib.sha256(text.encode("utf-8")).hexdigest()
    expect = dict(model_sha256=model_sha, calibration_sha256=calib_sha, n_tokens=len(ids),
                  formats=formats, ops=ops, activations=activations, n_layers=cfg.n_layers,
                  tied_embeddings=cfg.tied_embeddings)
    path = cache_path(model_sha, _cache_key(model_sha, calib_sha, formats, ops, activations, len(ids)))
    if cache:
        hit = _read_cache(path, expect)
        if hit is not None:
            log.info("sensitivity: cached result %s", path)
            return dataclasses.replace(hit, from_cache=True)

    t0 = time.perf_counter()
    passes = 0

    def run() -> np.ndarray:
        nonlocal passes
        seq = engine._new_sequence()
        try:
            passes += 1
            return runner.forward(seq, ids, all_logits=True)        # (n_tokens, vocab)
        finally:
            seq.free()

    ref_lp = _log_softmax64(run())
    ref_p = np.exp(ref_lp)
    sites = [(li, op) for li in range(cfg.n_layers) for op in ops if op not in MODEL_LEVEL_OPS]
    sites += [(None, op) for op in ops if op in MODEL_LEVEL_OPS]
    total = len(sites) * (len(formats) + len(activations))
    done = 0
    entries: list[Entry] = []
    skipped: list[Skipped] = []

    def tick():
        nonlocal done
        done += 1
        if progress is not None:
            progress(done, total)

    for li, op in sites:
        w = _matrix(runner._ops["prefill"][op][1], op, li)
        for fmt in formats:
            try:
                conv = requant.convert(w, fmt, name=f"layer {li} {op}" if li is not None else op)
            except ConfigError as e:
                skipped.append(Skipped(li, op, "weights", fmt, str(e)))
                tick()
                continue
            # a tied head's table is also the one every token's embedding is gathered from
            lookup = _swapped_embedding(runner, conv.dequantized) if tied and op == "lm_head" else nullcontext()
            with _swapped_weights(runner, op, li, conv.dequantized), lookup:
                kl = _mean_kl(ref_lp, ref_p, run())
            entries.append(Entry(li, op, "weights", fmt, kl, conv.sqnr_db))
            del conv
            tick()
        for fmt in activations:
            unit = _ActQuantUnit(reference, w, fmt)
            with _swapped_module(runner, op, unit):
                kl = _mean_kl(ref_lp, ref_p, run())
            entries.append(Entry(li, op, "activations", fmt, kl, unit.sqnr_db()))
            tick()

    result = Sensitivity(model_sha256=model_sha, calibration_sha256=calib_sha, n_layers=cfg.n_layers,
                         n_tokens=len(ids), formats=formats, ops=ops, activations=activations,
                         entries=tuple(entries), skipped=tuple(skipped), forward_passes=passes,
                         seconds=time.perf_counter() - t0, tied_embeddings=cfg.tied_embeddings)
    if cache:
        _write_cache(path, result)
    return result


def _matrix(prepared, op: str, layer: int | None):
    if op in MODEL_LEVEL_OPS:
        return getattr(prepared, _WEIGHT_FIELD[op])
    return getattr(prepared.layers[layer], _WEIGHT_FIELD[op])


class _Swap:
    """Replaces runner._ops[phase][op] in every phase for the duration of a `with`, and puts the
    original (module, weights) tuples back on exit, whatever happened inside."""

    def __init__(self, runner, op: str, make):
        self._runner, self._op, self._make = runner, op, make
        self._saved: dict[str, tuple] = {}

    def __enter__(self):
        try:
            for phase, table in self._runner._ops.items():
                self._saved[phase] = table[self._op]
                table[self._op] = self._make(*table[self._op])
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc):
        for phase, entry in self._saved.items():
            self._runner._ops[phase][self._op] = entry
        self._saved.clear()
        return False


def _swapped_weights(runner, op: str, layer: int | None, matrix: np.ndarray) -> _Swap:
    field = _WEIGHT_FIELD[op]

    def make(mod, prepared):
        if op in MODEL_LEVEL_OPS:
            return mod, dataclasses.replace(prepared, **{field: matrix})
        layers = list(prepared.layers)
        layers[layer] = dataclasses.replace(layers[layer], **{field: matrix})
        return mod, dataclasses.replace(prepared, layers=tuple(layers))

    return _Swap(runner, op, make)


def _swapped_embedding(runner, table: np.ndarray) -> _Swap:
    """The embedding lookup reading `table` (vocab, d) fp32 in place of the file's rows."""
    emb = reference.EmbeddingTable(np.ascontiguousarray(table, dtype=np.float32), GGMLQuantizationType.F32,
                                   table.shape[1])
    return _Swap(runner, "embedding", lambda mod, prepared: (mod, dataclasses.replace(prepared, embedding=emb)))


def _swapped_module(runner, op: str, unit: _ActQuantUnit) -> _Swap:
    return _Swap(runner, op, lambda mod, prepared: (unit, prepared))
