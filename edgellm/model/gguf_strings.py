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
from collections.abc import Iterator, Sequence

import numpy as np

_LEN_PREFIX = 8     # each string in a GGUF array is u64 length + UTF-8 bytes


class GGUFStrings(Sequence):
    """Read-only sequence of str: string j is text[starts[j]:starts[j + 1]]."""

    __slots__ = ("_text", "_starts")

    def __init__(self, text: str, starts: np.ndarray):
        self._text = text
        self._starts = starts        # (n + 1,) int32 (int64 for 2^31 characters or more)

    @classmethod
    def from_array_bytes(cls, raw: bytes, starts: list[int]) -> "GGUFStrings | None":
        """`raw`: an array's bytes as stored (each string's u64 length, then its bytes);
        `starts[j]`: where string j's bytes begin in raw (lengths already checked against raw).
        None when some string is not UTF-8 (the caller finds which, for its error)."""
        n = len(starts)
        at = np.asarray(starts, dtype=np.int64)
        keep = np.ones(len(raw), dtype=bool)
        for k in range(1, _LEN_PREFIX + 1):
            keep[at - k] = False
        data = np.frombuffer(raw, dtype=np.uint8)[keep]
        try:
            text = data.tobytes().decode("utf-8")
        except UnicodeDecodeError:
            return None
        # valid as a whole; each string is valid alone iff none begins inside a character (a
        # string cut mid-character joins the next one's continuation bytes into a valid whole)
        inner = np.flatnonzero((data & 0xC0) == 0x80)                 # continuation bytes
        byte_starts = at - _LEN_PREFIX * np.arange(1, n + 1)          # in data, without prefixes
        if np.isin(byte_starts, inner, assume_unique=True).any():
            return None
        # a string's first character: its first byte less the continuation bytes before it
        char_starts = np.append(byte_starts - np.searchsorted(inner, byte_starts), len(text))
        dt = np.int32 if len(text) < 2**31 else np.int64
        return cls(text, char_starts.astype(dt))

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
