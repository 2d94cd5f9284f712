"""Plain-Python renderers for chat templates whose jinja2 source we know by heart.

A chat app's first turn paid for jinja2: its import (~16 ms on this project's x86 host) and the
template's compile (~3.5 ms) came before the first token, and jinja2 with the OpenSSL its
bytecode cache maps stayed ~5 MB resident. A template whose source is byte for byte one below
renders here instead, to the same text (tests/test_chat_builtin.py holds each against jinja2 on
generated conversations); any other template, or a call that passes the template extra
variables, still goes through jinja2.

Each renderer takes the checked messages (every one a mapping with str 'role' and 'content')
and add_generation_prompt.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

Renderer = Callable[[Sequence[Mapping[str, Any]], bool], str]

# ChatML: what a model without a template gets (chat_template.CHATML_TEMPLATE)
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_SMOLLM2_SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"

# SmolLM2-*-Instruct's tokenizer.chat_template: ChatML with a default system turn
SMOLLM2 = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '" + _SMOLLM2_SYSTEM + "' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _chatml_turns(messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool, head: str = "") -> str:
    parts = [head]
    parts += ["<|im_start|>" + m["role"] + "\n" + m["content"] + "<|im_end|>\n" for m in messages]
    if add_generation_prompt:
        parts.append("<|im_start|>assistant\n")
    return "".join(parts)


def render_chatml(messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool) -> str:
    return _chatml_turns(messages, add_generation_prompt)


def render_smollm2(messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool) -> str:
    # the default system turn comes inside the loop: only when there is a first message
    head = _SMOLLM2_SYSTEM if messages and messages[0]["role"] != "system" else ""
    return _chatml_turns(messages, add_generation_prompt, head)


BUILTIN: dict[str, Renderer] = {CHATML: render_chatml, SMOLLM2: render_smollm2}
