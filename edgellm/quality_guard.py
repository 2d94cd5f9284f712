"""Runtime quality guard: when a decode step's next-token distribution looks unsure (high entropy
or a low top-1 probability), the next steps compute at the `quality` plan's precision (fp32
activations everywhere), then return to the loaded plan.

Why these signals: a precision plan's error shows up where the model is unsure. Near-ties between
candidate tokens are where an int8-rounded activation flips the choice, and a flipped token is
then fed back for every later step; a confident step (one token holding most of the mass) is
robust to the same rounding. Both signals cost one softmax over the vocabulary per step.

Scope: the guard changes compute precision only. Weights a plan requantized stay as loaded (the
quality weights would be a second resident copy of the model).
"""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import numpy as np

from .errors import ConfigError

log = logging.getLogger("edgellm.quality_guard")


@dataclass(frozen=True)
class QualityGuard:
    max_entropy: float = 4.0    # nats; above it a step counts as unsure (uniform over 55 tokens: 4.0)
    min_top1: float = 0.1       # the most likely token's probability; below it a step is unsure
    hold_steps: int = 16        # decode steps kept at the quality precision after a trigger

    def __post_init__(self):
        if not (isinstance(self.max_entropy, (int, float)) and self.max_entropy > 0):
            raise ConfigError(f"quality guard: max_entropy must be > 0 nats, got {self.max_entropy!r}")
        if not (isinstance(self.min_top1, (int, float)) and 0 <= self.min_top1 < 1):
            raise ConfigError(f"quality guard: min_top1 must be in [0, 1), got {self.min_top1!r}")
        if isinstance(self.hold_steps, bool) or not isinstance(self.hold_steps, int) or self.hold_steps < 1:
            raise ConfigError(f"quality guard: hold_steps must be an integer >= 1, got {self.hold_steps!r}")

    @classmethod
    def from_option(cls, option) -> "QualityGuard | None":
        """load(quality_guard=...): None/False -> off, True -> defaults, a QualityGuard as is."""
        if option is None or option is False:
            return None
        if option is True:
            return cls()
        if isinstance(option, cls):
            return option
        raise ConfigError(f"quality_guard must be True, False, None or a QualityGuard, got {option!r}")


def uncertainty(logits: np.ndarray) -> tuple[float, float]:
    """(entropy in nats, top-1 probability) of softmax(logits), computed in float64."""
    x = logits.astype(np.float64)
    x -= x.max()
    p = np.exp(x)
    z = p.sum()
    p /= z
    ent = float(np.log(z) - (p * x).sum())
    return ent, float(p.max())


@functools.lru_cache(maxsize=8)
def _quality_table(n_layers: int):
    """The quality plan's compute table, one per layer count: the runner caches its per-layer
    kwargs by table, so a fresh table per generation added a cache entry (~23 KB) per generation
    for good, and parsed the preset again (~7 ms)."""
    from .precision_runtime import all_fp32

    return all_fp32(n_layers)


class GuardState:
    """One generation's guard: observe() each decode step's logits; override() is the compute
    table this generation's next decode step runs with (the generation sets it on the runner for
    its own steps only: written on the runner here, one request's switch ran other requests'
    steps in fp32, and one request's end cleared another's hold). Counts the switches."""

    def __init__(self, guard: QualityGuard, runner):
        self.guard, self.runner = guard, runner
        self.quality = _quality_table(runner.cfg.n_layers)
        self.left = 0          # steps still to run at the quality precision
        self.switches = 0
        self.steps = 0         # decode steps observed

    def observe(self, logits: np.ndarray) -> None:
        self.steps += 1
        ent, top1 = uncertainty(logits)
        if ent > self.guard.max_entropy or top1 < self.guard.min_top1:
            if self.left == 0:
                self.switches += 1
                log.info("quality guard: step %d has entropy %.2f nats, top-1 p %.3f; the next %d decode steps "
                         "compute at the quality precision (fp32)", self.steps, ent, top1, self.guard.hold_steps)
            self.left = self.guard.hold_steps
        elif self.left > 0:
            self.left -= 1

    def override(self):
        """The quality table while a switch holds, else None (the plan's own precision)."""
        return self.quality if self.left > 0 else None

    def close(self) -> None:
        self.left = 0
