"""The actor's side: insert scored rollouts, one table item per row, through the
`Client` protocol; fields are checked against the item spec before any reaches a server.
"""

from __future__ import annotations

from typing import Callable, Mapping, Optional

import numpy as np

from jaxreplay.config import Config
from jaxreplay.replay.backend import Client
from jaxreplay.replay.tables import POSITIVE_TABLE_NAME, TABLE_NAME, Interrupted, ItemSpec, positive_split


class RolloutWriter:
    """Inserts batches of rollouts into `table`, never blocking past `timeout_s`."""

    def __init__(self, client: Client, item_spec: ItemSpec, *, timeout_s: float, table: str = TABLE_NAME,
                 positive_table: Optional[str] = None,
                 priority_fn: Optional[Callable[[Mapping[str, np.ndarray]], np.ndarray]] = None,
                 interrupted: Interrupted = None):
        """positive_table: rows with reward > 0 also get an item there (positive-bias
        sampling); both items reference the same stored row. priority_fn: the priorities
        of a batch when `insert` is given none (default: 1 for every row). interrupted:
        polled while an insert waits; once true, it raises `ReplayInterrupted`."""
        self._client = client
        self._table = table
        self._positive_table = positive_table
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
        also = {self._positive_table: arrays["reward"] > 0} if self._positive_table is not None else None
        self._client.insert(self._table, arrays, priorities, also=also, timeout_s=self._timeout_s,
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
    positive = POSITIVE_TABLE_NAME if positive_split(config).positive_size else None
    priority = advantage_priority if config.replay.selector == "prioritized" else None
    return RolloutWriter(client, item_spec, timeout_s=config.replay.timeout_s, positive_table=positive,
                         priority_fn=priority, interrupted=interrupted)


def advantage_priority(batch: Mapping[str, np.ndarray]) -> np.ndarray:
    """|advantage| (+ a floor, so no row is unreachable): a rollout whose group all scored
    alike carries no gradient and is rarely worth a sample."""
    return np.abs(np.asarray(batch["advantage"], np.float64)) + 1e-3
