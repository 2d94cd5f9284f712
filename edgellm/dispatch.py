"""Placement: which unit runs each op, per phase (prefill chunk / decode step), and why.

The only place that decides placement. For one layer, the dispatcher minimises the predicted time
of the whole layer, handoffs between units included (a dynamic programme over the op chain: a
unit that is locally fastest can lose once moving its input there is paid for). Layers are
identical, so the layer's residual stream must end on the unit it started on. Every decision
keeps its reason and the other units' predicted times or why they could not take the op.
"""
from __future__ import annotations

import copy
import logging
import math
from dataclasses import dataclass, replace
from typing import Mapping, Sequence

from . import backends
from .chunking import ChunkChoice, choose_chunk, chunk_bounds
from .precision_runtime import ENGINE_TO_PLAN, ComputeTable
from .costmodel import FFN_INNER_KINDS, Estimate, Unit, cpu_unit, estimate, gpu_unit, handoff_ms, npu_unit
from .device.profile import DeviceProfile
from .errors import ConfigError, shown
from .model.config import ModelConfig
from .ops import ACT_BYTES, MATMUL_KINDS, OpSpec, layer_ops, mixed_formats, model_ops, op_cost

log = logging.getLogger("edgellm")
PHASES = ("prefill", "decode")
# the reason a unit refuses a projection whose tensors mix formats (_warn_mixed finds it by this)
ONE_FORMAT_PER_CALL = "runs a projection in one weight format per call"
SHORT_STEP = 32                      # the short prefill step planned for: a chat turn's new tokens
SHORT_STEPS = (8, 16, 32, 64, 128)   # step lengths the short placement is checked at


def layer_spans(layers: list[int]) -> str:
    """[0, 1, 28, 29] -> "0-1, 28-29"."""
    spans: list[list[int]] = []
    for i in layers:
        if spans and i == spans[-1][1] + 1:
            spans[-1][1] = i
        else:
            spans.append([i, i])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


@dataclass(frozen=True)
class Placement:
    scope: str              # "layer" (same in every layer) or "model"
    op: str
    kind: str
    phase: str
    unit: str
    precision: str          # compute precision on the unit
    weight_format: str      # resident weight format on the unit
    flops: float
    bytes: float
    intensity: float
    bound: str              # compute | memory | launch
    predicted_ms: float     # on the unit, the handoff into it included
    transfer_ms: float      # the handoff part
    reason: str
    alternatives: tuple[tuple[str, str], ...]   # (unit, "0.123 ms" or why it could not)
    by_layer: str = ""      # where its layers differ (a plan's per-layer weights or compute):
                            # which layers run what; "" when every layer runs as the row says


@dataclass(frozen=True)
class PhasePlan:
    phase: str
    tokens: int
    context: int
    placements: tuple[Placement, ...]
    layer_ms: float         # one layer, handoffs included
    model_ms: float         # embedding + final norm + head
    n_layers: int

    @property
    def step_ms(self) -> float:
        return self.layer_ms * self.n_layers + self.model_ms

    def unit(self, op: str) -> str:
        for p in self.placements:
            if p.op == op:
                return p.unit
        raise KeyError(op)


@dataclass(frozen=True)
class Plan:
    device: str
    units: tuple[Unit, ...]
    prefill: PhasePlan
    decode: PhasePlan
    chunk: ChunkChoice
    prompt_tokens: int
    predicted_ttft_ms: float
    predicted_decode_tps: float
    warnings: tuple[str, ...]
    # a placement for short prefill steps (a chat turn after a cached prefix) where it differs
    # from the chunk's and is predicted faster; used for steps of <= short_max_tokens tokens
    prefill_short: PhasePlan | None = None
    short_max_tokens: int = 0
    ttft_phase: str = "prefill"   # the placement key the engine runs the prompt with (prompt_phase)

    def phase(self, name: str) -> PhasePlan:
        if name == "prefill_short" and self.prefill_short is not None:
            return self.prefill_short
        return self.prefill if name == "prefill" else self.decode

    def phases(self) -> dict[str, PhasePlan]:
        """Placement key -> PhasePlan: "prefill", "decode" and, when planned, "prefill_short"."""
        out = {"prefill": self.prefill, "decode": self.decode}
        if self.prefill_short is not None:
            out["prefill_short"] = self.prefill_short
        return out

    def placement(self) -> dict[str, dict[str, str]]:
        """Placement key -> op -> unit, as the engine's ModelRunner takes it."""
        return {key: {p.op: p.unit for p in ph.placements} for key, ph in self.phases().items()}

    def units_used(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(p.unit for ph in self.phases().values() for p in ph.placements))

    def to_json(self) -> dict:
        return {
            "device": self.device, "prompt_tokens": self.prompt_tokens,
            "predicted_ttft_ms": round(self.predicted_ttft_ms, 3),
            "predicted_decode_tps": round(self.predicted_decode_tps, 3),
            "chunk_tokens": self.chunk.tokens, "chunk_derivation": list(self.chunk.derivation),
            "units": [{"name": u.name, "kind": u.kind, "available": u.available, "reason": u.reason}
                      for u in self.units],
            "warnings": list(self.warnings),
            "short_prefill_max_tokens": self.short_max_tokens, "ttft_placement": self.ttft_phase,
            "ops": [{"layer": p.scope, "op": p.op, "phase": key, "unit": p.unit, "precision": p.precision,
                     "weight_format": p.weight_format, "flops": p.flops, "bytes": p.bytes,
                     "intensity": round(p.intensity, 3), "bound": p.bound,
                     "predicted_ms": round(p.predicted_ms, 6), "reason": p.reason,
                     "alternatives": dict(p.alternatives), "by_layer": p.by_layer}
                    for key, ph in self.phases().items() for p in ph.placements],
        }


# ---- units -------------------------------------------------------------------------------------

def build_units(profile: DeviceProfile, *, probe: bool, threads: int | None = None,
                only: Sequence[str] | None = None) -> tuple[Unit, ...]:
    """The units of `profile`. probe=True: this is the machine we run on, and each unit is
    available only if its backend module loads and its own probe passes. probe=False: planning
    for another device; what its profile describes is assumed present (and said so).
    only: the --units restriction (None: none). A unit outside it is neither probed nor assumed:
    probing one builds its self-check (an NPU's runtime graphs, OpenCL kernels) and warns about a
    unit the user ruled out. reference stays: it is the fallback of an op no listed unit runs."""
    models: list[Unit] = []
    for name in backends.names():
        if name == "neon" or name == "reference":
            models.append(cpu_unit(name, profile, threads=threads))
        elif name == "opencl":
            u = gpu_unit(profile)
            why = f"{profile.name} has no OpenCL GPU"
            if probe and profile.gpu is None:
                why = (f"the {profile.name} profile lists no OpenCL GPU (`edgellm profile` detects and "
                       f"measures one; `--device NAME` plans with a profile that has one)")
            models.append(u or Unit("opencl", "gpu", {}, 1.0, 0.0, available=False, reason=why))
        elif name == "npu":
            u = npu_unit(profile)
            models.append(u or Unit("npu", "npu", {}, 1.0, 0.0, available=False, reason=f"{profile.name} has no NPU"))
        else:   # a registered backend describes itself to the cost model
            mod, _ = backends.get(name)
            if mod is not None and hasattr(mod, "cost_unit"):
                models.append(mod.cost_unit(profile))
    out = []
    for u in models:
        if not u.available:
            out.append(u)
            continue
        if only is not None and u.name not in only and u.name != "reference":
            out.append(replace(u, available=False, reason=f"not in --units {','.join(only)} (not probed)"))
            continue
        if not probe:
            ok, why = _assumed(u, profile)
        else:
            ok, why = _probe(u.name, profile)
        out.append(replace(u, available=ok, reason=why))
    return tuple(out)


# CPU features of an x86 profile (`edgellm profile` on an x86 machine writes these): the neon
# library builds there through SIMDe, as it does for the host, so `plan` with that profile shows
# what `run` with it does
_X86_SIMD = frozenset({"avx2", "avx512f", "fma", "f16c"})


def _assumed(u: Unit, profile: DeviceProfile) -> tuple[bool, str]:
    if u.name == "neon" and not all("neon" in c.features or c.features & _X86_SIMD for c in profile.clusters):
        return False, f"{profile.name}'s CPU has no NEON"
    return True, f"assumed from the {profile.name} profile (not probed on this machine)"


def _probe(name: str, profile: DeviceProfile) -> tuple[bool, str]:
    mod, why = backends.get(name)
    if mod is None:
        return False, why
    try:
        if hasattr(mod, "use_profile"):     # a unit configured by the profile (NPU providers, buckets)
            mod.use_profile(profile)
        ok, why = mod.available()
    except Exception as e:  # a probe must never take the engine down
        return False, f"probe failed: {type(e).__name__}: {e}"
    return bool(ok), why


def _supports(u: Unit, op: OpSpec, precision: str, probe: bool) -> tuple[bool, str]:
    if u.op_kinds is not None:
        # a unit that runs matmuls runs the head; an NPU also the FFN's swiglu, inside its FFN subgraph
        kinds = u.op_kinds | ({"lm_head"} if "matmul" in u.op_kinds else set()) \
            | (FFN_INNER_KINDS if u.kind == "npu" and "matmul" in u.op_kinds else set())
        if op.kind not in kinds:
            return False, f"{u.name} runs only {', '.join(sorted(u.op_kinds))}"
    if probe:
        mod, why = backends.get(u.name)
        if mod is None:
            return False, why
        ok, why = mod.supports(op.kind, precision)
        return bool(ok), why
    # another device's plan: what that device's runtime offers is assumed, but an op kind this
    # edgellm's backend has no code for would only be moved away by the run
    mod, _ = backends.get(u.name)
    kinds = getattr(mod, "OPS", None)
    if kinds is not None and op.kind not in kinds:
        return False, mod.supports(op.kind, precision)[1]
    return True, ""


# ---- placement ---------------------------------------------------------------------------------

class Dispatcher:
    """Plans for one model on one device. formats: op name -> the model's weight format
    ("q4_1", "f32", ...). override: unit names in preference order (load(units=...))."""

    def __init__(self, profile: DeviceProfile, cfg: ModelConfig, formats: Mapping[str, str], *,
                 probe: bool, units: Sequence[Unit] | None = None, override: Sequence[str] | None = None,
                 kv_bytes: float = 2.0, threads: int | None = None,
                 exclude: Mapping[tuple[str, str], str] | None = None, compute: ComputeTable | None = None):
        """exclude: (unit, op name) -> why that unit may not take that op (it failed at load).
        compute: what a precision plan asks each op to compute in (None: each unit's own choice);
        a unit runs an op at that precision or higher, and cannot take it otherwise."""
        self.profile, self.cfg, self.formats = profile, cfg, dict(formats)
        self.compute = compute
        self.exclude = dict(exclude or {})
        self.probe, self.kv_bytes = probe, kv_bytes
        if override is not None and (isinstance(override, (str, bytes)) or not hasattr(override, "__iter__")
                                     or not all(isinstance(n, str) for n in override)):
            known = [u.name for u in units] if units is not None else list(backends.names())
            raise ConfigError(f"units: expected a list of unit names ({', '.join(known)}), found {shown(override)}")
        self.override = tuple(override) if override else None
        # (units outside --units are not probed: build_units)
        self.units = tuple(units) if units is not None else build_units(profile, probe=probe, threads=threads,
                                                                        only=self.override)
        names = [u.name for u in self.units]
        if self.override:
            bad = [n for n in self.override if n not in names]
            if bad:
                raise ConfigError(f"units: unknown unit(s) {', '.join(bad)} (known: {', '.join(names)})")
            if len(set(self.override)) != len(self.override):
                raise ConfigError(f"units: {', '.join(self.override)} lists a unit twice")
        self.warnings: list[str] = []
        self._warned: set[str] = set()
        # ops --units left to reference, by cause, said in one warning per cause at the plan's end:
        # one per op repeated the same cause 14 times (`run --units opencl` without OpenCL)
        # (cause -> the units' reasons, the ops)
        self._to_reference: dict[str, tuple[Mapping[str, str], list[str]]] = {}

    def unit(self, name: str) -> Unit:
        return next(u for u in self.units if u.name == name)

    # -- options per op ----------------------------------------------------------------------
    def _options(self, op: OpSpec, phase: str, tokens: int, context: int):
        """{unit: Estimate} of the units that can run op, and {unit: why not} of the others."""
        ok, no = {}, {}
        for u in self.units:
            if not u.available:
                no[u.name] = f"unavailable: {u.reason}"
                continue
            if (u.name, op.name) in self.exclude:
                no[u.name] = f"rejected at load: {self.exclude[(u.name, op.name)]}"
                continue
            est, why = self._estimate(u, op, phase, tokens, context)
            if est is None:
                no[u.name] = why
                continue
            ok[u.name] = est
        return ok, no

    def _asks(self, op: OpSpec, phase: str, tokens: int) -> list[tuple[str | None, int]]:
        """(asked compute precision, layers asking it) for op; [(None, 1)] without a plan."""
        if self.compute is None:
            return [(None, 1)]
        asks = self.compute.asked(phase, op.name, tokens)
        return [(a, asks.count(a)) for a in dict.fromkeys(asks)]

    def _estimate(self, u: Unit, op: OpSpec, phase: str, tokens: int, context: int,
                  unit_for_cost: Unit | None = None) -> tuple[Estimate | None, str]:
        """u's estimate for op (layers asking different precisions: their mean), or (None, why not)."""
        fmt = self.formats.get(op.name, "f32")
        mixed = mixed_formats(fmt)
        if mixed and u.keeps_file_format(op, fmt):
            return None, (f"{ONE_FORMAT_PER_CALL}, and {op.name}'s tensors mix "
                          f"{', '.join(mixed)} (its load rejects it)")
        parts = []
        for ask, count in self._asks(op, phase, context + tokens):
            prec, _ = u.precision_for(op, fmt, ask)
            if prec is None:
                return None, (f"the precision plan asks {ask} compute; {u.name} computes {op.kind} with {fmt} "
                               f"weights in {', '.join(u.computes(op, fmt))} only")
            sup, why = _supports(u, op, prec, self.probe)
            if not sup:
                return None, f"does not run {op.kind} in {prec}: {why}" if why else f"does not run {op.kind}"
            est = estimate(unit_for_cost or u, op, self.cfg, tokens, context, fmt, self.kv_bytes,
                           phase == "prefill", ask)
            if est is None:
                return None, f"no {prec} throughput figure in the profile"
            parts.append((est, count))
        if len(parts) == 1:
            return parts[0][0], ""
        n = sum(c for _, c in parts)
        precs = "+".join(dict.fromkeys(e.precision for e, _ in parts))
        est = max(parts, key=lambda p: p[1])[0]
        return replace(est, ms=sum(e.ms * c for e, c in parts) / n, precision=precs), ""

    def _not_listed_why(self, no: Mapping[str, str], ops: str = "it") -> str:
        """Why no --units entry runs an op, with each listed unit's own cause ("opencl unavailable:
        no OpenCL platform", "npu: does not run rmsnorm ..."): "none of --units opencl runs it"
        alone left the cause on another line, and read as if opencl merely lacked the op."""
        parts = []
        for n in self.override:
            why = no.get(n, "does not run it")
            parts.append(f"{n} {why}" if why.startswith("unavailable:") else f"{n}: {why}")
        return f"none of --units {','.join(self.override)} runs {ops} ({'; '.join(parts)})"

    def _forced(self, op: OpSpec, ok: Mapping[str, Estimate], no: Mapping[str, str] | None = None) -> str:
        """--units: the first listed unit that can run op; else reference, with one warning
        naming each listed unit's cause."""
        for n in self.override:
            if n in ok:
                return n
        if "reference" not in ok:
            raise ConfigError(f"op {op.name}: no unit can run it ({', '.join(self.override)} listed)")
        if op.name not in self._warned:
            self._warned.add(op.name)
            self._to_reference.setdefault(self._not_listed_why(no or {}), (no or {}, []))[1].append(op.name)
        return "reference"

    def _say_to_reference(self) -> None:
        """One warning per cause for the ops --units left to reference (a plan's own list too)."""
        for why, (no, ops) in self._to_reference.items():
            if len(ops) == 1:
                msg = f"op {ops[0]}: {why}; using reference"
            else:
                msg = f"ops {', '.join(ops)}: {self._not_listed_why(no, 'them')}; using reference"
            self.warnings.append(msg)
            log.warning(msg)
        self._to_reference = {}

    def _logits_bytes(self, phase: str, tokens: int) -> float:
        """The head's output, which the sampler reads on the CPU: one row in a prefill chunk."""
        rows = 1 if phase == "prefill" else tokens
        return ACT_BYTES * rows * self.cfg.vocab_size

    def _out_bytes(self, tokens: int, end_bytes: float | None) -> float:
        """What a chain hands to its end unit: end_bytes, by default the residual stream's rows."""
        return ACT_BYTES * tokens * self.cfg.d_model if end_bytes is None else end_bytes

    def _chain(self, ops, phase, tokens, context, start: str, end: str | None, end_bytes: float | None = None):
        """Best units for an op chain whose input lives on `start` (and, if `end`, whose output
        must end there: end_bytes of it, by default the residual stream's rows). Returns (total ms,
        [unit], [(ok, no)])."""
        opts = [self._options(op, phase, tokens, context) for op in ops]
        for op, (ok, no) in zip(ops, opts):
            if not ok:
                raise ConfigError(self._none_runs(op, no))
        if self.override:
            choice = [self._forced(op, ok, no) for op, (ok, no) in zip(ops, opts)]
            return self._total(ops, choice, opts, start, end, tokens, phase, end_bytes), choice, opts
        # Viterbi over the chain: best[u] = (ms, path) with the current activation on u
        best = {start: (0.0, [])}
        for op, (ok, _) in zip(ops, opts):
            nxt = {}
            for u, est in ok.items():
                cands = [(ms + handoff_ms(self.unit(p), self.unit(u), self._in_bytes(op, tokens, phase)) + est.ms,
                          path + [u]) for p, (ms, path) in best.items()]
                nxt[u] = min(cands, key=lambda c: c[0])
            best = nxt
        if end is not None:
            h = self._out_bytes(tokens, end_bytes)
            best = {u: (ms + handoff_ms(self.unit(u), self.unit(end), h), path) for u, (ms, path) in best.items()}
        ms, path = min(best.values(), key=lambda c: c[0])
        return ms, path, opts

    def _none_runs(self, op: OpSpec, no: Mapping[str, str]) -> str:
        """The error of an op no unit can run: the op, the profile, and each unit's reason."""
        reasons = "; ".join(f"{unit}: {why}" for unit, why in no.items())
        msg = f"op {op.name} ({op.kind}): no unit can run it with the {self.profile.name} profile ({reasons})"
        if op.kind not in MATMUL_KINDS and any("no fp32 throughput figure" in why for why in no.values()):
            # norms, rope, attention and the elementwise ops have fp32 kernels only
            msg += f"; {op.kind} computes in fp32 only: the profile needs an fp32 peak for a unit that runs it"
        return msg

    def _in_bytes(self, op: OpSpec, tokens: int, phase: str) -> float:
        """Activation bytes a handoff into op moves: what the op IR says it reads from its
        producers (attention: q and the step's new k and v, not q alone; a last-row op: one row)."""
        return op_cost(op, self.cfg, tokens, 0, "f32", self.kv_bytes, phase == "prefill").in_bytes

    def _total(self, ops, choice, opts, start, end, tokens, phase, end_bytes=None) -> float:
        ms, prev = 0.0, start
        for op, u, (ok, _) in zip(ops, choice, opts):
            ms += handoff_ms(self.unit(prev), self.unit(u), self._in_bytes(op, tokens, phase)) + ok[u].ms
            prev = u
        if end is not None:
            ms += handoff_ms(self.unit(prev), self.unit(end), self._out_bytes(tokens, end_bytes))
        return ms

    def place(self, phase: str, tokens: int, context: int) -> PhasePlan:
        if phase not in PHASES:
            raise ConfigError(f"phase must be one of {PHASES}, got {phase!r}")
        lops, (emb, onorm, head) = layer_ops(self.cfg), model_ops(self.cfg)
        # the layer: try each unit as the home of the residual stream
        homes = [u.name for u in self.units if u.available]
        best = None
        for home in homes:
            ms, path, opts = self._chain(lops, phase, tokens, context, home, home)
            if best is None or ms < best[0] - 1e-12:
                best = (ms, path, opts, home)
        layer_ms, lpath, lopts, home = best
        if self.override:
            # --units chose the layer's units; where that is one unit with a native layer step,
            # the engine runs it fused (ModelRunner fuses by placement alone), so it is priced so:
            # op by op, `plan --units neon` predicted decode ~1.5x slower than the same run without
            one = set(lpath)
            fused = self._fused_step(lops, phase, tokens, context, only=one.pop()) if len(one) == 1 else None
        else:
            fused = self._fused_step(lops, phase, tokens, context)
        fused_note = ""
        if fused is not None and fused[0] < layer_ms:
            what, per = ("decode step", "token") if phase == "decode" else ("prefill chunk", "chunk")
            fused_note = (f"fused {what} on {fused[3]}: every layer in one native call per {per}, "
                          f"{fused[0]:.4f} ms per layer vs {layer_ms:.4f} ms op by op")
            layer_ms, lpath, lopts, home = fused
        e_ms, e_path, e_opts = self._chain([emb], phase, tokens, context, e_home := self._cpu_home(), home)
        # the logits go back to the CPU, where the sampler reads them (a head on the GPU or NPU
        # was costed as if they stayed there)
        h_ms, h_path, h_opts = self._chain([onorm, head], phase, tokens, context, home, self._cpu_home(),
                                           self._logits_bytes(phase, tokens))
        lead_note = tail_note = ""
        if fused_note:
            lead = self._fused_tail([emb], phase, tokens, context, home, dispatch=False)
            # (under --units, only where its order put them on the fused unit already)
            if lead is not None and lead[0] < e_ms and (not self.override or e_path == [home]):
                lead_note = (f"in the fused {what}'s native call on {home} (the step's token ids looked up there, "
                             f"serially: no call or pool dispatch of its own): {lead[0]:.4f} ms vs {e_ms:.4f} ms "
                             f"as a separate call")
                e_ms, e_path, e_opts = lead
                e_home = home
            tail = self._fused_tail([onorm, head], phase, tokens, context, home)
            if tail is not None and tail[0] < h_ms and (not self.override or h_path == [home, home]):
                tail_note = (f"in the fused {what}'s native call on {home} (the output norm and head on the "
                             f"last row, no call of their own): {tail[0]:.4f} ms vs {h_ms:.4f} ms as separate calls")
                h_ms, h_path, h_opts = tail
        lpath, swiglu_note = self._swiglu_with_its_ffn(lops, list(lpath), lopts)
        placements = []
        for ops, path, opts, start, note in (([emb], e_path, e_opts, e_home, lead_note),
                                             (lops, lpath, lopts, home, fused_note),
                                             ([onorm, head], h_path, h_opts, home, tail_note)):
            prev = start
            for op, u, (ok, no) in zip(ops, path, opts):
                self._warn_mixed(op, u, no)
                p = self._placement(op, phase, tokens, u, prev, ok, no, context)
                if note:
                    p = replace(p, reason=f"{note}; alone: {p.reason}")
                if op.name == "swiglu" and swiglu_note:
                    p = replace(p, reason=f"{swiglu_note}; {p.reason}")
                placements.append(p)
                prev = u
        return PhasePlan(phase, tokens, context, tuple(placements), layer_ms, e_ms + h_ms, self.cfg.n_layers)

    def _warn_mixed(self, op: OpSpec, u: str, no: Mapping[str, str]) -> None:
        """An op left to reference because its tensors mix weight formats (a file's Q8_0 attn_v
        beside Q4_0 q and k) says so once: it showed only in the plan's reasons, while that op
        ran in numpy in every layer and decode lost its fused step."""
        if u != "reference":
            return
        units = [n for n, w in no.items() if w.startswith(ONE_FORMAT_PER_CALL)]
        if units:
            mixed = ", ".join(mixed_formats(self.formats.get(op.name, "f32")))
            msg = (f"op {op.name}: its tensors mix {mixed}, and {', '.join(units)} run{'s' if len(units) == 1 else ''} "
                   f"a projection in one weight format per call: it runs on reference (numpy), slower")
            if msg not in self.warnings:
                self.warnings.append(msg)
                log.warning(msg)

    def _swiglu_with_its_ffn(self, lops, lpath: list, lopts) -> tuple[list, str]:
        """An NPU runs swiglu only inside its FFN subgraph, which needs both FFN projections on
        it: on a path that puts either elsewhere, swiglu goes where ffn_gate_up is (its input),
        else to its fastest other unit, and says why (the plan showed it on the NPU while it ran
        on the host)."""
        names = [op.name for op in lops]
        if not {"swiglu", "ffn_gate_up", "ffn_down"} <= set(names):
            return lpath, ""
        i, gu, dn = names.index("swiglu"), lpath[names.index("ffn_gate_up")], lpath[names.index("ffn_down")]
        u = lpath[i]
        if self.unit(u).kind != "npu" or gu == u == dn:
            return lpath, ""
        alt = self._swiglu_off_the_npu(lopts[i][0], gu)
        if alt is None:
            return lpath, ""
        lpath[i] = alt
        return lpath, (f"{u} runs swiglu only inside its FFN subgraph, with ffn_gate_up and ffn_down on it "
                       f"(here on {gu} and {dn}): on {alt}")

    def _swiglu_off_the_npu(self, ok, gu: str) -> str | None:
        """Where swiglu goes when the NPU cannot run it: gu's unit, unless gu is the NPU itself
        (ffn_gate_up there, ffn_down elsewhere: alone, the NPU's swiglu runs on the host while
        the plan showed it on the NPU); else the first --units entry that runs it (reference
        when none does, as _forced), or without --units the fastest."""
        off = [n for n in ok if self.unit(n).kind != "npu"]
        if gu in off:
            return gu
        if self.override:
            listed = [n for n in self.override if n in off]
            return listed[0] if listed else ("reference" if "reference" in off else None)
        return min(off, key=lambda n: ok[n].ms, default=None)

    def _fused_step(self, lops, phase, tokens, context, only: str | None = None):
        """A unit with a native layer step (a decode token or a prefill chunk) runs every layer
        of the step in one call: its ops pay no per-op call overhead, the step one call.
        (ms per layer, path, opts, unit) of the best such unit (only: that unit), or None."""
        best = None
        for u in self.units:
            if not u.available or u.fused_decode_s is None or (only is not None and u.name != only):
                continue
            if self.kv_bytes not in u.fused_kv_bytes:
                # a unit whose fused step reads only some KV element sizes runs the others op by op
                msg = (f"{u.name}'s fused layer step cannot read a {self.kv_bytes:g}-byte KV cache: "
                       f"decode and prefill run op by op")
                if msg not in self.warnings:
                    self.warnings.append(msg)
                continue
            fast = u.in_fused_step()
            # the step's one call, shared by its layers, is booked on each layer's first op
            share = u.fused_decode_s * 1e3 / self.cfg.n_layers
            opts, ms = [], 0.0
            for op in lops:
                ok, no = self._options(op, phase, tokens, context)
                if u.name not in ok or not self._native_precision(u, op, phase, context + tokens):
                    break
                e, _ = self._estimate(u, op, phase, tokens, context, unit_for_cost=fast)
                if not opts:
                    e = replace(e, ms=e.ms + share)
                ok = {**ok, u.name: e}
                opts.append((ok, no))
                ms += e.ms
            else:
                if best is None or ms < best[0]:
                    best = (ms, [u.name] * len(lops), opts, u.name)
        return best

    def _fused_tail(self, ops, phase, tokens, context, home: str, dispatch: bool = True):
        """Ops inside the fused step's call on `home` (the model's tail: output norm, head; or its
        lead, the embedding lookup): each op at the fused per-op cost, none paying a call of its
        own; dispatch=False: not even a pool dispatch (an op the call runs serially). (ms, path,
        opts), or None when home cannot run one of them."""
        u = self.unit(home)
        fast = u.in_fused_step(dispatch)
        opts, ms = [], 0.0
        for op in ops:
            ok, no = self._options(op, phase, tokens, context)
            if home not in ok:
                return None
            e, _ = self._estimate(u, op, phase, tokens, context, unit_for_cost=fast)
            ok = {**ok, home: e}
            opts.append((ok, no))
            ms += e.ms
        return ms, [home] * len(ops), opts

    def _native_precision(self, u: Unit, op: OpSpec, phase: str, tokens: int) -> bool:
        """Whether every layer's ask for op runs at u's own precision: the fused layer step
        has one kernel per op (int8 activations for the quantized matmuls)."""
        fmt = self.formats.get(op.name, "f32")
        own, _ = u.precision_for(op, fmt)
        return all(u.precision_for(op, fmt, a)[0] == own for a, _ in self._asks(op, phase, tokens) if a)

    def _cpu_home(self) -> str:
        return next(u.name for u in self.units if u.available and u.kind == "cpu")

    def _placement(self, op, phase, tokens, u, prev, ok, no, context: int = 0) -> Placement:
        # (a plan's sequence policies are asked at the step's end, context + tokens, as _estimate
        # and the runner ask them: at `tokens`, a decode step's 1, the reason and by_layer named
        # the short-sequence asks where the row and the runner had the long one's)
        est = ok[u]
        moved = handoff_ms(self.unit(prev), self.unit(u), self._in_bytes(op, tokens, phase))
        alts = tuple((n, f"{e.ms:.4f} ms ({e.bound}-bound)") for n, e in ok.items()) + tuple(no.items())
        fastest = min(ok, key=lambda n: ok[n].ms)
        why = (f"{est.bound}-bound, AI {est.cost.intensity:.1f} vs ridge {est.ridge:.1f} FLOP/B" if est.ridge > 0
               else f"inside {u}'s FFN subgraph: one pass over its data, no call of its own")
        if self.override:
            reason = (f"--units order: {u} is the first listed unit that runs it" if u in self.override
                      else f"{self._not_listed_why(no)}; using reference")
        elif len(ok) == 1:
            reason = f"only unit that can run it ({why}); " + "; ".join(f"{n}: {w}" for n, w in no.items())
        elif u == fastest:
            others = ", ".join(f"{n} {e.ms:.3f} ms" for n, e in ok.items() if n != u)
            reason = f"fastest: {est.ms:.3f} ms, {why}; {others}"
        elif est.ms - ok[fastest].ms < 5e-4:     # (a tie at the printed precision is not a loss)
            reason = (f"as fast as {fastest} ({est.ms:.3f} ms), and the data stays where the ops around it "
                      f"run: {why}")
        else:
            reason = (f"{fastest} alone would take {ok[fastest].ms:.3f} ms, but handing data across units "
                      f"costs more than the {est.ms - ok[fastest].ms:.3f} ms it saves; {u} {est.ms:.3f} ms")
        if not self.override and len(ok) > 1:
            # an available unit passed over because it cannot run the op says why (a profile
            # without its int8 figure, say); an unavailable one says so in the units list
            passed = [f"{n}: {w}" for n, w in no.items() if self.unit(n).available]
            if passed:
                reason = f"{reason.rstrip('; ')}; {'; '.join(passed)}"
        if self.compute is not None:
            asked = "+".join(a for a, _ in self._asks(op, phase, context + tokens))
            if asked != est.precision:
                reason = (f"{reason.rstrip('; ')}; the precision plan asks {asked}: {u} computes it in "
                          f"{est.precision}, its nearest kernel at or above")
        return Placement("model" if op.scope == "model" else "layer", op.name, op.kind, phase, u, est.precision,
                         est.weight_format, est.cost.flops, est.cost.bytes, est.cost.intensity, est.bound,
                         est.ms + moved, moved, reason.rstrip("; "), alts, self._by_layer(op, phase, context + tokens, u))

    def _by_layer(self, op: OpSpec, phase: str, tokens: int, u: str) -> str:
        """Which layers run which weights and compute, where they differ: the row shows one name
        (the most layers' format; compute as "int8+fp32"), and a plan keeping its first and last
        layers in the file's format read as if every layer ran the majority's."""
        if op.scope == "model":
            return ""
        n = self.cfg.n_layers
        fmt = self.formats.get(op.name, "f32")
        fmts = getattr(fmt, "layers", None) or (fmt,) * n
        asks = self.compute.asked(phase, op.name, tokens) if self.compute is not None else (None,) * n
        unit = self.unit(u)
        runs = []
        for i, (f, a) in enumerate(zip(fmts, asks)):
            prec, held = unit.precision_for(op, f, a)
            if prec is None:   # (no kernel at or above the ask: the layer runs at the unit's own)
                prec = f"{unit.precision_for(op, f)[0]} below the asked {a}"
            if unit.kind == "npu" and op.kind in MATMUL_KINDS:
                # npu.prepare: fp16 where the plan keeps the projection's weights in a float
                # format, else its int8 form (a float file alone is requantized too)
                plan = getattr(self.compute, "plan", None)
                pop = ENGINE_TO_PLAN.get(op.name)
                asked_fmt = plan.weight_format(i, pop, n) if plan is not None and pop else None
                held = "f16" if asked_fmt in ("f16", "f32") else "int8"
            runs.append((prec, held))
        out = []
        for what, values in (("weights", [r[1] for r in runs]), ("compute", [r[0] for r in runs])):
            if len(set(values)) > 1:
                at = {v: [i for i, x in enumerate(values) if x == v] for v in dict.fromkeys(values)}
                out.append(f"{what} " + ", ".join(f"{v} (layer{'s' * (len(i) > 1)} {layer_spans(i)})"
                                                  for v, i in at.items()))
        return "; ".join(out)

    # -- the whole plan --------------------------------------------------------------------------
    def plan(self, *, prompt_tokens: int, n_ctx: int, memory_budget: float, chunk: int | None = None,
             chunk_why: str = "set by the caller") -> Plan:
        """Place both phases, size the chunk, and predict TTFT for `prompt_tokens` and decode
        tok/s at that context. chunk: a fixed chunk instead of the roofline's, for chunk_why."""
        if prompt_tokens < 1 or prompt_tokens > n_ctx:
            raise ConfigError(f"prompt_tokens must be in 1..n_ctx ({n_ctx}), got {prompt_tokens}")
        if chunk is None:
            def gemm_unit_at(t: int) -> str:   # the unit of the largest GEMM at a chunk of t tokens
                placed = self.place("prefill", t, 0).placements
                return max(placed, key=lambda p: p.flops if p.kind in MATMUL_KINDS else -1).unit

            def sized_by(unit: str) -> ChunkChoice:
                return choose_chunk(self.unit(unit), self.cfg, self.formats, n_ctx=n_ctx,
                                    memory_budget=memory_budget, kv_bytes=self.kv_bytes)

            sizer = gemm_unit_at(min(512, n_ctx))
            choice = sized_by(sizer)
            runner = gemm_unit_at(choice.tokens)
            if runner != sizer:
                # the sizer's chunk (an NPU bucket, say) hands the GEMMs to another unit: size the
                # chunk for the unit that runs them, when it keeps them at its own chunk
                again = sized_by(runner)
                if gemm_unit_at(again.tokens) == runner:
                    choice = replace(again, derivation=(
                        f"{sizer} sized {choice.tokens} tokens, where {runner} runs the GEMMs: sized for "
                        f"{runner}", *again.derivation))
        else:
            if chunk < 1:
                raise ConfigError(f"prefill chunk must be >= 1, got {chunk}")
            choice = ChunkChoice(chunk, "", chunk, (f"chunk = {chunk} tokens ({chunk_why})",))
        prefill, decode, short, short_max, ttft, tps = self._priced(prompt_tokens, choice.tokens, 0)
        key = self.prompt_phase(prompt_tokens, short_max if short is not None else 0)
        self._say_to_reference()
        return Plan(self.profile.name, self.units, prefill, decode, choice, prompt_tokens, ttft, tps,
                    tuple(self.warnings), short, short_max, key)

    def predict(self, prompt_tokens: int, chunk: int, context: int = 0,
                plan: Plan | None = None) -> tuple[float, float]:
        """(TTFT ms, decode tok/s) predicted for `prompt_tokens` new tokens after `context`
        cached ones, in chunks of `chunk`, as plan() prices its own prompt; nothing is said
        (bench sets these beside what it measures). plan: price the placements an engine loaded
        with (its short-step placement and bound, its decode's), not those this length would get:
        a 32-token prompt on exynos2100 was priced on a short-step placement the engine, planned
        at 512, never runs (11.3 ms against the 15.3 its placement costs)."""
        said = copy.deepcopy(self._to_reference)
        try:
            return self._priced(prompt_tokens, chunk, context, plan)[4:]
        finally:
            self._to_reference = said

    def _priced(self, prompt_tokens: int, chunk: int, context: int, fixed: Plan | None = None) -> tuple:
        """(prefill, decode, short, short_max, TTFT ms, decode tok/s) of a prompt after `context`;
        fixed: a loaded plan's placements instead of this length's."""
        prefill = self.place("prefill", chunk, 0) if fixed is None else fixed.prefill
        decode = self.place("decode", 1, context + prompt_tokens)
        decode_ms = decode.step_ms
        if fixed is not None and [p.unit for p in decode.placements] != [p.unit for p in fixed.decode.placements]:
            decode_ms = self.step_ms(fixed.decode, 1, context + prompt_tokens)
        if fixed is None:
            short, short_max = self._short_prefill(prefill, chunk, context + prompt_tokens)
        else:
            short, short_max = fixed.prefill_short, fixed.short_max_tokens
        # TTFT is priced chunk by chunk as the engine runs them: each call's placement from its
        # own length, and no one-token last chunk (Generation cuts 257 as 255 + 2, not 256 + 1,
        # whose token was priced on the chunk's placement: +32 ms on an rk3588's)
        sm = short_max if short is not None else 0
        # (a one-token prompt runs as a decode step: the loaded plan's, when one is given)
        phases = {"decode": decode if fixed is None else fixed.decode, "prefill_short": short, "prefill": prefill}
        bounds = chunk_bounds(prompt_tokens, chunk)
        ttft = 0.0
        for c0, c1 in zip(bounds, bounds[1:]):
            ttft += self.step_ms(phases[self.prompt_phase(c1 - c0, sm)], c1 - c0, context + c0,
                                 head=c1 >= prompt_tokens)
        tps = 1e3 / decode_ms if decode_ms > 0 else math.inf
        return prefill, decode, short, short_max, ttft, tps

    @staticmethod
    def prompt_phase(prompt_tokens: int, short_max: int) -> str:
        """The placement key ModelRunner.forward picks for one call of `prompt_tokens` tokens (it
        picks per call, so per chunk): one token is a decode step; 2..short_max tokens take the
        short prefill's placement; longer calls the chunk's. A prompt's chunks after the first
        are never one token (Generation), so only a one-token prompt is a decode step."""
        if prompt_tokens == 1:
            return "decode"
        return "prefill_short" if prompt_tokens <= short_max else "prefill"

    def _short_prefill(self, prefill: PhasePlan, chunk: int, context: int) -> tuple[PhasePlan | None, int]:
        """A placement for short prefill steps at `context` (a chat turn after a cached prefix):
        GEMMs of a few rows favour other units than a chunk's. Kept when its units differ, with
        the longest step length (of SHORT_STEPS, below the chunk) at which it is still predicted
        faster than the chunk's placement; (None, 0) otherwise."""
        short = self.place("prefill", SHORT_STEP, context)
        if [p.unit for p in short.placements] == [p.unit for p in prefill.placements]:
            return None, 0
        best = 0
        for t in SHORT_STEPS:
            if t >= chunk:
                break
            if self.step_ms(short, t, context) < self.step_ms(prefill, t, context):
                best = t
            else:
                break
        return (short, best) if best else (None, 0)

    def step_ms(self, plan: PhasePlan, tokens: int, context: int, head: bool = True) -> float:
        """Predicted time of one step of `tokens` at `context` with plan's placement; a layer the
        engine runs as one fused native call is priced as place() prices it (each op at the fused
        per-op cost, one call per step, and the lead and tail inside that call)."""
        lops, (emb, onorm, head_op) = layer_ops(self.cfg), model_ops(self.cfg)
        by_op = {p.op: p.unit for p in plan.placements}
        fused = self._fused_unit(plan, tokens, context)
        layer_cost = lead_cost = tail_cost = None
        if fused is not None:
            layer_cost = tail_cost = fused.in_fused_step()
            if by_op[emb.name] == fused.name:
                lead_cost = fused.in_fused_step(dispatch=False)   # looked up serially inside the call
            if not by_op[onorm.name] == by_op[head_op.name] == fused.name:
                tail_cost = None                              # its own calls

        def chain(ops, start, end=None, cost_unit=None, end_bytes=None):
            ms, prev = 0.0, start
            for op in ops:
                u = self.unit(by_op[op.name])
                e, _ = self._estimate(u, op, plan.phase, tokens, context,
                                      unit_for_cost=cost_unit if cost_unit and cost_unit.name == u.name else None)
                ms += e.ms + handoff_ms(self.unit(prev), u, self._in_bytes(op, tokens, plan.phase))
                prev = u.name
            if end is not None:
                ms += handoff_ms(self.unit(prev), self.unit(end), self._out_bytes(tokens, end_bytes))
            return ms

        home = by_op[lops[-1].name]
        ms = chain([emb], by_op["embedding"], home, lead_cost) + self.cfg.n_layers * chain(lops, home, home, layer_cost)
        if fused is not None:
            ms += fused.fused_decode_s * 1e3      # the step's one native call
        return ms + (chain([onorm, head_op], home, self._cpu_home(), tail_cost,
                           self._logits_bytes(plan.phase, tokens)) if head else 0.0)

    def _fused_unit(self, plan: PhasePlan, tokens: int, context: int) -> Unit | None:
        """The unit whose native layer step runs plan's layers, as _fused_step allows it and the
        engine fuses them: every layer op on that one unit, its step able to read this KV cache,
        each op at the unit's own precision. None: the layer runs op by op."""
        lops = layer_ops(self.cfg)
        names = {plan.unit(op.name) for op in lops}
        if len(names) != 1:
            return None
        u = self.unit(names.pop())
        if u.fused_decode_s is None or self.kv_bytes not in u.fused_kv_bytes:
            return None
        if not all(self._native_precision(u, op, plan.phase, context + tokens) for op in lops):
            return None
        return u
