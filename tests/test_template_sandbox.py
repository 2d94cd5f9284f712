"""The chat-template sandbox's size and time bounds (edgellm/model/template_sandbox.py).

A GGUF file's chat template is code from whoever made the file. Before these bounds, each
template below either ran for hours (loops, macros and a filter counting to 10^9, none printing
anything) or built its text in full before the output's cap saw it (hundreds of MB, gigabytes
at larger counts: a list of references to one big string, printed; tojson indenting)."""
import subprocess
import sys
import textwrap
import tracemalloc

import jinja2
import pytest

from edgellm.errors import ModelFormatError
from edgellm.model import template_sandbox
from edgellm.model.chat_template import ChatTemplate

MSGS = [{"role": "user", "content": "hi"}]

ENDLESS = {
    "nested loops printing nothing": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "macro calling itself twice": "{% macro f(n) %}{% if n > 0 %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}"
                                  "{{ f(40) }}",
    "slice into 10^9 parts": "{{ 'x'|slice(1000000000)|list|length }}",
    # each |list result's size is checked by walking it: 10^10 items walked without the charge
    # a filter's time grows with its input: these made as many passes over 4M characters
    "a loop of filters on a long string": "{% set s = 'ab ' * 1000000 %}{% for i in range(100000) %}"
                                          "{% set t = s|upper %}{% endfor %}",
    "striptags, slower than linear": "{{ ('<a>x</a> ' * 400000)|striptags|length }}",
    # textwrap cuts a long word a line at a time, copying the rest each time: 46 s within the steps
    "wordwrap of one long word": "{{ ('x' * 1950000)|wordwrap(1, wrapstring='')|length }}",
    "wordwrap of one long word with ideographic spaces":
        "{{ ('x\u3000' * 1000000)|wordwrap(1, wrapstring='')|length }}",
    "sum of one-item lists": "{% set l = 'a' * 3000000 %}{{ l|batch(1)|sum(start=[])|length }}",
    "a loop re-checking a big list": "{% set big = range(100000)|list %}{% for i in range(100000) %}"
                                     "{% set y = big|list %}{% endfor %}",
}


@pytest.mark.parametrize("case", list(ENDLESS))
def test_endless_templates_stop_with_a_typed_error(case):
    # in a child: on a sandbox without the bound this runs for hours, and the timeout fails it
    code = textwrap.dedent(f"""
        from edgellm.errors import ModelFormatError
        from edgellm.model.chat_template import ChatTemplate
        try:
            ChatTemplate("/m.gguf", {ENDLESS[case]!r}, "", "").render([{{"role": "user", "content": "hi"}}])
        except ModelFormatError as e:
            print("ModelFormatError", e.field, e)
    """)
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{case}: still rendering after 60 s")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ModelFormatError tokenizer.chat_template"), out.stdout + out.stderr
    assert "runs too long" in out.stdout or "filter slice with a width of 1,000,000,000" in out.stdout, out.stdout


BIG = {   # template -> what the error names; each built 40M-100M characters before
    "a list of references, printed": ("{% set s = 'x' * 4000000 %}{{ [s] * 10 }}", "a repetition of 1 items"),
    "a list literal of references": ("{% set s = 'x' * 3000000 %}{{ [s, s, s, s] }}",
                                     "a literal gives a printed size of 12,000,"),
    "lists concatenated": ("{% set s = ['x' * 3000000] %}{{ s + s }}", "a concatenation of 3,000,004 and"),
    "tojson indenting a long list": ("{{ range(100000)|list|tojson(indent=1000) }}", "filter tojson passes 4,194,3"),
    "tojson indenting by 10^6": ("{{ [[[[[[1]]]]]]|tojson(indent=1000000) }}",
                                 "filter tojson with an indent of 1,000,000"),
    # a namespace or a dict view weighed 1, and printing prints its contents: 3 GB at once
    "a list of references to a namespace": ("{% set ns = namespace(x='x' * 3000000) %}{{ [ns] * 1000 }}",
                                            "a repetition of 1 items (3,000,0"),
    "a list of references to a dict view": ("{% set d = {'a': 'x' * 3000000} %}{{ [d.items()] * 1000 }}",
                                            "a repetition of 1 items (3,000,0"),
    "a list literal of namespace references": ("{% set ns = namespace(x='x' * 3000000) %}{{ [ns, ns] }}",
                                               "a literal gives a printed size of 6,000,"),
    # results many times their inputs: each built ~3 GB (2.9 GB traced) before its size was seen
    "filter replace": ("{{ ('a' * 3000000)|replace('a', 'b' * 1000) }}", "filter replace would give a length of 3,"),
    "str.replace": ("{{ ('a' * 3000000).replace('a', 'b' * 1000) }}", "str.replace would give a length of 3,"),
    "filter indent": ("{{ ('a\n' * 1500000)|indent(1000) }}", "filter indent would give a length of 1,50"),
    "str.expandtabs": ("{{ ('a\t' * 1000000).expandtabs(1000) }}", "str.expandtabs would give a length of 1,00"),
    "filter wordwrap": ("{{ ('ab ' * 100000)|wordwrap(2, wrapstring='x' * 10000) }}",
                        "filter wordwrap would give a length of 3,"),
    "str.join": ("{{ ('x' * 1000).join('a' * 3000000) }}", "str.join would give a length of 3,"),
    "str.format": ("{{ ('{0}' * 1000000).format('a' * 3000) }}", "str.format would give a length of 3,"),
    "str.format_map": ("{{ ('{a}' * 1000000).format_map({'a': 'a' * 3000}) }}",
                       "str.format_map would give a length of 3,"),
    "filter format": ("{{ ('%s' * 1000)|format(*(['x' * 3000] * 1000)) }}", "filter format would give a length of 3,"),
    "a % format": ("{{ ('%(a)s' * 500000) % {'a': 'x' * 3000} }}", "a % format would give a length of 1,"),
    "str.translate": ("{{ ('a' * 3000000).translate({97: 'x' * 1000}) }}", "str.translate would give a length of 3,"),
    "filter urlize with a long target": ("{{ ('www.a.bc ' * 20000)|urlize(target='x' * 10000) }}",
                                         "filter urlize would give a length of"),
    # bytes print their characters too: each of these built 1-3 GB
    "bytes repeated": ("{{ ('a' * 3000000).encode() * 1000 }}", "a repetition of 3,000,000 items"),
    "bytes.replace": ("{{ ('a' * 3000000).encode().replace('a'.encode(), ('b' * 1000).encode()) }}",
                      "bytes.replace would give a length of 3,"),
    "bytes.ljust": ("{{ 'x'.encode().ljust(1000000000) }}", "bytes.ljust with a width of 1,000,000,000"),
}


@pytest.mark.parametrize("case", list(BIG))
def test_big_results_are_refused_before_they_are_built(case):
    src, named = BIG[case]
    t = ChatTemplate("/m.gguf", src, "", "")
    tracemalloc.start()
    try:
        with pytest.raises(ModelFormatError, match="too large") as e:
            t.render(MSGS)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert named in str(e.value)
    assert peak < 30 * 1024 * 1024, f"{peak / 2**20:.0f} MB traced"


ORDINARY = [
    "{% for a, b in [(1, 2), (3, 4)] %}{{ a ~ b }}{% else %}none{% endfor %}{% for x in [] %}{% else %}empty{% endfor %}",
    "{% for m in messages %}{{ loop.index }}/{{ loop.length }}{{ loop.last }}{{ loop.cycle('a', 'b') }}{% endfor %}",
    "{% for x in [[1, [2]], [3]] recursive %}[{% if x is iterable %}{{ loop(x) }}{% else %}{{ x }}{% endif %}]"
    "{% endfor %}",
    "{% for x in range(10) %}{% if x == 2 %}{% continue %}{% endif %}{% if x == 5 %}{% break %}{% endif %}{{ x }}"
    "{% endfor %}",
    "{% set ns = namespace(n=0) %}{% for m in messages * 3 %}{% set ns.n = ns.n + 1 %}{% endfor %}{{ ns.n }}"
    "{% set t = (1, 'a') %}{{ t }}{{ {'k': [1, (2, 3)], 'é': none} }}",
    "{{ {'b': [1, 2], 'a': 'é'}|tojson }}{{ {'a': [1, {'c': 2}]}|tojson(indent=2) }}"
    "{{ messages|tojson(separators=(',', ':')) }}",
    "{{ 'a-b'.replace('-', '+') }}{{ 'x\ny'|indent(2, true) }}{{ '%s=%d' % ('k', 3) }}{{ '{}/{}'.format(1, 2) }}"
    "{{ '{a}'.format_map({'a': 5}) }}{{ ', '.join(['a', 'b']) }}{{ 'a b c'|wordwrap(3) }}{{ '%s-%s'|format(1, 2) }}"
    "{{ 'a\tb'.expandtabs(4) }}{{ messages[0].content|replace('h', 'H') }}",
    "{{ 'a\nb'|indent(width=2, first=True) }}{{ 'aaa'|replace('a', 'b', count=2) }}{{ 'ab'.translate({97: 'xy'}) }}"
    "{{ 'see www.a.bc now'|urlize(target='_blank') }}{{ 'a b'|wordwrap(width=1, wrapstring='|') }}",
]


@pytest.mark.parametrize("src", ORDINARY)
def test_ordinary_templates_render_as_jinja2_does(src):
    def tojson(v, indent=None, separators=None, sort_keys=False):
        import json
        return json.dumps(v, ensure_ascii=False, indent=indent, sort_keys=sort_keys,
                          separators=tuple(separators) if separators else None)
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    want = env.from_string(src).render(messages=MSGS, add_generation_prompt=True, bos_token="", eos_token="")
    assert ChatTemplate("/m.gguf", src, "", "").render(MSGS) == want


def test_a_long_conversation_through_nested_loops_fits_the_budget():
    # 1,000 messages, every one looking back over all of them: a million loop iterations
    msgs = [{"role": "user" if i % 2 else "assistant", "content": f"m{i}"} for i in range(1000)]
    src = ("{% for m in messages %}{% set ns = namespace(users=0) %}{% for n in messages %}"
           "{% if n.role == 'user' %}{% set ns.users = ns.users + 1 %}{% endif %}{% endfor %}"
           "{% if loop.last %}{{ ns.users }}{% endif %}{% endfor %}")
    assert ChatTemplate("/m.gguf", src, "", "").render(msgs) == "500"


def test_weight_counts_what_printing_prints():
    s = "x" * 1000
    shared = [s, s]
    with template_sandbox.bounded(10**9):
        assert template_sandbox.weight(s) == 1000
        assert template_sandbox.weight([shared] * 3) >= len(str([shared] * 3)) - 100
        assert template_sandbox.weight({"k": shared}) >= 2000
        cyclic = []
        cyclic.append(cyclic)     # (an app's extra variable can be anything)
        assert template_sandbox.weight(cyclic) < 10
        ns = jinja2.utils.Namespace(a=shared, b=s)
        assert template_sandbox.weight(ns) >= len(repr(ns)) - 100
        d = {"k": shared}
        for view in (d.keys(), d.values(), d.items()):
            assert template_sandbox.weight(view) >= len(str(list(view))) - 100
        deep = []
        for _ in range(100000):   # nesting deeper than Python's recursion limit
            deep = [deep]
        assert template_sandbox.weight(deep) == 4 * 100000 + 2


def test_lipsum_is_not_there():
    # lipsum(10, min=10**6, max=10**6 + 1) ran 49 s and built 234 MB before its size was seen
    with pytest.raises(ModelFormatError, match="'lipsum' is undefined"):
        ChatTemplate("/m.gguf", "{{ lipsum(10, min=1000000, max=1000001) }}", "", "").render(MSGS)


def test_sum_concatenates_as_jinja2_does():
    src = "{{ [[1], [2, 3]]|sum(start=[]) }}{{ [(1,), (2,)]|sum(start=()) }}{{ [1, 2.5]|sum }}" \
          "{{ [{'n': 2}, {'n': 3}]|sum(attribute='n') }}"
    want = jinja2.Environment().from_string(src).render()
    assert ChatTemplate("/m.gguf", src, "", "").render(MSGS) == want == "[1, 2, 3](1, 2)3.55"
    with pytest.raises(ModelFormatError, match="can only concatenate list"):
        ChatTemplate("/m.gguf", "{{ [[1], (2,)]|sum(start=[]) }}", "", "").render(MSGS)
