"""The optimality frontier of a stage-2 report: test accuracy against modelled compute at µ,
each arm at its chosen learning rate and the best over the stage-1 grid (the paper's
"optimality" curves).

- At its chosen rate: the arm's stage-2 runs, each seed's curve (modelled compute at µ of each
  evaluation, test accuracy) interpolated linearly onto their common grid, median with the IQR
  (report_stats.band), as every other accuracy plot.
- Best over the grid: for each stage-1 learning rate of the arm (the stage-1 setting ARM.lrLR,
  report_select), the median curve of its seeds made the same way; at each x, the highest of
  those medians (the pointwise max over rates), only where every rate's median reaches x. Rates
  end at slightly different compute (completions differ in length); past the shortest, a max over
  the rates still running would pick whichever runs longest, a collapsed rate at the very end.
- The table reads both at 25, 50 and 100% of the common budget: the least modelled compute any
  of those curves reaches (a stage-2 run's last evaluation, a stage-1 rate's median). A stage-2 setting is matched to the stage-1 arm of
  the same name; one without is "n/a" on the best-over-grid side.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Optional, Sequence

import numpy as np

from jaxreplay.research.report_data import RunData, Setting
from jaxreplay.research.report_select import learning_rate, lr_tag
from jaxreplay.research.report_stats import Curve, band, cell, clean, fmt

FRACTIONS = (0.25, 0.5, 1.0)  # the frontier table's shares of the common modelled-compute budget


def run_curve(run: RunData, mu: float) -> Curve:
    """(modelled compute at µ, test accuracy) at each of the run's evaluations."""
    steps, acc = run.evals()
    return clean(run.x("compute", steps, mu), acc)


@dataclasses.dataclass
class ArmFrontier:
    name: str
    learning_rate: Optional[float]  # the stage-2 runs' own (stage 1's choice, checked by the sweep)
    runs: list[Curve]  # the stage-2 runs' curves
    medians: dict[float, Curve]  # stage-1 learning rate -> the median curve of its seeds

    def chosen(self) -> Optional[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
        return band(self.runs)

    def at(self, x: float) -> list[float]:
        """Each stage-2 run's accuracy at `x`, interpolated linearly."""
        return [float(np.interp(x, cx, cy)) for cx, cy in self.runs if len(cx) and cx[0] <= x <= cx[-1]]

    def best(self, x: float) -> Optional[tuple[float, float]]:
        """(the highest stage-1 median at `x`, its learning rate); None unless every rate's median reaches `x`."""
        if not self.medians or not all(gx[0] <= x <= gx[-1] for gx, _ in self.medians.values()):
            return None
        values = [(float(np.interp(x, gx, gy)), lr) for lr, (gx, gy) in self.medians.items()]
        return max(values, key=lambda v: (v[0], -v[1]))

    def envelope(self) -> Optional[Curve]:
        """The best over the grid at every x of the rates' median curves."""
        if not self.medians:
            return None
        xs = np.unique(np.concatenate([gx for gx, _ in self.medians.values()]))
        points = [(x, b[0]) for x in xs if (b := self.best(float(x))) is not None]
        return np.array([p[0] for p in points]), np.array([p[1] for p in points])


def frontier(settings: Sequence[Setting], grid: Mapping[str, Mapping[float, Setting]], mu: float) -> list[ArmFrontier]:
    """One ArmFrontier per stage-2 setting, its best-over-grid from the stage-1 arm of the same name."""
    arms = []
    for s in settings:
        medians = {}
        for lr, stage1 in grid.get(s.name, {}).items():
            b = band([run_curve(r, mu) for r in stage1.runs])
            if b is not None:
                medians[lr] = (b[0], b[2])
        arms.append(ArmFrontier(name=s.name, learning_rate=learning_rate(s), runs=[run_curve(r, mu) for r in s.runs],
                                medians=medians))
    return arms


def budget(arms: Sequence[ArmFrontier]) -> float:
    """The common budget: the least modelled compute any curve of the frontier reaches, a stage-2 run's
    last evaluation or a stage-1 rate's median, so that every cell of the table at 100% has a value."""
    ends = [float(cx[-1]) for a in arms for cx, _ in a.runs if len(cx)]
    return min(ends + [float(gx[-1]) for a in arms for gx, _ in a.medians.values()])


def rows(arms: Sequence[ArmFrontier], common: float) -> tuple[list[str], list[list[str]]]:
    """(header, rows) of the frontier table: per arm, test accuracy at each share of `common`."""
    header = ["arm", "learning rate (chosen)", "seeds"]
    for f in FRACTIONS:
        header += [f"at {f:.0%} of {fmt(common)}: chosen lr", f"at {f:.0%}: best over the grid (its lr)"]
    out = []
    for a in arms:
        row = [a.name, "n/a" if a.learning_rate is None else lr_tag(a.learning_rate), str(len(a.runs))]
        for f in FRACTIONS:
            best = a.best(f * common)
            row += [cell(a.at(f * common)), "n/a" if best is None else f"{fmt(best[0])} ({lr_tag(best[1])})"]
        out.append(row)
    return header, out
