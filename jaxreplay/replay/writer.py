"""The actor's side: insert scored rollouts, one table item per row, through the
`Client` protocol; fields are checked against the item spec before any reaches a server.
"""

from __future__ import annotations

import functools
import math
from typing import Callable, Mapping, Optional

import numpy as np

from jaxreplay.config import Config, ConfigError, owner_check
from jaxreplay.replay.backend import Client
from jaxreplay.replay.tables import (
    FRESH_TABLE_NAME, POSITIVE_TABLE_NAME, TABLE_NAME, Interrupted, ItemSpec, positive_split)


class RolloutWriter:
    """Inserts batches of rollouts into `table`, never blocking past `timeout_s`."""

    def __init__(self, client: Client, item_spec: ItemSpec, *, timeout_s: float, table: str = TABLE_NAME,
                 positive_table: Optional[str] = None, fresh_table: Optional[str] = None,
                 priority_fn: Optional[Callable[[Mapping[str, np.ndarray]], np.ndarray]] = None,
                 interrupted: Interrupted = None):
        """positive_table: rows with reward > 0 also get an item there (positive-bias
        sampling); fresh_table: every row also gets one there (fresh anchors); the items
        of a row reference the same stored row. priority_fn: the priorities
        of a batch when `insert` is given none (default: 1 for every row). interrupted:
        polled while an insert waits; once true, it raises `ReplayInterrupted`."""
        self._client = client
        self._table = table
        self._positive_table = positive_table
        self._fresh_table = fresh_table
        self._priority_fn = priority_fn
        self._interrupted = interrupted
        self._spec = {k: (tuple(shape), np.dtype(dtype)) for k, (shape, dtype) in item_spec.items()}
        self._timeout_s = timeout_s

    def insert(self, batch: Mapping[str, np.ndarray], priorities: Optional[np.ndarray] = None) -> None:
        """Inserts row i of every array as one item (with `priorities[i]`, default 1).

        Blocks while the rate limiter holds inserts back, at most `timeout_s` in all,
        then raises `ReplayTimeoutError`.
        """
        arrays, n = self._validate(batch)
        if priorities is None:
            priorities = self._priority_fn(arrays) if self._priority_fn is not None else np.ones(n, np.float64)
        priorities = np.asarray(priorities, np.float64)
        if priorities.shape != (n,):
            raise ValueError(f"priorities: expected shape ({n},), got {priorities.shape}")
        also = {}
        if self._positive_table is not None:
            also[self._positive_table] = arrays["reward"] > 0
        if self._fresh_table is not None:
            also[self._fresh_table] = np.ones(n, bool)
        self._client.insert(self._table, arrays, priorities, also=also or None, timeout_s=self._timeout_s,
                            interrupted=self._interrupted)

    def _validate(self, batch: Mapping[str, np.ndarray]) -> tuple[dict[str, np.ndarray], int]:
        missing, extra = set(self._spec) - set(batch), set(batch) - set(self._spec)
        if missing or extra:
            raise ValueError(f"rollout batch keys differ from the item spec: missing {sorted(missing)}, "
                             f"unexpected {sorted(extra)}")
        arrays = {k: np.asarray(batch[k]) for k in sorted(self._spec)}
        n = None
        for k, a in arrays.items():
            shape, dtype = self._spec[k]
            if a.dtype != dtype or a.ndim != len(shape) + 1 or a.shape[1:] != shape:
                want = ", ".join(["n", *map(str, shape)])
                raise ValueError(f"rollout field {k!r}: expected [{want}] {dtype}, "
                                 f"got {list(a.shape)} {a.dtype}")
            if n is not None and a.shape[0] != n:
                raise ValueError(f"rollout field {k!r} has {a.shape[0]} rows, others have {n}")
            n = a.shape[0]
        return arrays, n or 0


def writer_for(client: Client, config: Config, item_spec: ItemSpec, interrupted: Interrupted = None) -> RolloutWriter:
    """The writer `config` asks for: also filling the positives table when positive bias is on."""
    split, r = positive_split(config), config.replay
    positive = POSITIVE_TABLE_NAME if split.positive_size else None
    fresh = FRESH_TABLE_NAME if split.fresh_batch else None
    priority = functools.partial(advantage_priority, decay=r.priority_decay) if r.selector == "prioritized" else None
    return RolloutWriter(client, item_spec, timeout_s=r.timeout_s, positive_table=positive, fresh_table=fresh,
                         priority_fn=priority, interrupted=interrupted)


def advantage_priority(batch: Mapping[str, np.ndarray], decay: float = 1.0) -> np.ndarray:
    """|advantage| (+ a floor, so no row is unreachable): a rollout whose group all scored
    alike carries no gradient and is rarely worth a sample.

    decay < 1 (`replay.priority_decay`): the priority is |advantage| * decay ** age, age in
    policy versions. Since only ratios of priorities matter, each row is stored with
    decay ** -policy_version instead, which ages every row alike without rewriting the
    table's priorities (Reverb could only rewrite items whose keys it reported). The
    stored values grow with the run; config validation bounds them (`check_decay`)."""
    base = np.abs(np.asarray(batch["advantage"], np.float64)) + 1e-3
    if decay == 1.0:
        return base
    return base * np.power(decay, -np.asarray(batch["policy_version"], np.float64))


# The largest stored priority a decayed run may reach (Reverb and the in-process table keep
# priorities as float64, max ~1.8e308; priority ** exponent and the selectors' sums need headroom).
MAX_DECAYED_SCALE = 1e250


@owner_check
def check_decay(config: Config) -> None:
    """replay.priority_decay: only the prioritized selector reads priorities, and the stored
    scale decay ** -(version * exponent) must stay finite up to the last learner step."""
    r = config.replay
    if r.priority_decay == 1.0:
        return
    if r.selector != "prioritized" or r.mode != "replay":
        raise ConfigError(f"replay.priority_decay: {r.priority_decay} needs replay.selector=prioritized in replay "
                          f"mode (got selector={r.selector}, mode={r.mode}): no other selector reads priorities")
    log_scale = -math.log10(r.priority_decay) * r.priority_exponent * config.train.steps
    if log_scale > math.log10(MAX_DECAYED_SCALE):
        most = math.floor(math.log10(MAX_DECAYED_SCALE) / (-math.log10(r.priority_decay) * r.priority_exponent))
        raise ConfigError(f"replay.priority_decay: {r.priority_decay} ** -(train.steps * priority_exponent) = "
                          f"1e{log_scale:.0f} overflows the stored priorities (each row is stored with "
                          f"decay ** -policy_version); at most {most} steps, or a decay closer to 1")
