"""RELIABILITY.md items 13-14: metadata of the wrong type or inconsistent with the vocabulary or
layer count, hyperparameters inconsistent with tensor shapes, missing tensors, token ids out of
range. Each fixture corrupts a valid tiny model in code and must raise a typed error naming the
field, within 1 s, before any weight is prepared."""
import time

import pytest
from gguf import GGUFValueType as VT

from edgellm.errors import ModelFormatError, UnsupportedModelError
from edgellm.model.loader import open_model
from tests.synthetic import write_tiny_model

A = "llama."
CASES = {
    # 13: wrong element types / lengths inconsistent with the vocabulary or the layer count
    "tokens of ints": (dict(extra_metadata={"tokenizer.ggml.tokens": (list(range(310)), VT.ARRAY, VT.INT32)}),
                       "tokenizer.ggml.tokens"),
    "token_type too short": (dict(extra_metadata={"tokenizer.ggml.token_type": ([1] * 10, VT.ARRAY, VT.INT32)}),
                             "tokenizer.ggml.token_type"),
    "merges of ints": (dict(extra_metadata={"tokenizer.ggml.merges": ([1, 2, 3], VT.ARRAY, VT.INT32)}),
                       "tokenizer.ggml.merges"),
    "vocab_size disagrees": (dict(extra_metadata={A + "vocab_size": 999}), A + "vocab_size"),
    "tokens disagree with embedding": (dict(vocab_size=320, extra_metadata={"tokenizer.ggml.tokens": (
        ["a%d" % i for i in range(300)], VT.ARRAY, VT.STRING)}), "tokenizer.ggml.tokens"),
    "block_count above tensors": (dict(extra_metadata={A + "block_count": 3}), "blk.2"),
    "block_count below tensors": (dict(extra_metadata={A + "block_count": 1}), "blk.1"),
    "block_count zero": (dict(extra_metadata={A + "block_count": 0}), A + "block_count"),
    "block_count a string": (dict(extra_metadata={A + "block_count": "two"}), A + "block_count"),
    "eps an array": (dict(extra_metadata={A + "attention.layer_norm_rms_epsilon": ([1e-5], VT.ARRAY, VT.FLOAT32)}),
                     A + "attention.layer_norm_rms_epsilon"),
    # 14: hyperparameters inconsistent with tensor shapes, missing tensors, ids out of range
    "width disagrees with tensors": (dict(extra_metadata={A + "embedding_length": 96}), "token_embd.weight"),
    "heads do not divide width": (dict(extra_metadata={A + "attention.head_count": 5}), A + "attention.head_count"),
    "heads x head_dim != q width": (dict(extra_metadata={A + "attention.key_length": 32,
                                                         A + "rope.dimension_count": 32}), "attn_q.weight"),
    "kv heads do not divide heads": (dict(extra_metadata={A + "attention.head_count_kv": 3}),
                                     A + "attention.head_count_kv"),
    "ffn width disagrees": (dict(extra_metadata={A + "feed_forward_length": 64}), "ffn_gate.weight"),
    "rope dims odd": (dict(extra_metadata={A + "rope.dimension_count": 7}), A + "rope.dimension_count"),
    # an odd head size (36 / 4 heads; the count written equals it): no pairs to rotate
    "head size odd": (dict(d_model=36), A + "rope.dimension_count"),
    # (llama.cpp refuses this file: "invalid n_rot: 8, expected 16"; qwen2 asserts)
    "rope dims below the head size": (dict(extra_metadata={A + "rope.dimension_count": 8}), A + "rope.dimension_count"),
    "rope dims above the head size": (dict(extra_metadata={A + "rope.dimension_count": 32}), A + "rope.dimension_count"),
    "missing tensor": (dict(omit=["blk.1.ffn_down.weight"]), "blk.1.ffn_down.weight"),
    "missing norm": (dict(omit=["output_norm.weight"]), "output_norm.weight"),
    "missing key": (dict(omit=[A + "embedding_length"]), A + "embedding_length"),
    "bos id out of range": (dict(extra_metadata={"tokenizer.ggml.bos_token_id": 5000}), "tokenizer.ggml.bos_token_id"),
    "eos id out of range": (dict(extra_metadata={"tokenizer.ggml.eos_token_id": 310}), "tokenizer.ggml.eos_token_id"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_inconsistent_model_is_a_typed_error(tmp_path, name):
    kwargs, field = CASES[name]
    path = tmp_path / "bad.gguf"
    write_tiny_model(path, **kwargs)
    t0 = time.perf_counter()
    with pytest.raises(ModelFormatError) as e:
        open_model(path)
    assert time.perf_counter() - t0 < 1.0
    assert field in str(e.value), str(e.value)
    assert str(path) in str(e.value)


def test_unknown_architecture_is_unsupported(tmp_path):
    path = tmp_path / "gpt.gguf"
    write_tiny_model(path, extra_metadata={"general.architecture": "mamba"})
    with pytest.raises(UnsupportedModelError, match="mamba"):
        open_model(path)


def test_valid_tiny_models_open(tmp_path):
    for arch in ("llama", "qwen2"):
        mf = open_model(write_tiny_model(tmp_path / f"{arch}.gguf", arch=arch).path)
        assert mf.config.arch == arch and mf.tokenizer.vocab_size == mf.config.vocab_size


@pytest.mark.parametrize("meta, why", [
    ({A + "attention.causal": False}, "non-causal"),                    # run causal, silently, before
    ({A + "rope.scaling.type": "longrope", A + "rope.scaling.factor": 4.0}, "'longrope' is not supported"),
    ({A + "rope.scaling.type": "yarn", A + "rope.scaling.factor": 4.0, A + "rope.scaling.yarn_log_multiplier": 0.1},
     "log multiplier is not supported"),
    ({A + "rope.scaling.type": "none", A + "rope.scaling.factor": 4.0}, "type 'none' beside a scaling factor"),
])
def test_attention_and_rope_variants_it_does_not_run_are_refused(tmp_path, meta, why):
    path = write_tiny_model(tmp_path / "m.gguf", extra_metadata=meta).path
    with pytest.raises(UnsupportedModelError, match=why):
        open_model(path)


def test_longrope_factor_tensors_are_refused_not_dropped(tmp_path):
    """rope_factors_long/short were dropped as if unused: every position's rotation differs."""
    from types import SimpleNamespace

    from edgellm.model.config import config_from_gguf
    from edgellm.model.ggml_types import GGMLQuantizationType as T
    from edgellm.model.gguf_file import read_gguf
    g = read_gguf(write_tiny_model(tmp_path / "m.gguf").path)
    tensors = {**g.tensors, "rope_factors_long.weight": SimpleNamespace(shape=(8,), ggml_type=T.F32)}
    assert config_from_gguf("m.gguf", g.metadata, g.tensors).rope_freq_scale == 1.0
    with pytest.raises(UnsupportedModelError, match="LongRoPE"):
        config_from_gguf("m.gguf", g.metadata, tensors)
