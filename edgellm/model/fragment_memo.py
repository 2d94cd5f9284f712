"""Token ids of recently encoded plain-text fragments, for Tokenizer.encode.

A chat template re-renders the whole conversation every turn, so each turn tokenizes every
earlier turn again: at a 2,000-token history that was ~2.4 ms of a ~46 ms TTFT (SmolLM2, x86).
Special tokens cut the rendered text into fragments, and the model encodes each fragment on its
own, from its text alone, so an earlier turn's fragment is the same string with the same ids.
Keeping them (least recently used out first) makes a turn encode only its new fragments, with
exactly the ids a fresh encode gives.

The memo is bounded by the ids it holds: at the default 65,536, with their fragments' texts, it
took 0.56 MiB (tracemalloc, English text). It is thread-safe: the scheduler may encode from several
threads.

A text whose fragments hold more ids than the memo (a ring chat's history, re-rendered whole
every turn, past 65,536 tokens) must not evict the fragments it is itself made of: in plain LRU
order each new fragment evicted the oldest, which the next turn needed first, so every turn
encoded everything again (13 ms at 65.6k tokens, 38 ms at 72k: a helper's probe). An encode call
(`call`, Tokenizer.encode's own number) never evicts a fragment it has used: when only those are
left, a new fragment is not kept, and the memo keeps serving the text's first 65,536 ids.
"""
from __future__ import annotations

import threading
from array import array
from collections import OrderedDict
from typing import Callable

# fragments shorter than this are cheap to encode and would only churn the memo
MIN_CHARS = 32


class FragmentMemo:
    def __init__(self, max_ids: int = 65536):
        if max_ids < 1:
            raise ValueError(f"max_ids must be >= 1, got {max_ids}")
        self.max_ids = max_ids
        self._ids: OrderedDict[str, array] = OrderedDict()
        self._used: dict[str, int] = {}   # fragment -> the last call that used it
        self._held = 0          # ids held, over all fragments
        self._calls = 0
        self._lock = threading.Lock()

    def new_call(self) -> int:
        """A number for one encode call (the fragments of one text)."""
        with self._lock:
            self._calls += 1
            return self._calls

    def __len__(self) -> int:
        return len(self._ids)

    @property
    def held_ids(self) -> int:
        return self._held

    def encode(self, fragment: str, encode: Callable[[str], list[int]], call: int = 0) -> array | list[int]:
        """The ids of `fragment`: remembered, or encode(fragment) (then remembered, unless only
        fragments this `call` used could make room; 0: no call of its own)."""
        if len(fragment) < MIN_CHARS:
            return encode(fragment)
        with self._lock:
            hit = self._ids.get(fragment)
            if hit is not None:
                self._ids.move_to_end(fragment)
                self._used[fragment] = call
                return hit
        ids = array("i", encode(fragment))
        if len(ids) > self.max_ids:     # larger than the whole memo: not kept
            return ids
        with self._lock:
            if fragment in self._ids:
                return ids
            room = self.max_ids - self._held
            for old, old_ids in self._ids.items():     # least recently used first
                if room >= len(ids):
                    break
                if call and self._used.get(old) == call:
                    return ids                          # only this text's own fragments left
                room += len(old_ids)
            while self._held + len(ids) > self.max_ids:
                old, old_ids = self._ids.popitem(last=False)
                self._used.pop(old, None)
                self._held -= len(old_ids)
            self._ids[fragment] = ids
            self._used[fragment] = call
            self._held += len(ids)
        return ids

    def clear(self) -> None:
        with self._lock:
            self._ids.clear()
            self._used.clear()
            self._held = 0
