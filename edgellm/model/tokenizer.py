"""Tokenizer built from GGUF metadata, token for token what llama.cpp's llama-vocab.cpp produces.

Two vocabulary kinds (``tokenizer.ggml.model``):

- ``gpt2``: byte-level BPE. Vocab and ranked merges come from the file; the pre-tokenizer regexes
  are the ones llama.cpp uses for ``tokenizer.ggml.pre`` (a chain of splits, each applied to the
  pieces of the previous one, then GPT-2's byte-to-unicode mapping). The native library
  (bpe_native.py) runs the merges and the pre-tokenizers; HF ``tokenizers`` runs them only
  without it.
- ``llama``: SentencePiece-style. llama.cpp's SPM tokenizer is *not* a Unigram (Viterbi) search: it
  starts from UTF-8 characters and repeatedly merges the adjacent pair whose concatenation is a
  vocab token with the highest score, leftmost first, then falls back to ``<0xNN>`` byte tokens
  for characters not in the vocab. That is BPE with merges ranked by the merged token's score (the
  way transformers' GGUF converter builds it), so it is built as an HF BPE model with
  byte_fallback where the native library is missing. That fallback has a known gap: HF ranks
  every merge uniquely, so when two *different* merged tokens have equal scores llama.cpp takes
  the leftmost pair and HF the one ranked first. The native path (bpe_native.NativeSPM) runs
  llama.cpp's algorithm itself: leftmost.

Special tokens are split out in Python exactly as llama.cpp's ``tokenizer_st_partition`` does
(longest text first, every occurrence), and only the plain-text fragments go to the BPE model, so
parse_special and user-defined tokens behave as in ``llama_tokenize(..., parse_special)``.
Fragments are encoded through a memo (fragment_memo.py): a chat's earlier turns, re-rendered every
turn, are not encoded again.
Per-model token attributes that llama.cpp hard-codes by model name (phi-3 rstrip, jina lstrip)
are not reproduced.
"""
from __future__ import annotations

import codecs
import logging
import re
from dataclasses import dataclass
from operator import methodcaller
from typing import Callable, Iterable, Sequence

import numpy as np

from edgellm.errors import ConfigError, ModelFormatError, TokenIdError, UnsupportedModelError, shown
from edgellm.backends.neon_lib import NeonLibError
from edgellm.model.bpe_native import SPLIT, DuplicateToken, MergeError, NativeBPE, NativeSPM
from edgellm.model.fragment_memo import FragmentMemo
from edgellm.model.gguf_file import describe_value
from edgellm.model.gguf_strings import GGUFStrings

_log = logging.getLogger(__name__)

# GGUF token types (llama.cpp's llama_token_type).
TOKEN_UNDEFINED, TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL = 0, 1, 2, 3
TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 4, 5, 6

_SPM_SPACE = "\u2581"  # '▁': SentencePiece's visible space
# llama_detokenize's clean-up (clean_spaces) drops, in this order, each pass over the previous
# one's output: the one space right before ? ! . , ; the spaces around a lone apostrophe
# (" ' " -> "'"); the space before the contractions 's 'm 're 've (not 't 'd 'll; lower case only)
_SPACE_BEFORE_PUNCT = re.compile(r" (?=[?!.,])")
_SPACE_BEFORE_CONTRACTION = re.compile(r" (?='(?:[sm]|re|ve))")
_BYTE_TEXT = re.compile(r"<0x[0-9A-Fa-f]{2}>")   # the text of a BYTE token: the byte in hex
_INT32_MIN, _INT32_MAX = -(1 << 31), (1 << 31) - 1

# --- pre-tokenizers: llama.cpp's regex chains (llm_tokenizer_bpe's regex_exprs) -------------------
_GPT2_RE = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
# llama.cpp's case-insensitive contractions are spelled out ([sS]) rather than (?i:...): Oniguruma's
# case folding would also match e.g. U+017F 'ſ' for 's', which llama.cpp's custom splitter does not.
_LLAMA3_RE = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
              r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_RE = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
             r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


@dataclass(frozen=True)
class _PreTokenizer:
    regexes: tuple[str, ...]   # applied in order, each splitting the pieces of the previous one
    gpt2_regex_last: bool      # finish with GPT-2's regex (HF ByteLevel's built-in one)
    ignore_merges: bool        # a word that is a whole vocab token is emitted as is (llama3)
    add_bos: bool              # llama.cpp's add_bos default for this pre-tokenizer


_PRE_FAMILIES: dict[str, _PreTokenizer] = {
    "default": _PreTokenizer((r"[\p{P}\$\+<=>\^~\|]+", _GPT2_RE, r"\p{N}+", r"[0-9][0-9][0-9]"),
                             False, False, False),
    "gpt2": _PreTokenizer((), True, False, False),
    # digits one by one, then GPT-2's regex
    "smollm": _PreTokenizer((r"\p{N}",), True, False, False),
    "llama3": _PreTokenizer((_LLAMA3_RE,), False, True, True),
    "qwen2": _PreTokenizer((_QWEN2_RE,), False, False, False),
}

# tokenizer.ggml.pre -> family, for the names llama.cpp maps onto those regex sets.
_PRE_ALIASES: dict[str, str] = {
    "default": "default",
    "gpt-2": "gpt2", "gpt2": "gpt2", "phi-2": "gpt2", "mpt": "gpt2", "olmo": "gpt2",
    "exaone4": "gpt2",
    "smollm": "smollm", "starcoder": "smollm", "refact": "smollm", "command-r": "smollm",
    "codeshell": "smollm", "exaone": "smollm", "minerva-7b": "smollm", "mellum2": "smollm",
    "llama3": "llama3", "llama-v3": "llama3", "llama-bpe": "llama3", "falcon3": "llama3",
    "falcon-h1": "llama3", "pixtral": "llama3",
    "qwen2": "qwen2", "deepseek-r1-qwen": "qwen2", "megrez": "qwen2",
}

# Pre-tokenizers whose text llama_detokenize leaves as the pieces give it. llama.cpp sets
# clean_spaces (HF's clean_up_tokenization_spaces) for every BPE vocabulary and clears it for the
# names it lists (llama-vocab.cpp, llama_vocab::impl::load): keyed by name, not family, as
# llama.cpp does ("megrez" splits as qwen2 but is cleaned). SPM vocabularies are never cleaned.
_KEEP_SPACES_PRE = frozenset({"smollm", "command-r", "qwen2", "deepseek-r1-qwen"})

# Token texts llama.cpp treats as end-of-generation (llama_vocab::impl::load, special_eog_ids).
_EOG_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
    "<\uff5cend\u2581of\u2581sentence\uff5c>", "[e~[",
})
# FIM tokens, by category: (metadata keys naming the id, texts llama.cpp looks for when none
# does). A category's token is the file's id, or else one token found by text (the first text of
# the list the vocabulary holds: llama.cpp takes whichever its hash map yields first), forced to
# control type. The pad, repo and file-separator tokens also end generation. A file that names
# its FIM ids keeps other tokens with those texts as they are: matched by text regardless, a
# NORMAL "<|file_sep|>" became a control token that stopped generation and vanished from text.
_FIM_CATEGORIES = (
    (("tokenizer.ggml.fim_pre_token_id", "tokenizer.ggml.prefix_token_id"), False,
     ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<\uff5cfim\u2581begin\uff5c>", "<PRE>",
      "\u2581<PRE>", "<|code_prefix|>", "<|prefix|>")),
    (("tokenizer.ggml.fim_suf_token_id", "tokenizer.ggml.suffix_token_id"), False,
     ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<\uff5cfim\u2581hole\uff5c>", "<SUF>",
      "\u2581<SUF>", "<|code_suffix|>", "<|suffix|>")),
    (("tokenizer.ggml.fim_mid_token_id", "tokenizer.ggml.middle_token_id"), False,
     ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<\uff5cfim\u2581end\uff5c>", "<MID>",
      "\u2581<MID>", "<|code_middle|>", "<|middle|>")),
    (("tokenizer.ggml.fim_pad_token_id",), True, ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]")),
    (("tokenizer.ggml.fim_rep_token_id",), True,
     ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>")),
    (("tokenizer.ggml.fim_sep_token_id",), True, ("<|file_sep|>",)),
)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE vocabularies."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


_BYTE_DECODER = {c: b for b, c in bytes_to_unicode().items()}


class Tokenizer:
    """Text <-> token ids for one model. Build with ``Tokenizer.from_metadata``."""

    def __init__(self, *, source: str, model: str, pre: str | None, tokens: list[str],
                 token_types: np.ndarray, encoder: Callable[[str], Sequence[int]], bos_id: int | None,
                 eos_id: int | None, add_bos: bool, add_space_prefix: bool,
                 special_ids: list[int], control_ids: frozenset[int], eot_ids: frozenset[int],
                 add_eos: bool = False, clean_spaces: bool = False):
        self.source = source
        self.model = model                      # "gpt2" (byte-level BPE) or "llama" (SPM)
        self.pre = pre                          # tokenizer.ggml.pre as written in the file
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.add_bos = add_bos                  # encode()'s default for add_bos
        self.add_eos = add_eos                  # EOS appended where BOS is not refused (llama.cpp's add_special)
        self.add_space_prefix = add_space_prefix  # SPM: ' ' before text that starts a fragment
        self.clean_spaces = clean_spaces        # decode() cleans spaces as llama_detokenize (clean_up_spaces)
        self.eot_ids = eot_ids                  # ids that end generation (llama.cpp's EOG set)
        self._tokens = tokens                   # GGUFStrings from a file: texts decoded per read
        self._types = token_types
        self._encoder = encoder                 # a plain-text fragment -> its ids (bpe_native or HF)
        self._control = control_ids             # rendered only when specials are rendered
        # longest first, as llama.cpp partitions; ties by id for determinism
        self._special = sorted(((tokens[i], i) for i in special_ids),
                               key=lambda t: (-len(t[0]), t[1]))
        self._special_parse_always = [(t, i) for t, i in self._special
                                      if token_types[i] == TOKEN_USER_DEFINED
                                      and i not in control_ids]
        self._pieces: dict[int, bytes] = {}
        self._memo = FragmentMemo()   # ids of recent plain-text fragments (a chat's earlier turns)

    # --- construction ---------------------------------------------------------------------------
    @classmethod
    def from_metadata(cls, metadata: dict, source: str) -> "Tokenizer":
        """Build from GGUF key/values (``tokenizer.ggml.*``). ``source`` names the file in errors."""
        source = str(source)
        model = _optional_str(metadata, "tokenizer.ggml.model", source)
        if model is None:
            raise ModelFormatError(source, "tokenizer.ggml.model", "missing; expected 'gpt2' or 'llama'")
        if model not in ("gpt2", "llama"):
            raise UnsupportedModelError(source, "tokenizer.ggml.model",
                                        f"tokenizer model {model!r} is not supported "
                                        "(supported: 'gpt2' byte-level BPE, 'llama' SentencePiece)")
        tokens = _string_list(metadata, "tokenizer.ggml.tokens", source, required=True)
        n = len(tokens)
        if n == 0:
            raise ModelFormatError(source, "tokenizer.ggml.tokens", "empty token list")
        if _has_empty(tokens):
            # llama.cpp renames empty token strings rather than rejecting the file
            tokens = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]

        types = _int_array(metadata, "tokenizer.ggml.token_type", source, n)   # (n,) int32
        if types is None:
            types = np.full(n, TOKEN_NORMAL, dtype=np.int32)
        _check_byte_tokens(tokens, types, source)

        pre_name = _optional_str(metadata, "tokenizer.ggml.pre", source)
        # (an id outside the vocabulary was dropped silently, as bos/eos ones are not)
        unk_id = _token_id(metadata, "tokenizer.ggml.unknown_token_id", source, n, 0 if model == "llama" else None)
        if model == "gpt2":
            if not pre_name:
                _log.warning("%s: no tokenizer.ggml.pre; using llama.cpp's 'default' pre-tokenizer "
                             "(llama.cpp warns that generation quality will be degraded)", source)
            family = _PRE_ALIASES.get(pre_name if pre_name else "default")
            if family is None:
                raise UnsupportedModelError(source, "tokenizer.ggml.pre",
                                            f"pre-tokenizer {pre_name!r} is not supported "
                                            f"(supported: {', '.join(sorted(_PRE_ALIASES))})")
            pre = _PRE_FAMILIES[family]
            encoder, token_id = _build_bpe(source, tokens, metadata, n, family)
            bos_default = eos_default = None
            add_bos_default, add_space_default = pre.add_bos, False
            clean_spaces = (pre_name or "default") not in _KEEP_SPACES_PRE
        else:
            encoder, token_id = _build_spm(source, tokens, metadata, n, unk_id)
            bos_default, eos_default = 1, 2     # llama.cpp's SPM defaults
            add_bos_default, add_space_default = True, True
            clean_spaces = False

        bos_id = _token_id(metadata, "tokenizer.ggml.bos_token_id", source, n, bos_default)
        eos_id = _token_id(metadata, "tokenizer.ggml.eos_token_id", source, n, eos_default)
        add_bos = _bool(metadata, "tokenizer.ggml.add_bos_token", source, add_bos_default)
        if add_bos and bos_id is None:
            raise ModelFormatError(source, "tokenizer.ggml.add_bos_token",
                                   "is true but the file has no tokenizer.ggml.bos_token_id")
        add_space_prefix = _bool(metadata, "tokenizer.ggml.add_space_prefix", source, add_space_default)
        # llama.cpp appends EOS to a text tokenized with its specials when the file asks (it was
        # ignored: such a model got another prompt than llama.cpp gives it)
        add_eos = _bool(metadata, "tokenizer.ggml.add_eos_token", source, False)
        if add_eos and eos_id is None:
            raise ModelFormatError(source, "tokenizer.ggml.add_eos_token",
                                   "is true but the file has no tokenizer.ggml.eos_token_id")

        control = set(np.flatnonzero((types == TOKEN_CONTROL) | (types == TOKEN_UNKNOWN)).tolist())
        special = np.flatnonzero((types == TOKEN_CONTROL) | (types == TOKEN_UNKNOWN)
                                 | (types == TOKEN_USER_DEFINED)).tolist()
        eog: set[int] = set()

        def force_control(i: int) -> None:
            if i not in control:
                control.add(i)
                if types[i] != TOKEN_USER_DEFINED:
                    special.append(i)
        for text in _EOG_TEXTS:       # every token with an end-of-generation text
            i = token_id(text)
            if i is not None:
                force_control(i)
                eog.add(i)
        for keys, ends, texts in _FIM_CATEGORIES:
            i = next((j for j in (_token_id(metadata, k, source, n, None) for k in keys) if j is not None), None)
            if i is None:
                i = next((j for j in map(token_id, texts) if j is not None), None)
                if i is not None:
                    force_control(i)
            if i is not None and ends:
                eog.add(i)
        for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
            i = _token_id(metadata, key, source, n, None)
            if i is not None:
                eog.add(i)
        if eos_id is not None:
            eog.add(eos_id)
        # llama.cpp: with <|return|>/<|call|> (gpt-oss) or <|calls|>/<|flush|> (solar-open) in the
        # EOG set, <|end|> is an ordinary user-defined token that does not stop generation
        texts = {tokens[i] for i in eog}
        has_call = "<|call|>" in texts or "<|calls|>" in texts
        if "<|end|>" in texts and has_call and ("<|return|>" in texts or "<|flush|>" in texts):
            end = token_id("<|end|>")
            eog.discard(end)
            control.discard(end)
            types = types.copy()
            types[end] = TOKEN_USER_DEFINED

        return cls(source=source, model=model, pre=pre_name, tokens=tokens, token_types=types,
                   encoder=encoder, bos_id=bos_id, eos_id=eos_id, add_bos=add_bos, add_eos=add_eos,
                   add_space_prefix=add_space_prefix, special_ids=sorted(set(special)),
                   control_ids=frozenset(control), eot_ids=frozenset(eog), clean_spaces=clean_spaces)

    # --- encoding -------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return len(self._tokens)

    def encode(self, text: str, add_bos: bool | None = None, parse_special: bool = True) -> list[int]:
        """Token ids for ``text``, as llama.cpp's llama_tokenize(text, add_special, parse_special).

        add_bos None is the model's default (tokenizer.ggml.add_bos_token, else llama.cpp's
        default for the vocabulary), which is what llama_tokenize(add_special=True) does;
        True/False force it. With parse_special the texts of control tokens (``<|im_start|>``)
        become those tokens, except inside the plain_spans of a rendered chat (chat_plain:
        its messages' contents); user-defined tokens are always matched whole, as in llama.cpp.
        A model whose file sets tokenizer.ggml.add_eos_token gets EOS appended too, unless
        add_bos is False (llama.cpp's add_special=False).
        """
        check_text(text)
        add_eos = self.add_eos and add_bos is not False
        if add_bos is None:
            add_bos = self.add_bos
        elif add_bos and self.bos_id is None:
            raise ConfigError(f"add_bos=True, but {self.source} defines no BOS token")
        out: list[int] = [self.bos_id] if add_bos else []
        prev_special = True   # SPM: a fragment at the start or after a special gets a space prefix
        memo, encode = self._memo, self._encoder
        call = memo.new_call()   # (this text's fragments are not evicted to keep its later ones)
        spm = self.model == "llama"
        spans = getattr(text, "plain_spans", ()) if parse_special else ()
        for frag in (self._partition_spans(text, spans) if spans else self._partition(text, parse_special)):
            if isinstance(frag, int):
                out.append(frag)
                prev_special = True
                continue
            if spm:
                if self.add_space_prefix and prev_special:
                    frag = " " + frag
                frag = frag.replace(" ", _SPM_SPACE)
            try:
                out.extend(memo.encode(frag, encode, call))
            except (UnicodeEncodeError, TypeError):
                _raise_if_surrogate(text)
                raise
            prev_special = False
        if add_eos:
            out.append(self.eos_id)
        return out

    def clear_memo(self) -> None:
        """Forget the remembered fragment encodings (what a cold request should not find)."""
        self._memo.clear()

    def _partition(self, text: str, parse_special: bool) -> list[str | int]:
        """Split ``text`` into plain-text fragments and special-token ids (tokenizer_st_partition)."""
        frags: list[str | int] = [text] if text else []
        for tok_text, tok_id in (self._special if parse_special else self._special_parse_always):
            if tok_text not in text:
                continue
            new: list[str | int] = []
            for frag in frags:
                if isinstance(frag, int) or tok_text not in frag:
                    new.append(frag)
                    continue
                for k, part in enumerate(frag.split(tok_text)):
                    if k:
                        new.append(tok_id)
                    if part:
                        new.append(part)
            frags = new
        return frags

    def _partition_spans(self, text: str, spans) -> list[str | int]:
        """_partition with specials parsed, except control-token texts that overlap a span."""
        always = {i for _, i in self._special_parse_always}
        frags: list[tuple[int, str | int]] = [(0, str(text))] if text else []
        for tok_text, tok_id in self._special:
            if tok_text not in text:
                continue
            new: list[tuple[int, str | int]] = []
            for off, frag in frags:
                if isinstance(frag, int):
                    new.append((off, frag))
                    continue
                pos, cut = 0, 0
                while (i := frag.find(tok_text, pos)) >= 0:
                    a, b = off + i, off + i + len(tok_text)
                    if tok_id not in always and any(a < e and s < b for s, e in spans):
                        pos = i + 1                     # inside a content: stays text
                        continue
                    if i > cut:
                        new.append((off + cut, frag[cut:i]))
                    new.append((a, tok_id))
                    pos = cut = i + len(tok_text)
                if cut < len(frag):
                    new.append((off + cut, frag[cut:]))
            frags = new
        return [f for _, f in frags]

    # --- decoding -------------------------------------------------------------------------------
    def token_text(self, token_id: int) -> str:
        """The token's string as stored in the vocabulary (byte-level or '▁' form)."""
        return self._tokens[token_id]

    def token_piece(self, token_id: int, special: bool = True) -> bytes:
        """The bytes this token stands for (may be part of a UTF-8 character), as llama.cpp's
        token_to_piece. Control tokens give their text when ``special`` else nothing."""
        if not special and token_id in self._control:
            return b""
        piece = self._pieces.get(token_id)
        if piece is None:
            piece = self._make_piece(token_id)
            self._pieces[token_id] = piece
        return piece

    def _make_piece(self, token_id: int) -> bytes:
        if not 0 <= token_id < len(self._tokens):
            raise TokenIdError(f"token id {token_id} outside the vocabulary (0..{len(self._tokens) - 1})")
        text, kind = self._tokens[token_id], self._types[token_id]
        if token_id in self._control or kind == TOKEN_USER_DEFINED:
            return text.encode("utf-8")
        if kind == TOKEN_BYTE:
            return bytes([int(text[3:5], 16)])
        if kind not in (TOKEN_NORMAL,):
            return b""          # undefined/unused types render as nothing in llama.cpp
        if self.model == "llama":
            return text.replace(_SPM_SPACE, " ").encode("utf-8")
        dec = _BYTE_DECODER
        return b"".join(bytes([dec[c]]) if c in dec else c.encode("utf-8") for c in text)

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """Text for ``ids`` as a whole text, the inverse of encode() but for the special tokens
        encode() adds and the spaces clean_spaces removes (a BOS renders as its text, as in llama_detokenize; skip_special drops
        every special token): bytes that are not valid UTF-8 become U+FFFD, and for SPM
        vocabularies the space encode() put in front of the text is dropped again (HF's
        behaviour; llama_detokenize keeps it after a BOS). Where llama.cpp cleans spaces for the
        vocabulary (clean_spaces: byte-level BPE but for a few pre-tokenizers), the text is
        cleaned as llama_detokenize(remove_special=False, unparse_special=not skip_special)
        cleans it, after the special tokens are rendered or dropped: "Hi !" is "Hi!"."""
        d = StreamDecoder(self, skip_special, strip_leading_space=True)
        text = "".join([d.push(i) for i in ids]) + d.flush()
        return clean_up_spaces(text) if self.clean_spaces else text

    def decoder(self, skip_special: bool = False) -> "StreamDecoder":
        """A streaming detokenizer for generated tokens (see StreamDecoder). Generated text
        continues the prompt, so every piece keeps its leading space, as in llama.cpp. Its
        pieces are llama.cpp's token_to_piece, never space-cleaned, as llama.cpp's completions
        (llama-server, the Python binding) give them: "Hi" " !" streams as "Hi !" where
        decode() of the same ids gives "Hi!" on a vocabulary with clean_spaces."""
        return StreamDecoder(self, skip_special)

    def is_control(self, token_id: int) -> bool:
        return token_id in self._control

    @property
    def special_texts(self) -> list[str]:
        """The texts encode(parse_special=True) parses into special tokens and parse_special=False
        leaves as text, longest first (user-defined tokens, parsed either way, are not among
        them: chat_plain has nothing to keep as text there)."""
        always = {i for _, i in self._special_parse_always}
        return [t for t, i in self._special if i not in always]


class StreamDecoder:
    """Incremental detokenizer: ``push(id)`` returns only complete UTF-8 text, holding back the
    bytes of a character split across tokens (byte-level emoji, SPM <0xNN> fallbacks) until it
    completes; ``flush()`` returns what is left (U+FFFD for an incomplete sequence, or nothing
    with drop_partial)."""

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = False,
                 strip_leading_space: bool = False):
        self._tok = tokenizer
        self._special = not skip_special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        # SPM: drop the space that encode() put before the first text piece (decode() only)
        self._strip_space = strip_leading_space and tokenizer.model == "llama" \
            and tokenizer.add_space_prefix

    def push(self, token_id: int) -> str:
        piece = self._tok.token_piece(token_id, self._special)
        if self._strip_space and not self._tok.is_control(token_id):
            self._strip_space = False
            if piece.startswith(b" "):
                piece = piece[1:]
        return self._utf8.decode(piece)

    def flush(self, drop_partial: bool = False) -> str:
        if drop_partial:   # (what it holds is only ever the start of one unfinished character)
            self._utf8.reset()
            return ""
        return self._utf8.decode(b"", final=True)


def clean_up_spaces(text: str) -> str:
    """llama_detokenize's clean-up of a whole text (llama.cpp's clean_spaces, HF's
    clean_up_tokenization_spaces as llama.cpp has it): three passes, each over the last one's
    output. Only ASCII is looked at, so the str gives what llama.cpp's bytes give (U+FFFD from a
    broken byte sequence never stands for an ASCII byte)."""
    text = _SPACE_BEFORE_PUNCT.sub("", text)
    text = text.replace(" ' ", "'")
    return _SPACE_BEFORE_CONTRACTION.sub("", text)


def check_text(text, what: str = "text") -> None:
    """Text to encode is a str: anything else is a ConfigError naming its type (bytes: say how to
    decode them), not a TypeError from deep inside the tokenizer."""
    if not isinstance(text, str):
        hint = "; decode bytes first: data.decode('utf-8', errors='replace')" if isinstance(text, (bytes, bytearray)) else ""
        raise ConfigError(f"{what}: expected a str, found {type(text).__name__}{hint}")


def check_unicode(text: str, what: str = "text") -> None:
    """check_text, and no lone surrogate: checked where the caller's text is known by name (a
    chat message's content, a prompt when the request is made, a stop string), not later at an
    offset of the rendered prompt."""
    check_text(text, what)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:   # (the fast check; the loop below only names the place)
        _raise_if_surrogate(text, what, start=e.start)


def check_token_ids(ids, vocab_size: int, what: str = "token ids") -> list[int]:
    """ids as a list of ints inside the vocabulary: a ConfigError naming what is not a token id
    (a str, a float that would be truncated, None), TokenIdError for an id outside."""
    if isinstance(ids, (str, bytes, bytearray)) or not hasattr(ids, "__iter__") or \
            (isinstance(ids, np.ndarray) and ids.ndim != 1):   # (a 0-d array: "iteration over a 0-d array")
        raise ConfigError(f"{what}: expected a sequence of integer token ids, found {type(ids).__name__}"
                          + (f" of {ids.ndim} dimensions" if isinstance(ids, np.ndarray) else ""))
    if isinstance(ids, np.ndarray) and np.issubdtype(ids.dtype, np.integer) and ids.dtype != np.bool_:
        bad = np.flatnonzero((ids < 0) | (ids >= vocab_size))    # (whole arrays at once, not id by id)
        if bad.size:
            raise TokenIdError(f"token id {ids[bad[0]]} outside the vocabulary (0..{vocab_size - 1})")
        return ids.astype(np.int64).tolist()
    try:
        ids = list(ids)
    except Exception as e:   # noqa: BLE001 - an app's iterable that fails as it is read
        raise ConfigError(f"{what}: could not be read as a sequence ({type(e).__name__}: {e})") from None
    out = []
    for i, t in enumerate(ids):
        if isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer)):
            raise ConfigError(f"{what}[{i}]: expected an integer token id, found {shown(t)}")
        if not 0 <= t < vocab_size:
            raise TokenIdError(f"token id {t} outside the vocabulary (0..{vocab_size - 1})")
        out.append(int(t))
    return out


# --- metadata helpers ----------------------------------------------------------------------------
def _raise_if_surrogate(text: str, what: str = "text", start: int = 0) -> None:
    """A lone surrogate (U+D800..U+DFFF: a str Python allows, but not Unicode text) is a
    ConfigError naming where it is."""
    for i in range(start, len(text)):
        ch = text[i]
        if 0xD800 <= ord(ch) <= 0xDFFF:
            raise ConfigError(f"{what}: character {i} is a lone surrogate (U+{ord(ch):04X}), not valid Unicode; "
                              "encode text from bytes with errors='replace'") from None


def _string_list(md: dict, key: str, source: str, required: bool) -> Sequence[str] | None:
    """The strings as given: a GGUFStrings stays one (its bytes, not ~50k str objects, are what
    the tokenizer keeps); any other sequence becomes a list of str, checked."""
    value = md.get(key)
    if value is None:
        if required:
            raise ModelFormatError(source, key, "missing")
        return None
    if isinstance(value, GGUFStrings):
        return value
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise ModelFormatError(source, key, f"expected an array of strings, found {describe_value(value)}")
    if not isinstance(value, list):
        value = list(value)
    if set(map(type, value)) - {str}:
        bad = next(v for v in value if type(v) is not str)
        raise ModelFormatError(source, key, f"expected strings, found {type(bad).__name__} {bad!r}")
    return value


def _optional_str(md: dict, key: str, source: str) -> str | None:
    """A string-valued key, None when absent; any other type is a ModelFormatError (an int array
    reached `in` and `if` tests as a numpy truth-value ValueError, a string array a TypeError)."""
    value = md.get(key)
    if value is not None and not isinstance(value, str):
        raise ModelFormatError(source, key, f"expected a string, found {describe_value(value)}")
    return value


def _number_array(value, key: str, source: str, n: int) -> np.ndarray:
    """One number per token as a 1-D array: numpy from a file, a list from a dict. Nested arrays
    (ragged ones made numpy raise ValueError, [[1]] * n passed as if flat) and strings are a
    ModelFormatError naming the key."""
    if isinstance(value, np.ndarray):
        arr = value
    elif isinstance(value, (list, tuple)):
        bad = next((j for j, v in enumerate(value) if isinstance(v, bool) or not isinstance(v, (int, float))), None)
        if bad is not None:
            raise ModelFormatError(source, key, f"expected numbers, found {describe_value(value[bad])} "
                                                f"at [{bad}] of {describe_value(value)}")
        arr = np.array(value)
    else:
        raise ModelFormatError(source, key, f"expected an array of numbers, found {describe_value(value)}")
    if arr.ndim != 1:
        raise ModelFormatError(source, key, f"expected a flat array, found shape {arr.shape}")
    if len(arr) != n:
        raise ModelFormatError(source, key, f"expected {n} entries (one per token), found {len(arr)}")
    return arr


def _int_array(md: dict, key: str, source: str, n: int) -> np.ndarray | None:
    """(n,) int32, or None when the key is absent. Values outside int32 are refused: astype
    wrapped a u64 2**32 + 3 to type 3."""
    value = md.get(key)
    if value is None:
        return None
    arr = _number_array(value, key, source, n)
    if n and arr.dtype.kind not in "iu":
        raise ModelFormatError(source, key, f"expected integers, found {describe_value(arr)}")
    if n:
        lo, hi = int(arr.min()), int(arr.max())
        if lo < _INT32_MIN or hi > _INT32_MAX:
            raise ModelFormatError(source, key, f"expected int32 values, found {lo if lo < _INT32_MIN else hi}")
    return arr.astype(np.int32, copy=False)


def _check_byte_tokens(tokens: Sequence[str], types: np.ndarray, source: str) -> None:
    """A token typed BYTE renders as the byte its <0xNN> text names; any other text loaded, then
    failed in int(..., 16) when generation reached it. llama.cpp refuses such a file too."""
    for i in np.flatnonzero(types == TOKEN_BYTE).tolist():
        if not _BYTE_TEXT.fullmatch(tokens[i]):
            raise ModelFormatError(source, "tokenizer.ggml.token_type",
                                   f"token {i} is typed BYTE ({TOKEN_BYTE}) but its text "
                                   f"{tokens[i][:40]!r} is not a byte of the form <0xNN>")


def _token_id(md: dict, key: str, source: str, n: int, default: int | None) -> int | None:
    value = md.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise ModelFormatError(source, key, f"expected a token id, found {value!r}")
    if not 0 <= value < n:
        raise ModelFormatError(source, key, f"token id {value} outside the vocabulary (0..{n - 1})")
    return value


def _bool(md: dict, key: str, source: str, default: bool) -> bool:
    value = md.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ModelFormatError(source, key, f"expected a bool, found {value!r}")
    return value


def _hf_encoder(hf) -> Callable[[str], list[int]]:
    return lambda fragment: hf.encode(fragment, add_special_tokens=False).ids


def _pre_tokenizer(pre: _PreTokenizer, missing: str = ""):
    """HF's pre-tokenizer for a family: the fallback without the native library, and the
    reference tests/test_bpe_native.py checks pretok.c against. missing: byte characters the
    vocabulary lacks; each cuts its piece there and is removed, so no merge joins its neighbours
    (llama.cpp's BPE, and bpe.c; HF's BPE model drops them first and merges across)."""
    from tokenizers import Regex
    from tokenizers import pre_tokenizers as hf_pre

    steps = [hf_pre.Split(Regex(r), "isolated") for r in pre.regexes]
    steps.append(hf_pre.ByteLevel(add_prefix_space=False, use_regex=pre.gpt2_regex_last))
    if missing:
        steps.append(hf_pre.Split(Regex("[" + "".join(f"\\x{{{ord(c):X}}}" for c in missing) + "]"), "removed"))
    return hf_pre.Sequence(steps) if len(steps) > 1 else steps[0]


def missing_byte_chars(has: Callable[[str], bool]) -> str:
    """The byte-level characters (GPT-2's printable map of the 256 bytes) a vocabulary lacks."""
    return "".join(sorted(c for c in bytes_to_unicode().values() if not has(c)))


def _has_empty(tokens: Sequence[str]) -> bool:
    if isinstance(tokens, GGUFStrings):
        return bool((np.diff(tokens.joined()[1]) == 0).any())
    return "" in tokens


def _vocab(tokens: Sequence[str], source: str) -> dict[str, int]:
    """text -> id, for HF's models (a dict of ~50k str: ~9 MB while built, the native path
    does without); duplicate texts are a ModelFormatError."""
    vocab = dict(zip(tokens, range(len(tokens))))
    if len(vocab) != len(tokens):
        seen: set[str] = set()
        dup = next(t for t in tokens if t in seen or seen.add(t))
        raise ModelFormatError(source, "tokenizer.ggml.tokens",
                               f"{len(tokens) - len(vocab)} duplicate token string(s), e.g. {dup!r}")
    return vocab


def _build_bpe(source: str, tokens: Sequence[str], md: dict, n: int,
               family: str) -> tuple[Callable[[str], Sequence[int]], Callable[[str], int | None]]:
    """The fragment encoder of a 'gpt2' vocabulary and its text -> id lookup: native
    (bpe_native.py: merges and pre-tokenizer, no HF `tokenizers` at all) where the library loads,
    else HF's pre-tokenizer and BPE model (the same ids, with a longer load and more memory)."""
    key = "tokenizer.ggml.merges"
    pre = _PRE_FAMILIES[family]
    merges = _string_list(md, key, source, required=True)
    if len(merges) >= n:
        raise ModelFormatError(source, key, f"{len(merges)} merges for {n} tokens; each merge makes "
                                            "a distinct token, so there must be fewer merges than tokens")
    try:
        native = NativeBPE(tokens, merges, family, pre.ignore_merges)
        return native, native.token_id
    except DuplicateToken as e:
        raise ModelFormatError(source, "tokenizer.ggml.tokens",
                               f"duplicate token string(s), e.g. {tokens[e.index]!r} (token {e.index})") from None
    except MergeError as e:
        what = str(e) if e.kind == SPLIT else f"merges inconsistent with tokenizer.ggml.tokens: {e}"
        raise ModelFormatError(source, key, what) from None
    except NeonLibError as e:
        _log.warning("%s: tokenizer merges on HF tokenizers, a slower load and more memory (the native "
                     "library is unavailable: %s)", source, e)
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models as hf_models

    vocab = _vocab(tokens, source)
    pairs = [(a, b) for a, _, b in map(methodcaller("partition", " "), merges)]
    for k, (a, b) in enumerate(pairs):
        if not a or not b:
            # llama.cpp splits at the first space after position 0 (a token may start with one)
            m = merges[k]
            i = m.find(" ", 1)
            if i < 0 or i == len(m) - 1:
                raise ModelFormatError(source, key, f"merge {k} {m!r} is not two tokens separated by a space")
            pairs[k] = (m[:i], m[i + 1:])
    try:
        bpe = hf_models.BPE(vocab, pairs, ignore_merges=pre.ignore_merges)
    except Exception as e:  # tokenizers raises a plain Exception naming the bad merge
        raise ModelFormatError(source, key, f"merges inconsistent with tokenizer.ggml.tokens: {e}") from None
    hf = HFTokenizer(bpe)
    hf.pre_tokenizer = _pre_tokenizer(pre, missing_byte_chars(vocab.__contains__))
    return _hf_encoder(hf), vocab.get


def _build_spm(source: str, tokens: Sequence[str], md: dict, n: int,
               unk: int | None) -> tuple[Callable[[str], Sequence[int]], Callable[[str], int | None]]:
    """The fragment encoder of a 'llama' (SentencePiece-style) vocabulary and its text -> id
    lookup: native (bpe_native.NativeSPM, llama.cpp's algorithm) where the library loads, else
    an HF BPE model with merges ranked by score (see the module docstring for its one gap)."""
    key = "tokenizer.ggml.scores"
    scores = md.get(key)
    if scores is None:
        raise ModelFormatError(source, key, "missing; a 'llama' (SentencePiece) vocabulary needs "
                                            "per-token scores to rank merges")
    scores = _number_array(scores, key, source, n)
    if scores.dtype.kind not in "iuf":
        raise ModelFormatError(source, key, f"expected numbers, found {describe_value(scores)}")
    scores = scores.tolist()
    try:
        native = NativeSPM(tokens, scores, unk)
        return native, native.token_id
    except DuplicateToken as e:
        raise ModelFormatError(source, "tokenizer.ggml.tokens",
                               f"duplicate token string(s), e.g. {tokens[e.index]!r} (token {e.index})") from None
    except NeonLibError as e:
        _log.warning("%s: tokenizer on HF tokenizers, a slower load and more memory (the native library "
                     "is unavailable: %s)", source, e)
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models as hf_models

    vocab = _vocab(tokens, source)
    # A pair merges when its concatenation is a vocab token; llama.cpp takes the highest score
    # first. Enumerate every split of every token into two vocab tokens.
    merges = []
    for tok, tid in vocab.items():
        for i in range(1, len(tok)):
            a, b = tok[:i], tok[i:]
            if a in vocab and b in vocab:
                merges.append((-float(scores[tid]), tid, i, a, b))
    merges.sort()
    unk_token = tokens[unk] if unk is not None else None
    try:
        bpe = hf_models.BPE(vocab, [(a, b) for *_, a, b in merges], unk_token=unk_token,
                             byte_fallback=True, fuse_unk=False)
    except Exception as e:
        raise ModelFormatError(source, "tokenizer.ggml.tokens", f"cannot build the SPM model: {e}") from None
    return _hf_encoder(HFTokenizer(bpe)), vocab.get
