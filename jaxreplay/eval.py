"""Held-out evaluation: greedy pass@1 on the task's eval set."""

from __future__ import annotations

import jax
import numpy as np

from jaxreplay.tasks import ArithmeticTask

EVAL_BATCH = 128  # fixed so evaluation compiles once


def evaluate(params, task: ArithmeticTask, greedy_sample_fn) -> float:
    """Fraction of eval problems answered exactly; the last batch is padded, not reshaped."""
    problems = task.eval_problems
    correct = 0.0
    key = jax.random.PRNGKey(0)  # unused by greedy decoding, required by the signature
    for start in range(0, len(problems), EVAL_BATCH):
        chunk = problems[start:start + EVAL_BATCH]
        padded = chunk + [chunk[-1]] * (EVAL_BATCH - len(chunk))
        prompts, prompt_mask = task.encode_prompts(padded)
        rollout = jax.device_get(greedy_sample_fn(params, prompts, prompt_mask, key))
        completions = rollout.tokens[:, task.prompt_len:]
        correct += sum(task.reward(p, completions[i]) for i, p in enumerate(chunk))
    return correct / len(problems)
