"""The sandbox chat templates render in: jinja2's ImmutableSandboxedEnvironment, bounded.

A GGUF file's tokenizer.chat_template is code from whoever made the file. jinja2's sandbox keeps
it away from Python's internals, not from building gigabytes of text or looping for hours. The
bounds here refuse both with TooLarge / TooLong, which chat_template turns into a
ModelFormatError naming the field:

- size: every string (bytes too) or container an operator, call, filter, literal or `~` gives is held to
  the render's limit (chat_template sets it: a few MB plus twice the conversation). A
  container's size is what printing it prints (`weight`): a list of 1,000 references to a 4 MB
  string prints 4 GB, though its length is 1,000. Where the size is known before building
  ('x' * n, [s] * n, '%*s', 'x'.ljust(n), tojson's indent), it is refused before; tojson stops
  as its output passes the limit.
  Namespace objects and dict views (d.items()) print their contents, and weigh them.
- growth: where a result can be many times its inputs (replace, translate, indent, wordwrap, urlize, expandtabs,
  str.join, str.format, % and |format), a bound on its length from the arguments is checked
  before the call; 'a' * 3M with each 'a' replaced by 1,000 characters was 3 GB. lipsum, which
  builds up to n x max words, is not offered.
- time: loop iterations and calls (macros included) share MAX_STEPS per render. Two nested
  loops over range(100000) that print nothing ran for hours, and so did a macro calling itself
  twice 40 levels deep.

Not covered: what the other filters build inside before their result is checked (no more than
a few times their inputs: escape's 5x).
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import json
import re
from dataclasses import dataclass
from typing import Any, Iterator

# Steps per render: a loop iteration is one, a call (a macro's, a method's) CALL_STEPS, about
# their cost's ratio (0.19 us a bare iteration, 3.3 us a macro call, measured here). Real
# templates take a few per message; two nested loops over every message, as some templates run
# to find the last user turn, a million at 1,000 messages. The budget runs out in about a second.
MAX_STEPS = 4_000_000
CALL_STEPS = 16
WALK_ITEMS = 4
# {{ 9 ** 9 ** 9 }}: a bigint that takes minutes to compute, refused above this many bits
MAX_POWER_BITS = 1 << 16
# tojson's indent: each line's indentation is built whole (indent x depth), before any check
MAX_TOJSON_INDENT = 1024


class TooLarge(Exception):
    """The template would build a string or container past the render's limit."""


class TooLong(Exception):
    """The template ran past the render's loop iterations and calls."""


@dataclass
class _Render:
    limit: int
    steps: int = MAX_STEPS


_render: contextvars.ContextVar[_Render] = contextvars.ContextVar("edgellm_chat_template_render")
DEFAULT_LIMIT = 4 * 1024 * 1024   # characters: chat_template's MAX_MARKUP_CHARS (why this size: there)


def _state() -> _Render:
    """The render's bounds; outside `bounded`, DEFAULT_LIMIT and no step budget (a fresh one
    each time)."""
    r = _render.get(None)
    return r if r is not None else _Render(DEFAULT_LIMIT)


@contextlib.contextmanager
def bounded(limit: int) -> Iterator[None]:
    """Renders inside this are held to `limit` characters and MAX_STEPS steps."""
    token = _render.set(_Render(limit))
    try:
        yield
    finally:
        _render.reset(token)


def limit() -> int:
    return _state().limit


# what prints its characters: bytes too ('a' * 3M).encode() * 1000 was 3 GB
_TEXT = (str, bytes)
_DICT_VIEWS = (type({}.keys()), type({}.values()), type({}.items()))
# what prints its items: lists, tuples, dicts, a namespace (its attributes' dict) and a dict
# view (its dict's keys, values or both: a view's items are made as it is read, so it is
# weighed through its dict)
_CONTAINERS = (list, tuple, dict, *_DICT_VIEWS)


def _is_namespace(x: Any) -> bool:
    # by name: importing jinja2 here would load it for chats that render without it
    return type(x).__name__ == "Namespace" and type(x).__module__ == "jinja2.utils"


def _is_container(x: Any) -> bool:
    return isinstance(x, _CONTAINERS) or _is_namespace(x)


def _children(x: Any) -> list[Any]:
    if _is_namespace(x):
        x = x._Namespace__attrs       # (its __getattribute__ lets this one name through)
    if isinstance(x, dict):
        return [*x.keys(), *x.values()]
    if isinstance(x, _DICT_VIEWS):
        m = x.mapping
        return [*m.keys()] if isinstance(x, _DICT_VIEWS[0]) else [*m.values()] if isinstance(x, _DICT_VIEWS[1]) \
            else [*m.keys(), *m.values()]
    return list(x)


def weight(value: Any) -> int:
    """About how many characters printing `value` gives: a string's length; a list's, tuple's or
    dict's items' weights and separators, a shared item counted each time it appears (it prints
    each time); anything else 1. Each distinct container is walked once, and the walk is charged
    to the step budget (WALK_ITEMS items a step): a loop checking a big list on every turn would
    otherwise run unbounded. Nothing is kept between calls (a render-long memo held every list
    a loop made)."""
    if isinstance(value, _TEXT):
        return len(value)
    if not _is_container(value):
        return 1
    memo: dict[int, int] = {}
    items = 0
    stack = [(value, False)]
    while stack:        # post-order without recursion (nesting from the app's data is unbounded)
        x, ready = stack.pop()
        if ready:
            kids = _children(x)
            w = 14 if _is_namespace(x) else 2     # (<Namespace {...}>)
            for c in kids:
                w += 2 + (len(c) if isinstance(c, _TEXT) else memo[id(c)] if _is_container(c) else 1)
            memo[id(x)] = w
            items += len(kids)
        elif id(x) not in memo:
            memo[id(x)] = 1    # until its items are summed: a cycle back to it counts 1
            stack.append((x, True))
            stack.extend((c, False) for c in _children(x) if _is_container(c) and id(c) not in memo)
    _step("a size check", items // WALK_ITEMS)
    return memo[id(value)]


def check_size(value: Any, what: str) -> Any:
    if isinstance(value, _TEXT) or _is_container(value):
        w = weight(value)
        if w > limit():
            kind = "a length" if isinstance(value, _TEXT) else "a printed size"
            raise TooLarge(f"{what} gives {kind} of {w:,}")
    return value


def _step(what: str, n: int = 1) -> None:
    r = _state()
    r.steps -= n
    if r.steps < 0:
        raise TooLong(f"more than {MAX_STEPS:,} steps: loop iterations, and calls at {CALL_STEPS} each "
                      f"(stopped at {what})")


def _counted(iterable: Any) -> Iterator[Any]:
    for item in iterable:
        _step("a loop")
        yield item


# calls and filters whose integer arguments are widths or counts of what they build
_WIDENING_METHODS = frozenset({"ljust", "rjust", "center", "zfill", "expandtabs"})
_WIDENING_FILTERS = frozenset({"center", "indent", "slice"})
_PERCENT_SPEC = re.compile(r"%[-#0 +]*(\d+|\*)?(?:\.(\d+|\*))?")
_BRACE_SPEC = re.compile(r"\{[^{}]*?:([^{}]*)\}")


def _check_widths(what: str, widths) -> None:
    """A width or count past the limit ('x'.ljust(10**9), '%1000000000s') is refused before the
    call builds anything that large; no chat template needs one."""
    big = [w for w in widths if isinstance(w, int) and w > limit()]
    if big:
        raise TooLarge(f"{what} with a width of {max(big):,}")


def _percent_widths(fmt: str, args: Any) -> list[int]:
    """The field widths and precisions of a printf-style format ('*' ones taken from args)."""
    out = [int(g) for m in _PERCENT_SPEC.finditer(fmt) for g in m.groups() if g and g != "*"]
    if "*" in fmt:
        out += [a for a in (args if isinstance(args, tuple) else (args,)) if isinstance(a, int)]
    return out


def _brace_widths(fmt: str) -> list[int]:
    """The numbers in the format specs of a str.format string ('{:>1000000000}')."""
    return [int(d) for m in _BRACE_SPEC.finditer(fmt) for d in re.findall(r"\d+", m.group(1))]


# Operations whose result can be many times their inputs' size: 'a' * 3M with every 'a'
# replaced by 1,000 characters is 3 GB, built whole before its size could be checked (a phone's
# app is killed for memory first). Each bound is the result's length, or more, from the
# arguments alone; None where the arguments are not what the bound reads (the call then fails
# or builds no more than its inputs).
def _replace_size(s: Any, old: Any = None, new: Any = None, count: Any = None, *_: Any, **__: Any) -> int | None:
    if not (isinstance(s, _TEXT) and isinstance(old, _TEXT) and isinstance(new, _TEXT)):
        return None
    n = len(s) + 1 if old == "" else s.count(old)
    if isinstance(count, int) and count >= 0:
        n = min(n, count)
    return len(s) + n * max(0, len(new) - len(old))


def _indent_size(s: Any, width: Any = 4, *_: Any, **__: Any) -> int | None:
    if not isinstance(s, str):
        return None
    w = len(width) if isinstance(width, str) else width if isinstance(width, int) else 0
    return len(s) + (s.count("\n") + 1) * max(0, w)


def _expandtabs_size(s: Any, tabsize: Any = 8, *_: Any, **__: Any) -> int | None:
    if not (isinstance(s, _TEXT) and isinstance(tabsize, int)):
        return None
    return len(s) + s.count(b"\t" if isinstance(s, bytes) else "\t") * max(0, tabsize)


def _wordwrap_size(s: Any, width: Any = 79, break_long_words: Any = True, wrapstring: Any = None,
                   *_: Any, **__: Any) -> int | None:
    # at most one break per character, each one wrapstring (a newline by default)
    if not isinstance(s, str):
        return None
    return len(s) + (len(s) + 1) * (len(wrapstring) if isinstance(wrapstring, str) else 2)


def _str_join_size(sep: Any, items: Any = (), *_: Any, **__: Any) -> int | None:
    if not (isinstance(sep, _TEXT) and isinstance(items, (*_TEXT, list, tuple))):
        return None
    return len(sep) * max(0, len(items) - 1) + (len(items) if isinstance(items, _TEXT) else weight(items))


def _fields_size(mark: str, fmt: Any, *args: Any, **kwargs: Any) -> int | None:
    # each replacement field prints at most all of the arguments (one may repeat: '{0}' * 10^6);
    # the count of `mark` ('{' for str.format, '%' for % and |format) is the fields', or more
    if not isinstance(fmt, _TEXT):
        return None
    fields = fmt.count(mark.encode() if isinstance(fmt, bytes) else mark)
    return len(fmt) + fields * weight([*args, *kwargs.values()]) if fields else len(fmt)


def _translate_size(s: Any, table: Any = None, *_: Any, **__: Any) -> int | None:
    # each character becomes at most the table's longest replacement
    if not (isinstance(s, str) and isinstance(table, dict)):
        return None
    return len(s) * max([1, *(len(v) for v in table.values() if isinstance(v, str))])


def _urlize_size(s: Any, trim_url_limit: Any = None, nofollow: Any = False, target: Any = None, rel: Any = None,
                 *_: Any, **__: Any) -> int | None:
    # a link is the URL twice plus its markup, target and rel; a URL holds a '.', '@' or ':'
    if not isinstance(s, str):
        return None
    extra = sum(len(v) for v in (target, rel) if isinstance(v, str))
    return 3 * len(s) + (s.count(".") + s.count("@") + s.count(":")) * (64 + extra)


_brace_size = functools.partial(_fields_size, "{")
_percent_size = functools.partial(_fields_size, "%")
_SIZED_METHODS = {"replace": _replace_size, "expandtabs": _expandtabs_size, "join": _str_join_size,
                  "format": _brace_size, "format_map": _brace_size, "translate": _translate_size}
_SIZED_FILTERS = {"replace": _replace_size, "indent": _indent_size, "wordwrap": _wordwrap_size,
                  "format": _percent_size, "urlize": _urlize_size}


def _check_result_size(what: str, size: Any) -> None:
    if isinstance(size, int) and size > limit():
        raise TooLarge(f"{what} would give a length of {size:,}")


def tojson(value: Any, indent: int | None = None, separators=None, sort_keys: bool = False,
           ensure_ascii: bool = False, **_: Any) -> str:
    """Hugging Face's tojson: its keywords are honoured (templates ask for compact separators).
    Encoded piece by piece (the pure-Python encoder json uses for iterencode), counted as it
    grows: an indent of 1,000 over a list of 100,000 numbers is 100M characters."""
    if isinstance(indent, int) and indent > MAX_TOJSON_INDENT:
        raise TooLarge(f"filter tojson with an indent of {indent:,} (at most {MAX_TOJSON_INDENT:,})")
    enc = json.JSONEncoder(ensure_ascii=ensure_ascii, indent=indent, sort_keys=sort_keys,
                           separators=tuple(separators) if separators is not None else None)
    parts, n, cap = [], 0, limit()
    for part in enc.iterencode(value):
        n += len(part)
        if n > cap:
            raise TooLarge(f"filter tojson passes {cap:,} characters")
        parts.append(part)
    return "".join(parts)


# Steps a filter charges per character (or top-level item) of its input before it runs: its
# time grows with the input, and a loop calling it on a 4 MB string 100,000 times did as many
# full passes. Most cost a few ns a character (1/32 of a step, ~0.25 us); these, measured here
# on their worst inputs, cost more: 25-120 ns a character or item, urlize and wordwrap ~0.4 us,
# and striptags ~2.7 us and growing faster than its input (160,000 characters: 0.18 s).
CHARS_PER_STEP = 32
_FILTER_STEPS = {**dict.fromkeys(("title", "wordcount", "indent", "urlencode", "select", "reject", "selectattr",
                                  "rejectattr", "map", "pprint", "sort", "unique", "groupby", "batch", "max",
                                  "min", "dictsort"), 0.25),
                 "urlize": 2, "wordwrap": 2, "striptags": 12}


def _wordwrap_steps(s: Any, width: Any = 79, break_long_words: Any = True, *_: Any, **kw: Any) -> int:
    """What wordwrap costs beyond its linear pass: textwrap cuts a word longer than the width a
    line at a time, copying the rest of the word each time, ~L^2 / (2 width) characters for a
    word of L (0.03-0.05 ns each here, so ~5,000 a step). One word of 1.95M characters at width 1
    took 46 s within the step limit (a probe)."""
    width, break_long_words = kw.get("width", width), kw.get("break_long_words", break_long_words)
    if not isinstance(s, str) or not break_long_words:
        return 0
    # (textwrap's own whitespace: split() on any Unicode space charged 'x\u3000' * N as short words)
    longest = max(map(len, re.split(r"[\t\n\x0b\x0c\r ]+", s)), default=0)
    width = max(width, 1) if isinstance(width, int) else 1
    return longest * longest // (2 * width) // 5000


def _input_size(*values: Any) -> int:
    """Characters of the strings, items of the containers (their top level: O(1) to count)."""
    return sum(len(v) for v in values if isinstance(v, (*_TEXT, list, tuple, dict)))


def _sum(environment: Any, iterable: Any, attribute: Any = None, start: Any = 0) -> Any:
    """jinja's sum, but lists and tuples are concatenated in one pass: sum() copies its running
    total at every item (100,000 one-item lists took 12 s). Items are counted as loop steps."""
    from jinja2.filters import make_attrgetter

    if attribute is not None:
        iterable = map(make_attrgetter(environment, attribute), iterable)
    if not isinstance(start, (list, tuple)):
        return sum(_counted(iterable), start)
    out = list(start)
    for item in _counted(iterable):
        if type(item) is not type(start):     # (what start + item raises)
            raise TypeError(f'can only concatenate {type(start).__name__} (not "{type(item).__name__}") to '
                            f'{type(start).__name__}')
        out.extend(item)
        if len(out) > limit():
            raise TooLarge(f"filter sum passes {limit():,} items")
    return type(start)(out)


def _checked_filter(name: str, f):
    """A filter whose result is held to the limit, and whose width arguments are too where it
    widens (join, center, indent, format, ... build their strings outside call_binop)."""
    passes_first = hasattr(f, "jinja_pass_arg")     # a context / environment before the value

    @functools.wraps(f)     # (keeps jinja's pass_context / pass_environment marks)
    def filt(*args: Any, **kwargs: Any) -> Any:
        rest = args[1:] if passes_first else args
        if rest:
            value, params = rest[0], rest[1:]
            _step(f"filter {name}", int(_input_size(value, *params) * _FILTER_STEPS.get(name, 1 / CHARS_PER_STEP)))
            if name == "wordwrap":
                _step("filter wordwrap", _wordwrap_steps(value, *params, **kwargs))
            if name in _WIDENING_FILTERS:
                _check_widths(f"filter {name}", [*params, *kwargs.values()])
            elif name == "format" and isinstance(value, str):
                _check_widths("filter format", _percent_widths(value, tuple(params)))
            if name in _SIZED_FILTERS:
                _check_result_size(f"filter {name}", _SIZED_FILTERS[name](value, *params, **kwargs))
            elif name == "join":
                sep = kwargs.get("d", params[0] if params else "")
                if isinstance(sep, str) and hasattr(value, "__len__"):
                    items = weight(value) if isinstance(value, (list, tuple)) else 0
                    if len(value) * len(sep) + items > limit():
                        raise TooLarge(f"filter join of {len(value):,} items ({items:,} characters) with a "
                                       f"separator of {len(sep):,}")
        return check_size(f(*args, **kwargs), f"filter {name}")
    return filt


def sandbox(**options: Any):
    """A bounded ImmutableSandboxedEnvironment (see the module's docstring) with `filters`
    checked; render its templates inside `bounded`."""
    from jinja2 import nodes
    from jinja2.compiler import CodeGenerator
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class BoundedCode(CodeGenerator):
        """What jinja compiles into the template's own code, past call_binop: `a ~ b` (a join; a
        template doubling a string with `~` in a loop was killed for memory), list, tuple and
        dict literals ([s, s, s, s] of a 4 MB s) and for loops (their iterations are counted)."""

        def _checked(self, fn: str, visit, node, frame) -> None:
            self.write(f"environment.{fn}(")
            visit(node, frame)
            self.write(")")

        def visit_Concat(self, node, frame):
            self._checked("checked_concat", super().visit_Concat, node, frame)

        def visit_List(self, node, frame):
            self._checked("checked_literal", super().visit_List, node, frame)

        def visit_Dict(self, node, frame):
            self._checked("checked_literal", super().visit_Dict, node, frame)

        def visit_Tuple(self, node, frame):
            if node.ctx == "load":      # (not an unpacking target: `for a, b in ...`, `set a, b = ...`)
                self._checked("checked_literal", super().visit_Tuple, node, frame)
            else:
                super().visit_Tuple(node, frame)

        def visit_For(self, node, frame):
            counted = nodes.EnvironmentAttribute("counted_loop", lineno=node.lineno)
            if not (isinstance(node.iter, nodes.Call) and node.iter.node == counted):
                node.iter = nodes.Call(counted, [node.iter], [], None, None, lineno=node.lineno)
            super().visit_For(node, frame)

    class Sandbox(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "+", "%", "**"})
        code_generator_class = BoundedCode

        counted_loop = staticmethod(_counted)

        @staticmethod
        def checked_literal(value):
            return check_size(value, "a literal")

        @staticmethod
        def checked_concat(value):
            return check_size(value, "operator ~")

        def call_binop(self, context, operator, left, right):
            cap = limit()
            if operator == "*":
                for seq, n in ((left, right), (right, left)):
                    if isinstance(seq, (*_TEXT, list, tuple)) and isinstance(n, int) and weight(seq) * n > cap:
                        raise TooLarge(f"a repetition of {len(seq):,} items ({weight(seq):,} characters) "
                                       f"{n:,} times")
            elif operator == "+":
                sized = (*_TEXT, list, tuple)
                if isinstance(left, sized) and isinstance(right, sized) and weight(left) + weight(right) > cap:
                    raise TooLarge(f"a concatenation of {weight(left):,} and {weight(right):,} characters")
            elif operator == "%" and isinstance(left, _TEXT):
                if isinstance(left, str):
                    _check_widths("a % format", _percent_widths(left, right))
                _check_result_size("a % format", _percent_size(left, right))
            elif operator == "**":
                if isinstance(left, int) and isinstance(right, int) and abs(left) > 1 \
                        and right * abs(left).bit_length() > MAX_POWER_BITS:
                    raise TooLarge(f"{left} ** {right}")
            return check_size(super().call_binop(context, operator, left, right), f"operator {operator}")

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja's own signature)
            what = getattr(__obj, "__name__", type(__obj).__name__)
            _step(f"a call of {what}", CALL_STEPS)
            # (str.format comes wrapped: jinja sandboxes it where the template reads the attribute)
            owner = getattr(getattr(__obj, "__wrapped__", __obj), "__self__", None)
            if isinstance(owner, _TEXT):
                method = f"{type(owner).__name__}.{what}"
                _step(method, _input_size(owner, *args) // CHARS_PER_STEP)   # (its time grows with it)
                if what in _WIDENING_METHODS:
                    _check_widths(method, [*args, *kwargs.values()])
                if what in _SIZED_METHODS:
                    _check_result_size(method, _SIZED_METHODS[what](owner, *args, **kwargs))
            return check_size(super().call(__context, __obj, *args, **kwargs), what)

        def wrap_str_format(self, value):
            owner = getattr(value, "__self__", None)
            if isinstance(owner, str) and getattr(value, "__name__", "") in ("format", "format_map"):
                _check_widths("str.format", _brace_widths(owner))
            return super().wrap_str_format(value)

    env = Sandbox(**options)
    # lipsum(n, min=, max=) builds n paragraphs of up to max words each before anything sees
    # its size (lipsum(10, min=10**6, max=10**6 + 1): 49 s, 234 MB); no chat template uses it
    env.globals.pop("lipsum", None)
    env.filters["tojson"] = tojson
    from jinja2 import pass_environment
    env.filters["sum"] = pass_environment(_sum)
    env.filters.update({k: _checked_filter(k, f) for k, f in env.filters.items()})
    return env
