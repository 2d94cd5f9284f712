"""Automatic precision search: the per-layer plan that minimises predicted TTFT (or decode time)
on a device, subject to a budget on the summed measured KL.

Inputs are measurements, not guesses: sensitivity.analyze's KL per (layer, op, weight format)
and per (layer, op, int8 activations), and the dispatcher's cost model for the device (each op's
predicted time on the fastest unit that can run it at that weight format and compute precision).

The search starts from the `quality` plan (file weights, fp32 compute) and is greedy: each step
takes, among all (layer, op) sites, the one change (a cheaper weight format, or int8 activations)
with the most predicted time saved per nat of KL added, while the summed KL stays within the
budget (SEARCH_MARGIN of it: the rest absorbs what the sum misses). Summing per-site KLs
assumes their errors add; `verify` measures the plan end to end so that assumption is checked,
not trusted. When whole plans can be predicted, the search runs a second time from every layer
matmul's int8 activations (if their KL fits), which one site at a time never reaches, and keeps
the faster of the two results.

A site is changed only when the change saves time: an error that buys nothing is not taken.
Per-op savings are estimates: they do not see whole-model effects (a unit's fused decode step
runs only the file's formats, so the first change of format can lose it and cost more than all
changes save). When op_times can predict whole plans, the search keeps the prefix of its changes
that the dispatcher predicts fastest, and returns `quality` itself when no prefix beats it.
Activation changes are made for the objective's phase only (ttft: prefill, decode: decode), so
the other phase keeps fp32 compute.

A model with tied embeddings keeps its head's weights: the head is the embedding table (one
tensor, which requant.plan_formats stores in the head's format), and the embedding-float rule
keeps the embedding in the file's format or a float one; a plan that requantized the head would
say `embedding: {weights: gguf}` and store the table in the head's format.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

from .errors import ConfigError
from .precision import OpSetting, PhasePrecision, PrecisionPlan, load_plan
from .sensitivity import mean_kl  # noqa: F401 (verify's measure; part of this module's API)

OBJECTIVES = ("ttft", "decode")
SEARCH_OPS = ("qkv", "attn_out", "ffn_gate_up", "ffn_down", "lm_head")
KL_FLOOR = 1e-7     # a measured KL at or below this (noise, or negative by rounding) counts as this
SEARCH_MARGIN = 0.95   # the share of the budget the summed KL may take (search says why)

log = logging.getLogger("edgellm")


@dataclass(frozen=True)
class Change:
    layer: int | None      # None: lm_head
    op: str
    kind: str              # "weights" | "activations"
    format: str            # weights: a requant format; activations: "int8"
    kl: float              # measured sensitivity (nats)
    saved_ms: float        # predicted time saved per prompt (ttft) or per token (decode)


@dataclass(frozen=True)
class SearchResult:
    plan: PrecisionPlan
    changes: tuple[Change, ...]
    predicted_kl: float    # sum of the changes' measured KLs
    budget_kl: float
    objective: str
    saved_ms: float        # sum of the changes' predicted savings (per-op estimates)
    predicted_ms: float | None = None   # the whole plan's predicted time (None: no predictor)
    quality_ms: float | None = None     # the `quality` plan's, predicted the same way
    note: str = ""         # why changes the greedy step chose were dropped ("" when none were)


class OpTimes(dict):
    """op_times' table (op -> {(weight format, compute): ms}) with `predict`: plan -> the whole
    plan's predicted ms for the objective, from the same dispatcher (None: not known)."""
    predict: Callable[[PrecisionPlan], float] | None = None


def op_times(dispatcher, objective: str, prompt_tokens: int, file_formats: dict[str, str],
             formats: tuple[str, ...]) -> OpTimes:
    """op -> {(weight format, compute): predicted ms of that op in one layer (lm_head: once)
    over a whole prompt (ttft) or one decode token}, on the fastest unit that can run it.
    Its `predict` costs a whole plan on the dispatcher's units (see plan_time)."""
    from .costmodel import estimate
    from .ops import layer_ops, model_ops
    from .requant import GGUF_TYPE_FOR

    cfg = dispatcher.cfg
    specs = {o.name: o for o in (*layer_ops(cfg), *model_ops(cfg))}
    if objective == "ttft":
        phase, chunk = "prefill", min(dispatcher.plan(prompt_tokens=prompt_tokens, n_ctx=max(prompt_tokens, 1),
                                                      memory_budget=1 << 30).chunk.tokens, prompt_tokens)
        steps = [(min(chunk, prompt_tokens - c), c) for c in range(0, prompt_tokens, chunk)]
    else:
        phase, steps = "decode", [(1, prompt_tokens)]
    out = OpTimes()
    out.predict = lambda plan: plan_time(dispatcher, file_formats, plan, objective, prompt_tokens)
    for op in SEARCH_OPS:
        spec = specs[op]
        fmts = {"gguf": file_formats[op]} | {f: GGUF_TYPE_FOR[f].name.lower() for f in formats}
        table = {}
        for name, fmt in fmts.items():
            for prec in ("fp32", "int8"):
                best = math.inf
                for u in dispatcher.units:
                    if not u.available:
                        continue
                    total = 0.0
                    for tokens, context in (steps[-1:] if op == "lm_head" else steps):
                        e = estimate(u, spec, cfg, tokens, context, fmt, dispatcher.kv_bytes, phase == "prefill", prec)
                        # an int8 ask a unit runs above int8 (in fp32) saves nothing there
                        if e is None or (prec == "int8" and e.precision != "int8"):
                            total = math.inf
                            break
                        total += e.ms
                    best = min(best, total)
                table[(name, prec)] = best
        out[op] = table
    return out


def plan_time(dispatcher, file_formats: dict[str, str], plan: PrecisionPlan, objective: str,
              prompt_tokens: int) -> float:
    """The dispatcher's predicted TTFT (ms, ttft) or time per decode token (ms, decode) of the
    whole model under `plan`, on `dispatcher`'s units: what `edgellm precision plan` reports."""
    from .dispatch import Dispatcher
    from .kv.store import KVConfig
    from .precision_runtime import ComputeTable, formats_under_plan

    cfg = dispatcher.cfg
    d = Dispatcher(dispatcher.profile, cfg, formats_under_plan(file_formats, cfg, plan), probe=dispatcher.probe,
                   units=dispatcher.units, compute=ComputeTable(plan, cfg.n_layers),
                   kv_bytes=KVConfig(precision=plan.kv_precision).bytes_per_elem)
    p = d.plan(prompt_tokens=prompt_tokens, n_ctx=max(prompt_tokens + 1, 2048), memory_budget=1 << 30)
    return p.predicted_ttft_ms if objective == "ttft" else 1e3 / p.predicted_decode_tps


def search(sens, times: dict[str, dict[tuple[str, str], float]], budget_kl: float, objective: str,
           n_layers: int, formats: tuple[str, ...],
           predict: Callable[[PrecisionPlan], float] | None = None) -> SearchResult:
    """Greedy search (see the module doc). sens: a sensitivity.Sensitivity with weight entries for
    `formats` and int8 activation entries of the SEARCH_OPS it measured. predict: plan -> its
    whole predicted ms (default: `times.predict` when op_times made `times`); with one, the
    result is never predicted slower than `quality`."""
    if objective not in OBJECTIVES:
        raise ConfigError(f"objective must be one of {', '.join(OBJECTIVES)}, got {objective!r}")
    if not (isinstance(budget_kl, (int, float)) and budget_kl > 0 and math.isfinite(budget_kl)):
        raise ConfigError(f"the KL budget must be a positive number of nats, got {budget_kl!r}")
    if sens.n_layers != n_layers:
        raise ConfigError(f"the sensitivities are for {sens.n_layers} layers, the model has {n_layers}")
    # a KL that is not a number (a damaged measurement) is no measurement: max(nan, floor) is nan,
    # and no sum with a nan is ever over the budget
    kl = {(e.layer, e.op, e.kind, e.format): max(e.kl, KL_FLOOR) for e in sens.entries if math.isfinite(e.kl)}
    if sens.tied_embeddings:   # (see the module doc)
        kl = {k: v for k, v in kl.items() if k[1:3] != ("lm_head", "weights")}
    sites = [(i, op) for i in range(n_layers) for op in SEARCH_OPS if op != "lm_head" and op in times]
    sites += [(None, "lm_head")] if "lm_head" in times else []
    if predict is None:
        predict = getattr(times, "predict", None)
    # the summed KL may use SEARCH_MARGIN of the budget: verify measured 0.91-1.06x the sum (1.12x
    # and 1.24x with 40 calibration tokens: verify refuses those over the budget), and
    # a plan that fills 99.8% of it was then refused at most budgets (a helper's probe)
    room = budget_kl * SEARCH_MARGIN
    spent, changes = _greedy(sites, _apply(sites, ()), 0.0, [], kl, times, formats, room)
    if predict is None:
        plan = build_plan(_apply(sites, changes), objective, budget_kl, spent)
        return SearchResult(plan, tuple(changes), spent, budget_kl, objective, sum(c.saved_ms for c in changes))
    res = _best_prefix(sites, changes, predict, objective, budget_kl)
    # One layer's int8 activations alone may save nothing (a unit's fused decode step runs int8
    # in every layer or in none), so the greedy steps never took them where `balanced` was
    # predicted faster within the budget (a helper's probe). The search also starts from every
    # site's int8 activations, when their KL fits, and keeps the faster result.
    int8 = [Change(s[0], s[1], "activations", "int8", kl[(s[0], s[1], "activations", "int8")],
                   times[s[1]][("gguf", "fp32")] - times[s[1]][("gguf", "int8")])
            for s in sites if s[1] != "lm_head" and (s[0], s[1], "activations", "int8") in kl]
    if int8 and math.fsum(c.kl for c in int8) <= room:
        _, changes2 = _greedy(sites, _apply(sites, int8), math.fsum(c.kl for c in int8), list(int8), kl, times,
                              formats, room)
        res2 = _best_prefix(sites, changes2, predict, objective, budget_kl)
        if res2.predicted_ms < res.predicted_ms or (res2.predicted_ms == res.predicted_ms
                                                    and res2.predicted_kl < res.predicted_kl):
            return res2
    return res


def _apply(sites, changes) -> dict:
    """The (weights, compute) of every site after `changes`, from quality's."""
    state = {s: ("gguf", "fp32") for s in sites}
    for c in changes:
        w, a = state[(c.layer, c.op)]
        state[(c.layer, c.op)] = (c.format, a) if c.kind == "weights" else (w, "int8")
    return state


def _greedy(sites, state, spent, changes, kl, times, formats, room):
    """Greedy steps from `state` (see the module doc) while the summed KL stays within room."""
    state = dict(state)
    while True:
        best = None
        for site in sites:
            w, a = state[site]
            t_now = times[site[1]][(w, a)]
            moves = [("weights", f, (f, a)) for f in formats if w == "gguf"]
            moves += [("activations", "int8", (w, "int8"))] if a == "fp32" else []
            for kind, fmt, new in moves:
                k = kl.get((site[0], site[1], kind, fmt))
                saved = t_now - times[site[1]][new]
                if k is None or not saved > 0 or not spent + k <= room:
                    continue
                score = saved / k
                if best is None or score > best[0]:
                    best = (score, site, kind, fmt, new, k, saved)
        if best is None:
            break
        _, site, kind, fmt, new, k, saved = best
        state[site] = new
        spent += k
        changes.append(Change(site[0], site[1], kind, fmt, k, saved))
    return spent, changes


def _best_prefix(sites, changes: list[Change], predict: Callable[[PrecisionPlan], float], objective: str,
                 budget_kl: float) -> SearchResult:
    """Of the greedy order's prefixes (the empty one is `quality`), the one the whole-plan
    predictor finds fastest; on a tie, the shorter (less KL for the same time)."""
    def plan_of(n: int) -> tuple[PrecisionPlan, float]:
        kl = math.fsum(c.kl for c in changes[:n])
        return build_plan(_apply(sites, changes[:n]), objective, budget_kl, kl), kl

    q_ms = predict(plan_of(0)[0])
    full_plan, full_kl = plan_of(len(changes))
    full_ms = predict(full_plan) if changes else q_ms
    best_n, best_ms = len(changes), full_ms
    if changes and not full_ms < q_ms:
        # the whole plan is no faster than quality: look for a prefix that is (each costs one
        # dispatcher plan, so only when needed)
        best_n, best_ms = 0, q_ms
        for n in range(1, len(changes)):
            ms = predict(plan_of(n)[0])
            if ms < best_ms:
                best_n, best_ms = n, ms
    note = ""
    if best_n < len(changes):
        note = (f"the {len(changes)} changes chosen op by op are predicted to take {full_ms:.4g} ms "
                f"against {q_ms:.4g} ms for quality (per-op savings miss whole-model effects such as a "
                f"fused decode step); "
                + (f"kept the first {best_n}, predicted {best_ms:.4g} ms" if best_n
                   else "no prefix of them is faster, so the plan is quality's"))
        log.warning("precision search: %s", note)
    kept = changes[:best_n]
    plan, kl = (full_plan, full_kl) if best_n == len(changes) else plan_of(best_n)
    return SearchResult(plan, tuple(kept), kl, budget_kl, objective, sum(c.saved_ms for c in kept),
                        best_ms, q_ms, note)


def build_plan(state: dict[tuple[int | None, str], tuple[str, str]], objective: str, budget_kl: float,
               predicted_kl: float) -> PrecisionPlan:
    """The `quality` plan with each site's (weights, compute) from `state`; compute changes apply
    to the objective's phase only."""
    from dataclasses import replace

    base = load_plan("quality")
    phase = "prefill" if objective == "ttft" else "decode"

    def setting(w: str, a: str) -> OpSetting:
        pair = PhasePrecision(a, "int32" if a == "int8" else "fp32")
        fp32 = PhasePrecision("fp32", "fp32")
        return OpSetting(weights=w, prefill=pair if phase == "prefill" else fp32,
                         decode=pair if phase == "decode" else fp32)

    defaults = dict(base.defaults)
    layers: dict[int, dict[str, OpSetting]] = {}
    for (layer, op), (w, a) in sorted(state.items(), key=lambda kv: (kv[0][0] is None, kv[0][0] or 0, kv[0][1])):
        if (w, a) == ("gguf", "fp32"):
            continue
        if layer is None:
            defaults[op] = setting(w, a)
        else:
            layers.setdefault(layer, {})[op] = setting(w, a)
    return replace(base, defaults=defaults, layers=layers, name="searched", source="",
                   description=(f"searched for {objective} under a {budget_kl:g}-nat KL budget "
                                f"(predicted KL {predicted_kl:.4f})"))


def teacher_forced_logits(engine, ids: list[int], phase: str) -> np.ndarray:
    """Logits (len(ids), vocab) of every position of `ids`, computed as `phase` computes them:
    one prefill forward with all logits, or one decode step per token."""
    seq = engine._new_sequence()
    try:
        if phase == "prefill":
            return engine.runner.forward(seq, np.asarray(ids), all_logits=True)
        return np.stack([engine.runner.forward(seq, [t]) for t in ids])
    finally:
        seq.free()


def verify(load_engine: Callable[[object], object], plan: PrecisionPlan, ids: list[int], phase: str) -> float:
    """Measured mean KL of `plan` against the `quality` plan over `ids` in `phase`.
    load_engine(plan) -> an Engine loaded with that plan."""
    ref = teacher_forced_logits(load_engine(load_plan("quality")), ids, phase)
    return mean_kl(ref, teacher_forced_logits(load_engine(plan), ids, phase))
