"""Advantage estimators over groups of G completions of one prompt.

Computed once, at generation time, and frozen into the replay item: a replayed
rollout keeps the advantage its group had when it was made.
"""

from __future__ import annotations

import numpy as np


def group_normalized(rewards: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """GRPO: (r - mean_group) / (std_group + eps); rewards [num_prompts, G]."""
    rewards = np.asarray(rewards, np.float32)
    mean = rewards.mean(axis=-1, keepdims=True)
    std = rewards.std(axis=-1, keepdims=True)
    return ((rewards - mean) / (std + eps)).astype(np.float32)


ADVANTAGES = {"group_normalized": group_normalized}
