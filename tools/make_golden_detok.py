#!/usr/bin/env python3
"""Golden detokenizations from llama.cpp: llama_detokenize of token sequences on the tiny
byte-level BPE vocabulary (tests/data/bpe_tiny.gguf, whose tokenizer metadata
golden_bpe_tiny.json holds), under each tokenizer.ggml.pre name edgellm accepts. llama.cpp
cleans spaces (" !" -> "!", " 's" -> "'s") for most BPE pre-tokenizers and not for others
(clean_spaces in llama-vocab.cpp); tests/test_detokenize_clean.py checks edgellm's
Tokenizer.decode against this file.

Run with an interpreter that has llama-cpp-python (not a test dependency):

    DIR/llamaenv/bin/python tools/make_golden_detok.py [--out tests/data/golden_detok.json]

Every sequence is decoded with remove_special=False (edgellm's detokenize renders a BOS as its
text) and unparse_special True and False (edgellm's skip_special False and True). A name whose
outputs equal an earlier name's on every sequence is written as {"same_as": that name}: the
equality is checked here, on llama.cpp's own outputs, before it is written.
"""
from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import random
import sys
import tempfile
from pathlib import Path

import llama_cpp
from llama_cpp import Llama

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tools")]   # (make_golden imports edgellm's byte map)
from make_golden import _arch_kv, write_vocab_gguf  # noqa: E402

# decoded in full, every sequence: the names the task was about first, then two that llama.cpp
# leaves uncleaned
FULL_NAMES = ["default", "starcoder", "gpt-2", "llama3", "llama-bpe", "smollm", "qwen2"]
# only the PROBE sequences: every other name edgellm accepts (edgellm's _PRE_ALIASES), and ""
# (no tokenizer.ggml.pre key: llama.cpp's 'default')
FLAG_NAMES = ["", "phi-2", "mpt", "olmo", "exaone4", "refact", "command-r", "codeshell", "exaone",
              "minerva-7b", "mellum2", "llama-v3", "falcon3", "falcon-h1", "pixtral",
              "deepseek-r1-qwen", "megrez", "gpt2"]

TEXTS = [
    "Hi !", "Hello , world .", "What ?", "Stop !Now", "a . b", "end .", "ok ,then", "1 , 2 , 3 .",
    "  ?", "?", " ?", " .leading", "multiple   !", "a\n ?", "a\t!", "x ?!", "x . . .",
    "do n't", "it 's", "I 'm fine", "they 're here", "we 've got", "don 't", "I 'd", "we 'll", "x 'sun",
    "x 're", "x 'r", "x 'v", "l 'S", "I 'M", "'s at start", " 's", " 've", "x ''s", "x 's's",
    " ' ", "a ' b", "rock ' n ' roll", "he said ' yes '", "x ' ' y", "x ' ", "' x", "a ' .",
    "a ' 's", "a  ' b", "café !", "日本 ?", "naïve 's", "😀 !",
    "<|endoftext|> !", "Hi<|im_end|> !", "<tool> 's", "<|im_start|> ?", "x <|im_end|>.",
    "a <|endoftext|>'s", "a ' <|im_start|> b", "<|endoftext|>", " <tool> , <tool> ,",
]
PROBE = ["Hi !", "it 's", "a ' b", "<|endoftext|> !"]


def detok(vocab, ids: list[int], remove_special: bool, unparse_special: bool) -> str:
    arr = (llama_cpp.llama_token * max(1, len(ids)))(*ids)
    size = 64
    while True:
        buf = ctypes.create_string_buffer(size)
        n = llama_cpp.llama_detokenize(vocab, arr, len(ids), buf, size, remove_special, unparse_special)
        if n >= 0:
            return buf.raw[:n].decode("utf-8", errors="replace")
        size = -n


def piece(vocab, tok: int) -> bytes:
    buf = ctypes.create_string_buffer(256)
    n = llama_cpp.llama_token_to_piece(vocab, tok, buf, len(buf), 0, True)
    assert n >= 0
    return buf.raw[:n]


def random_sequences(vocab, n_vocab: int, count: int, seed: int) -> list[list[int]]:
    """Sequences drawn from the tokens that make or break a clean-up: pieces holding a space,
    one of ?!., or an apostrophe, the letters of the contractions, specials, multi-byte bytes."""
    pool = []
    for t in range(n_vocab):
        p = piece(vocab, t)
        if (p.startswith(b"<") and p.endswith(b">")) or (len(p) <= 3 and any(c in p for c in b" ?!.,'")) \
                or p in (b"s", b"m", b"t", b"d", b"re", b"ve", b"ll", b"r", b"v", b"l", b"S", b"x", b"\n") \
                or p in (b"\xc3", b"\xa9"):
            pool.append(t)
    rng = random.Random(seed)
    return [[rng.choice(pool) for _ in range(rng.randint(1, 10))] for _ in range(count)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=REPO / "tests/data/golden_detok.json")
    ap.add_argument("--random", type=int, default=240, help="random sequences besides the texts")
    args = ap.parse_args()
    bpe = json.loads((REPO / "tests/data/golden_bpe_tiny.json").read_text(encoding="utf-8"))
    md = bpe["metadata"]
    base = [("tokenizer.ggml.model", "str", md["tokenizer.ggml.model"]),
            ("tokenizer.ggml.tokens", "arr:str", md["tokenizer.ggml.tokens"]),
            ("tokenizer.ggml.token_type", "arr:i32", md["tokenizer.ggml.token_type"]),
            ("tokenizer.ggml.merges", "arr:str", md["tokenizer.ggml.merges"]),
            ("tokenizer.ggml.bos_token_id", "u32", md["tokenizer.ggml.bos_token_id"]),
            ("tokenizer.ggml.eos_token_id", "u32", md["tokenizer.ggml.eos_token_id"])]
    arch = _arch_kv(len(md["tokenizer.ggml.tokens"]))
    out = {"generator": {"tool": "tools/make_golden_detok.py", "llama_cpp_python": llama_cpp.__version__,
                         "vocabulary": "golden_bpe_tiny.json's metadata (tests/data/bpe_tiny.gguf), "
                                       "tokenizer.ggml.pre set per name",
                         "call": "llama_detokenize(ids, remove_special=False, unparse_special); "
                                 "texts: [unparse_special=True, unparse_special=False]"}}
    with tempfile.TemporaryDirectory() as d:
        def load(pre: str) -> Llama | None:
            path = Path(d) / "v.gguf"
            write_vocab_gguf(path, arch + base + ([("tokenizer.ggml.pre", "str", pre)] if pre else []))
            if pre == "smollm":   # the same file as the committed one: the vocabulary is the tests'
                sha = hashlib.sha256(path.read_bytes()).hexdigest()
                assert sha == bpe["generator"]["gguf_sha256"], "not bpe_tiny.gguf's vocabulary"
            try:
                return Llama(model_path=str(path), vocab_only=True, verbose=False)
            except ValueError:    # llama.cpp refuses the name (unknown pre-tokenizer)
                return None

        ref = load("default")
        vocab = llama_cpp.llama_model_get_vocab(ref.model)
        bos = md["tokenizer.ggml.bos_token_id"]
        seqs = [ref.tokenize(t.encode("utf-8"), add_bos=False, special=True) for t in TEXTS]
        seqs += [[bos] + s for s in seqs[:6]]
        seqs += random_sequences(vocab, ref.n_vocab(), args.random, seed=31)
        probes = [ref.tokenize(t.encode("utf-8"), add_bos=False, special=True) for t in PROBE]
        del ref
        out["texts"] = TEXTS
        out["ids"] = seqs
        out["full"], out["probe_ids"], out["probe"] = {}, probes, {}
        for names, key, ids in ((FULL_NAMES, "full", seqs), (FULL_NAMES + FLAG_NAMES, "probe", probes)):
            for pre in names:
                llm = load(pre)
                if llm is None:
                    out[key][pre] = None
                    print(f"{pre!r}: llama.cpp refuses the name", file=sys.stderr)
                    continue
                v = llama_cpp.llama_model_get_vocab(llm.model)
                texts = [[detok(v, s, False, True), detok(v, s, False, False)] for s in ids]
                del llm
                same = next((p for p, t in out[key].items() if t and t.get("texts") == texts), None)
                out[key][pre] = {"same_as": same} if same is not None else {"texts": texts}
    args.out.write_text(json.dumps(out, ensure_ascii=False, separators=(",", ":")) + "\n", encoding="utf-8")
    print(f"wrote {args.out} ({args.out.stat().st_size} bytes)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
