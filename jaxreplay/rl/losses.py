"""Policy losses on replayed rollouts, pure and jittable.

Every loss sees per-token log-probs under the current policy, the frozen
behaviour log-probs and advantages stored at generation time, and the mask of
completion tokens. The ratio therefore measures all drift since the rollout was
made, however many learner steps ago that was.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def masked_mean(x: jax.Array, mask: jax.Array) -> jax.Array:
    """Token-mean over every completion token in the batch."""
    mask = mask.astype(x.dtype)
    return (x * mask).sum() / jnp.maximum(mask.sum(), 1.0)


def grpo_clip_loss(
    logprobs: jax.Array,  # [B, T] current policy
    behaviour_logprobs: jax.Array,  # [B, T] frozen at generation
    advantages: jax.Array,  # [B] frozen at generation
    mask: jax.Array,  # [B, T] completion tokens
    *,
    eps_low: float,
    eps_high: float,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """GRPO with PPO clipping (eps_low / eps_high) and token-mean aggregation."""
    log_ratio = logprobs - behaviour_logprobs
    ratio = jnp.exp(log_ratio)
    adv = advantages[:, None]
    unclipped = ratio * adv
    clipped = jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high) * adv
    loss = -masked_mean(jnp.minimum(unclipped, clipped), mask)
    metrics = {
        "pg_clipfrac": masked_mean((clipped < unclipped).astype(jnp.float32), mask),
        "pg_clipfrac_low": masked_mean(((ratio < 1.0 - eps_low) & (adv < 0)).astype(jnp.float32), mask),
        "pg_clipfrac_high": masked_mean(((ratio > 1.0 + eps_high) & (adv > 0)).astype(jnp.float32), mask),
        # k3 estimator of KL(behaviour || current), non-negative per token.
        "approx_kl": masked_mean(jnp.exp(-log_ratio) - 1.0 + log_ratio, mask),
        "ratio_mean": masked_mean(ratio, mask),
    }
    return loss, metrics


def kl_penalty(logprobs: jax.Array, ref_logprobs: jax.Array, mask: jax.Array) -> jax.Array:
    """k3 estimate of KL(current || reference), token-mean."""
    log_ratio = ref_logprobs - logprobs
    return masked_mean(jnp.exp(log_ratio) - 1.0 - log_ratio, mask)


LOSSES = {"grpo": grpo_clip_loss}
