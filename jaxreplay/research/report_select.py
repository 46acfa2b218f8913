"""Stage 1: the rule that picks each arm's learning rate, read from the validation split only.

A stage-1 sweep file (sweep.py) runs every setting (an *arm*) at each of its `learning_rates`,
in run dirs OUT/ARM.lrLR/seedS (LR written by `lr_tag`: 1e-4, 3e-4, 1e-3), and declares
before any run the rule that picks each arm's rate:

    learning_rates: [1e-4, 3e-4, 1e-3]
    select:
      measure: validation_peak     # validation_peak | validation_final | validation_mean
      statistic: median            # median | mean | iqm: over the stage's seeds
      ties: lower_lr               # (the default and the only tie rule) equal statistics: the lower rate

Per run, the measure reads `eval/validation_accuracy` at every evaluation and nothing else:
its best value (validation_peak), its last (validation_final), or its mean over the
evaluations (validation_mean: the area under the curve per evaluation). The statistic over an
(arm, rate)'s seeds is compared across the arm's rates; the highest wins. Test-split numbers
never reach the rule: `validation_scores` is the only reader of runs it has, it reads one
series, and a run without that series is an error naming the run.

An arm and its rate come from the runs' config.yaml: runs of one arm differ only in
`train.learning_rate` (besides what `report_data.NOT_A_SETTING` ignores), and the rate is
the config's; the folder name ARM.lrLR names the arm and must agree with both.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import numpy as np
import yaml

from jaxreplay.config import ConfigError, did_you_mean, show
from jaxreplay.research.report_data import NOT_A_SETTING, RunData, Setting, declared, setting_key
from jaxreplay.research.report_stats import cell, fmt, iqm
from jaxreplay.train.eval import VALIDATION_KEY

SELECT_FILE = "select.yaml"  # beside a stage-1 sweep's setting folders: the rule its sweep file declared
SELECTED_FILE = "selected.yaml"  # in a stage-1 report's folder: arm -> the learning rate the rule chose
MEASURES = ("validation_peak", "validation_final", "validation_mean")
STATISTICS = ("median", "mean", "iqm")
TIES = ("lower_lr",)
_KEYS = ("measure", "statistic", "ties")
_LR_SEP = ".lr"  # run dirs of stage 1: OUT/ARM.lrLR/seedS


@dataclasses.dataclass(frozen=True)
class Rule:
    measure: str
    statistic: str
    ties: str = "lower_lr"

    def as_dict(self) -> dict[str, str]:
        return {"measure": self.measure, "statistic": self.statistic, "ties": self.ties}

    def describe(self) -> str:
        what = {"validation_peak": "best validation accuracy", "validation_final": "last validation accuracy",
                "validation_mean": "mean validation accuracy over the evaluations"}[self.measure]
        return (f"the learning rate with the highest {self.statistic} over seeds of each run's {what} "
                f"(`{self.measure}`); ties go to the lower rate")


def parse_rule(raw: Any, where: str = "sweep.select") -> Optional[Rule]:
    """The `select` mapping of a sweep file (None: none); `ConfigError` names the bad key."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a mapping like {{measure: validation_peak, statistic: median}}, "
                          f"got {show(raw)}")
    unknown = sorted((str(k) for k in set(raw) - set(_KEYS)))
    if unknown:
        guess = did_you_mean(unknown[0], _KEYS)
        raise ConfigError(f"{where}: unknown key {unknown[0]} (" + (f"did you mean {guess}?" if guess else
                                                                     f"known: {', '.join(_KEYS)}") + ")")
    for key, allowed in (("measure", MEASURES), ("statistic", STATISTICS)):
        if raw.get(key) not in allowed:
            raise ConfigError(f"{where}.{key}: {show(raw.get(key))} is not one of {', '.join(allowed)}")
    ties = raw.get("ties", TIES[0])
    if ties not in TIES:
        raise ConfigError(f"{where}.ties: {show(ties)} is not one of {', '.join(TIES)} (equal statistics pick the "
                          "lower learning rate)")
    return Rule(measure=raw["measure"], statistic=raw["statistic"], ties=ties)


def parse_learning_rate(value: Any, where: str) -> float:
    """A positive finite learning rate; YAML reads `1e-4` (no dot) as text, so numeric text counts."""
    try:
        lr = float(value) if isinstance(value, (int, float, str)) and not isinstance(value, bool) else math.nan
    except ValueError:
        lr = math.nan
    if not (math.isfinite(lr) and lr > 0):
        raise ConfigError(f"{where}: expected a positive learning rate like 3e-4, got {show(value)}")
    return lr


def lr_tag(lr: float) -> str:
    """A learning rate as a run dir writes it: 0.0003 -> '3e-4', 0.00025 -> '2.5e-4'."""
    mantissa, exponent = f"{lr:.6e}".split("e")
    return f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"


def setting_name(arm: str, lr: float) -> str:
    return f"{arm}{_LR_SEP}{lr_tag(lr)}"


# -- what the rule reads: the validation split, nothing else ------------------------------------
def validation_curve(run: RunData) -> np.ndarray:
    """`eval/validation_accuracy` at every evaluation of `run`; a run without it is an error naming it."""
    values = run.series(VALIDATION_KEY)[1]
    if not len(values):
        raise ConfigError(f"{run.dir}: no {VALIDATION_KEY} in metrics.jsonl; learning rates are chosen on the "
                          "validation split only (run with task.validation_size > 0)")
    return values


def run_measure(values: np.ndarray, measure: str) -> float:
    """One run's measure from its validation series."""
    return float({"validation_peak": np.max, "validation_final": lambda v: v[-1],
                  "validation_mean": np.mean}[measure](values))


def statistic(values: Sequence[float], name: str) -> float:
    return float({"median": np.median, "mean": np.mean, "iqm": iqm}[name](np.asarray(values, np.float64)))


Grid = Mapping[str, Mapping[float, Setting]]  # arm -> learning rate -> the setting (its seeds)


def validation_scores(grid: Grid, rule: Rule) -> dict[str, dict[float, list[float]]]:
    """arm -> learning rate -> each seed's measure: the rule's only input, read from the validation series."""
    return {arm: {lr: [run_measure(validation_curve(r), rule.measure) for r in s.runs] for lr, s in rates.items()}
            for arm, rates in grid.items()}


def choose(scores: Mapping[str, Mapping[float, Sequence[float]]], rule: Rule) -> dict[str, float]:
    """arm -> the learning rate whose statistic over seeds is highest; ties (equal to 1e-12) to the lower rate."""
    chosen = {}
    for arm, rates in scores.items():
        best, best_value = None, -math.inf
        for lr in sorted(rates):
            value = statistic(rates[lr], rule.statistic)
            if best is None or value > best_value + 1e-12:
                best, best_value = lr, value
        chosen[arm] = best
    return chosen


# -- arms and rates from the runs' configs ------------------------------------------------------
def split_name(name: str) -> tuple[str, Optional[str]]:
    """'on_policy.lr3e-4' -> ('on_policy', '3e-4'); a name without '.lr' -> (name, None)."""
    arm, sep, tag = name.rpartition(_LR_SEP)
    return (arm, tag) if sep and arm else (name, None)


def arm_grid(settings: Sequence[Setting]) -> dict[str, dict[float, Setting]]:
    """arm -> learning rate (ascending) -> setting, arms in the settings' order. The rate is each
    config's train.learning_rate; runs of one arm must differ in nothing else that counts."""
    grid: dict[str, dict[float, Setting]] = {}
    keys: dict[str, tuple[str, Setting]] = {}
    for s in settings:
        run = s.runs[0]
        lr = run.config.get("train", {}).get("learning_rate")
        if not isinstance(lr, (int, float)) or isinstance(lr, bool):
            raise ConfigError(f"{run.dir}: its config.yaml has no train.learning_rate")
        arm, tag = split_name(s.name)
        if tag is not None and tag != lr_tag(float(lr)):
            raise ConfigError(f"{run.dir}: the folder {s.name} says learning rate {tag}, its config.yaml says "
                              f"{lr_tag(float(lr))}")
        key = yaml.safe_dump(setting_key(run.config, (*NOT_A_SETTING, "train.learning_rate")), sort_keys=True)
        if arm in keys and keys[arm][0] != key:
            raise ConfigError(f"{run.dir}: runs of arm {arm} differ in more than train.learning_rate "
                              f"({keys[arm][1].name} and {s.name})")
        keys.setdefault(arm, (key, s))
        if float(lr) in grid.setdefault(arm, {}):
            raise ConfigError(f"{run.dir}: arm {arm} has two folders at learning rate {lr_tag(float(lr))}")
        grid[arm][float(lr)] = s
    return {arm: dict(sorted(rates.items())) for arm, rates in grid.items()}


def learning_rate(setting: Setting) -> Optional[float]:
    lr = setting.runs[0].config.get("train", {}).get("learning_rate")
    return float(lr) if isinstance(lr, (int, float)) and not isinstance(lr, bool) else None


# -- the stage-1 table and selected.yaml ----------------------------------------------------------
def stage1_rows(grid: Grid, rule: Rule, chosen: Mapping[str, float]) -> tuple[list[str], list[list[str]]]:
    """(header, rows): every arm x rate with the rule's measure median [IQR] over seeds, the statistic the
    rule compares, the test split's peak and final (for information: the rule never reads them), the choice."""
    scores = validation_scores(grid, rule)
    header = ["arm", "learning rate", "seeds", f"{rule.measure} (validation)", f"{rule.statistic} (the rule's)",
              "test peak (not used)", "test final (not used)", "chosen"]
    rows = []
    for arm, rates in grid.items():
        for lr, s in rates.items():
            tests = [r.evals()[1] for r in s.runs]
            rows.append([arm, lr_tag(lr), str(len(s.runs)), cell(scores[arm][lr]),
                         fmt(statistic(scores[arm][lr], rule.statistic)),
                         cell([float(np.max(a)) for a in tests]), cell([float(a[-1]) for a in tests]),
                         "**chosen**" if chosen.get(arm) == lr else ""])
    return header, rows


def write_selected(chosen: Mapping[str, float], path: Path) -> None:
    path.write_text(yaml.safe_dump({arm: float(lr) for arm, lr in chosen.items()}, sort_keys=False))


def read_selected(folder: Path, where: str) -> dict[str, float]:
    """arm -> learning rate from FOLDER/selected.yaml (a stage-1 report's), or a one-line ConfigError."""
    path = Path(folder) / SELECTED_FILE
    if not path.is_file():
        raise ConfigError(f"{where}: no {SELECTED_FILE} in {folder} (run `jaxreplay report` on the stage-1 runs "
                          "with --out there first)")
    raw = yaml.safe_load(path.read_text())
    if not isinstance(raw, dict) or not raw:
        raise ConfigError(f"{where}: {path} is not a mapping of arm -> learning rate")
    return {str(arm): parse_learning_rate(lr, f"{where}: {path}: {arm}") for arm, lr in raw.items()}


def load_rule(sweep: Optional[str | Path], run_dirs: Sequence[Path]) -> Optional[Rule]:
    """The rule of `sweep` (a sweep file's `select`), else of a select.yaml beside the runs' setting folders."""
    raw, source = declared(sweep, run_dirs, "select", SELECT_FILE,
                           "stage-1 sweeps each declare a selection rule; report them apart")
    return parse_rule(raw, source) if source else parse_rule(raw)
