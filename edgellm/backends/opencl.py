"""The opencl unit: the kernels of opencl_kernels/ on an OpenCL GPU (Mali first), through pyopencl.

Correct first, and never able to take the app down: the unit is probed in a child process
(backends/opencl_probe.py: platform and device choice, a build of the kernels, a numeric
self-check), because a GPU driver that crashes or hangs while probing would otherwise kill the
engine. Only when the child reports success is the device opened in this process; its programs
then come from the binary cache the child filled.

Weights stay in their GGUF block formats, repacked once at prepare() into device buffers
(backends/opencl_matmul.py). Activations cross as fp32 numpy arrays per op.
"""
from __future__ import annotations

import json
import logging
import math
import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass

import numpy as np

from .. import quant
from ..model import layout
from ..model.config import ModelConfig
from . import UnitFailed, opencl_child, opencl_probe_cache
from .opencl_runtime import ClRuntime, KernelBuildError, OpenCLUnavailable, cache_root
# the embedding lookup dequantizes rows on the host, the same for every unit
from .reference import embedding  # noqa: F401

NAME = "opencl"
KIND = "gpu"
log = logging.getLogger("edgellm")

# A cold PoCL build of every probe kernel takes ~10 s on 2 cores; a GPU driver's first compile can
# take as long. A probe that has not answered by then is hung. EDGELLM_OPENCL_PROBE_TIMEOUT overrides.
PROBE_TIMEOUT_S = 180.0
MAX_PROBE_TIMEOUT_S = 1e6   # (waits are whole milliseconds in a C int: 2147484 s raised OverflowError)
_OPS = {"embedding", "rmsnorm", "matmul", "rope", "attention", "swiglu", "add", "lm_head"}
_TYPES = {"Q4_0", "Q4_1", "Q8_0", "F16", "F32"}

_state: dict = {"probe": None, "rt": None, "probe_report": {}}
_lock = threading.Lock()


# ---- probe ---------------------------------------------------------------------------------------

def available() -> tuple[bool, str]:
    """(ok, reason), probed once per process in a guarded child process."""
    with _lock:
        if _state["probe"] is None:
            _state["probe"] = _probe()
            opencl_child.set_answered(True)
        return _state["probe"]


def start_probe() -> None:
    """Starts the probe child now, without waiting for it (backends/opencl_child.py: edgellm.load
    starts it before importing the runtime), so that it runs while load() works; available()
    then collects its answer. Does nothing once probed, while a child runs, or when pyopencl is
    missing (available() says so)."""
    with _lock:
        if _state["probe"] is None:
            opencl_child.spawn()


def reset() -> None:
    """Forget the probe result and the device (tests; a changed environment)."""
    with _lock:
        opencl_child.discard()
        opencl_child.set_answered(False)
        _state.update(probe=None, rt=None, probe_report={})


def probe_timeout_s() -> tuple[float | None, str]:
    """(seconds, "") from EDGELLM_OPENCL_PROBE_TIMEOUT (else PROBE_TIMEOUT_S), or (None, why the
    setting is invalid): 0, a negative, nan or a word would report a healthy driver as hung."""
    raw = os.environ.get("EDGELLM_OPENCL_PROBE_TIMEOUT")
    if raw is None:
        return PROBE_TIMEOUT_S, ""
    try:
        seconds = float(raw)
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and 0 < seconds <= MAX_PROBE_TIMEOUT_S):
        return None, (f"EDGELLM_OPENCL_PROBE_TIMEOUT={raw!r} is invalid: expected a number of seconds in "
                      f"(0, {MAX_PROBE_TIMEOUT_S:.0f}] (unset, the probe waits {PROBE_TIMEOUT_S:.0f} s)")
    return seconds, ""


def _clear_binaries() -> int:
    """Removes the program-binary cache; the number of files removed."""
    n = 0
    for p in cache_root().glob("*.bin"):
        try:
            p.unlink()
            n += 1
        except OSError:
            pass
    return n


def _probe(retried: bool = False) -> tuple[bool, str]:
    """The probe child's answer: the one start_probe() began (with what is left of its
    timeout), else a child started now; or, instead of either, the answer the probe gave on this
    driver and kernel set before (backends/opencl_probe_cache.py)."""
    if not opencl_child.has_pyopencl():     # the cheap check first, in this process
        return False, "pyopencl is not installed (pip install 'edgellm[opencl]')"
    timeout_s, bad = probe_timeout_s()
    if bad:         # checked before any answer is used, so the setting is refused the same way every time
        opencl_child.discard()
        opencl_child.take_cached()
        return False, bad
    # spawn() leaves one of the two: the cached answer it found, or the child it started
    cached, child = opencl_child.take_cached(), opencl_child.take()
    if cached is None and child is None:
        err = opencl_child.spawn()
        cached, child = opencl_child.take_cached(), opencl_child.take()
        if cached is None and child is None:
            return False, f"the OpenCL probe could not start: {err or 'no child process'}"
    if cached is not None:
        _state["probe_report"] = dict(cached, cached=True)
        return True, (f"{cached.get('reason') or 'the OpenCL probe passed'} (the probe's answer of {cached['cached_at']} for "
                      f"this driver and kernel set; EDGELLM_OPENCL_PROBE_CACHE=0 probes again)")
    proc, t0 = child
    try:
        out, err = proc.communicate(timeout=max(0.0, timeout_s - (time.monotonic() - t0)))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return False, f"the OpenCL probe did not finish in {timeout_s:g} s (driver hung?)"
    except BaseException:
        # SIGTERM (SystemExit) or Ctrl-C while waiting for it: the child must not outlive us (it
        # went on writing program binaries into EDGELLM_HOME after the command had exited)
        proc.kill()
        proc.communicate()
        raise
    if proc.returncode < 0:
        try:
            sig = signal.Signals(-proc.returncode).name
        except ValueError:
            sig = f"signal {-proc.returncode}"
        tail = err.strip().splitlines()[-1:] or [""]
        why = f"the OpenCL probe crashed ({sig}) while probing the driver; {tail[0]}".rstrip("; ")
        if not retried and _clear_binaries():
            # a program binary the driver dies on (a damaged file whose header still matches it,
            # another driver build's) crashed every probe, or the engine's own process once a
            # passing answer was kept: the cache goes, and the sources are built once more
            log.warning("%s; the program-binary cache in %s was cleared, probing again", why, cache_root())
            return _probe(retried=True)
        return False, why
    try:
        res = json.loads(out.strip().splitlines()[-1])
    except (IndexError, ValueError):
        tail = (err.strip().splitlines() or ["no output"])[-1]
        return False, f"the OpenCL probe exited with code {proc.returncode} without a result: {tail}"
    _state["probe_report"] = res
    if not res.get("ok"):
        why = str(res.get("reason", "probe failed"))
        if not retried and res.get("from_cache") and _clear_binaries():
            # as a crash above: a cached binary the driver accepts but runs wrong, or one whose
            # fault a GPU driver reports as an error (NVIDIA: OUT_OF_RESOURCES at the read-back)
            # where PoCL dies, failed every probe until the user cleared the cache by hand
            log.warning("%s; the program-binary cache in %s was cleared, probing again", why, cache_root())
            return _probe(retried=True)
        return False, why
    opencl_probe_cache.store(res)
    # the device itself is opened on first use (runtime()): a driver's libraries cost resident
    # memory (PoCL: ~29 MB) that a plan placing nothing on this unit should not pay
    return True, str(res.get("reason", "the OpenCL probe passed"))


def probe_report() -> dict:
    """What the probe child reported: device, build seconds, its own wall time."""
    return dict(_state["probe_report"])


def runtime() -> ClRuntime:
    """The device this process runs on (after a successful probe), opened on first use."""
    if _state["rt"] is None:
        ok, why = available()
        if not ok:
            raise OpenCLUnavailable(why)
        with _lock:
            if _state["rt"] is None:
                _state["rt"] = ClRuntime.create()
    return _state["rt"]


def supports(op: str, precision: str = "fp32") -> tuple[bool, str]:
    if op not in _OPS:
        return False, f"opencl_kernels/ has no {op} kernel"
    if op in ("matmul", "lm_head"):
        if precision in ("fp32", "fp16"):
            return True, f"{precision} GEMV/GEMM (weights dequantized in the kernel, fp32 accumulation)"
        if precision == "int8":
            # what the probe child saw (the device itself is opened on first use)
            if _state["probe_report"].get("int8_dot"):
                return True, "int8 dot-product GEMM (cl_arm_integer_dot_product_int8)"
            return False, "the device reports no integer dot-product extension"
        return False, f"no {precision} matmul kernel"
    if precision != "fp32":
        return False, f"{op} runs in fp32 only"
    if op == "embedding":
        return True, "row gather on the host into a buffer the device reads"
    return True, "fp32 kernel"


# ---- resident weights ----------------------------------------------------------------------------

@dataclass(frozen=True)
class ResidentVector:
    """A small constant (norm gain, QKV bias) uploaded once at prepare(): the ops take it as it is
    instead of copying it to the device on every call."""
    host: np.ndarray        # float32 (n,), for shape checks
    buf: object             # the device buffer (ClRuntime.resident)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.host.shape


@dataclass(frozen=True)
class LayerWeights:
    attn_norm: ResidentVector
    wqkv: object            # opencl_matmul.ClMatrix, or None when this unit does not run qkv
    bqkv: ResidentVector | None
    wo: object
    ffn_norm: ResidentVector
    w_gate_up: object
    w_down: object


@dataclass(frozen=True)
class PreparedWeights:
    embedding: object       # reference.EmbeddingTable
    layers: tuple[LayerWeights, ...]
    output_norm: ResidentVector
    lm_head: object
    nbytes: int             # device bytes of the packed matrices


def prepare(model, precision: str = "fp32", progress=None, ops=None) -> PreparedWeights:
    """Pack and upload the matrices of the ops this unit runs (`ops`; None: all), once."""
    from . import opencl_matmul
    from .reference import EmbeddingTable

    try:
        # the probe passed in its child, yet opening the device here can still fail (a driver out
        # of contexts, a device taken since): the unit is out, not the load
        rt = runtime()
    except OpenCLUnavailable as e:
        raise UnitFailed(NAME, str(e)) from e
    cfg: ModelConfig = model.config
    d = cfg.d_model
    need = (lambda op: True) if ops is None else (lambda op: op in ops)
    total = [0]

    def f32(name, shape):
        return quant.dequantize(model.raw(name), model.tensor_type(name), shape)

    def vec(a: np.ndarray | None) -> ResidentVector | None:
        if a is None:
            return None
        a = np.ascontiguousarray(a, dtype=np.float32)
        try:
            return ResidentVector(a, rt.resident(a))
        except OpenCLUnavailable as e:
            raise UnitFailed(NAME, str(e)) from e

    def mat(op: str, *parts: tuple[str, int], k: int):
        if not need(op):
            return None
        types = {model.tensor_type(n).name for n, _ in parts}
        if len(types) != 1 or not types <= _TYPES:
            raise UnitFailed(NAME, f"{[n for n, _ in parts]}: the OpenCL kernels read one of {sorted(_TYPES)} "
                             f"per projection, found {sorted(types)}", ops=(op,))
        try:
            m = opencl_matmul.pack(rt, types.pop(), [model.raw(n) for n, _ in parts], [r for _, r in parts], k)
        except (KernelBuildError, OpenCLUnavailable) as e:
            raise UnitFailed(NAME, str(e)) from e
        total[0] += m.nbytes
        return m

    def proj(i: int, op: str):
        parts, k = layout.projection(cfg, i, op)
        return mat(op, *parts, k=k)

    layers = []
    for i in range(cfg.n_layers):
        p = f"blk.{i}."
        layers.append(LayerWeights(
            attn_norm=vec(f32(p + "attn_norm.weight", (d,))), wqkv=proj(i, "qkv"),
            bqkv=vec(layout.qkv_bias(model, i)),
            wo=proj(i, "attn_out"), ffn_norm=vec(f32(p + "ffn_norm.weight", (d,))),
            w_gate_up=proj(i, "ffn_gate_up"), w_down=proj(i, "ffn_down")))
        if progress:
            progress(i + 1, cfg.n_layers + 1)
    lm = mat("lm_head", (layout.head_tensor(cfg), cfg.vocab_size), k=d)
    if progress:
        progress(cfg.n_layers + 1, cfg.n_layers + 1)
    _warm_up(rt, cfg, ops)
    return PreparedWeights(
        embedding=EmbeddingTable(model.raw("token_embd.weight"), model.tensor_type("token_embd.weight"), d),
        layers=tuple(layers), output_norm=vec(f32("output_norm.weight", (d,))), lm_head=lm, nbytes=total[0])


def _warm_up(rt: ClRuntime, cfg: ModelConfig, ops) -> None:
    """Build the model-specific elementwise and attention programs now, at load: a kernel that
    fails to build must fail here (and the engine re-plan without this unit), not mid-request."""
    from . import opencl_attention, opencl_elementwise

    need = (lambda op: True) if ops is None else (lambda op: op in ops)
    H, KVH, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    if need("attention") and hd > opencl_attention.MAX_HEAD_DIM:
        raise UnitFailed(NAME, f"head_dim {hd} is above its attention kernel's {opencl_attention.MAX_HEAD_DIM}",
                         ops=("attention",))
    x = np.ones((2, cfg.d_model), np.float32)
    try:
        if need("attn_norm") or need("ffn_norm") or need("output_norm"):
            opencl_elementwise.rmsnorm(rt, x, np.ones(cfg.d_model, np.float32), cfg.norm_eps)
        if need("rope"):
            half = cfg.rope_dim // 2
            opencl_elementwise.rope(rt, np.ones((2, H, hd), np.float32), np.ones((2, half), np.float32),
                                    np.zeros((2, half), np.float32), cfg.rope_style)
        if need("swiglu"):
            opencl_elementwise.swiglu(rt, np.ones((2, 2 * cfg.d_ff), np.float32))
        if need("attn_add") or need("ffn_add"):
            opencl_elementwise.add(rt, x, x)
        if need("attention"):
            # every layout and K/V type: the default KV pool is f16, a program of its own
            opencl_attention.warm_up(rt, H, KVH, hd)
    except KernelBuildError as e:
        # attention's programs are its own: one that does not build moves attention alone
        raise UnitFailed(NAME, str(e), ops=("attention",) if e.family == opencl_attention.FAMILY else ()) from e
    except OpenCLUnavailable as e:
        raise UnitFailed(NAME, str(e)) from e


def prepared_nbytes(cfg: ModelConfig, ops=None) -> int:
    """Host bytes: the fp32 norm vectors. The packed matrices live in device buffers, which on a
    unified-memory GPU are the same DRAM: about the GGUF size of the matrices this unit runs."""
    return 4 * (2 * cfg.n_layers + 1) * cfg.d_model


# ---- ops -----------------------------------------------------------------------------------------

def matmul(x: np.ndarray, w, b: np.ndarray | None = None) -> np.ndarray:
    from . import opencl_matmul

    return opencl_matmul.matmul(runtime(), x, w, b)


def lm_head(x: np.ndarray, w) -> np.ndarray:
    return matmul(x, w)


def rmsnorm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    from . import opencl_elementwise

    return opencl_elementwise.rmsnorm(runtime(), x, w, eps)


def rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, style: str) -> np.ndarray:
    from . import opencl_elementwise

    return opencl_elementwise.rope(runtime(), x, cos, sin, style)


def swiglu(gate_up: np.ndarray) -> np.ndarray:
    from . import opencl_elementwise

    return opencl_elementwise.swiglu(runtime(), gate_up)


def add(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    from . import opencl_elementwise

    return opencl_elementwise.add(runtime(), a, b)


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, start: int) -> np.ndarray:
    from . import opencl_attention

    return opencl_attention.attention(runtime(), q, k, v, start)


def can_read_pool(pool) -> bool:
    from . import opencl_attention

    return opencl_attention.can_read_pool(pool)


def attention_pool(q: np.ndarray, pool, table: np.ndarray, layer: int, start: int) -> np.ndarray:
    from . import opencl_attention

    return opencl_attention.attention_pool(runtime(), q, pool, table, layer, start)


def kernel_times() -> dict[str, list[float]]:
    """Per-kernel device times from profiling events (after enable_profiling())."""
    rt = _state["rt"]
    return dict(rt.timings) if rt is not None else {}


def enable_profiling(on: bool = True) -> None:
    runtime().profiling = on

