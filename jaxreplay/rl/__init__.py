"""Advantage estimators and policy losses, chosen by name."""

from jaxreplay.rl.advantages import ADVANTAGES, group_normalized
from jaxreplay.rl.losses import LOSSES, grpo_clip_loss, kl_penalty, masked_mean

__all__ = ["ADVANTAGES", "LOSSES", "group_normalized", "grpo_clip_loss", "kl_penalty", "masked_mean"]
