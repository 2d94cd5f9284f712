"""The Python API on a tiny synthetic model: generate / stream / chat / logits / stats / cancel."""
import threading

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

import edgellm
from edgellm.api import GenerationConfig
from edgellm.engine import CancelToken
from edgellm.errors import ConfigError, ContextFull, ModelFormatError, ModelNotFoundError
from tests.synthetic import write_tiny_model


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    tm = write_tiny_model(tmp_path_factory.mktemp("api") / "tiny.gguf", tensor_type=QT.Q8_0, seed=2)
    return edgellm.load(tm.path, n_ctx=128, threads=1)


def test_generate_equals_joined_stream_and_is_deterministic_greedy(engine):
    a = engine.generate("hello world", max_tokens=10, temperature=0)
    b = "".join(engine.stream("hello world", max_tokens=10, temperature=0))
    assert a == b
    assert engine.last_stats.generated_tokens >= 1


def test_stats_are_filled(engine):
    engine.generate("the quick brown fox", max_tokens=6, temperature=0, config=GenerationConfig(ignore_eos=True))
    s = engine.last_stats
    assert s.prompt_tokens == len(engine.tokenize("the quick brown fox"))
    assert s.generated_tokens == 6 and s.stop_reason == "max_tokens"
    assert 0 < s.prefill_ms <= s.ttft_ms and s.tokenize_ms >= 0
    assert s.decode_tps > 0 and s.peak_rss_mb > 0


def test_seeded_sampling_reproducible(engine):
    kw = dict(max_tokens=12, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=123, ignore_eos=True)
    assert engine.generate("abc", **kw) == engine.generate("abc", **kw)


def test_logits_teacher_forced_shape_and_consistency(engine):
    # one unit for both phases: the default plan may run decode steps on another unit (int8
    # matmuls on neon), whose roundings differ from the fp32 prefill's
    engine = edgellm.load(engine.model.path, n_ctx=128, threads=1, units=["reference"])
    ids = engine.tokenize("one two three")
    lg = engine.logits(ids)
    assert lg.shape == (len(ids), engine.config.vocab_size) and lg.dtype == np.float32
    # each row equals what an incremental forward pass over the prefix produces
    r, seq = engine.runner, engine._new_sequence()
    np.testing.assert_allclose(r.forward(seq, ids[:2]), lg[1], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(r.forward(seq, ids[2:3]), lg[2], rtol=1e-4, atol=1e-5)
    seq.free()


def test_stop_string_is_not_emitted(engine):
    text = engine.generate("hello", max_tokens=20, temperature=0, ignore_eos=True)
    if len(text) < 3:
        pytest.skip("greedy output too short to pick a stop string from")  # pragma: no cover
    stop = text[1:3]
    out = engine.generate("hello", max_tokens=20, temperature=0, ignore_eos=True, stop=stop)
    assert stop not in out and engine.last_stats.stop_reason == "stop"
    assert text.startswith(out)


def test_chat_uses_template(engine):
    prompt = engine.render_chat([{"role": "user", "content": "hi"}])
    assert "hi" in prompt
    out = engine.chat([{"role": "user", "content": "hi"}], max_tokens=4, temperature=0)
    assert out == engine.generate(prompt, max_tokens=4, temperature=0)


def test_cancel_before_first_token_returns_nothing_and_engine_reusable(engine):
    tok = CancelToken()
    it = engine.stream("hello world", max_tokens=50, temperature=0, ignore_eos=True, cancel=tok)
    first = next(it)  # prefill done, first piece out
    tok.cancel()
    rest = list(it)
    assert engine.last_stats.stop_reason == "cancelled"
    assert len(rest) <= 1
    again = engine.generate("hello world", max_tokens=5, temperature=0, ignore_eos=True)
    assert again.startswith(first) or first.startswith(again[: len(first)])


def test_a_cancel_before_the_request_starts_is_honoured(engine):
    """A caller's token cancelled already, or engine.cancel() between stream() and the first
    piece: the request ends as cancelled with nothing (the token was reset when the generation
    started, so both ran to the end). The engine's own token starts afresh with each request."""
    tok = CancelToken()
    tok.cancel()
    assert engine.generate("hello world", max_tokens=8, temperature=0, cancel=tok) == ""
    assert engine.last_stats.stop_reason == "cancelled" and engine.last_stats.generated_tokens == 0
    assert tok.cancelled
    it = engine.stream("hello world", max_tokens=8, temperature=0)
    engine.cancel()
    assert "".join(it) == "" and engine.last_stats.stop_reason == "cancelled"
    assert engine.generate("hello world", max_tokens=3, temperature=0, ignore_eos=True)
    assert engine.last_stats.stop_reason == "max_tokens"
    with pytest.raises(ConfigError, match="cancel: expected an edgellm.engine.CancelToken, found int"):
        engine.stream("hello", cancel=5)


def test_engine_cancel_from_other_thread(engine):
    # the cancel arrives from another thread after the first piece; decode stops at the next token
    pieces = []
    for p in engine.stream("a b c", max_tokens=100, temperature=0, ignore_eos=True):
        if not pieces:
            t = threading.Thread(target=engine.cancel)
            t.start()
            t.join()
        pieces.append(p)
    assert engine.last_stats.stop_reason == "cancelled"
    assert engine.last_stats.generated_tokens < 100


@pytest.mark.parametrize("kw", [dict(temperature=-1), dict(top_p=-0.1), dict(top_k=-2), dict(max_tokens=0),
                                dict(min_p=2.0), dict(bogus=1)])
def test_bad_generation_options_are_config_errors(engine, kw):
    with pytest.raises(ConfigError):
        engine.generate("x", **kw)


def test_prompt_longer_than_context(engine):
    with pytest.raises(ContextFull):
        engine.generate("a " * 400, max_tokens=2)


def test_bad_options_and_messages_fail_before_iteration(engine):
    with pytest.raises(ConfigError):
        engine.chat_stream([{"role": "user"}])
    with pytest.raises(ConfigError):
        engine.stream("x", temperature=-1)


@pytest.mark.parametrize("prompt, found", [(b"hello", "found bytes; decode bytes first"), (12345, "found int"),
                                           (None, "found NoneType"), (["hi"], "found list")])
def test_a_prompt_that_is_not_text_is_a_config_error_naming_its_type(engine, prompt, found):
    """Not a TypeError from inside the tokenizer ("a bytes-like object is required, not 'str'"
    for bytes): stream refuses it before iteration, the scheduler at submit, tokenize too."""
    from edgellm.scheduler import Scheduler

    with pytest.raises(ConfigError, match=f"prompt: expected a str, {found}"):
        engine.stream(prompt, max_tokens=2)
    # (submit's None is no prompt: "submit needs exactly one of prompt or messages")
    with Scheduler(engine) as s, pytest.raises(ConfigError, match=f"prompt: expected a str, {found}"
                                                if prompt is not None else "exactly one of prompt or messages"):
        s.submit(prompt, max_tokens=2)
    with pytest.raises(ConfigError, match=f"text: expected a str, {found}"):
        engine.tokenize(prompt)


def test_detokenizing_an_id_outside_the_vocabulary_is_a_typed_error(engine):
    from edgellm.errors import EdgeLLMError, TokenIdError

    n = engine.config.vocab_size
    for bad in (n, -1, 10**9):
        with pytest.raises(TokenIdError, match=f"token id {bad} outside the vocabulary") as e:
            engine.detokenize([1, bad])
        assert isinstance(e.value, EdgeLLMError) and isinstance(e.value, IndexError)


def test_saving_a_session_to_a_directory_names_it(engine, tmp_path):
    engine.generate("hello", max_tokens=2, temperature=0)
    with pytest.raises(ConfigError, match="is a directory; save_session writes only new files or session files"):
        engine.save_session(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_save_session_never_replaces_a_file_that_is_not_a_session(engine, tmp_path):
    """A user's document, or a device or pipe (as root, /dev/null became a regular file), given
    as the session path: refused, untouched. A session file, even a stale one, is replaced."""
    import os

    engine.generate("hello", max_tokens=2, temperature=0)
    doc, fifo, sess = tmp_path / "notes.txt", tmp_path / "pipe", tmp_path / "s.edgesess"
    doc.write_text("my notes")
    os.mkfifo(fifo)
    with pytest.raises(ConfigError, match="exists and is not an edgellm session file"):
        engine.save_session(doc)
    with pytest.raises(ConfigError, match="is not a regular file"):
        engine.save_session(fifo)
    assert doc.read_text() == "my notes" and fifo.is_fifo()
    n = engine.save_session(sess)
    assert engine.save_session(sess) == n and sess.read_bytes()[:8] == b"EDGESESS"


@pytest.mark.parametrize("call, message", [
    (lambda e: e.stream("hi", stop=""), "sampling.stop: expected non-empty strings, found ''"),
    (lambda e: e.stream("hi", stop=123), "stop: expected a string or a list of strings, found int"),
    (lambda e: e.stream("hi", config=5), "config: expected an edgellm.GenerationConfig, found int"),
    (lambda e: e.stream("hi", ignore_eos="yes"), "ignore_eos must be True or False"),
    (lambda e: e.stream("hi", max_tokens=True), "max_tokens must be an integer >= 1, got True"),
    (lambda e: e.logits(["a"]), r"token ids\[0\]: expected an integer token id, found 'a'"),
    (lambda e: e.logits(None), "token ids: expected a sequence of integer token ids, found NoneType"),
    (lambda e: e.logits([1.7]), r"token ids\[0\]: expected an integer token id, found 1.7"),
    (lambda e: e.logits([2**63]), "token id 9223372036854775808 outside the vocabulary"),
    (lambda e: e.detokenize("abc"), "token ids: expected a sequence of integer token ids, found str"),
    (lambda e: e.detokenize([1.5]), r"token ids\[0\]: expected an integer token id, found 1.5"),
    (lambda e: e.load_session(5), "load_session: expected a file path, found int"),
    (lambda e: e.save_session("/tmp/x.edgesess", meta=[1, 2]), "save_session: meta must be a dict"),
])
def test_bad_arguments_are_config_errors_named_up_front(engine, call, message):
    """Each was a TypeError, ValueError, OverflowError or AttributeError from deep inside, a
    stop string checked only at the first piece, or a float id silently truncated."""
    with pytest.raises(ConfigError, match=message):
        call(engine)


def test_logits_after_a_generation_fills_most_of_the_context(tmp_path):
    """The finished conversation the engine keeps for the next turn held the room logits()
    needed: ContextFull 'held by live sequences' with no request live. It lets it go now; more
    ids than the context holds say so."""
    tm = write_tiny_model(tmp_path / "t.gguf", seed=2)
    eng = edgellm.load(tm.path, n_ctx=64, threads=1)
    ids = list(range(10, 40))
    want = eng.logits(ids)
    eng.generate("hello", max_tokens=40, temperature=0, ignore_eos=True)
    np.testing.assert_array_equal(eng.logits(ids), want)
    with pytest.raises(ContextFull, match="logits: 65 token ids but the context holds 64"):
        eng.logits(list(range(10, 75)))


def test_a_bad_chat_template_fails_the_first_chat_not_the_load(tmp_path):
    # the template compiles on first use (jinja2 stays out of completion-only processes); until
    # then the model completes text, and a chat then names the field
    tm = write_tiny_model(tmp_path / "t.gguf", extra_metadata={"tokenizer.chat_template": "{% for %}"})
    eng = edgellm.load(tm.path, n_ctx=64, threads=1)
    assert eng.generate("hi", max_tokens=2, temperature=0) == eng.generate("hi", max_tokens=2, temperature=0)
    with pytest.raises(ModelFormatError) as e:
        eng.chat([{"role": "user", "content": "hi"}], max_tokens=2)
    assert e.value.field == "tokenizer.chat_template"
    with pytest.raises(ConfigError):   # messages are still checked before the template is needed
        eng.chat_stream([{"role": "user"}])


def test_load_errors(tmp_path):
    with pytest.raises(ModelNotFoundError):
        edgellm.load(str(tmp_path / "missing.gguf"))
    with pytest.raises(ConfigError):
        edgellm.load(str(tmp_path / "missing.gguf"), device="mali-npu-9000")
    with pytest.raises(ConfigError):
        edgellm.load(str(tmp_path / "missing.gguf"), threads=0)


def test_load_refuses_a_model_the_available_memory_cannot_hold(tmp_path, monkeypatch):
    tm = write_tiny_model(tmp_path / "tiny.gguf", tensor_type=QT.Q8_0, seed=2)
    monkeypatch.setattr("edgellm.api.available_bytes", lambda: 4096)
    with pytest.raises(ConfigError, match="not enough memory"):
        edgellm.load(tm.path, n_ctx=128, threads=1)


def test_a_template_that_writes_bos_gets_one_bos_not_two(tmp_path):
    """add_bos_token true and a template starting with {{ bos_token }} (Llama-2/3, Mistral): chat
    prompts started with BOS twice; llama.cpp strips the rendered one. Plain prompts keep the
    model's add_bos."""
    from edgellm.scheduler import Scheduler

    tmpl = ("{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    tm = write_tiny_model(tmp_path / "bos.gguf", seed=2, extra_metadata={
        "tokenizer.ggml.add_bos_token": True, "tokenizer.ggml.bos_token_id": 0, "tokenizer.chat_template": tmpl})
    eng = edgellm.load(tm.path, n_ctx=128, threads=1)
    msgs = [{"role": "user", "content": "hi"}]
    text = eng.render_chat(msgs)
    assert text.startswith(eng.tokenizer.token_text(0))
    want = eng.tokenize(text, add_bos=False)
    assert want[0] == 0 and want[1] != 0
    eng.chat(msgs, max_tokens=2, temperature=0)
    assert eng.last_stats.prompt_tokens == len(want)
    with Scheduler(eng) as s:
        r = s.submit(messages=msgs, max_tokens=2, temperature=0)
        r.result(timeout=30)
    assert r.stats.prompt_tokens == len(want)
    assert eng.tokenize("hi")[0] == 0 and eng.tokenize("hi")[1] != 0      # a plain prompt: one BOS added


def test_the_api_types_are_reachable_from_the_package():
    """The README's cancel=CancelToken() needed `from edgellm.engine import CancelToken`."""
    import edgellm
    from edgellm.api import Engine, GenerationConfig
    from edgellm.engine import CancelToken
    from edgellm.scheduler import Scheduler
    assert (edgellm.CancelToken, edgellm.Engine, edgellm.GenerationConfig, edgellm.Scheduler) == \
        (CancelToken, Engine, GenerationConfig, Scheduler)
