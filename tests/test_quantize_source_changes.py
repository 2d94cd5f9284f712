"""`edgellm quantize` against a source file that another process changes while it runs (a download
restarting, a second quantize writing to the model's path): a file that shrinks is a
ModelFormatError naming the file and the tensor, not a SIGBUS from a mapped page past the new end;
a file rewritten, replaced or removed is a ModelFormatError before the rename; either way no
output and no temporary file is left, and an existing output is untouched. A run on a file left
alone writes what the memory-mapped reads wrote, byte for byte."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

sys.path.insert(0, str(Path(__file__).parent))
from synthetic import write_tiny_model  # noqa: E402

from edgellm import requant  # noqa: E402
from edgellm.errors import ModelFormatError  # noqa: E402
from edgellm.model import gguf_file  # noqa: E402
from edgellm.model.loader import open_model  # noqa: E402
from edgellm.requant import requantize_gguf  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
SMALL = dict(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, d_ff=128)
# converted and copied tensors both: each kind reads its source bytes
FORMATS = {"blk.0.ffn_down.weight": "int4-32", "blk.1.ffn_up.weight": "int8", "blk.0.attn_q.weight": "q4_1",
           "blk.1.attn_k.weight": "f16", "token_embd.weight": "q8_0", "blk.1.ffn_gate.weight": "q4_0"}


def _leftovers(d: Path, keep: set[str]) -> list[str]:
    return sorted(p.name for p in d.iterdir() if p.name not in keep)


def _age(path: str) -> None:
    """Set the file's times an hour back. A rewrite within the same tick of a coarse file-system
    clock (ext4 stamps with the jiffy clock) can keep mtime_ns; in a test the rewrite follows the
    write by microseconds, so without this the check could not see it."""
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns - 3600 * 10**9, st.st_mtime_ns - 3600 * 10**9))


# ---------------------------------------------------------------------------------------------
# a source that shrinks: in a child process, so that a SIGBUS is a negative return code


_TRUNCATE_CHILD = textwrap.dedent("""
    import os, sys
    from edgellm.errors import ModelFormatError
    from edgellm.model.loader import open_model
    from edgellm.requant import requantize_gguf
    src, dst = sys.argv[1], sys.argv[2]
    formats = eval(sys.argv[3])

    # the file is cut at the page that holds the next tensor's start, just before a tensor that is
    # converted (read by numpy from a mapping: a page past the end is SIGBUS) or, with no
    # conversions, one that is copied (written from a mapping by write(2): a short write)
    infos = list(open_model(src).gguf.tensors.values())
    cut = next((i for i, t in enumerate(infos) if i > 0 and t.name in formats), 1)

    def progress(done, total):
        if done == cut:
            os.truncate(src, infos[cut].offset // 4096 * 4096)

    try:
        requantize_gguf(src, dst, formats, progress=progress)
    except ModelFormatError as e:
        print(e)
        sys.exit(3)
    print("no error")
""")


def _child_env(tmp_path: Path) -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(REPO), EDGELLM_HOME=str(tmp_path / "home"))


@pytest.mark.parametrize("formats", [FORMATS, {}], ids=["converting", "copying"])
@pytest.mark.parametrize("existing", [False, True])
def test_a_source_truncated_mid_run_is_a_typed_error_not_sigbus(tmp_path, formats, existing):
    m = write_tiny_model(tmp_path / "src.gguf", tensor_type=QT.F32, seed=5, **SMALL)
    dst = tmp_path / "dst.gguf"
    if existing:
        dst.write_bytes(b"previous contents")
    r = subprocess.run([sys.executable, "-c", _TRUNCATE_CHILD, m.path, str(dst), repr(formats)],
                       capture_output=True, text=True, timeout=120, cwd=tmp_path, env=_child_env(tmp_path))
    assert r.returncode == 3, f"rc {r.returncode} (negative: killed by signal {-r.returncode})\n{r.stdout}{r.stderr}"
    msg = r.stdout.strip()
    assert msg.startswith(f"{m.path}: tensor '"), msg           # names the file and the tensor
    assert "changed" in msg and f"now {os.path.getsize(m.path)} bytes" in msg, msg
    assert _leftovers(tmp_path, {"src.gguf", "dst.gguf", "home"}) == []   # no temporary file
    if existing:
        assert dst.read_bytes() == b"previous contents"
    else:
        assert not dst.exists()


def test_the_cli_names_a_truncated_source_in_one_line(tmp_path):
    """What a user sees: one error line, exit 1, no traceback, no output."""
    m = write_tiny_model(tmp_path / "src.gguf", tensor_type=QT.F32, seed=5, **SMALL)
    dst = tmp_path / "out.gguf"
    child = textwrap.dedent("""
        import os, sys
        from edgellm import cli, requant
        src = sys.argv[1]
        real = requant._Writer.write_tensor_data

        def write_then_truncate(self, *a, **k):
            real(self, *a, **k)
            if os.path.getsize(src) > 1000:
                os.truncate(src, 1000)      # into the header's tail: every tensor is past the end

        requant._Writer.write_tensor_data = write_then_truncate
        sys.argv = ["edgellm", "quantize", src, "--plan", "fast", "-o", sys.argv[2]]
        cli.main()
    """)
    r = subprocess.run([sys.executable, "-c", child, m.path, str(dst)], capture_output=True, text=True,
                       timeout=120, cwd=tmp_path, env=_child_env(tmp_path))
    assert r.returncode == 1, f"rc {r.returncode}\n{r.stdout}{r.stderr}"
    assert "Traceback" not in r.stderr, r.stderr
    err = [ln for ln in r.stderr.splitlines() if m.path in ln]
    assert len(err) == 1 and "tensor '" in err[0] and "1000 bytes" in err[0], r.stderr
    assert _leftovers(tmp_path, {"src.gguf", "home"}) == []


# ---------------------------------------------------------------------------------------------
# a source rewritten, replaced or removed: caught before the output is renamed into place


def _rewrite_same_size(src: str) -> None:
    data = bytearray(Path(src).read_bytes())
    data[-64:] = bytes(255 - b for b in data[-64:])     # the last tensor's bytes, read later
    with open(src, "r+b") as f:                         # in place: same inode, same size
        f.write(data)


def _truncate_and_restore(src: str) -> None:
    data = Path(src).read_bytes()      # a download that restarts and gets back to the same size
    with open(src, "r+b") as f:
        f.truncate(len(data) // 2)
        f.seek(0)
        f.write(data)


def _rewrite_mtime_restored(src: str) -> None:
    st = os.stat(src)
    time.sleep(0.05)     # (past a tick of the kernel's coarse file clock, which stamps ctime)
    _rewrite_same_size(src)
    os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns))   # size, inode and mtime as before


def _replace(src: str) -> None:
    tmp = src + ".new"
    Path(tmp).write_bytes(Path(src).read_bytes())
    os.replace(tmp, src)


@pytest.mark.parametrize("change,match", [
    (_rewrite_same_size, "modification time"),
    (_truncate_and_restore, "modification time"),
    (_rewrite_mtime_restored, "its ctime changed"),
    (_replace, "replaced by another file"),
    (os.unlink, "removed"),
], ids=["rewritten-same-size", "truncated-and-restored", "rewritten-mtime-restored", "replaced", "removed"])
@pytest.mark.parametrize("existing", [False, True])
def test_a_source_changed_mid_run_is_a_typed_error_and_no_output(tmp_path, change, match, existing):
    m = write_tiny_model(tmp_path / "src.gguf", tensor_type=QT.Q8_0, seed=6, **SMALL)
    _age(m.path)
    dst = tmp_path / "dst.gguf"
    if existing:
        dst.write_bytes(b"previous contents")

    def progress(done, total):
        if done == 2:
            change(m.path)

    with pytest.raises(ModelFormatError, match=match) as e:
        requantize_gguf(m.path, dst, FORMATS, progress=progress)
    assert e.value.path == m.path and e.value.field == "file"
    assert "no output was written" in str(e.value)
    assert _leftovers(tmp_path, {"src.gguf", "dst.gguf"}) == []
    if existing:
        assert dst.read_bytes() == b"previous contents"
    else:
        assert not dst.exists()


def test_a_source_changed_between_the_parse_and_the_reads(tmp_path, monkeypatch):
    """The header is parsed by path, the tensors read through a descriptor opened after: a
    rewrite in between is caught too (the parsed offsets would not describe the bytes read)."""
    m = write_tiny_model(tmp_path / "src.gguf", tensor_type=QT.F32, seed=6, **SMALL)
    _age(m.path)
    real = open_model

    def open_then_rewrite(path):
        mf = real(path)
        _rewrite_same_size(m.path)
        return mf

    monkeypatch.setattr("edgellm.model.loader.open_model", open_then_rewrite)
    with pytest.raises(ModelFormatError, match="modification time"):
        requantize_gguf(m.path, tmp_path / "dst.gguf", FORMATS)
    assert _leftovers(tmp_path, {"src.gguf"}) == []


# ---------------------------------------------------------------------------------------------
# a file left alone: the same output as the memory-mapped reads gave


@pytest.mark.parametrize("tensor_type", [QT.F32, QT.F16, QT.Q8_0, QT.Q4_1, QT.Q4_0], ids=lambda t: t.name)
def test_output_is_byte_identical_to_the_mapped_reads(tmp_path, monkeypatch, tensor_type):
    m = write_tiny_model(tmp_path / "src.gguf", tensor_type=tensor_type, seed=3, **SMALL)
    formats = dict(FORMATS, **{"blk.0.attn_norm.weight": "f16", "blk.0.ffn_up.weight": "f32"})
    rep = requantize_gguf(m.path, tmp_path / "read.gguf", formats)
    # the previous code path: every tensor a view of the file's memmap
    monkeypatch.setattr(requant, "read_tensor", lambda f, g, info: gguf_file.tensor_view(g, info))
    requantize_gguf(m.path, tmp_path / "mapped.gguf", formats)
    assert (tmp_path / "read.gguf").read_bytes() == (tmp_path / "mapped.gguf").read_bytes()
    assert rep.actual_size == rep.predicted_size


def test_read_tensor_is_tensor_view_copied(tmp_path):
    m = write_tiny_model(tmp_path / "src.gguf", tensor_type=QT.Q4_1, seed=4, **SMALL)
    g = open_model(m.path).gguf
    with open(m.path, "rb", buffering=0) as f:
        for info in g.tensors.values():
            a, b = gguf_file.read_tensor(f, g, info), gguf_file.tensor_view(g, info)
            assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a.view(np.uint8), b.view(np.uint8))
            assert not isinstance(a, np.memmap) and not isinstance(a.base, np.memmap)


def test_the_engine_still_reads_tensors_in_place(tmp_path):
    """Only quantize reads with copies: a loaded model's tensors stay views of the memmap."""
    m = write_tiny_model(tmp_path / "src.gguf", tensor_type=QT.Q8_0, **SMALL)
    raw = open_model(m.path).raw("blk.0.ffn_up.weight")
    assert isinstance(raw.base, np.memmap) or isinstance(raw, np.memmap)
