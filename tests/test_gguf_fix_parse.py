"""The header walk on two files the parser misjudged: one with no tensors and no padding before
an (empty) data section, and one whose string array is many tiny strings (memory, not time)."""
import random
import struct
import tracemalloc

import numpy as np
import pytest
from gguf import GGUFValueType as VT

from edgellm.errors import ModelFormatError
from edgellm.model.gguf_file import read_gguf
from edgellm.model.gguf_strings import GGUFStrings
from edgellm.model.loader import open_model
from tests.synthetic import encode_array, encode_kv, encode_string


def _header(n_tensors: int, kvs: list[bytes]) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", 3, n_tensors, len(kvs)) + b"".join(kvs)


def test_a_file_with_no_tensors_needs_no_padding(tmp_path):
    """38 bytes, 0 tensors, 1 key: the data section was rounded up to the alignment past the end
    of file, and the error said "tensors need 0 bytes in all, found -26 bytes of data section".
    With no tensors there is no data to pad to (llama.cpp reads the file); the model then fails
    on what it really lacks."""
    path = tmp_path / "notensors.gguf"
    data = _header(0, [encode_kv("a", VT.UINT8, b"\x07")])
    path.write_bytes(data)
    g = read_gguf(path)
    assert (g.tensors, g.metadata, g.data_offset) == ({}, {"a": 7}, len(data))
    with pytest.raises(ModelFormatError) as e:
        open_model(path)
    assert e.value.field == "general.architecture" and "missing" in e.value.message


def _string_array_bytes(strings: list[str]) -> tuple[bytes, list[int]]:
    raw = b"".join(encode_string(s) for s in strings)
    lengths = [len(s.encode()) for s in strings]
    starts = np.cumsum([0] + [8 + n for n in lengths[:-1]]) + 8
    return raw, starts.tolist()


def test_many_empty_strings_take_memory_within_the_arrays_size(tmp_path):
    """An array of 4M empty strings (32 MiB of length prefixes) peaked at ~8x its size while
    parsed: a Python list of every start, np.isin's sorted copies, and arange and fancy-index
    temporaries as large as all the starts. Here 256k of them (2 MiB): the walk may hold the
    array's bytes and its starts, and build the result (4 bytes a string), not much more."""
    n = 1 << 18
    path = tmp_path / "flat.gguf"
    data = _header(0, [encode_kv("x", VT.ARRAY, encode_array(VT.STRING, n, b"\0" * 8 * n))])
    path.write_bytes(data + b"\0" * (-len(data) % 32))     # padded to the (empty) data section
    size = path.stat().st_size
    tracemalloc.start()
    try:
        g = read_gguf(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(g.metadata["x"]) == n and g.metadata["x"][n - 1] == ""
    assert peak < 2.5 * size, f"peak {peak / size:.2f}x the file"


def test_strings_across_chunks_read_back_exactly():
    """from_array_bytes strips the length prefixes a chunk of strings at a time: strings past
    the first chunk, empty and multi-byte ones included, must read back as written."""
    rng = random.Random(0)
    alphabet = "ab\u0120\u00e9\u4e2d\U0001F600"
    strings = ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 4))) for _ in range(70_000)]
    strings[-1] = ""
    raw, starts = _string_array_bytes(strings)
    s = GGUFStrings.from_array_bytes(raw, starts)
    assert list(s) == strings and s[69_999] == "" and s[65_536] == strings[65_536]
    # a string cut mid-character, past the first chunk: valid as a whole, not alone
    raw, starts = _string_array_bytes(strings[:66_000] + ["X"])
    raw = raw[:-1] + b"\xc3" + encode_string(b"\xa9")      # "\xc3" then "\xa9": together an "é"
    assert str(raw[-10:-9] + raw[-1:], "utf-8") == "\u00e9"
    assert GGUFStrings.from_array_bytes(raw, starts + [len(raw) - 1]) is None
