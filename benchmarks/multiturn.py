"""Multi-turn episodes: the engine against a turn-synchronous loop, side by side (issue 48).

    .venv/bin/python -m benchmarks.multiturn [--quick] [--out FILE]

Both sides run the same engine programs, the same model and the same environment; only when an
answer reaches its row differs:
  engine       a row whose turn ended waits in its slot while its environment's step runs in a
               worker thread; other rows keep decoding, and an answer is fed on as soon as it is back.
  synchronous  the pool takes one batch of rows (as many as its slots); after each turn every row
               waits for the slowest environment of the batch before any decodes again; the next
               batch starts when the whole batch is done.
Environment: each step sleeps a lognormal time (median 0.1 s, sigma 1), answers one token and
ends the episode after 4 turns. 64 episodes (16 groups of G = 4) over 16 slots; the model is the
multi-turn demo's (random weights), turns end at one of 8 stop ids (~4 tokens a turn). Unit:
episodes per second. Each round times one side then the other (alternating which first), after
warm-up rounds that compile; the figure is the median over rounds; `load` is the 1-minute load
average as the line is printed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import time
from typing import Any, Optional

import jax
import numpy as np

from jaxreplay.config import ModelConfig
from jaxreplay.models.transformer import init_params
from jaxreplay.rollout.engine import JaxEngine, PromptGroup
from jaxreplay.rollout.episodes import EpisodeRunner
from jaxreplay.tasks.chat import PlainFormat
from jaxreplay.tasks.environment import EnvPool, Message, Step, register_environment

FULL = dict(episodes=64, group=4, slots=16, turns=4, median=0.1, sigma=1.0, rounds=3, new=64, chunk=4, warmup=3)
QUICK = dict(episodes=8, group=2, slots=4, turns=2, median=0.01, sigma=1.0, rounds=1, new=32, chunk=4, warmup=1)
STOPS = tuple(range(1, 9))


class SleepyEnv:
    """Sleeps lognormal(log median, sigma) seconds a step; answers `+`; done after `turns` turns."""

    def __init__(self, turns: int = 4, median: float = 0.1, sigma: float = 1.0):
        self.turns, self.median, self.sigma, self.seen = turns, median, sigma, 0

    def reset(self, item: Any, seed: int) -> tuple[Message, ...]:
        self.seen = 0
        return (Message("user", "::"),)

    def step(self, turn_text: str) -> Step:
        time.sleep(random.lognormvariate(math.log(self.median), self.sigma))
        self.seen += 1
        return Step(reward=1.0, done=True) if self.seen >= self.turns else Step(observation=(Message("user", "+"),))


register_environment("bench_sleepy", SleepyEnv)


class BenchTokenizer:
    """Eight stop ids, so random weights end a turn every few tokens; text is one id a character."""

    pad_id, eos_ids, vocab_size = 0, STOPS, 32

    def encode(self, text: str) -> list[int]:
        return [10] * len(text)

    def decode(self, ids) -> str:
        return "x" * len(ids)


class Barrier:
    """The turn-synchronous loop's scheduling: answers are held until every row of the batch that
    is still playing has its answer, then all go back at once."""

    def __init__(self, inner: EpisodeRunner):
        self.inner, self.held, self.waiting, self.playing = inner, [], 0, 0

    def ended(self, tag, row, turn_ids, cut):
        self.inner.ended(tag, row, turn_ids, cut)
        if cut:
            self.playing -= 1
        else:
            self.waiting += 1

    def answers(self, wait: float):
        self.held += self.inner.answers(wait)
        if self.waiting and len(self.held) == self.waiting == self.playing:
            out, self.held, self.waiting = self.held, [], 0
            self.playing -= sum(ids is None for _, _, ids in out)
            return out
        return []


def setup(s: dict):
    cfg = ModelConfig(vocab_size=32, d_model=128, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, d_ff=384,
                      max_seq_len=2 + s["new"])
    graphdef, params = init_params(cfg, 0)
    return cfg, graphdef, params


def run_side(s: dict, model, synchronous: bool, seed: int) -> float:
    """Seconds to play s["episodes"] episodes."""
    cfg, graphdef, params = model
    tok = BenchTokenizer()
    pool = EnvPool("bench_sleepy", {"turns": s["turns"], "median": s["median"], "sigma": s["sigma"]},
                   workers=s["slots"], timeout=60)
    runner = EpisodeRunner(pool, PlainFormat(tok), tok, group_size=s["group"], prompt_len=2, max_turns=s["turns"])
    turns = Barrier(runner) if synchronous else runner
    engine = JaxEngine(graphdef, cfg, params, slots=s["slots"], group_size=s["group"], prompt_len=2,
                       max_new_tokens=s["new"], chunk_steps=s["chunk"], stop_ids=STOPS, pad_id=0, live_vocab=32,
                       turns=turns)
    engine.answer_wait = 0.005
    groups = []
    for k in range(s["episodes"] // s["group"]):
        tokens, mask = runner.open(k, k, seed * 1000 + k)
        groups.append(PromptGroup(tag=k, tokens=tokens, mask=mask, key=jax.random.fold_in(jax.random.key(seed), k)))
    per_batch = s["slots"] // s["group"]
    batches = [groups[i:i + per_batch] for i in range(0, len(groups), per_batch)] if synchronous else [groups]
    start = time.perf_counter()
    done = 0
    for batch in batches:
        if synchronous:
            turns.playing = len(batch) * s["group"]
        engine.submit(batch)
        while engine.pending():
            engine.step()
            for group in engine.collect():
                runner.result(group.tag)
                done += 1
    seconds = time.perf_counter() - start
    pool.shutdown()
    assert done == len(groups)
    return seconds


def main(argv: Optional[list[str]] = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes (the test's)")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args(argv)
    s = QUICK if args.quick else FULL
    model = setup(s)
    for _ in range(s["warmup"]):  # compiles the programs both sides use (shapes vary with the schedule)
        run_side(s, model, False, 0)
        run_side(s, model, True, 0)
    times: dict[str, list[float]] = {"engine": [], "synchronous": []}
    for r in range(s["rounds"]):
        order = ("engine", "synchronous") if r % 2 == 0 else ("synchronous", "engine")
        for side in order:
            times[side].append(run_side(s, model, side == "synchronous", r + 1))
    eps = {side: s["episodes"] / statistics.median(t) for side, t in times.items()}
    result = {"episodes": s["episodes"], "slots": s["slots"], "turns": s["turns"], "latency_median_s": s["median"],
              "latency_sigma": s["sigma"], "seconds": times, "engine_episodes_s": eps["engine"],
              "synchronous_episodes_s": eps["synchronous"], "ratio": eps["engine"] / eps["synchronous"],
              "load": os.getloadavg()[0]}
    print(f"multiturn engine {eps['engine']:.2f} episodes/s | synchronous {eps['synchronous']:.2f} episodes/s | "
          f"ratio {result['ratio']:.2f} | load {result['load']:.2f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
