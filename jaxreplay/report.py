"""`jaxreplay report RUN_DIR... --out DIR`: side-by-side plots and a Markdown table.

Runs are grouped into settings: the seeds of one setting share their config except
`run.seed` and `run.dir`, and a setting is named after the folder holding its run
dirs (the sweep layout OUT/SETTING/seedS). The baseline is the on-policy setting
(`replay.mode: on_policy`) unless `--baseline` names another.

The table's "to baseline peak" columns: the target is the peak of the baseline's
seed-mean eval curve; for each run, the generated tokens (and estimated FLOPs) at its
first evaluation at or above the target, divided by the same quantity where the
baseline's seed-mean curve first reaches it. Mean and standard deviation are over the
seeds that reach the target, with how many did; a setting none of whose seeds reach
it says so.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np
import yaml

from jaxreplay.accounting import STALENESS_LABELS
from jaxreplay.metrics import read_metrics

_PASS_AT = re.compile(r"eval/pass@(\d+)$")
EVAL_FILE = "eval.json"  # `jaxreplay eval CONFIG --checkpoint RUN_DIR --k 1,8 --out RUN_DIR/eval.json`
# x axes of the accuracy plots: metrics key (cumulative, per step) and label.
_AXES = {
    "tokens": ("tokens/generated", "generated tokens"),
    "compute": ("compute/flops", "estimated compute (FLOPs)"),
    "wallclock": (None, "seconds in the loop (generate + train + replay; eval excluded)"),
}


@dataclasses.dataclass
class RunData:
    dir: Path
    config: dict[str, Any]
    records: list[dict[str, Any]]
    final_eval: dict[str, Any] = dataclasses.field(default_factory=dict)  # RUN_DIR/eval.json, if any

    def final_scores(self) -> dict[str, float]:
        """The final policy's scores from `jaxreplay eval ... --out RUN_DIR/eval.json`, each named
        with its temperature: pass@1_t0.1, then pass@{k}_t1.0 for every k evaluated."""
        from jaxreplay.eval import PASS1_KEY, PASSK_KEY, PASSK_TEMPERATURE  # as in table()

        scores = {PASS1_KEY: self.final_eval[PASS1_KEY]} if PASS1_KEY in self.final_eval else {}
        for k in sorted(self.final_eval.get(PASSK_KEY, {}), key=int):
            scores[f"pass@{k}_t{PASSK_TEMPERATURE}"] = self.final_eval[PASSK_KEY][k]
        return {name: float(value) for name, value in scores.items()}

    def series(self, key: Optional[str]) -> tuple[np.ndarray, np.ndarray]:
        """(steps, values) of `key` where present; key None: cumulative loop seconds."""
        steps, values = [], []
        for r in self.records:
            if key is None:
                parts = [r.get(k) for k in ("time/generate_s", "time/train_s", "time/replay_s")]
                value = sum(parts) if all(p is not None for p in parts) else None
            else:
                value = r.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                steps.append(r["step"])
                values.append(float(value))
        return np.asarray(steps, np.int64), np.asarray(values, np.float64)

    def at_step(self, key: Optional[str], step: int) -> float:
        """`key` at `step`; for step 0 (before any training) the cumulative counters are 0."""
        steps, values = self.series(key)
        hit = np.nonzero(steps == step)[0]
        if len(hit):
            return float(values[hit[0]])
        return 0.0 if step == 0 else float("nan")


@dataclasses.dataclass
class Setting:
    name: str
    runs: list[RunData]

    @property
    def on_policy(self) -> bool:
        return self.runs[0].config.get("replay", {}).get("mode") == "on_policy"

    def eval_curve(self) -> tuple[np.ndarray, np.ndarray]:
        """(steps evaluated by every seed, accuracy [seeds, steps])."""
        per_run = [dict(zip(*r.series("eval/accuracy"))) for r in self.runs]
        common = sorted(set.intersection(*(set(c) for c in per_run)))
        return np.asarray(common, np.int64), np.array([[c[s] for s in common] for c in per_run], np.float64)


def load_runs(run_dirs: Sequence[str | Path]) -> list[RunData]:
    runs = []
    for d in map(Path, run_dirs):
        if not (d / "metrics.jsonl").exists() or not (d / "config.yaml").exists():
            raise FileNotFoundError(f"{d} is not a run dir (needs metrics.jsonl and config.yaml)")
        final_eval = json.loads((d / EVAL_FILE).read_text()) if (d / EVAL_FILE).exists() else {}
        runs.append(RunData(dir=d, config=yaml.safe_load((d / "config.yaml").read_text()), records=read_metrics(d),
                            final_eval=final_eval))
    if not runs:
        raise ValueError("no run dirs given")
    return runs


def group_settings(runs: Sequence[RunData]) -> list[Setting]:
    """Groups by config without run.seed/run.dir; each group named after its run dirs' parent folder."""
    groups: dict[str, list[RunData]] = {}
    for run in runs:
        key = yaml.safe_dump({**run.config, "run": {k: v for k, v in run.config.get("run", {}).items()
                                                    if k not in ("seed", "dir")}}, sort_keys=True)
        groups.setdefault(key, []).append(run)
    settings, used = [], set()
    for members in groups.values():
        name = members[0].dir.resolve().parent.name or members[0].dir.name
        base, i = name, 2
        while name in used:
            name, i = f"{base}#{i}", i + 1
        used.add(name)
        settings.append(Setting(name=name, runs=sorted(members, key=lambda r: r.config.get("run", {}).get("seed", 0))))
    return settings


def pick_baseline(settings: Sequence[Setting], name: Optional[str]) -> Setting:
    if name is not None:
        for s in settings:
            if s.name == name:
                return s
        raise ValueError(f"--baseline {name!r} is not one of the settings: {', '.join(s.name for s in settings)}")
    on_policy = [s for s in settings if s.on_policy]
    if len(on_policy) != 1:
        raise ValueError(f"found {len(on_policy)} on-policy settings; name the baseline with --baseline "
                         f"(settings: {', '.join(s.name for s in settings)})")
    return on_policy[0]


def _first_reach(steps: np.ndarray, acc: np.ndarray, target: float) -> Optional[int]:
    hit = np.nonzero(acc >= target - 1e-12)[0]
    return int(steps[hit[0]]) if len(hit) else None


def cost_to_reach(setting: Setting, key: str, target: float) -> list[Optional[float]]:
    """Per run: `key` at its first evaluation with accuracy >= target (None if never)."""
    out = []
    for run in setting.runs:
        steps, acc = run.series("eval/accuracy")
        step = _first_reach(steps, acc, target)
        out.append(None if step is None else run.at_step(key, step))
    return out


def baseline_cost(baseline: Setting, key: str) -> tuple[float, float]:
    """(target accuracy, seed-mean `key` where the baseline's seed-mean curve first reaches it)."""
    steps, acc = baseline.eval_curve()
    mean = acc.mean(axis=0)
    target = float(mean.max())
    step = _first_reach(steps, mean, target)
    return target, float(np.mean([r.at_step(key, step) for r in baseline.runs]))


def _mean_std(values: Sequence[float]) -> str:
    if not values:
        return "n/a"
    if len(values) == 1:
        return f"{values[0]:.3g}"
    mean, std = float(np.mean(values)), float(np.std(values))
    return f"{mean:.3g} ± {0.0 if std < 1e-9 * max(1.0, abs(mean)) else std:.2g}"  # no float-noise spreads


def table(settings: Sequence[Setting], baseline: Setting) -> str:
    """The Markdown comparison table (one row per setting)."""
    from jaxreplay.eval import PASS1_KEY  # names eval.json's keys; imported here, as it brings in JAX

    pass_keys = sorted({k for s in settings for r in s.runs for rec in r.records for k in rec if _PASS_AT.match(k)},
                       key=lambda k: int(_PASS_AT.match(k).group(1)))
    target, base_tokens = baseline_cost(baseline, "tokens/generated")
    _, base_flops = baseline_cost(baseline, "compute/flops")
    finals_of = {id(r): r.final_scores() for s in settings for r in s.runs}
    final_names = sorted({name for scores in finals_of.values() for name in scores},
                         key=lambda name: (name != PASS1_KEY, int(name[5:].split("_")[0])))
    header = ["setting", "seeds", "peak eval acc", "final eval acc", *[f"peak {k[5:]}" for k in pass_keys],
              *[f"final {name} (jaxreplay eval)" for name in final_names],
              f"tokens to baseline peak ({target:.3f}), × baseline", "compute to baseline peak, × baseline",
              "replay ratio", "staleness mean", "mu (gen/train s per rollout)"]
    rows = []
    for s in settings:
        peaks = [float(np.max(r.series("eval/accuracy")[1])) for r in s.runs]
        finals = [float(r.series("eval/accuracy")[1][-1]) for r in s.runs]
        cells = [s.name + (" (baseline)" if s is baseline else ""), str(len(s.runs)), _mean_std(peaks),
                 _mean_std(finals)]
        for k in pass_keys:
            cells.append(_mean_std([float(np.max(v)) for r in s.runs if len(v := r.series(k)[1])]))
        for name in final_names:
            cells.append(_mean_std([finals_of[id(r)][name] for r in s.runs if name in finals_of[id(r)]]))
        for key, base in (("tokens/generated", base_tokens), ("compute/flops", base_flops)):
            reached = [c / base for c in cost_to_reach(s, key, target) if c is not None and base > 0]
            if base == 0:
                cells.append("baseline peak is the start")
            elif not reached:
                cells.append(f"never reaches {target:.3f}")
            else:
                cells.append(f"{_mean_std(reached)} ({len(reached)}/{len(s.runs)} seeds)")
        for key in ("replay/ratio", "staleness/mean", "cost/mu"):
            last = [v[-1] for r in s.runs if len(v := r.series(key)[1])]
            cells.append(_mean_std(last) if key != "staleness/mean" else
                         _mean_std([float(np.mean(r.series(key)[1])) for r in s.runs if len(r.series(key)[1])]))
        rows.append(cells)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def _band(ax, setting: Setting, xkey: Optional[str], color) -> None:
    """Seed-mean eval accuracy against `xkey` (seed-mean x at each eval step), min-max band across seeds."""
    steps, acc = setting.eval_curve()
    if not len(steps):
        return
    x = np.array([[r.at_step(xkey, int(s)) for s in steps] for r in setting.runs]).mean(axis=0)
    ax.plot(x, acc.mean(axis=0), color=color, label=f"{setting.name} ({len(setting.runs)} seeds)", marker=".")
    if len(setting.runs) > 1:
        ax.fill_between(x, acc.min(axis=0), acc.max(axis=0), color=color, alpha=0.2, linewidth=0)


def _per_step(ax, setting: Setting, key: str, color) -> None:
    curves = [r.series(key) for r in setting.runs]
    curves = [c for c in curves if len(c[0])]
    if not curves:
        return
    common = sorted(set.intersection(*(set(c[0].tolist()) for c in curves)))
    ys = np.array([[dict(zip(c[0].tolist(), c[1]))[s] for s in common] for c in curves])
    ax.plot(common, ys.mean(axis=0), color=color, label=setting.name)
    if len(curves) > 1:
        ax.fill_between(common, ys.min(axis=0), ys.max(axis=0), color=color, alpha=0.2, linewidth=0)


def plots(settings: Sequence[Setting], out: Path, target: Optional[float] = None) -> list[Path]:
    """Writes the PNGs (accuracy plots with a dashed line at `target`, the baseline's peak); returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = plt.get_cmap("tab10").colors
    written = []

    def save(fig, name):
        fig.tight_layout()
        path = out / name
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

    for name, (key, label) in _AXES.items():
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for i, s in enumerate(settings):
            _band(ax, s, key, colors[i % len(colors)])
        if target is not None:
            ax.axhline(target, color="gray", linestyle="--", linewidth=1, label=f"baseline peak {target:.3f}")
        ax.set_xlabel(label)
        ax.set_ylabel("eval accuracy (mean, min-max band over seeds)")
        ax.set_title(f"eval accuracy vs {label.split(' (')[0]}")
        ax.grid(alpha=0.3)
        ax.legend()
        save(fig, f"accuracy_vs_{name}.png")

    for key, ylabel, fname in (("entropy", "policy entropy (nats/token)", "entropy.png"),
                               ("staleness/mean", "mean staleness of the batch (learner steps)", "staleness.png"),
                               ("replay/ratio", "measured samples per insert", "replay_ratio.png")):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for i, s in enumerate(settings):
            _per_step(ax, s, key, colors[i % len(colors)])
        ax.set_xlabel("learner step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend()
        save(fig, fname)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    width = 0.8 / max(len(settings), 1)
    for i, s in enumerate(settings):
        hist = np.zeros(len(STALENESS_LABELS))
        for r in s.runs:
            for rec in r.records:
                if isinstance(rec.get("staleness/hist"), list):
                    hist += np.asarray(rec["staleness/hist"], np.float64)
        if hist.sum():
            ax.bar(np.arange(len(hist)) + i * width, hist / hist.sum(), width, color=colors[i % len(colors)],
                   label=s.name)
    ax.set_xticks(np.arange(len(STALENESS_LABELS)) + 0.4 - width / 2, STALENESS_LABELS)
    ax.set_xlabel("staleness of a sampled rollout (learner steps)")
    ax.set_ylabel("share of sampled rollouts")
    ax.grid(alpha=0.3, axis="y")
    ax.legend()
    save(fig, "staleness_hist.png")
    return written


def report(run_dirs: Sequence[str | Path], out: str | Path, baseline: Optional[str] = None) -> str:
    """Writes OUT/report.md and the PNGs; returns the Markdown table."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    settings = group_settings(load_runs(run_dirs))
    base = pick_baseline(settings, baseline)
    text = table(settings, base)
    pngs = plots(settings, out, target=baseline_cost(base, "tokens/generated")[0])
    doc = ["# Replay comparison", "", f"Baseline: `{base.name}`. Runs: " +
           ", ".join(f"`{r.dir}`" for s in settings for r in s.runs), "", text, "",
           *[f"![{p.stem}]({p.name})" for p in pngs], ""]
    (out / "report.md").write_text("\n".join(doc))
    return text
