"""Claims and the rules that decide them, declared in a sweep file before any run.

A sweep file's `claims` maps a name to a rule on a measure paired by seed with the
baseline (the report's `--baseline`, on-policy by default):

    claims:
      keeps_peak:
        text: moderate reuse (spi 2) keeps the peak
        settings: [spi2_nr2, spi2_nr8]   # pooled: the bootstrap resamples seeds within each
        measure: peak                    # peak | final | pass@K | {tokens,rollouts,compute,wallclock}_to_{50,75,90}
                                         # | final_at_compute | entropy_at_compute | final_at_wallclock
                                         # | entropy_at_wallclock | largest_fall
        above: -0.02                     # or below: 1.0
        mu: 5.28                         # the µ of the modelled compute: compute_to_*, *_at_compute
        ceiling: 0.98                    # optional: the baseline's median peak/final/pass@K/final_at_*
                                         # at or above it leaves no room to show the claim: "not testable here"

Accuracy measures are differences (setting minus the same seed's baseline run); cost
measures are ratios to the same seed's baseline, +inf where the run never reached the
target. At equal compute (`final_at_compute`, `entropy_at_compute`), each seed pair is read
at the smaller of the two runs' total modelled compute at µ: test accuracy at each run's
latest evaluation at or before it, or the mean of the logged `entropy` over the last 10
logged steps at or before it; `final_at_wallclock` and `entropy_at_wallclock` the same at the
smaller of the two runs' wall-clock seconds (compilation and evaluation left out, as the report's
wallclock axis). `largest_fall` is the largest drop of test accuracy below an earlier evaluation
(after the peak so far); "smaller with a buffer" is `below: 0`.

The verdict reads the IQM's 95% stratified bootstrap interval against the threshold:
wholly on the rule's side, "holds"; wholly on the other, "fails"; across it, "inconclusive".
A verdict must not depend on the bootstrap's random stream, so each end of the interval comes
with its Monte Carlo range (report_stats.Interval), the replicates are quadrupled (up to
report_stats.MAX_REPS) until each end's error is at most a tenth of its distance to the
threshold, and where the threshold still lies within an end's range the verdict is
"borderline", with the numbers and the verdicts another stream could give.

Three optional keys serve a study over two regimes (issue 49):

    regime_contrast:
      text: replay's edge at equal compute is larger where on-policy exhausted its pool
      settings: [spi4_nr16_p512]            # paired with `baseline`, seed by seed ...
      baseline: on_policy_p512              # this claim's baseline (default: the report's)
      contrast: {settings: [spi4_nr16_p2048], baseline: on_policy_p2048}   # ... minus the same there
      measure: final_at_compute
      mu: 5.28
      above: 0.0
      regime: true                          # decided only where the sweep's `regime` rule is met

`contrast` makes the claim a difference of paired differences, paired by seed: for each seed
that all four runs share, (setting − baseline) − (contrast setting − contrast baseline), the
i-th setting against the i-th contrast setting, one stratum each. With `above: 0` it holds if
the lower end of the IQM's 95% interval is above 0 and fails if its upper end is below 0.
`regime: true` leaves the verdict "regime not reached" (with the rule's numbers) where the
sweep's exhaustion rule (report_regime) is not met.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Optional

from jaxreplay.config import ConfigError, did_you_mean, show
from jaxreplay.research.report_stats import Interval, fmt

CLAIMS_FILE = "claims.yaml"  # beside a sweep's setting folders: the claims its sweep file declared
REPLICATION_FILE = "replication.yaml"  # beside a replication's setting folders (`jaxreplay sweep --replicate`)
TARGET_FRACTIONS = (0.5, 0.75, 0.9)  # targets: these shares of the same seed's baseline gain (peak - start)
_COST = re.compile(r"(tokens|rollouts|compute|wallclock)_to_(50|75|90)")
_PASS = re.compile(r"pass@([1-9][0-9]*)")
_KEYS = {"text", "settings", "measure", "above", "below", "mu", "ceiling", "baseline", "contrast", "regime"}
AT_COMPUTE = ("final_at_compute", "entropy_at_compute")  # paired at the smaller of the two runs' compute at µ
AT_WALLCLOCK = ("final_at_wallclock", "entropy_at_wallclock")  # ... at the smaller of their wall-clock seconds
NO_CEILING = ("entropy_at_compute", "entropy_at_wallclock", "largest_fall")  # none is an accuracy with a top


@dataclasses.dataclass(frozen=True)
class Claim:
    name: str
    text: str
    settings: tuple[str, ...]
    measure: str
    threshold: float
    above: bool  # the rule: IQM > threshold (else IQM < threshold)
    mu: Optional[float] = None
    ceiling: Optional[float] = None
    baseline: Optional[str] = None  # this claim's baseline setting (None: the report's)
    contrast: tuple[str, ...] = ()  # a regime contrast's other settings, paired with `settings` in order
    contrast_baseline: Optional[str] = None
    regime: bool = False  # decided only where the sweep's exhaustion rule is met

    @property
    def names(self) -> tuple[str, ...]:
        """Every setting the claim reads, baselines included."""
        return (*self.settings, *((self.baseline,) if self.baseline else ()), *self.contrast,
                *((self.contrast_baseline,) if self.contrast_baseline else ()))

    @property
    def cost(self) -> Optional[tuple[str, float]]:
        """(axis, target fraction) of a cost measure; None for an accuracy one."""
        m = _COST.fullmatch(self.measure)
        return (m.group(1), int(m.group(2)) / 100) if m else None

    def describe(self, baseline: str) -> str:
        baseline = self.baseline or baseline
        at = "" if self.mu is None else f", µ = {self.mu:g}"
        if self.contrast:
            side = ">" if self.above else "<"
            return (f"paired IQM of ({self.measure} − {baseline}'s) − (the same of {', '.join(self.contrast)} − "
                    f"{self.contrast_baseline}'s){' (' + at[2:] + ')' if at else ''} {side} {self.threshold:g}")
        what = (f"{self.measure} − {baseline}'s" + (f" ({at[2:]})" if self.measure in AT_COMPUTE and at else "")
                if self.cost is None else f"{self.measure} (× {baseline}'s{at})")
        side = ">" if self.above else "<"
        return f"paired IQM of {what} {side} {self.threshold:g}"


def _number(value: Any, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"{key}: expected a finite number, got {show(value)}")
    return float(value)


def parse_claims(raw: Any, where: str = "sweep.claims") -> tuple[Claim, ...]:
    """The claims of a sweep file (None: none); `ConfigError` names the bad key."""
    if raw is None:
        return ()
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a mapping of claim name -> rule, got {show(raw)}")
    claims = []
    for name, rule in raw.items():
        key = f"{where}.{name}"
        if not isinstance(rule, dict):
            raise ConfigError(f"{key}: expected a mapping with keys {', '.join(sorted(_KEYS))}")
        unknown = sorted(set(rule) - _KEYS, key=str)
        if unknown:
            guess = did_you_mean(str(unknown[0]), _KEYS)
            raise ConfigError(f"{key}: unknown key {unknown[0]} (" + (f"did you mean {guess}?" if guess else
                                                                       f"known: {', '.join(sorted(_KEYS))}") + ")")
        settings = rule.get("settings")
        if not (isinstance(settings, list) and settings and all(isinstance(s, str) for s in settings)):
            raise ConfigError(f"{key}.settings: expected a non-empty list of setting names, got {show(settings)}")
        measure = rule.get("measure")
        named = ("peak", "final", "largest_fall", *AT_COMPUTE, *AT_WALLCLOCK)
        if not isinstance(measure, str) or not (measure in named or _PASS.fullmatch(measure)
                                                or _COST.fullmatch(measure)):
            raise ConfigError(f"{key}.measure: {show(measure)} is not peak, final, pass@K, "
                              "{tokens,rollouts,compute,wallclock}_to_{50,75,90}, final_at_compute, "
                              "entropy_at_compute, final_at_wallclock, entropy_at_wallclock or largest_fall")
        if ("above" in rule) == ("below" in rule):
            raise ConfigError(f"{key}: give exactly one of above and below (the rule's threshold)")
        side = "above" if "above" in rule else "below"
        mu = None if rule.get("mu") is None else _number(rule["mu"], f"{key}.mu")
        if (measure.startswith("compute_to_") or measure in AT_COMPUTE) and (mu is None or mu <= 0):
            raise ConfigError(f"{key}.mu: {measure} needs the positive µ its compute is modelled at")
        ceiling = None if rule.get("ceiling") is None else _number(rule["ceiling"], f"{key}.ceiling")
        if ceiling is not None and measure in NO_CEILING:
            raise ConfigError(f"{key}.ceiling: {measure} has no ceiling (a ceiling applies to peak, final, pass@K "
                              "and final_at_compute)")
        baseline = rule.get("baseline")
        if baseline is not None and not isinstance(baseline, str):
            raise ConfigError(f"{key}.baseline: expected a setting name, got {show(baseline)}")
        contrast, contrast_baseline = (), None
        if rule.get("contrast") is not None:
            raw = rule["contrast"]
            if not (isinstance(raw, dict) and set(raw) == {"settings", "baseline"} and isinstance(raw["baseline"], str)
                    and isinstance(raw["settings"], list) and all(isinstance(v, str) for v in raw["settings"])
                    and len(raw["settings"]) == len(settings)):
                raise ConfigError(f"{key}.contrast: expected {{settings: [...], baseline: NAME}} with as many settings "
                                  f"as {key}.settings ({len(settings)}), got {show(raw)}")
            if _COST.fullmatch(measure):
                raise ConfigError(f"{key}.contrast: a difference of paired differences needs an accuracy-like measure, "
                                  f"not the cost ratio {measure}")
            if ceiling is not None:
                raise ConfigError(f"{key}.ceiling: a contrast has no ceiling")
            contrast, contrast_baseline = tuple(raw["settings"]), raw["baseline"]
        regime = rule.get("regime", False)
        if not isinstance(regime, bool):
            raise ConfigError(f"{key}.regime: expected true or false, got {show(regime)}")
        claims.append(Claim(name=str(name), text=str(rule.get("text", name)), settings=tuple(settings),
                            measure=measure, threshold=_number(rule[side], f"{key}.{side}"), above=side == "above",
                            mu=mu, ceiling=ceiling, baseline=baseline, contrast=contrast,
                            contrast_baseline=contrast_baseline, regime=regime))
    return tuple(claims)


def verdict(claim: Claim, ci: Interval) -> str:
    """'holds', 'fails' or 'inconclusive' from where the IQM's interval lies against the threshold;
    'borderline' where the bootstrap's own random stream could move an end across it (`borderline`)."""
    if near := borderline(claim, ci):
        return near
    t = claim.threshold
    if (ci.lo > t) if claim.above else (ci.hi < t):
        return "holds"
    if (ci.hi < t) if claim.above else (ci.lo > t):
        return "fails"
    return "inconclusive"


def borderline(claim: Claim, ci: Interval) -> str:
    """The verdict 'borderline: ...' with the numbers, where the threshold lies within the Monte Carlo range
    of an end of the interval (report_stats.Interval: the range of that end over bootstrap streams), so that
    another stream could decide otherwise; '' where neither end is that near."""
    t = claim.threshold
    ends = [(name, end, bracket, error) for name, end, bracket, error in
            (("lower", ci.lo, ci.lo_range, ci.lo_error), ("upper", ci.hi, ci.hi_range, ci.hi_error))
            if bracket[0] < bracket[1] and bracket[0] <= t <= bracket[1]]
    if not ends:
        return ""
    outcomes = {"inconclusive"}
    for name, *_ in ends:
        outcomes.add("holds" if (name == "lower") == claim.above else "fails")
    said = "; ".join(f"the interval's {name} end, {fmt(end)}, is within its Monte Carlo error (±{fmt(error)}, "
                     f"range {fmt(bracket[0])} to {fmt(bracket[1])}) of the threshold {t:g}"
                     for name, end, bracket, error in ends)
    order = [o for o in ("holds", "inconclusive", "fails") if o in outcomes]
    return f"borderline: {said}; another bootstrap stream can give {' or '.join(order)}"
