"""Chat template from GGUF metadata (``tokenizer.chat_template``), rendered with sandboxed jinja2.

The environment matches what transformers and llama-cpp-python use for these templates:
trim_blocks + lstrip_blocks, the loopcontrols extension, ``raise_exception``, ``strftime_now``
and a ``tojson`` that keeps non-ASCII text. A model without a template gets ChatML, and
``fallback_reason`` says so.

jinja2 is imported when a template is compiled, not with this module: its import takes ~20 ms
and, through its bytecode cache's hashlib, maps OpenSSL (~5 MB resident with jinja2 itself),
which an app that only completes text never needs (the engine compiles on first chat use). A
template whose source chat_builtin.py knows (SmolLM2's, ChatML) renders in plain Python and never
needs jinja2 at all, unless a call passes the template extra variables.
"""
from __future__ import annotations

import contextvars
import functools
import json
import re
from datetime import datetime
from typing import Any, Mapping, Sequence

from edgellm.errors import ConfigError, ModelFormatError
from edgellm.model.tokenizer import check_unicode
from edgellm.model.chat_builtin import BUILTIN, CHATML

_KEY = "tokenizer.chat_template"

CHATML_TEMPLATE = CHATML


# The rendered prompt may hold at most this many characters beyond twice the conversation's own
# (its messages' roles and contents and the extra variables): a template rendering
# {{ 'x' * 1000000000 }} took 14 s and 3.9 GB before the tokenizer failed on it. Real templates
# add a few hundred characters of markup per message, far below this.
MAX_MARKUP_CHARS = 4 * 1024 * 1024
# {{ 9 ** 9 ** 9 }}: a bigint that takes minutes to compute, refused above this many bits
_MAX_POWER_BITS = 1 << 16

_limit: contextvars.ContextVar[int] = contextvars.ContextVar("edgellm_chat_template_limit", default=MAX_MARKUP_CHARS)


class _TooLarge(Exception):
    """The template would build a string or list past the render's limit."""


_SIZED = (str, list, tuple)


def _check_size(value: Any, what: str) -> Any:
    if isinstance(value, _SIZED) and len(value) > _limit.get():
        raise _TooLarge(f"{what} gives a length of {len(value):,}")
    return value


# calls and filters whose integer arguments are widths or counts of what they build
_WIDENING_METHODS = frozenset({"ljust", "rjust", "center", "zfill", "expandtabs"})
_WIDENING_FILTERS = frozenset({"center", "indent"})
_PERCENT_SPEC = re.compile(r"%[-#0 +]*(\d+|\*)?(?:\.(\d+|\*))?")
_BRACE_SPEC = re.compile(r"\{[^{}]*?:([^{}]*)\}")


def _check_widths(what: str, widths) -> None:
    """A width or count past the limit ('x'.ljust(10**9), '%1000000000s') is refused before the
    call builds anything that large; no chat template needs one."""
    limit = _limit.get()
    big = [w for w in widths if isinstance(w, int) and w > limit]
    if big:
        raise _TooLarge(f"{what} with a width of {max(big):,}")


def _percent_widths(fmt: str, args: Any) -> list[int]:
    """The field widths and precisions of a printf-style format ('*' ones taken from args)."""
    out = [int(g) for m in _PERCENT_SPEC.finditer(fmt) for g in m.groups() if g and g != "*"]
    if "*" in fmt:
        out += [a for a in (args if isinstance(args, tuple) else (args,)) if isinstance(a, int)]
    return out


def _brace_widths(fmt: str) -> list[int]:
    """The numbers in the format specs of a str.format string ('{:>1000000000}')."""
    return [int(d) for m in _BRACE_SPEC.finditer(fmt) for d in re.findall(r"\d+", m.group(1))]


def _checked_filter(name: str, f):
    """A filter whose result is held to the limit, and whose width arguments are too where it
    widens (join, center, indent, format, ... build their strings outside call_binop)."""
    passes_first = hasattr(f, "jinja_pass_arg")     # a context / environment before the value

    @functools.wraps(f)     # (keeps jinja's pass_context / pass_environment marks)
    def filt(*args: Any, **kwargs: Any) -> Any:
        rest = args[1:] if passes_first else args
        if rest:
            value, params = rest[0], rest[1:]
            if name in _WIDENING_FILTERS:
                _check_widths(f"filter {name}", [*params, *kwargs.values()])
            elif name == "format" and isinstance(value, str):
                _check_widths("filter format", _percent_widths(value, tuple(params)))
            elif name == "join":
                sep = kwargs.get("d", params[0] if params else "")
                if isinstance(sep, str) and hasattr(value, "__len__"):
                    items = sum(len(v) for v in value if isinstance(v, str)) if isinstance(value, (list, tuple)) else 0
                    if len(value) * len(sep) + items > _limit.get():
                        raise _TooLarge(f"filter join of {len(value):,} items ({items:,} characters) with a "
                                        f"separator of {len(sep):,}")
        return _check_size(f(*args, **kwargs), f"filter {name}")
    return filt


def _sandbox_class():
    """ImmutableSandboxedEnvironment whose repetition, concatenation, formatting and calls
    refuse results past the render's limit before building them where the size is known in
    advance ('x' * n, '%*s', 'x'.ljust(n)), and right after otherwise. Not covered: what a
    filter builds before its result is checked; the rendered output's cap (render) holds."""
    from jinja2.compiler import CodeGenerator
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class BoundedConcat(CodeGenerator):
        """Jinja compiles `a ~ b` to a plain join in the template's code, past call_binop: a
        template doubling a string with `~` in a loop was killed for memory (40 doublings). Each
        join's result now goes through the size check, so it stops at the first one past the
        limit, having built at most twice the limit."""

        def visit_Concat(self, node, frame):
            self.write("environment.checked_concat(")
            super().visit_Concat(node, frame)
            self.write(")")

    class Sandbox(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "+", "%", "**"})
        code_generator_class = BoundedConcat

        @staticmethod
        def checked_concat(value):
            return _check_size(value, "operator ~")

        def call_binop(self, context, operator, left, right):
            limit = _limit.get()
            if operator == "*":
                for seq, n in ((left, right), (right, left)):
                    if isinstance(seq, _SIZED) and isinstance(n, int) and len(seq) * n > limit:
                        raise _TooLarge(f"a repetition of {len(seq):,} items {n:,} times")
            elif operator == "+":
                if isinstance(left, _SIZED) and isinstance(right, _SIZED) and len(left) + len(right) > limit:
                    raise _TooLarge(f"a concatenation of {len(left):,} and {len(right):,} items")
            elif operator == "%" and isinstance(left, str):
                _check_widths("a % format", _percent_widths(left, right))
            elif operator == "**":
                if isinstance(left, int) and isinstance(right, int) and abs(left) > 1 \
                        and right * abs(left).bit_length() > _MAX_POWER_BITS:
                    raise _TooLarge(f"{left} ** {right}")
            return _check_size(super().call_binop(context, operator, left, right), f"operator {operator}")

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja's own signature)
            what = getattr(__obj, "__name__", type(__obj).__name__)
            if isinstance(getattr(__obj, "__self__", None), str) and what in _WIDENING_METHODS:
                _check_widths(f"str.{what}", [*args, *kwargs.values()])
            return _check_size(super().call(__context, __obj, *args, **kwargs), what)

        def wrap_str_format(self, value):
            owner = getattr(value, "__self__", None)
            if isinstance(owner, str) and getattr(value, "__name__", "") in ("format", "format_map"):
                _check_widths("str.format", _brace_widths(owner))
            return super().wrap_str_format(value)

    return Sandbox


def _conversation_chars(messages: Sequence[Mapping[str, Any]], extra: Mapping[str, Any]) -> int:
    n = sum(len(m["role"]) + len(m["content"]) for m in messages)
    if extra:
        try:   # (tools and the like: their JSON is about what a template prints of them)
            n += len(json.dumps(extra, default=str, ensure_ascii=False))
        except (TypeError, ValueError, RecursionError):
            pass
    return n


class _TemplateRaised(Exception):
    """raise_exception() called by the template: the conversation is not one it accepts."""


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(message)


def _tojson(value: Any, indent: int | None = None, separators=None, sort_keys: bool = False,
            ensure_ascii: bool = False, **_: Any) -> str:
    """Hugging Face's tojson: its keywords are honoured (templates ask for compact separators)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                      separators=tuple(separators) if separators is not None else None, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class ChatTemplate:
    """Renders a list of {role, content} messages into the prompt text the model was tuned on."""

    def __init__(self, source: str, text: str, bos_token: str, eos_token: str,
                 fallback_reason: str | None = None):
        self.source = source
        self.text = text                        # the jinja2 source being rendered
        self.bos_token = bos_token              # exposed to the template as bos_token
        self.eos_token = eos_token              # exposed to the template as eos_token
        self.fallback_reason = fallback_reason  # None when the model's own template is used
        self.builtin = BUILTIN.get(text)        # its plain-Python renderer, when chat_builtin knows it
        self._template = None if self.builtin else self._compile()

    def _compile(self):
        import jinja2

        env = _sandbox_class()(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = _tojson
        env.filters.update({k: _checked_filter(k, f) for k, f in env.filters.items()})
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            return env.from_string(self.text)
        except jinja2.TemplateError as e:
            raise ModelFormatError(self.source, _KEY, f"not a valid jinja2 template: {e}") from None

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, Any], source: str) -> "ChatTemplate":
        source = str(source)
        tokens = metadata.get("tokenizer.ggml.tokens") or []

        def token(key: str) -> str:
            i = metadata.get(key)
            return tokens[i] if isinstance(i, int) and 0 <= i < len(tokens) else ""

        bos, eos = token("tokenizer.ggml.bos_token_id"), token("tokenizer.ggml.eos_token_id")
        text = metadata.get(_KEY)
        if text is None or (isinstance(text, str) and not text.strip()):
            reason = f"{source} has no {_KEY}; using ChatML"
            if "<|im_start|>" not in tokens:
                reason += " (its vocabulary has no <|im_start|> token, so the markup is plain text)"
            return cls(source, CHATML_TEMPLATE, bos, eos, fallback_reason=reason)
        if not isinstance(text, str):
            raise ModelFormatError(source, _KEY, f"expected a string, found {type(text).__name__}")
        return cls(source, text, bos, eos)

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
               **extra: Any) -> str:
        """The prompt text for ``messages``; ``extra`` reaches the template (e.g. tools)."""
        self.check_messages(messages)
        if self.builtin is not None and not extra:
            return self.builtin(messages, add_generation_prompt)
        import jinja2

        if self._template is None:          # a known template asked for extra variables
            self._template = self._compile()
        limit = MAX_MARKUP_CHARS + 2 * _conversation_chars(messages, extra)
        token = _limit.set(limit)
        try:
            # streamed, the length counted as it grows: a loop printing forever stops at the limit
            parts, n = [], 0
            for part in self._template.generate(messages=[dict(m) for m in messages],
                                                add_generation_prompt=add_generation_prompt,
                                                bos_token=self.bos_token, eos_token=self.eos_token, **extra):
                n += len(part)
                if n > limit:
                    raise _TooLarge(f"the output passes {limit:,} characters")
                parts.append(part)
            return "".join(parts)
        except _TooLarge as e:
            raise ModelFormatError(self.source, _KEY,
                                   f"the template renders too large a prompt: {e}; the limit is "
                                   f"{MAX_MARKUP_CHARS:,} characters plus twice the conversation's "
                                   f"({limit:,} here)") from None
        except _TemplateRaised as e:
            raise ConfigError(f"the chat template of {self.source} rejected the conversation: {e}") from None
        except jinja2.TemplateError as e:
            raise ModelFormatError(self.source, _KEY, f"rendering failed: {e}") from None
        except Exception as e:   # (a template's own arithmetic or call: ZeroDivisionError, TypeError, ...)
            raise ModelFormatError(self.source, _KEY, f"rendering failed: {type(e).__name__}: {e}") from None
        finally:
            _limit.reset(token)

    @staticmethod
    def check_conversation(messages: Any) -> None:
        """check_messages, and at least one message: what the Engine renders for a request (a
        template reading messages[0] failed on an empty list, blaming the model file; others
        rendered a bare generation prompt)."""
        ChatTemplate.check_messages(messages)
        if not messages:
            raise ConfigError("messages: the conversation is empty: give at least one message")

    @staticmethod
    def check_messages(messages: Any) -> None:
        """ConfigError unless messages is a list of {'role': str, 'content': str}."""
        if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
            raise ConfigError(f"messages: expected a list of {{role, content}} dicts, found "
                              f"{type(messages).__name__}")
        for k, m in enumerate(messages):
            if not isinstance(m, Mapping) or not isinstance(m.get("role"), str) \
                    or not isinstance(m.get("content"), str):
                raise ConfigError(f"messages[{k}]: expected {{'role': str, 'content': str}}, found {m!r}")
            # named here, not at an offset of the rendered prompt
            check_unicode(m["content"], f"messages[{k}].content")
