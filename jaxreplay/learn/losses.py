"""Policy losses on replayed rollouts, pure and jittable, chosen by name.

Every loss sees per-token log-probs under the current policy, the frozen
behaviour log-probs and advantages stored at generation time, and the mask of
completion tokens. The ratio therefore measures all drift since the rollout was
made, however many learner steps ago that was.

Losses reduce per-token terms with an `Aggregate` (see `AGGREGATIONS`), so the
token weighting (DAPO token-mean, GRPO sequence-mean, Dr.GRPO constant) is chosen
independently of the objective, and report token means with `mean`. Every
aggregation is a weighted sum whose weights depend on the mask alone
(`make_weights`): a learner that splits a batch into micro-batches computes the
weights once from the whole batch and sums `weighted(w)` over the micro-batches,
which gives exactly the whole batch's loss and metrics.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp

from jaxreplay.rollout.sampling import LOGPROB_FLOOR

Aggregate = Callable[[jax.Array, jax.Array], jax.Array]  # (per-token [B, T], mask [B, T]) -> scalar
Weigh = Callable[[jax.Array], jax.Array]  # mask [B, T] -> per-token weights [B, T], zero off the mask
Loss = Callable[..., tuple[jax.Array, dict[str, jax.Array]]]


def masked_mean(x: jax.Array, mask: jax.Array) -> jax.Array:
    """Token-mean over every completion token in the batch (DAPO): long completions weigh more."""
    mask = mask.astype(x.dtype)
    return (x * mask).sum() / jnp.maximum(mask.sum(), 1.0)


def sequence_mean(x: jax.Array, mask: jax.Array) -> jax.Array:
    """Original GRPO: mean over each completion's tokens, then over completions."""
    mask = mask.astype(x.dtype)
    per_seq = (x * mask).sum(-1) / jnp.maximum(mask.sum(-1), 1.0)
    return per_seq.mean()


def constant_normalizer(x: jax.Array, mask: jax.Array, *, max_tokens: int) -> jax.Array:
    """Dr.GRPO: token sum divided by a constant (batch x max completion length), no length bias."""
    mask = mask.astype(x.dtype)
    return (x * mask).sum() / (x.shape[0] * max_tokens)


def make_aggregate(name: str, max_tokens: int) -> Aggregate:
    """`token_mean` (DAPO), `sequence_mean` (GRPO) or `constant` (Dr.GRPO, / B*max_tokens)."""
    if name == "constant":
        return functools.partial(constant_normalizer, max_tokens=max_tokens)
    return AGGREGATIONS[name]


AGGREGATIONS: dict[str, Aggregate] = {"token_mean": masked_mean, "sequence_mean": sequence_mean,
                                      "constant": constant_normalizer}


def token_mean_weights(mask: jax.Array) -> jax.Array:
    """`masked_mean` as weights: 1 / (completion tokens in the batch) on each of them."""
    mask = mask.astype(jnp.float32)
    return mask / jnp.maximum(mask.sum(), 1.0)


def sequence_mean_weights(mask: jax.Array) -> jax.Array:
    """`sequence_mean` as weights: 1 / (B x that completion's tokens)."""
    mask = mask.astype(jnp.float32)
    return mask / jnp.maximum(mask.sum(-1, keepdims=True), 1.0) / mask.shape[0]


def constant_weights(mask: jax.Array, *, max_tokens: int) -> jax.Array:
    """`constant_normalizer` as weights: 1 / (B x max_tokens)."""
    return mask.astype(jnp.float32) / (mask.shape[0] * max_tokens)


def make_weights(name: str, max_tokens: int) -> Weigh:
    """The weights of aggregation `name` (see `make_aggregate`), from the whole batch's mask."""
    if name == "constant":
        return functools.partial(constant_weights, max_tokens=max_tokens)
    return {"token_mean": token_mean_weights, "sequence_mean": sequence_mean_weights}[name]


def weighted(weights: jax.Array) -> Aggregate:
    """An `Aggregate` that is the sum of per-token values times fixed `weights` (zero off the
    mask). Off-mask values are dropped first: they may be infinite (a ratio at a prompt
    position scored at the log-prob floor), and inf x 0 is NaN."""
    return lambda x, mask: jnp.sum(jnp.where(mask, x, 0.0) * weights)


def _drift_metrics(log_ratio: jax.Array, mask: jax.Array, mean: Aggregate) -> dict[str, jax.Array]:
    return {
        # k3 estimator of KL(behaviour || current) on tokens drawn from the behaviour policy:
        # r - 1 - log r with r = current / behaviour, non-negative per token.
        "approx_kl": mean(jnp.exp(log_ratio) - 1.0 - log_ratio, mask),
        "ratio_mean": mean(jnp.exp(log_ratio), mask),
    }


def grpo_clip_loss(
    logprobs: jax.Array,  # [B, T] current policy
    behaviour_logprobs: jax.Array,  # [B, T] frozen at generation
    advantages: jax.Array,  # [B] frozen at generation
    mask: jax.Array,  # [B, T] completion tokens
    *,
    eps_low: float,
    eps_high: float,
    aggregate: Aggregate = masked_mean,
    mean: Aggregate = masked_mean,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """GRPO with PPO clipping (eps_low / eps_high) on the frozen behaviour log-probs."""
    log_ratio = logprobs - behaviour_logprobs
    ratio = jnp.exp(log_ratio)
    adv = advantages[:, None]
    unclipped = ratio * adv
    clipped = jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high) * adv
    loss = -aggregate(jnp.minimum(unclipped, clipped), mask)
    metrics = {
        "pg_clipfrac": mean((clipped < unclipped).astype(jnp.float32), mask),
        "pg_clipfrac_low": mean(((ratio < 1.0 - eps_low) & (adv < 0)).astype(jnp.float32), mask),
        "pg_clipfrac_high": mean(((ratio > 1.0 + eps_high) & (adv > 0)).astype(jnp.float32), mask),
        **_drift_metrics(log_ratio, mask, mean),
    }
    return loss, metrics


def truncated_is_loss(
    logprobs: jax.Array, behaviour_logprobs: jax.Array, advantages: jax.Array, mask: jax.Array, *,
    tis_cap: float, aggregate: Aggregate = masked_mean, mean: Aggregate = masked_mean,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Truncated importance sampling: gradient min(ratio, cap) * A * grad log pi.

    The weight is held constant (stop-gradient), so, unlike PPO clipping, a token
    whose ratio passed the cap still gets a gradient, scaled down to `cap`. The
    loss value is -min(ratio, cap) * A.
    """
    log_ratio = logprobs - behaviour_logprobs
    ratio = jnp.exp(log_ratio)
    weight = jax.lax.stop_gradient(jnp.minimum(ratio, tis_cap))
    # exp(lp - sg(lp)) is 1 in value and has gradient grad log pi: value -weight*A, gradient -weight*A*grad log pi.
    surrogate = weight * jnp.exp(logprobs - jax.lax.stop_gradient(logprobs)) * advantages[:, None]
    loss = -aggregate(surrogate, mask)
    metrics = {"tis_truncfrac": mean((ratio > tis_cap).astype(jnp.float32), mask),
               **_drift_metrics(log_ratio, mask, mean)}
    return loss, metrics


def asymre_loss(
    logprobs: jax.Array, behaviour_logprobs: jax.Array, advantages: jax.Array, mask: jax.Array, *,
    asymre_delta_v: float, aggregate: Aggregate = masked_mean, mean: Aggregate = masked_mean,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """AsymRE: REINFORCE with no ratio on the advantage r - (V + dV).

    `advantages` must be r - V (a centred estimator: group_centered or
    leave_one_out). dV < 0 lowers the baseline to V + dV, shifting every advantage
    up by |dV|: the asymmetry that keeps REINFORCE on stale data from collapsing.
    """
    adv = advantages[:, None] - asymre_delta_v
    # A token the sampling filter now excludes sits at the constant log-prob floor: it has no
    # gradient, so it contributes 0 to the reported value too, instead of |A| * 1e4.
    live = jnp.where(logprobs > LOGPROB_FLOOR, logprobs, 0.0)
    loss = -aggregate(adv * live, mask)
    return loss, _drift_metrics(logprobs - behaviour_logprobs, mask, mean)


def kl_penalty(logprobs: jax.Array, ref_logprobs: jax.Array, mask: jax.Array, *,
               mean: Aggregate = masked_mean) -> jax.Array:
    """The k3 penalty, token-mean: r - 1 - log r with r = reference / current (GRPO's, TRL's
    and verl's). Its value estimates KL(current || reference), unbiased on tokens drawn from
    the current policy; its gradient, in expectation over those tokens, is the gradient of
    KL(reference || current): sum_x (current(x) - reference(x)) grad log current(x), the
    samples carrying no gradient (tests/test_rl.py enumerates it). On replayed tokens, drawn
    from the behaviour policy, both are off by the drift."""
    log_ratio = ref_logprobs - logprobs
    return mean(jnp.exp(log_ratio) - 1.0 - log_ratio, mask)


LOSSES: dict[str, Loss] = {"grpo": grpo_clip_loss, "tis": truncated_is_loss, "asymre": asymre_loss}


def make_loss(name: str, *, aggregate: Aggregate, eps_low: float, eps_high: float, tis_cap: float,
              asymre_delta_v: float, mean: Aggregate = masked_mean) -> Loss:
    """`LOSSES[name]` with its own hyperparameters bound: `(logprobs, behaviour, adv, mask) -> (loss, metrics)`."""
    own = {"grpo": {"eps_low": eps_low, "eps_high": eps_high}, "tis": {"tis_cap": tis_cap},
           "asymre": {"asymre_delta_v": asymre_delta_v}}[name]
    return functools.partial(LOSSES[name], aggregate=aggregate, mean=mean, **own)
