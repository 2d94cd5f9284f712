"""RELIABILITY.md item 13: tokenizer and RoPE metadata of the wrong type. The parser keeps each
value as its GGUF type gives it (a scalar, a numpy array, GGUFStrings, a list of arrays); the
config and the tokenizer read those keys as if they had the expected type, so a wrong one ended
in a TypeError or ValueError with a traceback, or was silently accepted. Each case must be a
ModelFormatError naming the key, and say what it expected."""
import pytest
from gguf import GGUFValueType as VT

from edgellm.errors import ModelFormatError, UnsupportedModelError
from edgellm.model.loader import open_model
from tests.synthetic import build_vocab, encode_array, encode_kv, gguf_layout, splice_header, write_tiny_model

A = "llama."
N_VOCAB = len(build_vocab()[0])
SPM = {"tokenizer.ggml.model": "llama"}     # the tiny vocabulary read as SentencePiece


def _write_empty_array(path, key: str) -> None:
    """The tiny model with `key` an empty INT32 array (the gguf writer refuses to write one)."""
    write_tiny_model(path, extra_metadata={key: ([7], VT.ARRAY, VT.INT32)})
    data = open(path, "rb").read()
    kv = gguf_layout(data).kvs[key]
    empty = encode_kv(key, VT.ARRAY, encode_array(VT.INT32, 0, b""))
    open(path, "wb").write(splice_header(data, kv.start, kv.end, empty))


def _open_bad(tmp_path, metadata: dict) -> ModelFormatError:
    path = str(tmp_path / "bad.gguf")
    empty = [k for k, v in metadata.items() if isinstance(v, tuple) and v[0] == []]
    if empty:
        _write_empty_array(path, *empty)
    else:
        write_tiny_model(path, extra_metadata=metadata)
    with pytest.raises(ModelFormatError) as e:
        open_model(path)
    assert type(e.value) is ModelFormatError, e.value
    assert e.value.path == path
    return e.value


# case -> (metadata, what it did before the fix)
UNTYPED = {
    "tokens u32": ({"tokenizer.ggml.tokens": (5, VT.UINT32)}, "TypeError: object of type 'int' has no len()"),
    "tokens f32": ({"tokenizer.ggml.tokens": (1.5, VT.FLOAT32)}, "TypeError"),
    "tokens bool": ({"tokenizer.ggml.tokens": (True, VT.BOOL)}, "TypeError"),
    "tokens a string": ({"tokenizer.ggml.tokens": "abc"}, "'3 tokens disagree with the embedding'"),
    "pre int array": ({"tokenizer.ggml.pre": ([1, 2], VT.ARRAY, VT.INT32)}, "ValueError: truth value"),
    "pre string array": ({"tokenizer.ggml.pre": (["smollm"], VT.ARRAY, VT.STRING)},
                         "TypeError: unhashable type: 'GGUFStrings'"),
    "model int array": ({"tokenizer.ggml.model": ([1, 2], VT.ARRAY, VT.INT32)}, "ValueError: truth value"),
    "model empty array": ({"tokenizer.ggml.model": ([], VT.ARRAY, VT.INT32)}, "ValueError"),
    "scaling type int array": ({A + "rope.scaling.type": ([1, 2], VT.ARRAY, VT.INT32)}, "ValueError"),
    "scaling type empty array": ({A + "rope.scaling.type": ([], VT.ARRAY, VT.INT32)}, "ValueError"),
    "spm scores u32": ({**SPM, "tokenizer.ggml.scores": (7, VT.UINT32)}, "TypeError"),
    "spm scores strings": ({**SPM, "tokenizer.ggml.scores": (["x"] * N_VOCAB, VT.ARRAY, VT.STRING)},
                           "ValueError: could not convert string to float"),
    "spm scores one string": ({**SPM, "tokenizer.ggml.scores": "x" * N_VOCAB}, "ValueError"),
    "spm scores ragged": ({**SPM, "tokenizer.ggml.scores": ([[1.0]] * (N_VOCAB - 1) + [[1.0, 2.0]],
                                                             VT.ARRAY, VT.ARRAY)}, "ValueError: inhomogeneous"),
    "token_type ragged": ({"tokenizer.ggml.token_type": ([[1]] * (N_VOCAB - 1) + [[1, 1]], VT.ARRAY, VT.ARRAY)},
                          "ValueError: inhomogeneous"),
    "token_type width 3": ({"tokenizer.ggml.token_type": ([[3, 1, 1]] * N_VOCAB, VT.ARRAY, VT.ARRAY)},
                           "ValueError: truth value"),
}


@pytest.mark.parametrize("name", list(UNTYPED))
def test_wrong_typed_tokenizer_and_rope_keys_are_typed_errors(tmp_path, name):
    """These crashed with an untyped TypeError/ValueError (or, for a string of tokens, blamed the
    count): config_from_gguf took len() of any tokens value, Tokenizer.from_metadata compared an
    array with `in` and `if`, and the scores went to numpy as they were."""
    metadata, _before = UNTYPED[name]
    err = _open_bad(tmp_path, metadata)
    assert err.field == list(metadata)[-1]      # the wrong key (SPM's model key comes first)
    assert "expected" in err.message


SILENT = {
    "causal u8 0": ({A + "attention.causal": (0, VT.UINT8)}, A + "attention.causal"),
    "causal string false": ({A + "attention.causal": "false"}, A + "attention.causal"),
    "pre u32 0": ({"tokenizer.ggml.pre": (0, VT.UINT32)}, "tokenizer.ggml.pre"),
    "token_type 2-D": ({"tokenizer.ggml.token_type": ([[1]] * N_VOCAB, VT.ARRAY, VT.ARRAY)},
                       "tokenizer.ggml.token_type"),
    "spm scores 2-D": ({**SPM, "tokenizer.ggml.scores": ([[1.0]] * N_VOCAB, VT.ARRAY, VT.ARRAY)},
                       "tokenizer.ggml.scores"),
    "token_type u64 past int32": ({"tokenizer.ggml.token_type": ([2**32 + 3] + [1] * (N_VOCAB - 1),
                                                                 VT.ARRAY, VT.UINT64)}, "tokenizer.ggml.token_type"),
    "unknown id out of range": ({"tokenizer.ggml.unknown_token_id": (10**6, VT.UINT32)},
                                "tokenizer.ggml.unknown_token_id"),
    "spm unknown id out of range": ({**SPM, "tokenizer.ggml.unknown_token_id": (10**6, VT.UINT32)},
                                    "tokenizer.ggml.unknown_token_id"),
}


@pytest.mark.parametrize("name", list(SILENT))
def test_wrong_typed_optional_keys_are_refused_not_ignored(tmp_path, name):
    """These loaded without a word: causal as u8 0 or "false" ran causal (only a real bool false
    was refused); pre as u32 0 warned that the key was missing; [[1]] * n token types and
    [[1.0]] * n scores passed as 1-D; a u64 token type 2**32 + 3 wrapped to 3 in astype(int32);
    an unknown_token_id outside the vocabulary was dropped (bos/eos ones were an error)."""
    metadata, field = SILENT[name]
    err = _open_bad(tmp_path, metadata)
    assert err.field == field


def test_a_subnormal_rope_scaling_factor_is_refused(tmp_path):
    """factor 5e-324 (f64) passed the finite, non-negative check, but 1 / factor is inf: every
    RoPE angle, and so every logit, came out NaN at the first token."""
    err = _open_bad(tmp_path, {A + "rope.scaling.factor": (5e-324, VT.FLOAT64)})
    assert err.field == A + "rope.scaling.factor" and "inverse" in err.message


def test_well_typed_keys_still_load(tmp_path):
    mf = open_model(write_tiny_model(tmp_path / "ok.gguf", extra_metadata={
        A + "attention.causal": True, A + "rope.scaling.type": "linear", A + "rope.scaling.factor": 4.0,
        "tokenizer.ggml.unknown_token_id": (5, VT.UINT32),
        "tokenizer.ggml.token_type": (build_vocab()[1], VT.ARRAY, VT.INT8)}).path)
    assert mf.config.rope_freq_scale == 0.25 and mf.tokenizer.pre == "smollm"
    with pytest.raises(UnsupportedModelError, match="non-causal"):
        open_model(write_tiny_model(tmp_path / "nc.gguf", extra_metadata={A + "attention.causal": False}).path)
