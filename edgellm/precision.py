"""Precision plans: per layer, op and phase, the weight format, compute precision and accumulation.

A plan is YAML (edgellm/precision_presets/README.md documents the schema), parsed once into the
frozen dataclasses below and validated against RULES, the numerical rules no plan may break.
Every error is a PrecisionPlanError naming the file and the dotted field path.

What a plan says for one (layer, op, phase) comes from four levels, lowest to highest:

    defaults  <  sequence policies  <  depth policies  <  explicit `layers:` entries

A higher level replaces only what it sets: the stored weight format, and per phase the
(compute, accumulate) pair. The order is the one that keeps each level's promise: an explicit
layer entry is the most specific statement; a depth policy protects the ends of the network, which
a long prompt must not undo; a sequence policy trades precision for speed on long steps only.

Weights are stored once, at load: they depend on (layer, op) only, never on the phase or on the
step's length, so a sequence policy may change compute precision but not weights.

Ops are places in the transformer, matching the op IR (edgellm.ops) where names agree:
the IR's fused `attention` is planned as `attn_scores` (QK^T, and the P*V product that reads the
same KV cache) and `softmax`; rope, swiglu and the residual adds are elementwise and always fp32.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import yaml

from edgellm.errors import ConfigError

__all__ = ["PrecisionPlan", "OpPrecision", "PhasePrecision", "OpSetting", "DepthPolicy",
           "SequencePolicy", "Rule", "RULES", "PrecisionPlanError", "load_plan", "parse_plan",
           "dump_plan", "list_presets", "presets_dir", "OPS", "LAYER_OPS", "MODEL_OPS",
           "WEIGHT_OPS", "WEIGHT_FORMATS", "COMPUTE_PRECISIONS", "ACCUMULATIONS", "KV_PRECISIONS",
           "PHASES", "SCHEMA_VERSION"]

SCHEMA_VERSION = 1
MAX_PLAN_BYTES = 1 << 20      # a plan is a few KiB; the cap is checked before parsing
MAX_LAYER = (1 << 16) - 1     # layer indices beyond this are typos, not models
MAX_TOKENS = 1 << 24          # sequence thresholds beyond this are typos

# Ops of one decoder layer, in execution order, then the model's ops outside the layers.
LAYER_OPS = ("attn_norm", "qkv", "attn_scores", "softmax", "attn_out",
             "ffn_norm", "ffn_gate_up", "ffn_down")
MODEL_OPS = ("embedding", "output_norm", "lm_head")
OPS = LAYER_OPS + MODEL_OPS
MATMUL_OPS = ("qkv", "attn_scores", "attn_out", "ffn_gate_up", "ffn_down", "lm_head")
# Ops whose weights the plan formats. attn_scores multiplies activations by the KV cache (its
# precision is kv_cache), and a norm's gain vector is a few KiB kept in f32.
WEIGHT_OPS = ("qkv", "attn_out", "ffn_gate_up", "ffn_down", "lm_head", "embedding")
NORM_OPS = ("attn_norm", "ffn_norm", "output_norm")

PHASES = ("prefill", "decode")
# "gguf" keeps the tensor as the file stores it; q8_0/q4_0/q4_1 are ggml blocks of 32; int8 has
# one scale per output channel; int4-G has symmetric groups of G along K (the input width).
WEIGHT_FORMATS = ("gguf", "q8_0", "q4_0", "q4_1", "int8", "int4-32", "int4-64", "int4-128",
                  "f16", "f32")
FLOAT_WEIGHT_FORMATS = ("f16", "f32")
COMPUTE_PRECISIONS = ("fp32", "fp16", "int8")
# fp16 is a known word only so that RULES can reject it with its reason.
ACCUMULATIONS = ("fp32", "fp16", "int32")
KV_PRECISIONS = ("f32", "f16", "int8")


def default_accumulation(compute: str) -> str:
    """What `compute` accumulates in when a plan does not say: int8 dot products sum in int32
    (sdot, cl_arm_integer_dot_product), everything else in fp32."""
    return "int32" if compute == "int8" else "fp32"


class PrecisionPlanError(ConfigError):
    """A plan that is malformed, breaks a rule, or does not fit the model it is used with."""

    def __init__(self, file: str, field: str, message: str):
        self.file = file        # the plan's file name ("fast.yaml"), or "" for a built plan
        self.field = field      # dotted path in the YAML ("layers.3.ffn_down.accumulate")
        self.message = message  # what was expected and what was found
        super().__init__(": ".join(s for s in (file, field, message) if s))

    def __reduce__(self):
        return type(self), (self.file, self.field, self.message)


# -- the hard rules ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Rule:
    name: str                               # short id, shown in errors
    ops: tuple[str, ...]                    # ops it constrains
    field: str                              # "weights", "compute" or "accumulate"
    allowed: tuple[str, ...]                # values `field` may take (empty: none at all)
    why: str                                # the reason, said in the error
    when: tuple[str, tuple[str, ...]] | None = None  # (field, values): applies only then


RULES: tuple[Rule, ...] = (
    Rule("no-fp16-accumulation", OPS, "accumulate", ("fp32", "int32"),
         "'fp16' accumulation is forbidden: a sum in fp16 overflows past 65504 and loses every "
         "addend below 1/2048 of it (Mali accumulates in the type it is given)"),
    Rule("fp32-softmax-norms", ("softmax",) + NORM_OPS, "compute", ("fp32",),
         "softmax and norms compute in fp32: exp() and sums of squares overflow fp16, and int8 "
         "cannot hold a normalizer"),
    Rule("fp32-softmax-norms-accumulate", ("softmax",) + NORM_OPS, "accumulate", ("fp32",),
         "softmax and norms accumulate in fp32: their sums run over a whole row"),
    Rule("int8-accumulates-int32", OPS, "accumulate", ("int32",),
         "int8 compute accumulates in int32: int8 x int8 dot products (sdot, "
         "cl_arm_integer_dot_product) sum exactly in int32 and are scaled once afterwards",
         when=("compute", ("int8",))),
    Rule("int32-needs-int8", OPS, "accumulate", ("fp32",),
         "int32 accumulation holds only integer products: it needs int8 compute",
         when=("compute", ("fp32", "fp16"))),
    Rule("weights-on-weighted-ops", tuple(o for o in OPS if o not in WEIGHT_OPS), "weights", (),
         f"only {', '.join(WEIGHT_OPS)} have weights a plan formats"),
    Rule("embedding-float", ("embedding",), "weights", ("gguf",) + FLOAT_WEIGHT_FORMATS,
         "the embedding keeps the file's format or a float one: it is a row lookup, so "
         "requantizing it saves memory but no time, and its error enters every layer's residual"),
    Rule("embedding-fp32", ("embedding",), "compute", ("fp32",),
         "the embedding's output is the fp32 residual stream every layer adds to"),
)


def _check_rules(file: str, op: str, values: Mapping[str, str], paths: Mapping[str, str]) -> None:
    """Apply RULES to the fields of one setting (`values`: field -> value, `paths`: field -> the
    YAML path that set it). The first broken rule raises."""
    for rule in RULES:
        if op not in rule.ops or rule.field not in values:
            continue
        if rule.when is not None and values.get(rule.when[0]) not in rule.when[1]:
            continue
        value = values[rule.field]
        if value not in rule.allowed:
            raise PrecisionPlanError(file, paths[rule.field],
                                     f"{op} {rule.field} {value!r}: {rule.why} [rule {rule.name}]")


# -- the plan ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class PhasePrecision:
    compute: str      # activation/compute precision: fp32 | fp16 | int8
    accumulate: str   # fp32 | int32 (int32 only with int8 compute)


@dataclass(frozen=True)
class OpSetting:
    """What one level of a plan sets for one op; None = not set at this level (a default
    entry has every field set, weights only on WEIGHT_OPS)."""
    weights: str | None = None               # stored weight format (WEIGHT_FORMATS)
    prefill: PhasePrecision | None = None    # compute for prefill chunks
    decode: PhasePrecision | None = None     # compute for decode steps


@dataclass(frozen=True)
class DepthPolicy:
    first_layers: int                  # layers 0 .. first_layers-1 take `ops`
    last_layers: int                   # and layers n_layers-last_layers .. n_layers-1
    ops: Mapping[str, OpSetting]       # layer op -> override

    def covers(self, layer: int, n_layers: int) -> bool:
        return layer < self.first_layers or layer >= n_layers - self.last_layers


@dataclass(frozen=True)
class SequencePolicy:
    min_tokens: int                    # applies when resolve()'s `tokens` is >= this
    ops: Mapping[str, OpSetting]       # op -> override (compute only: weights are fixed at load)


@dataclass(frozen=True)
class OpPrecision:
    """What resolve() answers for one (layer, op, phase, tokens)."""
    weights: str | None       # stored weight format; None for ops without weights
    compute: str              # fp32 | fp16 | int8
    accumulate: str           # fp32 | int32
    origin: str = field(default="defaults", compare=False)  # the highest level that set a field


@dataclass(frozen=True)
class PrecisionPlan:
    kv_precision: str                                 # KV cache storage: f32 | f16 | int8
    defaults: Mapping[str, OpSetting]                 # every op of OPS, every field set
    depth: tuple[DepthPolicy, ...] = ()               # later entries win over earlier ones
    sequence: tuple[SequencePolicy, ...] = ()         # ascending min_tokens; all that apply do
    layers: Mapping[int, Mapping[str, OpSetting]] = field(default_factory=dict)  # layer -> op -> override
    description: str = ""                             # one line: what the plan is for
    name: str = field(default="", compare=False)      # preset name or file stem
    source: str = field(default="", compare=False)    # the file it was read from

    def __post_init__(self):
        _check_built(self)

    @property
    def _file(self) -> str:
        return os.path.basename(self.source) if self.source else (self.name or "<plan>")

    def check_model(self, n_layers: int) -> None:
        """Raise unless the plan fits a model of `n_layers` layers (every explicit layer index
        exists). Called by resolve(); the engine may call it once at load."""
        if isinstance(n_layers, bool) or not isinstance(n_layers, int) or n_layers < 1:
            raise PrecisionPlanError(self._file, "", f"n_layers must be a positive integer, got {n_layers!r}")
        beyond = [i for i in self.layers if i >= n_layers]
        if beyond:
            raise PrecisionPlanError(self._file, f"layers.{min(beyond)}",
                                     f"the plan sets layer {min(beyond)} but the model has {n_layers} "
                                     f"layers (0..{n_layers - 1})")

    def resolve(self, layer: int | None, op: str, phase: str, n_layers: int,
                tokens: int = 1) -> OpPrecision:
        """The precision of `op` in `layer` (None for the model ops: embedding, output_norm,
        lm_head) during `phase` ("prefill" or "decode"). `tokens` is what sequence policies compare
        with min_tokens: the sequence's length at the end of the step (prefill chunk or decode token)."""
        self._check_query(layer, op, n_layers)
        if phase not in PHASES:
            raise PrecisionPlanError(self._file, "", f"phase must be one of {', '.join(PHASES)}, got {phase!r}")
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
            raise PrecisionPlanError(self._file, "", f"tokens must be an integer >= 0, got {tokens!r}")
        base = self.defaults[op]
        weights, pair, origin = base.weights, getattr(base, phase), "defaults"
        for where, setting in self._levels(layer, op, n_layers, tokens):
            if setting.weights is not None:
                weights, origin = setting.weights, where
            p = getattr(setting, phase)
            if p is not None:
                pair, origin = p, where
        return OpPrecision(weights, pair.compute, pair.accumulate, origin)

    def weight_format(self, layer: int | None, op: str, n_layers: int) -> str:
        """The stored weight format of `op` in `layer`: the same in both phases and for every step
        length (weights are converted once, at load)."""
        self._check_query(layer, op, n_layers)
        if op not in WEIGHT_OPS:
            raise PrecisionPlanError(self._file, "", f"{op} has no weights; ops with weights: "
                                                     f"{', '.join(WEIGHT_OPS)}")
        weights = self.defaults[op].weights
        for _, setting in self._levels(layer, op, n_layers, 0):
            if setting.weights is not None:
                weights = setting.weights
        assert weights is not None  # parse_plan fills every default
        return weights

    def _check_query(self, layer: int | None, op: str, n_layers: int) -> None:
        if op not in OPS:
            raise PrecisionPlanError(self._file, "", f"unknown op {op!r}; known: {', '.join(OPS)}")
        self.check_model(n_layers)
        if op in MODEL_OPS:
            if layer is not None:
                raise PrecisionPlanError(self._file, "", f"{op} is a model op, outside the layers: "
                                                         f"resolve it with layer=None, got {layer!r}")
        elif isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < n_layers:
            raise PrecisionPlanError(self._file, "", f"{op} is a layer op: layer must be an integer "
                                                     f"in 0..{n_layers - 1}, got {layer!r}")

    def _levels(self, layer: int | None, op: str, n_layers: int, tokens: int):
        """(path, setting) of every level that speaks about `op` here, lowest precedence first."""
        for i, s in enumerate(self.sequence):
            if tokens >= s.min_tokens and op in s.ops:
                yield f"sequence[{i}]", s.ops[op]
        if layer is None:
            return
        for i, d in enumerate(self.depth):
            if d.covers(layer, n_layers) and op in d.ops:
                yield f"depth[{i}]", d.ops[op]
        explicit = self.layers.get(layer, {})
        if op in explicit:
            yield f"layers.{layer}", explicit[op]


def _check_built(plan: PrecisionPlan) -> None:
    """The rules and vocabularies again, on the dataclasses: a plan built in code (by a search,
    with dataclasses.replace) is held to what a parsed one is. Paths name the same YAML fields."""
    file = plan._file

    def fail(path: str, message: str):
        raise PrecisionPlanError(file, path, message)

    def check_ops(ops: Any, path: str, allowed: tuple[str, ...], weights: bool) -> None:
        if not isinstance(ops, Mapping):
            fail(path, f"expected a mapping of op to OpSetting, got {_describe(ops)}")
        for op, s in ops.items():
            p = _join(path, op)
            if op not in allowed:
                fail(p, f"unknown op {_describe(op)}; allowed here: {', '.join(allowed)}")
            if not isinstance(s, OpSetting):
                fail(p, f"expected an OpSetting, got {_describe(s)}")
            if s.weights is not None:
                if not weights:
                    fail(_join(p, "weights"), "a sequence policy sets compute only")
                if s.weights not in WEIGHT_FORMATS:
                    fail(_join(p, "weights"), f"unknown weight format {_describe(s.weights)}; "
                                              f"known: {', '.join(WEIGHT_FORMATS)}")
                _check_rules(file, op, {"weights": s.weights}, {"weights": _join(p, "weights")})
            for ph in PHASES:
                pp = getattr(s, ph)
                if pp is None:
                    continue
                q = _join(p, ph)
                if not isinstance(pp, PhasePrecision):
                    fail(q, f"expected a PhasePrecision, got {_describe(pp)}")
                if pp.compute not in COMPUTE_PRECISIONS:
                    fail(_join(q, "compute"), f"unknown compute precision {_describe(pp.compute)}")
                if pp.accumulate not in ACCUMULATIONS:
                    fail(_join(q, "accumulate"), f"unknown accumulation {_describe(pp.accumulate)}")
                _check_rules(file, op, {"compute": pp.compute, "accumulate": pp.accumulate},
                             {"compute": _join(q, "compute"), "accumulate": _join(q, "accumulate")})

    if plan.kv_precision not in KV_PRECISIONS:
        fail("kv_cache", f"unknown KV cache precision {_describe(plan.kv_precision)}; "
                         f"known: {', '.join(KV_PRECISIONS)}")
    check_ops(plan.defaults, "defaults", OPS, True)
    for op in OPS:
        d = plan.defaults.get(op)
        if d is None or d.prefill is None or d.decode is None or (d.weights is None) == (op in WEIGHT_OPS):
            fail(_join("defaults", op), "a default entry sets both phases, and weights exactly "
                                        "on the ops that have them")
    for i, dp in enumerate(plan.depth):
        if not isinstance(dp, DepthPolicy):
            fail(f"depth[{i}]", f"expected a DepthPolicy, got {_describe(dp)}")
        if dp.first_layers < 0 or dp.last_layers < 0 or dp.first_layers == dp.last_layers == 0:
            fail(f"depth[{i}]", "first_layers and last_layers are >= 0, one of them > 0")
        check_ops(dp.ops, f"depth[{i}].with", LAYER_OPS, True)
    for i, sp in enumerate(plan.sequence):
        if not isinstance(sp, SequencePolicy):
            fail(f"sequence[{i}]", f"expected a SequencePolicy, got {_describe(sp)}")
        if sp.min_tokens < 1 or (i and sp.min_tokens <= plan.sequence[i - 1].min_tokens):
            fail(f"sequence[{i}].min_tokens", "thresholds are >= 1 and ascending")
        check_ops(sp.ops, f"sequence[{i}].with", OPS, False)
    for idx, ops in plan.layers.items():
        if isinstance(idx, bool) or not isinstance(idx, int) or not 0 <= idx <= MAX_LAYER:
            fail(_join("layers", idx), f"expected a layer index in [0, {MAX_LAYER}]")
        check_ops(ops, f"layers.{idx}", LAYER_OPS, True)


# -- reading -----------------------------------------------------------------------------------


def _describe(v: Any) -> str:
    if v is None:
        return "nothing (null)"
    if isinstance(v, bool):
        return f"a boolean ({str(v).lower()})"
    if isinstance(v, str):
        return repr(v)
    if isinstance(v, dict):
        return "a mapping"
    if isinstance(v, list):
        return "a list"
    return f"{type(v).__name__} {v!r}"[:80]


def _join(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)


class _Reader:
    """Typed accessors that fail with PrecisionPlanError('<file>', '<path>', 'expected ..., got ...')."""

    def __init__(self, file: str):
        self.file = file

    def fail(self, path: str, message: str):
        raise PrecisionPlanError(self.file, path, message)

    def mapping(self, v: Any, path: str, required: tuple[str, ...] = (),
                optional: tuple[str, ...] = ()) -> dict:
        allowed = required + optional
        if not isinstance(v, dict):
            self.fail(path, f"expected a mapping with keys {', '.join(allowed)}, got {_describe(v)}")
        for key in v:
            if key not in allowed:
                self.fail(_join(path, key), f"unknown key {_describe(key)}; allowed here: {', '.join(allowed)}")
        for key in required:
            if key not in v:
                self.fail(path, f"missing required field {key!r}")
        return v

    def integer(self, v: Any, path: str, lo: int, hi: int) -> int:
        if isinstance(v, bool) or not isinstance(v, int):
            self.fail(path, f"expected an integer, got {_describe(v)}")
        if not lo <= v <= hi:
            self.fail(path, f"expected an integer in [{lo}, {hi}], got {v}")
        return v

    def choice(self, v: Any, path: str, known: tuple[str, ...], what: str) -> str:
        if not isinstance(v, str):
            self.fail(path, f"expected a {what} ({', '.join(known)}), got {_describe(v)}")
        if v not in known:
            self.fail(path, f"unknown {what} {v!r}; known: {', '.join(known)}")
        return v

    def string(self, v: Any, path: str) -> str:
        if not isinstance(v, str):
            self.fail(path, f"expected a string, got {_describe(v)}")
        try:
            v.encode("utf-8")
        except UnicodeEncodeError as e:   # a lone surrogate escape ("\ud800"): printing it fails later
            self.fail(path, f"character {e.start} is a lone surrogate, not text")
        return v


def _phase(r: _Reader, v: dict, path: str, op: str) -> PhasePrecision | None:
    """The (compute, accumulate) pair written at one level (an op entry or its prefill/decode
    map); None when that level writes no compute. accumulate comes with compute or not at all:
    alone it would combine with a compute set elsewhere, and the pair could break a rule no
    single entry shows."""
    if "accumulate" in v and "compute" not in v:
        r.fail(_join(path, "accumulate"), "accumulate needs compute beside it (without, it is "
                                          "derived from compute: int32 for int8, else fp32)")
    if "compute" not in v:
        return None
    compute = r.choice(v["compute"], _join(path, "compute"), COMPUTE_PRECISIONS, "compute precision")
    if "accumulate" in v:
        acc = r.choice(v["accumulate"], _join(path, "accumulate"), ACCUMULATIONS, "accumulation")
        acc_path = _join(path, "accumulate")
    else:
        acc, acc_path = default_accumulation(compute), _join(path, "compute")
    _check_rules(r.file, op, {"compute": compute, "accumulate": acc},
                 {"compute": _join(path, "compute"), "accumulate": acc_path})
    return PhasePrecision(compute, acc)


def _op_setting(r: _Reader, v: Any, path: str, op: str, *, weights_allowed: bool = True) -> OpSetting:
    r.mapping(v, path, (), ("weights", "compute", "accumulate", "prefill", "decode"))
    weights = None
    if "weights" in v:
        if not weights_allowed:
            r.fail(_join(path, "weights"), "weights are converted once at load and cannot depend "
                                           "on the step's length: a sequence policy sets compute only")
        weights = r.choice(v["weights"], _join(path, "weights"), WEIGHT_FORMATS, "weight format")
        _check_rules(r.file, op, {"weights": weights}, {"weights": _join(path, "weights")})
    both = _phase(r, v, path, op)
    phases = {}
    for ph in PHASES:
        if ph in v:
            sub = r.mapping(v[ph], _join(path, ph), (), ("compute", "accumulate"))
            phases[ph] = _phase(r, sub, _join(path, ph), op)
        phases[ph] = phases.get(ph) or both
    return OpSetting(weights, phases["prefill"], phases["decode"])


def _op_map(r: _Reader, v: Any, path: str, ops: tuple[str, ...], *, weights_allowed: bool = True,
            scope_hint: str = "") -> dict[str, OpSetting]:
    if v is None:
        return {}
    if not isinstance(v, dict):
        r.fail(path, f"expected a mapping of op to settings, got {_describe(v)}")
    out = {}
    for op, entry in v.items():
        if op not in ops:
            hint = (f" ({op} is a model op: set it under defaults{scope_hint})"
                    if op in MODEL_OPS and op not in ops else "")
            r.fail(_join(path, op), f"unknown op {_describe(op)}{hint}; allowed here: {', '.join(ops)}")
        s = _op_setting(r, entry, _join(path, op), op, weights_allowed=weights_allowed)
        if s != OpSetting():  # an empty entry sets nothing
            out[op] = s
    return out


def _plan_from_doc(doc: Any, file: str, name: str, source: str) -> PrecisionPlan:
    r = _Reader(file)
    r.mapping(doc, "", ("schema", "kv_cache"), ("description", "defaults", "depth", "sequence", "layers"))
    schema = doc["schema"]
    if isinstance(schema, bool) or not isinstance(schema, int) or schema != SCHEMA_VERSION:
        r.fail("schema", f"expected schema version {SCHEMA_VERSION}, got {_describe(schema)}")
    kv = r.choice(doc["kv_cache"], "kv_cache", KV_PRECISIONS, "KV cache precision")
    description = r.string(doc.get("description", ""), "description")

    given = _op_map(r, doc.get("defaults"), "defaults", OPS)
    defaults = {}
    for op in OPS:  # what a default entry leaves out is the quality baseline
        g = given.get(op, OpSetting())
        fp32 = PhasePrecision("fp32", "fp32")
        defaults[op] = OpSetting(g.weights or ("gguf" if op in WEIGHT_OPS else None),
                                 g.prefill or fp32, g.decode or fp32)

    depth = []
    d_list = doc.get("depth") or []
    if not isinstance(d_list, list):
        r.fail("depth", f"expected a list of depth policies, got {_describe(d_list)}")
    for i, d in enumerate(d_list):
        p = f"depth[{i}]"
        r.mapping(d, p, ("with",), ("first_layers", "last_layers"))
        first = r.integer(d.get("first_layers", 0), f"{p}.first_layers", 0, MAX_LAYER)
        last = r.integer(d.get("last_layers", 0), f"{p}.last_layers", 0, MAX_LAYER)
        if first == last == 0:
            r.fail(p, "a depth policy needs first_layers or last_layers > 0")
        depth.append(DepthPolicy(first, last, _op_map(r, d["with"], f"{p}.with", LAYER_OPS,
                                                      scope_hint="; a depth policy covers layer ops")))

    sequence = []
    s_list = doc.get("sequence") or []
    if not isinstance(s_list, list):
        r.fail("sequence", f"expected a list of sequence policies, got {_describe(s_list)}")
    for i, s in enumerate(s_list):
        p = f"sequence[{i}]"
        r.mapping(s, p, ("min_tokens", "with"))
        n = r.integer(s["min_tokens"], f"{p}.min_tokens", 1, MAX_TOKENS)
        if sequence and n <= sequence[-1].min_tokens:
            r.fail(f"{p}.min_tokens", f"expected thresholds in ascending order, got {n} after "
                                      f"{sequence[-1].min_tokens}")
        sequence.append(SequencePolicy(n, _op_map(r, s["with"], f"{p}.with", OPS, weights_allowed=False)))

    layers: dict[int, dict[str, OpSetting]] = {}
    l_map = doc.get("layers") or {}
    if not isinstance(l_map, dict):
        r.fail("layers", f"expected a mapping of layer index to op settings, got {_describe(l_map)}")
    for idx, entry in l_map.items():
        if isinstance(idx, bool) or not isinstance(idx, int):
            r.fail(_join("layers", idx), f"expected an integer layer index, got {_describe(idx)}")
        if not 0 <= idx <= MAX_LAYER:
            r.fail(_join("layers", idx), f"expected a layer index in [0, {MAX_LAYER}], got {idx}")
        ops = _op_map(r, entry, f"layers.{idx}", LAYER_OPS, scope_hint="; `layers` covers layer ops")
        if ops:
            layers[idx] = ops

    return PrecisionPlan(kv_precision=kv, defaults=defaults, depth=tuple(depth),
                         sequence=tuple(sequence), layers=layers, description=description,
                         name=name, source=source)


class _Loader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate keys by their value (safe_load keeps the last silently,
    and `3:` and `03:` are the same layer)."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=True)
                try:
                    dup = key in seen
                    seen.add(key)
                except TypeError:  # an unhashable key: the base class says so
                    continue
                if dup:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"duplicate key {key!r}", key_node.start_mark)
        return super().construct_mapping(node, deep)


def _check_tree(root: yaml.Node, file: str) -> None:
    """No aliases (a small file of nested aliases expands to billions of nodes) and no merge
    keys (`<<` would let a key appear twice); plans need neither."""
    seen: set[int] = set()
    stack = [root]
    while stack:
        node = stack.pop()
        if id(node) in seen:
            raise PrecisionPlanError(file, "", f"line {node.start_mark.line + 1}: YAML aliases are not allowed")
        seen.add(id(node))
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                if k.tag == "tag:yaml.org,2002:merge":
                    raise PrecisionPlanError(file, "", f"line {k.start_mark.line + 1}: YAML merge keys "
                                                       f"(<<) are not allowed")
                stack += (k, v)
        elif isinstance(node, yaml.SequenceNode):
            stack += node.value


def _parse_yaml(text: str, file: str) -> Any:
    loader = None
    try:
        loader = _Loader(text)  # the reader rejects control characters here
        root = loader.get_single_node()
        if root is None:
            return None
        _check_tree(root, file)
        return loader.construct_document(root)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        problem = getattr(e, "problem", None) or " ".join(str(e).split())   # (one line: a ReaderError)
        raise PrecisionPlanError(file, "", f"{where}YAML error: {problem}") from None
    except (ValueError, TypeError, KeyError, IndexError, AttributeError, OverflowError) as e:
        # PyYAML's safe constructors leak these for explicit tags on bad text ("!!int neon")
        raise PrecisionPlanError(file, "", f"YAML value cannot be read ({type(e).__name__}: {e})") from None
    except RecursionError:
        raise PrecisionPlanError(file, "", "YAML nested too deeply") from None
    finally:
        if loader is not None:
            loader.dispose()


def parse_plan(text: str, source: str = "<string>", name: str | None = None) -> PrecisionPlan:
    """A plan from YAML text; `source` names it in errors (its basename) and in plan.source."""
    file = os.path.basename(source) or source
    if len(text) > MAX_PLAN_BYTES:
        raise PrecisionPlanError(file, "", f"a precision plan is at most {MAX_PLAN_BYTES} bytes")
    doc = _parse_yaml(text, file)
    return _plan_from_doc(doc, file, name if name is not None else Path(file).stem, source)


# -- finding -----------------------------------------------------------------------------------

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")   # (bounded: a longer name failed its stat, untyped)


def presets_dir() -> Path:
    """The shipped presets: precision_presets/ beside this module (wheel and checkout alike)."""
    return Path(__file__).resolve().parent / "precision_presets"


def list_presets() -> list[str]:
    """Names load_plan accepts besides paths."""
    d = presets_dir()
    return sorted(f.stem for f in d.glob("*.yaml") if _NAME.fullmatch(f.stem)) if d.is_dir() else []


def load_plan(name_or_path: str | os.PathLike | PrecisionPlan) -> PrecisionPlan:
    """A shipped preset by name ("quality", "balanced", "fast") or a plan file by path (anything
    ending in .yaml/.yml, containing a '/', or a PathLike). A PrecisionPlan passes through."""
    if isinstance(name_or_path, PrecisionPlan):
        return name_or_path
    if not isinstance(name_or_path, (str, os.PathLike)):
        raise PrecisionPlanError("", "", f"expected a preset name or a plan path, got {_describe(name_or_path)}")
    s = os.fspath(name_or_path)
    is_path = isinstance(name_or_path, os.PathLike) or s.endswith((".yaml", ".yml")) or "/" in s or os.sep in s
    if is_path:
        path, name = Path(s).expanduser(), None
    else:
        if not (_NAME.fullmatch(s) and (presets_dir() / f"{s}.yaml").is_file()):
            raise PrecisionPlanError("", "", f"unknown precision preset {s!r}; presets: "
                                             f"{', '.join(list_presets()) or '(none)'}, or a path to a .yaml file")
        path, name = presets_dir() / f"{s}.yaml", s
    try:
        if not path.is_file():
            raise PrecisionPlanError(str(path), "", "no such precision plan file" if not path.exists()
                                     else "not a regular file")
        with open(path, "rb") as f:
            data = f.read(MAX_PLAN_BYTES + 1)
    except OSError as e:
        raise PrecisionPlanError(str(path), "", f"cannot read: {e.strerror or e}") from None
    if len(data) > MAX_PLAN_BYTES:
        raise PrecisionPlanError(str(path), "", f"a precision plan is at most {MAX_PLAN_BYTES} bytes")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise PrecisionPlanError(str(path), "", f"not UTF-8 text (byte {e.start})") from None
    return parse_plan(text, str(path), name)


# -- writing -----------------------------------------------------------------------------------


def _pair(p: PhasePrecision) -> dict:
    d = {"compute": p.compute}
    if p.accumulate != default_accumulation(p.compute):
        d["accumulate"] = p.accumulate
    return d


def _setting(s: OpSetting) -> dict:
    d: dict[str, Any] = {}
    if s.weights is not None:
        d["weights"] = s.weights
    if s.prefill is not None and s.prefill == s.decode:
        d.update(_pair(s.prefill))
    else:
        for ph in PHASES:
            p = getattr(s, ph)
            if p is not None:
                d[ph] = _pair(p)
    return d


def _ops(ops: Mapping[str, OpSetting]) -> dict:
    return {op: _setting(ops[op]) for op in OPS if op in ops}


def dump_plan(plan: PrecisionPlan) -> str:
    """YAML text of `plan`, every default written out; parse_plan reads it back equal."""
    d: dict[str, Any] = {"schema": SCHEMA_VERSION}
    if plan.description:
        d["description"] = plan.description
    d["kv_cache"] = plan.kv_precision
    d["defaults"] = _ops(plan.defaults)
    if plan.depth:
        d["depth"] = [{"first_layers": p.first_layers, "last_layers": p.last_layers, "with": _ops(p.ops)}
                      for p in plan.depth]
    if plan.sequence:
        d["sequence"] = [{"min_tokens": p.min_tokens, "with": _ops(p.ops)} for p in plan.sequence]
    if plan.layers:
        d["layers"] = {i: _ops(plan.layers[i]) for i in sorted(plan.layers)}
    body = yaml.safe_dump(d, sort_keys=False, default_flow_style=None, allow_unicode=True, width=100)
    title = f" '{plan.name}'" if plan.name else ""
    return f"# edgellm precision plan{title} (schema: edgellm/precision_presets/README.md)\n{body}"
