"""The learner's side: sample training batches, never blocking past a timeout.

Reverb's `Client.sample` has no timeout, so the reader first waits (polling the
server's limiter counters with a backoff sleep) until the whole batch can be
sampled without blocking, then samples exactly `batch_size` items: a sampler that
fetches ahead would spend limiter budget, since samples in flight count against it.
"""

from __future__ import annotations

import time
from typing import NamedTuple, Optional

import numpy as np

from jaxreplay.replay.inprocess import InProcessServer
from jaxreplay.replay.server import Source, connect
from jaxreplay.config import Config
from jaxreplay.replay.tables import (
    POSITIVE_TABLE_NAME, TABLE_NAME, ItemSpec, LimiterState, ReplayTimeoutError, limiter_state, positive_split)

_MAX_POLL_S = 0.05


class SampleInfo(NamedTuple):
    """Per-row sampling metadata: `keys` identify items across calls; `probabilities`
    and `table_size` give importance weights (N * P)^-beta for prioritized replay."""

    keys: np.ndarray  # [B] uint64
    times_sampled: np.ndarray  # [B] int32, this sample included
    probabilities: np.ndarray  # [B] float64
    table_size: np.ndarray  # [B] int64


class RolloutReader:
    """Samples batches of rollouts from `table` as numpy arrays [B, ...].

    Use one reader per table: two readers can both pass the wait and one of them
    then blocks inside Reverb until more rollouts arrive.
    """

    def __init__(self, source: Source, item_spec: ItemSpec, *, timeout_s: float, table: str = TABLE_NAME):
        self._client = connect(source)
        self._table = table
        # Reverb returns an item's fields flattened in the signature's (sorted-key) order.
        self._keys = sorted(item_spec)
        self._timeout_s = timeout_s

    def sample(self, batch_size: int) -> tuple[dict[str, np.ndarray], SampleInfo]:
        """Waits up to `timeout_s` until `batch_size` items can be sampled, then samples them.

        Raises `ReplayTimeoutError` if the limiter does not allow it in time.
        """
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        start = time.monotonic()
        state = self._wait(start, batch_size, 0)
        if isinstance(self._client, InProcessServer):
            return self._sample_inprocess(batch_size, start)
        if state.can_sample_at_once(batch_size):
            rows = list(self._client.sample(self._table, batch_size, emit_timesteps=False))
        else:  # Items may be deleted as they are sampled: take them one at a time.
            rows = []
            for i in range(batch_size):
                if i:
                    self._wait(start, batch_size, i)
                rows.extend(self._client.sample(self._table, 1, emit_timesteps=False))
        batch = {k: np.stack([r.data[j] for r in rows]) for j, k in enumerate(self._keys)}
        info = SampleInfo(
            keys=np.array([r.info.key for r in rows], np.uint64),
            times_sampled=np.array([r.info.times_sampled for r in rows], np.int32),
            probabilities=np.array([r.info.probability for r in rows], np.float64),
            table_size=np.array([r.info.table_size for r in rows], np.int64))
        return batch, info

    def _sample_inprocess(self, batch_size: int, start: float) -> tuple[dict[str, np.ndarray], SampleInfo]:
        taken = self._client.sample(self._table, batch_size,
                                    timeout_s=max(0.0, start + self._timeout_s - time.monotonic()))
        batch = {k: np.stack([t[0].row[k] for t in taken]) for k in self._keys}
        info = SampleInfo(
            keys=np.array([t[0].key for t in taken], np.uint64),
            times_sampled=np.array([t[3] for t in taken], np.int32),
            probabilities=np.array([t[1] for t in taken], np.float64),
            table_size=np.array([t[2] for t in taken], np.int64))
        return batch, info

    def can_sample(self, batch_size: int) -> bool:
        """Whether `sample(batch_size)` would return without waiting."""
        return limiter_state(self._client, self._table, self._timeout_s).can_sample_at_once(batch_size)

    def _wait(self, start: float, batch_size: int, done: int) -> LimiterState:
        """Polls until `batch_size` samples are allowed or, once `done` > 0, one more."""
        n = 1 if done else batch_size
        deadline, pause = start + self._timeout_s, 1e-3
        while True:
            state = limiter_state(self._client, self._table, self._timeout_s)
            if state.can_sample(n):
                return state
            now = time.monotonic()
            if now >= deadline:
                taken = f" with {done} of {batch_size} items taken," if done else ""
                raise ReplayTimeoutError(
                    f"RolloutReader.sample({batch_size}) timed out after {now - start:.3g}s{taken} "
                    f"waiting for the rate limiter to allow {n} more samples (no actor inserting?): "
                    f"{state.describe()}")
            time.sleep(min(pause, deadline - now))
            pause = min(2 * pause, _MAX_POLL_S)


class PositiveBiasReader:
    """Positive-bias sampling: each batch takes `positive_batch` rows from the positives
    table (the freshest correct rollouts) and the rest from the rollout table.

    Until the first correct rollout arrives the positives table is empty, and the whole
    batch comes from the rollout table. The positives table has no rate limiter beyond
    holding one item, so `can_sample` only asks the rollout table's limiter, for exactly
    the rows `sample` will then take from it.
    """

    def __init__(self, source: Source, item_spec: ItemSpec, *, timeout_s: float, positive_batch: int,
                 table: str = TABLE_NAME, positive_table: str = POSITIVE_TABLE_NAME):
        self._client = connect(source)
        self._main = RolloutReader(self._client, item_spec, timeout_s=timeout_s, table=table)
        self._positives = RolloutReader(self._client, item_spec, timeout_s=timeout_s, table=positive_table)
        self._positive_table = positive_table
        self._positive_batch = positive_batch
        self._timeout_s = timeout_s

    def split(self, batch_size: int) -> tuple[int, int]:
        """(rows from the rollout table, rows from the positives table) for a batch now."""
        have = limiter_state(self._client, self._positive_table, self._timeout_s).size > 0
        n_pos = min(self._positive_batch, batch_size) if have else 0
        return batch_size - n_pos, n_pos

    def can_sample(self, batch_size: int) -> bool:
        n_main, _ = self.split(batch_size)
        return n_main == 0 or self._main.can_sample(n_main)

    def sample(self, batch_size: int) -> tuple[dict[str, np.ndarray], SampleInfo]:
        """Samples the split; rows from the positives table come last."""
        n_main, n_pos = self.split(batch_size)
        parts = [reader.sample(n) for reader, n in ((self._main, n_main), (self._positives, n_pos)) if n]
        batch = {k: np.concatenate([p[0][k] for p in parts]) for k in parts[0][0]}
        info = SampleInfo(*(np.concatenate([getattr(p[1], f) for p in parts]) for f in SampleInfo._fields))
        return batch, info


class IncrementalReader:
    """Assembles each batch over several scheduler turns, for `max_times_sampled` > 0.

    Items sampled `max_times_sampled` times are deleted, so a table holding enough rows
    for a whole batch now may not a moment later. Each `sample` call therefore takes
    only as many rows as can be sampled at once without blocking (`can_sample_at_once`,
    which assumes every row it takes is deleted), and returns the batch once it holds
    `batch_size` rows, None before. Taking one row is always possible when no insert is
    (see `_validate_replay`), so the colocated scheduler never deadlocks.
    """

    def __init__(self, source: Source, item_spec: ItemSpec, *, timeout_s: float, table: str = TABLE_NAME):
        self._client = connect(source)
        self._reader = RolloutReader(self._client, item_spec, timeout_s=timeout_s, table=table)
        self._table = table
        self._timeout_s = timeout_s
        self._parts: list[tuple[dict[str, np.ndarray], SampleInfo]] = []

    @property
    def pending_rows(self) -> int:
        """Rows of the batch being assembled (0 between batches: checkpoints see none)."""
        return sum(len(p[1].keys) for p in self._parts)

    def _room(self, batch_size: int) -> int:
        """The most rows, up to what the batch still lacks, that can be sampled now without blocking."""
        state = limiter_state(self._client, self._table, self._timeout_s)
        lo, hi = 0, batch_size - self.pending_rows
        if state.can_sample_at_once(hi):
            return hi
        while hi - lo > 1:  # can_sample_at_once is monotone in n: holds at lo (vacuously at 0), fails at hi
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if state.can_sample_at_once(mid) else (lo, mid)
        return lo

    def can_sample(self, batch_size: int) -> bool:
        """Whether `sample` can take at least one more row now."""
        return self._room(batch_size) > 0

    def sample(self, batch_size: int) -> tuple[Optional[dict[str, np.ndarray]], Optional[SampleInfo]]:
        """Takes what it can; returns the whole batch once complete, else (None, None)."""
        n = self._room(batch_size)
        if n:
            self._parts.append(self._reader.sample(n))
        if self.pending_rows < batch_size:
            return None, None
        parts, self._parts = self._parts, []
        batch = {k: np.concatenate([p[0][k] for p in parts]) for k in parts[0][0]}
        return batch, SampleInfo(*(np.concatenate([getattr(p[1], f) for p in parts]) for f in SampleInfo._fields))


def reader_for(source: Source, config: Config,
               item_spec: ItemSpec) -> RolloutReader | PositiveBiasReader | IncrementalReader:
    """The reader `config` asks for: positive-bias when `replay.positive_fraction` > 0."""
    split = positive_split(config)
    if config.replay.mode == "replay" and config.replay.max_times_sampled:
        return IncrementalReader(source, item_spec, timeout_s=config.replay.timeout_s)
    if split.positive_size:
        return PositiveBiasReader(source, item_spec, timeout_s=config.replay.timeout_s,
                                  positive_batch=split.positive_batch)
    return RolloutReader(source, item_spec, timeout_s=config.replay.timeout_s)
