"""Setting `replay.samples_per_insert` from the mu a run measures (`replay.calibrate_steps` > 0).

Reverb fixes a table's rate limiter when the table is built, so "the ratio from the
measured mu" means a calibration phase first: after the warm start, and before the
table exists, time `calibrate_steps` generation calls (R rollouts each) and as many
learner updates (B rollouts each) on the run's own model and shapes, the first
(compiling) call of each left out, and on throwaway copies of the state, so training
itself is untouched. Then mu = generation seconds per rollout / training seconds per
rollout, and the cost model's best ratio for the configured window x = N/R,
y = sqrt(mu / (rho + 1/x)) (`theory.replay_ratio`), becomes `samples_per_insert`.

The result is saved as RUN_DIR/calibration.json and reused on resume: the restored
Reverb table was built with it, and a fresh measurement would differ.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxreplay.config import Config, validate
from jaxreplay.replay.theory import realised_horizon, replay_ratio
from jaxreplay.rollout.rollouts import to_device_batch

CALIBRATION_FILE = "calibration.json"


def measure_mu(config: Config, act: Callable[[int], tuple[dict, dict]], train_step, params, opt_state,
               learner_batch: Callable[[dict], dict] = to_device_batch, processes: int = 1) -> dict[str, float]:
    """Seconds per rollout generating and training, over `calibrate_steps` calls each after a compiling one.
    act(i): this process's rollouts for prompt batch i (and its stats); learner_batch: rows as the
    learner takes them (multi-host: each of the `processes` gives B/P rows of the global batch)."""
    k, b = config.replay.calibrate_steps, config.train.batch_size
    gen_s, items = 0.0, None
    for i in range(k + 1):
        start = time.perf_counter()
        items, _ = act(i)
        jax.block_until_ready(items["tokens"])
        if i:
            gen_s += time.perf_counter() - start
    rows = np.resize(np.arange(len(items["reward"])), b // processes)  # this process's share, from its last batch
    batch = learner_batch({key: value[rows] for key, value in items.items()})
    p, o = jax.tree.map(jnp.copy, params), jax.tree.map(jnp.copy, opt_state)  # the step donates its inputs
    train_s = 0.0
    for i in range(k + 1):
        start = time.perf_counter()
        p, o, metrics = train_step(p, o, batch, None)
        jax.block_until_ready(metrics["loss"])
        if i:
            train_s += time.perf_counter() - start
    gen_per, train_per = gen_s / (k * config.rollouts_per_step), train_s / (k * b)
    return {"generate_s_per_rollout": gen_per, "train_s_per_rollout": train_per, "mu": gen_per / train_per}


def horizon_mismatch(config: Config, samples_per_insert: float, tolerance: float = 0.1) -> str:
    """Why the run does not realise the cost model's horizon x = N/R, or "" when it does.

    The model takes one learner update per actor step (B = y*R); at another B the window
    spans N*y/B updates instead (`theory.realised_horizon`)."""
    r, b, rollouts = config.replay, config.train.batch_size, config.rollouts_per_step
    modelled = r.max_size / rollouts
    realised = realised_horizon(r.max_size, b, samples_per_insert)
    if abs(realised - modelled) <= tolerance * modelled:
        return ""
    return (f"train.batch_size={b} with samples_per_insert {samples_per_insert:g} realises a staleness horizon of "
            f"{realised:.3g} learner steps, not the modelled x = N/R = {modelled:.3g}: the model assumes "
            f"train.batch_size = y*R = {samples_per_insert * rollouts:.0f} (or replay.max_size = x*B/y = "
            f"{modelled * b / samples_per_insert:.0f} at this batch size)")


def calibrated(config: Config, run_dir: Path, measure: Callable[[], dict[str, float]],
               log: Callable[[str], None] = print, write: bool = True) -> Config:
    """`config` with `samples_per_insert` set from mu (measured now, or read back on resume).
    write: write calibration.json (multi-host: the leader only; every process measures alike)."""
    r = config.replay
    if r.mode != "replay" or r.calibrate_steps == 0:
        return config
    path = Path(run_dir) / CALIBRATION_FILE
    if path.exists():
        record: dict[str, Any] = json.loads(path.read_text())
    else:
        record = measure()
        x = r.max_size / config.rollouts_per_step
        record.update(rho=r.cost_rho, horizon=x, samples_per_insert=round(replay_ratio(record["mu"], r.cost_rho, x), 3))
        if write:
            path.write_text(json.dumps(record, indent=2) + "\n")
    spi = record["samples_per_insert"]
    log(f"calibration: mu {record['mu']:.3g} (generate {record['generate_s_per_rollout'] * 1e3:.3g} ms, "
        f"train {record['train_s_per_rollout'] * 1e3:.3g} ms per rollout) -> samples_per_insert {spi:g} "
        f"for a window of {record['horizon']:.3g} actor steps")
    mismatch = horizon_mismatch(config, spi)
    if mismatch:
        log(f"calibration: {mismatch}")
    resolved = dataclasses.replace(config, replay=dataclasses.replace(r, samples_per_insert=spi))
    validate(resolved)  # a ratio outside the limiter's window is refused here, before any table exists
    return resolved
