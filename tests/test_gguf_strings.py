"""GGUFStrings: a GGUF string array kept as its bytes reads like the list of str it replaces."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from synthetic import write_tiny_model  # noqa: E402

from edgellm.model.gguf_file import read_gguf  # noqa: E402
from edgellm.model.gguf_strings import GGUFStrings  # noqa: E402
from edgellm.model.loader import open_model  # noqa: E402


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("s") / "m.gguf")


def test_reads_like_the_list(model):
    g = read_gguf(model.path)
    for key, want in (("tokenizer.ggml.tokens", model.tokens), ("tokenizer.ggml.merges", model.merges)):
        s = g.metadata[key]
        assert isinstance(s, GGUFStrings)
        assert len(s) == len(want) and list(s) == list(want) and s == want and want == s
        assert [s[i] for i in range(len(want))] == list(want)
        assert s[-1] == want[-1] and s[-len(want)] == want[0]
        assert s[1:7] == list(want[1:7]) and s[::-3] == list(want[::-3]) and s[5:2] == []
        for bad in (len(want), -len(want) - 1):
            with pytest.raises(IndexError):
                s[bad]
        with pytest.raises(TypeError):
            s["0"]
        assert want[3] in s and s.index(want[3]) == list(want).index(want[3])
        assert s != list(want)[:-1] and s != list(want)[::-1] and s != "abc"


def test_non_ascii_and_empty_strings(tmp_path):
    # multi-byte UTF-8 and empty strings, first and last too: each entry ends where the next
    # one's length prefix begins, the last at the end of the array
    toks = ["", "a", "", "\u0120\u00e9t\u00e9", "\U0001F600", "z" * 300, ""]
    m = write_tiny_model(tmp_path / "m.gguf", extra_metadata={"x.strings": toks, "x.one": ["\u00e9"]})
    g = read_gguf(m.path)
    s = g.metadata["x.strings"]
    assert isinstance(s, GGUFStrings) and list(s) == toks and [s[i] for i in range(len(toks))] == toks
    assert g.metadata["x.one"] == ["\u00e9"] and g.metadata["x.one"][0] == "\u00e9"


def test_tokenizer_keeps_one_str_not_str_objects(model):
    mf = open_model(model.path)
    assert isinstance(mf.tokenizer._tokens, GGUFStrings)
    toks = list(mf.tokenizer._tokens)
    assert mf.tokenizer._tokens.nbytes < (sum(map(sys.getsizeof, toks)) + sys.getsizeof(toks)) / 2
    assert [mf.tokenizer.token_text(i) for i in range(mf.tokenizer.vocab_size)] == list(model.tokens)
