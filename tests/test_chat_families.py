"""Chat on templates other than SmolLM2's (from a helper's probe with Llama 3, Mistral, Gemma 2,
DeepSeek and others): a template that writes {{ bos_token }} itself, one that refuses system
turns, one that fails while rendering, a model with no template, an empty conversation, and
tojson's keywords."""
import logging
import os
import re
import subprocess
import sys

import pytest
from typer.testing import CliRunner

import edgellm
from edgellm.cli import app
from edgellm.errors import ConfigError, ModelFormatError
from edgellm.model.chat_template import ChatTemplate
from tests.synthetic import BOS_ID, write_tiny_model

runner = CliRunner()
# Llama 3 / Mistral / Gemma style: the template writes BOS, and the model's add_bos is on
BOS_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\n' }}{% endfor %}"
                "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}")
NO_SYSTEM = ("{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
             "{% endif %}" + BOS_TEMPLATE)


def _model(tmp_path, name, template=None, omit=()):
    meta = {"tokenizer.ggml.add_bos_token": True}
    if template is not None:
        meta["tokenizer.chat_template"] = template
    return write_tiny_model(tmp_path / f"{name}.gguf", seed=2, extra_metadata=meta, omit=omit).path


def test_a_template_that_writes_bos_gets_one_through_run_and_warm(tmp_path, monkeypatch):
    """`run --chat` rendered the template and then tokenized it with the model's add_bos: two
    BOS (Engine.chat and llama.cpp give one). warm() of the rendered system turn did the same,
    so the chat after it never reused the warmed blocks."""
    monkeypatch.setenv("EDGELLM_HOME", str(tmp_path / "home"))
    path = _model(tmp_path, "bos", BOS_TEMPLATE)
    eng = edgellm.load(path, n_ctx=256, threads=1)
    msgs = [{"role": "user", "content": "hello"}]
    eng.chat(msgs, max_tokens=1, temperature=0)
    alone = eng.last_stats.prompt_tokens
    ids = eng._prompt_ids(eng.render_chat(msgs))
    assert ids.count(BOS_ID) == 1 and len(ids) == alone
    r = runner.invoke(app, ["run", "hello", "--chat", "-m", path, "-n", "1", "--temperature", "0"])
    assert r.exit_code == 0 and f"prompt {alone} tok" in r.stderr, r.stderr
    system = [{"role": "system", "content": "You answer in one short line about the world. " * 3}]
    eng.clear_cache()
    eng.warm(eng.render_chat(system)[: -len("assistant: ")])
    eng.chat(system + msgs, max_tokens=1, temperature=0)
    assert eng.last_stats.cached_tokens >= eng.kv.pool.block_tokens
    # an app that renders itself and calls generate() tokenizes as warm() does (it got a second
    # BOS there, and 0 cached tokens; from a review of the day's change)
    eng.generate(eng.render_chat(system + msgs), max_tokens=1, temperature=0)
    assert eng.last_stats.cached_tokens >= eng.kv.pool.block_tokens


def test_a_template_failing_in_its_own_code_is_a_model_format_error(tmp_path):
    t = ChatTemplate("m.gguf", "{{ messages[0]['content'] }}{{ 1 / 0 }}", "<s>", "</s>")
    with pytest.raises(ModelFormatError, match=r"tokenizer.chat_template: rendering failed: ZeroDivisionError"):
        t.render([{"role": "user", "content": "hi"}])


def test_an_empty_conversation_is_the_callers_error_on_every_template(tmp_path):
    for template in (BOS_TEMPLATE, None):   # one reading messages[0]; the synthetic ChatML one
        eng = edgellm.load(_model(tmp_path, "empty", template), n_ctx=128, threads=1)
        for call in (lambda: eng.chat([], max_tokens=1), lambda: eng.render_chat([])):
            with pytest.raises(ConfigError, match="the conversation is empty"):
                call()


def test_chat_refuses_a_system_prompt_its_template_rejects_before_the_first_turn(tmp_path):
    """Every turn failed with 'System role not supported', /reset kept the system prompt, and the
    chat could not recover."""
    path = _model(tmp_path, "nosys", NO_SYSTEM)
    r = subprocess.run([sys.executable, "-c", "from edgellm.cli import main; main()", "chat", "-m", path,
                        "--system", "Be brief", "-n", "1"], input="Hello\nAgain\n", capture_output=True, text=True,
                       env={**os.environ, "EDGELLM_HOME": str(tmp_path / "home")}, timeout=60)
    assert r.returncode == 1 and r.stderr.count("System role not supported") == 1, r.stderr
    assert r.stdout == "" and "edgellm chat with" not in r.stderr


def test_a_model_without_a_template_says_it_gets_chatml(tmp_path, caplog):
    path = _model(tmp_path, "none", omit=("tokenizer.chat_template",))
    eng = edgellm.load(path, n_ctx=128, threads=1)
    with caplog.at_level(logging.WARNING, logger="edgellm"):
        eng.render_chat([{"role": "user", "content": "hi"}])
    assert any(re.search(r"has no tokenizer.chat_template; using ChatML", r.getMessage()) for r in caplog.records)


def test_tojson_takes_hugging_faces_keywords():
    t = ChatTemplate("m.gguf", "{{ messages[0]['content'] | length }}"
                     "{{ {'b': 1, 'a': 'é'} | tojson(separators=(',', ':'), sort_keys=true, ensure_ascii=true) }}",
                     "<s>", "</s>")
    assert t.render([{"role": "user", "content": "x"}]).endswith('{"a":"\\u00e9","b":1}')
