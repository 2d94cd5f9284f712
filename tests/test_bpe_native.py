"""The native BPE merges (neon/bpe.c through edgellm/model/bpe_native.py) against HF's BPE model
on the same vocabulary, merges and pre-tokenizer, for every pre-tokenizer family; the llama.cpp
goldens of test_tokenizer.py run through the native path as well."""
from __future__ import annotations

import json
import logging
import random
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models as hf_models

from edgellm.backends import neon_lib
from edgellm.errors import ModelFormatError
from edgellm.model import tokenizer as T
from edgellm.model.bpe_native import NativeBPE
from edgellm.model.gguf_file import read_gguf

DATA = Path(__file__).parent / "data"
GOLDEN_BPE = json.loads((DATA / "golden_bpe_tiny.json").read_text(encoding="utf-8"))
ALPHABET = "abcdefghijklmnopqrstuvwxyz ABCXYZ\n\t\r0123456789.,!?'\"-_()[]äöüéß✓日本語한🙂 \u00a0'sll'VE"


def hf_reference(tokens, merges, pre_family: str):
    """HF's BPE model on the same vocabulary and merges: the reference the native path must equal."""
    pre = T._PRE_FAMILIES[pre_family]
    pairs = []
    for m in merges:
        i = m.find(" ", 1)
        pairs.append((m[:i], m[i + 1:]))
    hf = HFTokenizer(hf_models.BPE(dict(zip(tokens, range(len(tokens)))), pairs, ignore_merges=pre.ignore_merges))
    hf.pre_tokenizer = T._pre_tokenizer(pre)
    return lambda text: hf.encode(text, add_special_tokens=False).ids


def random_texts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 120))) for _ in range(n)]


@pytest.mark.parametrize("family", sorted(GOLDEN_BPE["pre"]))
def test_tiny_vocab_matches_hf_per_family(family):
    md = GOLDEN_BPE["metadata"]
    tokens, merges = md["tokenizer.ggml.tokens"], md["tokenizer.ggml.merges"]
    fam = T._PRE_ALIASES[family]
    native = NativeBPE(tokens, merges, T._pre_tokenizer(T._PRE_FAMILIES[fam]), T._PRE_FAMILIES[fam].ignore_merges)
    ref = hf_reference(tokens, merges, fam)
    texts = random_texts(400, seed=sum(map(ord, family))) + [e["text"] for e in GOLDEN_BPE["pre"][family]["tokenize"]]
    for text in texts:
        assert native(text) == ref(text), repr(text)


def test_smollm2_matches_hf(real_model_path):
    md = dict(read_gguf(Path(real_model_path)).metadata)
    tokens, merges = md["tokenizer.ggml.tokens"], md["tokenizer.ggml.merges"]
    native = NativeBPE(tokens, merges, T._pre_tokenizer(T._PRE_FAMILIES["smollm"]), False)
    ref = hf_reference(list(tokens), list(merges), "smollm")
    source = Path(T.__file__).read_text(encoding="utf-8")      # ~8k tokens of code and prose
    for text in random_texts(300, seed=5) + [source, " " * 3000, "9" * 500, "a" * 2000]:
        assert native(text) == ref(text)


def test_tokenizer_uses_native_merges(real_model_path):
    md = dict(read_gguf(Path(real_model_path)).metadata)
    tok = T.Tokenizer.from_metadata(md, real_model_path)
    assert isinstance(tok._encoder, NativeBPE)


def test_without_the_library_hf_merges_give_the_same_ids(monkeypatch, caplog):
    md = GOLDEN_BPE["metadata"]
    native = T.Tokenizer.from_metadata({**md, "tokenizer.ggml.pre": "smollm"}, "bpe_tiny.gguf")

    def missing(*a, **k):
        raise neon_lib.NeonLibError("the dotprod NEON library is not built")

    monkeypatch.setattr(T, "NativeBPE", missing)
    with caplog.at_level(logging.INFO, logger="edgellm.model.tokenizer"):
        fallback = T.Tokenizer.from_metadata({**md, "tokenizer.ggml.pre": "smollm"}, "bpe_tiny.gguf")
    assert not isinstance(fallback._encoder, NativeBPE)
    assert "HF tokenizers" in caplog.text and "not built" in caplog.text
    for text in random_texts(100, seed=9):
        assert fallback.encode(text) == native.encode(text)


def _tiny(tokens_extra=(), merges=("h e",)):
    chars = list(T.bytes_to_unicode().values())
    tokens = chars + ["he", *tokens_extra]
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "smollm", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": [1] * len(tokens), "tokenizer.ggml.merges": list(merges)}


@pytest.mark.parametrize("merges,says", [
    (["zz e"], "first part"),
    (["h zz"], "second part"),
    (["e h"], "joins into"),
    (["he"], "not two tokens separated by a space"),
    (["h "], "not two tokens separated by a space"),
])
def test_bad_merge_is_named(merges, says):
    with pytest.raises(ModelFormatError) as e:
        T.Tokenizer.from_metadata(_tiny(merges=merges), "bad.gguf")
    assert e.value.field == "tokenizer.ggml.merges" and says in str(e.value) and repr(merges[0]) in str(e.value)


def test_encode_refuses_a_short_output_buffer():
    lib = neon_lib.load()
    chars = list(T.bytes_to_unicode().values())
    native = NativeBPE(chars, [], T._pre_tokenizer(T._PRE_FAMILIES["gpt2"]), False)
    cp = np.frombuffer("abc".encode("utf-32-le"), dtype=np.uint32)
    starts = np.array([0, 3], dtype=np.int32)
    out = np.empty(2, dtype=np.int32)
    assert lib.el_bpe_encode(native._bpe, cp.ctypes.data, starts.ctypes.data, 1, out.ctypes.data, 2) < 0
    out = np.empty(3, dtype=np.int32)
    assert lib.el_bpe_encode(native._bpe, cp.ctypes.data, starts.ctypes.data, 1, out.ctypes.data, 3) == 3


def test_create_refuses_bad_arguments():
    lib = neon_lib.load()
    cp = np.frombuffer("ab".encode("utf-32-le"), dtype=np.uint32)
    for starts, n in ((np.array([0, 1, 2], np.int32), 0), (np.array([0, 2, 1], np.int32), 2),
                      (np.array([-1, 1, 2], np.int32), 2)):
        assert not lib.el_bpe_create(cp.ctypes.data, starts.ctypes.data, n, None, None, 0, 0, None, None)


def test_characters_missing_from_the_vocabulary_are_dropped_as_hf_drops_them():
    # a byte-level vocabulary without some byte characters ('z', and 'Ġ' = the space byte)
    chars = [c for c in T.bytes_to_unicode().values() if c not in "zĠ"]
    tokens = chars + ["he"]
    native = NativeBPE(tokens, ["h e"], T._pre_tokenizer(T._PRE_FAMILIES["gpt2"]), False)
    ref = hf_reference(tokens, ["h e"], "gpt2")
    for text in ["hez", "zz he z", "a b", "zhe", "z", " "] + random_texts(100, seed=3):
        assert native(text) == ref(text)
