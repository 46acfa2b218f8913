"""The cost model of replay (Arnal et al., 2026, Thm. 4.5): the optimal staleness horizon
x* = N/R and replay ratio y* = B/R, and the Reverb settings that realise them.

Per learner update the learner trains on B rollouts and the actor generates R, so an
update costs c = B + mu*R training-rollout units (mu: generation cost over training
cost per rollout). Training on data up to x steps stale inflates gradient noise by
sigma(x) = (x/tau)^alpha, and rho weighs the variance of the batch against that of
the buffer. The cost to reach a target loss is, up to constants,

    f(x) = sigma(x)^2 * (1/sqrt(mu) + sqrt(rho + 1/x))^2,  at y = sqrt(mu / (rho + 1/x)),

minimised in closed form by y* = (-alpha + sqrt(alpha^2 + mu*rho*(1 - 2*alpha))) / rho and
x* = y*^2 / (2*alpha*(mu + y*)). An x* below 1 (a window shorter than one actor step)
means replay does not pay: train on-policy. The model takes one learner update per actor
step, so B = y*R: a run with another batch size realises another horizon
(`realised_horizon`), and `reverb_settings` gives both ways to realise x*.

The paper writes the compute ratio two ways, (1 + mu/y)/(1 + mu) with the replay ratio y
and (1 + W/T)/(1 + mu) with a split of W inference and T trainer devices; they agree only
at y = mu T/W, so `split_table` prints both, and `fit_table` recovers the mu behind its
Table 1.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import numpy as np


@dataclasses.dataclass(frozen=True)
class Optimum:
    mu: float
    rho: float
    alpha: float
    x: float  # staleness horizon N / R, in actor steps
    y: float  # replay ratio B / R = samples per insert

    @property
    def on_policy(self) -> bool:
        """x* < 1: the optimal window is shorter than one actor step's rollouts."""
        return self.x < 1.0

    @property
    def compute_ratio(self) -> float:
        """gamma = (1 + mu/y) / (1 + mu): compute per trained rollout relative to on-policy."""
        return (1.0 + self.mu / self.y) / (1.0 + self.mu)


def _check(mu: float, rho: float, alpha: float) -> None:
    if not (math.isfinite(mu) and mu > 0):
        raise ValueError(f"mu must be a positive finite number, got {mu}")
    if not (math.isfinite(rho) and rho > 0):
        raise ValueError(f"rho must be a positive finite number, got {rho}")
    if not 0 < alpha < 0.5:
        raise ValueError(f"alpha must be in (0, 0.5) for a finite optimum, got {alpha}")


def replay_ratio(mu: float, rho: float, x: float) -> float:
    """The best replay ratio for a staleness horizon x: y = sqrt(mu / (rho + 1/x))."""
    return math.sqrt(mu / (rho + 1.0 / x))


def cost(x: np.ndarray | float, mu: float, rho: float, alpha: float, tau: float = 1.0) -> np.ndarray | float:
    """f(x) = sigma(x)^2 (1/sqrt(mu) + sqrt(rho + 1/x))^2 with sigma(x) = (x/tau)^alpha."""
    x = np.asarray(x, np.float64)
    return (x / tau) ** (2 * alpha) * (1.0 / math.sqrt(mu) + np.sqrt(rho + 1.0 / x)) ** 2


def optimum(mu: float, rho: float, alpha: float) -> Optimum:
    """The closed-form minimiser of `cost`."""
    _check(mu, rho, alpha)
    y = (-alpha + math.sqrt(alpha ** 2 + mu * rho * (1 - 2 * alpha))) / rho
    x = y ** 2 / (2 * alpha * (mu + y))
    return Optimum(mu=mu, rho=rho, alpha=alpha, x=x, y=y)


def numeric_optimum(mu: float, rho: float, alpha: float, lo: float = 1e-3, hi: float = 1e6) -> Optimum:
    """Minimises `cost` numerically (log grid, then golden section): a check on the closed form."""
    _check(mu, rho, alpha)
    grid = np.geomspace(lo, hi, 4001)
    i = int(np.argmin(cost(grid, mu, rho, alpha)))
    a, b = math.log(grid[max(i - 1, 0)]), math.log(grid[min(i + 1, len(grid) - 1)])
    g = (math.sqrt(5) - 1) / 2
    f = lambda t: float(cost(math.exp(t), mu, rho, alpha))  # noqa: E731
    c, d = b - g * (b - a), a + g * (b - a)
    while b - a > 1e-12:
        if f(c) < f(d):
            b, d = d, c
            c = b - g * (b - a)
        else:
            a, c = c, d
            d = a + g * (b - a)
    x = math.exp((a + b) / 2)
    return Optimum(mu=mu, rho=rho, alpha=alpha, x=x, y=replay_ratio(mu, rho, x))


def realised_horizon(max_size: int, batch_size: int, samples_per_insert: float) -> float:
    """The staleness horizon a run realises, in model steps (one learner update each).

    The model generates R = B / y rollouts per update, so a FIFO window of N rollouts spans
    N * y / B updates; it equals x* = N/R only when B = y*R."""
    return max_size * samples_per_insert / batch_size


def _multiple(value: float, unit: int) -> int:
    """`value` rounded to the nearest positive multiple of `unit`."""
    return max(unit, unit * round(value / unit))


def reverb_settings(opt: Optimum, rollouts_per_step: int, batch_size: Optional[int] = None,
                    batch_unit: int = 1) -> dict[str, float | int | str]:
    """Config values realising `opt` with R = `rollouts_per_step` generated per actor step.

    The model takes one learner update per actor step, so B = y*R. Without `batch_size`,
    that B is set (rounded to a multiple of `batch_unit`: the mesh's data parallelism and
    the group size) with a window N = x*R; with the config's own `batch_size` B, the window
    is N = x*B/y* instead, which realises the same horizon at that B."""
    if opt.on_policy:
        return {"replay.mode": "on_policy"}
    settings: dict[str, float | int | str] = {"replay.mode": "replay", "replay.samples_per_insert": round(opt.y, 3)}
    if batch_size is None:
        settings["train.batch_size"] = _multiple(opt.y * rollouts_per_step, batch_unit)
        settings["replay.max_size"] = max(1, round(opt.x * rollouts_per_step))
    else:
        settings["train.batch_size"] = batch_size
        settings["replay.max_size"] = max(1, round(opt.x * batch_size / opt.y))
    return settings


# The paper's Table 1 splits of 8 devices into W inference and T trainer devices, the gammas it
# prints for them, and the replay ratios its runs reached there (measured on Qwen3-0.6B, not given
# by this model).
PAPER_SPLITS = ((7, 1), (6, 2), (5, 3), (4, 4))
PAPER_TABLE_GAMMA = {(7, 1): 1.29, (6, 2): 0.65, (5, 3): 0.43, (4, 4): 0.32}
PAPER_MEASURED_RATIO = {(7, 1): 1.0, (6, 2): 2.2, (5, 3): 5.6, (4, 4): 17.6}


def split_compute_ratio(inference: int, trainers: int, mu: float) -> float:
    """gamma = (1 + W/T) / (1 + mu): compute per update with a buffer vs on-policy."""
    return (1.0 + inference / trainers) / (1.0 + mu)


def ratio_compute_ratio(y: float, mu: float) -> float:
    """gamma = (1 + mu/y) / (1 + mu): the same ratio written with the replay ratio y."""
    return (1.0 + mu / y) / (1.0 + mu)


def split_replay_ratio(inference: int, trainers: int, mu: float) -> float:
    """The y at which the two gamma forms agree: 1 + mu/y = 1 + W/T, so y = mu T / W."""
    return mu * trainers / inference


@dataclasses.dataclass(frozen=True)
class TableFit:
    mu: float  # least squares over the table's gammas
    per_split: dict[tuple[int, int], float]  # the mu that gives each gamma exactly
    lo: float  # every mu in [lo, hi] rounds all gammas to the table's (nan, nan: none does)
    hi: float


def fit_table(table: dict[tuple[int, int], float] = PAPER_TABLE_GAMMA, decimals: int = 2) -> TableFit:
    """The mu behind a table of gamma = (1 + W/T)/(1 + mu): least squares in z = 1/(1 + mu) (the
    gammas are linear in it), each split's own exact mu, and the interval of mu that rounds every
    gamma to the table's `decimals`."""
    a = np.array([1.0 + w / t for w, t in table], np.float64)
    g = np.array(list(table.values()), np.float64)
    mu = 1.0 / float(a @ g / (a @ a)) - 1.0
    half = 0.5 * 10.0 ** -decimals
    lo = float(np.max(a / (g + half))) - 1.0
    hi = float(np.min(a / (g - half))) - 1.0
    if lo > hi:
        lo = hi = math.nan
    return TableFit(mu=mu, per_split={s: (1.0 + s[0] / s[1]) / v - 1.0 for s, v in table.items()}, lo=lo, hi=hi)


def describe_fit(fit: TableFit, table: dict[tuple[int, int], float] = PAPER_TABLE_GAMMA) -> str:
    """What `jaxreplay theory --fit-table` prints."""
    rounding = ("no mu rounds all four" if math.isnan(fit.lo) else
                f"every mu in [{fit.lo:.3f}, {fit.hi:.3f}] rounds all of them to the table's")
    lines = [f"Table 1's gammas, solved for mu in gamma = (1 + W/T)/(1 + mu): mu = {fit.mu:.3f} (least squares)",
             f"  {rounding}",
             "  W  T  table gamma  mu for it  gamma at fitted mu"]
    for (w, t), gamma in table.items():
        lines.append(f"  {w}  {t}  {gamma:.2f}         {fit.per_split[(w, t)]:.3f}      "
                     f"{split_compute_ratio(w, t, fit.mu):.3f}")
    return "\n".join(lines)


def split_table(mu: float, splits=PAPER_SPLITS) -> str:
    """Both forms of gamma per split: (1 + W/T)/(1 + mu) and the y = mu T/W at which it equals
    (1 + mu/y)/(1 + mu); and the paper's measured y with the gamma (1 + mu/y)/(1 + mu) it gives."""
    lines = [f"(W,T) device splits at mu={mu:g}: the two gamma forms agree only at y = mu T/W",
             "  W  T  gamma = (1 + W/T)/(1 + mu)  y = mu T/W  | paper's measured y  gamma = (1 + mu/y)/(1 + mu)"]
    for w, t in splits:
        measured = PAPER_MEASURED_RATIO.get((w, t))
        tail = "" if measured is None else f"{measured:<18g}  {ratio_compute_ratio(measured, mu):.2f}"
        lines.append(f"  {w}  {t}  {split_compute_ratio(w, t, mu):.2f}                       "
                     f"{split_replay_ratio(w, t, mu):<10.3g}  | {tail}")
    return "\n".join(lines)


def describe(opt: Optimum, rollouts_per_step: int, batch_size: Optional[int] = None, batch_unit: int = 1) -> str:
    """The report `jaxreplay theory` prints."""
    lines = [
        f"cost model: mu={opt.mu:g} rho={opt.rho:g} alpha={opt.alpha:g} R={rollouts_per_step}",
        f"x* = {opt.x:.2f}  (staleness horizon N/R, actor steps)",
        f"y* = {opt.y:.3f}  (replay ratio B/R = samples per insert)",
    ]
    if opt.on_policy:
        lines.append("x* < 1: replay does not pay at these constants; train on-policy")
    else:
        lines.append(f"compute per trained rollout vs on-policy: gamma = (1 + mu/y*)/(1 + mu) = {opt.compute_ratio:.3f}"
                     f" = (1 + W/T)/(1 + mu) at W/T = mu/y* = {opt.mu / opt.y:.3f}")
        if opt.y < 1:
            lines.append("y* < 1: fewer samples than rollouts generated; replay saves no compute here (gamma > 1)")
    show = lambda s: " ".join(f"{k}={v}" for k, v in s.items())  # noqa: E731
    lines.append("settings (B = y*R, N = x*R): " + show(reverb_settings(opt, rollouts_per_step, None, batch_unit)))
    if batch_size is not None and not opt.on_policy:
        lines.append(f"settings at train.batch_size={batch_size} (N = x*B/y*): "
                     + show(reverb_settings(opt, rollouts_per_step, batch_size)))
    lines.append(split_table(opt.mu))
    return "\n".join(lines)
