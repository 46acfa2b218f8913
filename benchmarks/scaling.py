"""Learner step time against the number of items N in the table, and resident memory
over many steps: a step (sample B from Reverb, train, insert fresh rows) should cost
the same at any N, and memory should stop growing once the table is full."""

from __future__ import annotations

import time

import jax
import numpy as np

from benchmarks.learner import random_batch
from benchmarks.replay import random_items, unlimited
from jaxreplay.actor import item_spec
from jaxreplay.config import Config
from jaxreplay.learner import make_optimizer, make_train_step, to_device_batch
from jaxreplay.models import init_params
from jaxreplay.replay import build_tables, reader_for, serve, writer_for


def rss_mib() -> float:
    """This process's resident set now (Linux /proc)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def run(quick: bool = False) -> dict:
    base = Config()
    sizes, steps = ((100, 1000), 20) if quick else ((100, 1000, 10_000, 100_000), 1000)
    spec = item_spec(base, prompt_len=base.model.max_seq_len - base.sampling.max_new_tokens)
    graphdef, params = init_params(base.model, 0)
    optimizer = make_optimizer(base.train)
    opt_state = optimizer.init(params)
    step = make_train_step(graphdef, base, optimizer)
    rng = np.random.default_rng(0)
    fresh = random_items(spec, base.rollouts_per_step, rng)
    fresh["tokens"] %= base.model.vocab_size
    rows = []
    for n in sizes:
        config = unlimited(base, max_size=n)
        with serve(build_tables(config, spec), timeout_s=60.0) as server:
            writer, reader = writer_for(server, config, spec), reader_for(server, config, spec)
            fill = random_items(spec, n, rng)
            fill["tokens"] %= base.model.vocab_size
            writer.insert(fill)
            del fill
            times, rss = [], []
            for i in range(steps if n == sizes[-1] else min(steps, 100)):
                t0 = time.perf_counter()
                batch, _ = reader.sample(base.train.batch_size)
                params, opt_state, metrics = step(params, opt_state, to_device_batch(batch), None)
                jax.device_get(metrics)
                if i % 2 == 0:  # replay ratio 2: one fresh batch of R rows per two steps
                    writer.insert(fresh)
                times.append(time.perf_counter() - t0)
                rss.append(rss_mib())
            writer.close()
        rows.append({"items": n, "step_ms": 1e3 * float(np.median(times)), "steps": len(times),
                     "rss_mib_first": rss[min(10, len(rss) - 1)], "rss_mib_last": rss[-1]})
    return {"rows": rows, "flatness": rows[-1]["step_ms"] / rows[0]["step_ms"],
            "rss_growth_mib": rows[-1]["rss_mib_last"] - rows[-1]["rss_mib_first"]}


if __name__ == "__main__":
    print(run())
