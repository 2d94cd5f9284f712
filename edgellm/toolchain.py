"""Cross-compiling the NEON kernel library for a device: the `edgellm build` command and
tools/cross_build.py call build_bundle().

A bundle is a folder to copy onto the phone or board:

    libedgellm_neon_base.so      Armv8.0 NEON (any 64-bit Arm core)
    libedgellm_neon_dotprod.so   + SDOT/UDOT and fp16 arithmetic (Armv8.2+: Cortex-A55/A75 and later)
    selftest_base, selftest_dotprod   static executables: the same sources plus neon/selftest.c
    selftest_cases.bin           the kernel conformance cases (write_cases), expected outputs from
                                 edgellm/backends/reference.py
    bundle.json                  target, cpu, compiler, flags and features per variant, source hash

On the device: `./selftest_dotprod selftest_cases.bin` prints PASS/FAIL per case and exits 0 iff
all pass; then point EDGELLM_NEON_LIB at the library the self-test vouched for.

Compilers, by target: aarch64-linux-gnu uses aarch64-linux-gnu-gcc when it is on PATH, else zig
(`pip install ziglang`); aarch64-linux-android[API] uses the NDK's clang from $ANDROID_NDK_HOME.
"""
from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import platform
import re
import shutil
import struct
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Mapping, Sequence

import numpy as np

from .errors import EdgeLLMError

TARGETS = ("aarch64-linux-gnu", "aarch64-linux-android")
VARIANTS = ("base", "dotprod")
DEFAULT_ANDROID_API = 28      # Android 9: the oldest release with Armv8.2 phones in numbers
# The ISA per variant; the same as setup.py and tools/build_neon.py (tests compare them).
ARM_FLAGS = {"base": ["-march=armv8-a"], "dotprod": ["-march=armv8.2-a+dotprod+fp16"]}
# zig cc reads -march as a CPU name and spells CPUs and features its own way (cortex_a78, fullfp16)
ZIG_FLAGS = {"base": ["-mcpu=generic"], "dotprod": ["-mcpu=generic+v8_2a+dotprod+fullfp16"]}
COMMON_FLAGS = ["-O3", "-std=gnu11", "-fvisibility=hidden", "-pthread"]
# predefined macro -> feature name recorded in bundle.json
FEATURE_MACROS = {"__ARM_NEON": "neon", "__ARM_FEATURE_DOTPROD": "dotprod",
                  "__ARM_FEATURE_FP16_VECTOR_ARITHMETIC": "fp16"}
CPU_EXAMPLES = "cortex-a55, cortex-a76 (Raspberry Pi 5), cortex-a78, cortex-x1, cortex-a72 (Raspberry Pi 4)"
LIB_NAME = "libedgellm_neon_{}.so"
SELFTEST_NAME = "selftest_{}"
CASES_NAME = "selftest_cases.bin"


class ToolchainError(EdgeLLMError):
    """No usable compiler for the target, or a bad target/cpu; the message says what to install."""


class BuildError(ToolchainError):
    """The compiler ran and failed; carries its command and output."""

    def __init__(self, what: str, cmd: Sequence[str], output: str):
        self.cmd = list(cmd)
        self.output = output
        tail = "\n".join(output.strip().splitlines()[-30:])
        super().__init__(f"{what} failed: {' '.join(self.cmd)}\n{tail}")


# ---- sources ---------------------------------------------------------------------------------

def neon_source_dir() -> Path:
    """neon/ of a source checkout, else the copy installed as package data (edgellm/neon_src)."""
    here = Path(__file__).resolve().parent
    for d in (here.parent / "neon", here / "neon_src"):
        if (d / "edgellm_neon.h").is_file():
            return d
    raise ToolchainError(f"the NEON sources are missing: neither {here.parent / 'neon'} nor {here / 'neon_src'} "
                         "holds edgellm_neon.h (reinstall edgellm)")


def source_files(src_dir: Path) -> list[Path]:
    """neon/*.c and *.h, sorted by name (selftest.c included)."""
    return sorted([*src_dir.glob("*.c"), *src_dir.glob("*.h")], key=lambda p: p.name)


def library_sources(src_dir: Path) -> list[Path]:
    return [p for p in sorted(src_dir.glob("*.c")) if p.name != "selftest.c"]


def source_hash(src_dir: Path) -> str:
    """sha256 over (name, contents) of neon/*.c, *.h in name order: a rename changes it too."""
    h = hashlib.sha256()
    for p in source_files(src_dir):
        data = p.read_bytes()
        h.update(f"{p.name}\0{len(data)}\0".encode())
        h.update(data)
    return h.hexdigest()


# ---- compilers -------------------------------------------------------------------------------

@dataclass(frozen=True)
class Toolchain:
    target: str                 # "aarch64-linux-gnu" or "aarch64-linux-android"
    kind: str                   # "gcc", "zig" or "ndk-clang"
    cc: tuple[str, ...]         # command prefix compiling C for the target (shared libraries)
    exe_cc: tuple[str, ...]     # command prefix for the static self-test executables
    path: str                   # the compiler's executable
    api: int | None = None      # Android API level (android only)

    def version(self) -> str:
        """First line of `cc --version` (zig: "zig 0.13.0 (clang version ...)")."""
        def first_line(cmd: Sequence[str]) -> str:
            try:
                r = subprocess.run(list(cmd), capture_output=True, text=True, timeout=60)
            except (OSError, subprocess.TimeoutExpired) as e:
                raise ToolchainError(f"cannot run {self.path}: {e}") from None
            lines = (r.stdout or r.stderr).strip().splitlines()
            return lines[0] if lines else "unknown"

        cc = first_line([*self.cc, "--version"])
        if self.kind == "zig":
            return f"zig {first_line([sys.executable, '-m', 'ziglang', 'version'])} ({cc})"
        return cc


def _zig_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("ziglang") is not None


def _ndk_host_tag() -> str:
    system = platform.system()
    # the NDK ships x86_64 host tools only (macOS: universal binaries under darwin-x86_64)
    return {"Linux": "linux-x86_64", "Darwin": "darwin-x86_64", "Windows": "windows-x86_64"}.get(system, system.lower())


def parse_target(target: str) -> tuple[str, int | None]:
    """("aarch64-linux-android", api) for "aarch64-linux-android[API]"; (target, None) otherwise."""
    m = re.fullmatch(r"aarch64-linux-android(\d*)", target)
    if m:
        return "aarch64-linux-android", int(m.group(1)) if m.group(1) else None
    if target in TARGETS:
        return target, None
    raise ToolchainError(f"unknown target {target!r}; known: aarch64-linux-gnu, aarch64-linux-android[API] "
                         f"(API level suffix optional, default {DEFAULT_ANDROID_API})")


def find_toolchain(target: str = "aarch64-linux-gnu", api: int | None = None,
                   env: Mapping[str, str] | None = None) -> Toolchain:
    """The compiler for `target`, looked up in env (default os.environ: PATH, ANDROID_NDK_HOME)."""
    env = os.environ if env is None else env
    target, t_api = parse_target(target)
    if target == "aarch64-linux-gnu":
        gcc = shutil.which("aarch64-linux-gnu-gcc", path=env.get("PATH", ""))
        if gcc:
            return Toolchain(target, "gcc", (gcc,), (gcc,), gcc)
        if _zig_available():
            import ziglang

            zig = str(Path(ziglang.__file__).parent / ("zig.exe" if os.name == "nt" else "zig"))
            zcc = (sys.executable, "-m", "ziglang", "cc")
            # glibc cannot be linked statically: the self-test executable targets musl instead
            return Toolchain(target, "zig", (*zcc, "-target", "aarch64-linux-gnu"),
                             (*zcc, "-target", "aarch64-linux-musl"), zig)
        raise ToolchainError(
            "no C compiler for aarch64-linux-gnu: aarch64-linux-gnu-gcc is not on PATH and the ziglang "
            "package is not installed. Install one: `sudo apt-get install gcc-aarch64-linux-gnu` "
            "(Debian/Ubuntu; Fedora: gcc-aarch64-linux-gnu) or `pip install ziglang`")
    api = api or t_api or DEFAULT_ANDROID_API
    ndk = env.get("ANDROID_NDK_HOME") or env.get("ANDROID_NDK_ROOT")
    hint = ("install the Android NDK (Android Studio's SDK Manager, `sdkmanager \"ndk;27.2.12479018\"`, or "
            "https://developer.android.com/ndk/downloads) and set ANDROID_NDK_HOME to its folder")
    if not ndk:
        raise ToolchainError(f"target aarch64-linux-android needs the Android NDK: ANDROID_NDK_HOME is not set; {hint}")
    bindir = Path(ndk) / "toolchains" / "llvm" / "prebuilt" / _ndk_host_tag() / "bin"
    if not bindir.is_dir():
        raise ToolchainError(f"ANDROID_NDK_HOME={ndk} is not an NDK (r19 or later): {bindir} does not exist; {hint}")
    clang = bindir / f"aarch64-linux-android{api}-clang{'.cmd' if os.name == 'nt' else ''}"
    if not clang.is_file():
        have = sorted(int(m.group(1)) for p in bindir.glob("aarch64-linux-android*-clang")
                      if (m := re.fullmatch(r"aarch64-linux-android(\d+)-clang", p.name)))
        raise ToolchainError(f"the NDK at {ndk} has no compiler for Android API {api} ({clang.name}); "
                             f"API levels it has: {', '.join(map(str, have)) or 'none'}")
    return Toolchain(target, "ndk-clang", (str(clang),), (str(clang),), str(clang), api)


def variant_flags(variant: str, cpu: str | None = None, kind: str = "gcc") -> list[str]:
    """The ISA flags of a variant for a compiler kind. With a cpu, the dotprod variant is built for
    that core (-mcpu=NAME+dotprod+fp16) while base keeps the Armv8.0 ISA and only tunes for it: the
    loader picks base exactly on cores without dotprod, so base must never carry an Armv8.2
    instruction (zig cannot tune without selecting the core's features: its base stays generic)."""
    if variant not in VARIANTS:
        raise ToolchainError(f"unknown variant {variant!r}; known: {', '.join(VARIANTS)}")
    if cpu is not None and not re.fullmatch(r"[a-z0-9][a-z0-9.\-]*", cpu):
        raise ToolchainError(f"--cpu {cpu!r} is not a CPU name (lower-case letters, digits, '-', '.'; "
                             f"e.g. {CPU_EXAMPLES})")
    if kind == "zig":
        if cpu is None or variant == "base":
            return list(ZIG_FLAGS[variant])
        return [f"-mcpu={cpu.replace('-', '_')}+dotprod+fullfp16"]
    if cpu is None:
        return list(ARM_FLAGS[variant])
    return ["-march=armv8-a", f"-mtune={cpu}"] if variant == "base" else [f"-mcpu={cpu}+dotprod+fp16"]


def compile_flags(variant: str, src_dir: Path, cpu: str | None = None, kind: str = "gcc") -> list[str]:
    return [*COMMON_FLAGS, f"-DEL_VARIANT={variant}", f"-I{src_dir}", *variant_flags(variant, cpu, kind)]


def probe_features(tc: Toolchain, flags: Sequence[str]) -> list[str]:
    """Features the flags enable, read from the compiler's predefined macros. Also where a bad
    --cpu is rejected, with the compiler's own message."""
    cmd = [*tc.cc, *flags, "-dM", "-E", "-x", "c", os.devnull]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ToolchainError(f"cannot run {tc.path}: {e}") from None
    if r.returncode != 0:
        raise ToolchainError(f"{tc.path} rejects the flags {' '.join(flags)} (a CPU name it does not know? "
                             f"e.g. {CPU_EXAMPLES}):\n{r.stderr.strip()}")
    defined = {line.split()[1] for line in r.stdout.splitlines() if line.startswith("#define ")}
    return [name for macro, name in FEATURE_MACROS.items() if macro in defined]


# ---- self-test cases (the file neon/selftest.c reads; format documented there) ---------------

OP_MATMUL, OP_RMSNORM, OP_ROPE, OP_SWIGLU, OP_SOFTMAX, OP_ADD, OP_ATTN_DENSE, OP_ATTN_POOL = range(1, 9)
CASES_MAGIC, CASES_VERSION = b"ELSTCASE", 1
KIND_F32, KIND_RAW = 1, 2
BOUND_ELEMENTWISE = 1e-7     # NMSE bounds of DESIGN.md's correctness discipline
BOUND_MATMUL = 5e-4
BOUND_ATTENTION = 5e-4
EL_F32, EL_F16, EL_Q4_0, EL_Q4_1, EL_Q8_0 = 0, 1, 2, 3, 8


@dataclass(frozen=True)
class Case:
    op: int                         # OP_*
    name: str                       # printable, no spaces; unique in a file
    bound: float                    # NMSE bound
    ints: tuple[int, ...]           # shape parameters, per op (neon/selftest.c's header)
    floats: tuple[float, ...]       # eps for rmsnorm, else empty
    arrays: tuple[np.ndarray, ...]  # float32 arrays are stored as f32, anything else as raw bytes; last = expected


def encode_case(c: Case) -> bytes:
    name = c.name.encode("ascii")
    parts = [struct.pack("<II", c.op, len(name)), name, struct.pack("<f", c.bound),
             struct.pack(f"<I{len(c.ints)}i", len(c.ints), *c.ints),
             struct.pack(f"<I{len(c.floats)}f", len(c.floats), *c.floats), struct.pack("<I", len(c.arrays))]
    for a in c.arrays:
        a = np.ascontiguousarray(a)
        if a.dtype == np.float32:
            parts += [struct.pack("<IIQ", KIND_F32, 0, a.size), a.astype("<f4").tobytes()]
        else:
            raw = a.view(np.uint8).reshape(-1)
            parts += [struct.pack("<IIQ", KIND_RAW, 0, raw.size), raw.tobytes()]
    return b"".join(parts)


def encode_cases(cases: Sequence[Case]) -> bytes:
    names = [c.name for c in cases]
    if len(set(names)) != len(names):
        raise ValueError("duplicate case names")
    return b"".join([CASES_MAGIC, struct.pack("<II", CASES_VERSION, len(cases)), *map(encode_case, cases)])


def _f32(a) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32)


def _matmul_cases(rng: np.random.Generator) -> list[Case]:
    from gguf import GGMLQuantizationType as G

    from . import quant
    from .backends import reference

    types = {"q4_0": (EL_Q4_0, G.Q4_0), "q4_1": (EL_Q4_1, G.Q4_1), "q8_0": (EL_Q8_0, G.Q8_0),
             "f32": (EL_F32, G.F32), "f16": (EL_F16, G.F16)}
    cases = []

    def one(tname: str, M: int, K: int, segs: Sequence[int], bias: bool, scratch: bool, zero_row: bool = False,
            suffix: str = "") -> Case:
        el, g = types[tname]
        N = sum(segs)
        # rows of different magnitude (per-block scales differ) and one all-zero block (d = 0)
        w = rng.standard_normal((N, K)).astype(np.float32) / np.sqrt(K)
        w *= np.exp(rng.normal(0.0, 0.5, N)).astype(np.float32)[:, None]
        w[0, : min(K, 32)] = 0.0
        x = rng.standard_normal((M, K)).astype(np.float32)
        if K > 32:
            # an outlier channel, as LLM activations have; it coarsens its block's int8 scale, so
            # not where the block is the whole row (the bound would then test the int8 step size)
            x[:, rng.integers(K)] *= 8.0
        if zero_row:
            x[1] = 0.0                                # a padded row: its int8 scale is 0
        raws, deqs = [], []
        for s0, s1 in zip(np.cumsum([0, *segs[:-1]]), np.cumsum(segs)):
            raw = quant.quantize(w[s0:s1], g)
            raws.append(np.ascontiguousarray(raw))
            deqs.append(quant.dequantize(raw.reshape(-1), g, (s1 - s0, K)))
        b = _f32(rng.standard_normal(N)) if bias else None
        want = reference.matmul(x, np.concatenate(deqs), b)
        name = f"matmul/{tname}/m{M}_k{K}_n{N}{suffix}" + ("_bias" if bias else "") + ("_scratch" if scratch else "") \
            + ("_zrow" if zero_row else "")
        return Case(OP_MATMUL, name, BOUND_MATMUL, (el, M, K, len(segs), int(bias), int(scratch), *segs), (),
                    (x, *raws, *([b] if bias else []), _f32(want)))

    for tname in types:
        i = 0
        # every (M, K, N) tail combination except the large K = 576, N = 960 cell, which the fused
        # QKV cases below cover (keeps the file small enough to push to a phone)
        for M in (1, 3, 17):
            for K, N in ((32, 7), (32, 33), (32, 960), (576, 7), (576, 33)):
                cases.append(one(tname, M, K, [N], bias=i % 2 == 1, scratch=i % 3 == 0, zero_row=M > 1 and N == 33))
                i += 1
        # fused projections: Q, K, V kept as separate tensors (SmolLM2-135M's 576/192/192; a third
        # of that for the plain float types, whose weights are 2-8x larger)
        qkv = [576, 192, 192] if tname not in ("f32", "f16") else [192, 64, 64]
        cases.append(one(tname, 1, 576, qkv, True, False, suffix="_qkv"))
        cases.append(one(tname, 3, 576, qkv, True, True, suffix="_qkv"))
        cases.append(one(tname, 17, 576, qkv, False, True, suffix="_qkv"))
        cases.append(one(tname, 3, 96, [7, 1, 25], True, False, suffix="_segs3"))
        if tname in ("f32", "f16"):          # no block structure: K need not be a multiple of 32
            cases.append(one(tname, 3, 45, [7], True, False))
            cases.append(one(tname, 1, 5, [33], False, True))
    return cases


def _elementwise_cases(rng: np.random.Generator) -> list[Case]:
    from .backends import reference

    cases = []
    for T, d, eps in ((1, 576, 1e-5), (3, 7, 1e-6), (17, 960, 1e-5), (2, 33, 1e-6), (4, 1, 1e-5)):
        x = _f32(rng.standard_normal((T, d)))
        x[0] *= 1e3
        if T > 2:
            x[2] = 0.0                               # only eps keeps 1/rms finite
        w = _f32(rng.standard_normal(d))
        cases.append(Case(OP_RMSNORM, f"rmsnorm/t{T}_d{d}", BOUND_ELEMENTWISE, (T, d), (eps,),
                          (x, w, _f32(reference.rmsnorm(x, w, eps)))))
    for neox in (0, 1):
        style = "neox" if neox else "norm"
        for T, heads, hd, rd, inplace in ((1, 9, 64, 64, 0), (5, 3, 64, 32, 0), (17, 2, 128, 128, 1),
                                          (3, 1, 6, 4, 0), (2, 4, 80, 64, 1)):
            x = _f32(rng.standard_normal((T, heads, hd)))
            pos = rng.integers(0, 4096) + np.arange(T)
            ang = pos[:, None].astype(np.float64) * 10000.0 ** (-np.arange(0, rd, 2) / rd)[None, :]
            cos, sin = _f32(np.cos(ang)), _f32(np.sin(ang))
            cases.append(Case(OP_ROPE, f"rope/{style}/t{T}_h{heads}_hd{hd}_rd{rd}" + ("_inplace" if inplace else ""),
                              BOUND_ELEMENTWISE, (T, heads, hd, rd, neox, inplace), (),
                              (x, cos, sin, _f32(reference.rope(x, cos, sin, style)))))
    for T, ff, scale in ((1, 1536, 1.0), (3, 7, 1.0), (17, 33, 3.0), (2, 64, 90.0)):
        gu = _f32(rng.standard_normal((T, 2 * ff)) * scale)   # scale 90: exp(-g) overflows fp32
        with np.errstate(over="ignore"):
            want = reference.swiglu(gu.copy())
        cases.append(Case(OP_SWIGLU, f"swiglu/t{T}_ff{ff}" + ("_large" if scale > 10 else ""), BOUND_ELEMENTWISE,
                          (T, ff), (), (gu, _f32(want))))
    for rows, n, scale, masked in ((1, 49152, 5.0, False), (3, 7, 1.0, False), (17, 33, 50.0, False),
                                   (2, 1, 1.0, False), (4, 100, 10.0, True)):
        x = _f32(rng.standard_normal((rows, n)) * scale)
        if masked:
            x[:, ::3] = -np.inf                     # masked logits (banned tokens): probability 0
        # reference.py has no softmax (the model never needs one outside attention): float64 here
        x64 = x.astype(np.float64)
        e = np.exp(x64 - x64.max(axis=1, keepdims=True))
        cases.append(Case(OP_SOFTMAX, f"softmax/r{rows}_n{n}" + ("_masked" if masked else ""), BOUND_ELEMENTWISE,
                          (rows, n), (), (x, _f32(e / e.sum(axis=1, keepdims=True)))))
    for n in (1, 7, 33, 16323):
        a, b = _f32(rng.standard_normal(n)), _f32(rng.standard_normal(n))
        cases.append(Case(OP_ADD, f"add/n{n}", BOUND_ELEMENTWISE, (n,), (), (a, b, _f32(reference.add(a, b)))))
    return cases


def _attention_cases(rng: np.random.Generator) -> list[Case]:
    from .backends import reference

    cases = []
    # (T, H, KVH, hd, start): decode, prefill from 0, a chunk after a cached prefix, one head
    for T, H, KVH, hd, start in ((1, 9, 3, 64, 40), (7, 9, 3, 64, 0), (5, 4, 4, 32, 11), (1, 1, 1, 64, 0),
                                 (17, 2, 1, 128, 30), (3, 6, 2, 80, 5), (33, 4, 2, 64, 100)):
        n = start + T
        q = _f32(rng.standard_normal((T, H, hd)) * 2.0)
        k = _f32(rng.standard_normal((KVH, n, hd)))
        v = _f32(rng.standard_normal((KVH, n, hd)))
        cases.append(Case(OP_ATTN_DENSE, f"attn_dense/t{T}_h{H}_kvh{KVH}_hd{hd}_s{start}", BOUND_ATTENTION,
                          (T, H, KVH, hd, start), (), (q, k, v, _f32(reference.attention(q, k, v, start)))))
    # (T, H, KVH, hd, start, block_tokens, n_layers, layer)
    for kv_type, dt in ((EL_F16, np.float16), (EL_F32, np.float32)):
        kvname = "f16" if kv_type == EL_F16 else "f32"
        for T, H, KVH, hd, start, bt, L, layer in ((1, 9, 3, 64, 45, 16, 3, 2), (7, 9, 3, 64, 20, 16, 3, 0),
                                                   (1, 1, 1, 64, 0, 16, 2, 1), (17, 4, 2, 128, 31, 8, 2, 1),
                                                   (3, 2, 2, 32, 4, 1, 1, 0)):
            n = start + T
            need = -(-n // bt)
            n_blocks = need + 3
            table = rng.permutation(n_blocks)[: need + (1 if T > 1 else 0)].astype(np.int32)
            # (blocks, layers, block_tokens, KVH, hd); NaN wherever the kernel must not read: other
            # layers, other blocks, positions >= n (the real pool leaves them uninitialised)
            shape = (n_blocks, L, bt, KVH, hd)
            karena, varena = np.full(shape, np.nan, dtype=dt), np.full(shape, np.nan, dtype=dt)
            k = rng.standard_normal((n, KVH, hd)).astype(dt)
            v = rng.standard_normal((n, KVH, hd)).astype(dt)
            for p in range(n):
                karena[table[p // bt], layer, p % bt] = k[p]
                varena[table[p // bt], layer, p % bt] = v[p]
            q = _f32(rng.standard_normal((T, H, hd)) * 2.0)
            want = reference.attention(q, _f32(k.transpose(1, 0, 2)), _f32(v.transpose(1, 0, 2)), start)
            name = f"attn_pool/{kvname}/t{T}_h{H}_kvh{KVH}_hd{hd}_s{start}_bt{bt}_l{layer}of{L}"
            ints = (T, H, KVH, hd, start, kv_type, bt, L, layer, n_blocks)
            cases.append(Case(OP_ATTN_POOL, name, BOUND_ATTENTION, ints, (),
                              (q, karena.view(np.uint8), varena.view(np.uint8), table, _f32(want))))
    return cases


def make_cases(seed: int = 20240531) -> list[Case]:
    """Every kernel, awkward shapes included (tails of 1, 7, 33; M = 1, 3, 17; GQA 9:3; fused
    segments; shuffled KV blocks), with expected outputs from the numpy reference."""
    rng = np.random.default_rng(seed)
    return [*_matmul_cases(rng), *_elementwise_cases(rng), *_attention_cases(rng)]


def write_cases(path: str | os.PathLike, seed: int = 20240531) -> int:
    """Write the self-test cases file; returns the number of cases."""
    cases = make_cases(seed)
    data = encode_cases(cases)
    tmp = Path(f"{path}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
    return len(cases)


# ---- the bundle ------------------------------------------------------------------------------

def _run(what: str, cmd: Sequence[str]) -> None:
    try:
        r = subprocess.run(list(cmd), capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise BuildError(what, cmd, str(e)) from None
    if r.returncode != 0:
        raise BuildError(what, cmd, r.stdout + r.stderr)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _edgellm_version() -> str:
    from . import __version__

    return __version__


def build_bundle(target: str = "aarch64-linux-gnu", cpu: str | None = None, out: str | os.PathLike | None = None,
                 variants: Iterable[str] = VARIANTS, api: int | None = None,
                 progress: Callable[[str], None] | None = print, src_dir: str | os.PathLike | None = None,
                 env: Mapping[str, str] | None = None, seed: int = 20240531) -> Path:
    """Cross-compile the libraries and self-tests for `target` into `out` (default
    ./edgellm-bundle-<target>) and return it. The bundle is built in a temporary folder beside
    `out` and moved into place only when complete; an existing `out` is replaced only if it is a
    bundle (holds bundle.json) or empty. Raises ToolchainError (no compiler, bad target or cpu)
    or BuildError (the compiler failed, with its output)."""
    say = progress or (lambda _msg: None)
    variants = list(dict.fromkeys(variants))
    if not variants or any(v not in VARIANTS for v in variants):
        raise ToolchainError(f"variants must be a non-empty subset of {', '.join(VARIANTS)}; got {variants}")
    tc = find_toolchain(target, api, env)
    src = Path(src_dir) if src_dir is not None else neon_source_dir()
    if not (src / "selftest.c").is_file() or not library_sources(src):
        raise ToolchainError(f"{src} lacks the library sources or selftest.c")
    name = tc.target + (str(tc.api) if tc.api and tc.target.endswith("android") else "")
    out = Path(out) if out is not None else Path.cwd() / f"edgellm-bundle-{name}"
    if out.exists() and not (out.is_dir() and ((out / "bundle.json").is_file() or not any(out.iterdir()))):
        raise ToolchainError(f"{out} exists and is not an edgellm bundle (no bundle.json): choose another --out")
    out.parent.mkdir(parents=True, exist_ok=True)

    version = tc.version()
    say(f"compiler: {tc.path} ({version})")
    lib_srcs = [str(p) for p in library_sources(src)]
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        meta_variants = {}
        jobs = []          # (what, command), run concurrently: each is one compiler process
        for v in variants:
            flags = compile_flags(v, src, cpu, tc.kind)
            features = probe_features(tc, flags)
            # the loader relies on these: base runs on any Armv8.0 core, dotprod has what its name says
            if v == "base" and ({"dotprod", "fp16"} & set(features)):
                raise ToolchainError(f"the base variant's flags enable {features}; it must stay Armv8.0")
            if v == "dotprod" and not {"dotprod", "fp16"} <= set(features):
                raise ToolchainError(f"{tc.path} ignored the dotprod variant's flags {flags}: features {features}")
            lib, exe = LIB_NAME.format(v), SELFTEST_NAME.format(v)
            isa = " ".join(variant_flags(v, cpu, tc.kind))
            jobs.append((f"{lib} ({isa})",
                         [*tc.cc, *flags, "-shared", "-fPIC", "-o", str(tmp / lib), *lib_srcs, "-lm"]))
            jobs.append((f"{exe} ({isa}, static)", [*tc.exe_cc, *flags, "-static", "-o", str(tmp / exe), *lib_srcs,
                                                    str(src / "selftest.c"), "-lm"]))
            meta_variants[v] = {"flags": [f for f in flags if not f.startswith("-I")], "features": features,
                                "library": lib, "selftest": exe}
        for what, _ in jobs:
            say(f"compiling {what} ...")
        with ThreadPoolExecutor(max_workers=max(1, min(len(jobs), os.cpu_count() or 1))) as pool:
            futures = [pool.submit(_run, f"compiling {what}", cmd) for what, cmd in jobs]
            say(f"writing {CASES_NAME} ...")
            n_cases = write_cases(tmp / CASES_NAME, seed)      # numpy, while the compilers run
            for f in futures:
                f.result()           # the first failure, in job order, with the compiler's output
        meta = {
            "format": 1,
            "target": tc.target,
            "api": tc.api,
            "cpu": cpu,
            "variants": meta_variants,
            "compiler": {"kind": tc.kind, "path": tc.path, "command": list(tc.cc), "version": version},
            "source_sha256": source_hash(src),
            "sources": [p.name for p in source_files(src)],
            "selftest_cases": {"file": CASES_NAME, "count": n_cases, "seed": seed},
            "edgellm_version": _edgellm_version(),
            "build_date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "run": f"./{SELFTEST_NAME.format(variants[-1])} {CASES_NAME}",
            "files": {p.name: _sha256(p) for p in sorted(tmp.iterdir())},
        }
        (tmp / "bundle.json").write_text(json.dumps(meta, indent=2) + "\n")
        tmp.chmod(0o755)      # mkdtemp makes it 0700
        old = None
        if out.exists():
            old = out.with_name(f".{out.name}.old-{os.getpid()}")
            os.replace(out, old)
        try:
            os.replace(tmp, out)
        except OSError:
            if old is not None:
                os.replace(old, out)       # the previous bundle stays as it was
            raise
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    say(f"bundle: {out}")
    return out
