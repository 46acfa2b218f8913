"""Whether on-policy used up its training pool: the "exhausted" rule a sweep file declares
before any run (issue 49), and on-policy's training reward beside its accuracy.

A sweep file's `regime` names the on-policy setting and the rule:

    regime:
      setting: on_policy_p512     # the on-policy arm on the small pool
      evaluations: 3              # mean of the last 3 validation evaluations ...
      plateau: 0.01               # ... at most this much above the mean of the 3 around half the budget
      reward_window: 10           # mean training reward over this many logged steps ...
      reward_rise: 0.1            # ... rising at least this much from half the budget to the end
      statistic: median           # over seeds: median (default) or mean

Per seed: the validation gain = mean of the last `evaluations` validation evaluations minus the
mean of the `evaluations` nearest half the run's generated tokens; the reward rise = mean
`reward_mean` (the fresh rollouts' training reward) over the last `reward_window` logged steps
minus over the `reward_window` logged steps nearest half the budget. The rule is met where the
statistic over seeds of the gain is at most `plateau` while that of the rise is at least
`reward_rise`: accuracy on held-out problems has stopped moving while the reward on the pool's
still climbs. Claims marked `regime: true` are decided only where it is met; elsewhere their
verdict is "regime not reached", with these numbers. Nothing is re-run to make it so.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional, Sequence

import numpy as np

from jaxreplay.config import ConfigError, did_you_mean, show
from jaxreplay.research.report_data import RunData, Setting
from jaxreplay.research.report_stats import cell, fmt
from jaxreplay.train.eval import TEST_KEY, VALIDATION_KEY

REGIME_FILE = "regime.yaml"  # beside a sweep's setting folders: the exhaustion rule its sweep file declared
REWARD_KEY = "reward_mean"  # the training reward of the fresh rollouts (metric_keys)
BUDGET_SHARES = (0.25, 0.5, 0.75, 1.0)  # where the reward table reads each run, as shares of its generated tokens
_KEYS = {"setting", "evaluations", "plateau", "reward_window", "reward_rise", "statistic"}
_STATISTICS = {"median": np.median, "mean": np.mean}


@dataclasses.dataclass(frozen=True)
class Regime:
    setting: str
    evaluations: int = 3
    plateau: float = 0.01
    reward_window: int = 10
    reward_rise: float = 0.1
    statistic: str = "median"

    def describe(self) -> str:
        return (f"over the {self.statistic} of {self.setting}'s seeds, the mean of its last {self.evaluations} "
                f"validation evaluations at most {self.plateau:g} above the mean of the {self.evaluations} nearest "
                f"half its generated tokens, while its training reward (mean over {self.reward_window} logged steps) "
                f"rises by at least {self.reward_rise:g} from half the budget to the end")

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def parse_regime(raw: Any, where: str = "sweep.regime") -> Optional[Regime]:
    """The sweep file's exhaustion rule (None: none declared); `ConfigError` names the bad key."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a mapping with keys {', '.join(sorted(_KEYS))}, got {show(raw)}")
    unknown = sorted(set(raw) - _KEYS, key=str)
    if unknown:
        guess = did_you_mean(str(unknown[0]), _KEYS)
        raise ConfigError(f"{where}: unknown key {unknown[0]} (" + (f"did you mean {guess}?" if guess else
                                                                    f"known: {', '.join(sorted(_KEYS))}") + ")")
    if not isinstance(raw.get("setting"), str):
        raise ConfigError(f"{where}.setting: the on-policy setting whose pool the rule reads, got "
                          f"{show(raw.get('setting'))}")
    values = {}
    for key, kind, ok in (("evaluations", int, lambda v: v >= 1), ("reward_window", int, lambda v: v >= 1),
                          ("plateau", float, math.isfinite), ("reward_rise", float, math.isfinite)):
        if key in raw:
            v = raw[key]
            good = isinstance(v, int if kind is int else (int, float)) and not isinstance(v, bool) and ok(v)
            if not good:
                what = "positive integer" if kind is int else "finite number"
                raise ConfigError(f"{where}.{key}: expected a {what}, got {show(v)}")
            values[key] = kind(v)
    statistic = raw.get("statistic", "median")
    if statistic not in _STATISTICS:
        raise ConfigError(f"{where}.statistic: {show(statistic)} is not one of {', '.join(_STATISTICS)}")
    return Regime(setting=raw["setting"], statistic=statistic, **values)


def _nearest(x: np.ndarray, at: float, n: int) -> np.ndarray:
    """Indices of the `n` entries of `x` nearest `at` (ties to the earlier)."""
    return np.argsort(np.abs(x - at), kind="stable")[:n]


def seed_numbers(run: RunData, regime: Regime) -> Optional[tuple[float, float]]:
    """(validation gain, reward rise) of one run, as the module's docstring defines them; None where the
    run lacks the evaluations, the logged reward or the generated-token counter they need."""
    steps, val = run.series(VALIDATION_KEY)
    rsteps, reward = run.series(REWARD_KEY)
    n, w = regime.evaluations, regime.reward_window
    if len(val) < 2 * n or len(reward) < 2 * w:
        return None
    x, rx = run.x("tokens", steps), run.x("tokens", rsteps)
    if not (np.isfinite(x).all() and np.isfinite(rx).all()):
        return None
    half = float(max(x[-1], rx[-1])) / 2
    gain = float(np.mean(val[-n:]) - np.mean(val[_nearest(x, half, n)]))
    rise = float(np.mean(reward[-w:]) - np.mean(reward[_nearest(rx, half, w)]))
    return gain, rise


@dataclasses.dataclass(frozen=True)
class RegimeResult:
    regime: Regime
    seeds: int  # seeds whose runs had what the rule reads
    gain: float  # the statistic over seeds of the validation gain (nan: no seed)
    rise: float  # the statistic over seeds of the reward rise
    per_seed: tuple[tuple[Any, float, float], ...] = ()  # (seed, validation gain, reward rise) of each such run

    @property
    def met(self) -> bool:
        return self.seeds > 0 and self.gain <= self.regime.plateau and self.rise >= self.regime.reward_rise

    def seed_counts(self) -> str:
        """How many seeds meet each half of the rule, and both: the picture under the statistic the rule reads."""
        r, n = self.regime, len(self.per_seed)
        flat = [s for s, g, _ in self.per_seed if g <= r.plateau]
        rising = [s for s, _, rise in self.per_seed if rise >= r.reward_rise]
        both = [s for s in flat if s in rising]
        return (f"Per seed (the rule reads the {r.statistic}, and stays as declared): the validation gain is at most "
                f"{r.plateau:g} in {len(flat)} of {n} seeds, the reward rise at least {r.reward_rise:g} in "
                f"{len(rising)} of {n}, both in {len(both)} of {n}"
                + (f" (seeds {', '.join(map(str, both))})" if 0 < len(both) < n else "") + ".")

    def seed_rows(self) -> tuple[list[str], list[list[str]]]:
        """One row per seed: its validation gain and reward rise, and which half of the rule each meets."""
        r = self.regime
        header = ["seed", "validation gain (last − half)", f"at most {r.plateau:g}",
                  "training reward rise (end − half)", f"at least {r.reward_rise:g}", "both"]
        yes = lambda ok: "yes" if ok else "no"  # noqa: E731
        return header, [[str(s), fmt(g), yes(g <= r.plateau), fmt(rise), yes(rise >= r.reward_rise),
                         yes(g <= r.plateau and rise >= r.reward_rise)] for s, g, rise in self.per_seed]

    def numbers(self) -> str:
        r = self.regime
        if not self.seeds:
            return f"no run of {r.setting} logged {r.evaluations * 2} validation evaluations and {REWARD_KEY}"
        return (f"{r.setting}'s validation rose {fmt(self.gain)} from half the budget to the end "
                f"({'at most' if self.gain <= r.plateau else 'more than'} {r.plateau:g}) while its training reward "
                f"rose {fmt(self.rise)} ({'at least' if self.rise >= r.reward_rise else 'less than'} "
                f"{r.reward_rise:g}); {r.statistic} over {self.seeds} seeds")


def decide(regime: Regime, settings: Sequence[Setting]) -> RegimeResult:
    by_name = {s.name: s for s in settings}
    if regime.setting not in by_name:
        raise ConfigError(f"regime.setting: {regime.setting} is not one of the settings "
                          f"({', '.join(by_name)})")
    per_seed = tuple((r.seed, *v) for r in by_name[regime.setting].runs if (v := seed_numbers(r, regime)) is not None)
    stat = _STATISTICS[regime.statistic]
    if not per_seed:
        return RegimeResult(regime, 0, math.nan, math.nan)
    return RegimeResult(regime, len(per_seed), float(stat([g for _, g, _ in per_seed])),
                        float(stat([r for _, _, r in per_seed])), per_seed)


def reward_rows(settings: Sequence[Setting]) -> Optional[tuple[list[str], list[list[str]]]]:
    """Per on-policy setting: test accuracy and training reward at shares of each run's generated
    tokens (each series interpolated linearly), median [IQR] over seeds; None without one."""
    chosen = [s for s in settings if s.on_policy]
    if not chosen:
        return None
    header = ["setting", *[f"{what} at {f:.0%} of its tokens" for f in BUDGET_SHARES
                           for what in ("test accuracy", "training reward")]]
    rows = []
    for s in chosen:
        cells: list[list[float]] = [[] for _ in range(2 * len(BUDGET_SHARES))]
        for run in s.runs:
            for j, key in enumerate((TEST_KEY, REWARD_KEY)):
                steps, values = run.series(key)
                if not len(values):
                    continue
                x = run.x("tokens", steps)
                end = float(run.x("tokens", [int(run.records[-1]["step"])])[0])
                if not (np.isfinite(x).all() and math.isfinite(end)):
                    continue
                for i, f in enumerate(BUDGET_SHARES):
                    cells[2 * i + j].append(float(np.interp(f * end, x, values)))
        rows.append([s.name, *[cell(c) for c in cells]])
    return header, rows
