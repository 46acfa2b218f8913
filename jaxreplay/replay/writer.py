"""The actor's side: insert scored rollouts, one table item per row.

Each row, packed into one byte tensor (rows.py), is one step of a Reverb trajectory
writer, and each item references that one step. The writer's Python layer (`append`
restructuring the row, `history` rebuilding references, `create_item` validating
them) costs 3x what the C++ writer underneath does for the same calls, so `insert`
calls the C++ writer directly; fields are checked against the item spec before any
reaches Reverb (dm-reverb is pinned).

Small rows are stored in chunks of up to `_FLUSH_EVERY` steps (each flush closes a
chunk) rather than one chunk per row: 1.8x cheaper to insert. But a sampled item
brings its whole chunk, decompressed, so a chunk holds at most `_CHUNK_BYTES` of rows
(at least one): sampling 64 rows of 512 tokens from 2,560 took 6.7 ms in 32-row chunks
and 1.5-1.8 ms in 3-row ones (benchmarks/replay.py). A chunk lives while any item
references it, so with `max_times_sampled` deleting items out of order a table can
hold a chunk of memory per live item.
"""

from __future__ import annotations

import time
from typing import Callable, Mapping, Optional

import numpy as np

from jaxreplay.replay.inprocess import InProcessServer
from jaxreplay.replay.rows import RowLayout
from jaxreplay.replay.server import Source, connect
from jaxreplay.config import Config
from jaxreplay.replay.tables import (
    POSITIVE_TABLE_NAME, TABLE_NAME, WAIT_SLICE_S, Interrupted, ItemSpec, ReplayTimeoutError, check_interrupted,
    import_reverb, limiter_state, positive_split)

# Reverb warns ("alarmingly high") past ~50 unconfirmed items; flush in slices below that.
_FLUSH_EVERY = 32
# A sampled item brings its whole chunk with it, decompressed: chunks of large rows stay small.
_CHUNK_BYTES = 16 * 1024


class RolloutWriter:
    """Inserts batches of rollouts into `table`, never blocking past `timeout_s`."""

    def __init__(self, source: Source, item_spec: ItemSpec, *, timeout_s: float, table: str = TABLE_NAME,
                 positive_table: Optional[str] = None,
                 priority_fn: Optional[Callable[[Mapping[str, np.ndarray]], np.ndarray]] = None,
                 interrupted: Interrupted = None):
        """positive_table: rows with reward > 0 also get an item there (positive-bias
        sampling); both items reference the same stored row. priority_fn: the priorities
        of a batch when `insert` is given none (default: 1 for every row). interrupted:
        polled while an insert waits; once true, it raises `ReplayInterrupted`."""
        self._priority_fn = priority_fn
        self._interrupted = interrupted
        self._client = connect(source)
        self._table = table
        self._positive_table = positive_table
        self._spec = {k: (tuple(shape), np.dtype(dtype)) for k, (shape, dtype) in item_spec.items()}
        self._layout = RowLayout(self._spec)
        self._timeout_s = timeout_s
        # One step per item: each item references only the step just appended.
        self._writer = self._cpp = None
        if not isinstance(self._client, InProcessServer):
            reverb = import_reverb()
            # The pybind writer, and Reverb's Python one around it for `flush` and `close`.
            chunk_rows = max(1, min(_FLUSH_EVERY, _CHUNK_BYTES // self._layout.nbytes))
            self._cpp = self._client._client.NewTrajectoryWriter(
                reverb.pybind.ConstantChunkerOptions(chunk_rows, chunk_rows), False)
            self._writer = reverb.trajectory_writer.TrajectoryWriter(self._cpp)

    def insert(self, batch: Mapping[str, np.ndarray], priorities: Optional[np.ndarray] = None) -> None:
        """Inserts row i of every array as one item (with `priorities[i]`, default 1).

        Blocks while the rate limiter holds inserts back, at most `timeout_s` in all,
        then raises `ReplayTimeoutError`. Rows sent before a timeout stay queued in
        Reverb and land once the limiter admits them.
        """
        arrays, n = self._validate(batch)
        if priorities is None:
            priorities = self._priority_fn(arrays) if self._priority_fn is not None else np.ones(n, np.float64)
        priorities = np.asarray(priorities, np.float64)
        if priorities.shape != (n,):
            raise ValueError(f"priorities: expected shape ({n},), got {priorities.shape}")
        if self._writer is None:
            positive = (lambda i: (self._positive_table,) if arrays["reward"][i] > 0 else ()) \
                if self._positive_table is not None else (lambda i: ())
            self._client.insert([{k: a[i] for k, a in arrays.items()} for i in range(n)], priorities, positive,
                                table=self._table, timeout_s=self._timeout_s, interrupted=self._interrupted)
            return
        deadline = time.monotonic() + self._timeout_s
        rows = self._layout.pack(arrays)
        squeezed = [True]  # the item is one step's row, not a [1, nbytes] slice
        positive = arrays["reward"] > 0 if self._positive_table is not None else np.zeros(n, bool)
        for start in range(0, n, _FLUSH_EVERY):
            for i in range(start, min(n, start + _FLUSH_EVERY)):
                refs = [self._cpp.Append([rows[i]])]
                self._cpp.CreateItem(self._table, float(priorities[i]), refs, squeezed)
                if positive[i]:
                    self._cpp.CreateItem(self._positive_table, 1.0, refs, squeezed)
            self._flush(deadline, n)

    def close(self) -> None:
        """Releases the stream; rows still queued behind the limiter may be dropped."""
        if self._writer is not None:
            self._writer.close()

    def __enter__(self) -> "RolloutWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _flush(self, deadline: float, n: int) -> None:
        """Waits for the server to confirm every item sent, in slices that let signal handlers
        run; a timeout says whether the limiter or the server held them back."""
        reverb = import_reverb()
        while True:
            slice_ms = max(1, int(min(WAIT_SLICE_S, deadline - time.monotonic()) * 1000))
            try:
                self._writer.flush(timeout_ms=slice_ms)
                return
            except reverb.errors.DeadlineExceededError:
                pass
            check_interrupted(self._interrupted, f"RolloutWriter.insert of {n} rows was waiting for the server")
            if time.monotonic() >= deadline:
                break
        state = limiter_state(self._client, self._table, self._timeout_s, self._interrupted)
        if state.can_insert(1):
            why = ("waiting for the server to confirm them, although the rate limiter admits inserts "
                   "(a slow or busy server: raise replay.timeout_s?)")
        else:
            why = "waiting for the rate limiter to admit them (no sampler draining the table?)"
        raise ReplayTimeoutError(f"RolloutWriter.insert of {n} rows timed out after {self._timeout_s:g}s {why}: "
                                 f"{state.describe()}")

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


def writer_for(source: Source, config: Config, item_spec: ItemSpec, interrupted: Interrupted = None) -> RolloutWriter:
    """The writer `config` asks for: also filling the positives table when positive bias is on."""
    positive = POSITIVE_TABLE_NAME if positive_split(config).positive_size else None
    priority = advantage_priority if config.replay.selector == "prioritized" else None
    return RolloutWriter(source, item_spec, timeout_s=config.replay.timeout_s, positive_table=positive,
                         priority_fn=priority, interrupted=interrupted)


def advantage_priority(batch: Mapping[str, np.ndarray]) -> np.ndarray:
    """|advantage| (+ a floor, so no row is unreachable): a rollout whose group all scored
    alike carries no gradient and is rarely worth a sample."""
    return np.abs(np.asarray(batch["advantage"], np.float64)) + 1e-3
