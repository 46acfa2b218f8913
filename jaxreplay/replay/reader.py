"""The learner's side: sample training batches, never blocking past a timeout.

Reverb's samplers have no timeout, so the reader first waits (polling the server's
limiter counters with a backoff sleep) until the whole batch can be sampled without
blocking, then samples exactly `batch_size` items: a sampler that fetches ahead would
spend limiter budget, since samples in flight count against it. A caller that already
holds a current `Snapshot` (the colocated loop, the table's only client) passes it and
skips the polling when it admits the batch.

Each batch gets its own Reverb sampler asking for exactly the batch in one request.
A sampler kept open across calls cannot avoid fetching ahead: its worker asks for
the next request as soon as the last one is answered, and the server takes that
sample (spending limiter budget, before the next insert) while the learner trains.
`reverb.Client.sample` asks for one item per request; requesting the whole batch
is 4x cheaper, hence the pybind sampler (dm-reverb is pinned).

That sampler has no timeout, and while it blocks in C++ no Python signal handler runs.
It can block even when the limiter admitted the batch: another client may take the
samples first. So a worker thread takes the samples and the caller waits for them in
`WAIT_SLICE_S` slices, checking its deadline and `interrupted()` between them (SIGTERM
sets the loop's flag). A caller that passed a snapshot claims to be the table's only
client; if the server's counters show otherwise, the wait ends in `TableSharedError`.
"""

from __future__ import annotations

import queue
import threading
import time
import weakref
from concurrent.futures import Future, TimeoutError as FutureTimeout
from typing import NamedTuple, Optional

import numpy as np

from jaxreplay.replay.inprocess import InProcessServer
from jaxreplay.replay.rows import RowLayout
from jaxreplay.replay.server import Source, connect
from jaxreplay.config import Config
from jaxreplay.replay.tables import (
    POSITIVE_TABLE_NAME, TABLE_NAME, WAIT_SLICE_S, Interrupted, ItemSpec, LimiterState, ReplayTimeoutError,
    Snapshot, TableSharedError, check_interrupted, limiter_state, limiter_states, positive_split, table_state)

_MAX_POLL_S = 0.05
_INFO = 5  # a pybind sample: key, probability, table size, priority, times sampled, then the packed row


class SampleInfo(NamedTuple):
    """Per-row sampling metadata: `keys` identify items across calls; `probabilities`
    and `table_size` give importance weights (N * P)^-beta for prioritized replay."""

    keys: np.ndarray  # [B] uint64
    times_sampled: np.ndarray  # [B] int32, this sample included
    probabilities: np.ndarray  # [B] float64
    table_size: np.ndarray  # [B] int64


class _SamplerThread:
    """Takes samples through Reverb's pybind sampler in a worker thread (module docstring).

    A request its caller stopped waiting for is abandoned: its thread stays in Reverb
    until the limiter admits those samples (they are then dropped) or the process ends,
    and later requests go to a fresh thread.
    """

    def __init__(self, new_sampler, table: str):
        self._new_sampler, self._table = new_sampler, table
        self._requests: Optional[queue.SimpleQueue] = None

    def submit(self, n: int) -> tuple[Future, list]:
        """Asks for `n` samples: (their future, the list they arrive in one by one)."""
        if self._requests is None:
            self._requests = queue.SimpleQueue()
            threading.Thread(target=_take_samples, args=(self._requests, self._new_sampler, self._table),
                             name=f"reverb-sampler-{self._table}", daemon=True).start()
            weakref.finalize(self, self._requests.put, None)  # the thread ends with its reader
        future, arrived = Future(), []
        self._requests.put((n, future, arrived))
        return future, arrived

    def abandon(self) -> None:
        """Stop serving requests from the current thread once its request returns."""
        if self._requests is not None:
            self._requests.put(None)
            self._requests = None


def _take_samples(requests: queue.SimpleQueue, new_sampler, table: str) -> None:
    """A sampler thread's work: each request is `n` samples from one sampler asking for exactly `n`."""
    while (request := requests.get()) is not None:
        n, future, arrived = request
        try:
            sampler = new_sampler(table, n, n)
            for _ in range(n):
                arrived.append(sampler.GetNextTrajectory())
            future.set_result(arrived)
        except BaseException as e:  # noqa: BLE001 - handed to the waiting caller
            future.set_exception(e)


class RolloutReader:
    """Samples batches of rollouts from `table` as numpy arrays [B, ...].

    Use one reader per table: two readers can both pass the wait and one of them
    then waits for its samples until more rollouts arrive or its timeout ends.
    interrupted: polled while waiting; once true, the call raises `ReplayInterrupted`.
    """

    def __init__(self, source: Source, item_spec: ItemSpec, *, timeout_s: float, table: str = TABLE_NAME,
                 interrupted: Interrupted = None):
        self._client = connect(source)
        self._table = table
        self._keys = sorted(item_spec)
        self._layout = RowLayout(item_spec)  # a Reverb item is one packed row
        self._timeout_s = timeout_s
        self._interrupted = interrupted
        # Reverb's sampler factory, (table, max_samples, samples per request) -> sampler, in its thread.
        self._sampler = None if isinstance(self._client, InProcessServer) else \
            _SamplerThread(self._client._client.NewSampler, table)

    def sample(self, batch_size: int, snapshot: Optional[Snapshot] = None) -> tuple[dict[str, np.ndarray], SampleInfo]:
        """Waits up to `timeout_s` until `batch_size` items can be sampled, then samples them.

        snapshot: the server's state now, if the caller knows it (nothing inserted or
        sampled since it was taken); when it admits the whole batch there is no wait.
        Raises `ReplayTimeoutError` if the batch does not come in time, `TableSharedError`
        if another client changed the table behind the snapshot.
        """
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        start = time.monotonic()
        known = None if snapshot is None else table_state(snapshot, self._table)
        if known is None or not known.can_sample_at_once(batch_size):
            known, state = None, self._wait(start, batch_size, 0)
        else:
            state = known
        if isinstance(self._client, InProcessServer):
            return self._sample_inprocess(batch_size, start)
        if state.can_sample_at_once(batch_size):
            rows = self._take(batch_size, start, state, known)
        else:  # Items may be deleted as they are sampled: take them one at a time.
            rows = []
            for i in range(batch_size):
                rows.extend(self._take(1, start, self._wait(start, batch_size, i) if i else state, None))
        batch = self._layout.unpack(np.stack([r[_INFO] for r in rows]))
        info = SampleInfo(
            keys=np.array([r[0] for r in rows], np.uint64),
            probabilities=np.array([r[1] for r in rows], np.float64),
            table_size=np.array([r[2] for r in rows], np.int64),
            times_sampled=np.array([r[4] for r in rows], np.int32))
        return batch, info

    def _take(self, n: int, start: float, admitted: LimiterState, known: Optional[LimiterState]) -> list:
        """`n` samples through one sampler that requests exactly `n` at once (see the module
        docstring), which the limiter admitted in state `admitted`; `known`: that state, when
        the caller vouched for it as the table's only client."""
        deadline = start + self._timeout_s
        future, arrived = self._sampler.submit(n)
        had = -1  # samples that had arrived at the end of the previous slice
        while True:
            try:
                return future.result(timeout=max(0.0, min(WAIT_SLICE_S, deadline - time.monotonic())))
            except FutureTimeout:
                pass
            try:
                check_interrupted(self._interrupted, f"RolloutReader.sample was waiting for {n} samples")
                got = len(arrived)
                now = limiter_state(self._client, self._table, self._timeout_s, self._interrupted)
                # Stalled for a whole slice with fewer samples than the table counts: others took the rest.
                if known is not None and (now.inserts != known.inserts or
                                          (got == had and now.samples - known.samples > got)):
                    raise TableSharedError(
                        f"table {self._table!r} was changed by another client while this one sampled it: "
                        f"its state admitted {n} samples at inserts={known.inserts}, samples={known.samples}; "
                        f"the server now counts inserts={now.inserts}, samples={now.samples}. The colocated loop "
                        "must be the table's only client (is another process using replay.port?)")
                had = got
                if time.monotonic() >= deadline:
                    raise ReplayTimeoutError(
                        f"RolloutReader.sample timed out after {time.monotonic() - start:.3g}s waiting for {n} "
                        f"samples that the rate limiter had admitted ({admitted.describe()}); another client "
                        f"sampling from table {self._table!r} may have taken them: now {now.describe()}")
            except BaseException:
                self._sampler.abandon()
                raise

    def _sample_inprocess(self, batch_size: int, start: float) -> tuple[dict[str, np.ndarray], SampleInfo]:
        taken = self._client.sample(self._table, batch_size,
                                    timeout_s=max(0.0, start + self._timeout_s - time.monotonic()),
                                    interrupted=self._interrupted)
        batch = {k: np.stack([t[0].row[k] for t in taken]) for k in self._keys}
        info = SampleInfo(
            keys=np.array([t[0].key for t in taken], np.uint64),
            times_sampled=np.array([t[3] for t in taken], np.int32),
            probabilities=np.array([t[1] for t in taken], np.float64),
            table_size=np.array([t[2] for t in taken], np.int64))
        return batch, info

    def can_sample(self, batch_size: int, snapshot: Optional[Snapshot] = None) -> bool:
        """Whether `sample(batch_size)` would return without waiting (in `snapshot`'s state,
        if given, else the server's now)."""
        return self._state(snapshot).can_sample_at_once(batch_size)

    def _state(self, snapshot: Optional[Snapshot]) -> LimiterState:
        if snapshot is None:
            return limiter_state(self._client, self._table, self._timeout_s, self._interrupted)
        return table_state(snapshot, self._table)

    def _wait(self, start: float, batch_size: int, done: int) -> LimiterState:
        """Polls until `batch_size` samples are allowed or, once `done` > 0, one more."""
        n = 1 if done else batch_size
        deadline, pause = start + self._timeout_s, 1e-3
        while True:
            state = limiter_state(self._client, self._table, self._timeout_s, self._interrupted)
            if state.can_sample(n):
                return state
            check_interrupted(self._interrupted, f"RolloutReader.sample({batch_size}) was waiting for the rate "
                                                 f"limiter: {state.describe()}")
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
                 table: str = TABLE_NAME, positive_table: str = POSITIVE_TABLE_NAME, interrupted: Interrupted = None):
        self._client = connect(source)
        self._main = RolloutReader(self._client, item_spec, timeout_s=timeout_s, table=table, interrupted=interrupted)
        self._positives = RolloutReader(self._client, item_spec, timeout_s=timeout_s, table=positive_table,
                                        interrupted=interrupted)
        self._positive_table = positive_table
        self._positive_batch = positive_batch
        self._timeout_s = timeout_s
        self._interrupted = interrupted

    def split(self, batch_size: int, snapshot: Optional[Snapshot] = None) -> tuple[int, int]:
        """(rows from the rollout table, rows from the positives table) for a batch now
        (`snapshot`: the server's state now, if the caller knows it)."""
        have = self._positives._state(snapshot).size > 0
        n_pos = min(self._positive_batch, batch_size) if have else 0
        return batch_size - n_pos, n_pos

    def can_sample(self, batch_size: int, snapshot: Optional[Snapshot] = None) -> bool:
        if snapshot is None:  # one query answers for both tables
            snapshot = limiter_states(self._client, self._timeout_s, interrupted=self._interrupted)
        n_main, _ = self.split(batch_size, snapshot)
        return n_main == 0 or self._main.can_sample(n_main, snapshot)

    def sample(self, batch_size: int, snapshot: Optional[Snapshot] = None) -> tuple[dict[str, np.ndarray], SampleInfo]:
        """Samples the split; rows from the positives table come last. Sampling one table
        leaves the other's state in `snapshot` current."""
        n_main, n_pos = self.split(batch_size, snapshot)
        parts = [reader.sample(n, snapshot) for reader, n in ((self._main, n_main), (self._positives, n_pos)) if n]
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

    def __init__(self, source: Source, item_spec: ItemSpec, *, timeout_s: float, table: str = TABLE_NAME,
                 interrupted: Interrupted = None):
        self._client = connect(source)
        self._reader = RolloutReader(self._client, item_spec, timeout_s=timeout_s, table=table,
                                     interrupted=interrupted)
        self._table = table
        self._timeout_s = timeout_s
        self._parts: list[tuple[dict[str, np.ndarray], SampleInfo]] = []

    @property
    def pending_rows(self) -> int:
        """Rows of the batch being assembled (0 between batches: checkpoints see none)."""
        return sum(len(p[1].keys) for p in self._parts)

    def _room(self, batch_size: int, snapshot: Optional[Snapshot]) -> int:
        """The most rows, up to what the batch still lacks, that can be sampled now without blocking."""
        state = self._reader._state(snapshot)
        lo, hi = 0, batch_size - self.pending_rows
        if state.can_sample_at_once(hi):
            return hi
        while hi - lo > 1:  # can_sample_at_once is monotone in n: holds at lo (vacuously at 0), fails at hi
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if state.can_sample_at_once(mid) else (lo, mid)
        return lo

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


def reader_for(source: Source, config: Config, item_spec: ItemSpec,
               interrupted: Interrupted = None) -> RolloutReader | PositiveBiasReader | IncrementalReader:
    """The reader `config` asks for: positive-bias when `replay.positive_fraction` > 0.
    interrupted: polled while a call waits; once true, the call raises `ReplayInterrupted`."""
    split = positive_split(config)
    timeout_s = config.replay.timeout_s
    if config.replay.mode == "replay" and config.replay.max_times_sampled:
        return IncrementalReader(source, item_spec, timeout_s=timeout_s, interrupted=interrupted)
    if split.positive_size:
        return PositiveBiasReader(source, item_spec, timeout_s=timeout_s, positive_batch=split.positive_batch,
                                  interrupted=interrupted)
    return RolloutReader(source, item_spec, timeout_s=timeout_s, interrupted=interrupted)
