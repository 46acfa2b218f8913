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
means replay does not pay: train on-policy.
"""

from __future__ import annotations

import dataclasses
import math

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
    if not mu > 0:
        raise ValueError(f"mu must be positive, got {mu}")
    if not rho > 0:
        raise ValueError(f"rho must be positive, got {rho}")
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


def reverb_settings(opt: Optimum, rollouts_per_step: int) -> dict[str, float | int | str]:
    """Config values realising `opt` with R = `rollouts_per_step`: a FIFO window of x*R
    rollouts, each sampled y* times on average (the limiter holds the ratio whatever B is;
    B = y*R gives one learner update per actor step, as in the model)."""
    if opt.on_policy:
        return {"replay.mode": "on_policy"}
    return {
        "replay.mode": "replay",
        "replay.max_size": max(1, round(opt.x * rollouts_per_step)),
        "replay.samples_per_insert": round(opt.y, 3),
    }


def describe(opt: Optimum, rollouts_per_step: int) -> str:
    """The report `jaxreplay theory` prints."""
    lines = [
        f"cost model: mu={opt.mu:g} rho={opt.rho:g} alpha={opt.alpha:g} R={rollouts_per_step}",
        f"x* = {opt.x:.2f}  (staleness horizon N/R, actor steps)",
        f"y* = {opt.y:.3f}  (replay ratio B/R = samples per insert)",
    ]
    if opt.on_policy:
        lines.append("x* < 1: replay does not pay at these constants; train on-policy")
    else:
        lines.append(f"compute per trained rollout vs on-policy: gamma = {opt.compute_ratio:.3f}")
        if opt.y < 1:
            lines.append("y* < 1: fewer samples than rollouts generated; replay saves no compute here (gamma > 1)")
    lines.append("settings: " + " ".join(f"{k}={v}" for k, v in reverb_settings(opt, rollouts_per_step).items()))
    return "\n".join(lines)
