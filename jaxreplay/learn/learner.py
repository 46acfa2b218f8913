"""The learner: one jitted GRPO/PPO update on a batch sampled from replay.

The whole update is visible here: score the replayed sequences under the current
params, compare with the behaviour log-probs frozen at generation time, clip,
optionally penalise KL to a reference, then one optax step.

Memory, for real models (docs/memory.md): the batch can be
split into micro-batches whose gradients are summed (`train.micro_batch_size`);
each decoder block can be rematerialised (`train.remat`); the logits are computed a
chunk of positions at a time (`train.logits_chunk_size`), never as one [B, T, V]
float32 array; Adam's first moment can be stored in bfloat16 (`train.adam_mu_dtype`).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh

from jaxreplay.config import Config, TrainConfig
from jaxreplay.learn import trainable
from jaxreplay.learn.losses import kl_penalty, make_loss, make_weights, token_mean_weights, weighted
from jaxreplay.learn.scoring import sequence_scores
from jaxreplay.learn.staleness import KEY as BY_AGE, by_age
from jaxreplay.models import sharding
from jaxreplay.models.moe import load_balancing_loss, route_disagreement
from jaxreplay.models.transformer import abstract_params, dtype_of, routed_score_hidden
from jaxreplay.rollout.rollouts import ROUTES

Batch = dict[str, jax.Array]
TrainStep = Callable[[Any, Any, Batch, Any], tuple[Any, Any, dict[str, jax.Array]]]

def make_optimizer(config: TrainConfig) -> optax.GradientTransformation:
    """AdamW with global-norm clipping; a linear warm-up, then a constant learning rate.

    The warm-up matters for RL on a fresh Adam state: its first steps are sign-like,
    moving every weight by the full learning rate on a noisy policy gradient. Over the trainable
    params only (`trainable.trainable_only`): with LoRA, the adapters.
    """
    mu_dtype = dtype_of(config.adam_mu_dtype) if config.adam_mu_dtype else None
    return trainable.trainable_only(optax.chain(
        optax.clip_by_global_norm(config.grad_clip),
        optax.adamw(learning_rate_schedule(config), b1=config.adam_b1, b2=config.adam_b2,
                    weight_decay=config.weight_decay, mu_dtype=mu_dtype),
    ))


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
                    mesh: Optional[Mesh] = None, *, live_vocab: int = 0) -> TrainStep:
    """Returns `step(params, opt_state, batch, ref_params) -> (params, opt_state, metrics)`, jitted.

    params and opt_state are donated: the caller must use the returned ones. A step
    whose loss, gradient or update is not finite returns them unchanged, with `nonfinite` = 1.
    `ref_params` is only read when `train.kl_coef > 0` and the params hold no LoRA adapters (pass None
    otherwise: `trainable.initial_reference`). With adapters only they train (`trainable`): the base
    comes back as it went in, and `opt_state` is the adapters' (`make_optimizer`).
    With a `mesh`, params, opt_state and ref_params carry `sharding.param_shardings`
    (place them with `sharding.shard_params`), the batch is split over its rows, and
    the metrics come back replicated. With `train.micro_batch_size`, the loss, the
    gradient and every metric are those of the whole batch, up to float rounding.
    `live_vocab`: the tokenizer's ids (0: every embedding row), as the sampler was given, so
    the learner's log-probs are the sampler's (`sampling.mask_padded`).
    """
    train = config.train
    abstract = abstract_params(config.model)
    loss_and_grad = make_loss_and_grad(graphdef, config, mesh, live_vocab=live_vocab)

    def step(params, opt_state, batch: Batch, ref_params):
        loss, metrics, grads = loss_and_grad(params, batch, ref_params)  # of the trainable params
        tuned, frozen = trainable.split(params)
        grad_norm = optax.tree.norm(grads)
        updates, new_opt_state = optimizer.update(grads, opt_state, tuned)
        new_tuned = optax.apply_updates(tuned, updates)
        # A non-finite loss, gradient or update would poison params and Adam's moments for
        # good: skip the update (keep both), and say so in the metrics.
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm) & jnp.isfinite(optax.tree.norm(updates))
        keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)
        metrics["loss"] = loss
        metrics["grad_norm"] = grad_norm
        metrics["learning_rate"] = learning_rate(train, opt_state)  # of this update; it warms up
        metrics["nonfinite"] = (~finite).astype(jnp.int32)
        return trainable.join(keep(new_tuned, tuned), frozen), keep(new_opt_state, opt_state), metrics

    if mesh is None:
        return jax.jit(step, donate_argnums=(0, 1))
    params_sh = sharding.param_shardings(mesh, abstract)
    opt_sh = sharding.param_shardings(mesh, jax.eval_shape(optimizer.init, abstract))
    ref_sh = params_sh if train.kl_coef > 0 and trainable.split(abstract)[1] is None else None
    return jax.jit(
        step, donate_argnums=(0, 1),
        in_shardings=(params_sh, opt_sh, sharding.batch_sharding(mesh), ref_sh),
        out_shardings=(params_sh, opt_sh, sharding.replicated(mesh)),
    )


def make_loss_and_grad(graphdef, config: Config, mesh: Optional[Mesh] = None, *, live_vocab: int = 0):
    """`(params, batch, ref_params) -> (loss, metrics, grads)` of one training batch, not jitted:
    the train step's first half. `grads` are those of the trainable params (`trainable.split`).
    With `train.micro_batch_size` the batch goes through the model that many rows at a time and the
    results are summed; the loss aggregation's weights come from the whole batch's mask, so the sums
    are exactly the whole batch's loss, metrics and gradient, up to float rounding. A batch that carries
    each row's `age` (learner version minus `policy_version`) also gets `metrics["by_age"]`, the
    staleness statistics by age (learn/staleness.py) of the log-probs the loss was computed from."""
    train = config.train
    params_sh = None if mesh is None else sharding.param_shardings(mesh, abstract_params(config.model))
    tuned_sh = None if mesh is None else trainable.split(params_sh)[0]
    loss_fn = _make_loss_fn(graphdef, config, live_vocab)

    def grads_fn(params, batch: Batch, ref_params):  # ((loss, (metrics, log-probs)), gradient of the trainable params)
        tuned, frozen = trainable.split(params)
        tuned_loss = lambda t: loss_fn(trainable.join(t, frozen), batch, ref_params)
        return jax.value_and_grad(tuned_loss, has_aux=True)(tuned)

    weigh = make_weights(train.loss_aggregation, config.sampling.max_new_tokens)

    def loss_and_grad(params, batch: Batch, ref_params):
        mask = batch["completion_mask"]
        batch = {**batch, "loss_weights": weigh(mask), "token_weights": token_mean_weights(mask)}
        rows = mask.shape[0]
        micro = train.micro_batch_size or rows
        if rows % micro:
            raise ValueError(f"train.micro_batch_size={micro} does not divide a batch of {rows} rows")
        if micro == rows:
            (loss, (metrics, logprobs)), grads = grads_fn(params, batch, ref_params)
        else:
            loss, metrics, grads, logprobs = _accumulate(grads_fn, params, batch, ref_params, rows // micro, mesh,
                                                         tuned_sh)
        if "age" in batch:
            metrics[BY_AGE] = by_age(logprobs, batch["logprobs"], batch["advantage"], mask, batch["age"],
                                     eps_low=train.eps_low, eps_high=train.eps_high)
        return loss, metrics, grads

    return loss_and_grad


def _make_loss_fn(graphdef, config: Config, live_vocab: int = 0):
    """`loss_fn(params, batch, ref_params) -> (loss, (metrics, log-probs))` of one (micro-)batch that
    carries its rows' `loss_weights` and `token_weights`: the loss and every metric are weighted sums,
    so those of a batch are the sums over its micro-batches. The log-probs [b, T] (no gradient) are
    those the loss used, for the statistics by age."""
    train, sampling = config.train, config.sampling
    scores = dict(temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
                  chunk=train.logits_chunk_size, live_vocab=live_vocab)

    model = config.model

    def score(params, batch: Batch, with_entropy: bool):
        """(log-probs, entropy, the sparse layers' routing or None); with `train.routing_replay`, routed as
        the sampler routed the batch's tokens."""
        routes = None
        if train.routing_replay and ROUTES in batch:
            routes = jnp.moveaxis(batch[ROUTES], 2, 0)  # [B, T, L, k] -> [L, B, T, k]
        h, unembed, routing = routed_score_hidden(graphdef, params, batch["tokens"], batch["attention_mask"],
                                                  remat=train.remat, routes=routes)
        return (*sequence_scores(h, batch["tokens"], unembed, with_entropy=with_entropy, **scores), routing)

    def loss_fn(params, batch: Batch, ref_params):
        mask = batch["completion_mask"]
        mean = weighted(batch["token_weights"])
        loss_impl = make_loss(train.loss, aggregate=weighted(batch["loss_weights"]), mean=mean,
                              eps_low=train.eps_low, eps_high=train.eps_high, tis_cap=train.tis_cap,
                              asymre_delta_v=train.asymre_delta_v, seq_mask_low=train.seq_mask_low,
                              seq_mask_high=train.seq_mask_high, m2po_threshold=train.m2po_threshold,
                              decoupled_weight_cap=train.decoupled_weight_cap)
        logprobs, entropy, routing = score(params, batch, with_entropy=True)
        loss, metrics = loss_impl(logprobs, batch["logprobs"], batch["advantage"], mask)
        metrics["pg_loss"] = loss
        if routing is not None:
            # HF's load-balancing loss over this (micro-)batch's real tokens, weighted by its share of the
            # batch's completion tokens: a whole batch's is HF's; micro-batches' is their weighted mean, as
            # HF's gradient accumulation computes it.
            share = jnp.sum(batch["token_weights"] * mask)
            aux = load_balancing_loss(routing.logits, batch["attention_mask"], model.experts_per_token) * share
            loss = loss + model.router_aux_loss_coef * aux
            metrics["router_aux_loss"] = aux
            if ROUTES in batch:  # the router's own top k against the sampler's, replayed or not
                recorded = jnp.moveaxis(batch[ROUTES], 2, 0)
                _, own = jax.lax.top_k(routing.logits, model.experts_per_token)
                ran = batch["attention_mask"].astype(bool) & (recorded[0, ..., 0] >= 0)
                metrics["router_disagreement"] = route_disagreement(own, recorded, ran) * share
        if train.kl_coef > 0:  # with LoRA, the reference is the base, adapters off
            reference = trainable.kl_reference(params, ref_params)
            ref_logprobs, _, _ = score(jax.lax.stop_gradient(reference), batch, with_entropy=False)
            kl = kl_penalty(logprobs, ref_logprobs, mask, mean=mean)
            loss = loss + train.kl_coef * kl
            metrics["kl_ref"] = kl
        metrics["entropy"] = mean(entropy, mask)
        return loss, (metrics, jax.lax.stop_gradient(logprobs))

    return loss_fn


def _accumulate(grads_fn, params, batch: Batch, ref_params, count: int, mesh: Optional[Mesh], params_sh):
    """(loss, metrics, grads) of the whole batch as sums over `count` micro-batches, one
    forward and backward pass at a time in a `lax.scan`, and the log-probs of every row in the
    batch's order. Micro-batch k holds rows k, k + count, k + 2 count, ...: each device's rows of
    the batch split into its rows of every micro-batch, so splitting moves no data between devices."""

    def split(x):
        x = x.reshape(x.shape[0] // count, count, *x.shape[1:]).swapaxes(0, 1)
        return x if mesh is None else jax.lax.with_sharding_constraint(x, sharding.microbatch_sharding(mesh))

    def like_params(total):  # the running gradient sum stays sharded like the params
        return total if mesh is None else (total[0], jax.lax.with_sharding_constraint(total[1], params_sh))

    micro = jax.tree.map(split, batch)
    first = jax.tree.map(lambda x: x[0], micro)
    (loss_shape, (metrics_shape, _)), grads_shape = jax.eval_shape(grads_fn, params, first, ref_params)
    zeros = like_params(jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), ((loss_shape, metrics_shape), grads_shape)))

    def body(total, one):
        (loss, (metrics, logprobs)), grads = grads_fn(params, one, ref_params)
        return like_params(jax.tree.map(jnp.add, total, ((loss, metrics), grads))), logprobs

    ((loss, metrics), grads), logprobs = jax.lax.scan(body, zeros, micro)
    rows = logprobs.shape[0] * logprobs.shape[1]
    return loss, metrics, grads, logprobs.swapaxes(0, 1).reshape(rows, *logprobs.shape[2:])
