"""The size bound of the npu graph caches (backends/npu_cache.py): nothing evicted them, and a
probe filled 1.8 GiB of a phone's storage after ten configurations. Least recently used files go
first (mtime, refreshed on each hit), the cap holds, the file just written and files of live
subgraphs stay, links are neither counted nor followed, files another process removed are
tolerated, and a bad EDGELLM_NPU_CACHE_MB is a ConfigError. Fake cache files of 1 KiB and caps
of a few KiB keep it fast; the ONNX and LiteRT paths are checked on tiny synthetic graphs."""
from __future__ import annotations

import gc
import logging
import os

import numpy as np
import pytest

from edgellm.backends import npu_cache
from edgellm.errors import ConfigError

KIB = 1024


def _cap_kib(monkeypatch, kib: int) -> None:
    # kib / 1024 MiB is a binary fraction: the setting's float gives exactly kib KiB
    monkeypatch.setenv(npu_cache.CAP_ENV, str(kib / 1024))


def _file(folder, name: str, mtime: float | None, size: int = KIB):
    p = folder / name
    p.write_bytes(b"m" * size)
    if mtime is not None:
        os.utime(p, (mtime, mtime))
    return p


def _names(folder, suffix=".onnx") -> set[str]:
    return {p.name for p in folder.iterdir() if p.name.endswith(suffix)}


# --- the setting --------------------------------------------------------------------------------

def test_the_cap_setting_is_parsed(monkeypatch):
    monkeypatch.delenv(npu_cache.CAP_ENV, raising=False)
    assert npu_cache.cap_bytes() == 1024 * 2**20                     # default 1 GiB
    for raw, want in (("512", 512 * 2**20), ("0.5", 2**19), (" 2 ", 2 * 2**20), ("", 1024 * 2**20)):
        monkeypatch.setenv(npu_cache.CAP_ENV, raw)
        assert npu_cache.cap_bytes() == want, raw


@pytest.mark.parametrize("raw", ["0", "-1", "abc", "nan", "inf", "1GB"])
def test_a_bad_cap_setting_is_a_config_error(monkeypatch, raw):
    monkeypatch.setenv(npu_cache.CAP_ENV, raw)
    with pytest.raises(ConfigError) as e:
        npu_cache.cap_bytes()
    assert npu_cache.CAP_ENV in str(e.value) and repr(raw) in str(e.value), str(e.value)


# --- eviction on fake files ---------------------------------------------------------------------

def test_least_recently_used_go_first_and_a_hit_refreshes(tmp_path, monkeypatch, caplog):
    _cap_kib(monkeypatch, 3)
    a, b, c, d = (_file(tmp_path, f"{n}.onnx", t) for n, t in zip("abcd", (1000, 2000, 3000, 4000)))
    npu_cache.touch(a)                         # a cache hit: a is now the most recently used
    new = _file(tmp_path, "new.onnx", None)    # 5 KiB in all, cap 3 KiB
    with caplog.at_level(logging.INFO, logger="edgellm"):
        assert npu_cache.evict(tmp_path, ".onnx", keep=new) == 2
    assert _names(tmp_path) == {"a.onnx", "d.onnx", "new.onnx"}       # b and c were the oldest
    lines = [r.getMessage() for r in caplog.records if "npu cache" in r.getMessage()]
    assert len(lines) == 1 and "evicted 2 file(s)" in lines[0] and "to stay under" in lines[0], lines


def test_the_cap_holds_and_other_files_are_left_alone(tmp_path, monkeypatch):
    _cap_kib(monkeypatch, 10)
    rng = np.random.default_rng(0)
    for i in range(30):
        _file(tmp_path, f"g{i}.onnx", 1000 + i, int(rng.integers(1, 3 * KIB)))
    others = [_file(tmp_path, "notes.txt", 1, 50 * KIB), _file(tmp_path, "g.tflc", 1, 50 * KIB),
              _file(tmp_path, ".g0.onnx.pid1.abc.tmp", 1, 50 * KIB)]        # (a writer's temp file)
    new = _file(tmp_path, "new.onnx", None)
    assert npu_cache.evict(tmp_path, ".onnx", keep=new) > 0
    assert npu_cache.usage(tmp_path, ".onnx").bytes <= 10 * KIB
    assert new.exists() and all(p.exists() for p in others)
    # a second pass under the cap removes nothing
    assert npu_cache.evict(tmp_path, ".onnx", keep=new) == 0


def test_the_new_file_stays_even_alone_over_the_cap(tmp_path, monkeypatch):
    _cap_kib(monkeypatch, 1)
    old = _file(tmp_path, "old.onnx", 1000, 4 * KIB)
    new = _file(tmp_path, "new.onnx", 500, 8 * KIB)     # older mtime than old.onnx: still kept
    assert npu_cache.evict(tmp_path, ".onnx", keep=new) == 1
    assert new.exists() and not old.exists()
    assert npu_cache.evict(tmp_path, ".onnx", keep=new) == 0 and new.exists()


def test_a_file_in_use_by_a_live_subgraph_stays_until_it_is_gone(tmp_path, monkeypatch):
    _cap_kib(monkeypatch, 1)

    class Subgraph:
        pass

    used = _file(tmp_path, "used.onnx", 1000)
    live = Subgraph()
    npu_cache.hold(live, used)
    npu_cache.hold(Subgraph(), used)          # a second holder, dropped at once: one still holds it
    gc.collect()
    assert npu_cache.evict(tmp_path, ".onnx", keep=_file(tmp_path, "n1.onnx", None)) == 0
    assert used.exists()
    del live
    gc.collect()
    assert npu_cache.evict(tmp_path, ".onnx", keep=_file(tmp_path, "n2.onnx", None)) == 2
    assert _names(tmp_path) == {"n2.onnx"}


def test_links_are_neither_followed_counted_nor_removed(tmp_path, monkeypatch):
    _cap_kib(monkeypatch, 2)
    cache, outside = tmp_path / "cache", tmp_path / "outside"
    cache.mkdir()
    outside.mkdir()
    target = _file(outside, "big.onnx", 500, 100 * KIB)
    link = cache / "link.onnx"
    os.symlink(target, link)
    os.utime(link, (100, 100), follow_symlinks=False)    # the oldest entry of the folder
    os.symlink(outside, cache / "dir.onnx")               # a link to a folder
    old = _file(cache, "old.onnx", 1000)
    new = _file(cache, "new.onnx", None)
    assert npu_cache.usage(cache, ".onnx") == npu_cache.Usage(2, 2 * KIB)  # the 100 KiB target not counted
    assert npu_cache.evict(cache, ".onnx", keep=new) == 0                 # 2 KiB: under the cap
    _file(cache, "old2.onnx", 2000)
    assert npu_cache.evict(cache, ".onnx", keep=new) == 1                 # old.onnx, not the link
    assert not old.exists() and link.is_symlink() and target.exists() and (cache / "dir.onnx").is_symlink()
    npu_cache.touch(link)                                                  # a hit never moves the target's mtime
    assert target.stat().st_mtime == 500


def test_files_another_process_removes_are_tolerated(tmp_path, monkeypatch):
    _cap_kib(monkeypatch, 2)
    for n, t in zip("abcd", (1000, 2000, 3000, 4000)):
        _file(tmp_path, f"{n}.onnx", t)
    new = _file(tmp_path, "new.onnx", None)
    listed = npu_cache._entries

    def then_another_process_evicts(folder, suffix):
        out = listed(folder, suffix)
        (tmp_path / "a.onnx").unlink()        # between the listing and the unlink
        return out

    monkeypatch.setattr(npu_cache, "_entries", then_another_process_evicts)
    assert npu_cache.evict(tmp_path, ".onnx", keep=new) == 2   # b and c; a was gone already
    assert _names(tmp_path) == {"d.onnx", "new.onnx"}
    monkeypatch.undo()
    assert npu_cache.usage(tmp_path / "missing", ".onnx") == npu_cache.Usage(0, 0)
    assert npu_cache.evict(tmp_path / "missing", ".onnx", keep=new) == 0
    npu_cache.touch(tmp_path / "missing.onnx")                 # no exception


# --- the runtimes' caches -----------------------------------------------------------------------

def _onnx_graph(seed: int, name: str):
    from edgellm.backends.npu_graphs import LinearGraph, quantize

    rng = np.random.default_rng(seed)
    return LinearGraph(name, quantize((rng.standard_normal((96, 64)) / 8).astype(np.float32), "int8b"), 32)


def test_the_onnx_cache_evicts_after_a_write_and_keeps_live_subgraphs(tmp_path, monkeypatch):
    pytest.importorskip("onnx", reason="onnx is not installed (the npu extra)")
    pytest.importorskip("onnxruntime", reason="onnxruntime is not installed (the npu extra)")
    from edgellm.backends import npu_onnx

    cpu = ["CPUExecutionProvider"]
    g1, g2, g3 = (_onnx_graph(i, f"blk.{i}.qkv") for i in range(3))
    _cap_kib(monkeypatch, 1)                   # smaller than one model: only the protections keep files
    s1 = npu_onnx.compile(g1, providers=cpu, cache_dir=tmp_path)
    p1 = npu_onnx.cache_path(g1, tmp_path)
    os.utime(p1, (1000, 1000))
    s2 = npu_onnx.compile(g2, providers=cpu, cache_dir=tmp_path)
    assert p1.exists()                         # in use by s1, though the oldest and over the cap
    os.utime(p1, (1000, 1000))
    before = npu_onnx.stats.loaded
    npu_onnx.compile(g1, providers=cpu, cache_dir=tmp_path)    # a hit refreshes its mtime
    assert npu_onnx.stats.loaded == before + 1 and p1.stat().st_mtime > 1000
    del s1, s2
    gc.collect()
    npu_onnx.compile(g3, providers=cpu, cache_dir=tmp_path)
    assert _names(tmp_path) == {npu_onnx.cache_path(g3, tmp_path).name}
    monkeypatch.setenv(npu_cache.CAP_ENV, "lots")
    with pytest.raises(ConfigError):           # refused on a hit as on a miss
        npu_onnx.compile(g3, providers=cpu, cache_dir=tmp_path)


def test_the_litert_cache_evicts_after_a_write_and_a_hit_refreshes(tmp_path, monkeypatch):
    pytest.importorskip("tflite", reason="the tflite schema package (the [npu] extra) writes the models")
    from edgellm.backends import npu_graphs, npu_tflite

    rng = np.random.default_rng(3)
    g1, g2, g3 = (npu_graphs.LinearGraph(f"blk.{i}.attn_out", npu_graphs.quantize(
        rng.standard_normal((8, 64)).astype(np.float32), "int8s"), 4) for i in range(3))
    npu_tflite.load_or_build(g1, tmp_path)
    npu_tflite.load_or_build(g2, tmp_path)
    p1, p2, p3 = (npu_tflite.cache_path(g, tmp_path) for g in (g1, g2, g3))
    os.utime(p1, (1000, 1000))
    os.utime(p2, (2000, 2000))
    npu_tflite.load_or_build(g1, tmp_path)     # a hit: g1 is now newer than g2
    assert p1.stat().st_mtime > 2000
    size = p1.stat().st_size                   # (the three graphs have the same shapes: the same size)
    monkeypatch.setattr(npu_cache, "cap_bytes", lambda *a: int(2.5 * size))
    npu_tflite.load_or_build(g3, tmp_path)     # over the cap: g2, the least recently used, goes
    assert _names(tmp_path, ".tflc") == {p1.name, p3.name}


def test_cache_info_shows_the_npu_caches_against_the_cap(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from edgellm.cli import app

    home = tmp_path / "home"
    monkeypatch.setenv("EDGELLM_HOME", str(home))
    monkeypatch.setenv(npu_cache.CAP_ENV, "256")
    (home / "cache" / "npu" / "onnx").mkdir(parents=True)
    _file(home / "cache" / "npu" / "onnx", "g.onnx", None, 2**20)
    runner = CliRunner()
    r = runner.invoke(app, ["cache", "info"])
    assert r.exit_code == 0, r.output
    assert "npu/onnx/    1 file(s), 1.0 MiB of a 256 MiB cap (EDGELLM_NPU_CACHE_MB)" in r.stdout, r.stdout
    assert "npu/tflite/  0 file(s), 0.0 MiB of a 256 MiB cap" in r.stdout, r.stdout
    monkeypatch.setenv(npu_cache.CAP_ENV, "-5")
    r = runner.invoke(app, ["cache", "info"])
    assert r.exit_code != 0 and "EDGELLM_NPU_CACHE_MB='-5' is invalid" in r.output, r.output
