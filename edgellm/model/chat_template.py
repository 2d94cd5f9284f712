"""Chat template from GGUF metadata (``tokenizer.chat_template``), rendered with sandboxed jinja2.

The environment matches what transformers and llama-cpp-python use for these templates:
trim_blocks + lstrip_blocks, the loopcontrols extension, ``raise_exception``, ``strftime_now``
and a ``tojson`` that keeps non-ASCII text. A model without a template gets ChatML, and
``fallback_reason`` says so. The sandbox and its size and time bounds: template_sandbox.py.

jinja2 is imported when a template is compiled, not with this module: its import takes ~20 ms
and, through its bytecode cache's hashlib, maps OpenSSL (~5 MB resident with jinja2 itself),
which an app that only completes text never needs (the engine compiles on first chat use). A
template whose source chat_builtin.py knows (SmolLM2's, ChatML) renders in plain Python and never
needs jinja2 at all, unless a call passes the template extra variables.
"""
from __future__ import annotations

import json
from datetime import datetime
from typing import Any, Mapping, Sequence

from edgellm.errors import ConfigError, ModelFormatError, shown
from edgellm.model.tokenizer import check_unicode
from edgellm.model import template_sandbox
from edgellm.model.chat_builtin import BUILTIN, CHATML

_KEY = "tokenizer.chat_template"

CHATML_TEMPLATE = CHATML


# The rendered prompt may hold at most this many characters beyond twice the conversation's own
# (its messages' roles and contents and the extra variables): a template rendering
# {{ 'x' * 1000000000 }} took 14 s and 3.9 GB before the tokenizer failed on it. Real templates
# add a few hundred characters of markup per message, far below this.
MAX_MARKUP_CHARS = template_sandbox.DEFAULT_LIMIT     # (4 MiB)


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

        env = template_sandbox.sandbox(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
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
        messages = self.check_messages(messages)
        if self.builtin is not None and not extra:
            return self.builtin(messages, add_generation_prompt)
        import jinja2

        if self._template is None:          # a known template asked for extra variables
            self._template = self._compile()
        limit = MAX_MARKUP_CHARS + 2 * _conversation_chars(messages, extra)
        try:
            with template_sandbox.bounded(limit):
                # streamed, the length counted as it grows: a loop printing forever stops at the limit
                parts, n = [], 0
                for part in self._template.generate(messages=[dict(m) for m in messages],
                                                    add_generation_prompt=add_generation_prompt,
                                                    bos_token=self.bos_token, eos_token=self.eos_token, **extra):
                    n += len(part)
                    if n > limit:
                        raise template_sandbox.TooLarge(f"the output passes {limit:,} characters")
                    parts.append(part)
                return "".join(parts)
        except template_sandbox.TooLarge as e:
            raise ModelFormatError(self.source, _KEY,
                                   f"the template renders too large a prompt: {e}; the limit is "
                                   f"{MAX_MARKUP_CHARS:,} characters plus twice the conversation's "
                                   f"({limit:,} here)") from None
        except template_sandbox.TooLong as e:
            raise ModelFormatError(self.source, _KEY, f"the template runs too long: {e}") from None
        except _TemplateRaised as e:
            raise ConfigError(f"the chat template of {self.source} rejected the conversation: {e}") from None
        except jinja2.TemplateError as e:
            raise ModelFormatError(self.source, _KEY, f"rendering failed: {e}") from None
        except Exception as e:   # (a template's own arithmetic or call: ZeroDivisionError, TypeError, ...)
            raise ModelFormatError(self.source, _KEY, f"rendering failed: {type(e).__name__}: {e}") from None

    @staticmethod
    def check_conversation(messages: Any) -> list:
        """check_messages, and at least one message: what the Engine renders for a request (a
        template reading messages[0] failed on an empty list, blaming the model file; others
        rendered a bare generation prompt)."""
        items = ChatTemplate.check_messages(messages)
        if not items:
            raise ConfigError("messages: the conversation is empty: give at least one message")
        return items

    @staticmethod
    def check_messages(messages: Any) -> list:
        """ConfigError unless messages is a list of {'role': str, 'content': str}; returns them
        as a list. (An app's own Sequence or Mapping is read once: one whose len() raised, or
        whose get() and [] disagreed, leaked its own error from here.)"""
        if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
            raise ConfigError(f"messages: expected a list of {{role, content}} dicts, found "
                              f"{type(messages).__name__}")
        try:
            items = [dict(m) if isinstance(m, Mapping) else m for m in messages]   # (plain copies, read once)
        except Exception as e:   # noqa: BLE001 - an app's sequence or mapping that fails as it is read
            raise ConfigError(f"messages: could not be read ({type(e).__name__}: {shown(e)})") from None
        for k, m in enumerate(items):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise ConfigError(f"messages[{k}]: expected {{'role': str, 'content': str}}, found {shown(m)}")
            # named here, not at an offset of the rendered prompt
            check_unicode(m["content"], f"messages[{k}].content")
        return items
