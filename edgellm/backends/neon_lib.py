"""Loading the NEON kernel library (neon/, built by setup.py) with ctypes.

Two variants are built: "base" (Armv8.0 NEON) and "dotprod" (SDOT + fp16 arithmetic). On aarch64
the CPU's HWCAP flags choose; on other hosts the library runs through SIMDe and "dotprod" is
used (both are tested). EDGELLM_NEON_VARIANT=base|dotprod forces one; EDGELLM_NEON_LIB=PATH
loads a given file (a library from `edgellm build`, say); one that sits in its bundle folder is
checked against the size and sha256 the bundle's bundle.json records before it is loaded.
"""
from __future__ import annotations

import ctypes
import json
import os
import platform
from ctypes import POINTER, c_float, c_int, c_size_t, c_uint, c_void_p
from pathlib import Path

from ..fileio import read_bundle_json
from ..hashing import bulk_sha256
from . import elf_check

EL_F32, EL_F16, EL_Q4_0, EL_Q4_1, EL_Q8_0 = 0, 1, 2, 3, 8
EL_KV_I8 = 16   # an int8 KV pool (kv_type only): k and v each point to an el_kv_i8


class ElKvI8(ctypes.Structure):
    """el_kv_i8 of neon/edgellm_neon.h: an int8 pool's arena (K or V) and its scales."""
    _fields_ = [("q", ctypes.c_void_p), ("scale", ctypes.c_void_p)]


class ElSampling(ctypes.Structure):
    """el_sampling of neon/edgellm_neon.h: a sampling chain's parameters (neon/sample.c)."""
    _fields_ = [("top_k", c_int), ("top_p", ctypes.c_double), ("min_p", ctypes.c_double),
                ("temperature", ctypes.c_double), ("repeat_penalty", ctypes.c_double), ("repeat_last_n", c_int)]


EL_ENONFINITE = -4   # el_sample: logits holding a NaN, or a maximum of +-inf
FEAT_NEON, FEAT_DOTPROD, FEAT_FP16, FEAT_SIMDE = 1, 2, 4, 8
_HWCAP_ASIMDHP, _HWCAP_ASIMDDP = 1 << 10, 1 << 20     # arch/arm64/include/uapi/asm/hwcap.h
_AT_HWCAP = 16

_c_float_p = POINTER(c_float)
_c_int_p = POINTER(c_int)

# name -> (restype, argtypes): the whole API of neon/edgellm_neon.h
_SIGNATURES = {
    "el_features": (c_uint, []),
    "el_build_info": (ctypes.c_char_p, []),
    "el_build_isa": (c_uint, []),
    "el_use_generic": (None, [c_int]),
    "el_x86_gemv": (c_int, [c_int]),
    "el_peak_probe": (c_int, [c_int, ctypes.c_long, POINTER(ctypes.c_double)]),
    "el_read_probe": (c_int, [c_void_p, c_void_p, c_size_t, POINTER(ctypes.c_uint64)]),
    "el_pool_create": (c_void_p, [c_int, _c_int_p, c_int]),
    "el_pool_destroy": (None, [c_void_p]),
    "el_pool_threads": (c_int, [c_void_p]),
    "el_pool_affinity": (c_int, [c_void_p, c_int, _c_int_p, c_int]),
    "el_matmul_scratch": (c_size_t, [c_int, c_int]),
    "el_matmul": (c_int, [c_void_p, c_int, POINTER(c_void_p), _c_int_p, c_int, _c_float_p, _c_float_p,
                          c_int, c_int, _c_float_p, c_void_p]),
    "el_matmul_f32act": (c_int, [c_void_p, c_int, POINTER(c_void_p), _c_int_p, c_int, _c_float_p, _c_float_p,
                                 c_int, c_int, _c_float_p]),
    "el_rmsnorm": (c_int, [c_void_p, _c_float_p, _c_float_p, _c_float_p, c_int, c_int, c_float]),
    "el_rope": (c_int, [_c_float_p, _c_float_p, c_int, c_int, c_int, c_int, _c_float_p, _c_float_p, c_int]),
    "el_swiglu": (c_int, [c_void_p, _c_float_p, _c_float_p, c_int, c_int]),
    "el_softmax": (c_int, [_c_float_p, c_int, c_int]),
    "el_add": (c_int, [_c_float_p, _c_float_p, _c_float_p, c_size_t]),
    "el_attention_pool": (c_int, [c_void_p, _c_float_p, _c_float_p, c_int, c_int, c_int, c_int, c_int,
                                  c_void_p, c_void_p, c_int, POINTER(ctypes.c_int32), c_int, c_int, c_int]),
    "el_attention_dense": (c_int, [c_void_p, _c_float_p, _c_float_p, c_int, c_int, c_int, c_int, c_int,
                                   _c_float_p, _c_float_p]),
    # the struct pointers (el_layer *, el_model_dims *) are addresses: neon_fused.py passes ints
    "el_decode_scratch": (c_size_t, [c_void_p]),
    "el_decode_step": (c_int, [c_void_p, c_void_p, c_int, c_void_p, c_void_p, c_int, c_void_p, c_void_p,
                               c_void_p, c_void_p, c_int, c_void_p, c_int, c_int, c_int, c_void_p, c_size_t]),
    "el_chunk_scratch": (c_size_t, [c_void_p, c_int]),
    "el_chunk_step": (c_int, [c_void_p, c_void_p, c_int, c_void_p, c_void_p, c_int, c_int, c_void_p, c_void_p,
                              c_void_p, c_void_p, c_int, c_void_p, c_int, c_int, c_int, c_void_p, c_size_t]),
    "el_chunk_step_out": (c_int, [c_void_p, c_void_p, c_int, c_void_p, c_void_p, c_int, c_int, c_void_p,
                                  c_void_p, c_void_p, c_void_p, c_int, c_void_p, c_int, c_int, c_int, c_void_p,
                                  c_size_t, c_int]),
    "el_embed_rows": (c_int, [c_void_p, c_void_p, c_int, c_void_p]),
    "el_chunk_ids": (c_int, [c_void_p, c_void_p, c_int, c_void_p, c_void_p, c_void_p, c_void_p, c_int, c_int,
                             c_void_p, c_void_p, c_void_p, c_void_p, c_int, c_void_p, c_int, c_int, c_int, c_void_p,
                             c_size_t, c_int, c_void_p, c_void_p, c_int, c_int, c_void_p]),
    "el_chunk_logits": (c_int, [c_void_p, c_void_p, c_int, c_void_p, c_void_p, c_int, c_int, c_void_p, c_void_p,
                                c_void_p, c_void_p, c_int, c_void_p, c_int, c_int, c_int, c_void_p, c_size_t,
                                c_void_p, c_void_p, c_int, c_int, c_void_p]),
    "el_decode_greedy": (c_int, [c_void_p, c_void_p, c_int, c_void_p, c_void_p, c_int, c_void_p, c_int, c_int,
                                 c_void_p, c_void_p, c_void_p, c_void_p, c_int, c_void_p, c_int, c_int, c_int,
                                 c_void_p, c_size_t, c_void_p, c_void_p, c_int, c_int, c_void_p, c_void_p, c_int,
                                 c_void_p]),
    "el_decode_sample": (c_int, [c_void_p, c_void_p, c_int, c_void_p, c_void_p, c_int, c_void_p, c_int, c_int,
                                 c_void_p, c_void_p, c_void_p, c_void_p, c_int, c_void_p, c_int, c_int, c_int,
                                 c_void_p, c_size_t, c_void_p, c_void_p, c_int, c_int, c_void_p, c_void_p, c_int,
                                 c_void_p, c_void_p, c_void_p, c_void_p, c_int, c_void_p, c_size_t]),
    "el_decode_sample_scratch": (c_size_t, [c_int, c_int, c_int]),
    "el_sample_scratch": (c_size_t, [c_int]),
    "el_sample": (c_int, [c_void_p, c_int, c_void_p, ctypes.c_double, c_void_p, c_size_t]),
    "el_f32_to_f16": (c_int, [c_void_p, c_void_p, c_size_t]),
    "el_kv_quantize_i8": (c_int, [c_void_p, c_void_p, c_void_p, c_int, c_int]),
    # the tokenizer's BPE merges (neon/bpe.c, edgellm/model/bpe_native.py)
    "el_bpe_create": (c_void_p, [c_void_p, c_void_p, c_int, c_void_p, c_void_p, c_int, c_int, _c_int_p, _c_int_p]),
    "el_bpe_destroy": (None, [c_void_p]),
    "el_bpe_token_id": (c_int, [c_void_p, c_void_p, c_int]),
    "el_bpe_encode": (c_int, [c_void_p, c_void_p, c_void_p, c_int, c_void_p, c_int]),
    "el_bpe_encode_text": (c_int, [c_void_p, c_int, c_void_p, c_int, c_void_p, c_int]),
    "el_spm_create": (c_void_p, [c_void_p, c_void_p, c_int, c_void_p, c_int, _c_int_p, _c_int_p]),
    "el_spm_encode": (c_int, [c_void_p, c_void_p, c_int, c_void_p, c_int]),
    # the GGUF parser's string-array walk (neon/gguf_walk.c, edgellm/model/gguf_file.py)
    "el_gguf_string_walk": (c_int, [c_void_p, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_int64, ctypes.c_uint64,
                                    c_void_p, POINTER(ctypes.c_uint64)]),
}


class NeonLibError(RuntimeError):
    """The library is missing, or lacks a symbol: the neon unit is unavailable."""


# el_build_isa's bits (neon/features.c): each extension as /proc/cpuinfo names it, and as numpy's
# CPUID-based dispatch does (None: numpy does not report it)
EL_X86_ISA = (("sse4_2", "SSE42"), ("popcnt", "POPCNT"), ("avx", "AVX"), ("avx2", "AVX2"), ("fma", "FMA3"),
              ("f16c", "F16C"), ("bmi1", "BMI"), ("bmi2", "BMI2"), ("abm", "LZCNT"), ("movbe", "MOVBE"),
              ("avx512f", "AVX512F"), ("avx512bw", "AVX512BW"), ("avx512vl", "AVX512VL"), ("avx512dq", "AVX512DQ"),
              ("avx512cd", "AVX512CD"), ("avx512_vnni", "AVX512VNNI"), ("avx512vbmi", "AVX512VBMI"),
              ("avx512_vbmi2", "AVX512VBMI2"), ("avx512_bf16", "AVX512BF16"), ("avx512ifma", "AVX512IFMA"),
              ("avx512_bitalg", "AVX512BITALG"), ("avx512_vpopcntdq", "AVX512VPOPCNTDQ"), ("avx_vnni", None),
              ("gfni", "GFNI"), ("vaes", "VAES"), ("vpclmulqdq", "VPCLMULQDQ"), ("avx512_fp16", "AVX512FP16"))


def _cpuinfo(keys: tuple[str, ...], cpuinfo: str) -> dict[str, str] | None:
    """The first value of each of `keys` in /proc/cpuinfo (the first CPU's), None where the file
    cannot be read; a key it lacks is absent."""
    found: dict[str, str] = {}
    try:
        with open(cpuinfo, encoding="ascii", errors="replace") as f:
            for line in f:
                key, _, val = line.partition(":")
                key = key.strip()
                if key in keys and key not in found:
                    found[key] = val.strip()
                    if len(found) == len(keys):
                        break
    except OSError:
        return None
    return found


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> frozenset[str] | None:
    """The running CPU's feature flags as /proc/cpuinfo lists them (Linux), None where unreadable."""
    flags = (_cpuinfo(("flags",), cpuinfo) or {}).get("flags")
    return None if flags is None else frozenset(flags.split())


def numpy_cpu_features() -> dict[str, bool] | None:
    """numpy's own CPUID probe (it also asks the OS which registers it saves): preferred to
    /proc/cpuinfo, which an emulator (qemu-user) passes through from the host."""
    try:
        from numpy._core._multiarray_umath import __cpu_features__ as feats
    except ImportError:
        try:
            from numpy.core._multiarray_umath import __cpu_features__ as feats   # numpy 1.x
        except ImportError:
            return None
    return dict(feats)


def missing_isa(built: int) -> list[str]:
    """The extensions in el_build_isa's mask that this CPU lacks; [] where that cannot be told."""
    np_feats, flags, out = numpy_cpu_features() or {}, cpu_flags(), []
    for bit, (name, np_key) in enumerate(EL_X86_ISA):
        if built >> bit & 1:
            has = np_feats[np_key] if np_key in np_feats else (flags is None or name in flags)
            if not has:
                out.append(name)
    return out


def _check_isa(lib: ctypes.CDLL, path: Path) -> None:
    """Refuse a library built for x86 extensions this CPU lacks (before any call could SIGILL)."""
    missing = missing_isa(lib.el_build_isa())
    if missing:
        raise NeonLibError(f"{path} was built for a CPU with {', '.join(missing)}, which this one lacks (a "
                           f"library compiled with -march=native elsewhere): reinstall from source on this "
                           f"machine, or build with EDGELLM_NEON_CFLAGS=-march=x86-64-v2 for any x86-64 CPU")


def package_dir() -> Path:
    return Path(__file__).resolve().parent.parent


def _hwcap() -> int:
    try:
        libc = ctypes.CDLL(None)
        libc.getauxval.restype = ctypes.c_ulong
        return int(libc.getauxval(_AT_HWCAP))
    except (OSError, AttributeError):
        return 0


def choose_variant() -> tuple[str, str]:
    """(variant, why)."""
    forced = os.environ.get("EDGELLM_NEON_VARIANT")
    if forced:
        if forced not in ("base", "dotprod"):
            raise NeonLibError(f"EDGELLM_NEON_VARIANT must be base or dotprod, got {forced!r}")
        return forced, "EDGELLM_NEON_VARIANT"
    if platform.machine().lower() in ("aarch64", "arm64"):
        cap = _hwcap()
        if cap & _HWCAP_ASIMDDP and cap & _HWCAP_ASIMDHP:
            return "dotprod", "HWCAP has asimddp and asimdhp"
        return "base", "HWCAP lacks asimddp or asimdhp"
    return "dotprod", "not an Arm CPU: SIMDe emulation, dotprod paths"


def cpu_vendor_family(cpuinfo: str = "/proc/cpuinfo") -> tuple[str, int] | None:
    """(vendor_id, cpu family) of an x86 CPU as /proc/cpuinfo gives them; None where unreadable."""
    d = _cpuinfo(("vendor_id", "cpu family"), cpuinfo) or {}
    if "vendor_id" not in d or not d.get("cpu family", "").isdigit():
        return None
    return d["vendor_id"], int(d["cpu family"])


# AMD family 19h with AVX-512 (Zen 4) runs a 512-bit operation as two 256-bit halves; there, in one
# process with the kernels alternated, SmolLM2's decode took 3.59 ms/token with both AVX2 GEMVs
# against 4.85 with both AVX-512 ones (Zen 4 guest, 128-token prompt; each kernel ~half the gap:
# the AVX-512 ones stream DRAM-resident rows slower there). On a Zen 5 (family 1Ah, full-width
# 512-bit units) the AVX-512 GEMVs were the faster (qgemv_avx512.h).
_AVX2_GEMV_FAMILIES = {("AuthenticAMD", 0x19)}


def choose_x86_gemv(lib: ctypes.CDLL, cpuinfo: str = "/proc/cpuinfo") -> str:
    """Set which GEMVs run on 512-bit registers in an x86 development build (el_x86_gemv) and say
    why; "" where the build has no choice (Arm, or x86 without AVX-512 VNNI + VBMI) and nobody
    asked for one."""
    forced = os.environ.get("EDGELLM_X86_GEMV")
    if forced and forced not in ("avx2", "avx512"):
        raise NeonLibError(f"EDGELLM_X86_GEMV must be avx2 or avx512, got {forced!r}")
    if lib.el_x86_gemv(-1) < 0:
        return f"EDGELLM_X86_GEMV={forced} ignored: this build has no AVX-512 GEMVs" if forced else ""
    if forced:
        wide, why = forced == "avx512", "EDGELLM_X86_GEMV"
    else:
        cpu = cpu_vendor_family(cpuinfo)
        wide = cpu not in _AVX2_GEMV_FAMILIES
        why = "default" if wide else f"{cpu[0]} family {cpu[1]:x}h: 512-bit operations run as two 256-bit halves"
    lib.el_x86_gemv(3 if wide else 0)
    return f"x86 GEMVs {'AVX-512' if wide else 'AVX2'} ({why})"


def library_path(variant: str) -> Path:
    explicit = os.environ.get("EDGELLM_NEON_LIB")
    if explicit:
        # absolute: a bare file name made dlopen search the system's library path, not here
        return Path(os.path.abspath(os.path.expanduser(explicit)))
    found = sorted(package_dir().glob(f"_neon_{variant}*.so"))
    if not found:
        raise NeonLibError(f"the {variant} NEON library is not built (no edgellm/_neon_{variant}*.so): the "
                           f"install compiles it where a C compiler and, off ARM, the simde-py headers are "
                           f"present; reinstall with both (pip install --force-reinstall --no-binary edgellm "
                           f"edgellm, or pip install -e . in a checkout)")
    return found[0]


def _explicit_variant(lib: ctypes.CDLL, path: Path) -> tuple[str, str]:
    """(variant, why) of a library EDGELLM_NEON_LIB names: what it was built as, not what this CPU
    would pick (the plan called an x86 base build "dotprod library", and EDGELLM_NEON_VARIANT
    the reason, though it was not what decided). On Arm a dotprod build the CPU cannot run is
    refused before any kernel dies of SIGILL."""
    variant = "dotprod" if lib.el_features() & FEAT_DOTPROD else "base"
    why = f"EDGELLM_NEON_LIB={path}"
    if platform.machine().lower() in ("aarch64", "arm64") and variant == "dotprod":
        cap = _hwcap()
        if not (cap & _HWCAP_ASIMDDP and cap & _HWCAP_ASIMDHP):
            raise NeonLibError(f"{path} is a dotprod build and this CPU lacks asimddp or asimdhp: load a base build")
    forced = os.environ.get("EDGELLM_NEON_VARIANT")
    if forced and forced != variant:
        why += f"; EDGELLM_NEON_VARIANT={forced} does not apply to it"
    return variant, why


def bundle_problem(path: str | os.PathLike) -> str | None:
    """Why a library in an `edgellm build` bundle (a bundle.json beside it listing its name) is not
    the file the build wrote: its size or sha256 differs from the record. None where it matches,
    or where no bundle lists it. Checked before dlopen: a copy cut short, or a library swapped
    in later, otherwise failed at load (or ran) as if it were the built one, while the bundle's
    hashes were written and never read."""
    try:
        real = Path(path).resolve()     # (a link to the bundle's file: checked against its bundle)
        if not real.is_file():
            return None                 # (elf_check says what it is)
        meta_path = real.parent / "bundle.json"
        meta = json.loads(read_bundle_json(meta_path))
    except (OSError, ValueError):
        return None                     # no bundle here (or no readable one): nothing to check against
    if not isinstance(meta, dict) or meta.get("format") != 1 or not isinstance(meta.get("files"), dict):
        return None                     # someone else's bundle.json
    want = meta["files"].get(real.name)
    if want is None:
        return None
    sizes = meta.get("sizes") if isinstance(meta.get("sizes"), dict) else {}
    try:
        data = real.read_bytes()
    except OSError:
        return None                     # (dlopen's error says why)
    again = "the file was truncated or replaced after `edgellm build`: copy the bundle again, or rebuild it"
    size = sizes.get(real.name)
    if isinstance(size, int) and len(data) != size:
        return f"{path} is {len(data)} bytes, but its bundle's {meta_path} records {size}: {again}"
    got = bulk_sha256(data).hexdigest()   # (OpenSSL's, imported only for a bundle's library)
    if not isinstance(want, str) or got != want.lower():
        return (f"{path} ({len(data)} bytes) has sha256 {got}, but its bundle's {meta_path} records "
                f"{want}: {again}")
    return None


def load(variant: str | None = None, path: str | os.PathLike | None = None, partial: bool = False) -> ctypes.CDLL:
    """The library with every function's signature declared. partial: allow missing symbols
    (kernel development builds of a few sources)."""
    why = ""
    if variant is None:
        variant, why = choose_variant()
    path = Path(path) if path is not None else library_path(variant)
    wrong = bundle_problem(path) or elf_check.problem(path)
    if wrong:
        raise NeonLibError(wrong)
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        raise NeonLibError(f"cannot load {path}: {e}") from None
    for name, (res, args) in _SIGNATURES.items():
        try:
            fn = getattr(lib, name)
        except AttributeError:
            if partial:
                continue
            raise NeonLibError(f"{path} lacks {name}: rebuild it (pip install -e .)") from None
        fn.restype, fn.argtypes = res, args
    if hasattr(lib, "el_build_isa"):
        _check_isa(lib, path)
    if os.environ.get("EDGELLM_NEON_LIB") and path == library_path(variant):
        variant, why = _explicit_variant(lib, path)
    lib.variant, lib.variant_reason, lib.path = variant, why, path
    lib.x86_gemv = choose_x86_gemv(lib) if hasattr(lib, "el_x86_gemv") else ""
    return lib


# the library choices a user may set, and what each takes
_CHOICES = {"EDGELLM_NEON_VARIANT": ("base", "dotprod"), "EDGELLM_X86_GEMV": ("avx2", "avx512")}


def named_library_problem() -> str | None:
    """Why the library EDGELLM_NEON_LIB names cannot be used, or a value of EDGELLM_NEON_VARIANT
    or EDGELLM_X86_GEMV is not one of theirs (None: all fine, or none is set). The neon unit's
    probe turns either into an unavailable unit, and the engine ran on the numpy reference (10x
    slower, ~700 MiB more memory): the user set them, so the CLI and edgellm.load() both make the
    reason an error instead (`EDGELLM_X86_GEMV=avx-512` ran at 0.8 tok/s without an error)."""
    for var, allowed in _CHOICES.items():
        v = os.environ.get(var)
        if v and v not in allowed:
            return f"{var} must be {' or '.join(allowed)}, got {v!r} (unset it to let edgellm choose)"
    named = os.environ.get("EDGELLM_NEON_LIB")
    if not named:
        return None
    try:
        load("dotprod")   # (the named file whatever the variant: what it is, it says)
    except NeonLibError as e:
        return (f"EDGELLM_NEON_LIB={named}: cannot use it: {e} (unset EDGELLM_NEON_LIB to use the installed "
                f"library)")
    return None


def fptr(a) -> "ctypes._Pointer":
    """float* of a C-contiguous float32 numpy array (no copy; the caller keeps `a` alive)."""
    return a.ctypes.data_as(_c_float_p)
