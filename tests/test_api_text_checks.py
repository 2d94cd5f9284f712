"""Text the API takes is checked where the caller's name for it is known (from a helper's
differential probe of the tokenizer): a lone surrogate in a chat message was reported at an
offset of the rendered template, in a prompt only at the first piece, and in a stop string never
(it could not match); add_bos="no" added a BOS; detokenize(tokenize(s)) gave "<s>" + s with no
way back to s."""
import pytest
from gguf import GGMLQuantizationType as QT

import edgellm
from edgellm.errors import ConfigError
from tests.synthetic import write_tiny_model


@pytest.fixture(scope="module")
def eng(tmp_path_factory):
    path = write_tiny_model(tmp_path_factory.mktemp("txt") / "m.gguf", tensor_type=QT.Q8_0, seed=1,
                            extra_metadata={"tokenizer.ggml.add_bos_token": True}).path
    return edgellm.load(path, n_ctx=128, threads=1)


def test_a_lone_surrogate_is_named_where_the_caller_put_it(eng):
    with pytest.raises(ConfigError, match=r"messages\[1\].content: character 2 is a lone surrogate"):
        eng.chat([{"role": "user", "content": "ok"}, {"role": "user", "content": "hi\ud800"}], max_tokens=1)
    with pytest.raises(ConfigError, match=r"prompt: character 3 is a lone surrogate"):
        eng.stream("abc\udfff")                          # when the request is made, before any piece
    with pytest.raises(ConfigError, match=r"sampling.stop: character 0 is a lone surrogate"):
        eng.generate("hello", max_tokens=2, stop=["\ud800"])


def test_add_bos_and_skip_special_take_booleans_and_detokenize_can_invert(eng):
    with pytest.raises(ConfigError, match="add_bos: expected True, False or None"):
        eng.tokenize("a", add_bos="no")
    ids = eng.tokenize("hello world")
    assert ids[0] == eng.tokenizer.bos_id
    assert eng.detokenize(ids).endswith("hello world") and eng.detokenize(ids) != "hello world"
    assert eng.detokenize(ids, skip_special=True) == "hello world"
    with pytest.raises(ConfigError, match="skip_special"):
        eng.detokenize(ids, skip_special="yes")
