"""Tokenizer and chat template against llama.cpp's golden outputs (tools/make_golden.py).

Every expected id here was produced by llama.cpp; none is written by hand. The real-model tests
use the model from conftest (EDGELLM_TEST_MODEL or the user cache, pulled on first use); the tiny-vocab
goldens come with their GGUF files in tests/data and always run.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from edgellm.errors import ConfigError, ModelFormatError, UnsupportedModelError
from edgellm.model.chat_template import ChatTemplate
from edgellm.model.gguf_file import read_gguf
from edgellm.model.tokenizer import Tokenizer, bytes_to_unicode

DATA = Path(__file__).parent / "data"
GOLDEN = json.loads((DATA / "golden_smollm2.json").read_text(encoding="utf-8"))
GOLDEN_SPM = json.loads((DATA / "golden_spm_tiny.json").read_text(encoding="utf-8"))
GOLDEN_BPE = json.loads((DATA / "golden_bpe_tiny.json").read_text(encoding="utf-8"))


def read_metadata(path: Path) -> dict:
    return dict(read_gguf(path).metadata)


@pytest.fixture(scope="module")
def smol_md(real_model_path) -> dict:
    return read_metadata(Path(real_model_path))


@pytest.fixture(scope="module")
def smol(smol_md, real_model_path) -> Tokenizer:
    return Tokenizer.from_metadata(smol_md, real_model_path)


@pytest.fixture(scope="module")
def spm() -> Tokenizer:
    return Tokenizer.from_metadata(GOLDEN_SPM["metadata"], "spm_tiny.gguf")


@pytest.fixture(scope="module")
def bpe_md() -> dict:
    return GOLDEN_BPE["metadata"]


@pytest.mark.parametrize("golden", [GOLDEN_SPM, GOLDEN_BPE], ids=["spm", "bpe"])
def test_tiny_golden_metadata_is_the_gguf_llama_cpp_read(golden):
    # the goldens carry their tokenizer metadata; the GGUF beside them is optional (git-ignored)
    path = DATA / golden["generator"]["gguf"]
    if not path.is_file():
        pytest.skip(f"{path.name} absent; the golden's embedded metadata is used")
    md = read_metadata(path)
    for key, value in golden["metadata"].items():
        found = md[key].tolist() if hasattr(md[key], "tolist") else md[key]
        assert found == value, key


def _case_id(entry: dict) -> str:
    flags = ("" if entry["special"] else "-nospecial") + ("-bos" if entry["add_bos"] else "")
    return repr(entry["text"][:24]) + flags


def _encode(tok: Tokenizer, entry: dict) -> list[int]:
    return tok.encode(entry["text"], add_bos=entry["add_bos"], parse_special=entry["special"])


SMOL_CASES = GOLDEN["tokenize"] + GOLDEN["tokenize_extra"]


# --- SmolLM2 (gpt2 byte-level BPE, pre "smollm") -------------------------------------------------
def test_golden_matches_model_file(smol_md, real_model_path):
    assert GOLDEN["generator"]["model_file"] == Path(real_model_path).name
    assert len(smol_md["tokenizer.ggml.tokens"]) == GOLDEN["vocab"]["n_vocab"]


@pytest.mark.parametrize("entry", SMOL_CASES, ids=_case_id)
def test_smollm2_ids_match_llama_cpp(smol, entry):
    assert _encode(smol, entry) == entry["ids"]


@pytest.mark.parametrize("entry", SMOL_CASES, ids=_case_id)
def test_smollm2_pieces_match_llama_cpp(smol, entry):
    d = smol.decoder()
    assert "".join(d.push(i) for i in entry["ids"]) + d.flush() == entry["pieces"]
    assert smol.decode(entry["ids"]) == entry["pieces"]


def test_smollm2_default_add_bos_and_ids(smol):
    assert smol.add_bos is GOLDEN["vocab"]["add_bos"] is False
    assert (smol.bos_id, smol.eos_id, smol.vocab_size) == (1, 2, GOLDEN["vocab"]["n_vocab"])
    assert smol.eot_ids == set(GOLDEN["vocab"]["eog_ids"])


def test_smollm2_prompt_ids_of_logprob_and_greedy_texts(smol):
    for entry in GOLDEN["logprobs"] + GOLDEN["greedy"]:
        expected = entry["ids"] if "positions" in entry else entry["prompt_ids"]
        assert smol.encode(entry["text"]) == expected, entry["text"][:40]   # model defaults


def test_smollm2_template_renders_golden_chat_prompts(smol_md):
    template = ChatTemplate.from_metadata(smol_md, "smollm2")
    chats = [e for e in GOLDEN["greedy"] if e.get("messages")]
    assert chats
    for entry in chats:
        assert template.render(entry["messages"]) == entry["text"]


def test_round_trip(smol):
    texts = [e["text"] for e in GOLDEN["tokenize"]] + ["\u00e9\u0301 combining", "\x00\x7f ctrl"]
    for text in texts:
        assert smol.decode(smol.encode(text, add_bos=False)) == text


def test_special_tokens_parsed_or_not(smol):
    assert smol.encode("<|im_start|>user<|im_end|>") == [1, 4093, 2]
    plain = smol.encode("<|im_start|>user<|im_end|>", parse_special=False)
    assert 1 not in plain and 2 not in plain
    assert smol.decode(plain) == "<|im_start|>user<|im_end|>"
    assert smol.encode("x", add_bos=True)[0] == smol.bos_id
    # control tokens render only when asked
    assert smol.decode([1, 4093, 2], skip_special=True) == "user"


def test_stream_decoder_holds_split_characters(smol):
    text = "a👨‍👩‍👧b"
    ids = smol.encode(text)
    assert len(ids) > len(text)       # the emoji is spread over byte-level tokens
    d = smol.decoder()
    outs = [d.push(i) for i in ids]
    assert "" in outs                  # some token ended mid-character and was held back
    assert all("\ufffd" not in o for o in outs)
    assert "".join(outs) + d.flush() == text


def test_stream_decoder_flushes_incomplete_sequence(smol):
    ids = smol.encode("🙂")
    d = smol.decoder()
    assert "".join(d.push(i) for i in ids[:-1]) == ""
    assert d.flush() == "\ufffd"


def test_token_piece(smol):
    assert smol.token_piece(1) == b"<|im_start|>"
    assert smol.token_piece(1, special=False) == b""
    assert smol.token_text(216) == "\u0120" and smol.token_piece(216) == b" "
    with pytest.raises(IndexError):
        smol.token_piece(smol.vocab_size)


# --- chat template -------------------------------------------------------------------------------
SMOL_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


def test_chat_template_smollm2_two_messages(smol_md):
    template = ChatTemplate.from_metadata(smol_md, "smollm2")
    assert template.fallback_reason is None
    conversation = [{"role": "user", "content": "Hello"},
                    {"role": "assistant", "content": "Hi there"}]
    # SmolLM2's template: a default system turn when the first message is not a system one,
    # then ChatML turns, then the assistant header for generation
    expected = (f"<|im_start|>system\n{SMOL_SYSTEM}<|im_end|>\n"
                "<|im_start|>user\nHello<|im_end|>\n"
                "<|im_start|>assistant\nHi there<|im_end|>\n"
                "<|im_start|>assistant\n")
    assert template.render(conversation) == expected
    assert template.render(conversation, add_generation_prompt=False) == expected[:-len("<|im_start|>assistant\n")]
    with_system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert template.render(with_system) == ("<|im_start|>system\nBe brief.<|im_end|>\n"
                                            "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_chat_template_fallback_and_variables():
    md = {"tokenizer.ggml.tokens": ["<s>", "</s>", "a"], "tokenizer.ggml.bos_token_id": 0,
          "tokenizer.ggml.eos_token_id": 1}
    template = ChatTemplate.from_metadata(md, "m.gguf")
    assert "no tokenizer.chat_template" in template.fallback_reason
    assert "<|im_start|>" in template.fallback_reason  # warns that the markup is plain text here
    assert template.render([{"role": "user", "content": "Hi"}]) == \
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    md["tokenizer.chat_template"] = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{{ eos_token }}{% endfor %}"
    assert ChatTemplate.from_metadata(md, "m.gguf").render([{"role": "user", "content": "x"}]) == "<s>x</s>"


def test_chat_template_errors():
    md = {"tokenizer.chat_template": "{% if messages|length > 1 %}{{ raise_exception('one only') }}{% endif %}ok"}
    template = ChatTemplate.from_metadata(md, "m.gguf")
    assert template.render([{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(ConfigError, match="one only"):
        template.render([{"role": "user", "content": "x"}] * 2)
    with pytest.raises(ConfigError, match="messages"):
        template.render([{"role": "user"}])
    with pytest.raises(ModelFormatError) as e:
        ChatTemplate.from_metadata({"tokenizer.chat_template": "{% for %}"}, "m.gguf")
    assert e.value.field == "tokenizer.chat_template"
    # the sandbox refuses attribute access to Python internals
    evil = ChatTemplate.from_metadata({"tokenizer.chat_template": "{{ ''.__class__.__mro__ }}"}, "m.gguf")
    with pytest.raises(ModelFormatError):
        evil.render([{"role": "user", "content": "x"}])


# --- tiny vocabularies: SentencePiece "llama" and byte-level BPE per pre-tokenizer ---------------
@pytest.mark.parametrize("entry", GOLDEN_SPM["tokenize"], ids=_case_id)
def test_spm_tiny_ids_match_llama_cpp(spm, entry):
    assert _encode(spm, entry) == entry["ids"]


@pytest.mark.parametrize("entry", GOLDEN_SPM["tokenize"], ids=_case_id)
def test_spm_tiny_stream_matches_llama_cpp_pieces(spm, entry):
    # a stream continues a prompt, so it keeps every piece's leading space, as llama.cpp does
    d = spm.decoder()
    assert "".join(d.push(i) for i in entry["ids"]) + d.flush() == entry["pieces"]


def test_spm_tiny_vocab_facts(spm):
    assert spm.add_bos is GOLDEN_SPM["vocab"]["add_bos"] is True
    assert spm.eot_ids == set(GOLDEN_SPM["vocab"]["eog_ids"])
    # decode() inverts encode(): the space prefix that encode added is dropped again
    for entry in GOLDEN_SPM["tokenize"]:
        if entry["special"] and "<" not in entry["text"]:
            assert spm.decode(spm.encode(entry["text"], add_bos=False)) == entry["text"]
    ids = spm.encode("日本", add_bos=False)     # not in the vocab: <0xNN> byte fallback
    d = spm.decoder()
    outs = [d.push(i) for i in ids]
    assert "" in outs and "".join(outs) + d.flush() == " 日本"


BPE_CASES = [(pre, e) for pre, r in GOLDEN_BPE["pre"].items() for e in r["tokenize"]]


@pytest.mark.parametrize("pre,entry", BPE_CASES, ids=[f"{p}-{_case_id(e)}" for p, e in BPE_CASES])
def test_bpe_tiny_ids_match_llama_cpp(bpe_md, pre, entry):
    tok = Tokenizer.from_metadata({**bpe_md, "tokenizer.ggml.pre": pre}, "bpe_tiny.gguf")
    assert tok.add_bos is GOLDEN_BPE["pre"][pre]["add_bos"]
    assert _encode(tok, entry) == entry["ids"]
    d = tok.decoder()
    assert "".join(d.push(i) for i in entry["ids"]) + d.flush() == entry["pieces"]


# --- metadata validation -------------------------------------------------------------------------
def _tiny_gpt2() -> dict:
    chars = list(bytes_to_unicode().values())
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "smollm",
            "tokenizer.ggml.tokens": chars + ["he", "<|endoftext|>"],
            "tokenizer.ggml.token_type": [1] * 257 + [3],
            "tokenizer.ggml.merges": ["h e"],
            "tokenizer.ggml.bos_token_id": 257, "tokenizer.ggml.eos_token_id": 257}


def _tiny_llama() -> dict:
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + ["\u2581", "h", "e", "\u2581he"]
    return {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.scores": [0.0] * 259 + [-5.0, -6.0, -7.0, -1.0],
            "tokenizer.ggml.token_type": [2, 3, 3] + [6] * 256 + [1, 1, 1, 1]}


def test_tiny_dicts_are_valid():
    gpt2 = Tokenizer.from_metadata(_tiny_gpt2(), "t.gguf")
    ids = gpt2.encode("hehe<|endoftext|>")
    assert ids[-1] == 257 and gpt2.decode(ids) == "hehe<|endoftext|>"
    assert gpt2.eot_ids == {257}
    llama = Tokenizer.from_metadata(_tiny_llama(), "t.gguf")
    assert (llama.bos_id, llama.eos_id, llama.add_bos) == (1, 2, True)   # llama.cpp's SPM defaults
    ids = llama.encode("he h")
    assert ids[0] == 1 and llama.decode(ids[1:]) == "he h"


@pytest.mark.parametrize("make,change,field,exc", [
    (_tiny_gpt2, {"tokenizer.ggml.token_type": [1] * 10}, "tokenizer.ggml.token_type", ModelFormatError),
    (_tiny_gpt2, {"tokenizer.ggml.merges": ["h e"] * 300}, "tokenizer.ggml.merges", ModelFormatError),
    (_tiny_gpt2, {"tokenizer.ggml.merges": ["h zz"]}, "tokenizer.ggml.merges", ModelFormatError),
    (_tiny_gpt2, {"tokenizer.ggml.merges": ["he"]}, "tokenizer.ggml.merges", ModelFormatError),
    (_tiny_gpt2, {"tokenizer.ggml.merges": None}, "tokenizer.ggml.merges", ModelFormatError),
    (_tiny_gpt2, {"tokenizer.ggml.bos_token_id": 258}, "tokenizer.ggml.bos_token_id", ModelFormatError),
    (_tiny_gpt2, {"tokenizer.ggml.eos_token_id": -1}, "tokenizer.ggml.eos_token_id", ModelFormatError),
    (_tiny_gpt2, {"tokenizer.ggml.pre": "klingon-bpe"}, "tokenizer.ggml.pre", UnsupportedModelError),
    (_tiny_gpt2, {"tokenizer.ggml.tokens": [1] * 258}, "tokenizer.ggml.tokens", ModelFormatError),
    (_tiny_gpt2, {"tokenizer.ggml.merges": [3]}, "tokenizer.ggml.merges", ModelFormatError),
    (_tiny_gpt2, {"tokenizer.ggml.token_type": ["x"] * 258}, "tokenizer.ggml.token_type", ModelFormatError),
    (_tiny_gpt2, {"tokenizer.ggml.model": "t5"}, "tokenizer.ggml.model", UnsupportedModelError),
    (_tiny_gpt2, {"tokenizer.ggml.model": None}, "tokenizer.ggml.model", ModelFormatError),
    (_tiny_gpt2, {"tokenizer.ggml.tokens": None}, "tokenizer.ggml.tokens", ModelFormatError),
    (_tiny_gpt2, {"tokenizer.ggml.tokens": []}, "tokenizer.ggml.tokens", ModelFormatError),
    (_tiny_gpt2, {"tokenizer.ggml.tokens": ["a", "a"], "tokenizer.ggml.token_type": [1, 1],
                  "tokenizer.ggml.merges": [], "tokenizer.ggml.bos_token_id": 0,
                  "tokenizer.ggml.eos_token_id": 0}, "tokenizer.ggml.tokens", ModelFormatError),
    (_tiny_gpt2, {"tokenizer.ggml.add_bos_token": True, "tokenizer.ggml.bos_token_id": None},
     "tokenizer.ggml.add_bos_token", ModelFormatError),
    (_tiny_llama, {"tokenizer.ggml.scores": [0.0] * 5}, "tokenizer.ggml.scores", ModelFormatError),
    (_tiny_llama, {"tokenizer.ggml.scores": None}, "tokenizer.ggml.scores", ModelFormatError),
    (_tiny_llama, {"tokenizer.ggml.token_type": [1] * 264}, "tokenizer.ggml.token_type", ModelFormatError),
    (_tiny_llama, {"tokenizer.ggml.bos_token_id": 10_000}, "tokenizer.ggml.bos_token_id", ModelFormatError),
])
def test_bad_metadata_is_a_typed_error(make, change, field, exc):
    md = {**make(), **change}
    with pytest.raises(exc) as e:
        Tokenizer.from_metadata(md, "bad.gguf")
    assert type(e.value) is exc
    assert e.value.field == field and e.value.path == "bad.gguf"


def test_unknown_pre_tokenizer_is_named():
    with pytest.raises(UnsupportedModelError, match="klingon-bpe"):
        Tokenizer.from_metadata({**_tiny_gpt2(), "tokenizer.ggml.pre": "klingon-bpe"}, "bad.gguf")


@pytest.mark.parametrize("text, ids", [
    # ids from llama.cpp (llama-cpp-python 0.3 vocab_only, tokenize(add_bos=False, special=True),
    # on this GGUF, 2026-11-27): SmolLM2's vocabulary lacks the byte characters of 0x13 and 0x06
    (".\x13.", [30, 30]), (" \x13=", [216, 45]), (" \x06\u065c", [216, 164, 246]),
])
def test_a_byte_the_vocabulary_lacks_is_a_barrier_to_merges_as_in_llama_cpp(smol, text, ids):
    """(It was dropped before the merges: ".\\x13." became the one token "..".)"""
    assert smol.encode(text, add_bos=False) == ids
