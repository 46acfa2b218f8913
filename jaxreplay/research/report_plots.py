"""The figures of `jaxreplay report`: per setting, the median over seeds with an IQR band.

Every figure carries a title (the report uses it as the caption). Figures are plain
`matplotlib.figure.Figure`s, not pyplot ones, so nothing global is left open.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator, Optional, Sequence

import numpy as np

from jaxreplay.research.report_data import Setting
from jaxreplay.research.report_stats import band, fmt, quartiles
from jaxreplay.train.accounting import STALENESS_LABELS
from jaxreplay.train.eval import PASSK_KEY

BAND = "median over seeds, IQR band"
_ACCURACY_AXES = (
    ("tokens", "generated tokens", "generated tokens"),
    ("steps", "learner steps", "learner step"),
    ("flops", "estimated FLOPs", "estimated compute (FLOPs: 2N per generated, 6N per trained token)"),
    ("wallclock", "wall-clock seconds", "seconds generating, training and on replay (compilation and eval left out)"),
)
_PER_STEP = (  # (file, metrics key, title, y label, y scale)
    ("entropy", "entropy", "Policy entropy", "entropy (nats/token)", "linear"),
    # KL spans orders of magnitude: about 1e-9 on fresh batches, 1 and more on stale ones
    ("drift_approx_kl", "approx_kl", "Drift: approx_kl (k3 estimate of KL(behaviour || current))",
     "approx_kl (log scale)", "log"),
    ("drift_clipfrac", "pg_clipfrac", "Drift: share of tokens clipped by PPO (pg_clipfrac)", "pg_clipfrac", "linear"),
)


def _figure():
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9.5, 4.8))
    return fig, fig.subplots()


def _colors(n: int):
    import matplotlib

    palette = matplotlib.colormaps["tab10"].colors
    return [palette[i % len(palette)] for i in range(n)]


def _plot_band(ax, curves, color, label: str) -> Optional[np.ndarray]:
    """Median line with the IQR band; returns the grid (None if the curves share no x range)."""
    b = band(curves)
    if b is None:
        return None
    grid, q1, med, q3 = b
    ax.plot(grid, med, color=color, label=label, marker="." if len(grid) < 40 else None)
    if len(curves) > 1:
        ax.fill_between(grid, q1, q3, color=color, alpha=0.2, linewidth=0)
    return grid


def _finish(ax, title: str, xlabel: str, ylabel: str) -> None:
    ax.set_title(title, fontsize=10)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:  # outside the axes: ten settings' curves leave no free corner
        ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)


def accuracy(settings: Sequence[Setting], axis: str, title: str, xlabel: str, target: Optional[float],
             mu: Optional[float] = None):
    fig, ax = _figure()
    for s, color in zip(settings, _colors(len(settings))):
        curves = []
        for run in s.runs:
            steps, acc = run.evals()
            curves.append((run.x(axis, steps, mu), acc))
        _plot_band(ax, curves, color, f"{s.name} ({len(s.runs)} seeds)")
    if target is not None:
        ax.axhline(target, color="gray", linestyle="--", linewidth=1,
                   label=f"90% of the baseline's gain {target:.3f} (median over seeds)")
    _finish(ax, f"Eval accuracy vs {title} ({BAND})", xlabel, "eval accuracy (greedy)")
    return fig


def per_step(settings: Sequence[Setting], key: str, title: str, ylabel: str):
    """`key` against learner steps; returns (figure, axes) so callers can add reference lines."""
    fig, ax = _figure()
    for s, color in zip(settings, _colors(len(settings))):
        _plot_band(ax, [r.series(key) for r in s.runs], color, s.name)
    _finish(ax, f"{title} ({BAND})", "learner step", ylabel)
    return fig, ax


def replay_ratio(settings: Sequence[Setting]):
    fig, ax = per_step(settings, "replay/ratio", "Measured replay ratio; dashed: target replay.samples_per_insert",
                       "samples / inserts so far")
    for s, color in zip(settings, _colors(len(settings))):
        ax.axhline(s.spi_target, color=color, linestyle="--", linewidth=1)
    return fig


def staleness(settings: Sequence[Setting]):
    fig, ax = per_step(settings, "staleness/mean",
                       "Mean staleness of sampled batches; dashed: horizon N/R, in learner steps",
                       "staleness (learner steps)")
    stacked: dict[float, int] = {}  # settings sharing a horizon: their labels stack above its line
    for s, color in zip(settings, _colors(len(settings))):
        if (h := s.horizon()) is not None:
            n_over_r, span = h
            ax.axhline(span, color=color, linestyle="--", linewidth=1)
            above = stacked[span] = stacked.get(span, -1) + 1
            ax.annotate(f"{s.name}: N/R = {fmt(n_over_r)} actor steps = {fmt(span)} learner steps",
                        (0.01, span), xycoords=("axes fraction", "data"), xytext=(0, 1 + 9 * above),
                        textcoords="offset points", color=color, fontsize="x-small", va="bottom")
    if stacked:  # room for the labels above the highest line
        ax.set_ylim(top=max(ax.get_ylim()[1], max(stacked) * (1.1 + 0.07 * max(stacked.values()))))
    return fig


def staleness_hist(settings: Sequence[Setting]):
    fig, ax = _figure()
    width = 0.8 / max(len(settings), 1)
    for i, (s, color) in enumerate(zip(settings, _colors(len(settings)))):
        hist = np.zeros(len(STALENESS_LABELS))
        for r in s.runs:
            for rec in r.records:
                if isinstance(rec.get("staleness/hist"), list) and len(rec["staleness/hist"]) == len(hist):
                    hist += np.asarray(rec["staleness/hist"], np.float64)
        if hist.sum():
            ax.bar(np.arange(len(hist)) + i * width, hist / hist.sum(), width, color=color, label=s.name)
    ax.set_xticks(np.arange(len(STALENESS_LABELS)) + 0.4 - width / 2, STALENESS_LABELS)
    _finish(ax, "Staleness of sampled rollouts (all steps and seeds pooled)",
            "staleness of a sampled rollout (learner steps)", "share of sampled rollouts")
    return fig


def pass_at_k(settings: Sequence[Setting]):
    fig, ax = _figure()
    for s, color in zip(settings, _colors(len(settings))):
        ks = sorted({int(k) for r in s.runs for k in r.final_eval.get(PASSK_KEY, {})})
        points = [(k, quartiles(v)) for k in ks if (v := [p for r in s.runs if (p := r.pass_at(str(k))) is not None])]
        if points:
            k, q = np.array([p[0] for p in points]), np.array([p[1] for p in points])
            n = sum(1 for r in s.runs if r.final_eval)
            ax.errorbar(k, q[:, 1], yerr=[q[:, 1] - q[:, 0], q[:, 2] - q[:, 1]], color=color, marker="o",
                        capsize=3, label=f"{s.name} ({n} runs with eval.json)")
    ax.set_xscale("log", base=2)
    ks = sorted({int(k) for s in settings for r in s.runs for k in r.final_eval.get(PASSK_KEY, {})})
    ax.set_xticks(ks, [str(k) for k in ks])
    ax.minorticks_off()
    _finish(ax, "pass@k of the final policy, temperature 1.0 (median over seeds, IQR bars)", "k",
            "pass@k (unbiased estimate)")
    return fig


def figures(settings: Sequence[Setting], target: Optional[float],
            mus: Sequence[tuple[str, float]]) -> Iterator[tuple[str, object]]:
    """(file stem, figure) for every plot of the report; `mus` are (label, mu) for the compute axes."""
    for axis, title, xlabel in _ACCURACY_AXES:
        yield f"accuracy_vs_{axis}", accuracy(settings, axis, title, xlabel, target)
    for label, mu in mus:
        stem = "accuracy_vs_compute_" + ("measured_mu" if label.startswith("measured") else
                                         f"mu{mu:g}".replace(".", "_"))
        yield stem, accuracy(settings, "compute", f"modelled compute at {label}",
                             f"trained rollouts + µ × generated rollouts (units of training one rollout), {label}",
                             target, mu)
    for stem, key, title, ylabel, scale in _PER_STEP:
        fig, ax = per_step(settings, key, title, ylabel)
        ax.set_yscale(scale)
        yield stem, fig
    yield "staleness", staleness(settings)
    yield "staleness_hist", staleness_hist(settings)
    yield "replay_ratio", replay_ratio(settings)
    if any(r.final_eval for s in settings for r in s.runs):
        yield "pass_at_k", pass_at_k(settings)


def frontier(arms, label: str, common: float):
    """Test accuracy against modelled compute at µ: per arm (report_frontier.ArmFrontier) the median over
    seeds at its chosen learning rate with the IQR band and, dashed, the best over the stage-1 grid."""
    fig, ax = _figure()
    for arm, color in zip(arms, _colors(len(arms))):
        _plot_band(ax, arm.runs, color, f"{arm.name} at its chosen lr ({len(arm.runs)} seeds)")
        envelope = arm.envelope()
        if envelope is not None and len(envelope[0]):
            ax.plot(*envelope, color=color, linestyle="--", linewidth=1.2,
                    label=f"{arm.name}: best over the stage-1 grid ({len(arm.medians)} lrs)")
    ax.axvline(common, color="gray", linestyle=":", linewidth=1, label="common budget (the frontier table's 100%)")
    _finish(ax, f"Frontier at {label}: chosen lr (median, IQR band); dashed: best over stage-1 lrs",
            f"trained rollouts + µ × generated rollouts (units of training one rollout), {label}",
            "test accuracy (greedy)")
    return fig


def save(fig, path: Path) -> str:
    """Saves one figure as PATH; returns its title."""
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return fig.axes[0].get_title()


def write(settings: Sequence[Setting], target: Optional[float], mus: Sequence[tuple[str, float]],
          out: Path, prefix: str = "") -> list[tuple[Path, str]]:
    """Saves every figure as OUT/PREFIXSTEM.png; returns (path, title) pairs."""
    written = []
    for stem, fig in figures(settings, target, mus):
        fig.tight_layout()
        path = out / f"{prefix}{stem}.png"
        fig.savefig(path, dpi=110)
        written.append((path, fig.axes[0].get_title()))
    return written
