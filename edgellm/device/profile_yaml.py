"""Device profile YAML: unit parsing, the validating loader, name lookup, and the atomic writer.

A profile is parsed once into the frozen dataclasses of edgellm.device.profile; every error is a
ConfigError naming the file and the dotted field path, and saying what was expected and found.
device_profiles/README.md documents the schema.
"""
from __future__ import annotations

import datetime
import logging
import math
import os
import re
from decimal import Decimal
from pathlib import Path
from typing import Any, Callable

import yaml

from edgellm.device.profile import (
    PRECISIONS, AttentionFigure, CpuCluster, DeviceProfile, ElementwiseFigure, GemmFigure, Gpu, Measured, Npu,
    UnitMeasurement,
)
from edgellm.errors import ConfigError
from edgellm.backends import KNOWN as UNIT_NAMES
from edgellm.ops import ELEMENTWISE_FLOPS, OP_KINDS, WEIGHT_BYTES
from edgellm.fileio import write_atomic

log = logging.getLogger("edgellm")

__all__ = ["parse_quantity", "format_quantity", "load_profile", "list_profiles", "dump_profile",
           "write_profile", "shipped_profiles_dir", "user_profiles_dir", "SCHEMA_VERSION"]

SCHEMA_VERSION = 1
MAX_PROFILE_BYTES = 1 << 20  # a real profile is a few KiB; the cap is checked before parsing

_K, _M, _G, _T = 1e3, 1e6, 1e9, 1e12
_KI, _MI, _GI = 1024, 1024 ** 2, 1024 ** 3

# kind -> unit -> factor to the SI base unit. Case matters: "Gb/s" would be gigabits.
_UNITS: dict[str, dict[str, float]] = {
    "size": {"B": 1, "KB": _K, "MB": _M, "GB": _G, "TB": _T, "KiB": _KI, "MiB": _MI, "GiB": _GI},
    "bandwidth": {"B/s": 1, "KB/s": _K, "MB/s": _M, "GB/s": _G, "TB/s": _T,
                  "KiB/s": _KI, "MiB/s": _MI, "GiB/s": _GI},
    "frequency": {"Hz": 1, "kHz": _K, "MHz": _M, "GHz": _G},
    "time": {"ns": 1e-9, "us": 1e-6, "\u00b5s": 1e-6, "\u03bcs": 1e-6, "ms": 1e-3, "s": 1},
    "compute": {"FLOPS": 1, "MFLOPS": _M, "GFLOPS": _G, "TFLOPS": _T,
                "OPS": 1, "MOPS": _M, "GOPS": _G, "TOPS": _T},
}
_EXAMPLE = {"size": "a size such as '64 KiB'", "bandwidth": "a bandwidth such as '51.2 GB/s'",
            "frequency": "a frequency such as '2.84 GHz'", "time": "a time such as '20 us'",
            "compute": "a compute rate such as '38.4 GFLOPS'"}
# the smallest non-zero figure of each kind that is not a typo: below it a float rounds to 0
# ('1e-999 GB/s') or a whole-byte size does ('0.4 B'), or the roofline's times overflow to inf
_SMALLEST = {"size": ("1 B", 1.0), "bandwidth": ("1 B/s", 1.0), "frequency": ("1 Hz", 1.0),
             "time": ("0.001 ns", 1e-12), "compute": ("1 FLOPS", 1.0)}
# Figures a real machine can have; one outside loads (a user may be experimenting) with a warning
# naming it, as the plan made from it is nonsense ('memory.bandwidth: 1 B/s' predicted a TTFT of
# 1.6e12 ms and decode at 0.0 tok/s without a word). Bandwidth: the slowest board (a Pi Zero's
# single ARM11 core on 32-bit LPDDR2, 3.2 GB/s peak) is well above 0.1 GB/s, and the fastest memory
# on any chip (HBM3e, 8 TB/s on NVIDIA's B200) below 10 TB/s; a phone's or desktop's figure
# (10-800 GB/s) written in MB/s or TB/s by mistake falls outside. Peaks: one scalar FPU at 100 MHz
# does 0.1 GFLOPS, below any core edgellm runs on; the fastest single accelerator's figure (B200:
# 20 PFLOPS fp4, sparse) is a fifth of 100000 TFLOPS.
_PLAUSIBLE = {"bandwidth": (0.1e9, 10e12, "0.1 GB/s to 10 TB/s"),
              "compute": (0.1e9, 1e17, "0.1 GFLOPS (GOPS) to 100000 TFLOPS (TOPS)")}
_warned: set[tuple[str, str, float]] = set()   # (file, field, value) said already: once per process
# ASCII digits only: \d took full-width ones ('３４ GB/s' read as 34e9); the spaces stay Unicode
# (a figure copied from a datasheet brings a no-break space before its unit)
_QUANTITY = re.compile(r"\s*([+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]{1,3})?)\s*(\S+)\s*")


def parse_quantity(text: Any, kind: str, where: str, *, allow_zero: bool = False) -> float:
    """'51.2 GB/s' -> 51.2e9 (bytes, bytes/s, Hz, s, FLOP/s or op/s). `where` prefixes errors
    ("rk3588.yaml: memory.bandwidth"). Bare numbers, unknown or wrong-kind units, and values
    that are negative (or zero, unless allow_zero) raise ConfigError."""
    expected = f"{where}: expected {_EXAMPLE[kind]}"
    if isinstance(text, bool) or not isinstance(text, (str, int, float)):
        raise ConfigError(f"{expected}, got {_describe(text)}")
    if not isinstance(text, str):
        raise ConfigError(f"{expected}, got the bare number {text!r} (every figure carries a unit)")
    m = _QUANTITY.fullmatch(text)
    if m is None:
        raise ConfigError(f"{expected}, got {text!r}")
    number, unit = Decimal(m.group(1)), m.group(2)
    if unit not in _UNITS[kind]:
        other = next((k for k, units in _UNITS.items() if unit in units), None)
        why = (f"{unit} is a {other} unit" if other else
               f"unknown unit {unit!r}; known: {', '.join(_UNITS[kind])}")
        raise ConfigError(f"{expected}, got {text!r} ({why})")
    if number < 0 or (number == 0 and not allow_zero):
        raise ConfigError(f"{expected}, got {text!r} (must be {'>= 0' if allow_zero else '> 0'})")
    # Decimal keeps '0.5 ms' at exactly 5e-4 and '2.171 TFLOPS' at 2.171e12 (float would not)
    exact = number * Decimal(str(_UNITS[kind][unit]))
    value = float(exact)
    if not math.isfinite(value):
        raise ConfigError(f"{expected}, got {text!r} (too large)")
    smallest, least = _SMALLEST[kind]
    if number != 0 and exact < Decimal(str(least)):
        raise ConfigError(f"{expected}, got {text!r} (a non-zero figure must be at least {smallest})")
    return value


def format_quantity(value: float, kind: str, *, ops: bool = False) -> str:
    """The inverse of parse_quantity, in the largest unit that keeps the number >= 1 and with
    6 significant digits (load(dump(x)) == x to ~1e-6). Sizes use an exact binary unit when one
    divides them. ops=True writes OPS instead of FLOPS (integer precisions)."""
    if not math.isfinite(value):  # e.g. a failed measurement; never write what cannot be read
        raise ConfigError(f"cannot write {value} as {_EXAMPLE[kind].split(' such')[0]}")
    if kind == "size":
        n = int(round(value))
        exact = (("GiB", _GI), ("MiB", _MI), ("KiB", _KI), ("GB", 10**9), ("MB", 10**6), ("KB", 10**3))
        for unit, f in exact:
            if n and n % f == 0:
                return f"{n // f} {unit}"
        return f"{n} B"
    scales = {"bandwidth": ("TB/s", "GB/s", "MB/s", "KB/s", "B/s"),
              "frequency": ("GHz", "MHz", "kHz", "Hz"),
              "time": ("s", "ms", "us", "ns"),
              "compute": ("TOPS", "GOPS", "MOPS", "OPS") if ops else
                         ("TFLOPS", "GFLOPS", "MFLOPS", "FLOPS")}[kind]
    for unit in scales:
        if abs(value) >= _UNITS[kind][unit]:
            break
    return f"{value / _UNITS[kind][unit]:.6g} {unit}"


_MAX_QUOTE = 120   # characters of a value an error quotes


def _describe(v: Any) -> str:
    if v is None:
        return "nothing (null)"
    if isinstance(v, bool):
        return f"a boolean ({str(v).lower()})"
    # capped: a path given as --device may name any file (`../../etc/passwd`), which parses as
    # one long YAML string, and "expected a mapping, got ..." printed the file's contents
    text = {dict: "a mapping", list: "a list"}.get(type(v)) or repr(v)
    return text if len(text) <= _MAX_QUOTE else f"{text[:_MAX_QUOTE]}... ({len(text):,} characters)"


# -- reading ---------------------------------------------------------------------------------


class _Reader:
    """Typed accessors that fail with '<file>: <path>: expected ..., got ...'."""

    def __init__(self, file: str):
        self.file = file

    def fail(self, path: str, message: str):
        raise ConfigError(f"{self.file}: {path}: {message}" if path else f"{self.file}: {message}")

    def mapping(self, v: Any, path: str, required: tuple[str, ...],
                optional: tuple[str, ...] = ()) -> dict:
        if not isinstance(v, dict):
            self.fail(path, f"expected a mapping with keys {', '.join(required + optional)}, "
                            f"got {_describe(v)}")
        allowed = required + optional
        for key in v:
            if key not in allowed:
                self.fail(_join(path, key), f"unknown key {key!r}; allowed here: {', '.join(allowed)}")
        for key in required:
            if key not in v:
                self.fail(path, f"missing required field {key!r}")
        return v

    def qty(self, v: Any, path: str, kind: str, allow_zero: bool = False) -> float:
        return parse_quantity(v, kind, f"{self.file}: {path}", allow_zero=allow_zero)

    def plausible(self, v: Any, path: str, kind: str) -> float:
        """qty() of a bandwidth or peak, warned about (once) outside _PLAUSIBLE."""
        value = self.qty(v, path, kind)
        lo, hi, span = _PLAUSIBLE[kind]
        if not lo <= value <= hi and (self.file, path, value) not in _warned:
            _warned.add((self.file, path, value))
            log.warning("%s: %s: %r is outside the range any real device has (%s): plans from this profile "
                        "will be far off; check the figure and its unit", self.file, path, v, span)
        return value

    # a name or a date, shown in plans and reports: a 900 KB soc was printed whole, and control
    # characters (BEL, NUL) raw to the terminal
    MAX_STRING = 200

    def string(self, v: Any, path: str) -> str:
        if isinstance(v, datetime.date):  # YAML reads 2026-11-21 as a date
            return v.isoformat()
        if not isinstance(v, str) or not v.strip():
            self.fail(path, f"expected a non-empty string, got {_describe(v)}")
        v = v.rstrip("\n")   # (a block scalar, `soc: |`, ends its text with a newline)
        if len(v) > self.MAX_STRING:
            self.fail(path, f"expected at most {self.MAX_STRING} characters, got {len(v):,}")
        # control characters (category Cc: U+0000-001F and U+007F-009F, a set Unicode's stability
        # policy fixes; unicodedata's import is ~0.2 MiB resident in every load), and the
        # bidirectional overrides that reorder what a terminal shows
        bad = next((c for c in v if c <= "\x1f" or "\x7f" <= c <= "\x9f" or "\u202a" <= c <= "\u202e"
                    or "\u2066" <= c <= "\u2069"), None)
        if bad is not None:
            self.fail(path, f"expected printable text, got the control character {bad!r}")
        return v

    def integer(self, v: Any, path: str, lo: int = 1, hi: int = 1 << 31) -> int:
        if isinstance(v, bool) or not isinstance(v, int):
            self.fail(path, f"expected an integer, got {_describe(v)}")
        if not lo <= v <= hi:
            self.fail(path, f"expected an integer in [{lo}, {hi}], got {v}")
        return v

    def boolean(self, v: Any, path: str) -> bool:
        if not isinstance(v, bool):
            self.fail(path, f"expected true or false, got {_describe(v)}")
        return v

    def items(self, v: Any, path: str, each: Callable[[Any, str], Any], nonempty: bool = True) -> list:
        if not isinstance(v, list) or (nonempty and not v):
            self.fail(path, f"expected a {'non-empty ' if nonempty else ''}list, got "
                            f"{'an empty list' if v == [] else _describe(v)}")
        return [each(x, f"{path}[{i}]") for i, x in enumerate(v)]

    def precisions(self, v: Any, path: str, peaks: bool = True) -> dict[str, float]:
        """{fp32: '38.4 GFLOPS', int8: '153.6 GOPS'} -> {precision: op/s}. peaks: each is a peak
        the cost model plans with, warned about outside _PLAUSIBLE."""
        if not isinstance(v, dict) or not v:
            self.fail(path, f"expected a non-empty mapping of precision to rate such as "
                            f"{{fp32: 38.4 GFLOPS}}, got {_describe(v)}")
        self.mapping(v, path, (), PRECISIONS)
        read = self.plausible if peaks else self.qty
        return {p: read(r, _join(path, p), "compute") for p, r in v.items()}


def _join(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)


_INT, _FLOAT = "tag:yaml.org,2002:int", "tag:yaml.org,2002:float"


def _check_tree(node: yaml.Node, file: str, seen: set[int]) -> None:
    """Reject duplicate keys (safe_load keeps the last silently) and aliases (a 1 MiB file of
    nested aliases expands to billions of nodes; profiles have no use for them)."""
    if id(node) in seen:
        raise ConfigError(f"{file}: line {node.start_mark.line + 1}: YAML aliases are not allowed")
    seen.add(id(node))
    if isinstance(node, yaml.ScalarNode) and node.tag in (_INT, _FLOAT) and ":" in node.value:
        # YAML 1.1 reads 1:30 as base 60 (90): a profile means no such number
        raise ConfigError(f"{file}: line {node.start_mark.line + 1}: {node.value!r} reads as a base-60 number "
                          f"in YAML; write the number itself, or quote the text")
    if isinstance(node, yaml.MappingNode):
        keys: set[str] = set()
        for k, v in node.value:
            if isinstance(k, yaml.ScalarNode) and k.tag == "tag:yaml.org,2002:merge":
                raise ConfigError(f"{file}: line {k.start_mark.line + 1}: YAML merge keys (<<) are not allowed")
            if isinstance(k, yaml.ScalarNode):
                if k.value in keys:
                    raise ConfigError(f"{file}: line {k.start_mark.line + 1}: duplicate key {k.value!r}")
                keys.add(k.value)
            _check_tree(k, file, seen)
            _check_tree(v, file, seen)
    elif isinstance(node, yaml.SequenceNode):
        for v in node.value:
            _check_tree(v, file, seen)


# libyaml's parser when PyYAML was built with it: the pure-Python one took ~0.17 s of every
# load() for a measured host profile; both are safe loaders with the same YAML semantics
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


# Profiles nest a few levels. libyaml's composer recurses once per level with no limit of its
# own in 0.2.5: '[' * 30000 (a 60 KB file) overflowed the C stack, a segfault no handler sees.
_MAX_DEPTH = 100


def _check_depth(text: str, file: str) -> None:
    """Refuse nesting past _MAX_DEPTH from the parser's events (a flat loop) before any node is
    composed."""
    events = _LOADER(text)
    try:
        depth = 0
        while events.check_event():
            ev = events.get_event()
            if isinstance(ev, (yaml.SequenceStartEvent, yaml.MappingStartEvent)):
                depth += 1
                if depth > _MAX_DEPTH:
                    raise ConfigError(f"{file}: line {ev.start_mark.line + 1}: YAML nested too deeply (more "
                                      f"than {_MAX_DEPTH} levels)")
            elif isinstance(ev, (yaml.SequenceEndEvent, yaml.MappingEndEvent)):
                depth -= 1
    finally:
        events.dispose()


def _parse_yaml(text: str, file: str) -> Any:
    loader = _LOADER(text)
    try:
        _check_depth(text, file)
        root = loader.get_single_node()  # nodes only, nothing constructed: checked first
        if root is None:
            return None
        _check_tree(root, file, set())
        try:
            return loader.construct_document(root)
        except (ValueError, TypeError, KeyError, IndexError, AttributeError, OverflowError) as e:
            # PyYAML's safe constructors leak these for explicit tags on bad text ("!!int neon")
            if "int_max_str_digits" in str(e):   # (the advice was Python's: sys.set_int_max_str_digits)
                raise ConfigError(f"{file}: a number with thousands of digits; no figure needs one") from None
            raise ConfigError(f"{file}: YAML value cannot be read ({type(e).__name__}: {e})") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        # (one line: a reader error's text carried a second, 'in "<unicode string>", position N')
        problem = (getattr(e, "problem", None) or str(e)).split("\n", 1)[0]
        if "nesting depth" in problem:   # libyaml >= 0.2.5 stops at its own depth limit
            raise ConfigError(f"{file}: YAML nested too deeply ({where}{problem})") from None
        raise ConfigError(f"{file}: {where}YAML syntax error: {problem}") from None
    except RecursionError:
        raise ConfigError(f"{file}: YAML nested too deeply") from None
    finally:
        loader.dispose()


# A written profile ends with _END, and says so on its first line: one cut at a line boundary
# (a full disk, a copy stopped half-way) parsed, and plans used whatever figures were left
# (TTFT predicted 0.3 ms instead of 1.5). Files without the first-line promise (hand-written,
# or written before it) are read as they are.
_ENDS = "; ends with '# end of profile'"
_END = "# end of profile"


def _profile_from_text(text: str, name: str, source: str) -> DeviceProfile:
    text = text.replace("\r\n", "\n")   # (a CRLF copy skipped the end-of-profile check)
    # a profile by its name, but one in EDGELLM_HOME/profiles by its path: a user's copy that
    # shadows a shipped profile was named as if it were the shipped file
    mine = bool(source) and os.path.dirname(os.path.abspath(source)) == os.path.abspath(user_profiles_dir())
    file = (source if mine else os.path.basename(source)) or source
    first = text.split("\n", 1)[0]
    if first.startswith("# edgellm device profile ") and first.endswith(_ENDS) and \
            text.rstrip().rsplit("\n", 1)[-1].rstrip() != _END:
        if any(line.rstrip() == _END for line in text.split("\n")):   # (a note after the end read as "cut short")
            raise ConfigError(f"{file}: has lines after '{_END}', which ends a written profile: move them "
                              f"above it (comments may go anywhere before it)")
        raise ConfigError(f"{file}: cut short (a written profile ends with '{_END}'): write it again "
                          f"(`edgellm profile`, or --out for another file)")
    r = _Reader(file)
    doc = r.mapping(_parse_yaml(text, file), "", ("schema", "soc", "memory", "cpu"),
                    ("gpu", "npu", "measured"))
    schema = doc["schema"]
    if isinstance(schema, bool) or not isinstance(schema, int) or schema != SCHEMA_VERSION:
        r.fail("schema", f"expected schema version {SCHEMA_VERSION}, got {_describe(schema)}")
    mem = r.mapping(doc["memory"], "memory", ("total", "bandwidth"))
    cpu = r.mapping(doc["cpu"], "cpu", ("clusters",))
    clusters = tuple(r.items(cpu["clusters"], "cpu.clusters", lambda v, p: _cluster(r, v, p)))
    owner: dict[int, str] = {}
    for i, c in enumerate(clusters):
        if c.name in (o.name for o in clusters[:i]):
            r.fail(f"cpu.clusters[{i}].name", f"duplicate cluster name {c.name!r}")
        for core in c.cores:
            if core in owner:
                r.fail(f"cpu.clusters[{i}].cores", f"core {core} is already in cluster "
                                                   f"{owner[core]!r}; each core belongs to one cluster")
            owner[core] = c.name
    return DeviceProfile(
        name=name,
        soc=r.string(doc["soc"], "soc"),
        memory_total_bytes=round(r.qty(mem["total"], "memory.total", "size")),
        memory_bandwidth=r.plausible(mem["bandwidth"], "memory.bandwidth", "bandwidth"),
        clusters=clusters,
        gpu=None if doc.get("gpu") is None else _gpu(r, doc["gpu"], "gpu"),
        npu=None if doc.get("npu") is None else _npu(r, doc["npu"], "npu"),
        measured=None if doc.get("measured") is None else _measured(r, doc["measured"], clusters),
        source=source,
    )


def _cluster(r: _Reader, v: Any, p: str) -> CpuCluster:
    r.mapping(v, p, ("name", "cores", "microarch", "max_freq", "features", "peak_per_core", "cache"),
              ("capacity",))
    cores = r.items(v["cores"], f"{p}.cores", lambda x, q: r.integer(x, q, lo=0, hi=4095))
    if len(set(cores)) != len(cores):
        r.fail(f"{p}.cores", f"a core is listed twice in {cores}")
    cache = r.mapping(v["cache"], f"{p}.cache", ("l1d", "l2"), ("l3",))
    capacity = v.get("capacity")
    return CpuCluster(
        name=r.string(v["name"], f"{p}.name"),
        cores=tuple(cores),
        microarch=r.string(v["microarch"], f"{p}.microarch"),
        max_freq_hz=r.qty(v["max_freq"], f"{p}.max_freq", "frequency"),
        features=frozenset(r.items(v["features"], f"{p}.features", r.string, nonempty=False)),
        peak_per_core=r.precisions(v["peak_per_core"], f"{p}.peak_per_core"),
        l1d_bytes=round(r.qty(cache["l1d"], f"{p}.cache.l1d", "size")),
        l2_bytes=round(r.qty(cache["l2"], f"{p}.cache.l2", "size")),
        l3_bytes=round(r.qty(cache.get("l3", "0 B"), f"{p}.cache.l3", "size", allow_zero=True)),
        capacity=None if capacity is None else r.integer(capacity, f"{p}.capacity", lo=1, hi=1024),
    )


def _gpu(r: _Reader, v: Any, p: str) -> Gpu:
    r.mapping(v, p, ("name", "api", "compute_units", "peak", "int8_dot", "unified_memory",
                     "launch_overhead", "transfer_overhead", "warp_width", "work_group_size"))
    api = r.string(v["api"], f"{p}.api")
    if api != "opencl":
        r.fail(f"{p}.api", f"expected 'opencl' (the only GPU API edgellm drives), got {api!r}")
    warp = r.integer(v["warp_width"], f"{p}.warp_width", hi=1024)
    wg = r.integer(v["work_group_size"], f"{p}.work_group_size", hi=4096)
    if wg % warp:
        r.fail(f"{p}.work_group_size", f"expected a multiple of warp_width ({warp}), got {wg}")
    return Gpu(
        name=r.string(v["name"], f"{p}.name"),
        api=api,
        compute_units=r.integer(v["compute_units"], f"{p}.compute_units", hi=4096),
        peak=r.precisions(v["peak"], f"{p}.peak"),
        int8_dot=r.boolean(v["int8_dot"], f"{p}.int8_dot"),
        unified_memory=r.boolean(v["unified_memory"], f"{p}.unified_memory"),
        **_overheads(r, v, p),
        warp_width=warp,
        work_group_size=wg,
    )


def _npu(r: _Reader, v: Any, p: str) -> Npu:
    r.mapping(v, p, ("name", "peak", "onnx_providers", "tflite_delegate", "static_shapes",
                     "chunk_buckets", "supported_ops", "launch_overhead", "transfer_overhead"))
    buckets = r.items(v["chunk_buckets"], f"{p}.chunk_buckets",
                      lambda x, q: r.integer(x, q, hi=1 << 20))
    if any(b <= a for a, b in zip(buckets, buckets[1:])):
        r.fail(f"{p}.chunk_buckets", f"expected strictly ascending token counts, got {buckets}")
    delegate = v["tflite_delegate"]
    return Npu(
        name=r.string(v["name"], f"{p}.name"),
        peak=r.precisions(v["peak"], f"{p}.peak"),
        onnx_providers=tuple(r.items(v["onnx_providers"], f"{p}.onnx_providers", r.string)),
        tflite_delegate=None if delegate is None else r.string(delegate, f"{p}.tflite_delegate"),
        static_shapes=r.boolean(v["static_shapes"], f"{p}.static_shapes"),
        chunk_buckets=tuple(buckets),
        supported_ops=frozenset(r.items(v["supported_ops"], f"{p}.supported_ops", _op_kind(r))),
        **_overheads(r, v, p),
    )


def _op_kind(r: _Reader) -> Callable[[Any, str], str]:
    # a typo ('matmull') left the NPU available and never placed, without a word
    def read(x: Any, q: str) -> str:
        kind = r.string(x, q)
        if kind not in OP_KINDS:
            r.fail(q, f"expected an op kind ({', '.join(sorted(OP_KINDS))}), got {kind!r}")
        return kind
    return read


def _overheads(r: _Reader, v: dict, p: str) -> dict[str, float]:
    # zero is allowed: a unified-memory unit may hand buffers over for (nearly) free
    return {f"{k}_s": r.qty(v[k], f"{p}.{k}", "time", allow_zero=True)
            for k in ("launch_overhead", "transfer_overhead")}


def _measured(r: _Reader, v: Any, clusters: tuple[CpuCluster, ...]) -> Measured:
    p = "measured"
    r.mapping(v, p, ("date", "tool", "memory_read_bandwidth", "clusters"), ("units", "others_cpu_share"))
    names = [c.name for c in clusters]
    per_cluster = r.mapping(v["clusters"], f"{p}.clusters", (), tuple(names))
    units = v.get("units", {})
    if units is None:
        units = {}
    if not isinstance(units, dict):   # (false, 0, '' and [] read as "no units" before)
        r.fail(f"{p}.units", f"expected a mapping of backend name to figures, got {_describe(units)}")
    return Measured(
        date=r.string(v["date"], f"{p}.date"),
        tool=r.string(v["tool"], f"{p}.tool"),
        memory_read_bandwidth=r.plausible(v["memory_read_bandwidth"], f"{p}.memory_read_bandwidth",
                                          "bandwidth"),
        # (not peaks: numpy's fp16 is emulated, 0.68 GFLOPS on the 2.6 GHz x86 host, and nothing
        # plans with these)
        clusters={n: r.precisions(f, f"{p}.clusters.{n}", peaks=False) for n, f in per_cluster.items()},
        units={_unit_name(r, n, f"{p}.units"): _unit(r, u, f"{p}.units.{n}", clusters) for n, u in units.items()},
        others_cpu_share=None if v.get("others_cpu_share") is None else _share(r, v["others_cpu_share"],
                                                                              f"{p}.others_cpu_share"),
    )


def _share(r: _Reader, v: Any, p: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 <= v <= 1.0:
        r.fail(p, f"expected a share of the CPUs from 0 to 1, got {_describe(v)}")
    return float(v)


def _unit_name(r: _Reader, n: Any, p: str) -> str:
    # a renamed entry ('neonn') was ignored: the unit fell back to nominal peaks
    name = r.string(n, p)
    if name not in UNIT_NAMES:
        r.fail(f"{p}.{name}", f"expected a unit name ({', '.join(UNIT_NAMES)})")
    return name


def _unit(r: _Reader, v: Any, p: str, clusters: tuple[CpuCluster, ...]) -> UnitMeasurement:
    r.mapping(v, p, ("threads", "call_overhead", "precision_flops", "gemm"),
              ("attention", "elementwise", "gemm_fp32act", "gemv", "gemv_fp32act"))
    # the threads a unit ran with ran on the profile's cores (`edgellm profile` uses one per big
    # core): more than it lists is a figure from elsewhere, and the cost model scales the unit's
    # figures by cores / threads (neon's by 2/64 on a 2-core host: every op went to reference)
    n_cores = sum(len(c.cores) for c in clusters)
    threads = r.integer(v["threads"], f"{p}.threads", hi=4096)
    if threads > n_cores:
        r.fail(f"{p}.threads", f"expected at most the {n_cores} core(s) cpu.clusters lists, got {threads}")

    def gemm(g: Any, q: str) -> GemmFigure:
        r.mapping(g, q, ("m", "k", "n", "flops"))
        return GemmFigure(*(r.integer(g[d], f"{q}.{d}", hi=1 << 30) for d in "mkn"),
                          flops=r.qty(g["flops"], f"{q}.flops", "compute"))

    def attention(a: Any, q: str) -> AttentionFigure:
        r.mapping(a, q, ("tokens", "context", "flops"))
        return AttentionFigure(tokens=r.integer(a["tokens"], f"{q}.tokens", lo=1, hi=1 << 30),
                               context=r.integer(a["context"], f"{q}.context", lo=0, hi=1 << 30),
                               flops=r.qty(a["flops"], f"{q}.flops", "compute"))

    def elementwise(e: Any, q: str) -> ElementwiseFigure:
        r.mapping(e, q, ("op", "tokens", "flops"))
        if not isinstance(e["op"], str) or e["op"] not in ELEMENTWISE_FLOPS:   # (a list: TypeError)
            r.fail(f"{q}.op", f"expected one of {', '.join(ELEMENTWISE_FLOPS)}, got {_describe(e['op'])}")
        return ElementwiseFigure(op=e["op"], tokens=r.integer(e["tokens"], f"{q}.tokens", lo=1, hi=1 << 30),
                                 flops=r.qty(e["flops"], f"{q}.flops", "compute"))

    def by_format(m: Any, q: str) -> dict[str, float]:   # {q4_1: 150 GFLOPS, ...}
        if m and not p.endswith(".neon"):
            # (the cost model reads them for neon only: under reference they repriced its decode)
            r.fail(q, "one-row figures by weight format are neon's (edgellm profile measures them there only)")
        if not isinstance(m, dict):
            r.fail(q, f"expected a mapping of weight format to rate such as {{q4_1: 150 GFLOPS}}, got {_describe(m)}")
        r.mapping(m, q, (), tuple(WEIGHT_BYTES))
        return {f: r.qty(x, f"{q}.{f}", "compute") for f, x in m.items()}

    return UnitMeasurement(
        precision_flops=r.precisions(v["precision_flops"], f"{p}.precision_flops"),
        gemm=_by_rows(r, tuple(r.items(v["gemm"], f"{p}.gemm", gemm, nonempty=False)), f"{p}.gemm"),
        call_overhead_s=r.qty(v["call_overhead"], f"{p}.call_overhead", "time", allow_zero=True),
        threads=threads,
        attention=tuple(r.items(v.get("attention", []), f"{p}.attention", attention, nonempty=False)),
        elementwise=tuple(r.items(v.get("elementwise", []), f"{p}.elementwise", elementwise, nonempty=False)),
        gemm_fp32act=_by_rows(r, tuple(r.items(v.get("gemm_fp32act", []), f"{p}.gemm_fp32act", gemm,
                                                nonempty=False)), f"{p}.gemm_fp32act"),
        gemv=by_format(v.get("gemv", {}), f"{p}.gemv"),
        gemv_fp32act=by_format(v.get("gemv_fp32act", {}), f"{p}.gemv_fp32act"),
    )


def _by_rows(r: _Reader, figures: tuple, p: str) -> tuple:
    """A curve by rows: one figure per row count (two for 1 row priced 1 row at the first and
    2..255 rows from the second)."""
    rows = [g.m for g in figures]
    if len(set(rows)) != len(rows):
        r.fail(p, f"expected one figure per row count m, found m {sorted(m for m in set(rows) if rows.count(m) > 1)} "
                  f"more than once")
    return figures


# -- finding -----------------------------------------------------------------------------------

# (bounded: a 300-character name made the lookup's stat fail with ENAMETOOLONG, untyped)
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def shipped_profiles_dir() -> Path:
    """The profiles that ship with edgellm: inside the installed package (wheel), else the
    device_profiles/ folder of a source checkout (editable install)."""
    here = Path(__file__).resolve().parent.parent
    packaged = here / "device_profiles"
    return packaged if packaged.is_dir() else here.parent / "device_profiles"


def user_profiles_dir() -> Path:
    """$EDGELLM_HOME/profiles: user profiles, and `host` as written by `edgellm profile`."""
    from edgellm.model.registry import edgellm_home

    return edgellm_home() / "profiles"


def list_profiles() -> list[str]:
    """Names load_profile accepts: shipped and user profiles (a user profile shadows a shipped one)."""
    names: set[str] = set()
    for d in (user_profiles_dir(), shipped_profiles_dir()):
        if d.is_dir():
            names.update(f.stem for f in d.glob("*.yaml") if _NAME.fullmatch(f.stem))
    return sorted(names)


def _resolve(name: str) -> Path:
    if _NAME.fullmatch(name):
        for d in (user_profiles_dir(), shipped_profiles_dir()):
            if (d / f"{name}.yaml").is_file():
                return d / f"{name}.yaml"
    hint = ("; run `edgellm profile` to measure this machine" if name == "host" else "")
    raise ConfigError(f"unknown device profile {name!r}{hint}; available: "
                      f"{', '.join(list_profiles()) or '(none)'}, or a path to a .yaml file")


def load_profile(name_or_path: str | os.PathLike) -> DeviceProfile:
    """A profile by name ($EDGELLM_HOME/profiles first, then the shipped ones) or by path."""
    if not isinstance(name_or_path, (str, os.PathLike)):
        raise ConfigError(f"device: expected a profile name or a path, found {type(name_or_path).__name__}")
    s = os.fspath(name_or_path)
    if not isinstance(s, str):   # a PathLike of bytes
        raise ConfigError(f"device: expected a profile name or a path as text, found {type(s).__name__}")
    is_path = (isinstance(name_or_path, os.PathLike) or s.lower().endswith((".yaml", ".yml"))
               or os.sep in s or "/" in s)
    path = Path(s).expanduser() if is_path else _resolve(s)
    try:
        st = path.stat()
        if not path.is_file():
            raise ConfigError(f"{path}: not a regular file")
        if st.st_size > MAX_PROFILE_BYTES:
            raise ConfigError(f"{path}: {st.st_size} bytes; a device profile is at most "
                              f"{MAX_PROFILE_BYTES} bytes")
        with open(path, "rb") as f:
            data = f.read(MAX_PROFILE_BYTES + 1)  # the file may grow between stat and read
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such device profile file") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror or e}") from None
    except ValueError as e:   # (a NUL byte, a lone surrogate: no path the system can open)
        raise ConfigError(f"device: {s!r} is not a usable path ({e})") from None
    if len(data) > MAX_PROFILE_BYTES:
        raise ConfigError(f"{path}: a device profile is at most {MAX_PROFILE_BYTES} bytes")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text (byte {e.start})") from None
    return _profile_from_text(text, path.stem, str(path))


# -- writing -----------------------------------------------------------------------------------


def _rates(peaks: dict[str, float]) -> dict[str, str]:
    return {p: format_quantity(v, "compute", ops=p.startswith("int")) for p, v in peaks.items()}


def _overheads_text(u: Gpu | Npu) -> dict[str, str]:
    return {"launch_overhead": format_quantity(u.launch_overhead_s, "time"),
            "transfer_overhead": format_quantity(u.transfer_overhead_s, "time")}


def _to_dict(p: DeviceProfile) -> dict:
    q = format_quantity
    d: dict[str, Any] = {
        "schema": SCHEMA_VERSION,
        "soc": p.soc,
        "memory": {"total": q(p.memory_total_bytes, "size"),
                   "bandwidth": q(p.memory_bandwidth, "bandwidth")},
        "cpu": {"clusters": []},
    }
    for c in p.clusters:
        cd = {"name": c.name, "cores": list(c.cores), "microarch": c.microarch,
              "max_freq": q(c.max_freq_hz, "frequency"), "features": sorted(c.features),
              "peak_per_core": _rates(c.peak_per_core),
              "cache": {"l1d": q(c.l1d_bytes, "size"), "l2": q(c.l2_bytes, "size"),
                        "l3": q(c.l3_bytes, "size")}}
        if c.capacity is not None:
            cd["capacity"] = c.capacity
        d["cpu"]["clusters"].append(cd)
    g = p.gpu
    d["gpu"] = None if g is None else {
        "name": g.name, "api": g.api, "compute_units": g.compute_units, "peak": _rates(g.peak),
        "int8_dot": g.int8_dot, "unified_memory": g.unified_memory,
        **_overheads_text(g), "warp_width": g.warp_width, "work_group_size": g.work_group_size}
    n = p.npu
    d["npu"] = None if n is None else {
        "name": n.name, "peak": _rates(n.peak), "onnx_providers": list(n.onnx_providers),
        "tflite_delegate": n.tflite_delegate, "static_shapes": n.static_shapes,
        "chunk_buckets": list(n.chunk_buckets), "supported_ops": sorted(n.supported_ops),
        **_overheads_text(n)}
    m = p.measured
    if m is not None:
        d["measured"] = {
            "date": m.date, "tool": m.tool,
            "memory_read_bandwidth": q(m.memory_read_bandwidth, "bandwidth"),
            "clusters": {name: _rates(f) for name, f in m.clusters.items()},
            "units": {name: {"threads": u.threads, "call_overhead": q(u.call_overhead_s, "time"),
                             "precision_flops": _rates(u.precision_flops),
                             "gemm": [{"m": g.m, "k": g.k, "n": g.n, "flops": q(g.flops, "compute")}
                                      for g in u.gemm],
                             **({"attention": [{"tokens": a.tokens, "context": a.context,
                                                "flops": q(a.flops, "compute")} for a in u.attention]}
                                if u.attention else {}),
                             **({"elementwise": [{"op": e.op, "tokens": e.tokens, "flops": q(e.flops, "compute")}
                                                 for e in u.elementwise]} if u.elementwise else {}),
                             **({"gemm_fp32act": [{"m": g.m, "k": g.k, "n": g.n, "flops": q(g.flops, "compute")}
                                                  for g in u.gemm_fp32act]} if u.gemm_fp32act else {}),
                             **{key: {f: q(x, "compute") for f, x in rates.items()}
                                for key, rates in (("gemv", u.gemv), ("gemv_fp32act", u.gemv_fp32act)) if rates}}
                      for name, u in m.units.items()},
            **({"others_cpu_share": m.others_cpu_share} if m.others_cpu_share is not None else {}),
        }
    return d


def dump_profile(profile: DeviceProfile) -> str:
    """YAML text of `profile`, every figure with its unit; load_profile reads it back equal
    (to 6 significant digits)."""
    body = yaml.safe_dump(_to_dict(profile), sort_keys=False, default_flow_style=None,
                          allow_unicode=True, width=100)
    return f"# edgellm device profile '{profile.name}' (schema: device_profiles/README.md){_ENDS}\n{body}{_END}\n"


def write_profile(profile: DeviceProfile, path: str | os.PathLike) -> Path:
    """Write dump_profile(profile) to `path` atomically (temp file in the same folder, fsync,
    rename), after checking that the text reads back. Returns the path."""
    path = Path(path).expanduser()
    text = dump_profile(profile)
    _profile_from_text(text, path.stem, str(path))  # never leave a file load_profile rejects
    # a user's file, read by other tools and users (mode 0644 less the umask); write_atomic's
    # default 0600 is for caches
    write_atomic(path, text.encode("utf-8"), mode=0o644)
    return path

