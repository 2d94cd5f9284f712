"""Automatic precision search: the per-layer plan that minimises predicted TTFT (or decode time)
on a device, subject to a budget on the summed measured KL.

Inputs are measurements, not guesses: sensitivity.analyze's KL per (layer, op, weight format)
and per (layer, op, int8 activations), and the dispatcher's cost model for the device (each op's
predicted time on the fastest unit that can run it at that weight format and compute precision).

The search starts from the `quality` plan (file weights, fp32 compute) and is greedy: each step
takes, among all (layer, op) sites, the one change (a cheaper weight format, or int8 activations)
with the most predicted time saved per nat of KL added, while the summed KL stays within the
budget. Summing per-site KLs assumes their errors add; `verify` measures the plan end to end so
that assumption is checked, not trusted.

A site is changed only when the change saves time: an error that buys nothing is not taken.
Activation changes are made for the objective's phase only (ttft: prefill, decode: decode), so
the other phase keeps fp32 compute.

A model with tied embeddings keeps its head's weights: the head is the embedding table (one
tensor, which requant.plan_formats stores in the head's format), and the embedding-float rule
keeps the embedding in the file's format or a float one; a plan that requantized the head would
say `embedding: {weights: gguf}` and store the table in the head's format.
"""
from __future__ import annotations

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


def op_times(dispatcher, objective: str, prompt_tokens: int, file_formats: dict[str, str],
             formats: tuple[str, ...]) -> dict[str, dict[tuple[str, str], float]]:
    """op -> {(weight format, compute): predicted ms of that op in one layer (lm_head: once)
    over a whole prompt (ttft) or one decode token}, on the fastest unit that can run it."""
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
    out: dict[str, dict[tuple[str, str], float]] = {}
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


def search(sens, times: dict[str, dict[tuple[str, str], float]], budget_kl: float, objective: str,
           n_layers: int, formats: tuple[str, ...]) -> SearchResult:
    """Greedy search (see the module doc). sens: a sensitivity.Sensitivity with weight entries for
    `formats` and int8 activation entries of the SEARCH_OPS it measured."""
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
    state = {s: ("gguf", "fp32") for s in sites}
    spent, changes = 0.0, []
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
                if k is None or not saved > 0 or not spent + k <= budget_kl:
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
    plan = build_plan(state, objective, budget_kl, spent)
    return SearchResult(plan, tuple(changes), spent, budget_kl, objective, sum(c.saved_ms for c in changes))


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
