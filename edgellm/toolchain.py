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
all pass (exit 3, before any case, on a CPU without dot products or fp16 arithmetic: run
selftest_base there); then point EDGELLM_NEON_LIB at the library the self-test vouched for.
bundle.json records per variant the ISA features the flags enable and the newest glibc symbol
version the library needs (min_glibc; the self-tests are static and do not tell). With --cpu
naming an Armv8.0 core (Cortex-A53, A72) only the base variant is built.

Compilers, by target: aarch64-linux-gnu uses aarch64-linux-gnu-gcc when it is on PATH, else zig
(`pip install ziglang`); aarch64-linux-android[API] uses the NDK's clang from $ANDROID_NDK_HOME.
"""
from __future__ import annotations

import contextlib
import datetime as _dt
import hashlib
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Mapping, Sequence


from .errors import EdgeLLMError
from .fileio import read_bundle_json
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
                  "__ARM_FEATURE_FP16_VECTOR_ARITHMETIC": "fp16", "__ARM_FEATURE_MATMUL_INT8": "i8mm",
                  "__ARM_FEATURE_BF16_VECTOR_ARITHMETIC": "bf16", "__ARM_FEATURE_SVE": "sve",
                  "__ARM_FEATURE_SVE2": "sve2"}
MIN_ANDROID_API = 21          # the first with 64-bit Arm
CPU_EXAMPLES = "cortex-a55, cortex-a76 (Raspberry Pi 5), cortex-a78, cortex-x1, cortex-a72 (Raspberry Pi 4)"
LIB_NAME = "libedgellm_neon_{}.so"
SELFTEST_NAME = "selftest_{}"
CASES_NAME = "selftest_cases.bin"


class ToolchainError(EdgeLLMError):
    """No usable compiler for the target, or a bad target/cpu; the message says what to install."""


class BuildError(ToolchainError):
    """The compiler ran and failed; carries its command and output."""

    def __init__(self, what: str, cmd: Sequence[str], output: str):
        self.what = what
        self.cmd = list(cmd)
        self.output = output
        tail = "\n".join(output.strip().splitlines()[-30:])
        super().__init__(f"{what} failed: {' '.join(self.cmd)}\n{tail}{_hint(output)}")


def _hint(output: str) -> str:
    """What to install for the failures a fresh machine gives (the linker's own words name none)."""
    if "cannot find -lc" in output or "cannot find crt1.o" in output:
        return ("\nhint: the cross compiler's C library is missing (the static self-test links it): on "
                "Debian/Ubuntu, apt install libc6-dev-arm64-cross")
    return ""


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
    if target == "aarch64-linux-gnu" and api is not None:
        raise ToolchainError(f"--api {api} is an Android API level: it applies to aarch64-linux-android only")
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
    if api is not None and t_api is not None and api != t_api:
        raise ToolchainError(f"the target names Android API {t_api} and --api says {api}: give one")
    api = api if api is not None else t_api if t_api is not None else DEFAULT_ANDROID_API
    if api < MIN_ANDROID_API:
        raise ToolchainError(f"Android API {api}: 64-bit Arm starts at API {MIN_ANDROID_API}")
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
    check_cpu_name(cpu)
    if kind == "zig":
        if cpu is None or variant == "base":
            return list(ZIG_FLAGS[variant])
        return [f"-mcpu={cpu.replace('-', '_')}+dotprod+fullfp16"]
    if cpu is None:
        return list(ARM_FLAGS[variant])
    # +nosve: a core with SVE (Cortex-X2, A710...) would let gcc auto-vectorize with it, and the
    # loader picks this library on the dotprod and fp16 HWCAPs alone (phones' firmware may hide
    # SVE): the library must not need more than its name says
    return ["-march=armv8-a", f"-mtune={cpu}"] if variant == "base" else [f"-mcpu={cpu}+dotprod+fp16+nosve"]


def check_cpu_name(cpu: str | None) -> None:
    if cpu is not None and not re.fullmatch(r"[a-z0-9][a-z0-9.\-]*", cpu):
        raise ToolchainError(f"--cpu {cpu!r} is not a CPU name (lower-case letters, digits, '-', '.'; "
                             f"e.g. {CPU_EXAMPLES})")


def core_flags(cpu: str, kind: str = "gcc") -> list[str]:
    """The flags of the core alone (its own ISA): what it can run."""
    return [f"-mcpu={cpu.replace('-', '_')}"] if kind == "zig" else [f"-mcpu={cpu}"]


def compile_flags(variant: str, src_dir: Path, cpu: str | None = None, kind: str = "gcc") -> list[str]:
    return [*COMMON_FLAGS, f"-DEL_VARIANT={variant}", f"-I{src_dir}", *variant_flags(variant, cpu, kind)]


def probe_features(tc: Toolchain, flags: Sequence[str], cpu: str | None = None) -> list[str]:
    """Features the flags enable, read from the compiler's predefined macros. Also where a bad
    --cpu is rejected, with the first line of the compiler's own message (gcc follows it with
    every CPU name it knows)."""
    cmd = [*tc.cc, *flags, "-dM", "-E", "-x", "c", os.devnull]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ToolchainError(f"cannot run {tc.path}: {e}") from None
    if r.returncode != 0:
        said = next((ln.strip() for ln in r.stderr.splitlines() if ln.strip()), f"exit {r.returncode}")
        hint = f" (is {cpu!r} a CPU name it knows? e.g. {CPU_EXAMPLES})" if cpu else ""
        raise ToolchainError(f"{tc.path} rejects the flags {' '.join(flags)}{hint}: {said}")
    defined = {line.split()[1] for line in r.stdout.splitlines() if line.startswith("#define ")}
    return [name for macro, name in FEATURE_MACROS.items() if macro in defined]


# ---- the bundle ------------------------------------------------------------------------------

class _Compilers:
    """The compiler processes of one build, so that an abort (Ctrl-C to Python alone, SIGTERM, a
    failed job) kills them instead of waiting for them (~15 s)."""

    def __init__(self):
        self._procs: list[subprocess.Popen] = []
        self._lock = threading.Lock()
        self._stopped = False

    def run(self, what: str, cmd: Sequence[str]) -> None:
        with self._lock:
            if self._stopped:
                raise BuildError(what, cmd, "the build was stopped")
            try:
                # its own process group: a stop signals the driver and its cc1, as and ld together
                p = subprocess.Popen(list(cmd), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=os.name == "posix")
            except OSError as e:
                raise BuildError(what, cmd, str(e)) from None
            self._procs.append(p)
        try:
            out, _ = p.communicate(timeout=600)
        except subprocess.TimeoutExpired:
            _stop([p])
            p.communicate()
            raise BuildError(what, cmd, "no result after 600 s") from None
        if p.returncode != 0:
            raise BuildError(what, cmd, out)

    def kill(self) -> None:
        with self._lock:
            self._stopped = True
            _stop(self._procs)


def _signal_group(p: subprocess.Popen, sig: int) -> None:
    try:
        if os.name == "posix":
            os.killpg(p.pid, sig)
        else:
            p.kill()
    except (ProcessLookupError, PermissionError):
        pass


def _stop(procs: Sequence[subprocess.Popen], grace: float = 2.0) -> None:
    """SIGTERM first, to the compiler's whole process group: gcc's driver removes its temporary
    files (/tmp/cc*.s, *.o) on SIGTERM, where SIGKILL left them behind at every stopped build (22
    files, ~300 KB, per interrupted build); SIGKILL whatever is left after `grace` seconds."""
    live = [p for p in procs if p.poll() is None]
    for p in live:
        _signal_group(p, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for p in live:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for p in live:
        _signal_group(p, signal.SIGKILL)


def glibc_needed(lib: Path) -> str | None:
    """The newest GLIBC_2.x symbol version a shared library asks for (its .dynstr names each
    one it needs), e.g. "2.34": the oldest glibc it loads on. None: it asks for none."""
    found = [int(m) for m in re.findall(rb"GLIBC_2\.(\d+)(?![\d.])", lib.read_bytes())]
    return f"2.{max(found)}" if found else None


@contextlib.contextmanager
def stop_on_sigterm():
    """SIGTERM (a CI timeout, `kill`) raises SystemExit(143) in the main thread while a build
    runs, so build_bundle kills its compilers and removes its temporary folder, as on Ctrl-C;
    the default action ended the process and left both behind."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        raise SystemExit(128 + signum)

    old = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def _is_bundle(out: Path) -> bool:
    """An empty folder, or one whose bundle.json is edgellm's (its format, target, variants and
    files) and that holds no folders and no file the bundle does not list: a project folder with
    a bundle.json of its own is neither, nor a bundle the user added notes to (a rebuild
    replaces the whole folder)."""
    if not out.is_dir():
        return False
    entries = list(out.iterdir())
    if not entries:
        return True
    if any(p.is_dir() for p in entries):
        return False
    try:
        meta = json.loads(read_bundle_json(out / "bundle.json"))
    except (OSError, ValueError):
        return False
    return (isinstance(meta, dict) and meta.get("format") == 1 and isinstance(meta.get("files"), dict)
            and isinstance(meta.get("variants"), dict) and meta.get("target") in TARGETS
            and all(p.name == "bundle.json" or p.name in meta["files"] for p in entries))


def _read_only(path: Path) -> str:
    try:
        return " (a read-only file system)" if os.statvfs(path).f_flag & os.ST_RDONLY else ""
    except OSError:
        return ""


def check_out_writable(out: Path) -> None:
    """What the build's last step needs, checked before anything compiles: the folder `out` goes
    in (its parent, or the nearest one there is, since missing ones are made) must be writable,
    and an `out` that exists is renamed away, so it must be writable itself and no mount point.
    A read-only mount given as --out compiled for minutes, then failed "Device or resource busy"
    (a probe)."""
    file_above = next((p for p in out.parents if p.exists() and not p.is_dir()), None)
    if file_above is not None:
        raise ToolchainError(f"cannot write the bundle at {out}: {file_above} is a file, not a folder")
    if out.exists():
        if not os.access(out, os.W_OK | os.X_OK):
            raise ToolchainError(f"cannot write the bundle at {out}: the folder is not writable{_read_only(out)}")
        if os.path.ismount(out):
            raise ToolchainError(f"cannot write the bundle at {out}: it is a mount point, and a build replaces "
                                 f"its --out folder whole; give a folder inside it, e.g. {out / 'edgellm-bundle'}")
    folder = next((p for p in out.parents if p.exists()), out.parent)
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ToolchainError(f"cannot write the bundle at {out}: the folder {folder} is not "
                             f"writable{_read_only(folder)}")


def _in_user_terms(e: ToolchainError, temps: Mapping[Path, Path]) -> ToolchainError:
    """`e` with each temporary folder in its text replaced by what it stands for."""
    def named(text: str) -> str:
        for temp, real in temps.items():
            text = text.replace(str(temp), str(real))
        return text

    if isinstance(e, BuildError):
        return BuildError(named(e.what), [named(c) for c in e.cmd], named(e.output))
    return type(e)(named(str(e)))


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
    check_cpu_name(cpu)      # before anything is probed or printed
    variants = list(dict.fromkeys(variants))
    if not variants or any(v not in VARIANTS for v in variants):
        raise ToolchainError(f"variants must be a non-empty subset of {', '.join(VARIANTS)}; got {variants}")
    tc = find_toolchain(target, api, env)
    src = Path(src_dir) if src_dir is not None else neon_source_dir()
    if not (src / "selftest.c").is_file() or not library_sources(src):
        raise ToolchainError(f"{src} lacks the library sources or selftest.c")
    name = tc.target + (str(tc.api) if tc.api and tc.target.endswith("android") else "")
    # resolved first: "." or "" has no name to put the temporary folder beside
    out = Path(os.path.expanduser(out)).resolve() if out is not None else Path.cwd() / f"edgellm-bundle-{name}"
    if out.exists() and not _is_bundle(out):
        raise ToolchainError(f"{out} exists and is not an edgellm bundle (no edgellm bundle.json, or it holds "
                             f"folders or files the bundle does not list): choose another --out")
    check_out_writable(out)
    if cpu is not None and "dotprod" in variants:
        # a core without dot products or fp16 arithmetic (Cortex-A53, A72: Armv8.0) cannot run
        # the dotprod variant: gcc fails on it after the whole build, and such a library would
        # die with SIGILL on the very core it was built for
        own = probe_features(tc, core_flags(cpu, tc.kind), cpu)
        if not {"dotprod", "fp16"} <= set(own):
            if variants == ["dotprod"]:
                raise ToolchainError(f"{cpu} has no dot product or fp16 arithmetic instructions (features: "
                                     f"{', '.join(own)}): it runs the base variant only")
            say(f"{cpu} has no dot product or fp16 arithmetic instructions: building the base variant only")
            variants = [v for v in variants if v != "dotprod"]

    version = tc.version()
    say(f"compiler: {tc.path} ({version})")
    jobs_run = _Compilers()
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    except OSError as e:
        file_above = next((p for p in out.parents if p.exists() and not p.is_dir()), None)
        why = f"{file_above} is a file, not a folder" if file_above else (e.strerror or str(e))
        raise ToolchainError(f"cannot write the bundle at {out}: {why}") from None
    snap = old = None
    try:
        # the sources as they are now, compiled and hashed from one copy: an edit during the
        # build would otherwise give a hash of sources other than those compiled
        try:
            snap = Path(tempfile.mkdtemp(prefix="edgellm-src-"))
            for f in source_files(src):
                shutil.copy2(f, snap / f.name)
        except OSError as e:
            raise ToolchainError(f"cannot copy the NEON sources {src} to a temporary folder in "
                                 f"{tempfile.gettempdir()} (set TMPDIR to use another): {e.strerror or e}") from None
        lib_srcs = [str(p) for p in library_sources(snap)]
        meta_variants = {}
        jobs = []          # (what, command), run concurrently: each is one compiler process
        for v in variants:
            flags = compile_flags(v, snap, cpu, tc.kind)
            features = probe_features(tc, flags, cpu)
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
                                                    str(snap / "selftest.c"), "-lm"]))
            meta_variants[v] = {"flags": [f for f in flags if not f.startswith("-I")], "features": features,
                                "library": lib, "selftest": exe}
        for what, _ in jobs:
            say(f"compiling {what} ...")
        with ThreadPoolExecutor(max_workers=max(1, min(len(jobs), os.cpu_count() or 1))) as pool:
            try:
                futures = [pool.submit(jobs_run.run, f"compiling {what}", cmd) for what, cmd in jobs]
                say(f"writing {CASES_NAME} ...")
                n_cases = write_cases(tmp / CASES_NAME, seed)      # numpy, while the compilers run
                for f in futures:
                    f.result()           # the first failure, in job order, with the compiler's output
            except BaseException:
                jobs_run.kill()          # before the pool's exit waits for its jobs
                raise
        for v in variants:
            glibc = glibc_needed(tmp / LIB_NAME.format(v)) if tc.target == "aarch64-linux-gnu" else None
            if glibc:
                meta_variants[v]["min_glibc"] = glibc
        needs = sorted({m["min_glibc"] for m in meta_variants.values() if "min_glibc" in m},
                       key=lambda g: int(g.split(".")[1]))
        if needs:
            say(f"the libraries need glibc {needs[-1]} or later on the device (the self-tests are static)")
        meta = {
            "format": 1,
            "target": tc.target,
            "api": tc.api,
            "cpu": cpu,
            "variants": meta_variants,
            "compiler": {"kind": tc.kind, "path": tc.path, "command": list(tc.cc), "version": version},
            "source_sha256": source_hash(snap),
            "sources": [p.name for p in source_files(snap)],
            "selftest_cases": {"file": CASES_NAME, "count": n_cases, "seed": seed},
            "edgellm_version": _edgellm_version(),
            "build_date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "run": f"./{SELFTEST_NAME.format(variants[-1])} {CASES_NAME}",
            "files": {p.name: _sha256(p) for p in sorted(tmp.iterdir())},
            # read by the loader (neon_lib.bundle_problem): a short copy is named as one, by size
            "sizes": {p.name: p.stat().st_size for p in sorted(tmp.iterdir())},
        }
        (tmp / "bundle.json").write_text(json.dumps(meta, indent=2) + "\n")
        tmp.chmod(0o755)      # mkdtemp makes it 0700
        if out.exists():
            old = out.with_name(f".{out.name}.old-{os.getpid()}")
            os.replace(out, old)
        try:
            os.replace(tmp, out)
        except BaseException:   # (a Ctrl-C between the two renames too: it left no --out at all)
            if old is not None and not out.exists():
                os.replace(old, out)       # the previous bundle stays as it was
            raise
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None and out.exists():   # (stopped after the new bundle went in)
            shutil.rmtree(old, ignore_errors=True)
        # the temporary folders are gone and a user cannot act on them: an error names the
        # sources and --out they stand for (a compile error named /tmp/edgellm-src-XXXX/one.c)
        temps = {tmp: out, **({snap: src} if snap is not None else {})}
        if isinstance(e, ToolchainError):
            raise _in_user_terms(e, temps) from None
        if isinstance(e, OSError):      # (a full disk said "[Errno 28] No space left on device", no path)
            raise ToolchainError(f"cannot write the bundle at {out}: {e.strerror or e}") from None
        raise
    finally:
        if snap is not None:
            shutil.rmtree(snap, ignore_errors=True)
    say(f"bundle: {out}")
    return out
