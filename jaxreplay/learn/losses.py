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


def _clip_objective(ratio: jax.Array, adv: jax.Array, eps_low: float, eps_high: float, mean: Aggregate,
                    mask: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
    """PPO's per-token min(r A, clip(r, 1 - eps_low, 1 + eps_high) A), and how often the clip is active."""
    unclipped = ratio * adv
    clipped = jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high) * adv
    metrics = {
        "pg_clipfrac": mean((clipped < unclipped).astype(jnp.float32), mask),
        "pg_clipfrac_low": mean(((ratio < 1.0 - eps_low) & (adv < 0)).astype(jnp.float32), mask),
        "pg_clipfrac_high": mean(((ratio > 1.0 + eps_high) & (adv > 0)).astype(jnp.float32), mask),
    }
    return jnp.minimum(unclipped, clipped), metrics


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
    objective, metrics = _clip_objective(jnp.exp(log_ratio), advantages[:, None], eps_low, eps_high, mean, mask)
    return -aggregate(objective, mask), {**metrics, **_drift_metrics(log_ratio, mask, mean)}


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


# -- Off-policy corrections beside the paper's loss (docs/comparing.md, "Off-policy corrections") --------------
# Each takes the same four arrays. `proximal_logprobs` is the policy at the start of the sampled batch's updates
# (AReaL's proximal policy, verl's and SkyRL's `old_log_probs`); the learner takes one update per sampled batch,
# so it passes nothing and the proximal policy is the current params, held constant: sg(logprobs).


def _proximal(logprobs: jax.Array, proximal_logprobs) -> jax.Array:
    return jax.lax.stop_gradient(logprobs) if proximal_logprobs is None else proximal_logprobs


def grpo_tis_loss(
    logprobs: jax.Array, behaviour_logprobs: jax.Array, advantages: jax.Array, mask: jax.Array, *,
    eps_low: float, eps_high: float, tis_cap: float, proximal_logprobs=None,
    aggregate: Aggregate = masked_mean, mean: Aggregate = masked_mean,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Token TIS times the PPO-clipped objective, as verl and SkyRL apply it: per token
    sg(min(π_prox/π_behaviour, cap)) · min(r A, clip(r) A) with r = π_θ/π_prox.

    With one update per sampled batch π_prox = π_θ in value, so r = 1, the clip never acts and
    this is `truncated_is_loss` in value and gradient (tests/test_offpolicy.py checks it)."""
    proximal = _proximal(logprobs, proximal_logprobs)
    behaviour_ratio = jax.lax.stop_gradient(jnp.exp(proximal - behaviour_logprobs))
    weight = jnp.minimum(behaviour_ratio, tis_cap)
    objective, metrics = _clip_objective(jnp.exp(logprobs - proximal), advantages[:, None], eps_low, eps_high,
                                         mean, mask)
    loss = -aggregate(weight * objective, mask)
    return loss, {**metrics, "tis_truncfrac": mean((behaviour_ratio > tis_cap).astype(jnp.float32), mask),
                  "is_weight_mean": mean(weight, mask), **_drift_metrics(logprobs - behaviour_logprobs, mask, mean)}


def sequence_mask_loss(
    logprobs: jax.Array, behaviour_logprobs: jax.Array, advantages: jax.Array, mask: jax.Array, *,
    eps_low: float, eps_high: float, seq_mask_low: float, seq_mask_high: float,
    aggregate: Aggregate = masked_mean, mean: Aggregate = masked_mean,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Sequence-level masked IS on the paper's loss: a row whose geometric-mean token ratio
    exp(mean_t log(π_θ/π_behaviour)) leaves [lo, hi] is dropped (verl's and SkyRL's geometric
    sequence mask). The geometric mean, not the product: a product over a long completion leaves
    any fixed interval for a small per-token drift. Dropped rows keep their share of the
    aggregation's denominator, so the loss of the kept rows is not rescaled."""
    log_ratio = logprobs - behaviour_logprobs
    row_log_ratio = jnp.sum(jnp.where(mask, log_ratio, 0.0), -1) / jnp.maximum(mask.sum(-1), 1)
    geometric = jax.lax.stop_gradient(jnp.exp(row_log_ratio))
    keep = ((geometric >= seq_mask_low) & (geometric <= seq_mask_high))[:, None]
    objective, metrics = _clip_objective(jnp.exp(log_ratio), advantages[:, None], eps_low, eps_high, mean, mask)
    loss = -aggregate(jnp.where(keep, objective, 0.0), mask)
    return loss, {**metrics, "seq_mask_frac": mean(jnp.broadcast_to(~keep, mask.shape).astype(jnp.float32), mask),
                  **_drift_metrics(log_ratio, mask, mean)}


def m2po_keep(log_ratio: jax.Array, mask: jax.Array, threshold: float) -> jax.Array:
    """[B, T]: M2PO's mask. Drops the tokens of largest squared log-ratio, fewest first, until the
    mean squared log-ratio of the rest is at most `threshold`. Fixed shapes: one sort and a
    cumulative sum over every token, the count to drop the first k that brings the mean under."""
    squared = jnp.where(mask, jax.lax.stop_gradient(log_ratio) ** 2, -1.0).reshape(-1)  # off-mask sorts last
    order = jnp.argsort(-squared)
    largest_first = jnp.where(squared[order] >= 0, squared[order], 0.0)
    n = mask.sum()
    dropped_sum = jnp.concatenate([jnp.zeros(1), jnp.cumsum(largest_first)])  # [N + 1]: sum of the k largest
    k = jnp.arange(squared.shape[0] + 1)
    rest_mean = (dropped_sum[-1] - dropped_sum) / jnp.maximum(n - k, 1)
    drop = jnp.argmax((rest_mean <= threshold) | (k >= n))  # the first k that is enough (k = n always is)
    rank = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0]))
    return (rank >= drop).reshape(mask.shape) & mask


def m2po_loss(
    logprobs: jax.Array, behaviour_logprobs: jax.Array, advantages: jax.Array, mask: jax.Array, *,
    m2po_threshold: float, aggregate: Aggregate = masked_mean, mean: Aggregate = masked_mean,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """M2PO (Zheng et al., 2025): the unclipped surrogate r·A, r = π_θ/π_behaviour, on the tokens
    `m2po_keep` leaves; the second-moment mask replaces PPO's clip. The moment is that of the batch
    the forward pass scores (with `train.micro_batch_size`, of each micro-batch)."""
    log_ratio = logprobs - behaviour_logprobs
    keep = m2po_keep(log_ratio, mask, m2po_threshold)
    objective = jnp.where(keep, jnp.exp(log_ratio) * advantages[:, None], 0.0)
    squared = jnp.where(mask, log_ratio, 0.0) ** 2
    return -aggregate(objective, mask), {
        "m2po_masked_frac": mean((mask & ~keep).astype(jnp.float32), mask),
        "m2po_m2": mean(squared, mask), **_drift_metrics(log_ratio, mask, mean)}


def decoupled_loss(
    logprobs: jax.Array, behaviour_logprobs: jax.Array, advantages: jax.Array, mask: jax.Array, *,
    eps_low: float, eps_high: float, decoupled_weight_cap: float, proximal_logprobs=None,
    aggregate: Aggregate = masked_mean, mean: Aggregate = masked_mean,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """AReaL's decoupled PPO: sg(π_prox/π_behaviour) · min(r A, clip(r) A) with r = π_θ/π_prox; a
    token whose weight exceeds the cap is dropped (AReaL's `behav_imp_weight_cap`), not truncated.

    With one update per sampled batch π_prox = π_θ in value: r = 1, the clip never acts, and the
    gradient is the plain importance-weighted policy gradient (π_θ/π_behaviour) A ∇log π_θ on the
    tokens whose weight is at most the cap."""
    proximal = _proximal(logprobs, proximal_logprobs)
    weight = jax.lax.stop_gradient(jnp.exp(proximal - behaviour_logprobs))
    keep = weight <= decoupled_weight_cap
    objective, metrics = _clip_objective(jnp.exp(logprobs - proximal), advantages[:, None], eps_low, eps_high,
                                         mean, mask)
    loss = -aggregate(jnp.where(keep, weight * objective, 0.0), mask)
    return loss, {**metrics, "decoupled_masked_frac": mean((~keep).astype(jnp.float32), mask),
                  "is_weight_mean": mean(jnp.where(keep, weight, 0.0), mask),
                  **_drift_metrics(logprobs - behaviour_logprobs, mask, mean)}


LOSSES: dict[str, Loss] = {"grpo": grpo_clip_loss, "tis": truncated_is_loss, "asymre": asymre_loss,
                           "grpo_tis": grpo_tis_loss, "seq_mask": sequence_mask_loss, "m2po": m2po_loss,
                           "decoupled": decoupled_loss}


def make_loss(name: str, *, aggregate: Aggregate, eps_low: float, eps_high: float, tis_cap: float,
              asymre_delta_v: float, seq_mask_low: float = 0.8, seq_mask_high: float = 1.25,
              m2po_threshold: float = 0.04, decoupled_weight_cap: float = 5.0,
              mean: Aggregate = masked_mean) -> Loss:
    """`LOSSES[name]` with its own hyperparameters bound: `(logprobs, behaviour, adv, mask) -> (loss, metrics)`."""
    clip = {"eps_low": eps_low, "eps_high": eps_high}
    own = {"grpo": clip, "tis": {"tis_cap": tis_cap}, "asymre": {"asymre_delta_v": asymre_delta_v},
           "grpo_tis": {**clip, "tis_cap": tis_cap},
           "seq_mask": {**clip, "seq_mask_low": seq_mask_low, "seq_mask_high": seq_mask_high},
           "m2po": {"m2po_threshold": m2po_threshold},
           "decoupled": {**clip, "decoupled_weight_cap": decoupled_weight_cap}}[name]
    return functools.partial(LOSSES[name], aggregate=aggregate, mean=mean, **own)
