"""The learner: one jitted GRPO/PPO update on a batch sampled from replay.

The whole update is visible here: score the replayed sequences under the current
params, compare with the behaviour log-probs frozen at generation time, clip,
optionally penalise KL to a reference, then one optax step.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh

from jaxreplay import sharding
from jaxreplay.config import Config, TrainConfig
from jaxreplay.models import abstract_params, forward
from jaxreplay.rl import kl_penalty, make_aggregate, make_loss, masked_mean
from jaxreplay.sampling import policy_logprobs, token_entropy

Batch = dict[str, jax.Array]
TrainStep = Callable[[Any, Any, Batch, Any], tuple[Any, Any, dict[str, jax.Array]]]

# Replayed fields the update reads; the actor writes these (and more) into the table.
BATCH_KEYS = ("tokens", "attention_mask", "completion_mask", "logprobs", "advantage")


def make_optimizer(config: TrainConfig) -> optax.GradientTransformation:
    """AdamW with global-norm clipping; a linear warm-up, then a constant learning rate.

    The warm-up matters for RL on a fresh Adam state: its first steps are sign-like,
    moving every weight by the full learning rate on a noisy policy gradient.
    """
    return optax.chain(
        optax.clip_by_global_norm(config.grad_clip),
        optax.adamw(learning_rate_schedule(config), b1=config.adam_b1, b2=config.adam_b2,
                    weight_decay=config.weight_decay),
    )


def learning_rate_schedule(config: TrainConfig) -> optax.ScalarOrSchedule:
    """A linear warm-up over `warmup_steps` updates, then `learning_rate`."""
    if not config.warmup_steps:
        return config.learning_rate
    return optax.linear_schedule(0.0, config.learning_rate, config.warmup_steps)


def learning_rate(config: TrainConfig, opt_state) -> jax.Array:
    """The learning rate the next update from `opt_state` applies (the schedule at its update count)."""
    schedule = learning_rate_schedule(config)
    if not callable(schedule):
        return jnp.asarray(schedule, jnp.float32)
    is_schedule = lambda x: isinstance(x, optax.ScaleByScheduleState)
    count = next(x.count for x in jax.tree.leaves(opt_state, is_leaf=is_schedule) if is_schedule(x))
    return jnp.asarray(schedule(count), jnp.float32)


def make_train_step(graphdef, config: Config, optimizer: optax.GradientTransformation,
                    mesh: Optional[Mesh] = None) -> TrainStep:
    """Returns `step(params, opt_state, batch, ref_params) -> (params, opt_state, metrics)`, jitted.

    params and opt_state are donated: the caller must use the returned ones. A step
    whose loss, gradient or update is not finite returns them unchanged, with `nonfinite` = 1.
    `ref_params` is only read when `train.kl_coef > 0` (pass None otherwise).
    With a `mesh`, params, opt_state and ref_params carry `sharding.param_shardings`
    (place them with `sharding.shard_params`), the batch is split over its rows, and
    the metrics come back replicated.
    """
    train, sampling = config.train, config.sampling
    temperature = sampling.temperature
    loss_impl = make_loss(
        train.loss, aggregate=make_aggregate(train.loss_aggregation, sampling.max_new_tokens),
        eps_low=train.eps_low, eps_high=train.eps_high, tis_cap=train.tis_cap, asymre_delta_v=train.asymre_delta_v)

    def score(logits, tokens):
        return policy_logprobs(logits, tokens, temperature=temperature, top_k=sampling.top_k, top_p=sampling.top_p)

    def loss_fn(params, batch: Batch, ref_params):
        logits = forward(graphdef, params, batch["tokens"], batch["attention_mask"])
        logprobs = score(logits, batch["tokens"])
        mask = batch["completion_mask"]
        loss, metrics = loss_impl(logprobs, batch["logprobs"], batch["advantage"], mask)
        metrics["pg_loss"] = loss
        if train.kl_coef > 0:
            ref_logits = forward(graphdef, jax.lax.stop_gradient(ref_params), batch["tokens"], batch["attention_mask"])
            kl = kl_penalty(logprobs, score(ref_logits, batch["tokens"]), mask)
            loss = loss + train.kl_coef * kl
            metrics["kl_ref"] = kl
        metrics["entropy"] = masked_mean(token_entropy(logits, temperature), mask)
        return loss, metrics

    def step(params, opt_state, batch: Batch, ref_params):
        (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch, ref_params)
        grad_norm = optax.global_norm(grads)
        updates, new_opt_state = optimizer.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        # A non-finite loss, gradient or update would poison params and Adam's moments for
        # good: skip the update (keep both), and say so in the metrics.
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm) & jnp.isfinite(optax.global_norm(updates))
        keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)
        metrics["loss"] = loss
        metrics["grad_norm"] = grad_norm
        metrics["learning_rate"] = learning_rate(train, opt_state)  # of this update; it warms up
        metrics["nonfinite"] = (~finite).astype(jnp.int32)
        return keep(new_params, params), keep(new_opt_state, opt_state), metrics

    if mesh is None:
        return jax.jit(step, donate_argnums=(0, 1))
    abstract = abstract_params(config.model)
    params_sh = sharding.param_shardings(mesh, abstract)
    opt_sh = sharding.param_shardings(mesh, jax.eval_shape(optimizer.init, abstract))
    ref_sh = params_sh if train.kl_coef > 0 else None
    return jax.jit(
        step, donate_argnums=(0, 1),
        in_shardings=(params_sh, opt_sh, sharding.batch_sharding(mesh), ref_sh),
        out_shardings=(params_sh, opt_sh, sharding.replicated(mesh)),
    )


def to_device_batch(batch: dict[str, Any]) -> Batch:
    """Host numpy -> device arrays with the dtypes the update expects."""
    return {
        "tokens": jnp.asarray(batch["tokens"], jnp.int32),
        "attention_mask": jnp.asarray(batch["attention_mask"], bool),
        "completion_mask": jnp.asarray(batch["completion_mask"], bool),
        "logprobs": jnp.asarray(batch["logprobs"], jnp.float32),
        "advantage": jnp.asarray(batch["advantage"], jnp.float32),
    }
