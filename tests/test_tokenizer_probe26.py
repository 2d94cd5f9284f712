"""Two tokenizer differences from llama.cpp a probing session found (session 26), each checked
there against llama-cpp-python 0.3.36 on the same files:
- tokenizer.ggml.add_eos_token = true was ignored: llama.cpp's tokenize("Hello world",
  add_special) gave [75, 104, 294, 114, 305, 2] (EOS last), edgellm the same without the 2;
- FIM tokens were matched by text even when the file names its FIM ids: NORMAL "<|file_sep|>",
  "<|repo_name|>", "<|fim_pad|>" became control tokens that ended generation and vanished from
  detokenized text (llama.cpp's EOG set was [0, 2, 300, 301, 302], edgellm's added 310-312)."""
import pytest
from gguf import GGMLQuantizationType as QT

import edgellm
import tests.synthetic as synthetic
from tests.synthetic import write_tiny_model

FIM_TEXTS = ["<|file_sep|>", "<|repo_name|>", "<|fim_pad|>"]


def test_add_eos_token_appends_eos_where_specials_are_added(tmp_path):
    plain = write_tiny_model(tmp_path / "plain.gguf", tensor_type=QT.F32).path
    eos = write_tiny_model(tmp_path / "eos.gguf", tensor_type=QT.F32,
                           extra_metadata={"tokenizer.ggml.add_eos_token": True}).path
    a, b = edgellm.load(plain, n_ctx=64, threads=1), edgellm.load(eos, n_ctx=64, threads=1)
    base = a.tokenize("Hello world")
    assert b.tokenize("Hello world") == base + [b.tokenizer.eos_id]
    assert b.tokenize("Hello world", add_bos=False) == a.tokenize("Hello world", add_bos=False)
    b.generate("Hello world", max_tokens=1, temperature=0)
    assert b.last_stats.prompt_tokens == len(base) + 1


def _with_normal_fim_tokens(monkeypatch, metadata_ids: bool, path):
    tokens, types, merges = synthetic.build_vocab(None)
    n = len(tokens)
    monkeypatch.setattr(synthetic, "build_vocab",
                        lambda vocab_size=None: (tokens + FIM_TEXTS + ["<PAD>"], types + [1] * 4, merges))
    extra = {"tokenizer.ggml.fim_sep_token_id": 300, "tokenizer.ggml.fim_rep_token_id": 301,
             "tokenizer.ggml.fim_pad_token_id": 302} if metadata_ids else {}
    return write_tiny_model(path, tensor_type=QT.F32, extra_metadata=extra).path, n


def test_fim_ids_named_in_the_file_leave_tokens_of_those_texts_alone(tmp_path, monkeypatch):
    path, n = _with_normal_fim_tokens(monkeypatch, True, tmp_path / "fim.gguf")
    eng = edgellm.load(path, n_ctx=64, threads=1)
    tok = eng.tokenizer
    assert {300, 301, 302} <= tok.eot_ids and not {n, n + 1, n + 2, n + 3} & tok.eot_ids
    assert n not in eng.tokenize("a<|file_sep|>b", add_bos=False)          # plain text, not one special
    assert eng.detokenize([n, n + 1, n + 2], skip_special=True) == "".join(FIM_TEXTS)


def test_without_fim_ids_one_token_per_category_is_found_by_text(tmp_path, monkeypatch):
    """llama.cpp takes one token per FIM category: with both "<|fim_pad|>" and "<PAD>" here, one
    of them (this vocabulary's first in llama.cpp's list) ends generation, not both."""
    path, n = _with_normal_fim_tokens(monkeypatch, False, tmp_path / "fim2.gguf")
    tok = edgellm.load(path, n_ctx=64, threads=1).tokenizer
    assert {n, n + 1, n + 2} <= tok.eot_ids                                 # sep, repo, pad by text
    assert n + 3 not in tok.eot_ids                                         # "<PAD>": pad is taken
    assert tok.decode([n + 3], skip_special=True) == "<PAD>"
