"""The native tokenizer path (neon/bpe.c, neon/pretok.c through edgellm/model/bpe_native.py)
against HF's BPE model and pre-tokenizer on the same vocabulary and merges: the native merges for
every pre-tokenizer family, the native pre-tokenizer for those it runs (NATIVE_PRE), on random
text over all of Unicode. The llama.cpp goldens of test_tokenizer.py run through it as well."""
from __future__ import annotations

import json
import logging
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models as hf_models

from edgellm.backends import neon_lib
from edgellm.errors import ConfigError, ModelFormatError
from edgellm.model import tokenizer as T
from edgellm.model.bpe_native import NATIVE_PRE, NativeBPE, NativeSPM
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
    vocab = dict(zip(tokens, range(len(tokens))))
    hf = HFTokenizer(hf_models.BPE(vocab, pairs, ignore_merges=pre.ignore_merges))
    hf.pre_tokenizer = T._pre_tokenizer(pre, T.missing_byte_chars(vocab.__contains__))
    return lambda text: hf.encode(text, add_special_tokens=False).ids


def random_texts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 120))) for _ in range(n)]


def random_unicode(n: int, seed: int) -> list[str]:
    """Any code point but the surrogates: ASCII, the BMP and the planes above, about equally."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        cps = []
        for _ in range(rng.randint(0, 30)):
            r = rng.random()
            c = rng.randint(0, 0x7F) if r < 0.4 else rng.randint(0x80, 0xFFFF) if r < 0.8 else rng.randint(0x10000, 0x10FFFF)
            cps.append(chr(0x20 if 0xD800 <= c <= 0xDFFF else c))
        out.append("".join(cps))
    return out


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


@pytest.mark.parametrize("family", sorted(f for f in GOLDEN_BPE["pre"] if T._PRE_ALIASES[f] in NATIVE_PRE))
def test_tiny_vocab_native_pre_tokenizer_matches_hf(family):
    fam = T._PRE_ALIASES[family]
    md = GOLDEN_BPE["metadata"]
    tokens, merges = md["tokenizer.ggml.tokens"], md["tokenizer.ggml.merges"]
    native = NativeBPE(tokens, merges, fam, T._PRE_FAMILIES[fam].ignore_merges)
    ref = hf_reference(tokens, merges, fam)
    for text in random_texts(300, seed=11) + random_unicode(1000, seed=12):
        assert native(text) == ref(text), repr(text)


@pytest.mark.parametrize("family", sorted(NATIVE_PRE))
def test_smollm2_matches_hf(real_model_path, family):
    md = dict(read_gguf(Path(real_model_path)).metadata)
    tokens, merges = md["tokenizer.ggml.tokens"], md["tokenizer.ggml.merges"]
    ignore = T._PRE_FAMILIES[family].ignore_merges
    native = NativeBPE(tokens, merges, family, ignore)
    merges_hf = NativeBPE(tokens, merges, T._pre_tokenizer(T._PRE_FAMILIES[family]), ignore)
    ref = hf_reference(list(tokens), list(merges), family)
    source = Path(T.__file__).read_text(encoding="utf-8")      # ~8k tokens of code and prose
    edge = [source, " " * 3000, "9" * 500, "a" * 2000, "a  b\n\n c\t\t1 2  3 \u3000x\u00a0's 'RE 'll",
            "\x1c\x1f\u200b\ufeff", "x \r\n\t y!!\n\n\tz ?\n 12345 'Ve", "\n \n", " \r", "\t\n\t\n  "]
    for text in random_texts(300, seed=5) + random_unicode(2000, seed=6) + edge:
        assert native(text) == merges_hf(text) == ref(text), repr(text)


def test_smollm2_tokenizer_needs_no_hf_tokenizers(real_model_path):
    # in a process of its own: whether `tokenizers` was ever imported is the point
    code = ("import sys; from pathlib import Path; from edgellm.model.gguf_file import read_gguf; "
            "from edgellm.model.tokenizer import Tokenizer; from edgellm.model.bpe_native import NativeBPE; "
            f"p = {str(real_model_path)!r}; tok = Tokenizer.from_metadata(dict(read_gguf(Path(p)).metadata), p); "
            "assert isinstance(tok._encoder, NativeBPE) and tok._encoder._family == 2, tok._encoder; "
            "tok.encode('Hello, world 123'); print('tokenizers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_lone_surrogate_is_a_typed_error(real_model_path):
    md = dict(read_gguf(Path(real_model_path)).metadata)
    tok = T.Tokenizer.from_metadata(md, real_model_path)
    with pytest.raises(ConfigError, match="character 2 is a lone surrogate"):
        tok.encode("ab\ud800cd")


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


def test_encode_text_refuses_bad_arguments():
    lib = neon_lib.load()
    chars = list(T.bytes_to_unicode().values())
    native = NativeBPE(chars, [], "gpt2", False)
    cp = np.frombuffer("abc".encode("utf-32-le"), dtype=np.uint32)
    out = np.empty(12, dtype=np.int32)
    assert lib.el_bpe_encode_text(native._bpe, 1, cp.ctypes.data, 3, out.ctypes.data, 11) < 0    # cap < 4 n
    assert lib.el_bpe_encode_text(native._bpe, 9, cp.ctypes.data, 3, out.ctypes.data, 12) < 0    # no family 9
    bad = np.array([0x61, 0xD800, 0x62], dtype=np.uint32)
    assert lib.el_bpe_encode_text(native._bpe, 1, bad.ctypes.data, 3, out.ctypes.data, 12) < 0   # a surrogate
    assert lib.el_bpe_encode_text(native._bpe, 1, cp.ctypes.data, 3, out.ctypes.data, 12) == 3
    with pytest.raises(ValueError, match="no native pre-tokenizer"):
        NativeBPE(chars, [], "klingon", False)


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


def test_characters_missing_from_the_vocabulary_are_barriers_then_dropped():
    """A byte-level vocabulary without some byte characters ('z', and 'Ġ' = the space byte):
    such a character joins no merge and yields no id, as in llama.cpp ("hze" is h, e, not he;
    they used to be dropped first, as HF's BPE model does). The HF fallback cuts its pieces at
    them to the same ids."""
    chars = [c for c in T.bytes_to_unicode().values() if c not in "zĠ"]
    tokens = chars + ["he"]
    native = NativeBPE(tokens, ["h e"], T._pre_tokenizer(T._PRE_FAMILIES["gpt2"]), False)
    ref = hf_reference(tokens, ["h e"], "gpt2")
    h, e, he = tokens.index("h"), tokens.index("e"), tokens.index("he")
    assert native("hze") == ref("hze") == [h, e] and native("he") == [he]
    for text in ["hez", "zz he z", "a b", "zhe", "z", " ", "h z e"] + random_texts(100, seed=3):
        assert native(text) == ref(text)


def test_unicode_tables_are_what_the_hf_regex_engine_matches():
    # neon/el_unicode_tables.h must classify as HF's pre-tokenizer does (the fallback, and what
    # the ids are checked against): a tokenizers upgrade with newer Unicode tables shows up here;
    # rerun tools/gen_unicode_tables.py then
    import importlib.util
    spec = importlib.util.spec_from_file_location("gen", Path(__file__).parent.parent / "tools" / "gen_unicode_tables.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    header = (Path(__file__).parent.parent / "neon" / "el_unicode_tables.h").read_text()
    for name, pattern in (("el_uni_letter", r"\p{L}"), ("el_uni_number", r"\p{N}"), ("el_uni_punct", r"\p{P}")):
        assert gen.table(name, gen.matching(pattern)) in header, name


def test_one_encoder_shared_by_threads(real_model_path):
    # the scheduler encodes from several threads through one tokenizer
    import threading
    md = dict(read_gguf(Path(real_model_path)).metadata)
    native = NativeBPE(md["tokenizer.ggml.tokens"], md["tokenizer.ggml.merges"], "smollm", False)
    texts = random_unicode(200, seed=21) + random_texts(200, seed=22)
    want = [native(t) for t in texts]
    errors = []

    def work(k: int):
        for i in range(len(texts)):
            j = (i * 7 + k) % len(texts)
            if native(texts[j]) != want[j]:
                errors.append(j)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert errors == []


GOLDEN_SPM = json.loads((DATA / "golden_spm_tiny.json").read_text(encoding="utf-8"))


def spm_hf_reference(md: dict):
    """HF's BPE emulation of the SentencePiece vocabulary: what the tokenizer falls back to."""
    def missing(*a, **k):
        raise neon_lib.NeonLibError("not loaded")
    real = T.NativeSPM
    T.NativeSPM = missing
    try:
        return T.Tokenizer.from_metadata(md, "spm_tiny.gguf")._encoder
    finally:
        T.NativeSPM = real


def test_spm_matches_hf_bpe_emulation():
    md = GOLDEN_SPM["metadata"]
    native = NativeSPM(md["tokenizer.ggml.tokens"], md["tokenizer.ggml.scores"],
                       md.get("tokenizer.ggml.unknown_token_id", 0))
    ref = spm_hf_reference(md)
    assert not isinstance(ref, NativeSPM)
    for text in random_texts(500, seed=31) + random_unicode(500, seed=32):
        frag = (" " + text).replace(" ", "\u2581")     # as Tokenizer.encode hands a fragment over
        assert native(frag) == ref(frag), repr(text)


def test_spm_tokenizer_is_native_and_needs_no_hf_tokenizers():
    code = ("import sys, json; from pathlib import Path; from edgellm.model.tokenizer import Tokenizer; "
            "from edgellm.model.bpe_native import NativeSPM; "
            f"g = json.loads(Path({str(DATA / 'golden_spm_tiny.json')!r}).read_text(encoding='utf-8')); "
            "tok = Tokenizer.from_metadata(g['metadata'], 'spm_tiny.gguf'); "
            "assert isinstance(tok._encoder, NativeSPM); "
            "assert all(tok.encode(e['text'], add_bos=e['add_bos'], parse_special=e['special']) == e['ids'] "
            "for e in g['tokenize']); print('tokenizers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_every_pre_tokenizer_family_runs_natively():
    # _build_bpe hands the family name to NativeBPE: a family added without a native pre-tokenizer
    # would stop every load of it with a ValueError
    assert set(T._PRE_FAMILIES) == set(NATIVE_PRE)


@pytest.mark.parametrize("astral", [False, True])
def test_token_lookup_matches_whole_code_points_in_either_storage_width(astral):
    """bpe.c keeps a vocabulary's code points as uint16 when every one fits (byte-level
    vocabularies: half the memory), else as uint32. Either way every token is found at its own
    id (a wrong copy or comparison of the stored code points fails this), and U+1F600 is not
    U+F600 (which a truncating comparison could only show when the two hash to one slot)."""
    tokens = ["a", "b", "ab", "\uf600", "x\uf600", "\uffff"] + (["\U0001f600", "x\U0001f600"] if astral else [])
    bpe = NativeBPE(tokens, ["a b"], T._pre_tokenizer(T._PRE_FAMILIES["gpt2"]), False)
    assert [bpe.token_id(t) for t in tokens] == list(range(len(tokens)))
    if not astral:
        assert bpe.token_id("\U0001f600") is None and bpe.token_id("x\U0001f600") is None
    assert bpe.token_id("\U0001f600\uf600") is None and bpe.token_id("") is None
