"""Advantage estimators and policy losses, chosen by name."""

from jaxreplay.rl.advantages import ADVANTAGES, group_centered, group_normalized, leave_one_out
from jaxreplay.rl.losses import (
    AGGREGATIONS, LOSSES, asymre_loss, grpo_clip_loss, kl_penalty, make_aggregate, make_loss, make_weights,
    masked_mean, token_mean_weights, truncated_is_loss, weighted)

__all__ = ["ADVANTAGES", "AGGREGATIONS", "LOSSES", "asymre_loss", "group_centered", "group_normalized",
           "grpo_clip_loss", "kl_penalty", "leave_one_out", "make_aggregate", "make_loss", "make_weights",
           "masked_mean", "token_mean_weights", "truncated_is_loss", "weighted"]
