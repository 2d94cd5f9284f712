"""Token sampling and stop strings.

The chain and its definitions follow llama.cpp's default sampler chain (common/sampling.cpp):

    repetition penalty -> top-k -> top-p -> min-p -> temperature -> draw

so top-p and min-p see probabilities at temperature 1 (renormalised over what top-k kept), and
temperature only reshapes the surviving set. Temperature 0 is greedy: argmax after the penalty.

Cost matters: this runs once per generated token on a ~49k vocabulary. Where the NEON library
loads, a draw runs in C (neon/sample.c), also inside native decode runs; the numpy chain below
is its twin and the path otherwise. Both fix every order that decides which token a uniform
picks: candidates rank by (logit descending, id ascending), so ties at the top-k or top-p
boundary keep the lower ids, and the draw walks the final candidates in id order. They can differ only where exp rounds an ulp apart, which moves a
pick only when the uniform falls within ~1e-7 of a boundary.

In numpy the full vocabulary is never sorted when top-k is set (a partition, then a sort of k
values), and top-p without top-k grows a partial sort until the nucleus is covered instead of
sorting everything.
"""
from __future__ import annotations

import math
import numbers
import random
from dataclasses import dataclass
from itertools import islice
from typing import NamedTuple, Sequence

import numpy as np

from edgellm.errors import ConfigError, EdgeLLMError, shown
from edgellm.model.tokenizer import check_unicode

__all__ = ["SamplingConfig", "Sampler", "StopChecker", "StopStep"]


def _bad(name: str, allowed: str, value: object) -> ConfigError:
    return ConfigError(f"sampling.{name}: expected {allowed}, found {shown(value)}")


def _finite(v: object) -> bool:
    try:
        return math.isfinite(v)
    except (OverflowError, TypeError, ValueError):   # (10**400: an int too large for a float)
        return False


_F32_MAX = float(np.finfo(np.float32).max)
_REPEAT_PENALTY_MIN = 1e-30   # a logit of 1e8 divided by it is 1e38, still under float32's 3.4e38
_REPEAT_PENALTY_MAX = 1e30


def _is_real(v: object) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def _is_int(v: object) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.0  # softmax temperature applied last; 0 = greedy (argmax)
    top_k: int = 0  # keep the k highest logits; 0 = off (1 = greedy)
    top_p: float = 1.0  # nucleus: smallest prefix (by prob) with cumulative prob >= top_p; 1 = off,
    #                     0 = the most probable token alone (llama.cpp's top-p keeps at least one)
    min_p: float = 0.0  # drop tokens with p < min_p * p_max; 0 = off
    repeat_penalty: float = 1.0  # recent tokens: logit > 0 divided by it, logit <= 0 multiplied; 1 = off
    repeat_last_n: int = 64  # how many recent history tokens the penalty covers; 0 = off, -1 = all
    seed: int | None = None  # RNG seed (seeded => reproducible draws); None = fresh OS entropy

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ConfigError naming the first bad parameter, its allowed range and its value."""
        t = self.temperature
        if not (_is_real(t) and _finite(t) and t >= 0):
            raise _bad("temperature", "a finite number >= 0 (0 = greedy)", t)
        if not (_is_int(self.top_k) and self.top_k >= 0):
            raise _bad("top_k", "an integer >= 0 (0 = off)", self.top_k)
        p = self.top_p
        if not (_is_real(p) and 0.0 <= p <= 1.0):
            raise _bad("top_p", "a number in [0, 1] (1 = off, 0 = the most probable token)", p)
        mp = self.min_p
        if not (_is_real(mp) and 0.0 <= mp <= 1.0):
            raise _bad("min_p", "a number in [0, 1] (0 = off)", mp)
        rp = self.repeat_penalty
        # bounded so the penalized float32 logits stay finite: 1e-40 rounds to a float32 denormal
        # and 1e-45 to 0 (a divide by zero), 1e300 overflows the cast; either way numpy warned and
        # the draw then blamed the model's output as non-finite
        if not (_is_real(rp) and _REPEAT_PENALTY_MIN <= rp <= _REPEAT_PENALTY_MAX):
            raise _bad("repeat_penalty", f"a number in [{_REPEAT_PENALTY_MIN:g}, {_REPEAT_PENALTY_MAX:g}] "
                       f"(1 = off; beyond it the penalized float32 logits can overflow)", rp)
        if not (_is_int(self.repeat_last_n) and self.repeat_last_n >= -1):
            raise _bad("repeat_last_n", "an integer >= -1 (0 = off, -1 = whole history)",
                       self.repeat_last_n)
        s = self.seed
        if s is not None and not (_is_int(s) and s >= 0):
            raise _bad("seed", "None or an integer >= 0", s)

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax after the repetition penalty."""
        return self.temperature == 0 or self.top_k == 1 or self.top_p == 0


class Sampler:
    """Draws one token id per call from a logits vector, following a SamplingConfig.

    Holds the random generator, so one Sampler per generation stream: a seeded config replays
    the same tokens for the same logits and history.
    """

    def __init__(self, config: SamplingConfig | None = None):
        self.config = config if config is not None else SamplingConfig()
        self.config.validate()
        self._seed = self.config.seed
        self._rng_now: random.Random | None = None
        self._pending: list[float] = []   # uniforms a native run drew but did not use, next last
        # the C chain (neon/sample.c) when the library loads; None: greedy, or numpy's chain
        self.native = None if self.config.greedy else _native_chain(self.config)

    @property
    def _rng(self) -> random.Random:
        # made on first use: greedy decoding never draws, and seeding from OS entropy costs
        # ~0.1 ms, inside the TTFT of every request (a cached chat turn takes ~14 ms). The
        # standard library's Mersenne Twister, not numpy.random: a draw is one uniform, and
        # numpy.random would add ~2 MB of modules to the process's resident memory.
        if self._rng_now is None:
            # int(): random.Random refuses numpy integers, which validate() accepts as seeds
            self._rng_now = random.Random(None if self._seed is None else int(self._seed))
        return self._rng_now

    def reset(self, seed: int | None = None) -> None:
        """Restart the random stream (from `seed`, else from the config's seed)."""
        self._seed = self.config.seed if seed is None else seed
        self._rng_now = None
        self._pending.clear()

    def run_chain(self):
        """(the chain a native decode run picks with, why no run can pick as this sampler
        does): the chain is None for greedy without a penalty (the bare argmax), a temperature-0
        chain for greedy with one, the native draw chain otherwise; the reason is None when a
        run can (token by token otherwise: no library, numpy's chain)."""
        cfg = self.config
        if cfg.greedy and (cfg.repeat_penalty == 1.0 or cfg.repeat_last_n == 0):
            return None, None
        chain = _native_chain(cfg) if cfg.greedy else self.native
        return (chain, None) if chain is not None else (None, "the NEON library is unavailable: numpy's chain")

    def uniforms(self, n: int) -> list[float]:
        """The stream's next n uniforms, one per draw: a native decode run draws with them."""
        out = [self._pending.pop() for _ in range(min(n, len(self._pending)))]
        return out + [self._rng.random() for _ in range(n - len(out))]

    def unuse(self, us: Sequence[float]) -> None:
        """Give back the last uniforms `uniforms` returned that no draw used: the next draws take
        them, so a seeded stream produces the same tokens however its draws were grouped."""
        self._pending.extend(reversed(us))

    def _uniform(self) -> float:
        return self._pending.pop() if self._pending else self._rng.random()

    def sample(self, logits: np.ndarray, history: Sequence[int] = ()) -> int:
        """Pick the next token id. logits: (vocab,) float; history: previous token ids."""
        x = logits if isinstance(logits, np.ndarray) else np.asarray(logits)
        if x.ndim != 1 or x.size == 0:
            raise ConfigError(f"sampler: logits: expected shape (vocab,), found {x.shape}")
        if x.dtype != np.float32 and x.dtype != np.float64:
            x = x.astype(np.float32)
        x = self._penalize(x, history)
        if self.config.greedy:
            i = int(np.argmax(x))
            # argmax returns the first NaN if there is one, so this O(1) check catches NaN logits
            if not math.isfinite(x[i]):
                raise _nonfinite(x)
            return i
        return self._draw(x)

    # -- stages ---------------------------------------------------------------------------------

    def _penalize(self, x: np.ndarray, history: Sequence[int]) -> np.ndarray:
        """llama.cpp repetition penalty over the distinct ids among the last repeat_last_n."""
        cfg = self.config
        n = len(history)
        if cfg.repeat_penalty == 1.0 or cfg.repeat_last_n == 0 or n == 0:
            return x
        start = max(0, n - cfg.repeat_last_n) if cfg.repeat_last_n > 0 else 0
        if isinstance(history, np.ndarray):
            ids = np.unique(history[start:]).astype(np.int64, copy=False)
        else:
            try:
                recent = history[start:]
            except TypeError:  # e.g. a deque: no slicing
                recent = islice(history, start, None)
            ids = np.fromiter(set(recent), dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= x.size):
            bad = int(ids.min()) if ids.min() < 0 else int(ids.max())
            raise ConfigError(
                f"sampler: history: expected token ids in [0, {x.size}), found {bad}")
        y = x.copy()
        v = y[ids]
        pen = cfg.repeat_penalty
        y[ids] = np.where(v <= 0, v * pen, v / pen)
        return y

    def _draw(self, x: np.ndarray) -> int:
        m = x.max()  # also the NaN check: max propagates NaN
        if not math.isfinite(m):
            raise _nonfinite(x)
        if x.dtype == np.float32 and self.native is not None:
            return self.native.draw(x, self._uniform())
        return draw_numpy(self.config, x, m, self._uniform())


def _native_chain(cfg: SamplingConfig):
    from .sampling_native import native_chain
    return native_chain(cfg)


def draw_numpy(cfg: SamplingConfig, x: np.ndarray, m, u: float) -> int:
    """The chain in numpy: the id drawn with the uniform u from logits x whose maximum m is
    finite. el_sample's twin (see the module docstring for the orders both fix)."""
    n = x.size
    idx: np.ndarray | None = None  # candidate ids, best first; None = the whole vocab in id order
    if 0 < cfg.top_k < n:
        idx = _ranked(x, cfg.top_k)
    if cfg.top_p < 1.0:
        idx = _nucleus(x, m, cfg.top_p) if idx is None else idx[:_nucleus_cut(x[idx], m, cfg.top_p)]
    if cfg.min_p > 0.0:
        # p_i >= min_p * p_max  <=>  logit_i >= max_logit + log(min_p), in float32 (m is); the
        # max always survives
        thr = m + math.log(cfg.min_p)
        idx = np.flatnonzero(x >= thr) if idx is None else idx[x[idx] >= thr]
    if idx is not None:
        idx = np.sort(idx)
    v = x if idx is None else x[idx]
    # temperature last; exp(0) = 1 at the max, so the weights never all underflow. 1/t is
    # capped at the float32 maximum as el_sample caps it: past it (t < ~2.9e-39) the maximum's
    # weight would be 0 * inf = NaN; at it every other weight underflows to 0, the argmax
    inv_t = np.float32(min(1.0 / cfg.temperature, _F32_MAX))
    with np.errstate(over="ignore"):   # (v - m) * inv_t below -FLT_MAX: -inf, a weight of 0
        j = _pick(np.exp((v - m) * inv_t), u)
    return int(idx[j]) if idx is not None else j


def _ranked(x: np.ndarray, k: int) -> np.ndarray:
    """Ids of the k largest values of x, best first by (value descending, id ascending), 0 < k.

    A partition over the whole vocab is the cost here, so it is first narrowed: the k-th
    largest value t of a strided sample has at least k values of x at or above it, hence every
    top-k value of x is >= t, and the mask x >= t is a superset of the answer (about k * stride
    ids on smooth logits; never wrong on any input, only slower on heavily tied ones).
    """
    n = x.size
    if k >= n:
        cand = np.arange(n)
    else:
        stride = min(16, n // (4 * k))
        cand = np.arange(n)
        if stride >= 2:
            sample = x[::stride]
            cand = np.flatnonzero(x >= np.partition(sample, sample.size - k)[sample.size - k])
        if cand.size > k:
            v = x[cand]
            t = np.partition(v, v.size - k)[v.size - k]       # the k-th largest value
            above = cand[v > t]
            cand = np.concatenate([above, cand[v == t][: k - above.size]])   # ties: lowest ids
    return cand[np.lexsort((cand, -x[cand]))]


def _nucleus_cut(v: np.ndarray, m, p: float) -> int:
    """How many of the ranked candidates v (best first) llama.cpp's top-p keeps: up to and
    including the first at which the cumulative probability (renormalised over v) reaches p."""
    e = np.exp(v - m)
    c = np.cumsum(e.astype(np.float64))
    return min(int(np.searchsorted(c, p * float(e.sum(dtype=np.float64)), side="left")) + 1, v.size)


def _nucleus(x: np.ndarray, m, p: float) -> np.ndarray:
    """Ids of llama.cpp's top-p set over the whole vocabulary, best first. Ranks only a growing
    top slice, not the whole vector."""
    target = p * float(np.exp(x - m).sum(dtype=np.float64))
    n = x.size
    kk = min(n, 64)
    while True:
        r = _ranked(x, kk)
        c = np.cumsum(np.exp(x[r] - m).astype(np.float64))
        cut = int(np.searchsorted(c, target, side="left")) + 1
        if cut <= kk or kk >= n:
            return r[:min(cut, kk)]
        kk = min(n, kk * 8)


_BLOCK = 256  # draw in two levels (block sums, then one block) above 8 blocks of weights


def _pick(w: np.ndarray, u: float) -> int:
    """Index i drawn with probability w[i] / sum(w); w >= 0 with a positive entry, u in [0, 1).

    A full cumulative sum over a 49k vocab costs several times the exp that produced w, so large
    vectors are searched by block sums first. side="right" finds the first cumulative value
    > r, so zero-weight entries (probabilities that underflowed) are never picked.
    """
    n = w.size
    if n <= 8 * _BLOCK:
        c = np.cumsum(w.astype(np.float64))
        return _last_positive(w, int(np.searchsorted(c, u * c[-1], side="right")))
    nb = n // _BLOCK
    sums = w[:nb * _BLOCK].reshape(nb, _BLOCK).sum(axis=1, dtype=np.float64)
    if n % _BLOCK:
        sums = np.append(sums, w[nb * _BLOCK:].sum(dtype=np.float64))
    cb = np.cumsum(sums)
    r = u * cb[-1]
    b = min(int(np.searchsorted(cb, r, side="right")), cb.size - 1)
    while sums[b] == 0:  # only reachable through rounding at the very top
        b -= 1
    lo = b * _BLOCK
    seg = w[lo:lo + _BLOCK]
    c = np.cumsum(seg.astype(np.float64))
    r = min(r - (cb[b - 1] if b else 0.0), c[-1])
    return lo + _last_positive(seg, int(np.searchsorted(c, r, side="right")))


def _last_positive(w: np.ndarray, j: int) -> int:
    """Clamp a search result that rounding pushed past the end to the last nonzero weight."""
    if j < w.size:
        return j
    return int(np.flatnonzero(w)[-1])


def _nonfinite(x: np.ndarray) -> EdgeLLMError:
    # errors.py has no numeric-fault class yet; the base class keeps it typed for the CLI
    nan = int(np.isnan(x).sum())
    inf = int(np.isinf(x).sum())
    return EdgeLLMError(
        f"sampler: logits: expected finite values, found {nan} NaN and {inf} inf "
        f"of {x.size}: the forward pass produced non-finite output (a model file whose weights or "
        f"block scales hold NaN or inf gives this; `--units reference` tells a file from a unit)")


# -- stop strings -------------------------------------------------------------------------------


class StopStep(NamedTuple):
    stopped: bool  # a stop string was hit; generation should end; `text` is what precedes it
    text: str  # text that is safe to show now (never contains any part of a stop string)


class StopChecker:
    """Streams decoded text while holding back anything that could be the start of a stop string.

    `stopped, text = feed(piece)` for each decoded piece; show text; end when stopped. At a natural end
    (EOS, length limit) call flush() for the held-back tail. Stop strings are never emitted.
    """

    def __init__(self, stops: Sequence[str] = ()):
        if isinstance(stops, str):
            stops = [stops]
        elif stops is None:
            stops = ()
        elif not isinstance(stops, (list, tuple, set, frozenset)):   # (a GenerationConfig's own stop=5)
            raise ConfigError(f"sampling.stop: expected a string or a list of strings, found {type(stops).__name__}")
        for s in stops:
            if not isinstance(s, str) or s == "":
                raise ConfigError(f"sampling.stop: expected non-empty strings, found {shown(s)}")
            check_unicode(s, "sampling.stop")   # (one holding a lone surrogate could never match)
        self.stops: tuple[str, ...] = tuple(dict.fromkeys(stops))
        self._held = ""
        self.stopped = False

    def feed(self, piece: str) -> StopStep:
        if self.stopped:
            return StopStep(True, "")
        buf = self._held + piece
        # held text never contains a whole stop string, and no stop string can start in text
        # already emitted (it would have been held back), so searching buf suffices
        hit = min((i for i in (buf.find(s) for s in self.stops) if i >= 0), default=-1)
        if hit >= 0:
            self.stopped = True
            self._held = ""
            return StopStep(True, buf[:hit])
        hold = self._hold(buf)
        self._held = buf[len(buf) - hold:] if hold else ""
        return StopStep(False, buf[:len(buf) - hold])

    def _hold(self, buf: str) -> int:
        """Length of the longest end of buf that is a proper prefix of a stop string: it must be
        held back. (A set of every stop's prefixes answered this by lookup, but it held O(L^2)
        characters: a 60,000-character stop took 7 s and 1.9 GB per request.)"""
        best, n = 0, len(buf)
        for s in self.stops:
            p = buf.find(s[0], max(0, n - (len(s) - 1)))    # longest candidates first
            while p != -1 and n - p > best:
                if s.startswith(buf[p:]):
                    best = n - p
                    break
                p = buf.find(s[0], p + 1)
        return best

    def flush(self) -> str:
        """Release the held-back tail at the end of a generation that did not hit a stop."""
        out, self._held = ("" if self.stopped else self._held), ""
        return out

    @property
    def held(self) -> str:
        """Text received but not yet safe to emit."""
        return self._held
