"""decode() cleans spaces exactly where llama_detokenize does (llama.cpp's clean_spaces: byte-level
BPE vocabularies but for the pre-tokenizers llama.cpp lists), against llama.cpp's own output
(tests/data/golden_detok.json, made by tools/make_golden_detok.py). Streams stay llama.cpp's
token pieces, uncleaned, as its completions give them."""
from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import pytest

from edgellm.model.tokenizer import _PRE_ALIASES, Tokenizer, clean_up_spaces

DATA = Path(__file__).parent / "data"
GOLDEN = json.loads((DATA / "golden_detok.json").read_text(encoding="utf-8"))
BPE_MD = json.loads((DATA / "golden_bpe_tiny.json").read_text(encoding="utf-8"))["metadata"]
CLEANED = {"default", "starcoder", "gpt-2", "llama3", "llama-bpe"}


@lru_cache(maxsize=None)
def tokenizer(pre: str) -> Tokenizer:
    md = dict(BPE_MD)
    if pre:
        md["tokenizer.ggml.pre"] = pre
    else:
        del md["tokenizer.ggml.pre"]
    return Tokenizer.from_metadata(md, "bpe_tiny.gguf")


def texts(table: dict, pre: str) -> list[list[str]]:
    entry = table[pre]
    return table[entry["same_as"]]["texts"] if "same_as" in entry else entry["texts"]


def streamed(tok: Tokenizer, ids: list[int], skip_special: bool) -> str:
    d = tok.decoder(skip_special=skip_special)
    return "".join(d.push(i) for i in ids) + d.flush()


@pytest.mark.parametrize("pre", list(GOLDEN["full"]))
def test_decode_matches_llama_detokenize(pre):
    tok = tokenizer(pre)
    assert tok.clean_spaces is (pre in CLEANED)
    bad = []
    for ids, (with_special, without) in zip(GOLDEN["ids"], texts(GOLDEN["full"], pre)):
        # skip_special=False is unparse_special=True, and the other way round
        for skip, want in ((False, with_special), (True, without)):
            got = tok.decode(ids, skip_special=skip)
            if got != want:
                bad.append((ids, skip, got, want))
    assert not bad, f"{len(bad)} of {2 * len(GOLDEN['ids'])} differ from llama.cpp, e.g. {bad[:3]}"


def test_golden_holds_cases_the_clean_up_decides():
    # the golden would pass an uncleaned decode() if none of its texts were changed by the clean-up
    tok = tokenizer("default")
    raw = [streamed(tok, ids, False) for ids in GOLDEN["ids"]]
    cleaned = [t[0] for t in texts(GOLDEN["full"], "default")]
    changed = sum(r != c for r, c in zip(raw, cleaned))
    assert changed >= 40, changed
    assert texts(GOLDEN["full"], "smollm") != texts(GOLDEN["full"], "default")
    # each pass is among them: before punctuation, a lone apostrophe, a contraction
    joined = "\n".join(cleaned)
    assert all(s in joined for s in ("Hi!", "a'b", "it's", "they're", "don 't", "we 'll"))


@pytest.mark.parametrize("pre", list(GOLDEN["probe"]))
def test_every_pre_tokenizer_name_cleans_as_llama_cpp_does(pre):
    tok = tokenizer(pre)
    table = GOLDEN["probe"]
    if table[pre] is None:
        # llama.cpp refuses the name; edgellm takes it as an alias of 'gpt-2' and cleans as it does
        assert _PRE_ALIASES[pre] == _PRE_ALIASES["gpt-2"]
        want = texts(table, "gpt-2")
    else:
        want = texts(table, pre)
    got = [[tok.decode(ids), tok.decode(ids, skip_special=True)] for ids in GOLDEN["probe_ids"]]
    assert got == want


def test_golden_covers_every_accepted_name():
    # a new alias needs llama.cpp's word on its clean_spaces: regenerate the golden with it
    assert set(_PRE_ALIASES) | {""} <= set(GOLDEN["probe"])


@pytest.mark.parametrize("pre", ["default", "smollm"])
def test_stream_is_the_pieces_and_decode_their_clean_up(pre):
    # generation streams llama.cpp's token_to_piece texts (as its completions do); decode() of
    # the same ids is that text cleaned where the vocabulary cleans, nothing more
    tok = tokenizer(pre)
    for ids in GOLDEN["ids"]:
        for skip in (False, True):
            text = streamed(tok, ids, skip)
            assert tok.decode(ids, skip_special=skip) == (clean_up_spaces(text) if tok.clean_spaces else text)


def test_spm_vocabulary_is_never_cleaned():
    spm_md = json.loads((DATA / "golden_spm_tiny.json").read_text(encoding="utf-8"))["metadata"]
    tok = Tokenizer.from_metadata(spm_md, "spm_tiny.gguf")
    assert tok.clean_spaces is False
    ids = tok.encode("Hi !", add_bos=False)
    assert tok.decode(ids) == "Hi !"


@pytest.mark.parametrize("text,want", [
    ("Hi !", "Hi!"), ("a  ?", "a ?"), (" ,x", ",x"), ("a ' b", "a'b"), (" ' ' ", "'' "),
    ("a ' .", "a '."), ("it 's", "it's"), ("I 'm", "I'm"), ("we 're", "we're"), ("you 've", "you've"),
    ("don 't", "don 't"), ("I 'd", "I 'd"), ("we 'll", "we 'll"), ("x 'S", "x 'S"), ("x 'r", "x 'r"),
    ("é !", "é!"), ("\ufffd ?", "\ufffd?"),
])
def test_clean_up_spaces_passes(text, want):
    assert clean_up_spaces(text) == want
