"""open_model drops the decoded BPE merges once the tokenizer is built (gguf_file.release_strings;
~0.9 MiB resident for SmolLM2) and any later reader gets exactly the same strings, re-read from
the file: requant's copy included, and a file changed since the load is a ModelFormatError."""
from __future__ import annotations

import os
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from synthetic import gguf_layout, patch_bytes, write_tiny_model  # noqa: E402

from edgellm.errors import ModelFormatError  # noqa: E402
from edgellm.model import gguf_strings  # noqa: E402
from edgellm.model.gguf_file import describe_value, read_gguf  # noqa: E402
from edgellm.model.gguf_strings import GGUFStrings, GGUFStringsOnDemand  # noqa: E402
from edgellm.model.loader import open_model  # noqa: E402
from edgellm.requant import requantize_gguf  # noqa: E402

KEY = "tokenizer.ggml.merges"
# 1091 merges: past gguf_file._NATIVE_WALK_MIN (1024), so the re-read takes the native walk where
# the library loads; the default vocabulary's 51 merges take the Python walk
VOCABS = [None, 1350]


@pytest.fixture(params=VOCABS, ids=["51-merges", "1091-merges"])
def tiny(request, tmp_path):
    return write_tiny_model(tmp_path / "m.gguf", vocab_size=request.param)


def test_open_model_does_not_hold_the_merges_decoded(tiny):
    mf = open_model(tiny.path)
    merges = mf.metadata[KEY]
    assert isinstance(merges, GGUFStringsOnDemand) and not merges.loaded and merges.nbytes == 0
    # what needs no strings reads none
    assert len(merges) == len(tiny.merges)
    assert describe_value(merges) == f"an array of {len(tiny.merges)} strings"
    assert not merges.loaded
    # the tokens stay as parsed: detokenize reads them
    assert type(mf.metadata["tokenizer.ggml.tokens"]) is GGUFStrings


def test_open_model_leaves_only_the_tokens_decoded(tmp_path):
    m = write_tiny_model(tmp_path / "m.gguf", vocab_size=1350)     # ~11 KB of tokens, ~11 KB of merges
    open_model(m.path)              # (first-use imports and caches out of the measurement)
    tracemalloc.start()
    try:
        mf = open_model(m.path)
        snap = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    # what the module that decodes string arrays left alive: the tokens (the tokenizer keeps
    # them), not the merges as well
    held = sum(s.size for s in snap.filter_traces([tracemalloc.Filter(True, gguf_strings.__file__)])
               .statistics("filename"))
    fresh = read_gguf(m.path).metadata
    assert held < fresh["tokenizer.ggml.tokens"].nbytes + fresh[KEY].nbytes // 2
    assert not mf.metadata[KEY].loaded


def test_merges_read_after_open_are_the_originals(tiny):
    mf = open_model(tiny.path)
    before = mf.tokenizer.encode("hello world, the cat")
    merges = mf.metadata[KEY]
    assert list(merges) == tiny.merges
    assert merges.loaded and merges.nbytes > 0
    assert merges == tiny.merges and tiny.merges == merges
    assert merges == read_gguf(tiny.path).metadata[KEY]
    assert merges[0] == tiny.merges[0] and merges[-1] == tiny.merges[-1] and merges[2:5] == tiny.merges[2:5]
    text, starts = read_gguf(tiny.path).metadata[KEY].joined()
    assert merges.joined()[0] == text and np.array_equal(merges.joined()[1], starts)    # what NativeBPE reads
    assert mf.tokenizer.encode("hello world, the cat") == before


def test_requantize_still_writes_the_same_merges(tiny, tmp_path):
    rep = requantize_gguf(tiny.path, tmp_path / "dst.gguf", {"blk.0.attn_q.weight": "q8_0"})
    dst = read_gguf(rep.dst)
    assert list(dst.metadata[KEY]) == tiny.merges
    assert dst.metadata_types[KEY] == read_gguf(tiny.path).metadata_types[KEY]
    assert open_model(rep.dst).tokenizer.encode("hello world") == open_model(tiny.path).tokenizer.encode("hello world")


def _first_merge_last_byte(path: str) -> int:
    """Offset of the last byte of merge 0 (e.g. 't' of 'Ġ t')."""
    with open(path, "rb") as f:
        kv = gguf_layout(f.read()).kvs[KEY]
    first = kv.array_len_at + 8                     # merge 0: u64 length, then its bytes
    with open(path, "rb") as f:
        f.seek(first)
        n = int.from_bytes(f.read(8), "little")
    return first + 8 + n - 1


def _rewrite_in_place(path: str, at: int, new: bytes) -> None:
    """Same inode, same size, same mtime: a change no stat() check sees."""
    st = os.stat(path)
    with open(path, "r+b") as f:
        f.seek(at)
        f.write(new)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_a_merge_changed_in_place_after_load_is_a_typed_error(tiny):
    mf = open_model(tiny.path)
    at = _first_merge_last_byte(tiny.path)
    with open(tiny.path, "rb") as f:
        f.seek(at)
        old = f.read(1)
    assert tiny.merges[0].encode()[-1:] == old
    _rewrite_in_place(tiny.path, at, b"u" if old != b"u" else b"v")   # still a plausible merge
    merges = mf.metadata[KEY]
    with pytest.raises(ModelFormatError) as e:
        list(merges)
    assert e.value.field.endswith(repr(KEY)) and "changed after it was read" in e.value.message
    assert not merges.loaded
    with pytest.raises(ModelFormatError):
        merges[0]                                   # each read checks again: no garbage on retry
    _rewrite_in_place(tiny.path, at, old)           # the file as parsed: the strings as parsed
    assert list(merges) == tiny.merges


def test_a_truncated_or_removed_file_is_a_typed_error(tiny):
    mf = open_model(tiny.path)
    with open(tiny.path, "rb") as f:
        data = f.read()
    end = _first_merge_last_byte(tiny.path) + 1
    with open(tiny.path, "wb") as f:
        f.write(data[:end])
    with pytest.raises(ModelFormatError, match="changed after it was read"):
        mf.metadata[KEY][0]
    os.remove(tiny.path)
    with pytest.raises(ModelFormatError, match="removed after it was read"):
        list(mf.metadata[KEY])


def test_a_file_replaced_by_another_of_the_same_size_is_a_typed_error(tiny, tmp_path):
    mf = open_model(tiny.path)
    with open(tiny.path, "rb") as f:
        data = f.read()
    at = _first_merge_last_byte(tiny.path)
    changed = patch_bytes(data, at, b"u" if data[at:at + 1] != b"u" else b"v")
    other = tmp_path / "other.gguf"
    other.write_bytes(changed)
    os.replace(other, tiny.path)                    # a new inode at the same path
    with pytest.raises(ModelFormatError, match="changed after it was read"):
        list(mf.metadata[KEY])


def test_threads_reading_at_once_load_the_strings_once():
    """Several threads reading an unloaded GGUFStringsOnDemand at once: one re-read, every
    thread sees the strings (without the lock each thread re-read and decoded the array)."""
    import threading
    import time

    words = ["Ġ t", "Ġ a", "h e", "i n"]
    loads = []

    def load():
        loads.append(1)
        time.sleep(0.05)            # a slow file read: the other threads arrive meanwhile
        text = "".join(words)
        starts = np.cumsum([0] + [len(w) for w in words]).astype(np.int32)
        return GGUFStrings(text, starts)

    lazy = GGUFStringsOnDemand(len(words), load)
    barrier, seen = threading.Barrier(8), []

    def reader():
        barrier.wait()
        seen.append(list(lazy))

    threads = [threading.Thread(target=reader) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(loads) == 1 and seen == [words] * 8


def test_a_directory_in_the_files_place_or_a_chdir(tiny, tmp_path, monkeypatch):
    """The re-read opens the file by its absolute path (a chdir after the load changes nothing),
    and any OSError on the way is a ModelFormatError, not an untyped IsADirectoryError."""
    monkeypatch.chdir(os.path.dirname(tiny.path))
    mf = open_model(os.path.basename(tiny.path))        # a relative path
    monkeypatch.chdir(tmp_path)
    assert len(list(mf.metadata[KEY])) == len(mf.metadata[KEY])
    mf2 = open_model(tiny.path)
    os.remove(tiny.path)
    os.mkdir(tiny.path)
    with pytest.raises(ModelFormatError, match="cannot read it again"):
        list(mf2.metadata[KEY])
