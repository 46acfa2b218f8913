"""Seed statistics for `jaxreplay report`: median and IQR over seeds, curves on a common grid.

Settings are compared by the median over seeds with the interquartile range (25th
to 75th percentile, numpy's default linear interpolation between seeds), as the
paper reports them: robust to the one diverging seed a mean and a min-max band
would follow. Seeds evaluate at different x (tokens, compute, seconds differ per
seed), so a band first interpolates each seed's curve linearly onto one grid: every
seed's x inside the range all seeds cover (no extrapolation).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Sequence

import numpy as np

from jaxreplay.config import ConfigError

Curve = tuple[np.ndarray, np.ndarray]  # (x, y), x non-decreasing


def quartiles(values: Sequence[float]) -> tuple[float, float, float]:
    """(25th percentile, median, 75th percentile) of `values`."""
    q1, med, q3 = np.percentile(np.asarray(values, np.float64), [25, 50, 75])
    return float(q1), float(med), float(q3)


def fmt(value: float) -> str:
    """Three significant digits; float noise around zero prints as 0."""
    return "0" if abs(value) < 1e-12 else f"{value:.3g}"


def cell(values: Sequence[float]) -> str:
    """'median [q25, q75]' over seeds; one value alone; 'n/a' for none."""
    values = [v for v in values if v is not None and math.isfinite(v)]
    if not values:
        return "n/a"
    if len(values) == 1:
        return fmt(values[0])
    q1, med, q3 = quartiles(values)
    return f"{fmt(med)} [{fmt(q1)}, {fmt(q3)}]"


def clean(x: np.ndarray, y: np.ndarray) -> Curve:
    """Finite points only, and one point per x (the last), so `np.interp` sees increasing x."""
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    keep = np.isfinite(x) & np.isfinite(y)
    x, y = x[keep], y[keep]
    last = np.r_[x[1:] != x[:-1], True] if len(x) else np.zeros(0, bool)
    return x[last], y[last]


def common_grid(curves: Sequence[Curve]) -> np.ndarray:
    """Every curve's x inside [the largest first x, the smallest last x]: the range all curves cover."""
    curves = [c for c in curves if len(c[0])]
    if not curves:
        return np.zeros(0)
    lo, hi = max(c[0][0] for c in curves), min(c[0][-1] for c in curves)
    grid = np.unique(np.concatenate([c[0] for c in curves]))
    return grid[(grid >= lo) & (grid <= hi)]


def band(curves: Sequence[Curve]) -> Optional[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
    """(grid, q25, median, q75) of the curves interpolated onto their common grid; None if empty."""
    curves = [clean(*c) for c in curves]
    curves = [c for c in curves if len(c[0])]
    grid = common_grid(curves)
    if not len(grid):
        return None
    ys = np.array([np.interp(grid, x, y) for x, y in curves])
    q1, med, q3 = np.percentile(ys, [25, 50, 75], axis=0)
    return grid, q1, med, q3


def largest_fall(acc: Sequence[float]) -> float:
    """The largest drop of accuracy below an earlier evaluation's (max drawdown): 0 if it never fell."""
    acc = np.asarray(acc, np.float64)
    return float(np.max(np.maximum.accumulate(acc) - acc)) if len(acc) else math.nan


def first_reach(x: np.ndarray, acc: np.ndarray, target: float) -> Optional[float]:
    """x at the first evaluation with accuracy >= target; None if none does."""
    hit = np.nonzero(np.asarray(acc) >= target - 1e-12)[0]
    return float(np.asarray(x)[hit[0]]) if len(hit) else None


def parse_mus(text: Optional[str]) -> tuple[float, ...]:
    """`--mu 5.28,6.84`: positive finite numbers, or ConfigError naming the bad one."""
    if text is None:
        return ()
    mus = []
    for part in text.split(","):
        try:
            mu = float(part)
        except ValueError:
            raise ConfigError(f"--mu: {part.strip()!r} is not a number (expected e.g. --mu 5.28,6.84)") from None
        if not (math.isfinite(mu) and mu > 0):
            raise ConfigError(f"--mu must be a positive finite number, got {part.strip()}")
        mus.append(mu)
    return tuple(mus)


# -- rliable's aggregates (Agarwal et al., 2021): IQM and a stratified percentile bootstrap ------
BOOTSTRAP_REPS = 10_000
BOOTSTRAP_SEED = 0  # fixed: the same runs give the same intervals, so a rebuilt report is byte-identical


def quantile(values: Sequence[float], q: float) -> float:
    """numpy's linear quantile, except that +inf values stay +inf instead of turning into nan
    (a run that never reached a target is +inf: above every run that did)."""
    v = np.sort(np.asarray(values, np.float64))
    pos = q * (len(v) - 1)
    lo, frac = int(math.floor(pos)), pos - math.floor(pos)
    if frac == 0 or v[lo] == v[min(lo + 1, len(v) - 1)]:
        return float(v[lo])
    hi = v[lo + 1]
    return math.inf if math.isinf(hi) else float(v[lo] + (hi - v[lo]) * frac)


def iqm(values: Sequence[float]) -> float:
    """Interquartile mean: the mean of the values left after cutting floor(n/4) from each end
    (scipy.stats.trim_mean(x, 0.25), as rliable computes it); +inf if an +inf survives the cut."""
    v = np.sort(np.asarray(values, np.float64))
    cut = int(0.25 * len(v))
    return float(np.mean(v[cut:len(v) - cut]))


def _iqm_rows(samples: np.ndarray) -> np.ndarray:
    """`iqm` of every row of a [reps, n] array."""
    s = np.sort(samples, axis=1)
    cut = int(0.25 * s.shape[1])
    return s[:, cut:s.shape[1] - cut].mean(axis=1)


MC_Z = 1.96  # the Monte Carlo range of a CI end: 95% over bootstrap streams
MC_SHARE = 0.1  # a claim's interval is redrawn with more replicates until each end's Monte Carlo error is ...
MAX_REPS = 640_000  # ... at most this share of its distance to the threshold, or until this many replicates


@dataclasses.dataclass(frozen=True)
class Interval:
    """A percentile bootstrap interval, and how far the bootstrap's own random stream moves each end.

    `lo_range` and `hi_range` bracket the quantile that infinitely many replicates would give, with 95%
    probability over the random stream: with R replicates the number below that quantile is
    Binomial(R, q), so it lies between the order statistics R·q ∓ 1.96·sqrt(R·q·(1 − q)) (the
    distribution-free confidence interval of a quantile). They need no second bootstrap."""
    lo: float
    hi: float
    lo_range: tuple[float, float]
    hi_range: tuple[float, float]
    reps: int = BOOTSTRAP_REPS

    @property
    def lo_error(self) -> float:
        return _error(self.lo, self.lo_range)

    @property
    def hi_error(self) -> float:
        return _error(self.hi, self.hi_range)

    def settled(self, threshold: float) -> bool:
        """Whether each end's Monte Carlo error is at most MC_SHARE of its distance to `threshold` (or 0)."""
        return all(error == 0 or (math.isfinite(error) and error <= MC_SHARE * abs(end - threshold))
                   for end, error in ((self.lo, self.lo_error), (self.hi, self.hi_error)))


def _error(end: float, bracket: tuple[float, float]) -> float:
    """The Monte Carlo error of a CI end: the farther of its bracket's two ends from it (0 if all agree)."""
    a, b = bracket
    if a == end == b:
        return 0.0
    return max(end - a, b - end) if math.isfinite(a) and math.isfinite(b) else math.inf


def _order_statistic_range(stats: np.ndarray, q: float, z: float = MC_Z) -> tuple[float, float]:
    """Of sorted replicates: the order statistics around the q-quantile that bracket its infinite-replicate
    value with the probability of ±z (see `Interval`)."""
    reps = len(stats)
    centre, half = q * (reps - 1), z * math.sqrt(reps * q * (1 - q))
    return float(stats[max(0, math.floor(centre - half))]), float(stats[min(reps - 1, math.ceil(centre + half))])


def _replicates(strata: Sequence[Sequence[float]], chunk: int, seed: int):
    """IQMs of successive chunks of stratified bootstrap replicates, all from one `default_rng(seed)` stream:
    the first chunk is what `chunk` replicates alone would give."""
    rng = np.random.default_rng(seed)
    values = [np.asarray(v, np.float64) for v in strata]
    while True:
        yield _iqm_rows(np.concatenate([v[rng.integers(0, len(v), size=(chunk, len(v)))] for v in values], axis=1))


def bootstrap_interval(strata: Sequence[Sequence[float]], reps: int = BOOTSTRAP_REPS, size: float = 0.95,
                       seed: int = BOOTSTRAP_SEED, threshold: Optional[float] = None,
                       max_reps: int = MAX_REPS) -> Interval:
    """95% percentile interval of the IQM under a stratified bootstrap: each replicate redraws
    every stratum's values with replacement (within the stratum; rliable's strata are tasks, here
    settings pooled into one claim) and takes the IQM of them all together. Replicates draw their
    indices from `np.random.default_rng(seed)` stratum by stratum, `integers(0, n, (reps, n))`.
    With each end, its range over bootstrap streams (`Interval`). Given a claim's `threshold`, the stream
    goes on, four times the replicates at a time, until the interval is `settled` or has `max_reps`."""
    draws = _replicates(strata, reps, seed)
    stats = next(draws)
    while True:
        ordered = np.sort(stats)
        q_lo, q_hi = (1 - size) / 2, (1 + size) / 2
        ci = Interval(quantile(ordered, q_lo), quantile(ordered, q_hi), _order_statistic_range(ordered, q_lo),
                      _order_statistic_range(ordered, q_hi), len(stats))
        if threshold is None or len(stats) >= max_reps or ci.settled(threshold):
            return ci
        stats = np.concatenate([stats, *(next(draws) for _ in range(3 * len(stats) // reps))])


def bootstrap_ci(strata: Sequence[Sequence[float]], reps: int = BOOTSTRAP_REPS, size: float = 0.95,
                 seed: int = BOOTSTRAP_SEED) -> tuple[float, float]:
    """(lo, hi) of `bootstrap_interval`."""
    ci = bootstrap_interval(strata, reps, size, seed)
    return ci.lo, ci.hi


def fmt_value(value: float, censored: str = "> budget") -> str:
    """`fmt`, with +inf written as `censored` (a run that never reached its target)."""
    return censored if value == math.inf else fmt(value)


def summary_cell(values: Sequence[float], strata: Optional[Sequence[Sequence[float]]] = None,
                 censored: str = "> budget") -> str:
    """'median [q25, q75]; IQM m [lo, hi]' over seeds, +inf counted (right-censored); 'n/a' for none."""
    values = [float(v) for v in values if v is not None and not math.isnan(v)]
    if not values:
        return "n/a"
    if len(values) == 1:
        return fmt_value(values[0], censored)
    show = lambda v: fmt_value(v, censored)  # noqa: E731
    q1, med, q3 = (quantile(values, q) for q in (0.25, 0.5, 0.75))
    lo, hi = bootstrap_ci(strata if strata is not None else [values])
    return f"{show(med)} [{show(q1)}, {show(q3)}]; IQM {show(iqm(values))} [{show(lo)}, {show(hi)}]"
