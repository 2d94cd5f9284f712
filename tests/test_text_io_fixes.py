"""Text in and out at the edges: a long stop string, and non-UTF-8 locales.

StopChecker kept every proper prefix of every stop string in a set: O(L^2) characters, so a
60,000-character --stop took 7 s and 1.9 GB for one request (a MemoryError traceback under a
memory limit). Under an ASCII locale without UTF-8 mode, valid UTF-8 on the command line (Python
keeps it as lone surrogates) and on chat's stdin was refused as "not valid UTF-8"."""
from __future__ import annotations

import io
import tracemalloc

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edgellm import cli
from edgellm.errors import ConfigError
from edgellm.sampling import StopChecker


def _hold_by_prefix_set(stops, buf: str) -> int:
    """The old definition, kept as the reference: the longest end of buf that is a proper
    prefix of a stop string."""
    prefixes = {s[:i] for s in stops for i in range(1, len(s))}
    for k in range(min(len(buf), max((len(s) - 1 for s in stops), default=0)), 0, -1):
        if buf[-k:] in prefixes:
            return k
    return 0


@settings(max_examples=400, deadline=None)
@given(st.lists(st.text("abcé😀", min_size=1, max_size=6), min_size=1, max_size=4),
       st.lists(st.text("abcé😀 ", max_size=5), max_size=8))
def test_stream_matches_the_prefix_set_definition(stops, pieces):
    c, shown = StopChecker(stops), []
    for piece in pieces:
        buf = c.held + piece
        step = c.feed(piece)
        shown.append(step.text)
        if step.stopped:
            hit = min(i for i in (buf.find(s) for s in c.stops) if i >= 0)
            assert step.text == buf[:hit]
            break
        assert len(c.held) == _hold_by_prefix_set(c.stops, buf)
        assert step.text + c.held == buf
    else:
        shown.append(c.flush())
    text = "".join(shown)
    assert not any(s in text for s in c.stops)


def test_a_long_stop_costs_memory_in_proportion():
    tracemalloc.start()
    try:
        c = StopChecker(["Z" * 20_000 + "!"])
        for piece in ("Paris", " is ", "Z" * 5_000, "Z" * 5_000, "."):
            c.feed(piece)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2 * 2**20, peak          # the prefix set took ~200 MB for this one


def test_held_text_comes_out_at_the_end():
    c = StopChecker(["Z" * 20_000 + "!"])
    assert c.feed("Paris ").text == "Paris "
    assert c.feed("ZZZ").text == "" and c.held == "ZZZ"
    assert c.flush() == "ZZZ"


def test_utf8_arguments_under_an_ascii_locale():
    as_argv = "party 🎉".encode().decode("ascii", "surrogateescape")   # what Python makes of it there
    assert cli._utf8_arg("the prompt", as_argv) == "party 🎉"
    assert cli._utf8_arg("the prompt", "plain") == "plain"
    bad = b"ab\xffc".decode("ascii", "surrogateescape")
    with pytest.raises(ConfigError, match=r"the prompt is not valid UTF-8 \(byte 0xff at character 3\)"):
        cli._utf8_arg("the prompt", bad)


def test_chat_lines_under_an_ascii_stdin(monkeypatch):
    monkeypatch.setattr(cli.sys, "stdin", io.TextIOWrapper(io.BytesIO(), encoding="ascii"))
    assert cli._decode_line("emojis 🎉🔥\n".encode()) == "emojis 🎉🔥"
    monkeypatch.setattr(cli.sys, "stdin", io.TextIOWrapper(io.BytesIO(), encoding="latin-1"))
    assert cli._decode_line("été\n".encode("latin-1")) == "été"
    monkeypatch.setattr(cli.sys, "stdin", io.TextIOWrapper(io.BytesIO(), encoding="utf-8"))
    with pytest.raises(UnicodeDecodeError):
        cli._decode_line(b"\xff\n")


def test_a_crlf_chat_line_loses_its_carriage_return(monkeypatch):
    """`printf 'Repeat exactly: abc\\r\\n' | edgellm chat` sent and saved 'Repeat exactly: abc\\r'."""
    monkeypatch.setattr(cli.sys, "stdin", io.TextIOWrapper(io.BytesIO(), encoding="utf-8"))
    assert cli._decode_line(b"Repeat exactly: abc\r\n") == "Repeat exactly: abc"
    assert cli._decode_line("a\r\n") == "a" and cli._decode_line("a\rb\n") == "a\rb"
