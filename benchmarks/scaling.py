"""Learner step time against the number of items N in the table, and resident memory
over many steps: a step (sample B from Reverb, train, insert fresh rows) should cost
the same at any N, and memory should stop growing once the table is full.

Memory growth is measured over the second half of the steps, after warm-up: RSS
jumps in the first steps (compilation; allocator arenas, XLA and Reverb buffers
reaching their working sizes) and then swings by ~30 MiB around a flat level as the
allocator returns memory and takes it again (N = 1e5, 3000 steps: 865 MiB at step 1,
902 at 10, 873 at 250, 875 at 500, 899 at 750, 875 at 1000, 904 at 1500, 895 at 2000,
888 at 2500, 889 at 3000: no growth). Two single readings, as before, measure the
swing (it once read +26 MiB). So growth is the median RSS over the last tenth of the
steps minus that over the tenth just after the midpoint: a leak shows as a steady
positive number, the swings mostly cancel.
"""

from __future__ import annotations

import time

import jax
import numpy as np

from benchmarks.learner import random_batch
from benchmarks.replay import random_items, unlimited
from jaxreplay.config import Config
from jaxreplay.learn.learner import make_optimizer, make_train_step
from jaxreplay.models.transformer import init_params
from jaxreplay.replay.reader import reader_for
from jaxreplay.replay.server import serve
from jaxreplay.replay.tables import build_tables
from jaxreplay.replay.writer import writer_for
from jaxreplay.rollout.rollouts import row_spec
from jaxreplay.rollout.rollouts import to_device_batch


def rss_mib() -> float:
    """This process's resident set now (Linux /proc)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def run(quick: bool = False) -> dict:
    base = Config()
    sizes, steps = ((100, 1000), 20) if quick else ((100, 1000, 10_000, 100_000), 1000)
    spec = row_spec(base, prompt_len=base.model.max_seq_len - base.sampling.max_new_tokens)
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
            writer, reader = writer_for(server, config, spec), reader_for(server, config)
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
        tenth, half = max(1, len(rss) // 10), len(rss) // 2
        rows.append({"items": n, "step_ms": 1e3 * float(np.median(times)), "steps": len(times),
                     "rss_mib_midpoint": float(np.median(rss[half:half + tenth])),
                     "rss_mib_last": float(np.median(rss[-tenth:])), "rss_mib_max": max(rss)})
    last = rows[-1]
    return {"rows": rows, "flatness": last["step_ms"] / rows[0]["step_ms"],
            "rss_growth_mib": last["rss_mib_last"] - last["rss_mib_midpoint"],
            "rss_growth_steps": last["steps"] - last["steps"] // 2}


if __name__ == "__main__":
    print(run())
