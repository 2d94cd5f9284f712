"""The plain-Python chat template renderers (edgellm/model/chat_builtin.py) give the text jinja2
gives for the same template source, on generated conversations; anything else still renders
through jinja2, and a known template keeps jinja2 out of the process."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edgellm.errors import ConfigError
from edgellm.model.chat_builtin import BUILTIN, CHATML, SMOLLM2
from edgellm.model.chat_template import ChatTemplate

sys.path.insert(0, str(Path(__file__).parent))
from synthetic import write_tiny_model  # noqa: E402

# roles the templates treat specially, and anything else; contents with the markup's own
# characters, template syntax, line breaks and non-ASCII text
_roles = st.one_of(st.sampled_from(["system", "user", "assistant", "tool"]), st.text(max_size=12))
_contents = st.one_of(st.text(max_size=60),
                      st.sampled_from(["", "\n", "<|im_end|>", "{{ x }}", "{% if %}", "système\r\n😀"]))
_messages = st.lists(st.fixed_dictionaries({"role": _roles, "content": _contents}), max_size=6)


def _jinja(t: ChatTemplate, messages, add_generation_prompt: bool) -> str:
    """The same template source compiled and rendered by jinja2, as ChatTemplate renders others."""
    return t._compile().render(messages=[dict(m) for m in messages], add_generation_prompt=add_generation_prompt,
                               bos_token=t.bos_token, eos_token=t.eos_token)


@pytest.mark.parametrize("text", [CHATML, SMOLLM2], ids=["chatml", "smollm2"])
@settings(max_examples=400, deadline=None)
@given(messages=_messages, add_generation_prompt=st.booleans())
def test_builtin_renders_what_jinja2_renders(text, messages, add_generation_prompt):
    t = ChatTemplate("test.gguf", text, "<s>", "</s>")
    assert t.builtin is BUILTIN[text] and t._template is None
    assert t.render(messages, add_generation_prompt) == _jinja(t, messages, add_generation_prompt)


def test_smollm2_default_system_turn_only_before_a_first_non_system_message():
    t = ChatTemplate("test.gguf", SMOLLM2, "", "")
    assert t.render([], add_generation_prompt=False) == ""
    assert t.render([{"role": "user", "content": "hi"}]).startswith("<|im_start|>system\nYou are a helpful")
    assert t.render([{"role": "system", "content": "Be brief."}], add_generation_prompt=False) == \
        "<|im_start|>system\nBe brief.<|im_end|>\n"


def test_other_templates_and_extra_variables_render_through_jinja2():
    other = ChatTemplate("test.gguf", "{{ messages[0]['content'] }}|{{ tools }}", "", "")
    assert other.builtin is None and other._template is not None
    assert other.render([{"role": "user", "content": "a"}], tools="T") == "a|T"
    known = ChatTemplate("test.gguf", CHATML, "", "")
    msgs = [{"role": "user", "content": "a"}]
    assert known.render(msgs, tools="T") == known.render(msgs)    # compiled when extra variables come
    assert known._template is not None


def test_builtin_path_still_checks_the_messages():
    t = ChatTemplate("test.gguf", SMOLLM2, "", "")
    for bad in ("hi", [{"role": "user"}], [{"role": 1, "content": "x"}], [None]):
        with pytest.raises(ConfigError):
            t.render(bad)


_CHAT_CHILD = """
import sys
import edgellm
eng = edgellm.load(sys.argv[1], n_ctx=128, threads=1)
eng.wait_loaded()
eng.chat([{"role": "user", "content": "hello"}], max_tokens=2)
print(eng.template.builtin is not None, "jinja2" in sys.modules)
"""


def test_a_chat_with_a_known_template_does_not_import_jinja2(tmp_path):
    m = write_tiny_model(tmp_path / "m.gguf", n_layers=1, extra_metadata={"tokenizer.chat_template": SMOLLM2})
    env = dict(os.environ, EDGELLM_HOME=str(tmp_path / "home"))
    out = subprocess.run([sys.executable, "-c", _CHAT_CHILD, str(m.path)], capture_output=True, text=True,
                         timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "True False"
