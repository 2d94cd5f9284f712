"""Probe 22: text that grows without bound.

- A chat template rendering {{ 'x' * 1000000000 }} took 14 s and 3.9 GB, then tokenizing failed
  with an untyped RuntimeError; the sandbox now refuses such results (before building them where
  their size is known) and a streamed render stops at the limit: a ModelFormatError naming
  tokenizer.chat_template.
- The native tokenizer's failures (a fragment too long to hand over, out of memory) were
  RuntimeError('el_bpe_encode_text failed (-1)'); now ConfigError with the limit, and KernelError
  naming the text's length.
"""
import time
import tracemalloc

import pytest

from edgellm.errors import ConfigError, EdgeLLMError, KernelError, ModelFormatError
from edgellm.model import bpe_native
from edgellm.model.chat_template import ChatTemplate
from edgellm.model.loader import open_model
from tests.synthetic import write_tiny_model

MSGS = [{"role": "user", "content": "hi"}]

HUGE = {
    "repeat": "{{ 'x' * 1000000000 }}",
    "repeat list": "{{ ['a'] * 1000000000 }}",
    "nested loops": "{% for i in range(100000) %}{% for j in range(100000) %}xxxxxxxxxx{% endfor %}{% endfor %}",
    "percent width": "{{ '%1000000000s' % 'x' }}",
    "ljust": "{{ 'x'.ljust(1000000000) }}",
    "str.format width": "{{ '{:>1000000000}'.format('x') }}",
    "center filter": "{{ 'x'|center(1000000000) }}",
    "join filter": "{{ range(100000)|join('x' * 100000) }}",
    "concatenation": "{% set a = 'x' * 3000000 %}{{ a + a }}",
    "power": "{{ 9 ** (9 ** 9) }}",
}


ORDINARY = ("{{ 'Date 20250101 %s' % 'x' }}{{ '{}'.format(1700000000) }}{{ messages[0]['content'] * 3 }}"
            "{{ '%05d'|format(12) }}{{ 'ab'|center(6) }}{{ 2 ** 10 }}{{ range(3)|join(',') }}")


@pytest.mark.parametrize("case", list(HUGE))
def test_huge_render_is_refused_quickly(case):
    # ordinary uses of the same operators and filters still render
    assert ChatTemplate("/m.gguf", ORDINARY, "", "").render(MSGS) == "Date 20250101 x1700000000hihihi00012  ab  10240,1,2"
    t = ChatTemplate("/m.gguf", HUGE[case], "<s>", "</s>")
    t0 = time.perf_counter()
    with pytest.raises(ModelFormatError) as e:
        t.render(MSGS)
    assert time.perf_counter() - t0 < 3.0
    assert e.value.field == "tokenizer.chat_template" and e.value.path == "/m.gguf"
    assert "too large" in str(e.value) and "4,194,304 characters" in str(e.value)


# jinja compiles `~` to a join in the template's own code, which call_binop never sees: 40
# doublings of a string in a loop had the process killed for memory
DOUBLING = ("{% set ns = namespace(a='x') %}{% for i in range(26) %}{% set ns.a = ns.a ~ ns.a %}{% endfor %}"
            "{{ ns.a|length }}")


def test_tilde_concatenation_stops_at_the_limit():
    # an ordinary `~` renders as jinja renders it (unsandboxed jinja2 gave 'a1hi')
    assert ChatTemplate("/m.gguf", "{{ 'a' ~ 1 ~ messages[0]['content'] }}", "", "").render(MSGS) == "a1hi"
    t = ChatTemplate("/m.gguf", DOUBLING, "", "")
    tracemalloc.start()
    try:
        with pytest.raises(ModelFormatError, match="operator ~ gives a length of 8,388,608"):
            t.render(MSGS)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # the concatenation past the limit is the last one built: ~12 MB of strings, not the 64M
    # characters (and 32M before them) that 26 doublings reach (the output cap caught those)
    assert peak < 40 * 1024 * 1024, peak


def test_limit_grows_with_the_conversation():
    """A long message printed twice renders in full; printed three times, past 4 MiB more, it
    does not."""
    content = "y" * (5 * 1024 * 1024)
    msgs = [{"role": "user", "content": content}]
    twice = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{{ m['content'] }}{% endfor %}"
    assert len(ChatTemplate("/m.gguf", twice, "", "").render(msgs)) == 2 * len(content) + len("<user>")
    thrice = "{% for m in messages %}{{ m['content'] }}{{ m['content'] }}{{ m['content'] }}{% endfor %}"
    with pytest.raises(ModelFormatError, match="too large"):
        ChatTemplate("/m.gguf", thrice, "", "").render(msgs)


def test_engine_chat_with_huge_template(tmp_path):
    from edgellm.api import load
    path = write_tiny_model(tmp_path / "t.gguf",
                            extra_metadata={"tokenizer.chat_template": "{{ 'x' * 1000000000 }}"}).path
    eng = load(path, units=["reference"], threads=1, prefault=False)
    try:
        t0 = time.perf_counter()
        with pytest.raises(ModelFormatError) as e:
            eng.chat([{"role": "user", "content": "hi"}], max_tokens=3)
        assert time.perf_counter() - t0 < 3.0
        assert e.value.field == "tokenizer.chat_template" and e.value.path == path
    finally:
        eng.close()


@pytest.fixture(scope="module")
def native_tok(tmp_path_factory):
    tok = open_model(write_tiny_model(tmp_path_factory.mktemp("p22t") / "m.gguf").path).tokenizer
    if not isinstance(tok._encoder, bpe_native.NativeBPE):
        pytest.skip("the native tokenizer library is not loaded")
    return tok


def test_fragment_over_the_native_limit_is_a_config_error(native_tok, monkeypatch):
    # (the real limit, 536,870,911 characters, would need a 2 GB text here)
    monkeypatch.setattr(bpe_native, "MAX_FRAGMENT_CHARS", 100)
    native_tok.clear_memo()
    with pytest.raises(ConfigError) as e:
        native_tok.encode("x" * 101)
    assert "101" in str(e.value) and "at most 100" in str(e.value)
    assert native_tok.encode("x" * 100)        # at the limit: encoded


class _FailingLib:
    """The native library, except that encoding returns `rc` (EL_ENOMEM: -2)."""

    def __init__(self, lib, rc):
        self._lib, self._rc = lib, rc

    def __getattr__(self, name):
        return getattr(self._lib, name)

    def el_bpe_encode_text(self, *args):
        return self._rc


@pytest.mark.parametrize("rc", [-2, -1])
def test_native_encode_failure_is_typed(native_tok, monkeypatch, rc):
    enc = native_tok._encoder
    monkeypatch.setattr(enc, "_lib", _FailingLib(enc._lib, rc))
    native_tok.clear_memo()
    text = "hello world " * 10
    with pytest.raises(EdgeLLMError) as e:
        native_tok.encode(text)
    assert isinstance(e.value, KernelError) and isinstance(e.value, RuntimeError)
    assert f"{len(text):,} characters" in str(e.value)
    if rc == -2:
        assert "out of memory" in str(e.value)


def test_native_limit_constant():
    assert bpe_native.MAX_FRAGMENT_CHARS == (2**31 - 1) // 4
