"""Short supervised warm start so RL begins from a weak but non-zero policy.

Cached in the run dir: re-running (or resuming) a run reuses it instead of
training again.
"""

from __future__ import annotations

from pathlib import Path

import jax
import optax
from tqdm import tqdm

from jaxreplay.checkpoint import restore_params, save_params
from jaxreplay.config import Config
from jaxreplay.models import forward
from jaxreplay.rl import masked_mean
from jaxreplay.sampling import token_logprobs
from jaxreplay.tasks import ArithmeticTask


def make_sft_step(graphdef, optimizer: optax.GradientTransformation):
    def loss_fn(params, tokens, attention_mask, loss_mask):
        logits = forward(graphdef, params, tokens, attention_mask)
        return -masked_mean(token_logprobs(logits, tokens, 1.0), loss_mask)

    def step(params, opt_state, tokens, attention_mask, loss_mask):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens, attention_mask, loss_mask)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return jax.jit(step, donate_argnums=(0, 1))


def warm_start(graphdef, params, task: ArithmeticTask, config: Config, cache_dir: Path):
    """Supervised next-token training on correct answers; returns (params, was_cached)."""
    cache = Path(cache_dir)
    if (cache / "params").exists():
        return restore_params(cache / "params", params), True
    params = supervised_warm_start(graphdef, params, task, config)
    save_params(cache / "params", params)
    return params, False


def supervised_warm_start(graphdef, params, task: ArithmeticTask, config: Config):
    """The warm start itself, uncached: deterministic given params and config. It can take
    minutes, so it shows a progress bar (`run.progress_bar`)."""
    w = config.warmstart
    optimizer = optax.adam(w.learning_rate)
    opt_state = optimizer.init(params)
    step = make_sft_step(graphdef, optimizer)
    # A stream of its own so warm-start problems are not the RL prompt stream.
    seed = config.run.seed + 7_919
    for i in tqdm(range(w.steps), desc="warm start", unit="step", disable=not config.run.progress_bar,
                  dynamic_ncols=True):
        tokens, attention_mask, loss_mask = task.supervised_batch(
            seed, i, w.batch_size, config.sampling.max_new_tokens, carry_error=w.teacher_carry_error
        )
        params, opt_state, _ = step(params, opt_state, tokens, attention_mask, loss_mask)
    return params
