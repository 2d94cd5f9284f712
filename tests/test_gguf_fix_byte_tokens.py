"""A token typed BYTE (6) stands for the byte its <0xNN> text names. Any other text loaded, then
crashed generation with "ValueError: invalid literal for int() with base 16" when the token was
rendered (Tokenizer._make_piece). llama.cpp refuses such a file; so must the load."""
import pytest
from gguf import GGUFValueType as VT

from edgellm.errors import ModelFormatError
from edgellm.model.loader import open_model
from edgellm.model.tokenizer import TOKEN_BYTE, Tokenizer
from tests.synthetic import build_vocab, write_tiny_model


def test_a_byte_token_whose_text_is_not_hex_is_refused_at_load(tmp_path):
    """Token 114 ('o' in the tiny vocabulary) typed BYTE opened fine and failed in decode."""
    tokens, types, _ = build_vocab()
    types = list(types)
    types[114] = TOKEN_BYTE
    path = write_tiny_model(tmp_path / "b.gguf", extra_metadata={
        "tokenizer.ggml.token_type": (types, VT.ARRAY, VT.INT32)}).path
    with pytest.raises(ModelFormatError) as e:
        open_model(path)
    assert e.value.field == "tokenizer.ggml.token_type"
    assert "token 114" in e.value.message and repr(tokens[114]) in e.value.message


@pytest.mark.parametrize("text", ["<0x4>", "<0xZZ>", "<0x41>x", "0x41", ""])
def test_byte_token_texts_must_be_two_hex_digits(text):
    tokens = ["<unk>", "<s>", "</s>", text if text else "<0x41>", "\u2581"]
    md = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
          "tokenizer.ggml.scores": [0.0] * 5, "tokenizer.ggml.token_type": [2, 3, 3, 6, 1]}
    if not text:            # a valid one, lower-case hex too: still decodes to its byte
        tok = Tokenizer.from_metadata(md, "t.gguf")
        assert tok.token_piece(3) == b"A"
        md["tokenizer.ggml.tokens"] = tokens[:3] + ["<0xe9>", "\u2581"]
        assert Tokenizer.from_metadata(md, "t.gguf").token_piece(3) == b"\xe9"
        return
    with pytest.raises(ModelFormatError, match="not a byte of the form <0xNN>"):
        Tokenizer.from_metadata(md, "t.gguf")
