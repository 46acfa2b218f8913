"""The actor: sample G completions per prompt, score them, freeze their advantages.

Everything the learner needs later is fixed here, at generation time: the
behaviour log-probs, the group-normalised advantage and the policy version that
made the rollout. A rollout replayed many steps later keeps all three.
"""

from __future__ import annotations

import time
from typing import Callable, Mapping

import jax
import numpy as np

from jaxreplay.config import Config
from jaxreplay.rollout.advantages import ADVANTAGES
from jaxreplay.rollout.rollouts import make_rows, row_spec
from jaxreplay.rollout.sampling import Rollout, completion_ids
from jaxreplay.tasks.base import Task, score

SampleFn = Callable[..., Rollout]


class Actor:
    def __init__(self, config: Config, task: Task, sample_fn: SampleFn, *, shard: tuple[int, int] = (0, 1)):
        """shard (i, n): act on the i-th of n equal slices of every prompt batch. Multi-host
        SPMD gives each process its own slice; `sample_fn` then sees only that slice."""
        self.config = config
        self.task = task
        self.sample_fn = sample_fn
        self.shard = shard
        self._base_key = jax.random.PRNGKey(config.run.seed)
        self.spec = row_spec(config, task.prompt_len)

    def act(self, params, policy_version: int, actor_step: int) -> tuple[dict[str, np.ndarray], dict[str, float]]:
        """Rollouts for the `actor_step`-th prompt batch; deterministic given params and step."""
        c = self.config
        group = c.train.group_size
        start = time.perf_counter()
        problems = self.task.train_problems(c.run.seed, actor_step, c.train.prompts_per_step)
        index, count = self.shard
        per_shard = len(problems) // count
        problems = problems[index * per_shard:(index + 1) * per_shard]
        prompts, prompt_mask = self.task.encode_prompts(problems)
        prompts, prompt_mask = np.repeat(prompts, group, axis=0), np.repeat(prompt_mask, group, axis=0)
        key = jax.random.fold_in(self._base_key, actor_step)
        rollout = jax.device_get(self.sample_fn(params, prompts, prompt_mask, key))

        rewards, reward_errors = score(self.task, problems, completion_ids(rollout), group)
        advantages = ADVANTAGES[c.train.advantage](rewards.reshape(-1, group)).reshape(-1)
        items = make_rows(
            self.spec, tokens=rollout.tokens, attention_mask=rollout.attention_mask,
            completion_mask=rollout.completion_mask, logprobs=rollout.logprobs, advantage=advantages,
            reward=rewards, policy_version=np.full(len(rewards), policy_version),
            rollout_id=rollout_ids(actor_step, index * per_shard * group, len(rewards), c.rollouts_per_step))
        return items, {**rollout_stats(items), "reward/errors": reward_errors, "seconds": time.perf_counter() - start}


def rollout_ids(actor_step: int, first_row: int, n: int, rollouts_per_step: int) -> np.ndarray:
    """Ids unique over the run and every process: the row's place in all rollouts ever generated."""
    ids = actor_step * rollouts_per_step + first_row + np.arange(n, dtype=np.int64)
    if ids[-1] >= 2**31:
        raise OverflowError(f"rollout ids past 2^31 at actor step {actor_step}: rollout_id is int32")
    return ids


def rollout_stats(rows: Mapping[str, np.ndarray]) -> dict[str, float]:
    """What a batch of rollouts says about the policy that generated it."""
    rewards, lengths = rows["reward"], rows["completion_mask"].sum(axis=1)
    return {"reward_mean": float(rewards.mean()), "reward_std": float(rewards.std()),
            "accuracy": float((rewards == 1.0).mean()), "completion_length": float(lengths.mean()),
            "tokens": int(lengths.sum())}
