"""Byte-level BPE and SentencePiece-style tokenizers in native code: what Tokenizer uses when
the native library loads. neon/bpe.c runs the merges, neon/pretok.c the pre-tokenizer of every
family in NATIVE_PRE (all of tokenizer.py's), so that HF `tokenizers` is not even imported; an
HF pre-tokenizer object is still accepted (tests compare the two).

With HF's BPE model, SmolLM2's tokenizer (~49k tokens and merges) took 70-85 ms of every load
to build and 14-15 MB of resident memory; with the native path 9-11 ms and 2.8 MB, and RSS after
load is 12-15 MB lower (x86, alternating processes; figures in the commit messages). The ids are
HF's: tests/test_bpe_native.py compares them on random text over all of Unicode; the llama.cpp
goldens of test_tokenizer.py run through this path too.
"""
from __future__ import annotations

import ctypes
from collections.abc import Sequence
from itertools import accumulate

import numpy as np

from edgellm.backends import neon_lib
from edgellm.errors import ConfigError, KernelError
from edgellm.model.gguf_strings import GGUFStrings

# el_bpe_create's error kinds (neon/edgellm_neon.h EL_BPE_E*); those of a merge -> what is wrong
_ENOMEM, _EDUP = 2, 3
SPLIT, LEFT, RIGHT, JOINED = 4, 5, 6, 7
_MERGE_ERRORS = {SPLIT: "is not two tokens separated by a space", LEFT: "has a first part that is not a token",
                 RIGHT: "has a second part that is not a token", JOINED: "joins into a string that is not a token"}


class DuplicateToken(ValueError):
    """Token `index` has the text of an earlier one."""

    def __init__(self, index: int, why: str):
        super().__init__(why)
        self.index = index


class MergeError(ValueError):
    """A merge the vocabulary cannot hold: kind (SPLIT, LEFT, RIGHT, JOINED) and index say which
    and why; the caller names the file and key."""

    def __init__(self, kind: int, index: int, why: str):
        super().__init__(why)
        self.kind, self.index = kind, index


def _code_points(strings: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """UTF-32 code points of all the strings and (n + 1,) int32 starts: GGUFStrings hands over
    its one str and offsets as they are, a list is joined once."""
    if isinstance(strings, GGUFStrings):
        text, starts = strings.joined()
    else:
        text = "".join(strings)
        starts = np.fromiter(accumulate(map(len, strings), initial=0), dtype=np.int64, count=len(strings) + 1)
    if len(text) >= 2**31:
        raise ValueError("more than 2^31 characters of vocabulary")
    return np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32), starts.astype(np.int32)


# The encoders take a fragment's length and their output room as C ints, the room 4 ids per code
# point (one per UTF-8 byte): a longer fragment cannot be handed over at all (its room wrapped
# negative: EL_EINVAL, an untyped RuntimeError). Bound to the longest plain-text fragment (the
# text between special tokens) the native tokenizer takes, in code points.
MAX_FRAGMENT_CHARS = (2**31 - 1) // 4
_EL_ENOMEM = -2                     # neon/edgellm_neon.h


def _check_length(fragment: str) -> None:
    if len(fragment) > MAX_FRAGMENT_CHARS:
        raise ConfigError(f"text: a run of {len(fragment):,} characters without a special token is too long for "
                          f"the tokenizer (at most {MAX_FRAGMENT_CHARS:,} characters at a time); split the text")


def _out_of_memory(fn: str, fragment: str) -> KernelError:
    return KernelError(f"tokenizer: out of memory encoding a run of {len(fragment):,} characters "
                       f"({fn}); encode shorter text")


def _encode_failed(fn: str, rc: int, fragment: str) -> KernelError:
    """The typed error for a native encoder's negative return code."""
    if rc == _EL_ENOMEM:
        return _out_of_memory(fn, fragment)
    return KernelError(f"tokenizer: {fn} refused a run of {len(fragment):,} characters (code {rc})")


# pre-tokenizers pretok.c runs itself (edgellm_neon.h EL_PRE_*)
NATIVE_PRE = {"gpt2": 1, "smollm": 2, "llama3": 3, "qwen2": 4, "default": 5}


class _NativeVocab:
    """What both native encoders share: the el_bpe object (self._bpe, made by the subclass), its
    text -> id lookup, and its release."""

    _bpe = None

    def token_id(self, text: str) -> int | None:
        """The id of the token `text`, None if there is none (the vocabulary's text -> id map)."""
        cp = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
        i = self._lib.el_bpe_token_id(self._bpe, cp.ctypes.data, len(cp))
        return i if i >= 0 else None

    def __call__(self, fragment: str) -> list[int]:
        _check_length(fragment)
        try:
            return self._encode(fragment)
        except MemoryError:     # (numpy's buffers for a huge fragment: untyped before)
            raise _out_of_memory(type(self).__name__, fragment) from None

    def __del__(self):
        if self._bpe:
            self._destroy(self._bpe)
            self._bpe = None


class NativeBPE(_NativeVocab):
    """fragment -> token ids, as HF's Tokenizer(BPE(vocab, merges)) with this pre-tokenizer:
    `pre_tokenizer` is a NATIVE_PRE name (pretok.c splits the text) or an HF pre-tokenizer."""

    def __init__(self, tokens: Sequence[str], merges: Sequence[str], pre_tokenizer, ignore_merges: bool,
                 lib=None):
        self._lib = lib or neon_lib.load()
        self._pre = pre_tokenizer
        self._family = NATIVE_PRE.get(pre_tokenizer) if isinstance(pre_tokenizer, str) else None
        if isinstance(pre_tokenizer, str) and self._family is None:
            raise ValueError(f"no native pre-tokenizer {pre_tokenizer!r} (native: {', '.join(NATIVE_PRE)})")
        tcp, tst = _code_points(tokens)
        mcp, mst = _code_points(merges)
        kind, index = ctypes.c_int(0), ctypes.c_int(-1)
        self._bpe = self._lib.el_bpe_create(tcp.ctypes.data, tst.ctypes.data, len(tokens), mcp.ctypes.data,
                                            mst.ctypes.data, len(merges), int(ignore_merges),
                                            ctypes.byref(kind), ctypes.byref(index))
        if not self._bpe:
            if kind.value in _MERGE_ERRORS:
                raise MergeError(kind.value, index.value,
                                 f"merge {index.value} {merges[index.value]!r} {_MERGE_ERRORS[kind.value]}")
            if kind.value == _EDUP:
                raise DuplicateToken(index.value, f"token {index.value} {tokens[index.value]!r} is listed twice")
            raise MemoryError("el_bpe_create failed") if kind.value == _ENOMEM else ValueError("el_bpe_create: bad arguments")
        self._destroy = self._lib.el_bpe_destroy

    def _encode(self, fragment: str) -> list[int]:
        if self._family is not None:
            cp = np.frombuffer(fragment.encode("utf-32-le"), dtype=np.uint32)
            out = np.empty(max(1, 4 * len(cp)), dtype=np.int32)
            n = self._lib.el_bpe_encode_text(self._bpe, self._family, cp.ctypes.data, len(cp), out.ctypes.data,
                                             len(out))
            if n < 0:
                raise _encode_failed("el_bpe_encode_text", n, fragment)
            return out[:n].tolist()
        pieces = [p for p, _ in self._pre.pre_tokenize_str(fragment)]
        if not pieces:
            return []
        cp = np.frombuffer("".join(pieces).encode("utf-32-le"), dtype=np.uint32)
        starts = np.fromiter(accumulate(map(len, pieces), initial=0), dtype=np.int32, count=len(pieces) + 1)
        out = np.empty(max(1, len(cp)), dtype=np.int32)
        n = self._lib.el_bpe_encode(self._bpe, cp.ctypes.data, starts.ctypes.data, len(pieces), out.ctypes.data,
                                    len(out))
        if n < 0:
            raise _encode_failed("el_bpe_encode", n, fragment)
        return out[:n].tolist()


class NativeSPM(_NativeVocab):
    """fragment (spaces already U+2581, as Tokenizer.encode prepares it) -> token ids, as
    llama.cpp's SentencePiece-style tokenizer: the highest-scoring adjacent pair whose text is a
    token merges first, the leftmost among equals; characters missing from the vocabulary become
    their bytes' <0xNN> tokens."""

    def __init__(self, tokens: Sequence[str], scores: Sequence[float], unk: int | None, lib=None):
        self._lib = lib or neon_lib.load()
        tcp, tst = _code_points(tokens)
        sc = np.ascontiguousarray(scores, dtype=np.float32)
        kind, index = ctypes.c_int(0), ctypes.c_int(-1)
        self._bpe = self._lib.el_spm_create(tcp.ctypes.data, tst.ctypes.data, len(tokens), sc.ctypes.data,
                                            -1 if unk is None else int(unk), ctypes.byref(kind), ctypes.byref(index))
        if not self._bpe:
            if kind.value == _EDUP:
                raise DuplicateToken(index.value, f"token {index.value} {tokens[index.value]!r} is listed twice")
            raise MemoryError("el_spm_create failed") if kind.value == _ENOMEM else ValueError("el_spm_create: bad arguments")
        self._destroy = self._lib.el_bpe_destroy

    def _encode(self, fragment: str) -> list[int]:
        cp = np.frombuffer(fragment.encode("utf-32-le"), dtype=np.uint32)
        out = np.empty(max(1, 4 * len(cp)), dtype=np.int32)
        n = self._lib.el_spm_encode(self._bpe, cp.ctypes.data, len(cp), out.ctypes.data, len(out))
        if n < 0:
            raise _encode_failed("el_spm_encode", n, fragment)
        return out[:n].tolist()
