"""The npu unit's LiteRT/TFLite path: static-shape prefill subgraphs (npu_graphs.LinearGraph,
FfnGraph) written as .tflite flatbuffers by edgellm itself, checked, cached on disk, and run by a
LiteRT interpreter with the external delegate the caller names (an NPU vendor's .so), or on the
default CPU path (XNNPACK) when it names none.

The flatbuffer forms and their writer: npu_tflite_writer.py; the validator every model passes
before a runtime reads it: npu_tflite_validate.py. This module holds the cache, the runtime choice
and its self-checks, and TfliteSubgraph / compile().

Cache: <cache_dir>/<name>-<sha256(writer version, key)[:32]>.tflc = a header (magic, cache format,
writer version, payload length, sha256 of the payload, digest of the graph key) and the .tflite
bytes. A file that fails any check is rebuilt with one warning, never trusted. Temporary files
a killed writer left in the cache folder are removed before the next write. Every model, built
or loaded, passes validate() before an interpreter sees it (RELIABILITY.md item 16). The folder
is bounded in size (least recently used files evicted after each write, EDGELLM_NPU_CACHE_MB):
npu_cache.py.
"""
from __future__ import annotations

import ctypes
import importlib
import logging
import os
import re
import struct
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..fileio import clear_odd_entry, read_capped
from ..hashing import bulk_sha256, sha256
from ..errors import ConfigError, EdgeLLMError
from ..fileio import remove_dead_writers, write_atomic
from . import npu_cache
from .npu_graphs import LinearGraph, NpuGraphError, NpuInputError, reference
from .npu_tflite_validate import TfliteModelError, validate
from .npu_tflite_writer import (WRITER_VERSION, _ADD, _DEQ, _FC, _LOGISTIC, _MUL, _SPLIT, _TT,
                                TfliteUnavailable, _Opt, _schema, build_flatbuffer, supports)

# The writer's and validator's names stay importable from here; the enum values too (the tests
# compare them with the tflite package's).
__all__ = ["TfliteModelError", "TfliteUnavailable", "TfliteDelegateError", "TfliteStats", "stats",
           "WRITER_VERSION", "supports", "build_flatbuffer", "validate", "cache_root", "cache_path",
           "load_or_build", "available", "int4_supported", "TfliteSubgraph", "TfliteRows", "compile",
           "_TT", "_Opt", "_FC", "_DEQ", "_SPLIT", "_LOGISTIC", "_MUL", "_ADD"]

log = logging.getLogger("edgellm")


# -- errors (TfliteModelError is the validator's, TfliteUnavailable the writer's) --------------
class TfliteDelegateError(EdgeLLMError):
    """The named external delegate could not be loaded, or refused the subgraph."""

    def __init__(self, delegate: str, reason: str):
        self.delegate, self.reason = delegate, reason
        super().__init__(f"TFLite delegate {delegate!r}: {reason}")


# -- counters ----------------------------------------------------------------------------------
@dataclass
class TfliteStats:
    built: int = 0            # flatbuffers written by build_flatbuffer through the cache (misses)
    loaded: int = 0           # flatbuffers read back from the disk cache (hits)
    rebuilt: int = 0          # cache files rejected (damaged, stale) and rebuilt; each warned once
    interpreters: int = 0     # interpreters created for TfliteSubgraphs (probes not counted)

    def reset(self) -> None:
        self.built = self.loaded = self.rebuilt = self.interpreters = 0


stats = TfliteStats()


# -- the cache ---------------------------------------------------------------------------------
_MAGIC = b"ELTFLC01"
_CACHE_FORMAT = 1
_HEADER = struct.Struct("<8sIIQ32s16s")   # magic, cache format, writer version, payload length,
#                                           sha256 of the payload, sha256 of the graph key [:16]


def cache_root() -> Path:
    from ..model.registry import edgellm_home

    return edgellm_home() / "cache" / "npu" / "tflite"


def cache_path(graph, cache_dir: str | os.PathLike | None = None) -> Path:
    h = sha256(f"{WRITER_VERSION}|{graph.key()}".encode()).hexdigest()[:32]
    stem = re.sub(r"[^A-Za-z0-9._-]", "_", graph.name)[:64]
    return Path(cache_dir if cache_dir is not None else cache_root()) / f"{stem}-{h}.tflc"


def load_or_build(graph, cache_dir: str | os.PathLike | None = None) -> bytes:
    """The validated .tflite bytes for `graph`: from the cache when a sound file is there, else
    built, validated and written (atomically). A damaged or stale file: one warning, rebuilt."""
    path = cache_path(graph, cache_dir)
    key_digest = sha256(graph.key().encode()).digest()[:16]
    payload = _read_cache(path, key_digest)
    if payload is not None:
        stats.loaded += 1
        npu_cache.touch(path)              # a hit: most recently used, last to be evicted
        return payload
    payload = build_flatbuffer(graph)
    try:
        validate(payload, source=f"<built {graph.name}>")
    except TfliteModelError as e:        # a writer bug: never cached, never run
        raise NpuGraphError(graph.name, f"the writer produced an invalid model: {e}") from e
    stats.built += 1
    try:
        _write_cache(path, payload, key_digest)
    except OSError as e:                 # an unwritable cache costs a rebuild next time, no more
        log.warning("TFLite cache %s not written: %s", path, e)
    return payload


# a FlatBuffer is at most 2 GiB; read_capped also refuses a FIFO (a read that hung every load)
# and a device (/dev/zero read to 3.3 GB before the MemoryError)
_MAX_CACHE_BYTES = (2 << 30) + 4096


def _read_cache(path: Path, key_digest: bytes) -> bytes | None:
    try:
        data = read_capped(path, _MAX_CACHE_BYTES)
    except FileNotFoundError:
        return None
    except OSError as e:
        return _reject(path, f"unreadable ({e})")
    if len(data) < _HEADER.size:
        return _reject(path, "truncated header")
    magic, fmt, writer, n, digest, key = _HEADER.unpack_from(data)
    payload = data[_HEADER.size:]
    if magic != _MAGIC or fmt != _CACHE_FORMAT:
        return _reject(path, "not an edgellm TFLite cache file of this format")
    if writer != WRITER_VERSION:
        return _reject(path, f"written by writer {writer}, this is writer {WRITER_VERSION}")
    if key != key_digest:
        return _reject(path, "built for another graph")
    if n != len(payload) or bulk_sha256(payload).digest() != digest:
        return _reject(path, "fails its checksum")
    try:
        validate(payload, source=str(path))
    except TfliteModelError as e:
        return _reject(path, str(e))
    return payload


def _reject(path: Path, why: str) -> None:
    log.warning("TFLite cache %s: %s; rebuilding", path, why)
    stats.rebuilt += 1
    return None


def _write_cache(path: Path, payload: bytes, key_digest: bytes) -> None:
    # a writer killed mid-write (SIGKILL, a low-memory killer) left its temporary file here: the
    # next writer removes it, as the model and precision caches do
    remove_dead_writers(path.parent)
    clear_odd_entry(path)   # (a FIFO or a link to a device there was read and rejected every load)
    write_atomic(path, _HEADER.pack(_MAGIC, _CACHE_FORMAT, WRITER_VERSION, len(payload),
                                    bulk_sha256(payload).digest(), key_digest) + payload)
    npu_cache.evict(path.parent, ".tflc", keep=path)


# -- the runtime -------------------------------------------------------------------------------
_RUNTIMES = (("ai_edge_litert", "ai_edge_litert.interpreter"),
             ("tflite_runtime", "tflite_runtime.interpreter"))
_state_lock = threading.Lock()
_runtime_state: tuple | None = None      # (Interpreter, load_delegate, name) or (None, None, why)
_int4_state: tuple[bool, str] | None = None


def _probe_graph(fmt: str) -> LinearGraph:
    from .npu_graphs import quantize

    rng = np.random.default_rng(7)
    w = rng.standard_normal((8, 64)).astype(np.float32)
    return LinearGraph(f"probe-{fmt}", quantize(w, fmt, rng.standard_normal(8).astype(np.float32)), 4)


def _self_check(Interpreter, graph, bound: float) -> None:
    """Build, validate and run `graph` on the default CPU path; raise unless it matches the
    reference within NMSE `bound`."""
    buf = build_flatbuffer(graph)
    validate(buf)
    it = Interpreter(model_content=buf)
    it.allocate_tensors()
    x = np.random.default_rng(8).standard_normal((graph.tokens, graph.w.k)).astype(np.float32)
    it.set_tensor(it.get_input_details()[0]["index"], x)
    it.invoke()
    y = it.get_tensor(it.get_output_details()[0]["index"])
    ref = reference(graph, x)
    err = float(np.sum((y.astype(np.float64) - ref) ** 2) / np.sum(ref.astype(np.float64) ** 2))
    if not err <= bound:
        raise RuntimeError(f"{graph.w.fmt} self-check: NMSE {err:.3g} against the reference, "
                           f"bound {bound:.3g}")


def _runtime():
    """(Interpreter, load_delegate, name): the first runtime that imports AND runs a tiny fp32
    model correctly under this numpy. Raises TfliteUnavailable with every runtime's reason."""
    global _runtime_state
    with _state_lock:
        if _runtime_state is None:
            reasons = []
            try:
                _schema("Model")
                runtimes = _RUNTIMES
            except TfliteUnavailable as e:        # no writer, nothing to run
                reasons, runtimes = [str(e)], ()
            for name, module in runtimes:
                try:
                    mod = importlib.import_module(module)
                    _self_check(mod.Interpreter, _probe_graph("fp32"), 1e-10)
                    _runtime_state = (mod.Interpreter, mod.load_delegate, name)
                    break
                except ModuleNotFoundError as e:
                    if not (e.name and module.startswith(e.name)):
                        reasons.append(f"{name}: cannot be imported: {e}")   # a broken install
                    else:
                        reasons.append(f"{name}: not installed")
                except Exception as e:        # noqa: BLE001 - a runtime that fails is reported
                    hint = ""
                    if name == "tflite_runtime" and int(np.__version__.split(".")[0]) >= 2:
                        hint = (" (tflite_runtime wheels up to 2.14 are built against numpy 1.x "
                                "and fail under numpy 2; install ai-edge-litert)")
                    reasons.append(f"{name}: cannot run a model under numpy {np.__version__}: "
                                   f"{type(e).__name__}: {e}{hint}")
            else:
                _runtime_state = (None, None, "; ".join(reasons))
        if _runtime_state[0] is None:
            raise TfliteUnavailable(f"no usable TFLite runtime: {_runtime_state[2]}")
        return _runtime_state


def available() -> tuple[bool, str]:
    """(True, runtime name) when a TFLite runtime imports and passes a numeric self-check in this
    process; else (False, reason). Never raises; the result is cached for the process."""
    try:
        _, _, name = _runtime()
    except TfliteUnavailable as e:
        return False, str(e)
    return True, name


def int4_supported() -> tuple[bool, str]:
    """Whether this runtime's FULLY_CONNECTED runs blockwise INT4 weights correctly (an older
    runtime may not know the blockwise schema field and misread the weights): a self-check on a
    tiny model against the reference, once per process."""
    global _int4_state
    ok, why = available()
    if not ok:
        return False, why
    with _state_lock:
        if _int4_state is None:
            Interpreter = _runtime_state[0]
            try:
                # dynamic int8 input quantization alone gives NMSE ~3e-5 here
                _self_check(Interpreter, _probe_graph("int4"), 1e-3)
                _int4_state = (True, "")
            except Exception as e:            # noqa: BLE001 - any failure means "not here"
                _int4_state = (False, f"int4 weights are not supported by this TFLite runtime "
                                      f"({_runtime_state[2]}): {type(e).__name__}: {e}")
        return _int4_state


def _formats(graph) -> set[str]:
    if isinstance(graph, LinearGraph):
        return {graph.w.fmt}
    return {graph.gate_up.fmt, graph.down.fmt}


def _open_delegate(load_delegate, delegate: str, options: dict | None):
    opts = {}
    for k, v in (options or {}).items():
        if not isinstance(k, str) or not isinstance(v, (str, int, float, bool)):
            raise ConfigError(f"delegate_options: {k!r}: {v!r}: keys must be str, values str/int/float/bool")
        opts[k] = v
    if os.sep in delegate or (os.altsep and os.altsep in delegate):
        if not Path(delegate).is_file():
            raise TfliteDelegateError(delegate, "no such file")
    # Open it with ctypes first: a missing library or one that is not an external delegate gets
    # its own reason (load_delegate's failure there leaves a half-built object behind).
    try:
        lib = ctypes.CDLL(delegate)
    except OSError as e:
        raise TfliteDelegateError(delegate, f"cannot be loaded: {e}") from e
    if not hasattr(lib, "tflite_plugin_create_delegate"):
        raise TfliteDelegateError(delegate, "not a TFLite external delegate (no "
                                            "tflite_plugin_create_delegate symbol)")
    try:
        return load_delegate(delegate, opts)
    except (ValueError, RuntimeError, OSError, AttributeError) as e:
        raise TfliteDelegateError(delegate, f"failed to create the delegate with options {opts}: {e}") from e


class TfliteSubgraph:
    """One compiled subgraph: an interpreter created once (tensors allocated), run per chunk.
    Not re-entrant: run() holds a lock (an interpreter runs one invoke at a time)."""

    def __init__(self, graph, model: bytes, *, delegate: str | None = None,
                 delegate_options: dict | None = None, num_threads: int | None = None):
        ok, why = supports(graph)
        if not ok:
            raise NpuGraphError(getattr(graph, "name", "?"), why)
        if num_threads is not None and (isinstance(num_threads, bool) or not isinstance(num_threads, int)
                                        or num_threads < 1):
            raise ConfigError(f"num_threads: {num_threads!r}, expected an int >= 1 or None "
                              "(None: the runtime's default, one thread for ai_edge_litert)")
        self.name = graph.name        # (not the graph: its weights are the interpreter's now)
        self.delegate = delegate
        self.num_threads = num_threads
        validate(model, source=f"<{graph.name}>")            # whoever built it: checked here
        Interpreter, load_delegate, self.runtime = _runtime()
        delegates = [_open_delegate(load_delegate, delegate, delegate_options)] if delegate else None
        try:
            it = Interpreter(model_content=model, experimental_delegates=delegates,
                             num_threads=num_threads)
            stats.interpreters += 1
            it.allocate_tensors()
        except (ValueError, RuntimeError) as e:
            if delegate:
                raise TfliteDelegateError(delegate, f"refused subgraph {graph.name!r}: {e}") from e
            raise NpuGraphError(graph.name, f"the TFLite runtime rejected the model: {e}") from e
        (inp,), (out,) = it.get_input_details(), it.get_output_details()
        k_in = graph.w.k if isinstance(graph, LinearGraph) else graph.gate_up.k
        n_out = graph.w.n if isinstance(graph, LinearGraph) else graph.down.n
        self.input_shape = (int(graph.tokens), k_in)       # (tokens, K)
        self.output_shape = (int(graph.tokens), n_out)     # (tokens, N)
        got_in, got_out = tuple(map(int, inp["shape"])), tuple(map(int, out["shape"]))
        if got_in != self.input_shape or got_out != self.output_shape \
                or inp["dtype"] != np.float32 or out["dtype"] != np.float32:
            raise NpuGraphError(graph.name, f"the model's input {got_in} / output {got_out} do not "
                                            f"match the graph's {self.input_shape} / {self.output_shape}")
        self._it, self._in, self._out = it, inp["index"], out["index"]
        self._delegates = delegates          # kept alive as long as the interpreter
        self._model = model
        self._lock = threading.Lock()
        self._tokens = self.input_shape[0]   # the rows the interpreter is shaped for now

    def run(self, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """y = graph(x) for x (tokens, K) float32 -> (tokens, N) float32, a new array (or `out`).
        x is copied once into the interpreter's input; y once out of its output."""
        return self._run(x, out, self.input_shape[0])

    def rows(self, tokens: int) -> "TfliteRows":
        """This subgraph run at another row count (a smaller bucket), on the same interpreter:
        see TfliteRows. Only without a delegate (an NPU compiles the shape it was given)."""
        if self.delegate:
            raise NpuGraphError(self.name, "a delegate's subgraph runs at its own shape only")
        return TfliteRows(self, int(tokens))

    def _run(self, x: np.ndarray, out: np.ndarray | None, tokens: int) -> np.ndarray:
        want_in, want_out = (tokens, self.input_shape[1]), (tokens, self.output_shape[1])
        if not isinstance(x, np.ndarray) or x.dtype != np.float32 or x.shape != want_in:
            raise NpuInputError(
                f"npu subgraph {self.name!r}: input must be float32 {want_in}, got "
                f"{getattr(x, 'dtype', type(x).__name__)} {getattr(x, 'shape', '')}")
        if out is not None and (not isinstance(out, np.ndarray) or out.dtype != np.float32
                                or out.shape != want_out):
            raise NpuInputError(f"npu subgraph {self.name!r}: out must be float32 {want_out}")
        with self._lock:
            if tokens != self._tokens:
                # XNNPACK reshapes its runtime; the packed weights stay (measured: 0.1 ms)
                try:
                    self._it.resize_tensor_input(self._in, want_in)
                    self._it.allocate_tensors()
                except (RuntimeError, ValueError) as e:
                    self._tokens = None          # the next run resizes again
                    raise NpuGraphError(self.name, f"resize to {tokens} rows failed: {e}") from e
                self._tokens = tokens
            self._it.set_tensor(self._in, x if x.flags.c_contiguous else np.ascontiguousarray(x))
            try:
                self._it.invoke()
            except (RuntimeError, ValueError) as e:      # a delegate failing at run time
                raise NpuGraphError(self.name, f"invoke failed ({self.delegate or 'default CPU'}): {e}") from e
            if out is None:
                return self._it.get_tensor(self._out)
            np.copyto(out, self._it.tensor(self._out)())    # the view is dropped before the next invoke
            return out

    def __repr__(self) -> str:
        return (f"TfliteSubgraph({self.name!r}, {self.input_shape} -> {self.output_shape}, "
                f"runtime={self.runtime}, delegate={self.delegate or 'default CPU'})")


class TfliteRows:
    """A TfliteSubgraph run at `tokens` rows on its own interpreter, resized when the row count
    changes (the CPU path: no delegate). One interpreter per graph instead of one per bucket: the
    buckets shared its weights nowhere (each interpreter held its model's bytes and XNNPACK's
    packed copy: 4 buckets x (1 + 1.1) x the int8 bytes, 1.2 GiB of SmolLM2-135M's 2.4 GiB).
    Each row's result does not depend on the row count (per-row activation quantization, exact
    int32 sums): bit-identical to the bucket's own static-shape model (tests check it)."""

    def __init__(self, sub: TfliteSubgraph, tokens: int):
        self.sub, self.tokens = sub, tokens
        self.name = sub.name
        self.input_shape = (tokens, sub.input_shape[1])
        self.output_shape = (tokens, sub.output_shape[1])

    def run(self, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        return self.sub._run(x, out, self.tokens)

    def __repr__(self) -> str:
        return f"TfliteRows({self.sub!r}, tokens={self.tokens})"


def compile(graph, *, delegate: str | None = None, delegate_options: dict | None = None,
            num_threads: int | None = None, cache_dir: str | os.PathLike | None = None) -> TfliteSubgraph:
    """A ready-to-run TfliteSubgraph for `graph`. NpuGraphError when this path rejects the graph
    (int4 included where the runtime cannot run it), TfliteUnavailable without a runtime,
    TfliteDelegateError when the named delegate cannot be loaded or refuses the subgraph: the
    caller decides the fallback."""
    ok, why = supports(graph)
    if not ok:
        raise NpuGraphError(getattr(graph, "name", "?"), why)
    _runtime()
    if "int4" in _formats(graph):
        ok, why = int4_supported()
        if not ok:
            raise NpuGraphError(graph.name, why)
    npu_cache.cap_bytes()          # a bad EDGELLM_NPU_CACHE_MB is refused on a hit as on a miss
    sub = TfliteSubgraph(graph, load_or_build(graph, cache_dir), delegate=delegate,
                         delegate_options=delegate_options, num_threads=num_threads)
    # the interpreter holds the bytes, not the file; the file is kept anyway while the subgraph
    # lives, so that a model larger than the cap does not evict its own files as it loads
    npu_cache.hold(sub, cache_path(graph, cache_dir))
    return sub
