"""Learner throughput on the demo model: completion tokens trained per second, and the
share of a step spent outside the jitted update (host batch -> device arrays, fetching
the metrics back), which is what a learner step costs beyond the compiled program."""

from __future__ import annotations

import time

import jax
import numpy as np

from jaxreplay.config import Config
from jaxreplay.learn.learner import make_optimizer, make_train_step
from jaxreplay.models.transformer import init_params
from jaxreplay.rollout.rollouts import to_device_batch


def random_batch(config: Config, rows: int, length: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """A host batch shaped like the reader's: prompt in the first half, completion after."""
    tokens = rng.integers(0, config.model.vocab_size, (rows, length)).astype(np.int32)
    completion = np.zeros((rows, length), bool)
    completion[:, length // 2:] = True
    return {"tokens": tokens, "attention_mask": np.ones((rows, length), bool), "completion_mask": completion,
            "logprobs": rng.normal(-2.0, 0.5, (rows, length)).astype(np.float32) * completion,
            "advantage": rng.normal(size=rows).astype(np.float32)}


def run(quick: bool = False) -> dict:
    config = Config()
    steps = 5 if quick else 100
    length = config.model.max_seq_len
    graphdef, params = init_params(config.model, 0)
    optimizer = make_optimizer(config.train)
    opt_state = optimizer.init(params)
    step = make_train_step(graphdef, config, optimizer)
    host = random_batch(config, config.train.batch_size, length, np.random.default_rng(0))
    device = to_device_batch(host)

    t0 = time.perf_counter()
    params, opt_state, metrics = step(params, opt_state, device, None)
    jax.block_until_ready(metrics)
    compile_s = time.perf_counter() - t0

    inside, total = [], []  # per step, timed in one loop so machine load hits both alike
    for _ in range(steps):
        t0 = time.perf_counter()
        batch = jax.block_until_ready(to_device_batch(host))
        t1 = time.perf_counter()
        params, opt_state, metrics = jax.block_until_ready(step(params, opt_state, batch, None))
        t2 = time.perf_counter()
        jax.device_get(metrics)
        inside.append(t2 - t1)
        total.append(time.perf_counter() - t0)
    step_s, update_s = float(np.median(total)), float(np.median(inside))

    tokens = int(host["completion_mask"].sum())
    return {"batch": config.train.batch_size, "length": length, "compile_s": compile_s,
            "step_ms": 1e3 * step_s, "update_ms": 1e3 * update_s, "tokens_s": tokens / step_s,
            "outside_share": float(np.median([1 - i / t for i, t in zip(inside, total)]))}


if __name__ == "__main__":
    print(run())
