"""Replay overhead: Reverb insert and sample throughput with realistic items (512 tokens,
per-token log-probs and masks, scalars), and the share of a colocated demo run's loop
(generate + train + replay, in steady state) spent in replay calls (loop.py's
`time/replay_s`)."""

from __future__ import annotations

import dataclasses
import json
import tempfile
import time
from pathlib import Path

import numpy as np

from jaxreplay.config import Config, load_config
from jaxreplay.replay.reader import reader_for
from jaxreplay.replay.server import serve
from jaxreplay.replay.tables import build_tables
from jaxreplay.replay.writer import writer_for
from jaxreplay.rollout.rollouts import row_spec
from jaxreplay.train.driver import train


def unlimited(config: Config, max_size: int) -> Config:
    """A table of `max_size` rows whose limiter never holds a call back: this measures the calls."""
    replay = dataclasses.replace(config.replay, max_size=max_size, min_size_to_sample=1, error_buffer=1e12)
    return dataclasses.replace(config, replay=replay)


def random_items(spec, rows: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Rows matching `spec` (actor.item_spec): random tokens and log-probs, True masks."""
    out = {}
    for key, (shape, dtype) in spec.items():
        if dtype == np.bool_:
            out[key] = np.ones((rows, *shape), bool)
        elif np.issubdtype(dtype, np.integer):
            out[key] = rng.integers(0, 512, (rows, *shape)).astype(dtype)
        else:
            out[key] = rng.normal(size=(rows, *shape)).astype(dtype)
    return out


def throughput(quick: bool = False) -> dict:
    """Items per second through insert (batches of R) and sample (batches of B)."""
    config = Config()
    sampling = dataclasses.replace(config.sampling, max_new_tokens=256)
    config = unlimited(dataclasses.replace(config, sampling=sampling), max_size=4096)
    spec = row_spec(config, prompt_len=256)  # 512 tokens per item
    rows, calls = config.rollouts_per_step, (4 if quick else 40)
    items = random_items(spec, rows, np.random.default_rng(0))
    with serve(build_tables(config, spec), timeout_s=30.0) as server:
        writer, reader = writer_for(server, config, spec), reader_for(server, config)
        t0 = time.perf_counter()
        for _ in range(calls):
            writer.insert(items)
        insert_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        for _ in range(calls):
            reader.sample(config.train.batch_size)
        sample_s = time.perf_counter() - t0
    item_bytes = sum(a[0].nbytes for a in items.values())
    return {"item_tokens": 512, "item_kib": item_bytes / 1024, "insert_items_s": calls * rows / insert_s,
            "sample_items_s": calls * config.train.batch_size / sample_s,
            "insert_ms_per_call": 1e3 * insert_s / calls, "sample_ms_per_call": 1e3 * sample_s / calls}


def demo_share(quick: bool = False) -> dict:
    """The demo config, run colocated: the share of its loop in replay calls, in steady state.

    The loop's timers are cumulative and include the first calls' compilation, which would
    swell the denominator: the share is taken between the records of step `warmup` and the
    last step (metrics.jsonl, unrounded)."""
    steps, warmup = (4, 1) if quick else (110, 10)
    with tempfile.TemporaryDirectory() as run_dir:
        config = load_config("configs/demo.yaml", [f"train.steps={steps}", f"run.dir={run_dir}",
                                                   "run.progress_bar=false", "warmstart.steps=0",
                                                   f"train.eval_every={steps}"])
        summary = train(config, log=lambda _: None)
        records = [json.loads(line) for line in Path(run_dir, "metrics.jsonl").read_text().splitlines()]
    timed = {r["step"]: r for r in records if "time/replay_s" in r}
    first, last = timed[warmup], timed[summary["steps"]]
    spent = {k: last[f"time/{k}_s"] - first[f"time/{k}_s"] for k in ("generate", "train", "replay")}
    loop_s, measured = sum(spent.values()), last["step"] - first["step"]
    return {"steps": measured, "warmup_steps": warmup, "run_s": summary["seconds"],
            "replay_ms_per_step": 1e3 * spent["replay"] / measured, "loop_ms_per_step": 1e3 * loop_s / measured,
            "replay_share_of_loop": spent["replay"] / loop_s}


if __name__ == "__main__":
    print(throughput())
    print(demo_share())
