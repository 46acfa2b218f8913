"""The learner's side: sample training batches through the `Client` protocol, never
blocking past a timeout.

A caller that already holds a current `Snapshot` (the colocated loop, the table's only
client) passes it: the backend then skips asking the server when it admits the batch,
and says so (`TableSharedError`) if another client changed the table behind it.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from jaxreplay.config import Config
from jaxreplay.replay.backend import Client, SampleInfo
from jaxreplay.replay.limiter import sample_room
from jaxreplay.replay.tables import (
    FRESH_TABLE_NAME, POSITIVE_TABLE_NAME, TABLE_NAME, Interrupted, LimiterState, Snapshot, positive_split,
    table_state)


class RolloutReader:
    """Samples batches of rollouts from `table` as numpy arrays [B, ...].

    Use one reader per table: two readers can both pass the wait and one of them
    then waits for its samples until more rollouts arrive or its timeout ends.
    interrupted: polled while waiting; once true, the call raises `ReplayInterrupted`.
    """

    def __init__(self, client: Client, *, timeout_s: float, table: str = TABLE_NAME,
                 interrupted: Interrupted = None):
        self._client = client
        self._table = table
        self._timeout_s = timeout_s
        self._interrupted = interrupted

    def sample(self, batch_size: int, snapshot: Optional[Snapshot] = None) -> tuple[dict[str, np.ndarray], SampleInfo]:
        """Waits up to `timeout_s` until `batch_size` items can be sampled, then samples them.

        snapshot: the server's state now, if the caller knows it (nothing inserted or
        sampled since it was taken); when it admits the whole batch there is no wait.
        Raises `ReplayTimeoutError` if the batch does not come in time, `TableSharedError`
        if another client changed the table behind the snapshot.
        """
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        known = None if snapshot is None else table_state(snapshot, self._table)
        return self._client.sample(self._table, batch_size, timeout_s=self._timeout_s,
                                   interrupted=self._interrupted, known=known)

    def can_sample(self, batch_size: int, snapshot: Optional[Snapshot] = None) -> bool:
        """Whether `sample(batch_size)` would return without waiting (in `snapshot`'s state,
        if given, else the server's now)."""
        return self.state(snapshot).can_sample_at_once(batch_size)

    def state(self, snapshot: Optional[Snapshot] = None) -> LimiterState:
        """The table's state in `snapshot`, else asked of the server now."""
        return table_state(self._client.states(self._interrupted) if snapshot is None else snapshot, self._table)


class SplitReader:
    """Each batch takes a share from side tables, the rest from the rollout table: positive
    bias (`positive_batch` rows from the freshest correct rollouts) and fresh anchors
    (`fresh_batch` rows from the newest actor step's rollouts).

    A side table still empty (no correct rollout yet) gives its share to the rollout table.
    The side tables have no rate limiter beyond holding one item, so `can_sample` only asks
    the rollout table's limiter, for exactly the rows `sample` will then take from it.
    """

    def __init__(self, client: Client, *, timeout_s: float, positive_batch: int = 0, fresh_batch: int = 0,
                 table: str = TABLE_NAME, positive_table: str = POSITIVE_TABLE_NAME,
                 fresh_table: str = FRESH_TABLE_NAME, interrupted: Interrupted = None):
        self._client = client
        self._main = RolloutReader(client, timeout_s=timeout_s, table=table, interrupted=interrupted)
        self._sides = [(RolloutReader(client, timeout_s=timeout_s, table=t, interrupted=interrupted), n)
                       for t, n in ((positive_table, positive_batch), (fresh_table, fresh_batch)) if n]
        self._interrupted = interrupted

    def split(self, batch_size: int, snapshot: Optional[Snapshot] = None) -> list[tuple[RolloutReader, int]]:
        """(reader, rows) for a batch now, the rollout table first (`snapshot`: the server's
        state now, if the caller knows it)."""
        if snapshot is None and self._sides:  # one query answers for every table
            snapshot = self._client.states(self._interrupted)
        sides = [(reader, n) for reader, n in self._sides if reader.state(snapshot).size > 0]
        return [(self._main, batch_size - sum(n for _, n in sides)), *sides]

    def can_sample(self, batch_size: int, snapshot: Optional[Snapshot] = None) -> bool:
        if snapshot is None:
            snapshot = self._client.states(self._interrupted)
        (_, n_main), *_ = self.split(batch_size, snapshot)
        return n_main == 0 or self._main.can_sample(n_main, snapshot)

    def sample(self, batch_size: int, snapshot: Optional[Snapshot] = None) -> tuple[dict[str, np.ndarray], SampleInfo]:
        """Samples the split, the rollout table's rows first. Sampling one table leaves the
        others' states in `snapshot` current."""
        parts = [reader.sample(n, snapshot) for reader, n in self.split(batch_size, snapshot) if n]
        batch = {k: np.concatenate([p[0][k] for p in parts]) for k in parts[0][0]}
        info = SampleInfo(*(np.concatenate([getattr(p[1], f) for p in parts]) for f in SampleInfo._fields))
        return batch, info


PositiveBiasReader = SplitReader  # the name positive-bias callers know


class IncrementalReader:
    """Assembles each batch over several scheduler turns, for `max_times_sampled` > 0.

    Items sampled `max_times_sampled` times are deleted, so a table holding enough rows
    for a whole batch now may not a moment later. Each `sample` call therefore takes
    only as many rows as can be sampled at once without blocking (`can_sample_at_once`,
    which assumes every row it takes is deleted), and returns the batch once it holds
    `batch_size` rows, None before. Taking one row is always possible when no insert is
    (see `_validate_replay`), so the colocated scheduler never deadlocks.
    """

    def __init__(self, client: Client, *, timeout_s: float, table: str = TABLE_NAME, interrupted: Interrupted = None):
        self._reader = RolloutReader(client, timeout_s=timeout_s, table=table, interrupted=interrupted)
        self._parts: list[tuple[dict[str, np.ndarray], SampleInfo]] = []

    @property
    def pending_rows(self) -> int:
        """Rows of the batch being assembled (0 between batches: checkpoints see none)."""
        return sum(len(p[1].keys) for p in self._parts)

    def _room(self, batch_size: int, snapshot: Optional[Snapshot]) -> int:
        """The most rows, up to what the batch still lacks, that can be sampled now without blocking."""
        return sample_room(self._reader.state(snapshot), batch_size - self.pending_rows)

    def can_sample(self, batch_size: int, snapshot: Optional[Snapshot] = None) -> bool:
        """Whether `sample` can take at least one more row now (in `snapshot`'s state, if given)."""
        return self._room(batch_size, snapshot) > 0

    def sample(self, batch_size: int,
               snapshot: Optional[Snapshot] = None) -> tuple[Optional[dict[str, np.ndarray]], Optional[SampleInfo]]:
        """Takes what it can; returns the whole batch once complete, else (None, None)."""
        n = self._room(batch_size, snapshot)
        if n:
            self._parts.append(self._reader.sample(n, snapshot))
        if self.pending_rows < batch_size:
            return None, None
        parts, self._parts = self._parts, []
        batch = {k: np.concatenate([p[0][k] for p in parts]) for k in parts[0][0]}
        return batch, SampleInfo(*(np.concatenate([getattr(p[1], f) for p in parts]) for f in SampleInfo._fields))


def reader_for(client: Client, config: Config,
               interrupted: Interrupted = None) -> RolloutReader | SplitReader | IncrementalReader:
    """The reader `config` asks for: incremental with `replay.max_times_sampled`, split over side
    tables when `replay.positive_fraction` or `replay.fresh_fraction` > 0. interrupted: polled while a call waits; once true, the
    call raises `ReplayInterrupted`."""
    split = positive_split(config)
    timeout_s = config.replay.timeout_s
    if config.replay.mode == "replay" and config.replay.max_times_sampled:
        return IncrementalReader(client, timeout_s=timeout_s, interrupted=interrupted)
    if split.positive_size or split.fresh_batch:
        return SplitReader(client, timeout_s=timeout_s, positive_batch=split.positive_batch,
                           fresh_batch=split.fresh_batch, interrupted=interrupted)
    return RolloutReader(client, timeout_s=timeout_s, interrupted=interrupted)
