"""GGUFStrings: a GGUF array of strings kept as one str, sliced when read.

Why: a model's vocabulary and merge list are ~100k short strings. As Python str objects they
take ~8 MB of a small model's resident memory (SmolLM2-135M: 4.3 MB of tokens, 3.4 MB of merges)
for data read once at load (the merges) or a few ids at a time (token texts). Kept as one str of
all the array's characters plus one start offset per string they take ~2 MB, and reading one is
a str slice. `from_array_bytes` checks the UTF-8 of the whole array in one decode.
"""
from __future__ import annotations

import operator
import sys
import threading
from collections.abc import Callable, Iterator, Sequence

import numpy as np

_LEN_PREFIX = 8     # each string in a GGUF array is u64 length + UTF-8 bytes


class GGUFStrings(Sequence):
    """Read-only sequence of str: string j is text[starts[j]:starts[j + 1]]."""

    __slots__ = ("_text", "_starts")

    def __init__(self, text: str, starts: np.ndarray):
        self._text = text
        self._starts = starts        # (n + 1,) int32 (int64 for 2^31 characters or more)

    @classmethod
    def from_array_bytes(cls, raw: bytes, starts: Sequence[int]) -> "GGUFStrings | None":
        """`raw`: an array's bytes as stored (each string's u64 length, then its bytes);
        `starts[j]`: where string j's bytes begin in raw (lengths already checked against raw).
        None when some string is not UTF-8 (the caller finds which, for its error).

        Temporaries stay within raw's size, one at a time: a hostile array of 4M empty strings
        (32 MiB of length prefixes) peaked at ~8x its size before (a list of 4M int starts,
        np.isin's sorted copies, arange and fancy-index temporaries the size of every start)."""
        at = np.asarray(starts)             # no copy for a numpy or array.array of integers
        if at.dtype.kind not in "iu":
            at = at.astype(np.int64)        # (an empty list)
        n = len(at)
        size = len(raw) - _LEN_PREFIX * n               # the strings' bytes, without prefixes
        data = _strip_length_prefixes(raw, at, size)
        del raw         # (a caller that passes a temporary frees its copy of the array here)
        dt = np.int32 if size < 2**31 else np.int64     # offsets of characters, never more than bytes
        byte_starts = _byte_starts(at, size, dt)         # (n + 1,) in the bytes without prefixes
        try:
            text = str(data, "utf-8")
        except UnicodeDecodeError:
            return None
        if len(text) == size:           # ASCII: characters are bytes
            return cls(text, byte_starts)
        # valid as a whole; each string is valid alone iff none begins inside a character (a
        # string cut mid-character joins the next one's continuation bytes into a valid whole)
        cont = (data & 0xC0) == 0x80                    # bytes inside a character
        del data
        starts = byte_starts[:n]
        begun = int(np.searchsorted(starts, size))      # strings not empty at the end
        if cont[starts[:begun]].any():
            return None
        # a string's characters: its bytes less its continuation bytes, counted per string (a
        # running count over every byte was an int32 per byte: 1.4 MiB for SmolLM2's vocabulary,
        # left resident by the allocator after load)
        per = np.zeros(n, dtype=dt)
        if begun:
            sums = np.add.reduceat(cont, starts[:begun], dtype=dt)
            per[:begun] = np.where(byte_starts[1:begun + 1] > starts[:begun], sums, 0)   # (reduceat: a[i] for empty)
        del cont
        np.cumsum(per, out=per)
        byte_starts[1:] -= per
        return cls(text, byte_starts)

    def joined(self) -> tuple[str, np.ndarray]:
        """All the strings as one str and the (n + 1,) start offsets into it (no copy)."""
        return self._text, self._starts

    def __len__(self) -> int:
        return len(self._starts) - 1

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        n = len(self._starts) - 1
        j = operator.index(i)       # TypeError for a non-integer index, as a list raises
        if j < 0:
            j += n
        if not 0 <= j < n:
            raise IndexError(f"string index {i} out of range for {n} strings")
        return self._text[int(self._starts[j]):int(self._starts[j + 1])]

    def __iter__(self) -> Iterator[str]:
        text, starts = self._text, self._starts.tolist()
        return (text[a:b] for a, b in zip(starts, starts[1:]))

    def __eq__(self, other) -> bool:
        if isinstance(other, GGUFStrings):
            return self._text == other._text and np.array_equal(self._starts, other._starts)
        if isinstance(other, (str, bytes)) or not isinstance(other, Sequence):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other))

    __hash__ = None     # equal to a list, so unhashable as a list is

    def __repr__(self) -> str:
        head = ", ".join(repr(s) for s in self[:3])
        return f"GGUFStrings([{head}{', ...' if len(self) > 3 else ''}], n={len(self)})"

    @property
    def nbytes(self) -> int:
        """Bytes held: the str of all characters (1, 2 or 4 bytes each) and the offsets."""
        return sys.getsizeof(self._text) + self._starts.nbytes


class GGUFStringsOnDemand(GGUFStrings):
    """A GGUFStrings decoded on first use by `load()` (then kept), its length known before.

    Why: SmolLM2's merges (48,900 strings) held ~0.9 MiB resident after load although only the
    tokenizer reads them, once, while the model opens (gguf_file.release_strings). A later
    reader (requant copies every key) gets the same strings, re-read from the file."""

    __slots__ = ("_n", "_load", "_lock")

    def __init__(self, n: int, load: Callable[[], GGUFStrings]):
        self._n = n
        self._load = load           # () -> GGUFStrings; raises when the strings cannot be had
        self._lock = threading.Lock()   # one re-read when several threads read at once

    def __getattr__(self, name):
        # reached only while the _text/_starts slots are unset: the first read of the strings
        if name not in ("_text", "_starts"):
            raise AttributeError(name)
        with self._lock:
            if not self.loaded:
                text, starts = self._load().joined()
                self._starts = starts
                self._text = text       # (set last: `loaded` tests _starts, a reader _text)
        return object.__getattribute__(self, name)

    def __len__(self) -> int:
        return self._n

    @property
    def loaded(self) -> bool:
        """Whether the strings are decoded and held (object.__getattribute__: no load)."""
        try:
            object.__getattribute__(self, "_starts")
        except AttributeError:
            return False
        return True

    @property
    def nbytes(self) -> int:
        """Bytes held: none until the strings are first read."""
        return super().nbytes if self.loaded else 0


# strings whose prefixes are cleared per step: bounds the mask and index temporaries to ~150 KiB
_PREFIX_CHUNK = 1 << 14


def _byte_starts(at: np.ndarray, size: int, dt: type) -> np.ndarray:
    """(n + 1,): where each string begins among the bytes without prefixes, then `size`.
    String j spans at[j] .. at[j + 1] - 8 in raw, so the starts are a running sum of those
    spans; built in place, no n-sized temporary."""
    n = len(at)
    out = np.empty(n + 1, dtype=dt)
    out[0] = 0
    np.subtract(at[1:], at[:-1], out=out[1:n], casting="same_kind")
    out[1:n] -= _LEN_PREFIX
    np.cumsum(out[:n], out=out[:n])
    out[n] = size
    return out


def _strip_length_prefixes(raw: bytes, at: np.ndarray, size: int) -> np.ndarray:
    """The strings' bytes without the u64 length before each, (size,) uint8, filled a chunk of
    strings at a time so the mask and index temporaries stay small."""
    u8 = np.frombuffer(raw, dtype=np.uint8)
    data = np.empty(size, dtype=np.uint8)
    n, filled = len(at), 0
    for lo in range(0, n, _PREFIX_CHUNK):
        hi = min(lo + _PREFIX_CHUNK, n)
        first = int(at[lo]) - _LEN_PREFIX                        # this chunk's first prefix
        last = int(at[hi]) - _LEN_PREFIX if hi < n else len(raw)  # the next chunk's
        keep = np.ones(last - first, dtype=bool)
        for k in range(1, _LEN_PREFIX + 1):
            keep[at[lo:hi] - (first + k)] = False
        part = u8[first:last][keep]
        data[filled:filled + len(part)] = part
        filled += len(part)
    return data
