"""`jaxreplay report RUN_DIR... --out DIR [--baseline NAME[,NAME]] [--mu 5.28,6.84] [--sweep FILE]`.

The report first copies what it reads into OUT/runs/SETTING/RUN (report_data.copy_run)
and then builds every table and plot from those copies alone, so `jaxreplay report
OUT/runs/*/seed* --out OUT` rebuilds it byte for byte (the bootstrap is seeded; no
table holds a path or a time of day).

Every comparison is paired by seed with the baseline (on-policy unless `--baseline`):
a sweep's seed fixes the warm start and the prompt stream. Accuracy measures are
differences from the same seed's baseline run; costs to a target are ratios to what
the same seed's baseline spent. Several baselines (a study over training pools) split the
settings into pools (`split_pools`), each with its own sections. Targets are 50, 75 and 90% of that seed's baseline gain
(its peak minus its start); a run that never reaches one is right-censored: "> budget",
+inf in medians and IQMs, and the count that did is shown. Each cell gives the median
[IQR] and rliable's IQM with a 95% stratified bootstrap interval (report_stats).

Compute is modelled as the paper does (cost per update B + mu R): trained rollouts +
mu x generated rollouts, at the mu the runs measured (the median of each run's last
logged `cost/mu`) and at every mu given with `--mu`. Claims declared in the sweep file
(report_claims) get their verdicts from the same paired numbers.

Two stages (docs/comparing.md): runs that come with a learning-rate rule (select.yaml beside
them, or `--sweep` naming a stage-1 file) get the stage-1 report instead (`stage1_report`:
the stage-1 table and OUT/selected.yaml, report_select). A stage-2 report given the stage-1
runs with `--stage1 RUN_DIR...` copies them into OUT/stage1 and adds the frontier at the first
`--mu` (report_frontier) and the stage-1 table; its Data line's command names `--stage1 stage1/*/*`.

A replication (`jaxreplay sweep FILE --replicate S,S --out DIR`: the same settings on new seeds)
is given with `--replication DIR/*/seed*` and copied into OUT/replication. It is set beside the
declared seeds and its claims are decided again on its seeds alone, under a heading of its own:
never pooled into the declared seeds' verdicts. Its runs given as ordinary run dirs are refused. A
replication of some of the settings (`--settings`) decides the claims those settings decide; the others
are "not decided by the replication". A pass@K claim's runs without pass@K in their eval.json are refused
before anything is written (`check_evaluations`), the declared seeds' and the replication's alike.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np
import yaml

from jaxreplay import storage
from jaxreplay.config import ConfigError, flatten
from jaxreplay.research import report_age, report_frontier, report_plots, report_regime
from jaxreplay.research.report_claims import (
    CLAIMS_FILE, REPLICATION_FILE, TARGET_FRACTIONS, Claim, parse_claims, verdict)
from jaxreplay.research.report_data import (
    EVAL_FILE, SUMMARY_FILE, RunData, Setting, copy_run, declared, group_settings, load_runs, measured_mu,
    pick_baseline, setting_key)
from jaxreplay.research.report_select import (
    SELECT_FILE, SELECTED_FILE, Rule, arm_grid, choose, learning_rate, load_rule, lr_tag, stage1_rows,
    validation_scores, write_selected)
from jaxreplay.research.report_stats import (
    BOOTSTRAP_REPS, BOOTSTRAP_SEED, MAX_REPS, bootstrap_interval, cell, clean, first_reach, fmt, fmt_value, iqm,
    largest_fall, summary_cell)
from jaxreplay.train.eval import PASS1_KEY, PASSK_KEY

LR_KEY = "train.learning_rate"
END_WINDOW = 10  # "entropy at the end": the mean over a run's last END_WINDOW logged steps, per-batch noise damped
BUDGET_FRACTIONS = (0.25, 0.5, 1.0)  # where the speed table reads each run's accuracy, as shares of the common budget
COST_AXES = (("tokens", "generated tokens"), ("rollouts", "generated rollouts"))

Mus = Sequence[tuple[str, float]]  # (label, mu) of the compute axes


# -- per-seed measures ---------------------------------------------------------------------
def start_and_peak(run: RunData) -> tuple[float, float]:
    """A run's first evaluation (its start, the warm start in a sweep) and its best one."""
    acc = run.evals()[1]
    return float(acc[0]), float(np.max(acc))


def split_pools(settings: Sequence[Setting], baseline: Optional[str]) -> list[tuple[Setting, list[Setting]]]:
    """[(baseline, its pool's settings)]: one baseline (on-policy unless named) pairs with every setting.

    Several (`--baseline A,B`, a study over training pools) split the settings: each joins the baseline
    whose config agrees with its own on every key where the baselines' configs differ, the learning rate
    aside (stage 1 may choose a different rate per pool). A setting matching none or several is refused."""
    names = baseline.split(",") if baseline else [None]
    if len(names) == 1:
        return [(pick_baseline(settings, names[0]), list(settings))]
    if len(set(names)) != len(names):
        raise ConfigError(f"--baseline {baseline}: a baseline named twice")
    bases = [pick_baseline(settings, n) for n in names]
    keys = _pool_keys(bases)
    if not keys:
        raise ConfigError(f"--baseline {baseline}: the baselines' configs differ in nothing but the learning rate, "
                          "so nothing tells their pools apart")
    base_configs = [(b, _config(b)) for b in bases]
    home = {}
    for s in settings:
        own = _config(s)
        match = [b for b, config in base_configs if all(own.get(k) == config.get(k) for k in keys)]
        if len(match) != 1:
            raise ConfigError(f"--baseline {baseline}: setting {s.name} matches {'none' if not match else 'several'} "
                              f"of the baselines' pools on {', '.join(keys)}")
        home[s.name] = match[0]
    return [(b, [s for s in settings if home[s.name] is b]) for b in bases]


def pool_label(pool: Setting, pools: Sequence[tuple[Setting, list[Setting]]]) -> str:
    """What sets a pool apart: its baseline's values of the keys where the baselines differ (learning rate aside)."""
    return ", ".join(f"{k}={_config(pool).get(k)}" for k in _pool_keys([b for b, _ in pools]))


def _config(s: Setting) -> dict:
    """A setting's config as dotted keys, what says where a run was kept left out."""
    return flatten(setting_key(s.runs[0].config))


def _pool_keys(bases: Sequence[Setting]) -> list[str]:
    """The dotted keys where the baselines' configs differ, the learning rate aside: what defines a pool."""
    configs = [_config(b) for b in bases]
    return sorted(k for k in set().union(*configs) if k != LR_KEY and len({repr(c.get(k)) for c in configs}) > 1)


def target(base_run: RunData, fraction: float) -> float:
    """`fraction` of the baseline run's gain above its start: start + fraction * (peak - start)."""
    start, peak = start_and_peak(base_run)
    return start + fraction * (peak - start)


def _x(run: RunData, axis: str, steps, mu: Optional[float]) -> np.ndarray:
    if axis == "rollouts":
        return np.array([run.generated(int(s)) for s in steps], np.float64)
    return run.x(axis, steps, mu)


def spent(run: RunData, level: float, axis: str, mu: Optional[float] = None) -> float:
    """`axis` at the run's first evaluation at or above `level`: +inf if it never got there
    (right-censored at its budget), nan if the run did not track `axis`."""
    steps, acc = run.evals()
    x = first_reach(_x(run, axis, steps, mu), acc, level)
    return math.inf if x is None else x


def pairs(setting: Setting, base: Setting) -> list[tuple[RunData, RunData]]:
    """(run, the baseline's run of the same seed) for every seed both have."""
    by_seed = {r.seed: r for r in base.runs}
    return [(r, by_seed[r.seed]) for r in setting.runs if r.seed in by_seed]


def cost_ratios(setting: Setting, base: Setting, fraction: float, axis: str, mu: Optional[float] = None) -> list[float]:
    """Per paired seed: what the run spent to reach `fraction` of that seed's baseline gain, over
    what the baseline run spent (+inf: never reached). Seeds whose baseline gained nothing, or
    that did not track `axis`, are left out."""
    out = []
    for run, ref in pairs(setting, base):
        start, peak = start_and_peak(ref)
        if peak <= start:
            continue
        level = target(ref, fraction)
        own, theirs = spent(run, level, axis, mu), spent(ref, level, axis, mu)
        if math.isnan(own) or math.isnan(theirs) or theirs <= 0:
            continue
        out.append(own / theirs)
    return out


def _pass(run: RunData, k: str) -> Optional[float]:
    return run.pass_at(k)


def accuracy_measures(settings: Sequence[Setting]) -> list[tuple[str, Callable[[RunData], Optional[float]]]]:
    ks = sorted({int(k) for s in settings for r in s.runs for k in r.final_eval.get(PASSK_KEY, {})})
    return [("peak", lambda r: start_and_peak(r)[1]), ("final", lambda r: float(r.evals()[1][-1])),
            *[(f"pass@{k}", lambda r, k=str(k): _pass(r, k)) for k in ks]]


def total_cost(run: RunData, axis: str, mu: Optional[float] = None) -> float:
    """The run's `axis` (modelled compute at µ, or wall-clock seconds) at its last logged step."""
    return float(_x(run, axis, [int(run.records[-1]["step"])], mu)[0])


def accuracy_at_cost(run: RunData, budget: float, axis: str, mu: Optional[float]) -> Optional[float]:
    """Test accuracy at the run's latest evaluation at or before `budget` on `axis`."""
    steps, acc = run.evals()
    keep = _x(run, axis, steps, mu) <= budget
    return float(acc[keep][-1]) if keep.any() else None


def entropy_at_cost(run: RunData, budget: float, axis: str, mu: Optional[float]) -> Optional[float]:
    """The mean logged `entropy` over the run's last END_WINDOW logged steps at or before `budget` on `axis`."""
    steps, values = run.series("entropy")
    values = values[_x(run, axis, steps, mu) <= budget][-END_WINDOW:]
    return float(values.mean()) if len(values) else None


# Measures read at equal cost: (the axis both runs are cut at, the measure there).
AT_EQUAL_COST = {"final_at_compute": ("compute", accuracy_at_cost), "entropy_at_compute": ("compute", entropy_at_cost),
                 "final_at_wallclock": ("wallclock", accuracy_at_cost),
                 "entropy_at_wallclock": ("wallclock", entropy_at_cost)}
RUN_MEASURES = {"largest_fall": lambda r: largest_fall(r.evals()[1])}  # claim measures beside accuracy_measures


def run_measure(measure: str, settings: Sequence[Setting]) -> Callable[[RunData], Optional[float]]:
    """A claim's per-run measure: peak, final, pass@K (None where a run's eval.json lacks it), largest_fall."""
    if measure.startswith("pass@"):
        return lambda r: _pass(r, measure.removeprefix("pass@"))
    return RUN_MEASURES.get(measure) or dict(accuracy_measures(settings))[measure]


def paired_measure(measure: str, mu: Optional[float], run: RunData, ref: RunData,
                   settings: Sequence[Setting]) -> Optional[tuple[float, float]]:
    """(the run's value, the baseline run's) of an accuracy-like claim measure, for one seed pair; None if
    either is missing. At equal cost, both are read at the smaller of the two runs' totals: compute at µ,
    or wall-clock seconds."""
    if measure in AT_EQUAL_COST:
        axis, at = AT_EQUAL_COST[measure]
        budget = min(total_cost(run, axis, mu), total_cost(ref, axis, mu))
        get = lambda r: at(r, budget, axis, mu)  # noqa: E731
    else:
        get = run_measure(measure, settings)
    a, b = get(run), get(ref)
    return None if a is None or b is None or math.isnan(a) or math.isnan(b) else (a, b)


def differences(setting: Setting, base: Setting, get: Callable[[RunData], Optional[float]]) -> list[float]:
    """Per paired seed: the run's measure minus the baseline run's (seeds missing either left out)."""
    return [a - b for r, ref in pairs(setting, base) if (a := get(r)) is not None and (b := get(ref)) is not None]


# -- tables --------------------------------------------------------------------------------
def _markdown(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows]) + "\n"


def _end_entropy(run: RunData) -> Optional[float]:
    values = run.series("entropy")[1][-END_WINDOW:]
    return float(values.mean()) if len(values) else None


def _name(s: Setting, base: Setting) -> str:
    return s.name + (" (baseline)" if s is base else "")


def main_table(settings: Sequence[Setting], base: Setting) -> str:
    """Per setting: start, peak and final accuracy, entropy at the end, replay ratio, staleness."""
    header = ["setting", "seeds", "start eval accuracy", "peak eval accuracy", "final eval accuracy",
              f"entropy at end (last {END_WINDOW} steps)", "replay ratio (target)", "mean staleness"]
    rows = [[_name(s, base), str(len(s.runs)),
             cell([start_and_peak(r)[0] for r in s.runs]),
             cell([start_and_peak(r)[1] for r in s.runs]),
             cell([float(r.evals()[1][-1]) for r in s.runs]),
             cell([_end_entropy(r) for r in s.runs]),
             f"{cell([r.last('replay/ratio') for r in s.runs])} ({fmt(s.spi_target)})",
             cell([float(np.mean(v)) for r in s.runs if len(v := r.series("staleness/mean")[1])])]
            for s in settings]
    return _markdown(header, rows)


def paired_table(settings: Sequence[Setting], base: Setting) -> Optional[str]:
    """Each run minus the baseline's run of the same seed: median [IQR]; IQM [95% CI]; seeds above."""
    measures = accuracy_measures(settings)
    rows = []
    for s in settings:
        n = len(pairs(s, base))
        if s is base or not n:
            continue
        cells = []
        for _, get in measures:
            d = differences(s, base, get)
            cells.append(f"{summary_cell(d)}; above in {sum(v > 0 for v in d)}/{len(d)}" if d else "n/a")
        rows.append([s.name, str(n), *cells])
    if not rows:
        return None
    return _markdown(["setting", "seeds paired", *[f"{name} − {base.name}'s" for name, _ in measures]], rows)


def target_table(settings: Sequence[Setting], base: Setting, fraction: float, mus: Mus) -> str:
    """What each setting spent to reach `fraction` of its seed's baseline gain, × the baseline's."""
    axes = [*((a, label, None) for a, label in COST_AXES), *(("compute", f"compute at {label}", mu)
                                                              for label, mu in mus)]
    header = ["setting", "seeds that reach it", *[label for _, label, _ in axes]]
    rows = []
    for s in settings:
        ratios = [cost_ratios(s, base, fraction, axis, mu) for axis, _, mu in axes]
        counted = max(ratios, key=len)
        reached = f"{sum(math.isfinite(v) for v in counted)}/{len(counted)}"
        rows.append([_name(s, base), reached, *[summary_cell(r) for r in ratios]])
    return _markdown(header, rows)


def speed_table(settings: Sequence[Setting], base: Setting) -> Optional[str]:
    """How fast and how steadily each setting learns: accuracy at shares of the generated-token budget
    every run spent (each run's evaluations interpolated linearly), and the largest fall below an
    earlier evaluation. None if a run did not track its generated tokens."""
    curves = {id(r): clean(r.x("tokens", steps), acc) for s in settings for r in s.runs for steps, acc in [r.evals()]}
    if any(len(x) == 0 for x, _ in curves.values()):
        return None
    budget = min(float(x[-1]) for x, _ in curves.values())
    header = ["setting", *[f"accuracy at {f:.0%} of {fmt(budget)} tokens" for f in BUDGET_FRACTIONS],
              "largest fall below an earlier evaluation"]
    rows = []
    for s in settings:
        at = [np.interp(np.multiply(BUDGET_FRACTIONS, budget), *curves[id(r)]) for r in s.runs]
        rows.append([_name(s, base), *[cell([float(a[i]) for a in at]) for i in range(len(BUDGET_FRACTIONS))],
                     cell([largest_fall(r.evals()[1]) for r in s.runs])])
    return _markdown(header, rows)


def pass_table(settings: Sequence[Setting], base: Setting) -> Optional[str]:
    """pass@1 (temperature 0.1) and pass@k (temperature 1.0) of the final policies, from eval.json."""
    ks = sorted({int(k) for s in settings for r in s.runs for k in r.final_eval.get(PASSK_KEY, {})})
    if not any(r.final_eval for s in settings for r in s.runs):
        return None
    header = ["setting", "runs with eval.json", "pass@1 (T 0.1)", *[f"pass@{k} (T 1.0)" for k in ks]]
    rows = [[_name(s, base), str(sum(1 for r in s.runs if r.final_eval)),
             cell([r.final_eval[PASS1_KEY] for r in s.runs if r.final_eval.get(PASS1_KEY) is not None]),
             *[cell([r.pass_at(str(k)) for r in s.runs]) for k in ks]] for s in settings]
    return _markdown(header, rows)


def coverage(settings: Sequence[Setting], base: Setting, mu: float) -> tuple[float, float]:
    """(the baseline's median final modelled compute at `mu` / the largest any other run reached,
    (y_max + mu)/(1 + mu): the token budget multiple the baseline needs to cover the others).

    Replay spends y + mu per generated rollout against 1 + mu on-policy: at equal generated
    tokens the baseline's compute axis ends (y_max + mu)/(1 + mu) times earlier."""
    def final(r: RunData) -> float:
        steps = r.evals()[0]
        return float(_x(r, "compute", [int(r.records[-1]["step"])], mu)[0]) if len(steps) else math.nan

    others = [final(r) for s in settings if s is not base for r in s.runs]
    others = [v for v in others if math.isfinite(v)]
    ours = [v for r in base.runs if math.isfinite(v := final(r))]
    y_max = max([s.spi_target for s in settings if math.isfinite(s.spi_target)], default=1.0)
    need = (y_max + mu) / (1 + mu)
    if not others or not ours:
        return math.nan, need
    return float(np.median(ours)) / max(others), need


def coverage_table(settings: Sequence[Setting], base: Setting, mus: Mus) -> str:
    header = ["µ", f"{base.name}'s median final compute / the most any other run reached",
              "(y_max + µ)/(1 + µ): the token multiple it needs"]
    rows = []
    for label, mu in mus:
        share, need = coverage(settings, base, mu)
        rows.append([label, "n/a" if math.isnan(share) else f"{fmt(share)} ({'full' if share >= 1 else 'partial'})",
                     fmt(need)])
    return _markdown(header, rows)


def claim_values(claim: Claim, settings: dict[str, Setting], base: Setting) -> list[list[float]]:
    """The claim's paired values, one stratum per setting it pools (`contrast_values` for a contrast)."""
    if claim.contrast:
        return contrast_values(claim, settings)
    strata = []
    for name in claim.settings:
        s = settings[name]
        if claim.cost is not None:
            axis, fraction = claim.cost
            strata.append(cost_ratios(s, base, fraction, axis, claim.mu))
        else:
            every = list(settings.values())
            values = [paired_measure(claim.measure, claim.mu, r, ref, every) for r, ref in pairs(s, base)]
            strata.append([a - b for a, b in filter(None, values)])
    return [v for v in strata if v]


def contrast_values(claim: Claim, settings: dict[str, Setting]) -> list[list[float]]:
    """A regime contrast's difference of paired differences, per seed that all four runs share:
    (setting − its baseline) − (contrast setting − the contrast baseline), one stratum per pair of
    settings (report_claims)."""
    every = list(settings.values())

    def by_seed(name: str, ref: str) -> dict:
        return {r.seed: v[0] - v[1] for r, b in pairs(settings[name], settings[ref])
                if (v := paired_measure(claim.measure, claim.mu, r, b, every)) is not None}

    strata = []
    for name, other in zip(claim.settings, claim.contrast):
        here, there = by_seed(name, claim.baseline), by_seed(other, claim.contrast_baseline)
        strata.append([here[seed] - there[seed] for seed in sorted(here, key=str) if seed in there])
    return [v for v in strata if v]


def baseline_values(claim: Claim, settings: Sequence[Setting], base: Setting) -> list[float]:
    """The baseline's own values of an accuracy claim's measure, which its ceiling is read against: every
    baseline run's, or at equal compute each pair's baseline side."""
    if claim.measure in AT_EQUAL_COST:
        by_name = {s.name: s for s in settings}
        return [v[1] for n in claim.settings for r, ref in pairs(by_name[n], base)
                if (v := paired_measure(claim.measure, claim.mu, r, ref, settings)) is not None]
    get = run_measure(claim.measure, settings)
    return [v for r in base.runs if (v := get(r)) is not None]


def claim_baseline(claim: Claim, base: str, pool_of: Optional[dict[str, str]] = None) -> str:
    """The name of the baseline a claim is paired with: its own, else its first setting's pool's
    (`pool_of`: setting name -> its pool's baseline name), else `base`."""
    return claim.baseline or (pool_of or {}).get(claim.settings[0], base)


def check_evaluations(claims: Sequence[Claim], settings: Sequence[Setting], base: str,
                      pool_of: dict[str, str], what: str = "") -> None:
    """Every run a pass@K claim reads (its settings' and its baseline's, where all of them have runs) holds
    pass@K in its eval.json, which `jaxreplay eval` writes after training: checked before anything is
    written, so that a missing evaluation is one line naming the runs and the command that makes it."""
    by_name = {s.name: s for s in settings}
    needs: dict[str, list[str]] = {}  # pass@K -> the run dirs that lack it
    for c in claims:
        if not c.measure.startswith("pass@"):
            continue
        names = list(dict.fromkeys((*c.names, claim_baseline(c, base, pool_of))))
        if any(n not in by_name for n in names):
            continue  # not decided here at all ("not reported")
        k = c.measure.removeprefix("pass@")
        for n in names:
            for r in by_name[n].runs:
                if r.pass_at(k) is None and str(r.dir) not in needs.setdefault(c.measure, []):
                    needs[c.measure].append(str(r.dir))
    if not needs:
        return
    ks = ",".join(sorted({"1", *(m.removeprefix("pass@") for m in needs)}, key=int))
    lacking = "; ".join(f"{len(dirs)} lack {m} ({_runs_named(dirs)})" for m, dirs in needs.items())
    raise ConfigError(f"{what}claims on {', '.join(needs)} read each run's {EVAL_FILE}, written by `jaxreplay eval` "
                      f"after training: {lacking}; make it with `jaxreplay eval RUN_DIR --k {ks} --out "
                      f"RUN_DIR/{EVAL_FILE}` for each")


def _runs_named(dirs: Sequence[str]) -> str:
    """Run dirs, grouped by setting folder: `/x/spi2/seed10, seed11; /x/on_policy/seed10`."""
    folders: dict[str, list[str]] = {}
    for d in dirs:
        folders.setdefault(str(Path(d).parent), []).append(Path(d).name)
    return "; ".join(f"{folder}/{', '.join(names)}" for folder, names in folders.items())


def claims_table(claims: Sequence[Claim], settings: Sequence[Setting], base: str,
                 regime: Optional[report_regime.RegimeResult] = None,
                 pool_of: Optional[dict[str, str]] = None, bootstrap_seed: int = BOOTSTRAP_SEED,
                 missing_runs: str = "not reported: no runs of") -> str:
    """Each claim's rule, paired numbers and verdict; a claim marked `regime` is "regime not reached"
    (with the rule's numbers) where `regime`, the exhaustion rule's result, is not met. A claim is paired
    with the baseline `claim_baseline` names; one that reads a setting without runs here gets the verdict
    `missing_runs` and those settings' names. Each end of an interval carries its Monte Carlo error
    (report_stats.Interval), and a verdict that the bootstrap's random stream could flip is "borderline"
    (report_claims.borderline)."""
    by_name = {s.name: s for s in settings}
    rows = []
    for c in claims:
        base_name = claim_baseline(c, base, pool_of)
        rule = c.describe(base_name)
        needed = (*c.names, base_name, *((regime.regime.setting,) if c.regime and regime is not None else ()))
        missing = [n for n in dict.fromkeys(needed) if n not in by_name]
        if missing:
            rows.append([c.text, rule, "n/a", f"{missing_runs} {', '.join(missing)}"])
            continue
        own_base = by_name[base_name]
        strata = claim_values(c, by_name, own_base)
        values = [v for stratum in strata for v in stratum]
        if not values:
            rows.append([c.text, rule, "n/a", "not testable here: no paired seeds"])
            continue
        ci = bootstrap_interval(strata, seed=bootstrap_seed, threshold=c.threshold)
        numbers = (f"IQM {fmt_value(iqm(values))} [{_end(ci.lo, ci.lo_error)}, {_end(ci.hi, ci.hi_error)}]"
                   + (f" ({ci.reps:,} replicates)" if ci.reps != BOOTSTRAP_REPS else "") + f" over {len(values)} paired "
                   f"seeds; " + (f"reached in {sum(math.isfinite(v) for v in values)}/{len(values)}" if c.cost else
                                 f"above 0 in {sum(v > 0 for v in values)}/{len(values)}" if c.contrast else
                                 f"above {own_base.name} in {sum(v > 0 for v in values)}/{len(values)}"))
        decided = verdict(c, ci)
        if c.regime and regime is not None and not regime.met:
            rows.append([c.text, rule, numbers, f"regime not reached: {regime.numbers()}"])
            continue
        if c.ceiling is not None and c.cost is None:
            ref = baseline_values(c, settings, own_base)
            if ref and float(np.median(ref)) >= c.ceiling:
                decided = (f"not testable here: {own_base.name}'s median {c.measure} is {fmt(float(np.median(ref)))}, "
                           f"at or above the ceiling {fmt(c.ceiling)}")
        rows.append([c.text, rule, numbers, decided])
    return _markdown(["claim", "rule (declared in the sweep file)", "paired numbers", "verdict"], rows)


def _end(value: float, error: float) -> str:
    """An interval's end with its Monte Carlo error: `0.0162 ±0.0003`; `> budget` alone where it is +inf."""
    if value == math.inf:
        return fmt_value(value)
    return f"{fmt(value)} ±{fmt_value(error, '> budget')}"


def runs_table(settings: Sequence[Setting], base: Setting) -> str:
    """One row per run: where it got, what it spent, and when it reached 90% of its seed's baseline gain."""
    fraction = TARGET_FRACTIONS[-1]
    by_seed = {r.seed: r for r in base.runs}
    header = ["setting", "run", "learner steps", "start acc", "peak acc", "final acc", "generated tokens",
              "generated / trained rollouts", "measured µ", "loop seconds (no compilation)",
              f"tokens to {fraction:.0%} of its seed's {base.name} gain"]
    rows = []
    for s in settings:
        for run in s.runs:
            step = int(run.records[-1]["step"])
            ref = by_seed.get(run.seed)
            hit = "n/a" if ref is None else fmt_value(spent(run, target(ref, fraction), "tokens"), "never")
            start, peak = start_and_peak(run)
            rows.append([s.name, run.dir.name, str(step), fmt(start), fmt(peak), fmt(run.evals()[1][-1]),
                         fmt(run.value("tokens/generated", step)),
                         f"{fmt(run.generated(step))} / {fmt(run.trained(step))}",
                         fmt(run.last("cost/mu") or float("nan")), fmt(run.seconds(step)), hit])
    return _markdown(header, rows)


def rebuild_command(baseline: Optional[str], mus: Sequence[float], stage1: bool = False,
                    replication: bool = False) -> str:
    """The command that rebuilds a report in its own folder from its copied runs (and stage-1 runs)."""
    return ("jaxreplay report runs/*/* --out ." + (f" --baseline {baseline}" if baseline else "")
            + (f" --mu {','.join(repr(float(m)).removesuffix('.0') for m in mus)}" if mus else "")
            + (" --stage1 stage1/*/*" if stage1 else "") + (" --replication replication/*/*" if replication else ""))


def _seeds(settings: Sequence[Setting]) -> list:
    return sorted({r.seed for s in settings for r in s.runs}, key=lambda v: (v is None, v))


def _is_replication(run_dir: str | Path) -> bool:
    return (Path(run_dir).resolve().parent.parent / REPLICATION_FILE).exists()


def check_replication(settings: Sequence[Setting], replicated: Sequence[Setting]) -> None:
    """A replication's settings are the study's, on seeds none of the study's runs used."""
    names = {s.name for s in settings}
    for s in replicated:
        if s.name not in names:
            raise ConfigError(f"--replication: setting {s.name} is none of the study's ({', '.join(sorted(names))})")
    shared = set(_seeds(settings)) & set(_seeds(replicated))
    if shared:
        raise ConfigError(f"--replication: seed {min(shared)} is also one of the study's runs; a replication runs "
                          "on new seeds and is never pooled with them")


def replication_table(settings: Sequence[Setting], replicated: Sequence[Setting], base: Setting) -> str:
    """Per setting: the declared seeds' numbers and the replication's, side by side, never pooled."""
    again = {s.name: s for s in replicated}
    header = ["setting", "seeds (declared / replication)", "peak (declared)", "peak (replication)",
              "final (declared)", "final (replication)", f"peak − {base.name}'s (declared)",
              f"peak − {base.name}'s (replication)"]
    peak = lambda r: start_and_peak(r)[1]  # noqa: E731
    final = lambda r: float(r.evals()[1][-1])  # noqa: E731
    rebase = again.get(base.name)
    rows = []
    for s in settings:
        rep = again.get(s.name)
        runs = rep.runs if rep else []
        rows.append([_name(s, base), f"{len(s.runs)} / {len(runs)}",
                     cell([peak(r) for r in s.runs]), cell([peak(r) for r in runs]),
                     cell([final(r) for r in s.runs]), cell([final(r) for r in runs]),
                     "" if s is base else summary_cell(differences(s, base, peak)),
                     "" if s is base or rep is None or rebase is None else
                     summary_cell(differences(rep, rebase, peak))])
    return _markdown(header, rows)


def _regime_on(regime: Optional[report_regime.Regime], settings: Sequence[Setting]):
    """The exhaustion rule decided on these settings alone (not met where they lack its setting)."""
    if regime is None:
        return None
    if regime.setting not in {s.name for s in settings}:
        return report_regime.RegimeResult(regime, 0, math.nan, math.nan)
    return report_regime.decide(regime, settings)


def _replication_section(claims: Sequence[Claim], pools: Sequence[tuple[Setting, list[Setting]]],
                         replicated: Sequence[Setting], regime: Optional[report_regime.Regime] = None) -> list[str]:
    """The replication beside the declared seeds, its claims decided again on it alone. A replication of some
    of the settings (`jaxreplay sweep FILE --replicate S --settings A,B`) decides the claims that read only
    those; each pairs with the baseline it pairs with in the declared report, and one that reads a setting the
    replication lacks (or its pool's baseline) is "not decided by the replication"."""
    settings = [s for _, members in pools for s in members]
    seeds, declared_seeds = _seeds(replicated), _seeds(settings)
    names = {s.name for s in replicated}
    left_out = [s.name for s in settings if s.name not in names]
    pool_of = {s.name: b.name for b, members in pools for s in members}
    kept = [s.name for s in settings if s.name in names]
    which = ("the same settings," if not left_out else
             f"{len(kept)} of the study's {len(settings)} settings ({', '.join(kept)}; not {', '.join(left_out)}), "
             "with the same")
    doc = ["## Replication on new seeds (apart from the declared seeds, never pooled with them)", "",
           f"Seeds {', '.join(map(str, seeds))}: {which} learning rates and budgets as the declared seeds "
           f"({', '.join(map(str, declared_seeds))}), run by `jaxreplay sweep FILE --replicate "
           f"{','.join(map(str, seeds))} --out DIR"
           + (f" --settings {','.join(kept)}" if left_out else "")
           + f"` (`replication/{REPLICATION_FILE}`). The verdicts above are the "
           "confirmatory ones, from the declared seeds alone; the claims are decided again below on the replication "
           "alone, by the same rules" + ("; a claim that reads a setting it did not run is not decided by it."
                                         if left_out else "."), ""]
    if claims:
        doc += ["## Replication: the claims decided again on its seeds alone", "",
                claims_table(claims, replicated, pools[0][0].name, _regime_on(regime, replicated), pool_of,
                             missing_runs="not decided by the replication: it has no runs of")]
    tables = [replication_table(members, replicated, b) for b, members in pools]
    return doc + ["## Replication beside the declared seeds", "", "\n".join(tables)]


def _how_to_read(settings: Sequence[Setting], pools: Sequence[tuple[Setting, list[Setting]]], mu: Optional[float],
                 given: Sequence[float], size: int, command: str) -> list[str]:
    runs = [r for s in settings for r in s.runs]
    timed = sum(r.timed for r in runs)
    mus = [m for r in runs if (m := r.last("cost/mu")) is not None]
    measured = (f"measured µ = {fmt(mu)}: the median of the last cost/mu of the {len(mus)} runs that logged it "
                f"(range {fmt(min(mus))} to {fmt(max(mus))})" if mu is not None else
                "no run logged cost/mu, so only the given µ are modelled")
    pairs_line, targets_head = _pairs_lines(pools)
    return [
        "- **Statistic:** `median [q25, q75]` over seeds (linear interpolation between seeds); where paired, also "
        "`IQM m [lo, hi]`: the interquartile mean (the mean after cutting a quarter of the seeds from each end, "
        "rliable's IQM) with its 95% percentile interval from a stratified bootstrap (seeds redrawn with "
        "replacement within each setting, 10,000 replicates, seed 0). In the claims each end carries its Monte "
        "Carlo error `±e`: how far the bootstrap's own random stream can move it (the replicates' order statistics "
        "that hold the infinite-replicate end with 95% probability); a claim's stream goes on with four times the "
        f"replicates, up to {MAX_REPS:,}, until each end's error is at most a tenth of its distance to the "
        "threshold, and a verdict whose threshold still lies within an end's error is `borderline`. Plot bands are "
        "the IQR after interpolating each seed's curve linearly onto one x grid.",
        pairs_line,
        targets_head + "reaches one at its first evaluation at or above it; what it spent until then is divided by "
        f"what the seed's {_base_words(pools)} run spent. A run that never reaches it is `> budget` (+inf in medians and IQMs); "
        "`k/n` counts the seeds that did.",
        "- **Compute:** trained rollouts + µ × generated rollouts, in units of training one rollout (the paper's "
        f"cost per update B + µR). {measured[0].upper() + measured[1:]}. Given with --mu: "
        f"{', '.join(fmt(m) for m in given) or 'none'}.",
        f"- **Wall-clock:** seconds generating, training and on replay, evaluation left out. Compilation is left "
        f"out: {timed} of {len(runs)} runs logged the accounting's timed seconds (first generate and train call "
        f"of each process left out); the other {len(runs) - timed} count from their first learner step, "
        "which holds both first calls.",
        f"- **Data:** every number and plot here is rebuilt from "
        f"{_folders(command)} alone ({size / 1e6:.2f} MB: each run's "
        "config.yaml, summary.json, eval.json and metrics.jsonl trimmed to the keys read): "
        f"`{command}` in this folder writes this file again, byte for byte.",
    ]


def _base_words(pools: Sequence[tuple[Setting, list[Setting]]]) -> str:
    return f"`{pools[0][0].name}`" if len(pools) == 1 else "pool's baseline"


def _pairs_lines(pools: Sequence[tuple[Setting, list[Setting]]]) -> tuple[str, str]:
    """The Pairs line and the start of the Targets line (whose end is shared)."""
    if len(pools) == 1:
        name = pools[0][0].name
        return (f"- **Pairs:** every comparison is with `{name}`'s run of the same seed, which shares the warm start "
                "and the prompt stream.",
                f"- **Targets:** 50%, 75% and 90% of the same seed's `{name}` gain (its peak minus its start). A run ")
    listed = "; ".join(f"`{b.name}` for {pool_label(b, pools)} ({', '.join(s.name for s in members)})"
                       for b, members in pools)
    return (f"- **Pairs:** every comparison is with the run of the same seed of the setting's pool's baseline, which "
            f"shares the warm start and the prompt stream: {listed}. A claim naming its own baseline (or a contrast "
            "between pools) says so in its rule.",
            "- **Targets:** 50%, 75% and 90% of the same seed's pool's baseline gain (its peak minus its start). A run ")


def _folders(command: str) -> str:
    """The folders a rebuild command reads: `runs/`, and `stage1/` and `replication/` where it names them."""
    names = ["`runs/`", *(f"`{f}/`" for f in ("stage1", "replication") if f"--{f} " in command)]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def load_regime(sweep: Optional[str | Path], run_dirs: Sequence[Path]) -> Optional[report_regime.Regime]:
    """The exhaustion rule of `sweep`, else of a regime.yaml beside the runs' setting folders (None: none)."""
    raw, source = declared(sweep, run_dirs, "regime", report_regime.REGIME_FILE,
                           "sweeps each declare an exhaustion rule; name one with --sweep")
    return report_regime.parse_regime(raw, source) if source else report_regime.parse_regime(raw)


def _regime_section(result: report_regime.RegimeResult, settings: Sequence[Setting]) -> list[str]:
    doc = ["## Regime: did on-policy exhaust its pool?", "",
           f"Rule (declared in the sweep file before any run, `runs/{report_regime.REGIME_FILE}`): "
           f"{result.regime.describe()}. {'Met' if result.met else 'Not met'}: {result.numbers()}. Claims marked "
           "`regime` are decided only where it is met.", ""]
    if result.per_seed:
        doc += [result.seed_counts(), "", _markdown(*result.seed_rows())]
    rows = report_regime.reward_rows(settings)
    if rows:
        doc += ["## On-policy's training reward beside its test accuracy", "",
                "Median [q25, q75] over seeds at shares of each run's generated tokens (each series interpolated "
                f"linearly); the training reward is `{report_regime.REWARD_KEY}`, the fresh rollouts' reward on the "
                "training pool. Reward climbing while test accuracy stays is what an exhausted pool looks like.", "",
                _markdown(*rows)]
    return doc


def load_claims(sweep: Optional[str | Path], run_dirs: Sequence[Path]) -> tuple[Claim, ...]:
    """The claims of `sweep` (a sweep file), else of a claims.yaml beside the runs' setting folders."""
    raw, source = declared(sweep, run_dirs, "claims", CLAIMS_FILE, "sweeps each declare claims; name one with --sweep")
    return parse_claims(raw, source) if source else parse_claims(raw)


def _size(folder: Path) -> int:
    return sum(p.stat().st_size for p in sorted(folder.rglob("*")) if p.is_file())


def _copy(settings: Sequence[Setting], dest: Path) -> list[Path]:
    """Every run's trimmed copy at DEST/SETTING/RUN (report_data.copy_run); returns the copies."""
    copies = []
    for s in settings:
        for run in s.runs:
            copy_run(run, dest / s.name / run.dir.name)
            copies.append(dest / s.name / run.dir.name)
    return copies


def _staged(run_dirs: Sequence[str | Path]) -> list:
    # A bucket run's records (not its checkpoints), copied to the cache; a local run dir as it is.
    return [storage.staged_files(d, ("config.yaml", "metrics.jsonl", SUMMARY_FILE, EVAL_FILE)) for d in run_dirs]


def _selection(settings: Sequence[Setting], rule: Rule) -> tuple[dict, dict[str, float]]:
    """(arm -> learning rate -> setting, arm -> the chosen rate) of stage-1 settings."""
    grid = arm_grid(settings)
    return grid, choose(validation_scores(grid, rule), rule)


def _stage1_section(grid, rule: Rule, chosen: dict[str, float], where: str) -> list[str]:
    return [f"Rule (declared in the stage-1 sweep file before any run, `{where}`): {rule.describe()}. It reads "
            f"`eval/validation_accuracy` only; the test split's columns are shown for information and never read by "
            "it. Cells: `median [q25, q75]` over seeds.", "", _markdown(*stage1_rows(grid, rule, chosen))]


def stage1_report(run_dirs: Sequence[str | Path], out: Path, rule: Rule) -> str:
    """Stage 1 (runs of every arm at every learning rate): copies the runs into OUT/runs with the rule
    (OUT/runs/select.yaml), writes OUT/report.md with the stage-1 table and OUT/selected.yaml (arm ->
    learning rate); returns the table."""
    grid, chosen = _selection(group_settings(load_runs(run_dirs)), rule)  # refuse bad runs before writing
    copies = _copy([s for rates in grid.values() for s in rates.values()], out / "runs")
    (out / "runs" / SELECT_FILE).write_text(yaml.safe_dump(rule.as_dict(), sort_keys=False))
    grid, chosen = _selection(group_settings(load_runs(copies)), rule)
    write_selected(chosen, out / SELECTED_FILE)
    section = _stage1_section(grid, rule, chosen, f"runs/{SELECT_FILE}")
    doc = ["# Stage 1: each arm's learning rate", "",
           f"- **Selection:** `{SELECTED_FILE}` in this folder (arm: learning rate) is what a stage-2 sweep file's "
           "`stage1:` names; `jaxreplay sweep` refuses a stage-2 arm at any other rate.",
           f"- **Data:** every number here is rebuilt from `runs/` alone ({_size(out / 'runs') / 1e6:.2f} MB: each "
           "run's config.yaml, summary.json, eval.json and metrics.jsonl trimmed to the keys read, and the rule): "
           f"`{rebuild_command(None, ())}` in this folder writes this file and {SELECTED_FILE} again, byte for byte.",
           "", "## Learning rates (validation split)", "", *section, "## Chosen", "",
           _markdown(["arm", "learning rate"], [[arm, lr_tag(lr)] for arm, lr in chosen.items()])]
    (out / "report.md").write_text("\n".join(doc))
    return section[-1]


def report(run_dirs: Sequence[str | Path], out: str | Path, baseline: Optional[str] = None,
           mus: Sequence[float] = (), sweep: Optional[str | Path] = None, stage1: Sequence[str | Path] = (),
           replication: Sequence[str | Path] = ()) -> str:
    """Copies the runs into OUT/runs, then writes OUT/report.md and the PNGs from the copies;
    returns the claims and 90%-target tables. Stage-1 runs (a selection rule in `sweep` or beside
    them) get the stage-1 report instead (`stage1_report`); `stage1` (stage-1 run dirs, copied into
    OUT/stage1) adds the frontier at the first of `mus` and the stage-1 table."""
    out = Path(out)
    run_dirs = _staged(run_dirs)
    if given := next((d for d in run_dirs if _is_replication(d)), None):
        raise ConfigError(f"{given} is a replication's run ({REPLICATION_FILE} beside its setting folders): give it "
                          "with --replication, beside the study's runs, so that it is never pooled with their seeds")
    rule = load_rule(sweep, [Path(d) for d in run_dirs])
    if rule is not None:
        if stage1 or replication:
            raise ConfigError(f"{'--stage1' if stage1 else '--replication'}: these runs are stage 1 themselves (they "
                              "come with a selection rule); it goes with stage-2 (or single-stage) runs")
        return stage1_report(run_dirs, out, rule)
    claims = load_claims(sweep, [Path(d) for d in run_dirs])
    regime = load_regime(sweep, [Path(d) for d in run_dirs])
    if any(c.regime for c in claims) and regime is None:
        raise ConfigError("claims marked `regime` need the sweep's exhaustion rule (its `regime`, written to "
                          f"{report_regime.REGIME_FILE} beside the runs); none found")
    originals = group_settings(load_runs(run_dirs))
    original_pools = split_pools(originals, baseline)  # refuse a bad --baseline before writing anything
    stage1_dirs = _staged(stage1)
    if stage1:
        rule = _stage1_rule(stage1_dirs, mus)
        _check_stage2(originals, _selection(group_settings(load_runs(stage1_dirs)), rule)[1])
    pool_names = {s.name: b.name for b, members in original_pools for s in members}
    check_evaluations(claims, originals, original_pools[0][0].name, pool_names)
    replication_dirs = _staged(replication)
    if replication:
        check_replication(originals, group_settings(load_runs(replication_dirs)))
        check_evaluations(claims, group_settings(load_runs(replication_dirs)), original_pools[0][0].name, pool_names,
                          "--replication: ")
    copies = _copy(originals, out / "runs")
    if claims:
        (out / "runs" / CLAIMS_FILE).write_text(yaml.safe_dump(
            {c.name: {"text": c.text, "settings": list(c.settings), "measure": c.measure,
                      ("above" if c.above else "below"): c.threshold,
                      **({"mu": c.mu} if c.mu is not None else {}),
                      **({"ceiling": c.ceiling} if c.ceiling is not None else {}),
                      **({"baseline": c.baseline} if c.baseline is not None else {}),
                      **({"contrast": {"settings": list(c.contrast), "baseline": c.contrast_baseline}}
                         if c.contrast else {}),
                      **({"regime": True} if c.regime else {})} for c in claims},
            sort_keys=False, allow_unicode=True))
    if regime is not None:
        (out / "runs" / report_regime.REGIME_FILE).write_text(yaml.safe_dump(regime.as_dict(), sort_keys=False))
    settings = group_settings(load_runs(copies))
    pools = split_pools(settings, baseline)
    base = pools[0][0]
    pool_of = {s.name: b for b, members in pools for s in members}
    frontier_grid, stage1_doc, replication_doc = None, [], []
    if replication:
        replicated = group_settings(load_runs(replication_dirs))
        rep_copies = _copy(replicated, out / "replication")
        marks = {p for d in replication_dirs if (p := Path(d).resolve().parent.parent / REPLICATION_FILE).exists()}
        seeds = {"seeds": _seeds(replicated), "declared_seeds": _seeds(settings)}
        (out / "replication" / REPLICATION_FILE).write_text(
            marks.pop().read_text() if len(marks) == 1 else yaml.safe_dump(seeds, sort_keys=False))
        replication_doc = _replication_section(claims, pools, group_settings(load_runs(rep_copies)), regime)
    if stage1:
        stage1_copies = _copy(group_settings(load_runs(stage1_dirs)), out / "stage1")
        (out / "stage1" / SELECT_FILE).write_text(yaml.safe_dump(rule.as_dict(), sort_keys=False))
        frontier_grid, chosen = _selection(group_settings(load_runs(stage1_copies)), rule)
        stage1_doc = ["## Stage 1: learning rates (validation split)", "",
                      *_stage1_section(frontier_grid, rule, chosen, f"stage1/{SELECT_FILE}")]
    mu = measured_mu([r for s in settings for r in s.runs])
    all_mus = ([(f"measured µ = {fmt(mu)}", mu)] if mu is not None else []) + [(f"µ = {fmt(m)}", m) for m in mus]
    decided = None if regime is None else report_regime.decide(regime, settings)
    verdicts = claims_table(claims, settings, base.name, decided, {n: b.name for n, b in pool_of.items()}) \
        if claims else None
    size = _size(out / "runs") + (_size(out / "stage1") if stage1 else 0) + (
        _size(out / "replication") if replication else 0)
    doc = ["# Replay comparison", "", *_how_to_read(settings, pools, mu, mus, size,
                                                    rebuild_command(baseline, mus, bool(stage1), bool(replication))),
           "", *(["## Claims and verdicts", "", verdicts] if verdicts else []),
           *(_regime_section(decided, settings) if decided is not None else []),
           *replication_doc]
    targets = [{f: target_table(members, b, f, all_mus) for f in TARGET_FRACTIONS} for b, members in pools]
    sections = [(b, _pool_sections(members, b, pool_targets, all_mus, mus, frontier_grid, out, len(pools) > 1))
                for (b, members), pool_targets in zip(pools, targets)]
    if len(pools) == 1:
        before, after = sections[0][1]
        doc += [*before, *stage1_doc, *after]
    else:
        doc += stage1_doc
        for b, (before, after) in sections:
            doc += [f"## Pool of `{b.name}`: {pool_label(b, pools)}", "",
                    f"Settings {', '.join(n for n, home in pool_of.items() if home is b)}, each paired by seed with "
                    f"`{b.name}`.", "", *before, *after]
    (out / "report.md").write_text("\n".join(doc))
    nineties = [pool_targets[TARGET_FRACTIONS[-1]] for pool_targets in targets]
    return (verdicts + "\n" if verdicts else "") + "\n".join(nineties)


def _pool_sections(settings: Sequence[Setting], base: Setting, targets: dict[float, str], all_mus: Mus,
                   mus: Sequence[float], grid, out: Path, several: bool) -> tuple[list[str], list[str]]:
    """One pool's sections (every setting paired with `base`; `targets`: its cost tables by fraction): (those
    before the stage-1 table, the plots and runs after it). Among several pools, one heading level down and the
    pool's plots named after its baseline."""
    h, prefix = ("###", f"{base.name}_") if several else ("##", "")
    plot_mus = []
    for label, m in all_mus:
        share, _ = coverage(settings, base, m)
        partial = math.isfinite(share) and share < 1
        plot_mus.append((label + (f" ({base.name} covers {share:.0%} of the others' compute)" if partial else ""), m))
    main, paired, speed, passes = (main_table(settings, base), paired_table(settings, base),
                                   speed_table(settings, base), pass_table(settings, base))
    level = float(np.median([target(r, TARGET_FRACTIONS[-1]) for r in base.runs]))
    pngs = report_plots.write(settings, level, plot_mus, out, prefix) + report_age.write(settings, out, prefix)
    before = [*(_frontier_section(settings, grid, mus[0], out, h, prefix) if grid is not None else []),
              f"{h} Per setting", "", main,
              *([f"{h} Paired by seed: each run minus the {base.name} run of the same seed", "", paired]
                if paired else []),
              *[x for f in TARGET_FRACTIONS for x in
                (f"{h} Cost to {f:.0%} of the seed's {base.name} gain, × the same seed's {base.name} run", "",
                 targets[f])],
              *([f"{h} Compute budget coverage", "", coverage_table(settings, base, all_mus)] if all_mus else []),
              *([f"{h} Learning speed and stability", "", speed] if speed else []),
              *([f"{h} pass@k of the final policy (`jaxreplay eval ... --out RUN_DIR/eval.json`)", "", passes]
                if passes else [])]
    after = [f"{h} Plots", "", *[f"{h}# {title}\n\n![{title}]({p.name})\n" for p, title in pngs],
             f"{h} Runs", "", runs_table(settings, base)]
    return before, after


def _stage1_rule(stage1_dirs: Sequence[Path], mus: Sequence[float]) -> Rule:
    if not mus:
        raise ConfigError("--stage1: the frontier is drawn against modelled compute at the first --mu; give --mu")
    rule = load_rule(None, [Path(d) for d in stage1_dirs])
    if rule is None:
        raise ConfigError(f"--stage1: no {SELECT_FILE} beside the stage-1 runs (their sweep writes the rule there "
                          "before the first run)")
    return rule


def _check_stage2(settings: Sequence[Setting], chosen: dict[str, float]) -> None:
    """Each stage-2 setting named after a stage-1 arm runs at the rate stage 1 chose for it."""
    for s in settings:
        lr = learning_rate(s)
        if s.name in chosen and (lr is None or not math.isclose(lr, chosen[s.name], rel_tol=1e-9)):
            raise ConfigError(f"{s.runs[0].dir}: learning rate {'none' if lr is None else lr_tag(lr)} is not "
                              f"stage 1's choice for arm {s.name} ({lr_tag(chosen[s.name])})")


def _frontier_section(settings: Sequence[Setting], grid, mu: float, out: Path, h: str = "##",
                      prefix: str = "") -> list[str]:
    arms = report_frontier.frontier(settings, grid, mu)
    common = report_frontier.budget(arms)
    label = f"µ = {fmt(mu)}"
    stem = prefix + f"frontier_mu{mu:g}".replace(".", "_")
    title = report_plots.save(report_plots.frontier(arms, label, common), out / f"{stem}.png")
    return [f"{h} Optimality frontier at {label}", "",
            f"Test accuracy against modelled compute at {label} (the first --mu), each arm at the learning rate "
            "stage 1 chose for it (median [q25, q75] over seeds, each seed's evaluations interpolated linearly) "
            "and the best over the stage-1 grid (at each point the highest of the rates' median curves, and which "
            f"rate that is, where every rate's median reaches). The common budget {fmt(common)} is the least modelled "
            "compute any of these curves reaches: a run's last evaluation, a stage-1 rate's median.", "", _markdown(*report_frontier.rows(arms, common)), f"![{title}]({stem}.png)", ""]
