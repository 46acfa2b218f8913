"""The rollout rows the replay tests insert: small, and each a pure function of its id."""

from __future__ import annotations

import numpy as np

T = 5
SPEC = {
    "tokens": ((T,), np.int32),
    "attention_mask": ((T,), np.bool_),
    "completion_mask": ((T,), np.int32),
    "logprobs": ((T,), np.float32),
    "advantage": ((), np.float32),
    "reward": ((), np.float32),
    "policy_version": ((), np.int32),  # doubles as the row id in these tests
}


def rollouts(ids) -> dict[str, np.ndarray]:
    """Rows whose contents are a pure function of their id."""
    rows = [_row(int(i)) for i in ids]
    return {k: np.stack([row[k] for row in rows]) for k in SPEC}


def _row(i: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(i)
    return {
        "tokens": rng.integers(0, 1000, T, dtype=np.int32),
        "attention_mask": rng.random(T) < 0.5,
        "completion_mask": rng.integers(0, 2, T, dtype=np.int32),
        "logprobs": -rng.random(T, dtype=np.float32),
        "advantage": np.float32(rng.standard_normal()),
        "reward": np.float32(rng.random()),
        "policy_version": np.int32(i),
    }
