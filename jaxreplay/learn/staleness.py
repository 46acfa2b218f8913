"""What a row's age costs the gradient: drift statistics of a trained batch, by age.

A row's age is the learner's version minus the `policy_version` that generated it. The rows
fall into `AGE_BUCKETS`; for each, from the log-probs of the very forward pass the loss used
(no second pass), `by_age` gives the rows, the shares of tokens the paper's clip zeroes
(low: ratio < 1 − eps_low with A < 0; high: ratio > 1 + eps_high with A > 0), the mean and
99th percentile of the token ratio r = π_θ/π_behaviour, the k3 estimate of KL(behaviour ‖
current) (mean of r − 1 − log r over the bucket's tokens, drawn from the behaviour policy),
and the effective sample size of the ratios as importance weights, (Σr)² / Σr², as a share
of the bucket's tokens. Fixed shapes under jit: every bucket is computed, masked; `records`
leaves the empty ones out on the host.
"""

from __future__ import annotations

from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

AGE_BUCKETS = ("0", "1", "2-3", "4-7", "8-15", "16+")
_EDGES = (1, 2, 4, 8, 16)  # bucket b holds ages in [EDGES[b-1], EDGES[b])
STATS = {
    "rows": "rows of the batch",
    "clipfrac_low": "share of tokens with ratio < 1 − `train.eps_low` and A < 0 (the paper's clip zeroes them)",
    "clipfrac_high": "share of tokens with ratio > 1 + `train.eps_high` and A > 0",
    "ratio_mean": "mean token ratio π_θ/π_behaviour",
    "ratio_p99": "99th percentile of the token ratio (linear interpolation, as numpy's default)",
    "kl_k3": "k3 estimate of KL(behaviour ‖ current): mean of r − 1 − log r over the tokens",
    "ess_frac": "effective sample size of the token ratios as importance weights, (Σr)²/Σr², over the token count",
}
KEY = "by_age"  # the train step's metrics hold the [len(AGE_BUCKETS)] arrays under this key


def age_bucket(age: jax.Array) -> jax.Array:
    """[B] bucket index of each age: 0, 1, 2-3, 4-7, 8-15, 16+."""
    return jnp.sum(age[:, None] >= jnp.asarray(_EDGES)[None, :], axis=1)


def by_age(logprobs: jax.Array, behaviour_logprobs: jax.Array, advantages: jax.Array, mask: jax.Array,
           age: jax.Array, *, eps_low: float, eps_high: float) -> dict[str, jax.Array]:
    """Each of `STATS` as a [len(AGE_BUCKETS)] array; entries of empty buckets are meaningless."""
    count = len(AGE_BUCKETS)
    logprobs = jax.lax.stop_gradient(logprobs)
    log_ratio = jnp.where(mask, logprobs - behaviour_logprobs, 0.0).reshape(-1)
    ratio = jnp.exp(log_ratio)
    bucket = age_bucket(age)
    rows = jnp.sum(bucket[:, None] == jnp.arange(count)[None, :], axis=0)
    # Every token's bucket; tokens off the mask go to an extra bucket `count` that nothing reads.
    token_bucket = jnp.where(mask, bucket[:, None], count).reshape(-1)
    member = token_bucket[:, None] == jnp.arange(count)[None, :]  # [N, buckets]
    tokens = member.sum(0)
    per = lambda x: jnp.sum(jnp.where(member, x[:, None], 0.0), axis=0) / jnp.maximum(tokens, 1)
    adv = jnp.broadcast_to(advantages[:, None], mask.shape).reshape(-1)
    # ESS in logs: 2 logsumexp(log r) − logsumexp(2 log r), finite where Σr² would overflow.
    peak = jnp.max(jnp.where(member, log_ratio[:, None], -jnp.inf), axis=0)
    peak = jnp.where(tokens > 0, peak, 0.0)
    lse = lambda scale: scale * peak + jnp.log(jnp.sum(
        jnp.where(member, jnp.exp(scale * (log_ratio[:, None] - peak[None, :])), 0.0), axis=0))
    ess_frac = jnp.exp(2 * lse(1.0) - lse(2.0)) / jnp.maximum(tokens, 1)
    # p99: one sort by (bucket, ratio) puts each bucket's ratios in a contiguous ascending run.
    _, sorted_ratio = jax.lax.sort((token_bucket, ratio), num_keys=2)
    start = jnp.cumsum(tokens) - tokens
    position = 0.99 * jnp.maximum(tokens - 1, 0)
    below = jnp.floor(position).astype(jnp.int32)
    above = jnp.minimum(below + 1, jnp.maximum(tokens - 1, 0))
    frac = position - below
    last = sorted_ratio.shape[0] - 1
    at = lambda i: sorted_ratio[jnp.clip(start + i, 0, last)]
    p99 = at(below) * (1 - frac) + at(above) * frac
    return {
        "rows": rows,
        "clipfrac_low": per(((ratio < 1.0 - eps_low) & (adv < 0)).astype(jnp.float32)),
        "clipfrac_high": per(((ratio > 1.0 + eps_high) & (adv > 0)).astype(jnp.float32)),
        "ratio_mean": per(ratio),
        "ratio_p99": p99,
        "kl_k3": per(ratio - 1.0 - log_ratio),
        "ess_frac": ess_frac,
    }


def key(bucket: str, stat: str) -> str:
    return f"{KEY}/{bucket}/{stat}"


def records(stats: Mapping[str, Any]) -> dict[str, float]:
    """The host's metrics record of `by_age`'s arrays: `by_age/<bucket>/<stat>` for every
    bucket that holds a row, none for an empty one (never a 0 that reads as a measurement)."""
    arrays = {name: np.asarray(value) for name, value in stats.items()}
    out: dict[str, float] = {}
    for b, bucket in enumerate(AGE_BUCKETS):
        if arrays["rows"][b] > 0:
            out.update({key(bucket, name): float(arrays[name][b]) for name in STATS})
    return out
