"""The npu unit: the prefill projections of each layer as static-shape subgraphs, one per token
bucket, run through ONNX Runtime execution providers (npu_onnx.py) or a LiteRT/TFLite delegate
(npu_tflite.py). NPUs compile for fixed shapes and want int8 weights: each matrix the plan gives
this unit is requantized at load to the runtime's int8 form (weight_format(): int8 blocks of 32
on ONNX Runtime, int8 per output channel per 64-column slice on LiteRT; fp16 where the precision
plan keeps a projection in a float format; npu_graphs.py) and compiled once per bucket (LiteRT on
its CPU kernels: once, resized per bucket, _shares_buckets); a chunk is split into bucket-sized pieces, the last one padded (its padded rows are
computed and dropped: the cost model counts that waste).

Runtime choice: EDGELLM_NPU_RUNTIME=onnx|tflite, else ONNX Runtime when one of the profile's
providers is present, else LiteRT. The profile says which providers (priority order) or which
external delegate the device has (use_profile(), called by the dispatcher before it probes).
"""
from __future__ import annotations

import logging
import os
import threading
import weakref
from dataclasses import dataclass

import numpy as np

from .. import quant
from ..model import layout
from ..model.config import ModelConfig
from . import UnitFailed, npu_graphs

NAME = "npu"
KIND = "npu"
log = logging.getLogger("edgellm")

DEFAULT_BUCKETS = (32, 64, 128, 256)
# Self-check bound: the runtime's int8 form (int8b: float activations; int8/int8s: activations
# rounded to int8 per row, or per row and 64-column slice) against the float reference of the
# same int8 weights: activation rounding alone gives NMSE ~2e-5 on Gaussian data (less per
# slice); a broken provider or a wrong packing is off by orders of magnitude.
SELF_CHECK_NMSE = 5e-4
_MATMUL_OPS = {"qkv": "attn", "attn_out": "attn_out", "ffn_gate_up": "ffn", "ffn_down": "ffn_down",
               "lm_head": "head"}

_state: dict = {"profile_npu": None, "probe": None, "runtime": None, "plan": None,
                "conflict": None}
_lock = threading.Lock()
# the weights prepared for live engines: while any is alive the process's NPU configuration (the
# state above, which their subgraphs run under) must not change under them
_live: "weakref.WeakValueDictionary[int, PreparedWeights]" = weakref.WeakValueDictionary()


def use_profile(profile) -> None:
    """The device profile's NPU section (providers, delegate, buckets): set before probing. The
    unit serves one NPU configuration per process: while an engine's weights use another, this
    load sees the unit unavailable, with the reason (switching broke the first engine for good)."""
    npu = getattr(profile, "npu", None)
    with _lock:
        _state["conflict"] = None
        if npu == _state["profile_npu"]:
            return
        if len(_live):
            old = getattr(_state["profile_npu"], "name", "another profile's NPU")
            _state["conflict"] = (f"a live engine uses this process's NPU unit as {old}; it serves one NPU "
                                  f"configuration per process")
            return
        _state.update(profile_npu=npu, probe=None, runtime=None)


def use_plan(plan) -> None:
    """The engine's precision plan (None: none). A projection the plan stores in a float format
    (f16, f32) runs as an fp16-weights subgraph; every other one in the runtime's int8 form."""
    _state["plan"] = plan


def configure(threads: int | None = None, cores=None) -> None:
    """(The units' interface.) Nothing to set: every subgraph runs on the calling thread (_compile
    says why), whatever the engine's thread count."""


def reset() -> None:
    with _lock:
        _state.update(profile_npu=None, probe=None, runtime=None, conflict=None)
        _live.clear()


def _providers() -> tuple[str, ...]:
    npu = _state["profile_npu"]
    return tuple(npu.onnx_providers) if npu is not None else ("CPUExecutionProvider",)


def _usable_providers() -> list[str]:
    """The profile's ONNX Runtime providers this onnxruntime has, in the profile's order."""
    import onnxruntime as ort

    have = set(ort.get_available_providers())
    return [p for p in _providers() if p in have]


def _delegate() -> str | None:
    npu = _state["profile_npu"]
    return npu.tflite_delegate if npu is not None else None


def buckets() -> tuple[int, ...]:
    npu = _state["profile_npu"]
    return tuple(npu.chunk_buckets) if npu is not None and npu.chunk_buckets else DEFAULT_BUCKETS


def _choose_runtime() -> tuple[object | None, str]:
    """(runtime module, why) or (None, why not)."""
    want = os.environ.get("EDGELLM_NPU_RUNTIME", "").strip().lower()
    if want not in ("", "onnx", "tflite"):
        return None, f"EDGELLM_NPU_RUNTIME={want!r}: expected onnx or tflite"
    reasons = []
    for name in (("onnx", "tflite") if not want else (want,)):
        try:
            if name == "onnx":
                from . import npu_onnx as mod
            else:
                from . import npu_tflite as mod
        except ImportError as e:
            reasons.append(f"{name}: {e}")
            continue
        ok, why = mod.available()
        if not ok:
            reasons.append(f"{name}: {why}")
            continue
        if name == "onnx":
            import onnxruntime as ort

            have = set(ort.get_available_providers())
            usable = _usable_providers()
            if not usable:
                reasons.append(f"onnx: none of the profile's providers {list(_providers())} is in this "
                               f"onnxruntime (it has {sorted(have)})")
                continue
            skipped = [p for p in _providers() if p not in have]
            note = f" (not present: {', '.join(skipped)})" if skipped else ""
            return mod, f"ONNX Runtime with {', '.join(usable)}{note}"
        d = _delegate()
        why = f"LiteRT with {'delegate ' + d if d else 'its built-in CPU/XNNPACK kernels'}"
        return mod, why + _onnx_skipped(reasons, why)
    return None, "; ".join(reasons) or "no NPU runtime"


def _onnx_skipped(reasons: list[str], chosen: str) -> str:
    """The unit-reason suffix saying why ONNX Runtime was passed over for LiteRT ("" when it was
    not tried); a warning too when the profile names ONNX providers, whose NPU then goes unused
    (LiteRT without a delegate runs the ops on its CPU kernels)."""
    if not reasons:
        return ""
    npu = _state["profile_npu"]
    if npu is not None and npu.onnx_providers:
        log.warning("npu: ONNX Runtime skipped (%s); using %s", "; ".join(reasons), chosen)
    return f" (ONNX Runtime skipped: {'; '.join(reasons)})"


def weight_format(mod=None) -> str:
    """The NPU weight format per runtime: ONNX Runtime runs int8 weight blocks with float
    activations (int8b: MatMulNBits, W8A16-style); LiteRT runs int8s, one int8 FULLY_CONNECTED
    per 64-column slice of K, each with its own per-output-channel weight scales and its own
    int8 rounding of the input rows (its kernel quantizes the activations; per slice, the error
    stays within the issue's accuracy bound, where one FC over the whole of K does not).
    EDGELLM_NPU_FORMAT overrides; int8s with ONNX Runtime is refused (UnitFailed), as its path
    has no int8s form."""
    mod = mod or _state["runtime"]
    on_onnx = mod is not None and mod.__name__.endswith("npu_onnx")
    env = os.environ.get("EDGELLM_NPU_FORMAT", "").strip()
    if env:
        if env not in npu_graphs.FORMATS:
            raise UnitFailed(NAME, f"EDGELLM_NPU_FORMAT={env!r}: expected one of {npu_graphs.FORMATS}")
        if env == "int8s" and on_onnx:
            raise UnitFailed(NAME, "EDGELLM_NPU_FORMAT=int8s is LiteRT's sliced hybrid form; the ONNX "
                                   "Runtime path does not build it (use int8b or int8 there, or "
                                   "EDGELLM_NPU_RUNTIME=tflite)")
        return env
    return "int8b" if on_onnx else "int8s"


def _compile(mod, graph):
    if mod.__name__.endswith("npu_onnx"):
        return mod.compile(graph, providers=list(_providers()))
    # one thread: each LiteRT interpreter with num_threads > 1 starts its own XNNPACK pool, and a
    # model holds one interpreter per layer x op x bucket (measured: 2 -> 54 threads for a 4-layer
    # test model at threads=2); the work is the delegate's, or on its CPU kernels the calling
    # thread's (npu_onnx.OnnxSubgraph says why a shared pool is not used there either)
    return mod.compile(graph, delegate=_delegate(), num_threads=1)


def available() -> tuple[bool, str]:
    """A runtime is importable, one of the profile's providers (or its delegate) loads, and an
    int8 subgraph matches the reference."""
    with _lock:
        if _state["conflict"] is not None:
            return False, _state["conflict"]
        if _state["probe"] is None:
            _state["probe"] = _probe()
        return _state["probe"]


def _probe() -> tuple[bool, str]:
    mod, why = _choose_runtime()
    if mod is None:
        return False, why
    try:
        rng = np.random.default_rng(11)
        w = npu_graphs.quantize(rng.standard_normal((48, 64)).astype(np.float32), weight_format(mod))
        g = npu_graphs.LinearGraph("self-check", w, 32)
        x = rng.standard_normal((32, 64)).astype(np.float32)
        got, ref = _compile(mod, g).run(x), npu_graphs.reference(g, x)
        e = float(np.mean((got - ref) ** 2) / np.mean(ref ** 2))
        if not e <= SELF_CHECK_NMSE:
            return False, f"numeric self-check failed ({why}): int8 linear NMSE {e:.2e} > {SELF_CHECK_NMSE:.0e}"
    except Exception as e:  # a provider that throws while probing leaves the unit unavailable
        return False, f"{why}: self-check failed: {type(e).__name__}: {e}"
    _state["runtime"] = mod
    cpu = _cpu_kernels_only(mod)
    if cpu:
        # the unit works (its self-check passed), but not on the NPU the plan costs it as: on a
        # device that is a slow plan nobody is told about (rk3588: its RKNN NPU has no provider)
        npu = _state["profile_npu"]
        peaks = ", ".join(f"{p} {v / 1e12:g} {'TOPS' if p.startswith('int') else 'TFLOPS'}"
                          for p, v in npu.peak.items()) if npu is not None else "?"
        log.warning("npu: no provider or delegate here reaches %s: its subgraphs run on %s, while the "
                    "plan costs them at the NPU's figures (%s); `--units` without npu plans without it",
                    npu.name if npu is not None else "the NPU", cpu, peaks)
        why += f"; on {cpu}, not the NPU"
    return True, why


_CPU_PROVIDERS = ("CPUExecutionProvider", "XnnpackExecutionProvider")


def _cpu_kernels_only(mod) -> str | None:
    """What runs the subgraphs when the chosen runtime reaches no accelerator (ONNX Runtime with
    CPU providers only, LiteRT without a delegate), else None."""
    if mod.__name__.endswith("npu_onnx"):
        usable = _usable_providers()
        return f"ONNX Runtime's CPU kernels ({', '.join(usable)})" if set(usable) <= set(_CPU_PROVIDERS) else None
    return None if _delegate() else "LiteRT's CPU kernels (no delegate)"


# the op kinds this backend runs, whatever a profile's supported_ops claims: `edgellm plan` for
# another device (no probe) checks them too, so it never plans an op here that a run moves away
OPS = frozenset({"matmul", "lm_head", "swiglu"})


def supports(op: str, precision: str = "int8") -> tuple[bool, str]:
    if op == "swiglu":
        return True, "inside the FFN subgraph (gate/up, swiglu and down in one graph per bucket)"
    if op not in OPS:
        return False, "the NPU takes only the projections (static-shape matmul subgraphs)"
    if precision not in ("int8", "fp16", "fp32"):
        return False, f"no {precision} subgraphs"
    return True, f"{precision} static-shape subgraphs, buckets {list(buckets())}"


# ---- resident weights ------------------------------------------------------------------------------

@dataclass(frozen=True, eq=False)
class NpuMatrix:
    """One projection (or the fused FFN) compiled for every bucket: bucket -> subgraph with
    .run((bucket, K) f32) -> (bucket, N). `make(bucket)` builds the graph spec; a bucket whose
    subgraph was not compiled at load (an FFN projection the plan normally runs inside the fused
    FFN) is compiled on first use, and logged."""
    name: str
    n: int
    k: int
    graphs: dict
    make: object            # bucket -> LinearGraph | FfnGraph
    ops: tuple[str, ...]    # the engine ops it serves (a rejection re-plans exactly these)


@dataclass(frozen=True)
class LayerWeights:
    attn_norm: np.ndarray
    wqkv: NpuMatrix | None
    bqkv: None              # the bias is inside the QKV subgraph
    wo: NpuMatrix | None
    ffn_norm: np.ndarray
    w_gate_up: NpuMatrix | None
    w_down: NpuMatrix | None
    ffn: NpuMatrix | None    # gate/up, swiglu and down in one subgraph, when this unit runs all three


@dataclass(frozen=True)
class PreparedWeights:
    embedding: object
    layers: tuple[LayerWeights, ...]
    output_norm: np.ndarray
    lm_head: NpuMatrix | None
    nbytes: int


def prepare(model, precision: str = "int8", progress=None, ops=None) -> PreparedWeights:
    """Requantize the matrices of the ops this unit runs to int8 per channel and compile each for
    every bucket (from the on-disk cache when built before)."""
    from .reference import EmbeddingTable

    ok, why = available()
    if not ok:
        raise UnitFailed(NAME, why)
    mod = _state["runtime"]
    before = (mod.stats.loaded, mod.stats.built)
    cfg: ModelConfig = model.config
    d = cfg.d_model
    need = (lambda op: True) if ops is None else (lambda op: op in ops)
    total = [0]
    steps = cfg.n_layers + 1

    def f32(name, shape):
        return quant.dequantize(model.raw(name), model.tensor_type(name), shape)

    fused_ffn = need("swiglu") and need("ffn_gate_up") and need("ffn_down")

    plan = _state.get("plan")

    def planned(layer: int | None, op: str) -> str:
        """fp16 where the precision plan keeps this projection in a float format (its most
        sensitive ones, typically), else the runtime's int8 form."""
        if plan is not None and not os.environ.get("EDGELLM_NPU_FORMAT", "").strip() \
                and plan.weight_format(layer, op, cfg.n_layers) in ("f16", "f32"):
            return "fp16"
        return weight_format(mod)

    def qlin(*parts: tuple[str, int], k: int, bias=None, fmt: str | None = None, op: str = ""):
        if len(parts) > 1:
            w = np.concatenate([f32(n, (r, k)) for n, r in parts])
        elif parts[0][1] > npu_graphs._QUANT_ROWS:     # (the head) dequantized as quantize reads it
            w = _GgufRows(model.raw(parts[0][0]), model.tensor_type(parts[0][0]), (parts[0][1], k))
        else:
            w = f32(parts[0][0], (parts[0][1], k))
        fmt = fmt or weight_format(mod)
        if fmt == "int8s" and k % npu_graphs.INT8S_SLICE:
            # a width the slices do not divide: one scale per output channel over the whole row
            log.info("npu: %s has K = %d, not a multiple of %d: int8 per channel instead of int8s",
                     parts[0][0], k, npu_graphs.INT8S_SLICE)
            fmt = "int8"
        try:
            q = npu_graphs.quantize(w, fmt, bias)
        except ValueError as e:   # a shape the format cannot hold (int8b: K a multiple of 32): elsewhere
            raise UnitFailed(NAME, f"{parts[0][0]}: {e}", ops=(op,) if op else ()) from e
        total[0] += q.q.nbytes + (q.scale.nbytes if q.scale is not None else 0)
        return q

    def compiled(label: str, n: int, k: int, make, eager: bool = True, ops: tuple[str, ...] = ()) -> NpuMatrix:
        m = NpuMatrix(label, n, k, {}, make, ops)
        for b in buckets() if eager else ():
            _graph(m, b)
        return m

    def linear(op: str, label: str, q: "_Requantized", eager: bool = True) -> NpuMatrix:
        return compiled(label, q.n, q.k, lambda b: npu_graphs.LinearGraph(label, q.get(), b), eager, (op,))

    def requantized(*parts: tuple[str, int], k: int, bias=None, fmt: str, op: str) -> "_Requantized":
        return _Requantized(lambda: qlin(*parts, k=k, bias=bias, fmt=fmt, op=op), held)

    def proj(i: int, op: str, bias=None):
        """The projection's requantized weights, or None when this unit does not run it."""
        if not need(op):
            return None
        parts, k = layout.projection(cfg, i, op)
        return requantized(*parts, k=k, bias=bias, fmt=planned(i, op), op=op)

    held: list[_Requantized] = []

    layers = []
    for i in range(cfg.n_layers):
        p = f"blk.{i}."
        qkv, wo = proj(i, "qkv", layout.qkv_bias(model, i)), proj(i, "attn_out")
        gu, down = proj(i, "ffn_gate_up"), proj(i, "ffn_down")
        # a fused FFN's projections compile alone only if a plan ever needs them so (lazily)
        layers.append(LayerWeights(
            attn_norm=f32(p + "attn_norm.weight", (d,)),
            wqkv=qkv and linear("qkv", p + "qkv", qkv), bqkv=None,      # the bias is in the subgraph
            wo=wo and linear("attn_out", p + "attn_out", wo), ffn_norm=f32(p + "ffn_norm.weight", (d,)),
            w_gate_up=gu and linear("ffn_gate_up", p + "ffn_gate_up", gu, eager=not fused_ffn),
            w_down=down and linear("ffn_down", p + "ffn_down", down, eager=not fused_ffn),
            ffn=_ffn(p + "ffn", gu, down, compiled, d) if fused_ffn else None))
        if progress:
            progress(i + 1, steps)
    lm = None
    if need("lm_head"):
        lm = linear("lm_head", "lm_head", requantized((layout.head_tensor(cfg), cfg.vocab_size), k=d,
                                                      fmt=planned(None, "lm_head"), op="lm_head"))
    if progress:
        progress(steps, steps)
    prepared = PreparedWeights(
        embedding=EmbeddingTable(model.raw("token_embd.weight"), model.tensor_type("token_embd.weight"), d),
        layers=tuple(layers), output_norm=f32("output_norm.weight", (d,)), lm_head=lm, nbytes=total[0])
    for q in held:        # the compiled subgraphs hold the weights now
        q.drop()
    _live[id(prepared)] = prepared
    # what a warm load saved is visible (only the time showed a cache hit)
    log.info("npu: %d subgraph models read from the graph cache, %d built", mod.stats.loaded - before[0],
             mod.stats.built - before[1])
    return prepared


class _GgufRows:
    """A GGUF matrix (rows, K) whose [r0:r1] dequantizes those rows alone (npu_graphs.quantize
    reads a tall matrix so: SmolLM2's head as f32 was 108 MiB of the load's peak RSS)."""

    def __init__(self, raw: np.ndarray, qtype, shape: tuple[int, int]):
        self.raw, self.qtype, self.shape = raw, qtype, shape

    def __getitem__(self, rows: slice) -> np.ndarray:
        idx = np.arange(self.shape[0])[rows]
        return quant.dequantize_rows(self.raw, self.qtype, self.shape[1], idx)


class _Requantized:
    """One projection's requantized weights (npu_graphs.QLinear): computed once when prepare()
    asks, held while it compiles the subgraphs, then dropped (drop()): the subgraphs hold their
    own copies, and this one (SmolLM2-135M: 136 MiB) stayed for a graph built after load (a fused
    FFN's projection alone, compiled on first use) that get() now computes again from the model,
    to the same bits (the format is fixed here, the model's bytes are mapped, the steps per row)."""

    def __init__(self, make, held: list):
        self._make = make
        self._q = make()
        self.n, self.k = self._q.n, self._q.k
        held.append(self)

    def get(self) -> npu_graphs.QLinear:
        return self._q if self._q is not None else self._make()

    def drop(self) -> None:
        self._q = None


def _ffn(label: str, gu: _Requantized, down: _Requantized, compiled, d: int) -> NpuMatrix:
    """gate/up, swiglu and down as one subgraph per bucket, on the projections' own weights."""
    return compiled(label, d, d, lambda b: npu_graphs.FfnGraph(label, gu.get(), down.get(), b),
                    ops=("ffn_gate_up", "swiglu", "ffn_down"))


def _shares_buckets() -> bool:
    """LiteRT on its CPU kernels (no delegate): one interpreter per graph, built for the smallest
    bucket and resized to the others when they run (npu_tflite.TfliteRows), instead of one per
    bucket, each with its own copy of the weights (SmolLM2-135M: 2.4 GiB resident after load,
    1.3 GiB of it the other buckets' copies). Built small, a graph's activations take a larger
    bucket's room only once one runs (the head's 256-row buffers, ~100 MiB, never do in a
    generation: it computes the last row's logits). A delegate keeps one static-shape graph per
    bucket: an NPU compiles the shape it is given. ONNX Runtime: its sessions are static-shape
    graphs too."""
    mod = _state["runtime"]
    return mod is not None and mod.__name__.endswith("npu_tflite") and not _delegate()


def _graph(m: NpuMatrix, bucket: int):
    g = m.graphs.get(bucket)
    if g is None:
        if _state["runtime"] is None:
            raise UnitFailed(NAME, "the npu unit is not available")
        try:
            low = min(buckets())
            if bucket != low and _shares_buckets():
                g = m.graphs[bucket] = _graph(m, low).rows(bucket)
            else:
                g = m.graphs[bucket] = _compile(_state["runtime"], m.make(bucket))
        except UnitFailed:
            raise
        except Exception as e:   # a rejected subgraph: the unit re-plans away, with the reason
            raise UnitFailed(NAME, f"subgraph {m.name} (bucket {bucket}) rejected: {type(e).__name__}: {e}",
                             m.ops) from e
    return g


# Resident bytes per byte of the weight format, and per compiled subgraph, as measured: RSS before
# and after prepare() of 4-layer synthetic models (d 256 / ff 512 and d 512 / ff 1024, vocab 1024,
# buckets 32-256), onnxruntime 1.32 CPU EP and ai_edge_litert on x86-64, fitted over both sizes:
#   ONNX Runtime  int8b 2.6x + 0.19 MiB a graph; int8 ~3.2x; fp16 ~4.6x of the fp16 bytes (the CPU
#                 EP folds the Cast: fp32 weights beside the fp16 initializers); fp32 ~1.8x
#   LiteRT        int8s 5.0x + 0.57 MiB a graph (model buffer, interpreter and XNNPACK's packed
#                 copy); fp16 ~3.8x; fp32 ~2.6x
# SmolLM2-135M checks them: 516 MiB of int8 weights x 4 buckets peaked at 1.5 GiB RSS on ONNX
# Runtime (2.9x), 2.4-2.8 GiB on LiteRT (4.8-5.5x), 3.3 GiB with fp16 on ONNX Runtime. Each figure
# is rounded up (and ONNX fp32 kept above fp16), so that the load-time memory check refuses
# before a phone's low-memory killer would act.
_RESIDENT = {"onnx": {"int8": 3.0, "int8b": 3.0, "int4": 3.0, "int8s": 3.0, "fp16": 4.75, "fp32": 2.5},
             "tflite": {"int8": 5.5, "int8b": 5.5, "int4": 5.5, "int8s": 5.5, "fp16": 4.0, "fp32": 3.0}}
_GRAPH_BYTES = {"onnx": 0.25 * 2**20, "tflite": 0.6 * 2**20}
# LiteRT without a delegate, one interpreter per graph (_shares_buckets): each keeps its largest
# bucket's activations (the int8s slices' partial sums, the FFN's gate/up and SiLU), measured on
# SmolLM2-135M after every graph ran at 256 rows: 659 MiB, 3.3 f32 values per output value of
# each graph (the head's 49152 and each layer's 960 + 576 + 3072 + 576 outputs a row); rounded up
_ACTIVATIONS = 4
_FORMAT_BYTES = {"int8": 1, "int8s": 1, "int8b": 1, "int4": 1, "fp16": 2, "fp32": 4}   # a weight element


def prepared_nbytes(cfg: ModelConfig, ops=None) -> int:
    """What the matrices this unit runs take once their subgraphs are built: the weight format's
    bytes (fp16 2 a weight, fp32 4, the int8 forms 1, plus their fp32 scales: one per row (int8),
    per row and 64-column slice (int8s) or 32-column block (int8b, int4)) once per bucket (each
    bucket's compiled subgraph holds its own copy: runtimes do not share constants across
    sessions), times the runtime's measured overhead (_RESIDENT), plus a fixed cost per subgraph.
    LiteRT without a delegate: once, plus the largest bucket's activations (_shares_buckets).
    Before the probe picked a runtime: LiteRT's per-bucket figures, the larger."""
    try:
        fmt = weight_format()
    except UnitFailed:                    # a bad EDGELLM_NPU_FORMAT: load() reports it
        fmt = "int8s"
    mod = _state["runtime"]
    rt = "onnx" if mod is not None and mod.__name__.endswith("npu_onnx") else "tflite"
    block = {"int8s": npu_graphs.INT8S_SLICE, "int8b": npu_graphs.INT4_BLOCK,
             "int4": npu_graphs.INT4_BLOCK}.get(fmt)
    width = _FORMAT_BYTES.get(fmt, 4)
    floats = fmt in ("fp16", "fp32")

    def scales(c: int) -> int:            # fp32 scale bytes of one weight row of c columns
        return 0 if floats else 4 * (-(-c // block) if block else 1)

    d = cfg.d_model
    per_op = {"qkv": (cfg.q_dim + 2 * cfg.kv_dim, d), "attn_out": (d, cfg.q_dim), "ffn_gate_up": (2 * cfg.d_ff, d),
              "ffn_down": (d, cfg.d_ff)}
    shapes = [(cfg.n_layers * r, c) for op, (r, c) in per_op.items() if ops is None or op in ops]
    graphs = len(shapes) * cfg.n_layers   # (a fused FFN is one graph for two ops: counted as two)
    if ops is None or "lm_head" in ops:
        shapes.append((cfg.vocab_size, d))
        graphs += 1
    # the overhead factor on the weights; the scales (a few % of them) counted once, as stored
    weights = sum(r * c * width for r, c in shapes) * _RESIDENT[rt][fmt]
    scale = sum(r * scales(c) for r, c in shapes)
    per_bucket = weights + scale + graphs * _GRAPH_BYTES[rt]
    norms = 4 * (2 * cfg.n_layers + 1) * d
    if _shares_buckets():
        # one interpreter per graph, resized per bucket: the weights once, and the largest
        # bucket's activations once it ran, _ACTIVATIONS f32 values per output value
        rows = sum(r for r, _ in shapes)
        return int(per_bucket + 4 * _ACTIVATIONS * max(buckets()) * rows) + norms
    return int(per_bucket * len(buckets())) + norms


# ---- ops ----------------------------------------------------------------------------------------------

def _run(w: NpuMatrix, x: np.ndarray) -> np.ndarray:
    """x (T, K) -> (T, N): pieces of the largest bucket, the rest padded up to the smallest bucket
    that holds it."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    T = x.shape[0]
    if not w.graphs:
        log.info("npu: compiling %s now (its FFN normally runs as one fused subgraph)", w.name)
    sizes = sorted(buckets())
    top = sizes[-1]
    out = np.empty((T, w.n), np.float32)
    for s in range(0, T, top):
        rows = min(top, T - s)
        b = next(b for b in sizes if b >= rows)
        if rows == b:
            out[s:s + rows] = _run_piece(w, b, x[s:s + rows])
        else:
            xp = np.zeros((b, w.k), np.float32)
            xp[:rows] = x[s:s + rows]
            out[s:s + rows] = _run_piece(w, b, xp)[:rows]
    return out


# A provider or delegate that fails after load (a device lost, a driver reset) fails every later
# run the same way, and the engine's plan is fixed at load: say so, and what to do about it.
RUN_FAILED_HINT = ("the npu unit failed after the model was loaded, and this engine cannot move its ops "
                   "now: load the model again without it (units without 'npu', e.g. --units reference)")


def _run_piece(w: NpuMatrix, bucket: int, x: np.ndarray) -> np.ndarray:
    try:
        return _graph(w, bucket).run(x)
    except npu_graphs.NpuGraphError as e:
        raise npu_graphs.NpuGraphError(e.graph, f"{e.reason}; {RUN_FAILED_HINT}") from e


def matmul(x: np.ndarray, w: NpuMatrix, b: np.ndarray | None = None) -> np.ndarray:
    y = _run(w, x)
    if b is not None:      # only when a caller passes one; the model's QKV bias is in the subgraph
        y += b
    return y


def lm_head(x: np.ndarray, w: NpuMatrix) -> np.ndarray:
    return _run(w, x)


def ffn(h: np.ndarray, layer: LayerWeights) -> np.ndarray:
    """down(silu(gate(h)) * up(h)) in the layer's fused FFN subgraph: (T, d) -> (T, d)."""
    return _run(layer.ffn, h)


_warned_split = []


def swiglu(gate_up: np.ndarray) -> np.ndarray:
    """Reached only when a plan puts swiglu on the npu without both FFN projections (the fused
    subgraph needs all three): computed on the host, said once."""
    from . import reference

    if not _warned_split:
        _warned_split.append(True)
        log.warning("npu: swiglu placed without its FFN projections; computing it on the host")
    return reference.swiglu(gate_up)

