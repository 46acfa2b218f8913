"""Advantage estimators over groups of G completions of one prompt.

Computed once, at generation time, and frozen into the replay item: a replayed
rollout keeps the advantage its group had when it was made. Each takes rewards
[num_prompts, G] and returns advantages of the same shape.
"""

from __future__ import annotations

import numpy as np


def group_normalized(rewards: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """GRPO: (r - mean_group) / (std_group + eps)."""
    rewards = np.asarray(rewards, np.float32)
    mean = rewards.mean(axis=-1, keepdims=True)
    std = rewards.std(axis=-1, keepdims=True)
    return ((rewards - mean) / (std + eps)).astype(np.float32)


def group_centered(rewards: np.ndarray) -> np.ndarray:
    """Dr.GRPO: r - mean_group, no std division (which over-weights near-solved prompts)."""
    rewards = np.asarray(rewards, np.float32)
    return (rewards - rewards.mean(axis=-1, keepdims=True)).astype(np.float32)


def leave_one_out(rewards: np.ndarray) -> np.ndarray:
    """RLOO: r_i - mean_{j != i} r_j, a baseline independent of r_i (unbiased)."""
    rewards = np.asarray(rewards, np.float32)
    g = rewards.shape[-1]
    if g < 2:
        raise ValueError(f"leave_one_out needs at least 2 completions per group, got {g}")
    others = (rewards.sum(axis=-1, keepdims=True) - rewards) / (g - 1)
    return (rewards - others).astype(np.float32)


ADVANTAGES = {"group_normalized": group_normalized, "group_centered": group_centered,
              "leave_one_out": leave_one_out}
