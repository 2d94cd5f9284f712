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
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Mapping, Sequence


from .errors import EdgeLLMError
from .selftest_cases import write_cases

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
