"""A precision plan at run time: the plan's weights as a (cached) requantized model file, and the
compute precision each engine op asks for, per phase, layer and step length.

Weights: a plan that stores any tensor in another format than the file is served from a GGUF
written once by requant.requantize_gguf into $EDGELLM_HOME/cache/precision/models/ and memory-mapped
like any model, so every backend reads the plan's formats through the ModelFile it already
knows, weights stay quantized and a second start costs nothing. The runtime formats (int8,
int4-G) are stored as the nearest GGUF block type (requant.GGUF_TYPE_FOR: Q8_0, Q4_0).

Compute: a unit computes an op at the precision the plan asks when it has a kernel for it, and at
a higher one when it has not (never lower: a plan is a bound on the error it accepts); units
without a precision high enough cannot take the op. `effective` is that rule, used by both the
dispatcher (placement and its reasons) and the engine (which kernel each call uses).
"""
from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass
from glob import escape as glob_escape
from pathlib import Path
from typing import Callable, Mapping

from .backends import npu_cache
from .errors import ConfigError, EdgeLLMError
from .fileio import clear_odd_entry, read_capped, remove_dead_writers, stat_key, write_atomic
from .hashing import bulk_sha256, file_sha256, sha256
from .precision import LAYER_OPS as PLAN_LAYER_OPS
from .precision import PrecisionPlan

log = logging.getLogger("edgellm")

# engine op name -> the plan op whose compute precision it runs at. The IR's fused attention is
# the plan's attn_scores (QK^T and P*V); rope, swiglu and the adds are elementwise and fp32.
ENGINE_TO_PLAN = {"embedding": "embedding", "attn_norm": "attn_norm", "qkv": "qkv", "attention": "attn_scores",
                  "attn_out": "attn_out", "ffn_norm": "ffn_norm", "ffn_gate_up": "ffn_gate_up",
                  "ffn_down": "ffn_down", "output_norm": "output_norm", "lm_head": "lm_head"}
# higher precision first: a unit may run an op above what the plan asks, never below
PRECISION_ORDER = ("fp32", "fp16", "int8")
CACHE_SCHEMA = 1
# the requantized copies' folder (cache/precision/models) is kept under this many MiB, the oldest
# copies removed first: SmolLM2's copies are ~90 MiB, so about eleven stay
CACHE_CAP_ENV = "EDGELLM_PRECISION_CACHE_MB"
CACHE_CAP_MB = 1024.0
CACHE_CAP_WHAT = "the requantized models take up to {mb} MiB in all"


def effective(asked: str, supported: tuple[str, ...]) -> str | None:
    """The precision a unit with kernels for `supported` runs an op the plan asks `asked` for:
    `asked` itself, else the lowest supported precision above it, else None (it cannot)."""
    if asked in supported:
        return asked
    above = [p for p in PRECISION_ORDER[: PRECISION_ORDER.index(asked)] if p in supported]
    return above[-1] if above else None


@dataclass(frozen=True)
class ComputeTable:
    """What the plan asks each engine op to compute in: per phase, a tuple over layers for layer
    ops (one entry for model ops). Sequence policies are resolved per step length by `at`."""
    plan: PrecisionPlan
    n_layers: int

    def at(self, phase: str, tokens: int = 0) -> dict[str, tuple[str, ...]]:
        """engine op -> asked compute per layer (model ops: a 1-tuple) for a step of `tokens`
        (prefill: the prompt's uncached length; decode: the context length)."""
        key = (phase, sum(tokens >= s.min_tokens for s in self.plan.sequence))
        cache = self.__dict__.setdefault("_cache", {})
        if key not in cache:
            out = {}
            for eop, pop in ENGINE_TO_PLAN.items():
                layers = range(self.n_layers) if pop in PLAN_LAYER_OPS else (None,)
                out[eop] = tuple(self.plan.resolve(i, pop, phase, self.n_layers, tokens).compute for i in layers)
            cache[key] = out
        return cache[key]

    def asked(self, phase: str, op: str, tokens: int = 0) -> tuple[str, ...]:
        """The per-layer asks of one engine op (fp32 for ops outside the plan: rope, swiglu, adds)."""
        return self.at(phase, tokens).get(op, ("fp32",))


def all_fp32(n_layers: int) -> "ComputeTable":
    """The table of a plan that asks fp32 everywhere (the `quality` preset's compute)."""
    from .precision import load_plan

    return ComputeTable(load_plan("quality"), n_layers)


# ---- weights ---------------------------------------------------------------------------------

def cache_dir() -> Path:
    from .model.registry import edgellm_home

    return edgellm_home() / "cache" / "precision" / "models"


def _cache_key(src: str, formats: Mapping[str, str]) -> str:
    """The source file's path, size and times, and the formats. mtime alone missed another model
    of the same size put in its place with its mtime kept (cp -p, an archive's timestamps): the
    old model's copy was used. A rename over it changes the inode; a write in place, or setting
    its mtime back, changes ctime, which no tool can set (a chmod does too: a needless rewrite)."""
    st = os.stat(src)
    desc = json.dumps({"schema": CACHE_SCHEMA, "src": os.path.abspath(src), "size": st.st_size,
                       "mtime_ns": st.st_mtime_ns, "dev": st.st_dev, "ino": st.st_ino, "ctime_ns": st.st_ctime_ns,
                       "formats": sorted(formats.items())})
    return sha256(desc.encode()).hexdigest()


def _identity(src: str, formats: Mapping[str, str]) -> str:
    """What a cached copy is of: the source's path and the formats (its key adds the source's size,
    times and inode). A copy of the same identity under another key is stale; one of another identity
    (the same file name elsewhere, the same plan name with other formats) is not."""
    desc = json.dumps({"src": os.path.abspath(src), "formats": sorted(formats.items())})
    return sha256(desc.encode()).hexdigest()[:8]


def _matches(mf, formats: Mapping[str, str]) -> bool:
    from .requant import GGUF_TYPE_FOR

    return all(mf.tensor_type(name) == GGUF_TYPE_FOR[fmt] for name, fmt in formats.items())


def _bits(type_name: str) -> float:
    """Bits per weight of a GGUF type (block types with their scales)."""
    from .model.ggml_types import GGML_QUANT_SIZES, GGMLQuantizationType

    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    return 8 * size / block


def plan_model(mf, plan: PrecisionPlan, progress: Callable[[int, int], None] | None = None,
               also: Mapping[str, str] | None = None, also_what: str = ""):
    """(the ModelFile to run, a one-line note) for `plan` on `mf`. The file itself when the plan
    keeps every tensor's format; else a requantized copy from the cache, written on first use.
    A damaged or stale cache file is rewritten with one warning. also: conversions needed
    whatever the plan says (api._runnable's K-quant matrices as Q4_1 / Q8_0; `also_what` names them),
    which the plan's own formats override: one copy from the source (a plan's copy made from
    the Q8_0 copy was named after that copy's key, so a touched source left each old one behind,
    and under the cache's bound each load wrote both, the second evicting the first)."""
    from .requant import GGUF_TYPE_FOR, plan_formats

    # a bad cap is refused first: found only after a requantization, it failed a miss once the
    # copy was written, and every hit after that never read it
    npu_cache.cap_bytes(CACHE_CAP_ENV, CACHE_CAP_MB, CACHE_CAP_WHAT)
    cfg = mf.config
    formats = plan_formats(mf, lambda layer, op: plan.weight_format(layer, op, cfg.n_layers))
    # a tensor the plan sets to the type the file already has needs no conversion
    formats = {n: f for n, f in formats.items() if mf.tensor_type(n) != GGUF_TYPE_FOR[f]}
    if not formats and also:
        return requantized_copy(mf, also, "runnable", also_what, progress)   # (the copy a load without a plan uses)
    if not formats:
        return mf, f"precision plan {plan.name!r}: weights as the file stores them"
    emb_asked = plan.weight_format(None, "embedding", cfg.n_layers)
    if cfg.tied_embeddings and "token_embd.weight" in formats and emb_asked == "gguf":
        # one tensor is the head and the embedding table: the plan's head format is the table's,
        # whatever its embedding entry says (the embedding-float rule meant to keep it)
        log.warning("precision plan %r stores lm_head in %s, and this model ties its embeddings: the embedding "
                    "table (token_embd.weight) is stored in %s too, though the plan's embedding says 'gguf'",
                    plan.name, formats["token_embd.weight"], GGUF_TYPE_FOR[formats["token_embd.weight"]].name)
    again = [n for n, f in formats.items() if _bits(mf.tensor_type(n).name) <= 5 and _bits(GGUF_TYPE_FOR[f].name) <= 5]
    if again:
        # measured on SmolLM2-135M Q4_1: the `fast` preset's Q4_0 FFN costs KL 0.15 against
        # llama.cpp (top-1 83%) for 5% fewer bytes
        log.warning("precision plan %r requantizes %d tensors that the file already stores in 4 bits (%s) "
                    "into another 4-bit format: a second rounding for few bytes saved; `edgellm precision plan` "
                    "measures what each layer tolerates", plan.name, len(again), mf.tensor_type(again[0]).name)
    what = f"precision plan {plan.name!r}"
    if also:
        formats, what = {**also, **formats}, f"{what} (and {also_what})"
    return requantized_copy(mf, formats, plan.name or "plan", what, progress)


def requantized_copy(mf, formats: Mapping[str, str], plan_name: str, what: str,
                     progress: Callable[[int, int], None] | None = None):
    """(the ModelFile of `mf` with the tensors in `formats` requantized, a one-line note): from
    the cache (cache_dir()) when a verified copy is there, else written there first. plan_name
    names the copy's file, `what` the conversion in messages."""
    from .model.loader import open_model
    from .requant import requantize_gguf

    npu_cache.cap_bytes(CACHE_CAP_ENV, CACHE_CAP_MB, CACHE_CAP_WHAT)   # (a bad cap: refused before any work)
    key, ident = _cache_key(mf.path, formats), _identity(mf.path, formats)
    stem = Path(mf.path).name.removesuffix(".gguf")
    path = cache_dir() / f"{stem}-{plan_name}-{ident}-{key[:16]}.gguf"
    remove_dead_writers(path.parent)     # (a writer killed mid-write left its part behind)
    legacy = path.with_name(f"{stem}-{plan_name}-{key[:16]}.gguf")   # the name before identities
    if legacy.exists() and not path.exists():   # the same copy: renamed, not requantized again
        for old, new in ((legacy, path), (_fingerprint_file(legacy), _fingerprint_file(path))):
            try:
                old.replace(new)
            except OSError:
                pass
    fp = _fingerprint_file(path)
    if path.exists() or path.is_symlink():
        try:
            if not path.is_file():
                raise OSError(f"{path.name} is not a regular file")
            cached = open_model(path)
            why = "its tensor types differ from the plan's" if not _matches(cached, formats) else _unverified(path)
            if why is None:
                return cached, f"{what}: {len(formats)} tensors requantized (cached: {path})"
        except (EdgeLLMError, OSError) as e:
            why = str(e)
        log.warning("requantized model cache %s is unusable (%s); writing it again", path, why)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:   # (a read-only EDGELLM_HOME: a bare OSError, naming no model nor cause)
        raise ConfigError(f"{what}: cannot write the requantized model to {path.parent}: {e.strerror or e}; "
                          "set EDGELLM_HOME to a writable folder") from e
    for f in (path, fp):   # (a FIFO, a folder or a link there failed every load)
        clear_odd_entry(f)
    # older copies of the same source and formats (the model file re-pulled or touched: the key
    # changed) are stale: each was a whole model's size, kept for good. Copies of another source
    # or other formats stay (they were deleted too: two models named alike, or two plans of one
    # name, requantized the whole model on every load), and so do names of another shape.
    head = f"{stem}-{plan_name}-"
    for old in path.parent.glob(f"{glob_escape(head)}*.gguf"):
        tail = old.name[len(head):-len(".gguf")]
        if old != path and (re.fullmatch(rf"{ident}-[0-9a-f]{{16}}", tail)
                            or re.fullmatch(r"[0-9a-f]{16}", tail)):   # (a name from before identities)
            for f in (old, _fingerprint_file(old)):
                try:
                    f.unlink(missing_ok=True)
                except OSError:   # (a folder of that name: IsADirectoryError stopped the load)
                    pass
    if plan_name == "runnable":
        # the copy load() made before Q4_K ran as Q4_1 (every K-quant / Q5_x matrix as Q8_0, named
        # "-q8_0-"): a whole model's size that no name above matches, left until the cache's bound
        from .model.ggml_types import GGMLQuantizationType as T

        before = {n: "q8_0" for n in formats if mf.tensor_type(n) != T.BF16 and len(mf.gguf.tensors[n].shape) == 2}
        old_head = f"{stem}-q8_0-{_identity(mf.path, before)}-"
        for old in path.parent.glob(f"{glob_escape(old_head)}*.gguf"):
            if re.fullmatch(r"[0-9a-f]{16}", old.name[len(old_head):-len(".gguf")]):
                for f in (old, _fingerprint_file(old)):
                    try:
                        f.unlink(missing_ok=True)
                    except OSError:
                        pass
    try:
        report = requantize_gguf(mf.path, path, formats, progress=progress)
        write_atomic(fp, _sidecar(path).encode())
    except OSError as e:
        raise ConfigError(f"{what}: cannot write the requantized model to {path}: {e}") from e
    # each plan (an edited one too) is a whole model's copy: without a bound, 11 plans of SmolLM2
    # took 994 MiB for good. The oldest copies go first (by their write: a hit does not touch a
    # copy, whose mtime its sidecar's check holds); the one just written stays
    npu_cache.evict(path.parent, ".gguf", keep=path, label="requantized model cache", env=CACHE_CAP_ENV,
                    default_mb=CACHE_CAP_MB, what=CACHE_CAP_WHAT, companion=_fingerprint_file)
    log.info("%s: %d tensors requantized into %s (%d -> %d bytes of tensor data)",
             what, len(formats), path, report.bytes_before, report.bytes_after)
    return open_model(path), f"{what}: {len(formats)} tensors requantized (written: {path})"


_SAMPLES, _SAMPLE_BYTES = 64, 65536


def _fingerprint(path: Path) -> str:
    """The size and a sha256 of 64 evenly spread 64 KiB samples of a cache file: a check of a
    few milliseconds at every load (the whole file, ~75 ms for SmolLM2's, would double a load),
    which sees a file damaged or replaced in any stretch longer than the spacing (1.5 MB for
    SmolLM2), not every flipped bit."""
    size = path.stat().st_size
    h = bulk_sha256(str(size).encode())
    with open(path, "rb") as f:
        for i in range(_SAMPLES):
            f.seek(i * max(0, size - _SAMPLE_BYTES) // (_SAMPLES - 1))
            h.update(f.read(_SAMPLE_BYTES))
    return f"{size}:{h.hexdigest()}"


def _fingerprint_file(path: Path) -> Path:
    return path.with_name(path.name + ".sample-sha256")


# The sidecar: the sampled fingerprint, a sha256 of the whole file, the entry it belongs to, and
# the file's (inode, size, mtime, ctime) when the whole hash last matched. A load while those are
# unchanged checks the samples only (milliseconds); a file written to since (its ctime moved)
# is hashed whole once (~75 ms for SmolLM2's): 109 KB overwritten between two samples of an 11 MB
# copy loaded without a word, logits off by 1.7.
_SIDECAR_MAX = 1024



def _sidecar(path: Path, whole: str | None = None) -> str:
    return (f"{_fingerprint(path)}\nwhole {whole or file_sha256(path)}\nentry {path.name}\n"
            f"stat {stat_key(path)}\n")


def _unverified(path: Path) -> str | None:
    """Why the cached copy at path cannot be trusted; None when its sidecar vouches for it (then
    brought up to date: a one-line sidecar of an older edgellm is upgraded once its samples match)."""
    fp = _fingerprint_file(path)
    try:
        raw = read_capped(fp, _SIDECAR_MAX).decode("ascii")
    except FileNotFoundError:
        return "no checksum was recorded for it"
    except (OSError, UnicodeDecodeError) as e:   # (a FIFO there hung every load, /dev/zero was read whole)
        return f"its checksum file is unusable ({getattr(e, 'strerror', None) or e})"
    lines = raw.split("\n")
    if lines[0] != _fingerprint(path):
        return "its bytes differ from those written (sampled checksum)"
    fields = dict(line.split(" ", 1) for line in lines[1:] if " " in line)
    if "whole" not in fields:          # an older sidecar: the samples matched, so record the rest
        write_atomic(fp, _sidecar(path).encode())
        return None
    if fields.get("entry") != path.name:
        return "its checksum file is another entry's"
    if fields.get("stat") != stat_key(path):
        if file_sha256(path) != fields["whole"]:
            return "its bytes differ from those written (whole-file checksum)"
        write_atomic(fp, _sidecar(path, fields["whole"]).encode())
    return None


def planned_formats(mf, plan: PrecisionPlan) -> dict[str, str]:
    """ops.weight_formats of the model `plan` would make of `mf`, without writing it (for
    `edgellm plan --precision`, which may plan for another device). A layer op whose layers the
    plan stores differently is a costmodel.LayerFormats: each layer is costed at its own format."""
    from .ops import weight_formats

    return formats_under_plan(weight_formats(mf), mf.config, plan)


def formats_under_plan(file_formats: dict[str, str], cfg, plan: PrecisionPlan) -> dict[str, str]:
    """planned_formats from the file's ops.weight_formats and its config (no ModelFile needed:
    precision_search predicts whole plans from what its dispatcher was built with)."""
    from .costmodel import LayerFormats
    from .requant import GGUF_TYPE_FOR

    out = dict(file_formats)
    file_fmt = dict(file_formats)

    def fmt(layer, op, eop):
        f = plan.weight_format(layer, op, cfg.n_layers)
        if f != "gguf":
            return GGUF_TYPE_FOR[f].name.lower()
        kept = file_fmt[eop]     # the file's own format: a mixed file's is the layer's own
        return kept.layers[layer] if isinstance(kept, LayerFormats) else kept

    compute = ComputeTable(plan, cfg.n_layers)
    for op in ("qkv", "attn_out", "ffn_gate_up", "ffn_down"):
        per_layer = tuple(fmt(i, op, op) for i in range(cfg.n_layers))
        out[op] = per_layer[0] if len(set(per_layer)) == 1 else LayerFormats(per_layer, compute)
    out["lm_head"] = fmt(None, "lm_head", "lm_head")
    out["embedding"] = out["lm_head"] if cfg.tied_embeddings else fmt(None, "embedding", "embedding")
    return out
