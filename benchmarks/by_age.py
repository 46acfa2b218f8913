"""Overhead of the staleness statistics by age (learn/staleness.py) on the demo's train step.

The same jitted step on the same batch, with each row's `age` (the statistics on) and without
(off: the batch carries no ages, so the step computes none); the two alternate step by step so
machine load hits both alike. Three repeats; the figure is the median of the repeats' median
ratios, printed with the load average."""

from __future__ import annotations

import os
import time
from pathlib import Path

import jax
import numpy as np

from benchmarks.learner import random_batch
from jaxreplay.config import load_config
from jaxreplay.learn.learner import make_optimizer, make_train_step
from jaxreplay.models.transformer import init_params
from jaxreplay.rollout.rollouts import to_device_batch

DEMO = Path(__file__).resolve().parents[1] / "configs" / "demo.yaml"


def run(steps: int = 200, repeats: int = 3) -> dict:
    config = load_config(DEMO)
    graphdef, params = init_params(config.model, 0)
    optimizer = make_optimizer(config.train)
    opt_state = optimizer.init(params)
    step = make_train_step(graphdef, config, optimizer)
    rng = np.random.default_rng(0)
    host = random_batch(config, config.train.batch_size, config.model.max_seq_len, rng)
    off = to_device_batch(host)
    on = to_device_batch({**host, "age": rng.integers(0, 24, config.train.batch_size)})
    for batch in (off, on):  # compile both
        params, opt_state, metrics = jax.block_until_ready(step(params, opt_state, batch, None))
    ratios, ms = [], []
    for _ in range(repeats):
        times = {"off": [], "on": []}
        for _ in range(steps):
            for name, batch in (("off", off), ("on", on)):
                t0 = time.perf_counter()
                params, opt_state, metrics = step(params, opt_state, batch, None)
                jax.device_get(metrics)
                times[name].append(time.perf_counter() - t0)
        ratios.append(float(np.median(times["on"]) / np.median(times["off"])))
        ms.append({k: 1e3 * float(np.median(v)) for k, v in times.items()})
    return {"overhead": float(np.median(ratios)) - 1, "ratios": ratios, "step_ms": ms,
            "load_avg": os.getloadavg(), "batch": config.train.batch_size, "length": config.model.max_seq_len}


if __name__ == "__main__":
    print(run())
