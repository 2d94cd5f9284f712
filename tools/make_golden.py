#!/usr/bin/env python3
"""Golden outputs from llama.cpp (through llama-cpp-python) for edgellm's end-to-end tests.

Run with an interpreter that has llama-cpp-python (it is not a test dependency); this script
must not import edgellm:

    /tmp/llamaenv/bin/python tools/make_golden.py                # tests/data/golden_smollm2.json
    /tmp/llamaenv/bin/python tools/make_golden.py --tiny-vocabs  # tiny SPM / BPE vocab goldens

The model golden holds token ids for varied strings, teacher-forced top-20 next-token logprobs
(log_softmax of llama.cpp's raw logits, computed in float64) and greedy continuations.
--tiny-vocabs writes small vocab-only GGUF files (a SentencePiece-style "llama" vocabulary with
scores and <0xNN> byte fallback; a byte-level "gpt2" vocabulary) into tests/data together with
the ids llama.cpp produces for them (Llama(path, vocab_only=True)), one golden per pre-tokenizer.
Each golden also holds the tokenizer.* metadata it was made from, so tests need not read the
GGUF (*.gguf is git-ignored in this repository).
"""
from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import os
import re
import struct
import sys
from collections import Counter
from pathlib import Path

import numpy as np

import llama_cpp
from llama_cpp import Llama

from edgellm.model.tokenizer import bytes_to_unicode

REPO = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = os.environ.get("EDGELLM_TEST_MODEL", "/tmp/dl/SmolLM2-135M-Instruct.Q4_1.gguf")
SETTINGS = dict(n_ctx=2048, n_threads=2, n_batch=512, seed=0)
TOP_K = 20
N_GREEDY = 32

SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"

TOKENIZE_STRINGS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "Café déjà vu — naïve façade, Ångström, Straße, São Paulo.",
    "日本語のテキストと中文字符，还有한국어.",
    "Ελληνικά, русский текст, العربية, עברית, हिन्दी",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "a  b   c    d\t\te\n\n\nf \n g",
    "   leading spaces and trailing   ",
    "    indented line\n\tTabbed\r\nWindows line",
    "Emoji: 🙂 👍🏽 👨‍👩‍👧‍👦 🏳️‍🌈",
    "Numbers: 1234567 3.14159 -42 1e-9 0x1F 2024-01-31 $1,000.50",
    "I'm sure you're right, they'll say it's what we'd've done. DON'T SHOUT'S",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "Mixed<|im_end|>markup<|endoftext|>without spaces<|im_start|>",
    "<|im_start|> spaced <|im_end|>  after",
    "<reponame>edgellm<file_sep>main.py",
    "",
    " ",
    "\n",
    "URL: https://example.com/path?q=1&r=two#frag and email a.b@c.de",
    '{"key": [1, 2, 3], "nested": {"a": null}}',
    "Math: ∑_{i=1}^{n} i² = n(n+1)/2 ≈ ½n²; √2 ≠ π",
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa!!!!!!!??????",
    "nbsp\u00a0here\u3000ideographic\u2009thin\u200bzwsp\u0085nel  \u00a0 x",
    "unassigned \u0378\u0379 private \ue000\ue001 ctrl \x01\x7f",
]
# (text, add_special, parse_special) beyond the defaults above: markup as plain text, no BOS.
TOKENIZE_EXTRA = [
    ("<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n", True, False),
    ("Mixed<|im_end|>markup<|endoftext|>without spaces<|im_start|>", True, False),
    ("Hello, world!", False, True),
]


def chatml(messages: list[dict], add_generation_prompt: bool = True) -> str:
    """ChatML, written out by hand. With an explicit system message this is exactly what
    SmolLM2's own template renders."""
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")


CHAT_EXCHANGE = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "Can you explain what a hash table is in two sentences?"},
    {"role": "assistant", "content": "A hash table stores key-value pairs in an array, using a hash "
                                     "function to turn each key into an index. This gives average "
                                     "constant-time lookups, inserts and deletes."},
    {"role": "user", "content": "Thanks!"},
]
LOGPROB_TEXTS = [
    ("prose", "The old lighthouse stood at the edge of the cliff, its white paint peeling after "
              "decades of salt and wind. Every evening, the keeper climbed the spiral stairs to "
              "light the lamp, even though ships rarely passed this way anymore."),
    ("code", "import math\n\n\ndef is_prime(n: int) -> bool:\n    if n < 2:\n        return False\n"
             "    for k in range(2, int(math.sqrt(n)) + 1):\n        if n % k == 0:\n"
             "            return False\n    return True\n\n\nprint([p for p in range(50) if is_prime(p)])\n"),
    ("chat", chatml(CHAT_EXCHANGE, add_generation_prompt=False)),
    ("list", "Shopping list:\n1. Eggs (12)\n2. Milk, 2 liters\n3. Flour - 500 g\n4. Apples x 6\n"
             "Total: 4 items, about $23.75 in 2024."),
]
GREEDY_PROMPTS = [
    ("plain", "The capital of France is", None),
    ("plain", "def fibonacci(n):\n", None),
    ("plain", "Once upon a time, in a small village,", None),
    ("chat", None, [{"role": "system", "content": SYSTEM},
                    {"role": "user", "content": "What is the boiling point of water in Celsius?"}]),
    ("chat", None, [{"role": "system", "content": SYSTEM},
                    {"role": "user", "content": "List three primary colors."}]),
]


# --- helpers -------------------------------------------------------------------------------------
def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def log_softmax64(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    m = x.max()
    return x - (m + np.log(np.exp(x - m).sum()))


def top_k(logprobs: np.ndarray, k: int) -> list[int]:
    idx = np.argpartition(-logprobs, k)[:k]
    # stable order: by logprob descending, then id
    return sorted(idx.tolist(), key=lambda i: (-logprobs[i], i))


def vocab_of(llm: Llama):
    return llama_cpp.llama_model_get_vocab(llm.model)


def default_add_bos(llm: Llama) -> bool:
    return bool(llama_cpp.llama_vocab_get_add_bos(vocab_of(llm)))


def pieces_text(llm: Llama, ids: list[int]) -> str:
    """llama.cpp's token_to_piece(special=True) for each id, concatenated (as a stream would)."""
    vocab = vocab_of(llm)
    out = b""
    buf = ctypes.create_string_buffer(256)
    for t in ids:
        n = llama_cpp.llama_token_to_piece(vocab, t, buf, len(buf), 0, True)
        assert n >= 0, "piece longer than 256 bytes"
        out += buf.raw[:n]
    return out.decode("utf-8", errors="replace")


def eog_ids(llm: Llama) -> list[int]:
    vocab = vocab_of(llm)
    return [i for i in range(llm.n_vocab()) if llama_cpp.llama_vocab_is_eog(vocab, i)]


def tokenize_entries(llm: Llama, cases: list[tuple[str, bool, bool]]) -> list[dict]:
    """llama_tokenize(text, add_special, parse_special). add_special adds BOS only where the
    model's tokenizer.ggml.add_bos_token (or llama.cpp's default for the vocab) says so; each
    entry's add_bos records what that resolved to, i.e. whether a BOS was asked for."""
    out = []
    for text, add_special, special in cases:
        ids = llm.tokenize(text.encode("utf-8"), add_bos=add_special, special=special)
        out.append({"text": text, "add_bos": add_special and default_add_bos(llm),
                    "special": special, "ids": ids, "pieces": pieces_text(llm, ids)})
    return out


# --- the model golden ----------------------------------------------------------------------------
def make_model_golden(model: Path, out: Path, source: Path | None = None) -> None:
    llm = Llama(model_path=str(model), logits_all=True, verbose=False, **SETTINGS)
    golden: dict = {
        "generator": {
            "tool": "tools/make_golden.py",
            "llama_cpp_python": llama_cpp.__version__,
            "model_file": model.name,
            "model_sha256": sha256(model),
            "settings": {**SETTINGS, "logits_all": True},
            **({"dequantized_from": source.name, "source_sha256": sha256(source)} if source else {}),
            "notes": "logprobs are log_softmax of llama.cpp's float32 logits computed in float64, "
                     "rounded to 5 decimals; top-k ordered by logprob then id",
        },
        "vocab": {"n_vocab": llm.n_vocab(), "add_bos": default_add_bos(llm), "eog_ids": eog_ids(llm)},
        # the model's defaults (BOS per its metadata, special tokens parsed) ...
        "tokenize": tokenize_entries(llm, [(s, True, True) for s in TOKENIZE_STRINGS]),
        # ... and other settings: markup as plain text, no BOS
        "tokenize_extra": tokenize_entries(llm, TOKENIZE_EXTRA),
    }

    logprob_entries = []
    for name, text in LOGPROB_TEXTS:
        # add_bos here is llama_tokenize's add_special: BOS only if the model asks for it
        ids = llm.tokenize(text.encode("utf-8"), add_bos=True, special=True)
        llm.reset()
        llm.eval(ids)
        positions = []
        for i in range(len(ids)):
            lp = log_softmax64(llm.scores[i])
            top = top_k(lp, TOP_K)
            p = np.exp(lp)
            entry = {
                "top": [[t, round(float(lp[t]), 5)] for t in top],
                # probability mass outside the top-k, and the full entropy: with these the KL
                # of another distribution can be bounded without storing all n_vocab values
                "tail_mass": round(float(max(0.0, 1.0 - p[top].sum())), 6),
                "entropy": round(float(-(p * lp).sum()), 5),
            }
            if i + 1 < len(ids):
                entry["next"] = [ids[i + 1], round(float(lp[ids[i + 1]]), 5)]
            positions.append(entry)
        logprob_entries.append({"name": name, "text": text, "ids": ids, "positions": positions})
    golden["logprobs"] = logprob_entries

    greedy_entries = []
    for kind, text, messages in GREEDY_PROMPTS:
        if messages is not None:
            text = chatml(messages)
        ids = llm.tokenize(text.encode("utf-8"), add_bos=True, special=True)
        llm.reset()
        llm.eval(ids)
        gen, gaps = [], []
        for _ in range(N_GREEDY):
            lp = log_softmax64(llm.scores[llm.n_tokens - 1])
            first, second = top_k(lp, 2)
            gen.append(first)
            gaps.append(round(float(lp[first] - lp[second]), 5))
            llm.eval([first])
        eog = set(golden["vocab"]["eog_ids"])
        entry = {"kind": kind, "text": text, "prompt_ids": ids, "ids": gen, "top1_top2_gap": gaps,
                 "first_eog_step": next((k for k, t in enumerate(gen) if t in eog), None),
                 "completion": pieces_text(llm, gen)}
        if messages is not None:
            entry["messages"] = messages
        greedy_entries.append(entry)
    golden["greedy"] = greedy_entries
    write_json(out, golden)


def write_dequantized_copy(src: Path, dst: Path) -> None:
    """The same weights with every tensor dequantized to F32 (gguf package only, not edgellm).

    llama.cpp quantizes activations to 8-bit blocks for Q4_1/Q8_0 matmuls; on an F32 file it
    does not, so a golden from this copy checks the forward pass without that rounding noise,
    on weights bit-identical to what a runtime dequantizing the original computes with."""
    from gguf import GGUFReader, GGUFValueType, GGUFWriter
    from gguf.quants import dequantize

    r = GGUFReader(str(src))
    w = GGUFWriter(str(dst), r.fields["general.architecture"].contents())
    for key, field in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == GGUFValueType.ARRAY else None
        w.add_key_value(key, field.contents(), vtype, sub_type=sub)
    for t in r.tensors:
        w.add_tensor(t.name, np.ascontiguousarray(dequantize(t.data, t.tensor_type), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_json(path: Path, obj: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n", encoding="utf-8")
    tmp.replace(path)
    print(f"wrote {path} ({path.stat().st_size} bytes)")


# --- tiny vocab-only GGUF files ------------------------------------------------------------------
_GGUF_T = {"u32": 4, "i32": 5, "f32": 6, "bool": 7, "str": 8, "arr": 9}


def _gguf_str(s: str) -> bytes:
    b = s.encode("utf-8")
    return struct.pack("<Q", len(b)) + b


def _gguf_value(kind: str, v) -> bytes:
    if kind == "u32":
        return struct.pack("<I", v)
    if kind == "i32":
        return struct.pack("<i", v)
    if kind == "f32":
        return struct.pack("<f", v)
    if kind == "bool":
        return struct.pack("<B", 1 if v else 0)
    if kind == "str":
        return _gguf_str(v)
    raise ValueError(kind)


def write_vocab_gguf(path: Path, kv: list[tuple[str, str, object]]) -> None:
    """A GGUF v3 file with metadata only (no tensors): enough for Llama(..., vocab_only=True).
    kv: (key, kind, value) with kind u32/i32/f32/bool/str or 'arr:<kind>' for arrays."""
    body = b""
    for key, kind, value in kv:
        body += _gguf_str(key)
        if kind.startswith("arr:"):
            ek = kind[4:]
            body += struct.pack("<IIQ", _GGUF_T["arr"], _GGUF_T[ek], len(value))
            body += b"".join(_gguf_value(ek, v) for v in value)
        else:
            body += struct.pack("<I", _GGUF_T[kind]) + _gguf_value(kind, value)
    head = b"GGUF" + struct.pack("<IQQ", 3, 0, len(kv))
    data = head + body
    data += b"\0" * (-len(data) % 32)
    path.write_bytes(data)


def _arch_kv(n_vocab: int) -> list[tuple[str, str, object]]:
    # llama.cpp loads hparams even for vocab_only; the smallest consistent llama shape
    return [("general.architecture", "str", "llama"), ("general.name", "str", "edgellm tiny vocab"),
            ("llama.context_length", "u32", 4096), ("llama.embedding_length", "u32", 8),
            ("llama.block_count", "u32", 1), ("llama.feed_forward_length", "u32", 16),
            ("llama.attention.head_count", "u32", 1), ("llama.attention.head_count_kv", "u32", 1),
            ("llama.attention.layer_norm_rms_epsilon", "f32", 1e-5),
            ("llama.vocab_size", "u32", n_vocab)]


TINY_CORPUS = (
    "hello world. the world is wide and the sea is deep. hello there, how are you? "
    "I'm fine, thanks; it's the best day in the world! we'd like to go to the café. "
    "the theory of the thing: there are three thin threads. 1234 + 5678 = 6912. "
    "def main():\n    return hello_world(42)\n\twith tabs\n"
    "Hello World HELLO WORLD The The the thee"
)


def _train_merges(words: Counter, n_merges: int) -> list[tuple[str, str]]:
    """Plain BPE training on a word-frequency table (words are tuples of symbols)."""
    merges = []
    words = Counter({tuple(w): c for w, c in words.items()})
    for _ in range(n_merges):
        pairs: Counter = Counter()
        for w, c in words.items():
            for a, b in zip(w, w[1:]):
                pairs[(a, b)] += c
        if not pairs:
            break
        best = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))[0]
        merges.append(best)
        new: Counter = Counter()
        for w, c in words.items():
            out, i = [], 0
            while i < len(w):
                if i + 1 < len(w) and (w[i], w[i + 1]) == best:
                    out.append(w[i] + w[i + 1])
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            new[tuple(out)] += c
        words = new
    return merges


SPM_STRINGS = [
    "hello world", "Hello World", " leading space", "the  double  space ", "café au lait",
    "日本 text", "emoji 🙂!", "line1\nline2\ttab", "<|im_start|>user\nhi there<|im_end|>\n",
    "<s>inside</s>", "<tool>call the world", "", " ", "1234 5678", "it's the world's end",
    "thethethe theory", "HELLO", "unknownzzq",
]
BPE_STRINGS = [
    "hello world", "Hello World!", "the  double  space ", "   leading", "café au lait",
    "1234567 3.14159", "it's I'M we'd THEY'LL", "emoji 🙂!", "line1\nline2\r\n\ttab",
    "<|im_start|>user\nhi<|im_end|>\n", "<tool>call", "", " ", "\n\n", "a+b=c; x|y ^z~ <>",
    "日本語 text", "def main():\n    return 42\n", "trailing space \n next",
]
BPE_PRES = ["smollm", "gpt-2", "default", "llama-bpe", "qwen2"]


def make_spm_tiny(data: Path) -> None:
    words = Counter("\u2581" + w for w in TINY_CORPUS.replace("\n", " ").split(" ") if w)
    merges = _train_merges(Counter({tuple(w): c for w, c in words.items()}), 120)
    chars = sorted({ch for w in words for ch in w})
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256
    scores = [0.0, 0.0, 0.0] + [0.0] * 256
    for i, (a, b) in enumerate(merges):          # SentencePiece BPE: score = -merge rank
        if a + b not in tokens:
            tokens.append(a + b)
            types.append(1)
            scores.append(-float(i))
    for ch in chars:                              # single characters after the pieces
        if ch not in tokens:
            tokens.append(ch)
            types.append(1)
            scores.append(-1000.0 - len(tokens))
    for text, kind in (("<|im_start|>", 3), ("<|im_end|>", 3), ("<tool>", 4)):
        tokens.append(text)
        types.append(kind)
        scores.append(0.0)
    kv = _arch_kv(len(tokens)) + [
        ("tokenizer.ggml.model", "str", "llama"),
        ("tokenizer.ggml.tokens", "arr:str", tokens),
        ("tokenizer.ggml.scores", "arr:f32", scores),
        ("tokenizer.ggml.token_type", "arr:i32", types),
        ("tokenizer.ggml.bos_token_id", "u32", 1),
        ("tokenizer.ggml.eos_token_id", "u32", 2),
        ("tokenizer.ggml.unknown_token_id", "u32", 0),
        ("tokenizer.ggml.add_bos_token", "bool", True),
        ("tokenizer.ggml.add_space_prefix", "bool", True),
    ]
    gguf = data / "spm_tiny.gguf"
    write_vocab_gguf(gguf, kv)
    llm = Llama(model_path=str(gguf), vocab_only=True, verbose=False)
    cases = [(s, True, True) for s in SPM_STRINGS] + [(s, False, True) for s in SPM_STRINGS[:6]] + \
            [(s, True, False) for s in SPM_STRINGS[8:11]]
    write_json(data / "golden_spm_tiny.json", {
        "generator": {"tool": "tools/make_golden.py --tiny-vocabs",
                      "llama_cpp_python": llama_cpp.__version__, "gguf": gguf.name,
                      "gguf_sha256": sha256(gguf)},
        # the tokenizer.* metadata written into the GGUF, so the golden stands on its own
        "metadata": {k: v for k, _, v in kv if k.startswith("tokenizer.")},
        "vocab": {"n_vocab": llm.n_vocab(), "add_bos": default_add_bos(llm), "eog_ids": eog_ids(llm)},
        "tokenize": tokenize_entries(llm, cases),
    })


def make_bpe_tiny(data: Path) -> None:
    b2u = bytes_to_unicode()
    pieces = re.findall(r"'s|'t|'re|'ve|'m|'ll|'d| ?[^\W\d_]+| ?\d+| ?[^\s\w]+|\s+", TINY_CORPUS)
    words = Counter(tuple(b2u[b] for b in p.encode("utf-8")) for p in pieces)
    merges = _train_merges(words, 150)
    tokens = [b2u[b] for b in range(256)]
    merge_strs = []
    for a, b in merges:
        merge_strs.append(f"{a} {b}")
        if a + b not in tokens:
            tokens.append(a + b)
    specials = [("<|endoftext|>", 3), ("<|im_start|>", 3), ("<|im_end|>", 3), ("<tool>", 4)]
    types = [1] * len(tokens) + [k for _, k in specials]
    tokens += [t for t, _ in specials]
    base = [("tokenizer.ggml.model", "str", "gpt2"),
            ("tokenizer.ggml.tokens", "arr:str", tokens),
            ("tokenizer.ggml.token_type", "arr:i32", types),
            ("tokenizer.ggml.merges", "arr:str", merge_strs),
            ("tokenizer.ggml.bos_token_id", "u32", tokens.index("<|endoftext|>")),
            ("tokenizer.ggml.eos_token_id", "u32", tokens.index("<|endoftext|>"))]
    gguf = data / "bpe_tiny.gguf"
    results = {}
    for pre in BPE_PRES:
        # the committed GGUF is the smollm one; the others differ only in tokenizer.ggml.pre
        path = gguf if pre == "smollm" else data / f".bpe_tiny_{pre}.gguf"
        write_vocab_gguf(path, _arch_kv(len(tokens)) + base + [("tokenizer.ggml.pre", "str", pre)])
        llm = Llama(model_path=str(path), vocab_only=True, verbose=False)
        results[pre] = {"add_bos": default_add_bos(llm), "eog_ids": eog_ids(llm),
                        "tokenize": tokenize_entries(llm, [(s, True, True) for s in BPE_STRINGS]
                                                     + [(BPE_STRINGS[9], True, False),
                                                        (BPE_STRINGS[0], False, True)])}
        del llm
        if path != gguf:
            path.unlink()
    write_json(data / "golden_bpe_tiny.json", {
        "generator": {"tool": "tools/make_golden.py --tiny-vocabs",
                      "llama_cpp_python": llama_cpp.__version__, "gguf": gguf.name,
                      "gguf_sha256": sha256(gguf),
                      "notes": "one GGUF; per pre-tokenizer, ids from a copy whose only change "
                               "is tokenizer.ggml.pre"},
        "metadata": {**{k: v for k, _, v in base}, "tokenizer.ggml.pre": "smollm"},
        "n_vocab": len(tokens),
        "pre": results,
    })


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=Path(DEFAULT_MODEL))
    ap.add_argument("--out", type=Path, default=REPO / "tests/data/golden_smollm2.json")
    ap.add_argument("--dequantize", action="store_true",
                    help="run llama.cpp on an F32 copy of --model (no activation quantization)")
    ap.add_argument("--tiny-vocabs", action="store_true",
                    help="write tiny vocab-only GGUFs and their goldens into tests/data instead")
    args = ap.parse_args(argv)
    if args.tiny_vocabs:
        data = REPO / "tests/data"
        data.mkdir(parents=True, exist_ok=True)
        make_spm_tiny(data)
        make_bpe_tiny(data)
        return 0
    if not args.model.is_file():
        print(f"model not found: {args.model} (set --model or EDGELLM_TEST_MODEL)", file=sys.stderr)
        return 2
    if args.dequantize:
        import tempfile

        with tempfile.TemporaryDirectory() as d:
            f32 = Path(d) / (args.model.stem + ".F32.gguf")
            write_dequantized_copy(args.model, f32)
            make_model_golden(f32, args.out, source=args.model)
        return 0
    make_model_golden(args.model, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
