"""The NEON kernels against the numpy reference, from one cases file (edgellm.toolchain.write_cases)
run three ways: on this host (x86: the NEON source through SIMDe), and cross-compiled for aarch64
under qemu-user, the dotprod build on a CPU model that has dotprod and fp16, the base build also on
one that has neither (Cortex-A53). Every case runs on the NEON path and on the plain-C twins.

Also: the self-test's reader on truncated and corrupt files (exit 2 and a message, never a crash),
and the toolchain's typed errors. aarch64-linux-gnu-gcc and qemu-aarch64 are required, not optional:
without them these tests fail and say what to install (.ci/run installs both).
"""
from __future__ import annotations

import importlib.util
import json
import re
import shutil
import signal
import struct
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from edgellm import selftest_cases as sc
from edgellm import toolchain as tc
from edgellm.errors import EdgeLLMError

ROOT = Path(__file__).resolve().parent.parent
NEON = ROOT / "neon"
INSTALL_HINT = ("install the aarch64 cross compiler and qemu-user: `sudo apt-get install gcc-aarch64-linux-gnu "
                "qemu-user` (.ci/run does this)")


def _build_neon():
    spec = importlib.util.spec_from_file_location("build_neon", ROOT / "tools" / "build_neon.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _run(cmd, timeout=600) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout)


def assert_all_pass(r: subprocess.CompletedProcess, cases: list[sc.Case], what: str) -> int:
    """Every case passed on both paths; returns the number of PASS lines."""
    lines = r.stdout.splitlines()
    fails = [ln for ln in lines if ln.startswith("FAIL")]
    assert r.returncode == 0 and not fails, (
        f"{what}: exit {r.returncode}, {len(fails)} failed:\n" + "\n".join(fails[:40]) + f"\n{r.stderr[-2000:]}")
    passed = {ln.split()[1] for ln in lines if ln.startswith("PASS")}
    for c in cases:
        assert c.name in passed and f"{c.name}/generic" in passed, f"{what}: {c.name} did not run"
    assert re.search(r"^# \d+ passed, 0 failed$", r.stdout, re.M), r.stdout[-500:]
    return len([ln for ln in lines if ln.startswith("PASS")])


# ---- fixtures --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cases() -> list[sc.Case]:
    return sc.make_cases()


@pytest.fixture(scope="module")
def cases_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("cases") / tc.CASES_NAME
    sc.write_cases(path)
    return path


@pytest.fixture(scope="module")
def host_selftest(tmp_path_factory):
    """variant -> path of the self-test built for this host (SIMDe on x86); both built at once."""
    bn, out = _build_neon(), tmp_path_factory.mktemp("host")
    sources = bn.library_sources() + [str(NEON / "selftest.c")]

    def build(variant: str) -> Path:
        return bn.build(out / f"selftest_{variant}", variant, sources, shared=False)

    built = {}
    with ThreadPoolExecutor(max_workers=len(tc.VARIANTS)) as pool:
        for variant, fut in [(v, pool.submit(build, v)) for v in tc.VARIANTS]:
            try:
                built[variant] = fut.result()
            except subprocess.CalledProcessError as e:
                pytest.fail(f"building the {variant} self-test for the host failed:\n{e.stderr[-4000:]}")
    return built.__getitem__


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> Path:
    try:
        return tc.build_bundle("aarch64-linux-gnu", out=tmp_path_factory.mktemp("b") / "bundle", progress=None)
    except tc.BuildError as e:
        pytest.fail(str(e))
    except tc.ToolchainError as e:
        pytest.fail(f"{e}\n{INSTALL_HINT}")


@pytest.fixture(scope="module")
def qemu() -> str:
    q = shutil.which("qemu-aarch64")
    if not q:
        pytest.fail(f"qemu-aarch64 is not on PATH: {INSTALL_HINT}")
    return q


# ---- the kernels ----------------------------------------------------------------------------


@pytest.mark.parametrize("variant", tc.VARIANTS)
def test_host_selftest(host_selftest, cases_file, cases, variant):
    r = _run([host_selftest(variant), cases_file])
    assert_all_pass(r, cases, f"host {variant}")
    assert f"variant={variant}" in r.stdout.splitlines()[0]


# (variant, qemu CPU model): Cortex-A53 is Armv8.0, no dotprod, no fp16 arithmetic
QEMU_RUNS = [("dotprod", "max"), ("base", "max"), ("base", "cortex-a53")]


@pytest.mark.parametrize("variant,cpu", QEMU_RUNS)
def test_qemu_selftest(bundle, qemu, cases, variant, cpu):
    r = _run([qemu, "-cpu", cpu, bundle / f"selftest_{variant}", bundle / tc.CASES_NAME])
    assert_all_pass(r, cases, f"aarch64 {variant} on qemu -cpu {cpu}")
    assert f"variant={variant} simde=0" in r.stdout.splitlines()[0]


def test_dotprod_build_faults_on_armv80(bundle, qemu):
    """The A53 model really rejects instructions past Armv8.0 (the dotprod build dies on it when
    forced past its CPU check, -f), so the base build's clean run on that model means something."""
    r = _run([qemu, "-cpu", "cortex-a53", bundle / "selftest_dotprod", "-f", bundle / tc.CASES_NAME])
    assert r.returncode == -signal.SIGILL, f"expected SIGILL, got exit {r.returncode}\n{r.stdout[-1000:]}"


def test_dotprod_selftest_names_a_cpu_without_dotprod(bundle, qemu):
    """Unforced it reads the CPU's HWCAPs first: on an Armv8.0 core it said nothing and died with
    SIGILL (exit 132) after its first case, like a broken kernel."""
    r = _run([qemu, "-cpu", "cortex-a72", bundle / "selftest_dotprod", bundle / tc.CASES_NAME])
    assert r.returncode == 3 and "run selftest_base" in r.stderr and "PASS" not in r.stdout


def _objdump() -> str:
    for name in ("aarch64-linux-gnu-objdump", "llvm-objdump"):
        if shutil.which(name):
            return name
    pytest.fail(f"no objdump for aarch64 (aarch64-linux-gnu-objdump comes with gcc-aarch64-linux-gnu): {INSTALL_HINT}")


# Armv8.2 instructions the base build must never contain: int8 dot products and fp16 arithmetic
# (fp16 <-> fp32 conversions, fcvtl/fcvtn, are Armv8.0 and allowed)
_V82 = re.compile(r"\t(s|u|us|su)dot\t|\tf(add|sub|mul|mla|mls|div|max|min|maxnm|minnm|abs|neg|sqrt|addp|maxp|minp"
                  r"|mulx|cm(eq|ge|gt))\t(v\d+\.[48]h|h\d+)")


def test_base_library_has_no_armv82_instructions(bundle):
    dis = {v: _run([_objdump(), "-d", bundle / tc.LIB_NAME.format(v)]) for v in tc.VARIANTS}
    for v, r in dis.items():
        assert r.returncode == 0, r.stderr
    bad = [ln for ln in dis["base"].stdout.splitlines() if _V82.search(ln)]
    assert not bad, "the base library holds Armv8.2 instructions:\n" + "\n".join(bad[:20])
    # the dotprod library uses SDOT somewhere (the quantized matmul)
    assert re.search(r"\tsdot\t", dis["dotprod"].stdout), "the dotprod library holds no sdot"


def test_libraries_export_the_api(bundle):
    header = (NEON / "edgellm_neon.h").read_text()
    api = set(re.findall(r"^EL_API[^(]*?\b(el_\w+)\(", header, re.M))
    assert len(api) >= 17
    for v in tc.VARIANTS:
        r = _run([_objdump(), "-T", bundle / tc.LIB_NAME.format(v)])
        exported = set(re.findall(r"\s(el_\w+)$", r.stdout, re.M))
        assert api <= exported, f"{v}: not exported: {sorted(api - exported)}"
        assert exported <= api, f"{v}: exported but not in the header: {sorted(exported - api)}"


def test_bundle_metadata(bundle, cases):
    meta = json.loads((bundle / "bundle.json").read_text())
    assert meta["target"] == "aarch64-linux-gnu" and meta["cpu"] is None
    assert set(meta["variants"]) == {"base", "dotprod"}
    assert meta["variants"]["base"]["features"] == ["neon"]
    assert meta["variants"]["dotprod"]["features"] == ["neon", "dotprod", "fp16"]
    assert "-march=armv8-a" in meta["variants"]["base"]["flags"]
    assert "-march=armv8.2-a+dotprod+fp16" in meta["variants"]["dotprod"]["flags"]
    assert meta["compiler"]["kind"] in ("gcc", "zig")
    assert meta["compiler"]["version"] and "\n" not in meta["compiler"]["version"]
    assert meta["source_sha256"] == tc.source_hash(NEON)
    for v in tc.VARIANTS:   # the libraries' glibc symbol versions (2.34 with Debian 12's cross gcc)
        assert re.fullmatch(r"2\.\d+", meta["variants"][v]["min_glibc"])
    assert "selftest.c" in meta["sources"] and "edgellm_neon.h" in meta["sources"]
    assert meta["selftest_cases"]["count"] == len(cases)
    from edgellm import __version__

    assert meta["edgellm_version"] == __version__
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\+00:00", meta["build_date"])
    expected = {tc.LIB_NAME.format(v) for v in tc.VARIANTS} | {f"selftest_{v}" for v in tc.VARIANTS} | {tc.CASES_NAME}
    assert set(meta["files"]) == expected
    assert {p.name for p in bundle.iterdir()} == expected | {"bundle.json"}
    for name, digest in meta["files"].items():
        assert tc._sha256(bundle / name) == digest
    for v in tc.VARIANTS:
        head = (bundle / f"selftest_{v}").read_bytes()[:20]
        assert head[:4] == b"\x7fELF" and struct.unpack("<H", head[18:20])[0] == 183   # EM_AARCH64
        lib = (bundle / tc.LIB_NAME.format(v)).read_bytes()[:20]
        assert struct.unpack("<HH", lib[16:20]) == (3, 183)                                # ET_DYN, AArch64


def test_rebuild_replaces_a_bundle_and_refuses_other_folders(tmp_path):
    src = _tiny_src(tmp_path)
    out = tmp_path / "out"
    try:
        tc.build_bundle(out=out, src_dir=src, progress=None)           # both variants
    except tc.ToolchainError as e:
        pytest.fail(f"{e}\n{INSTALL_HINT}")
    stale = tc.LIB_NAME.format("dotprod")
    assert (out / stale).is_file()
    # the old bundle's own files go, the new ones replace them (a file the old bundle.json does
    # not list is the user's: refused, test_a_bundle_with_files_it_does_not_list_is_not_replaced)
    tc.build_bundle(out=out, variants=["base"], src_dir=src, progress=None)
    assert not (out / stale).exists() and (out / "bundle.json").is_file()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "temporary folders left behind"
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "notes.txt").write_text("mine")
    with pytest.raises(tc.ToolchainError, match="not an edgellm bundle"):
        tc.build_bundle(out=precious, variants=["base"], src_dir=src, progress=None)
    assert (precious / "notes.txt").read_text() == "mine"
    # a compile error is a BuildError carrying the compiler's message, and leaves no bundle
    (src / "one.c").write_text("int el_one(void) { return }\n")
    with pytest.raises(tc.BuildError, match="one.c"):
        tc.build_bundle(out=tmp_path / "broken", variants=["base"], src_dir=src, progress=None)
    assert not (tmp_path / "broken").exists()


# ---- the cases file --------------------------------------------------------------------------


def test_cases_cover_every_op_and_are_deterministic(cases):
    ops = {c.op for c in cases}
    assert ops == set(range(1, 13))
    # the fused step in each of its modes: a chunk, the decode path, greedy from an id
    assert {c.ints[13] for c in cases if c.op == sc.OP_STEP} == {sc.STEP_CHUNK, sc.STEP_DECODE, sc.STEP_GREEDY}
    names = [c.name for c in cases]
    assert len(set(names)) == len(names) and all(re.fullmatch(r"[!-~]{1,127}", n) for n in names)
    wtypes = {c.ints[0] for c in cases if c.op == sc.OP_MATMUL}
    assert wtypes == {sc.EL_F32, sc.EL_F16, sc.EL_Q4_0, sc.EL_Q4_1, sc.EL_Q8_0}
    assert sc.encode_cases(sc.make_cases()) == sc.encode_cases(cases)
    pool = [c for c in cases if c.op == sc.OP_ATTN_POOL]
    assert {c.ints[5] for c in pool} == {sc.EL_F16, sc.EL_F32, sc.EL_KV_I8}
    assert any(c.ints[1] == 9 and c.ints[2] == 3 and c.ints[0] == 1 and c.ints[4] > 0 for c in pool)
    assert {c.ints[0] for c in cases if c.op == sc.OP_EMBED} == wtypes


def test_step_cases_catch_a_wrong_step():
    """The fused step's expected logits come from the reference forward: the bound passes the
    step's int8-activation rounding (measured ~5e-5 to 1e-4) and fails a step that drops a layer's
    FFN, which the helper's sabotage of a kernel stands for here. A self-test that never ran the
    fused step (the path every token takes) passed a library whose greedy argmax was off by one."""
    from edgellm import quant

    rng = np.random.default_rng(3)
    L, d, H, KVH, hd, ff = 1, 64, 4, 2, 16, 128

    def m(r, c):
        w = (rng.standard_normal((r, c)) / np.sqrt(c)).astype(np.float32)
        return quant.dequantize(quant.quantize(w, quant.T.Q4_0).reshape(-1), quant.T.Q4_0, (r, c))

    layer = (np.ones(d, np.float32), m((H + 2 * KVH) * hd, d), m(d, H * hd), np.ones(d, np.float32), m(2 * ff, d),
             m(d, ff))
    head, x = m(96, d), rng.standard_normal((5, d)).astype(np.float32)
    ang = np.arange(5)[:, None] * 10000.0 ** (-np.arange(0, hd, 2) / hd)
    cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    full = sc._step_forward([layer], np.ones(d, np.float32), head, x, cos, sin, H, KVH, hd, 1e-5)
    no_ffn = sc._step_forward([(*layer[:5], np.zeros((d, ff), np.float32))], np.ones(d, np.float32), head, x, cos,
                              sin, H, KVH, hd, 1e-5)
    err = float(np.sum((full - no_ffn) ** 2) / np.sum(full ** 2))
    assert err > 50 * sc.BOUND_STEP


def test_quantized_matmul_cases_are_fair(cases):
    """A correct kernel quantizes x to int8 blocks (header): the bound must leave it room. The
    ideal such kernel, simulated here, stays under a quarter of the bound on every case."""
    from gguf import GGMLQuantizationType as G

    from edgellm import quant

    gg = {sc.EL_Q4_0: G.Q4_0, sc.EL_Q4_1: G.Q4_1, sc.EL_Q8_0: G.Q8_0}
    for c in cases:
        if c.op != sc.OP_MATMUL or c.ints[0] not in gg:
            continue
        _, M, K, n_seg, has_bias = c.ints[:5]
        rows = c.ints[6 : 6 + n_seg]
        x = c.arrays[0]
        xq = quant.dequantize(quant.quantize(x, G.Q8_0).reshape(-1), G.Q8_0, x.shape)
        w = np.concatenate([quant.dequantize(r.reshape(-1), gg[c.ints[0]], (n, K))
                            for r, n in zip(c.arrays[1 : 1 + n_seg], rows)])
        y = xq @ w.T + (c.arrays[1 + n_seg] if has_bias else 0)
        want = c.arrays[-1]
        nmse = float(((y - want) ** 2).sum() / (want**2).sum())
        assert nmse < c.bound / 4, f"{c.name}: an int8-activation kernel reaches nmse {nmse:.2e}"


def _small_file(cases_list=None) -> bytes:
    a, b = np.arange(7, dtype=np.float32), np.ones(7, dtype=np.float32)
    small = [sc.Case(sc.OP_ADD, "add/n7", 1e-7, (7,), (), (a, b, a + b)),
             sc.Case(sc.OP_RMSNORM, "rmsnorm/t1_d7", 1e-7, (1, 7), (1e-5,), (a[None], b, a[None] / np.sqrt(
                 (a**2).mean() + 1e-5).astype(np.float32)))]
    return sc.encode_cases(cases_list or small)


def test_small_file_passes(host_selftest, tmp_path):
    f = tmp_path / "small.bin"
    f.write_bytes(_small_file())
    r = _run([host_selftest("base"), f])
    assert r.returncode == 0, r.stdout + r.stderr
    assert "PASS add/n7 nmse=" in r.stdout and "PASS rmsnorm/t1_d7/generic nmse=" in r.stdout


def test_a_filter_that_matches_no_case_is_an_error(host_selftest, tmp_path):
    """`-k nomatch` ran only the built-in checks and reported "36 passed, 0 failed", exit 0."""
    f = tmp_path / "small.bin"
    f.write_bytes(_small_file())
    r = _run([host_selftest("base"), "-k", "no-such-case", f])
    assert r.returncode == 2 and "-k no-such-case matches none of the" in r.stderr, r.stdout + r.stderr
    assert "PASS" not in r.stdout
    r = _run([host_selftest("base"), "-k", "add", f])
    assert r.returncode == 0 and "PASS add/n7" in r.stdout, r.stdout + r.stderr


def _expect_rejected(exe: Path, path: Path, what: str) -> None:
    r = _run([exe, path], timeout=60)
    assert r.returncode == 2, f"{what}: exit {r.returncode} (a negative value is a signal)\n{r.stdout}{r.stderr}"
    assert r.stderr.startswith("selftest: ") and r.stderr.count("\n") == 1, f"{what}: {r.stderr!r}"
    assert "PASS" not in r.stdout and "FAIL" not in r.stdout, f"{what}: cases ran before the file was validated"


def test_truncated_files_are_rejected(host_selftest, tmp_path):
    exe, data = host_selftest("base"), _small_file()
    f = tmp_path / "cut.bin"
    for n in range(len(data)):
        f.write_bytes(data[:n])
        _expect_rejected(exe, f, f"cut at {n} of {len(data)}")


def _patch(data: bytes, off: int, fmt: str, *vals) -> bytes:
    return data[:off] + struct.pack(fmt, *vals) + data[off + struct.calcsize(fmt):]


def test_corrupt_files_are_rejected(host_selftest, tmp_path):
    exe, good = host_selftest("base"), _small_file()
    # offsets in the first case (add/n7): op 16, name_len 20, name 24..30, bound 30, n_int 34,
    # ints 38, n_float 42, n_arrays 46, array 0: kind 50, reserved 54, count 58, data 66
    assert good[24:30] == b"add/n7"
    a, b = np.arange(7, dtype=np.float32), np.ones(7, dtype=np.float32)
    bad = {
        "empty": b"",
        "magic": b"XLSTCASE" + good[8:],
        "version 0": _patch(good, 8, "<I", 0),
        "version 2": _patch(good, 8, "<I", 2),
        "byte-swapped version": _patch(good, 8, ">I", 1),
        "zero cases": _patch(good, 12, "<I", 0),
        "more cases than bytes": _patch(good, 12, "<I", 100000),
        "case count over the cap": _patch(good, 12, "<I", 0xFFFFFFFF),
        "unknown op": _patch(good, 16, "<I", 99),
        "name length 0": _patch(good, 20, "<I", 0),
        "name length huge": _patch(good, 20, "<I", 0x7FFFFFFF),
        "name with a space": good[:24] + b"add n7" + good[30:],
        "bound NaN": _patch(good, 30, "<f", float("nan")),
        "bound negative": _patch(good, 30, "<f", -1.0),
        "int count huge": _patch(good, 34, "<I", 1 << 30),
        "n = 0": _patch(good, 38, "<i", 0),
        "n negative": _patch(good, 38, "<i", -7),
        "n larger than the arrays": _patch(good, 38, "<i", 8),
        "float count over the cap": _patch(good, 42, "<I", 17),
        "array count over the cap": _patch(good, 46, "<I", 65),
        "array kind 3": _patch(good, 50, "<I", 3),
        "reserved word": _patch(good, 54, "<I", 1),
        "array count past the end": _patch(good, 58, "<Q", 1 << 40),
        "array count overflowing x4": _patch(good, 58, "<Q", (1 << 62) + 1),
        "trailing byte": good + b"\0",
        "an array of the wrong kind": _small_file(
            [sc.Case(sc.OP_ADD, "add", 1e-7, (7,), (), (a, b.view(np.uint8), a))]),
        "matmul K not a multiple of 32": sc.encode_cases([sc.Case(
            sc.OP_MATMUL, "mm", 1e-3, (sc.EL_Q4_0, 1, 40, 1, 0, 0, 1), (),
            (np.zeros(40, np.float32), np.zeros(18, np.uint8), np.zeros(1, np.float32)))]),
        "matmul segment too short": sc.encode_cases([sc.Case(
            sc.OP_MATMUL, "mm", 1e-3, (sc.EL_Q8_0, 1, 32, 1, 0, 0, 2), (),
            (np.zeros(32, np.float32), np.zeros(34, np.uint8), np.zeros(2, np.float32)))]),
        "attention H not a multiple of KVH": sc.encode_cases([sc.Case(
            sc.OP_ATTN_DENSE, "at", 1e-3, (1, 3, 2, 4, 0), (),
            (np.zeros(12, np.float32), np.zeros(8, np.float32), np.zeros(8, np.float32), np.zeros(12, np.float32)))]),
        "block table entry out of range": sc.encode_cases([sc.Case(
            sc.OP_ATTN_POOL, "ap", 1e-3, (1, 1, 1, 4, 0, sc.EL_F32, 2, 1, 0, 1), (),
            (np.zeros(4, np.float32), np.zeros(8, np.float32).view(np.uint8), np.zeros(8, np.float32).view(np.uint8),
             np.array([1], np.int32), np.zeros(4, np.float32)))]),
        "block table too short": sc.encode_cases([sc.Case(
            sc.OP_ATTN_POOL, "ap", 1e-3, (1, 1, 1, 4, 2, sc.EL_F32, 2, 1, 0, 1), (),
            (np.zeros(4, np.float32), np.zeros(8, np.float32).view(np.uint8), np.zeros(8, np.float32).view(np.uint8),
             np.array([0], np.int32), np.zeros(4, np.float32)))]),
        "layer out of range": sc.encode_cases([sc.Case(
            sc.OP_ATTN_POOL, "ap", 1e-3, (1, 1, 1, 4, 0, sc.EL_F32, 2, 1, 1, 1), (),
            (np.zeros(4, np.float32), np.zeros(8, np.float32).view(np.uint8), np.zeros(8, np.float32).view(np.uint8),
             np.array([0], np.int32), np.zeros(4, np.float32)))]),
        "rope_dim odd": sc.encode_cases([sc.Case(
            sc.OP_ROPE, "ro", 1e-7, (1, 1, 4, 3, 0, 0), (),
            (np.zeros(4, np.float32), np.zeros(1, np.float32), np.zeros(1, np.float32), np.zeros(4, np.float32)))]),
    }
    for what, data in bad.items():
        f = tmp_path / "bad.bin"
        f.write_bytes(data)
        _expect_rejected(exe, f, what)
    _expect_rejected(exe, tmp_path / "missing.bin", "missing file")
    _expect_rejected(exe, tmp_path, "a directory")
    for argv in ([], ["-t", "0", "x"], ["-z", "x"], ["a", "b"]):
        r = _run([exe, *argv])
        assert r.returncode == 2 and "usage" in r.stderr, argv


def test_many_random_corruptions_never_crash(host_selftest, tmp_path):
    """Random byte flips: each run ends in 0, 1 (a case now fails) or 2 (rejected), never a signal."""
    exe, good = host_selftest("base"), bytearray(_small_file())
    rng = np.random.default_rng(7)
    f = tmp_path / "flip.bin"
    for _ in range(200):
        data = bytearray(good)
        for pos in rng.integers(0, len(data), rng.integers(1, 4)):
            data[pos] = rng.integers(0, 256)
        f.write_bytes(bytes(data))
        r = _run([exe, f], timeout=60)
        assert r.returncode in (0, 1, 2), f"exit {r.returncode} for {bytes(data).hex()}"


# ---- toolchain errors ------------------------------------------------------------------------


def test_unknown_target():
    with pytest.raises(tc.ToolchainError, match="unknown target 'riscv64-linux-gnu'.*aarch64-linux-gnu"):
        tc.find_toolchain("riscv64-linux-gnu")
    assert issubclass(tc.ToolchainError, EdgeLLMError)


def test_missing_cross_compiler_names_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setattr(tc, "_zig_available", lambda: False)
    with pytest.raises(tc.ToolchainError, match="gcc-aarch64-linux-gnu.*ziglang"):
        tc.find_toolchain("aarch64-linux-gnu", env={"PATH": str(tmp_path)})
    with pytest.raises(tc.ToolchainError, match="gcc-aarch64-linux-gnu"):
        tc.build_bundle(out=tmp_path / "b", env={"PATH": str(tmp_path)}, progress=None)
    assert not (tmp_path / "b").exists()


def test_cross_compiler_found_on_path(tmp_path):
    fake = tmp_path / "aarch64-linux-gnu-gcc"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    t = tc.find_toolchain("aarch64-linux-gnu", env={"PATH": str(tmp_path)})
    assert t.kind == "gcc" and t.path == str(fake)


def test_android_ndk_errors_and_lookup(tmp_path):
    with pytest.raises(tc.ToolchainError, match="ANDROID_NDK_HOME is not set"):
        tc.find_toolchain("aarch64-linux-android", env={})
    with pytest.raises(tc.ToolchainError, match="is not an NDK"):
        tc.find_toolchain("aarch64-linux-android", env={"ANDROID_NDK_HOME": str(tmp_path)})
    bindir = tmp_path / "toolchains" / "llvm" / "prebuilt" / tc._ndk_host_tag() / "bin"
    bindir.mkdir(parents=True)
    (bindir / "aarch64-linux-android30-clang").write_text("")
    with pytest.raises(tc.ToolchainError, match="API 28.*API levels it has: 30"):
        tc.find_toolchain("aarch64-linux-android", env={"ANDROID_NDK_HOME": str(tmp_path)})
    t = tc.find_toolchain("aarch64-linux-android30", env={"ANDROID_NDK_HOME": str(tmp_path)})
    assert (t.kind, t.api, t.target) == ("ndk-clang", 30, "aarch64-linux-android")
    t = tc.find_toolchain("aarch64-linux-android", api=30, env={"ANDROID_NDK_ROOT": str(tmp_path)})
    assert t.path.endswith("aarch64-linux-android30-clang")
    # API levels that were silently replaced: 0 built API 28, a target's and --api's disagreeing took --api's,
    # --api with the gnu target was ignored
    env = {"ANDROID_NDK_HOME": str(tmp_path)}
    for target, api, says in (("aarch64-linux-android0", None, "starts at API 21"),
                              ("aarch64-linux-android", 0, "starts at API 21"),
                              ("aarch64-linux-android30", 21, "names Android API 30 and --api says 21"),
                              ("aarch64-linux-gnu", 21, "applies to aarch64-linux-android only")):
        with pytest.raises(tc.ToolchainError, match=says):
            tc.find_toolchain(target, api=api, env=env)


def test_cpu_flags_and_validation():
    assert tc.variant_flags("base") == ["-march=armv8-a"]
    assert tc.variant_flags("base", "cortex-a78") == ["-march=armv8-a", "-mtune=cortex-a78"]
    assert tc.variant_flags("dotprod", "cortex-a78") == ["-mcpu=cortex-a78+dotprod+fp16+nosve"]
    for bad in ("cortex-a78 -fplugin=x", "-O0", "Cortex_A78", ""):
        with pytest.raises(tc.ToolchainError, match="not a CPU name"):
            tc.variant_flags("dotprod", bad)
    assert tc.variant_flags("base", "cortex-a78", "zig") == ["-mcpu=generic"]
    assert tc.variant_flags("dotprod", None, "zig") == ["-mcpu=generic+v8_2a+dotprod+fullfp16"]
    assert tc.variant_flags("dotprod", "cortex-a78", "zig") == ["-mcpu=cortex_a78+dotprod+fullfp16"]
    with pytest.raises(tc.ToolchainError, match="unknown variant"):
        tc.variant_flags("sve", None)


def _tiny_src(tmp_path):
    """A tiny source tree: the toolchain's plumbing, not the kernels."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "edgellm_neon.h").write_text("int el_one(void);\n")
    (src / "one.c").write_text('#include "edgellm_neon.h"\nint el_one(void) { return 1; }\n')
    (src / "selftest.c").write_text("int main(void) { return 0; }\n")
    return src


def test_cpu_without_dotprod_builds_base_only(tmp_path):
    """--cpu cortex-a72 (one of the tool's own examples) compiled everything and then failed in
    gcc on the dotprod variant; such a library could not run on that core anyway."""
    src, said = _tiny_src(tmp_path), []
    out = tc.build_bundle(out=tmp_path / "a72", cpu="cortex-a72", src_dir=src, progress=said.append)
    meta = json.loads((out / "bundle.json").read_text())
    assert set(meta["variants"]) == {"base"} and meta["run"].startswith("./selftest_base")
    assert any("base variant only" in m for m in said)
    with pytest.raises(tc.ToolchainError, match="runs the base variant only"):
        tc.build_bundle(out=tmp_path / "d", cpu="cortex-a53", variants=["dotprod"], src_dir=src, progress=None)
    # a core with SVE: the dotprod library must not need it (the loader checks dotprod and fp16 only)
    out = tc.build_bundle(out=tmp_path / "x2", cpu="cortex-x2", src_dir=src, progress=None)
    feats = json.loads((out / "bundle.json").read_text())["variants"]["dotprod"]["features"]
    assert {"dotprod", "fp16"} <= set(feats) and "sve" not in feats


def test_out_that_is_no_bundle_is_refused_before_any_work(tmp_path, monkeypatch):
    """A project folder with a bundle.json of its own was replaced whole (its sources gone); '.'
    failed after the whole compile with a traceback (ValueError: empty name)."""
    src = _tiny_src(tmp_path)
    proj = tmp_path / "proj"
    (proj / "src").mkdir(parents=True)
    (proj / "src" / "main.c").write_text("int main(void) { return 0; }\n")
    (proj / "bundle.json").write_text('{"name": "my-app"}')
    with pytest.raises(tc.ToolchainError, match="not an edgellm bundle"):
        tc.build_bundle(out=proj, src_dir=src, progress=None)
    assert (proj / "src" / "main.c").is_file() and (proj / "bundle.json").read_text() == '{"name": "my-app"}'
    monkeypatch.chdir(proj)
    for out in (".", ""):
        with pytest.raises(tc.ToolchainError, match="not an edgellm bundle"):
            tc.build_bundle(out=out, src_dir=src, progress=None)


def test_a_bundle_with_files_it_does_not_list_is_not_replaced(tmp_path):
    """A bundle folder the user added a file to (or a folder holding a copied bundle.json) was
    replaced whole by the next build: the added files were deleted."""
    src = _tiny_src(tmp_path)
    out = tc.build_bundle(out=tmp_path / "b", variants=["base"], src_dir=src, progress=None)
    (out / "NOTES.txt").write_text("my notes")
    with pytest.raises(tc.ToolchainError, match="files the bundle does not list"):
        tc.build_bundle(out=out, variants=["base"], src_dir=src, progress=None)
    assert (out / "NOTES.txt").read_text() == "my notes"
    flat = tmp_path / "flat"
    flat.mkdir()
    (flat / "bundle.json").write_bytes((out / "bundle.json").read_bytes())
    (flat / "thesis.txt").write_text("chapter 1")
    with pytest.raises(tc.ToolchainError, match="not an edgellm bundle"):
        tc.build_bundle(out=flat, variants=["base"], src_dir=src, progress=None)
    assert (flat / "thesis.txt").read_text() == "chapter 1"
    (out / "NOTES.txt").unlink()            # the bundle's own files alone: rebuilt in place
    assert tc.build_bundle(out=out, variants=["base"], src_dir=src, progress=None) == out


def test_a_bad_cpu_name_is_refused_before_anything_is_printed(tmp_path):
    """`--cpu cortex-a78+nodotprod` first said it would build the base variant only, and
    `--cpu Cortex-A78` printed the compiler line, before the name was refused."""
    src, said = _tiny_src(tmp_path), []
    for bad in ("cortex-a78+nodotprod", "Cortex-A78"):
        with pytest.raises(tc.ToolchainError, match="not a CPU name"):
            tc.build_bundle(out=tmp_path / "x", cpu=bad, src_dir=src, progress=said.append,
                            env={"PATH": ""})     # (no compiler needed: refused before the lookup)
    assert said == [] and not (tmp_path / "x").exists()


def test_an_out_below_a_file_says_so(tmp_path):
    src = _tiny_src(tmp_path)
    (tmp_path / "afile").write_text("x")
    with pytest.raises(tc.ToolchainError, match=r"afile is a file, not a folder"):
        tc.build_bundle(out=tmp_path / "afile" / "sub", variants=["base"], src_dir=src, progress=None)


def test_cpu_features_from_the_compiler():
    try:
        t = tc.find_toolchain("aarch64-linux-gnu")
    except tc.ToolchainError as e:
        pytest.fail(f"{e}\n{INSTALL_HINT}")
    src = tc.neon_source_dir()
    assert tc.probe_features(t, tc.compile_flags("base", src, "cortex-a78")) == ["neon"]
    assert tc.probe_features(t, tc.compile_flags("dotprod", src, "cortex-a78")) == ["neon", "dotprod", "fp16"]
    assert tc.probe_features(t, tc.compile_flags("dotprod", src, "cortex-a53")) == ["neon", "dotprod", "fp16"]
    with pytest.raises(tc.ToolchainError, match="rejects the flags"):
        tc.probe_features(t, tc.compile_flags("dotprod", src, "cortex-z99"))


def test_flags_match_the_other_builds():
    """setup.py, tools/build_neon.py and the cross build compile the same ISA per variant."""
    assert tc.ARM_FLAGS == _build_neon().ARM_FLAGS
    setup_py = (ROOT / "setup.py").read_text()
    for flags in tc.ARM_FLAGS.values():
        for f in flags:
            assert f'"{f}"' in setup_py


def test_neon_sources_are_packaged():
    tomllib = pytest.importorskip("tomllib")
    conf = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert "edgellm.neon_src" in conf["packages"]
    assert conf["package-dir"]["edgellm.neon_src"] == "neon"
    assert {"*.c", "*.h"} <= set(conf["package-data"]["edgellm.neon_src"])
    assert tc.neon_source_dir() == NEON


def test_cross_build_cli_reports_errors(tmp_path):
    r = _run([sys.executable, ROOT / "tools" / "cross_build.py", "--target", "mips-linux-gnu", "--out", tmp_path / "x"])
    assert r.returncode == 1 and "unknown target 'mips-linux-gnu'" in r.stderr and "Traceback" not in r.stderr
    # an OSError (an --out it cannot write beside) is one line too; it was a traceback
    r = _run([sys.executable, ROOT / "tools" / "cross_build.py", "--out", "/proc/x", "--variant", "base"])
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "--out /proc/x: cannot write a file in /proc" in r.stderr, r.stderr    # (checked before the build)
