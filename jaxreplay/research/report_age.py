"""The report's figures by age: what each arm's stale rows cost the gradient.

Per setting and age bucket (learn/staleness.py): each run's statistic over its steps, weighed
by the bucket's rows in each step, then the median over seeds. Two figures, against age:
the share of tokens the paper's clip zeroes (low + high) and the k3 KL between the current
and the behaviour policy. Runs written before the by-age keys existed give no figure.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

from jaxreplay.learn.staleness import AGE_BUCKETS, key
from jaxreplay.research.report_data import RunData, Setting

_FIGURES = (  # (file, statistics summed, title, y label, y scale)
    ("age_clipfrac", ("clipfrac_low", "clipfrac_high"),
     "Staleness by age: share of tokens the paper's clip zeroes (clipfrac_low + clipfrac_high)",
     "clipped-token share", "linear"),
    ("age_kl", ("kl_k3",), "Staleness by age: k3 KL(behaviour || current) on the rows' tokens",
     "kl_k3 (log scale)", "log"),
)


def run_profile(run: RunData, stats: Sequence[str]) -> dict[str, float]:
    """Bucket -> the run's sum of `stats`, averaged over its steps weighed by the bucket's rows."""
    out = {}
    for bucket in AGE_BUCKETS:
        rows = [(r[key(bucket, "rows")], sum(r[key(bucket, s)] for s in stats)) for r in run.records
                if key(bucket, "rows") in r and all(key(bucket, s) in r for s in stats)]
        weight = sum(n for n, _ in rows)
        if weight > 0:
            out[bucket] = sum(n * v for n, v in rows) / weight
    return out


def setting_profile(setting: Setting, stats: Sequence[str]) -> dict[str, float]:
    """Bucket -> the median over the setting's seeds of `run_profile` (buckets some seed reached)."""
    profiles = [run_profile(r, stats) for r in setting.runs]
    return {b: float(np.median([p[b] for p in profiles if b in p])) for b in AGE_BUCKETS
            if any(b in p for p in profiles)}


def figures(settings: Sequence[Setting]):
    from matplotlib.figure import Figure
    import matplotlib

    palette = matplotlib.colormaps["tab10"].colors
    for stem, stats, title, ylabel, scale in _FIGURES:
        curves = [(s.name, setting_profile(s, stats)) for s in settings]
        if not any(profile for _, profile in curves):
            continue
        fig = Figure(figsize=(9.5, 4.8))
        ax = fig.subplots()
        for i, (name, profile) in enumerate(curves):
            xs = [AGE_BUCKETS.index(b) for b in profile]
            ys = [max(profile[b], 1e-12) if scale == "log" else profile[b] for b in profile]
            ax.plot(xs, ys, marker="o", color=palette[i % len(palette)], label=name)
        ax.set_xticks(range(len(AGE_BUCKETS)), AGE_BUCKETS)
        ax.set_xlabel("age of the row (learner version − policy_version)")
        ax.set_ylabel(ylabel)
        ax.set_yscale(scale)
        ax.set_title(f"{title}; median over seeds of each run's row-weighted mean")
        ax.legend(fontsize=8)
        yield stem, fig


def write(settings: Sequence[Setting], out: Path, prefix: str = "") -> list[tuple[Path, str]]:
    """Saves each figure as OUT/PREFIXSTEM.png; returns (path, title) pairs (none without by-age keys)."""
    written = []
    for stem, fig in figures(settings):
        fig.tight_layout()
        path = out / f"{prefix}{stem}.png"
        fig.savefig(path, dpi=110)
        written.append((path, fig.axes[0].get_title()))
    return written
