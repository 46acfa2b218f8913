"""`jaxreplay report RUN_DIR... --out DIR [--baseline NAME] [--mu 5.28,6.84]`: tables and plots.

Every number is a median over the seeds of a setting with its interquartile range
(report_stats). The baseline is the on-policy setting unless `--baseline` names
another; its peak is the peak of its median eval-accuracy curve against generated
tokens. A run reaches that peak at its first evaluation at or above it; what it spent
until then (generated tokens, modelled compute at each mu) is divided by the
baseline's median over its seeds that reach it, so the baseline's own row sits near
1 and a setting below 1 got there cheaper. Only the seeds that reach the peak enter
that median; the table says how many did.

Compute is modelled as the paper does (cost per update B + mu R): trained rollouts +
mu x generated rollouts, at the mu the runs measured (the median of each run's last
logged `cost/mu`) and at every mu given with `--mu`.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from jaxreplay.research import report_plots
from jaxreplay.research.report_data import (
    EVAL_FILE, SUMMARY_FILE, RunData, Setting, group_settings, load_runs, measured_mu, pick_baseline)
from jaxreplay.research.report_stats import band, cell, clean, first_reach, fmt, largest_fall
from jaxreplay.train.eval import PASS1_KEY, PASSK_KEY

END_WINDOW = 10  # "entropy at the end": the mean over a run's last END_WINDOW logged steps, per-batch noise damped
BUDGET_FRACTIONS = (0.25, 0.5, 1.0)  # where the speed table reads each run's accuracy, as shares of the common budget

Mus = Sequence[tuple[str, float]]  # (label, mu) of the compute axes


def baseline_peak(base: Setting) -> float:
    """Peak of the baseline's median eval accuracy against generated tokens (learner steps if untracked)."""
    for axis in ("tokens", "steps"):
        b = band([(r.x(axis, steps), acc) for r in base.runs for steps, acc in [r.evals()]])
        if b is not None:
            return float(b[2].max())
    raise AssertionError("learner steps are always known")


def reach(setting: Setting, target: float, axis: str, mu: Optional[float] = None) -> list[Optional[float]]:
    """Per run: `axis` at its first evaluation with accuracy >= target (None if never, or untracked)."""
    out = []
    for run in setting.runs:
        steps, acc = run.evals()
        x = first_reach(run.x(axis, steps, mu), acc, target)
        out.append(x if x is not None and np.isfinite(x) else None)
    return out


def baseline_cost(base: Setting, target: float, axis: str, mu: Optional[float] = None) -> Optional[float]:
    """Median over the baseline's seeds that reach `target` of what they spent (None if none is tracked)."""
    hits = [v for v in reach(base, target, axis, mu) if v is not None]
    return float(np.median(hits)) if hits else None


def to_baseline(setting: Setting, base: Setting, target: float, axis: str, mu: Optional[float] = None) -> str:
    """'median [IQR] (k/n)' of what each seed spent to reach `target`, as a multiple of the baseline's."""
    ref = baseline_cost(base, target, axis, mu)
    if ref is None:
        return "n/a"
    if ref == 0:
        return "baseline peak is the start"
    hits = [v / ref for v in reach(setting, target, axis, mu) if v is not None]
    n = len(setting.runs)
    return f"{cell(hits)} ({len(hits)}/{n})" if hits else f"never reaches {target:.3f} (0/{n})"


def _markdown(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows]) + "\n"


def _end_entropy(run: RunData) -> Optional[float]:
    values = run.series("entropy")[1][-END_WINDOW:]
    return float(values.mean()) if len(values) else None


def _ref(value: Optional[float]) -> str:
    return "n/a" if value is None else fmt(value)


def _name(s: Setting, base: Setting) -> str:
    return s.name + (" (baseline)" if s is base else "")


def main_table(settings: Sequence[Setting], base: Setting, target: float, mus: Mus) -> str:
    """Per setting: peak and final accuracy, tokens and compute to the baseline peak, entropy at the end."""
    tokens_ref = baseline_cost(base, target, "tokens")
    header = ["setting", "seeds", "peak eval accuracy", "final eval accuracy",
              f"tokens to {base.name} peak {target:.3f} (multiple of {_ref(tokens_ref)} tokens)",
              *[f"compute to {base.name} peak at {label} (multiple of "
                f"{_ref(baseline_cost(base, target, 'compute', mu))} units)" for label, mu in mus],
              f"entropy at end (last {END_WINDOW} steps)", "replay ratio (target)", "mean staleness"]
    rows = []
    for s in settings:
        rows.append([
            _name(s, base), str(len(s.runs)),
            cell([float(np.max(r.evals()[1])) for r in s.runs]),
            cell([float(r.evals()[1][-1]) for r in s.runs]),
            to_baseline(s, base, target, "tokens"),
            *[to_baseline(s, base, target, "compute", mu) for _, mu in mus],
            cell([_end_entropy(r) for r in s.runs]),
            f"{cell([r.last('replay/ratio') for r in s.runs])} ({fmt(s.spi_target)})",
            cell([float(np.mean(v)) for r in s.runs if len(v := r.series("staleness/mean")[1])]),
        ])
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


def compute_table(settings: Sequence[Setting], base: Setting, target: float, mus: Mus) -> str:
    """Compute to the baseline peak at every mu, as multiples of the baseline's."""
    header = ["setting", *[f"{label} (× {_ref(baseline_cost(base, target, 'compute', mu))} units)"
                           for label, mu in mus]]
    rows = [[_name(s, base), *[to_baseline(s, base, target, "compute", mu) for _, mu in mus]] for s in settings]
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


def paired_table(settings: Sequence[Setting], base: Setting) -> Optional[str]:
    """Each run minus the baseline's run of the same seed. A sweep's seed fixes the warm start and
    the evaluation problems for every setting, so the pairs cancel what seeds share: a sharper
    test than comparing the two settings' medians. None if no seed is in both."""
    by_seed = {r.seed: r for r in base.runs}
    ks = sorted({int(k) for s in settings for r in s.runs for k in r.final_eval.get(PASSK_KEY, {})})
    measures = [("peak accuracy", lambda r: float(np.max(r.evals()[1]))),
                ("final accuracy", lambda r: float(r.evals()[1][-1])),
                *[(f"pass@{k} (T 1.0)", lambda r, k=str(k): r.pass_at(k)) for k in ks]]
    rows = []
    for s in settings:
        pairs = [(r, by_seed[r.seed]) for r in s.runs if r.seed in by_seed]
        if s is base or not pairs:
            continue
        diffs = [[a - b for r, ref in pairs if (a := get(r)) is not None and (b := get(ref)) is not None]
                 for _, get in measures]
        rows.append([s.name, str(len(pairs)), *[cell(d) for d in diffs]])
    if not rows:
        return None
    return _markdown(["setting", "seeds paired", *[f"{name} − {base.name}'s" for name, _ in measures]], rows)


def runs_table(settings: Sequence[Setting], target: float) -> str:
    """One row per run: where it got, what it spent, and when it reached the baseline peak."""
    header = ["setting", "run", "learner steps", "peak acc", "final acc", "generated tokens",
              "generated / trained rollouts", "measured µ", "loop seconds (no compilation)",
              f"tokens to {target:.3f}"]
    rows = []
    for s in settings:
        for run, hit in zip(s.runs, reach(s, target, "tokens")):
            step = int(run.records[-1]["step"])
            rows.append([s.name, run.dir.name, str(step), fmt(np.max(run.evals()[1])), fmt(run.evals()[1][-1]),
                         fmt(run.value("tokens/generated", step)),
                         f"{fmt(run.generated(step))} / {fmt(run.trained(step))}",
                         fmt(run.last("cost/mu") or float("nan")), fmt(run.seconds(step)),
                         "never" if hit is None else fmt(hit)])
    return _markdown(header, rows)


def _how_to_read(settings: Sequence[Setting], base: Setting, target: float, mu: Optional[float],
                 given: Sequence[float]) -> list[str]:
    runs = [r for s in settings for r in s.runs]
    timed = sum(r.timed for r in runs)
    mus = [m for r in runs if (m := r.last("cost/mu")) is not None]
    measured = (f"measured µ = {fmt(mu)}: the median of the last cost/mu of the {len(mus)} runs that logged it "
                f"(range {fmt(min(mus))} to {fmt(max(mus))})" if mu is not None else
                "no run logged cost/mu, so only the given µ are modelled")
    return [
        "- **Statistic:** every number is the median over a setting's seeds, with the interquartile range "
        "(25th to 75th percentile, linear interpolation between seeds) in brackets: `median [q25, q75]`. "
        "Bands in the plots are the same IQR, after interpolating each seed's curve linearly onto one x grid "
        "(the seeds' own x values inside the range every seed covers).",
        f"- **Baseline:** `{base.name}`. Its peak, {target:.4f}, is the peak of its median eval-accuracy curve "
        "against generated tokens. A run reaches it at its first evaluation at or above it; the tokens or compute "
        "spent until then are divided by the baseline's median over its seeds that reach it. Only seeds that "
        "reach it enter the median; `(k/n)` says how many of n did.",
        "- **Compute:** trained rollouts + µ × generated rollouts, in units of training one rollout (the paper's "
        f"cost per update B + µR). {measured[0].upper() + measured[1:]}. Given with --mu: "
        f"{', '.join(fmt(m) for m in given) or 'none'}.",
        f"- **Wall-clock:** seconds generating, training and on replay, evaluation left out. Compilation is left "
        f"out: {timed} of {len(runs)} runs logged the accounting's timed seconds (first generate and train call "
        f"of each process left out); the other {len(runs) - timed} count from their first learner step, "
        "which holds both first calls.",
    ]


def _copy_run_files(settings: Sequence[Setting], out: Path) -> None:
    """OUT/runs/SETTING/RUN/{config.yaml, summary.json, eval.json}: small enough to commit with the report."""
    for s in settings:
        for run in s.runs:
            dest = out / "runs" / s.name / run.dir.name
            dest.mkdir(parents=True, exist_ok=True)
            for name in ("config.yaml", SUMMARY_FILE, EVAL_FILE):
                if (run.dir / name).exists() and (run.dir / name).resolve() != (dest / name).resolve():
                    shutil.copyfile(run.dir / name, dest / name)


def report(run_dirs: Sequence[str | Path], out: str | Path, baseline: Optional[str] = None,
           mus: Sequence[float] = ()) -> str:
    """Writes OUT/report.md, the PNGs and OUT/runs/; returns the main and compute tables."""
    out = Path(out)
    settings = group_settings(load_runs(run_dirs))
    base = pick_baseline(settings, baseline)
    out.mkdir(parents=True, exist_ok=True)
    target = baseline_peak(base)
    mu = measured_mu([r for s in settings for r in s.runs])
    all_mus = ([(f"measured µ = {fmt(mu)}", mu)] if mu is not None else []) + [(f"µ = {fmt(m)}", m) for m in mus]
    main_mus = all_mus[:2] if mu is not None else all_mus[:1]  # the measured µ and the first given
    main, compute = main_table(settings, base, target, main_mus), compute_table(settings, base, target, all_mus)
    passes, speed, paired = pass_table(settings, base), speed_table(settings, base), paired_table(settings, base)
    pngs = report_plots.write(settings, target, all_mus, out)
    _copy_run_files(settings, out)
    doc = ["# Replay comparison", "", *_how_to_read(settings, base, target, mu, mus), "",
           "## Per setting", "", main,
           *(["## Learning speed and stability", "", speed] if speed else []),
           *([f"## Paired by seed: each run minus the {base.name} run of the same seed", "", paired]
             if paired else []),
           "## Compute to the baseline peak, × the baseline's", "",
           compute if all_mus else "No µ: no run logged cost/mu and none was given with --mu.\n",
           *(["## pass@k of the final policy (`jaxreplay eval ... --out RUN_DIR/eval.json`)", "", passes]
             if passes else []),
           "## Plots", "", *[f"### {title}\n\n![{title}]({p.name})\n" for p, title in pngs],
           "## Runs", "", runs_table(settings, target),
           "Per-run config.yaml, summary.json and eval.json are copied under `runs/`.", ""]
    (out / "report.md").write_text("\n".join(doc))
    return main + "\n" + (compute if all_mus else "")
