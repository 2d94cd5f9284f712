"""Autotuning of the OpenCL matmul tiles: a small per-device search, cached on disk.

For each shape (T, K, N) of a model (a decode step T = 1, a prefill chunk T = 512, ...) and a
weight type, tune() times a handful of tile configs of the kernel that shape runs (GEMV: rows
per work-item x split-K x work-group size; GEMM: TM x TN x work-group size) on random weights,
and keeps the fastest whose output matches numpy. Two stages keep it small: the tile shapes at
the default work-group size, then the other work-group sizes for the two best tiles.

Timing: kernel time from profiling events, the median of REPS runs after one warm-up run (PoCL,
like some GPU drivers, compiles a kernel per local size at its first launch; the warm-up also
checks the output). A config that cannot run is skipped with its reason: a work-group larger
than the kernel allows, a build failure, a launch error, a wrong result.

Cache: <cache folder>/tune/matmul-<hash of device identity and kernel sources>.json, so that a
new driver or an edited kernel is a miss. The file carries its schema version, the identity and
sources hash in clear, and a sha256 of its entries; a file that fails any check is ignored with
a warning (and rewritten by the next tune()), never trusted. Written atomically.

best_config() only looks up: the exact shape, else the same (type, kind, K, N) at the nearest
T, else opencl_matmul.default_config(). It never searches.
"""
from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..hashing import sha256
from .. import quant
from ..errors import EdgeLLMError
from ..fileio import write_atomic
from . import opencl_matmul as mm
from .opencl_matmul import TileConfig
from .opencl_runtime import ClDeviceError, ClRuntime, KernelBuildError, cache_root, sources_hash

log = logging.getLogger("edgellm")

SCHEMA = 1
REPS = 5                      # timed runs per config (after one warm-up) ...
REPS_LONG = 3                 # ... or this many when one run takes over LONG_S (little noise)
LONG_S = 0.02
GEMM_TILES = ((4, 4), (2, 4), (4, 2), (8, 4), (4, 8))      # (TM, TN)
GEMV_TILES = ((2, 1), (1, 1), (4, 1), (1, 4), (2, 4))      # (ROWS, SPLIT)
NMSE_CHECK = 5e-4             # a candidate's output against numpy (DESIGN.md's matmul bound)


class TuneCacheError(EdgeLLMError):
    """A tuning cache file that cannot be used (reported as a warning, then ignored)."""


@dataclass
class TuneStats:
    """Counters a caller (or a test) can read: did tune() search or answer from the cache?"""
    searches: int = 0         # shapes searched
    timed: int = 0            # configs timed
    cache_hits: int = 0       # shapes answered from the cache


stats = TuneStats()

_memo: dict[str, tuple[tuple, dict]] = {}     # path -> ((mtime_ns, size), entries)


def cache_path(rt: ClRuntime) -> Path:
    h = sha256(f"{rt.identity()}\0{sources_hash()}".encode()).hexdigest()[:16]
    return (rt.cache_dir or cache_root()) / "tune" / f"matmul-{h}.json"


def entry_key(type_name: str, int8: bool, kind: str, T: int, K: int, N: int) -> str:
    return f"{type_name}{'+int8' if int8 else ''}|{kind}|{T}|{K}|{N}"


# ---- lookup -----------------------------------------------------------------------------------------

def best_config(rt: ClRuntime, type_name: str, T: int, K: int, N: int, *, int8: bool = False) -> TileConfig:
    """The tuned config for this shape (or the nearest tuned T), else the default. No search."""
    kind = mm.kind_for(T)
    entries = _load(rt)
    e = entries.get(entry_key(type_name, int8, kind, T, K, N))
    if e is None:
        prefix = f"{type_name}{'+int8' if int8 else ''}|{kind}|"
        near = [(abs(math.log(int(key.split('|')[2]) / T)), key) for key in entries
                if key.startswith(prefix) and key.endswith(f"|{K}|{N}")]
        if near:
            e = entries[min(near)[1]]
    return e["config"] if e is not None else mm.default_config(rt, kind)


def _load(rt: ClRuntime) -> dict:
    """{key: {"config": TileConfig, ...}} from the cache file; {} when absent or unusable."""
    path = cache_path(rt)
    try:
        st = path.stat()
    except OSError:
        return {}
    sig = (st.st_mtime_ns, st.st_size)
    m = _memo.get(str(path))
    if m is not None and m[0] == sig:
        return m[1]
    try:
        entries = _parse(path, rt)
    except TuneCacheError as e:
        log.warning("%s; ignored (the next tune() rewrites it)", e)
        entries = {}
    _memo[str(path)] = (sig, entries)
    return entries


def _parse(path: Path, rt: ClRuntime) -> dict:
    def bad(why):
        raise TuneCacheError(f"tuning cache {path}: {why}")
    try:
        doc = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        bad(f"unreadable ({e})")
    if not isinstance(doc, dict):
        bad("not a JSON object")
    if doc.get("schema") != SCHEMA:
        bad(f"schema {doc.get('schema')!r}, expected {SCHEMA}")
    if doc.get("identity") != rt.identity() or doc.get("sources") != sources_hash():
        bad("made for another device or other kernel sources")
    raw = doc.get("entries")
    if not isinstance(raw, dict):
        bad("'entries' missing")
    if doc.get("sha256") != _digest(raw):
        bad("checksum mismatch")
    out = {}
    for key, e in raw.items():
        try:
            kind = _check_key(key)
            cfg = TileConfig(**e["config"]).check()
            if cfg.kind != kind:
                raise ValueError(f"kind {cfg.kind} under a {kind} key")
        except (KeyError, TypeError, ValueError, IndexError) as err:
            bad(f"entry {key!r}: {err}")
        out[key] = {**e, "config": cfg}
    return out


def _check_key(key: str) -> str:
    """The kind of an entry key (entry_key's form), or ValueError saying which part is wrong:
    best_config() divides by T and parses every key of a shape's type and kind as it looks up."""
    parts = key.split("|")
    if len(parts) != 5:
        raise ValueError(f"expected 5 '|'-separated parts (type|kind|T|K|N), found {len(parts)}")
    type_part, kind, *dims = parts
    type_name, int8 = type_part.removesuffix("+int8"), type_part.endswith("+int8")
    if type_name not in (mm.BLOCK_TYPES if int8 else mm.TYPES):
        raise ValueError(f"weight type {type_part!r} is not one the OpenCL matmul takes")
    if kind not in ("gemv", "gemm"):
        raise ValueError(f"kind must be 'gemv' or 'gemm', found {kind!r}")
    for name, v in zip("TKN", dims):
        if not (v.isascii() and v.isdigit()) or int(v) < 1:
            raise ValueError(f"{name} must be a positive integer, found {v!r}")
    return kind


def _digest(entries) -> str:
    return sha256(json.dumps(entries, sort_keys=True).encode()).hexdigest()


def _save(rt: ClRuntime, entries: dict) -> None:
    path = cache_path(rt)
    raw = {k: {**e, "config": e["config"].as_dict()} for k, e in entries.items()}
    doc = {"schema": SCHEMA, "identity": rt.identity(), "sources": sources_hash(), "entries": raw,
           "sha256": _digest(raw)}
    write_atomic(path, json.dumps(doc, indent=1, sort_keys=True).encode())
    _memo.pop(str(path), None)


# ---- search -----------------------------------------------------------------------------------------

def tune(rt: ClRuntime, shapes, type_name: str, *, int8: bool = False, progress=None) -> dict:
    """{(kind, T, K, N): TileConfig} for each (T, K, N) in `shapes`: from the cache, else
    searched now and cached. progress(line) receives one line per config timed."""
    if type_name not in mm.TYPES:
        raise mm.ClMatmulError(f"the OpenCL matmul does not take {type_name} weights "
                               f"(supported: {', '.join(mm.TYPES)})")
    if int8 and type_name not in mm.BLOCK_TYPES:
        raise mm.ClMatmulError(f"the int8-dot variant is for block types {mm.BLOCK_TYPES}, not {type_name}")
    entries = dict(_load(rt))
    out, changed = {}, False
    for T, K, N in shapes:
        kind = mm.kind_for(T)
        key = entry_key(type_name, int8, kind, T, K, N)
        if key in entries:
            stats.cache_hits += 1
        else:
            stats.searches += 1
            entries[key] = _search(rt, type_name, int8, kind, T, K, N, progress)
            changed = True
        out[(kind, T, K, N)] = entries[key]["config"]
    if changed:
        _save(rt, entries)
        mm.forget_configs(rt)
    return out


def candidates(rt: ClRuntime, kind: str, wg: int | None = None) -> list[TileConfig]:
    """Stage-one configs: every tile shape at the default work-group size (or `wg`)."""
    wg = wg or mm.default_config(rt, kind).wg
    if kind == "gemm":
        return [TileConfig("gemm", wg, tm=tm, tn=tn) for tm, tn in GEMM_TILES]
    return [TileConfig("gemv", wg, rows=r, split=s) for r, s in GEMV_TILES]


def work_group_sizes(rt: ClRuntime) -> list[int]:
    w = mm.warp_width(rt)
    return [2 * w, 4 * w, 8 * w]


def _search(rt, type_name, int8, kind, T, K, N, progress) -> dict:
    bench = _Bench(rt, type_name, int8, T, K, N)
    timed: dict[TileConfig, float] = {}
    skipped: list[str] = []

    def run(cfg: TileConfig):
        if cfg in timed:
            return
        t, why = bench.time(cfg, best=min(timed.values(), default=None))
        if why:
            skipped.append(f"{cfg.as_dict()}: {why}")
            log.info("opencl tune %s %s T=%d K=%d N=%d: skipped %s: %s", type_name, kind, T, K, N, cfg, why)
        else:
            timed[cfg] = t
            stats.timed += 1
        if progress:
            progress(f"{type_name}{' int8' if int8 else ''} {kind} T={T} K={K} N={N} {_short(cfg)}: "
                     + (f"skipped ({why})" if why else f"{t * 1e6:.0f} us"))

    for cfg in candidates(rt, kind):
        run(cfg)
    for cfg, _ in sorted(timed.items(), key=lambda kv: kv[1])[:2]:
        for wg in work_group_sizes(rt):
            if wg != cfg.wg and wg % cfg.split == 0:
                run(TileConfig(cfg.kind, wg, cfg.tm, cfg.tn, cfg.rows, cfg.split))
    if not timed:
        default = mm.default_config(rt, kind)
        log.warning("opencl tune %s %s T=%d K=%d N=%d: no config ran (%s); keeping the default %s",
                    type_name, kind, T, K, N, "; ".join(skipped), default)
        return {"config": default, "seconds": None, "skipped": skipped}
    best = min(timed, key=timed.get)
    return {"config": best, "seconds": timed[best], "gflops": 2.0 * T * K * N / timed[best] * 1e-9,
            "skipped": skipped}


def _short(cfg: TileConfig) -> str:
    if cfg.kind == "gemm":
        return f"TM={cfg.tm} TN={cfg.tn} WG={cfg.wg}"
    return f"ROWS={cfg.rows} SPLIT={cfg.split} WG={cfg.wg}"


def work_group_limit(rt: ClRuntime, kernel) -> int:
    """The largest work-group this kernel may run with on this device (registers and local
    memory can make it smaller than the device's maximum)."""
    import pyopencl as cl

    return min(rt.device.max_work_group_size,
               kernel.get_work_group_info(cl.kernel_work_group_info.WORK_GROUP_SIZE, rt.device))


class _Bench:
    """Random weights of one shape packed on the device, x, and numpy's answer."""

    def __init__(self, rt, type_name, int8, T, K, N):
        import pyopencl as cl

        self.cl, self.rt, self.type_name, self.int8, self.T = cl, rt, type_name, int8, T
        rng = np.random.default_rng([T, K, N])
        w = rng.standard_normal((N, K)).astype(np.float32)
        qtype = quant.T[type_name]
        raw = np.ascontiguousarray(quant.quantize(w, qtype))
        self.w = mm.pack(rt, type_name, [raw], [N], K, build=False)
        deq = quant.dequantize(raw.reshape(-1), qtype, (N, K))
        x = rng.standard_normal((T, K)).astype(np.float32)
        self.ref = (x.astype(np.float64) @ deq.T.astype(np.float64))
        if self.w.k_pad != K:
            x = np.concatenate([x, np.zeros((T, self.w.k_pad - K), np.float32)], axis=1)
        self.xbuf = rt.upload(x)
        self.y = rt.empty(4 * T * N)
        self.xargs = None

    def time(self, cfg: TileConfig, best: float | None) -> tuple[float, str]:
        """(median kernel seconds, "") or (0, reason it was skipped)."""
        cl, rt = self.cl, self.rt
        try:
            cfg.check()
            main, qx = mm.kernels(rt, self.type_name, self.int8, cfg)
        except KernelBuildError as e:
            return 0.0, f"build failed: {e}"
        except (mm.ClMatmulError, ClDeviceError) as e:
            return 0.0, str(e)
        limit = work_group_limit(rt, main)
        if cfg.wg > limit:
            return 0.0, f"work-group {cfg.wg} exceeds the kernel's limit {limit}"
        try:
            if self.int8 and self.xargs is None:
                self.xargs = mm.quantize_x(rt, qx, self.xbuf, self.T, self.w.k)
            xargs = self.xargs if self.int8 else (self.xbuf,)
            mm.enqueue(rt, main, cfg, self.w, xargs, self.xbuf, False, self.y, self.T).wait()
            got = rt.read(self.y, self.ref.shape)
            err = float(np.mean((got - self.ref) ** 2) / max(float(np.mean(self.ref ** 2)), 1e-30))
            if not np.isfinite(err) or err > NMSE_CHECK:
                return 0.0, f"wrong output (NMSE {err:.2e} against numpy)"
            times = []
            while len(times) < (REPS if not times or times[0] < LONG_S else REPS_LONG):
                ev = mm.enqueue(rt, main, cfg, self.w, xargs, self.xbuf, False, self.y, self.T)
                ev.wait()
                times.append((ev.profile.end - ev.profile.start) * 1e-9)
                if best is not None and times[0] > 3 * best:
                    break             # clearly slower: one run says enough
        except (cl.Error, ClDeviceError) as e:     # ClDeviceError: rt.launch / rt.read's typed form
            return 0.0, f"launch failed: {e}"
        return float(np.median(times)), ""
