"""An environment's step latency, drawn from a declared distribution, repeatable from a seed.

A real environment (a tool, a sandbox, a judge) takes time to answer, and that time is what makes
generation dominate the cost of multi-turn training. `Latency` stands in for it: the environment
that holds one sleeps a drawn time in each `step`, in the worker thread that runs the step.

A draw is a pure function of the latency's seed, the episode's seed, the turn and the episode's
turns so far (their text), never of the order the workers run steps in: the same episode waits
the same times in every run, whatever the threads do. Rows of a group that play the same turns
wait the same times (the same request, the same cost).
"""

from __future__ import annotations

import math
import time
import zlib
from dataclasses import dataclass
from typing import Any, Literal, Mapping, Optional

import numpy as np

DISTRIBUTIONS = ("constant", "lognormal")
# The normal quantile the timeout check reads: a lognormal step longer than step_timeout_s must be rarer than this.
TAIL_Z = 3.719  # 1 - 1e-4


@dataclass(frozen=True)
class Latency:
    """`constant`: `median_s` every step. `lognormal`: exp(N(log median_s, sigma^2)) seconds, whose
    median is `median_s` and mean `median_s * exp(sigma^2 / 2)`."""

    distribution: Literal["constant", "lognormal"] = "lognormal"
    median_s: float = 0.05
    sigma: float = 0.5
    seed: int = 0

    def __post_init__(self):
        if self.distribution not in DISTRIBUTIONS:
            raise ValueError(f"latency.distribution: {self.distribution!r} is not one of {', '.join(DISTRIBUTIONS)}")
        if not (isinstance(self.median_s, (int, float)) and math.isfinite(self.median_s) and self.median_s > 0):
            raise ValueError(f"latency.median_s: must be a positive number of seconds (got {self.median_s!r})")
        if not (isinstance(self.sigma, (int, float)) and math.isfinite(self.sigma) and 0 <= self.sigma <= 3):
            raise ValueError(f"latency.sigma: must be in [0, 3] (got {self.sigma!r})")
        if not (isinstance(self.seed, int) and self.seed >= 0):
            raise ValueError(f"latency.seed: must be a non-negative integer (got {self.seed!r})")

    @classmethod
    def from_options(cls, options: Optional[Mapping[str, Any]]) -> Optional["Latency"]:
        """The `latency` option of an environment (a mapping of this class's fields), or None."""
        if options is None:
            return None
        if not isinstance(options, Mapping):
            raise ValueError(f"latency: must be a mapping of distribution, median_s, sigma, seed (got {options!r})")
        unknown = set(options) - {"distribution", "median_s", "sigma", "seed"}
        if unknown:
            raise ValueError(f"latency: unknown keys {sorted(unknown)} (distribution, median_s, sigma, seed)")
        return cls(**dict(options))

    def quantile(self, z: float) -> float:
        """Seconds at the standard normal quantile `z` (the median at 0)."""
        return self.median_s * (math.exp(self.sigma * z) if self.distribution == "lognormal" else 1.0)

    def draw(self, episode_seed: int, turn: int, history: str = "") -> float:
        """The seconds step `turn` of the episode reset with `episode_seed` takes, after the turns `history`."""
        if self.distribution == "constant":
            return float(self.median_s)
        rng = np.random.default_rng([self.seed, int(episode_seed) % 2**63, int(turn), zlib.crc32(history.encode())])
        return float(self.median_s * math.exp(self.sigma * rng.standard_normal()))

    def wait(self, episode_seed: int, turn: int, history: str = "") -> float:
        """Sleeps the drawn time (in the calling worker thread); returns it."""
        seconds = self.draw(episode_seed, turn, history)
        time.sleep(seconds)
        return seconds
