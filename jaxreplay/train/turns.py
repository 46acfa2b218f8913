"""The turn schedule (colocated and multi-host placements): the rate limiter decides each move.

Each turn takes the first move the table admits (`replay.limiter.next_move`):
  1. insert waiting rollouts while the limiter admits inserts;
  2. otherwise take a learner step while it admits a batch;
  3. otherwise, with nothing waiting, generate the next batch of rollouts.
Nothing blocks on the limiter, so this cannot deadlock while the limiter window holds one
batch plus one insert (`replay.limiter.window_shortfall`, checked with the config).

Colocated, the loop is the table's only client, so a snapshot of the limiter stays exact
until the loop's own next call, and with one table and no `max_times_sampled` it can add
its own inserts and samples to the snapshot (`LimiterState.after_insert/after_sample`)
instead of asking again. Multi-host, every process reads one global view (a collective
through JAX's coordination service) and so takes the same move: each inserts its own
rows, samples its own B / P rows, and all take the same learner step. The moves are decided
on the most rollouts any process has waiting: with a streaming actor (`sampling.engine`
continuous) the processes complete groups at different chunks, so at an insert move each
inserts what it has (up to the admitted rows), and all act (decode one chunk each) only when
none has rows waiting, which keeps every process's waiting rows within one chunk's groups.
"""

from __future__ import annotations

import json
import time
from typing import Any, Callable, Optional, Protocol

import numpy as np

from jaxreplay.replay.limiter import LimiterState, next_move
from jaxreplay.replay.multiprocess import GlobalView
from jaxreplay.replay.tables import ReplayInterrupted, Snapshot
from jaxreplay.replay.tables import check_only_client
from jaxreplay.rollout import rollouts
from jaxreplay.train.checkpoint import write_failure
from jaxreplay.train.guards import agreed
from jaxreplay.train.run import Run, replay_record


class TurnTables(Protocol):
    """The table as the turn schedule sees it, in any placement."""

    processes: int

    def state(self, pending: int) -> LimiterState:
        """The limiter now (for multi-host, every process's counters and the fewest rows pending)."""

    def most_pending(self, pending: int) -> int:
        """The most rollouts any process has waiting (this process's `pending`, given to `state`
        first): the moves are decided on it, so a process acts only when none has rows waiting."""

    def can_learn(self, batch_size: int) -> bool: ...

    def acted(self) -> None:
        """After an act move: the rollouts waiting changed (the table did not)."""

    def evict(self, run: Run) -> None:
        """`replay.max_age`: the stale rows out before the turn decides whether to learn."""

    def insert(self, rows: rollouts.Rows) -> None: ...

    def sample(self, batch_size: int) -> tuple[Optional[rollouts.Rows], Optional[np.ndarray]]:
        """(rows, times each was sampled), or (None, None) while a batch is assembled over turns."""

    def stopping(self, run: Run) -> Optional[int]:
        """The stop signal that reached this process (multi-host: any process, agreed by all)."""

    def checkpoint_due(self, run: Run) -> bool:
        """After a learner step, whether to save (multi-host: by any process's clock)."""

    def checkpoint(self) -> str: ...

    def prune(self, keep: set[str]) -> Any: ...


def run_turns(run: Run, tables: TurnTables) -> None:
    """Takes turns until `train.steps` learner steps; checkpoints as due, and on a stop signal
    (read between moves: the longest wait for it is one move, an actor step or a learner step)."""
    b = run.config.train.batch_size
    try:
        while not run.done:
            if signum := tables.stopping(run):
                raise run.stop(signum, lambda: _save(run, tables))
            tables.evict(run)
            pending = rollouts.count(run.pending)
            state = tables.state(pending)
            move = next_move(state, tables.most_pending(pending), tables.can_learn(b), tables.processes)
            if move.kind == "insert":  # every process takes the move, inserting what it has of the rows
                head, run.pending = rollouts.split(run.pending, move.rows) if pending else (None, None)
                _timed(run, tables.insert, head)
                run.progress.rows_inserted += rollouts.count(head)
            elif move.kind == "learn":
                t0 = time.perf_counter()
                batch, times_sampled = tables.sample(b)
                if batch is None:  # replay.max_times_sampled: the batch is assembled over several turns
                    run.progress.time_replay_s += time.perf_counter() - t0
                    continue
                run.progress.rows_sampled += rollouts.count(batch)
                run.learn(batch, times_sampled, lambda: tables.state(rollouts.count(run.pending)),
                          time.perf_counter() - t0)
                if tables.checkpoint_due(run):
                    _save(run, tables)
                    run.restart_stream()  # goes on as a run resumed from this checkpoint would
            else:
                run.act(run.params, run.progress.policy_version)
                tables.acted()
    except ReplayInterrupted as e:
        raise run.interrupted_wait(str(e)) from None
    _save(run, tables)
    run.final_table = replay_record(tables.state(rollouts.count(run.pending)))


def _save(run: Run, tables: TurnTables) -> None:
    if run.checkpoints and run.progress.learner_step != run.last_saved[0]:
        run.save(lambda: tables.state(rollouts.count(run.pending)), tables.checkpoint, tables.prune)


def _timed(run: Run, call: Callable, *args) -> Any:
    t0 = time.perf_counter()
    try:
        return call(*args)
    finally:
        run.progress.time_replay_s += time.perf_counter() - t0


class LocalTables:
    """One process's tables (colocated): a replay server with its reader and writer."""

    processes = 1

    def __init__(self, server, reader, writer, run: Run):
        self._server, self._reader, self._writer, self._run = server, reader, writer, run
        self._snapshot: Optional[Snapshot] = None  # the tables now; None once a call may have changed them

    def _states(self) -> Snapshot:
        if self._snapshot is None:
            self._snapshot = _timed(self._run, self._server.states)
        return self._snapshot

    def state(self, pending: int) -> LimiterState:
        return self._states()[self._server.table]

    def most_pending(self, pending: int) -> int:
        return pending

    def acted(self) -> None:
        """Nothing: the snapshot is of the table, which acting leaves alone."""

    def can_learn(self, batch_size: int) -> bool:
        return self._reader.can_sample(batch_size, self._states())

    def evict(self, run: Run) -> None:
        if run.evict_stale(self._server):
            self._snapshot = None

    def _after(self, move: Callable[[LimiterState], LimiterState]) -> None:
        """The snapshot advanced by the loop's own call, where that is exact; else forgotten."""
        states = self._snapshot
        main = None if states is None else states[self._server.table]
        exact = states is not None and len(states) == 1 and main.max_times_sampled == 0
        self._snapshot = {self._server.table: move(main)} if exact else None

    def insert(self, rows: rollouts.Rows) -> None:
        self._writer.insert(rows)
        n = rollouts.count(rows)
        self._after(lambda s: s.after_insert(n))

    def sample(self, batch_size: int) -> tuple[Optional[rollouts.Rows], Optional[np.ndarray]]:
        batch, info = self._reader.sample(batch_size, self._states())
        if batch is None:
            self._snapshot = None
            return None, None
        self._after(lambda s: s.after_sample(batch_size))
        return batch, info.times_sampled

    def stopping(self, run: Run) -> Optional[int]:
        return run.notice.signum

    def checkpoint_due(self, run: Run) -> bool:
        return run.checkpoint_due()

    def checkpoint(self) -> str:
        if self._snapshot is not None:  # the loop's own count must match the server's: no other client
            self._snapshot = check_only_client(self._snapshot, self._server.states())
        return self._server.checkpoint()

    def prune(self, keep: set[str]) -> Any:
        return self._server.prune(keep)


_FAILED = "!failed:"  # a shard's checkpoint name is never this: a process's write failure, in the gather


class JobWriteFailure(OSError):
    """A write failure on one process of a job, raised on every process at once (agreed)."""


class GlobalTables:
    """Every process's view of one table in a multi-host job (replay/multiprocess.py)."""

    def __init__(self, replay, coordinator, run: Run):
        self._replay, self._coord, self._run = replay, coordinator, run
        self.processes = coordinator.num_processes
        self._turn = 0  # names each collective read; every process counts alike
        self._view: Optional[GlobalView] = None  # the global view, until this process's next call

    def state(self, pending: int) -> LimiterState:
        if self._view is None:
            self._turn += 1
            self._view = _timed(self._run, self._replay.view, f"turn/{self._turn}", pending)
        return self._view.state

    def most_pending(self, pending: int) -> int:
        """Every process's waiting rollouts from the view `state` gathered: with the static actor
        all have as many; a streaming actor's processes complete groups at different chunks."""
        return self._view.most if self._view is not None else pending

    def acted(self) -> None:
        """Every process acted (the move is agreed): the view's waiting rows are out of date on
        all, so all gather the next turn's view afresh."""
        self._view = None

    def can_learn(self, batch_size: int) -> bool:
        """The global limiter admits the batch, and every shard holds its B / P rows (B / P
        distinct where sampling deletes, else one): a streaming actor's shards fill unevenly."""
        view = self._view
        if view is None or not view.state.can_sample_at_once(batch_size):
            return False
        return view.least_size >= (batch_size // self.processes if view.state.max_times_sampled > 0 else 1)

    def evict(self, run: Run) -> None:
        """Nothing: config validation refuses replay.max_age multi-host (replay.multiprocess)."""

    def insert(self, rows: Optional[rollouts.Rows]) -> None:
        """This process's share of an insert move (None: it has no rows waiting; streaming only)."""
        self._view = None
        if rows is not None:
            self._replay.insert(rows)

    def sample(self, batch_size: int) -> tuple[Optional[rollouts.Rows], Optional[np.ndarray]]:
        self._view = None
        return self._replay.sample(batch_size // self.processes)

    def stopping(self, run: Run) -> Optional[int]:
        """Any process's stop signal (the first process's that has one), agreed through the
        coordination service, so all save, stop, and exit with the same status."""
        self._turn += 1
        return agreed(self._coord.gather(f"stop/{self._turn}", str(int(run.notice.signum or 0))))

    def checkpoint_due(self, run: Run) -> bool:
        """The step count is alike on every process, but each has its own clock for
        `checkpoint.every_seconds`: any process's makes the save due on all (saving is collective)."""
        due = run.checkpoint_due()
        if run.config.checkpoint.every_seconds <= 0 or not run.checkpoints:
            return due
        return self._any_process("due", due)

    def _any_process(self, name: str, flag: bool) -> bool:
        """Whether `flag` holds on any process (a gather through the coordination service)."""
        self._turn += 1
        return "1" in self._coord.gather(f"{name}/{self._turn}", "1" if flag else "0")

    def checkpoint(self) -> str:
        """Every shard's checkpoint, named by process (one JSON list in the run's progress). A
        process that cannot write its shard's (disk full, read-only, quota) says so in the same
        gather, so every process raises that failure, not only the one that hit it."""
        self._turn += 1
        try:
            mine = self._replay.checkpoint()
        except Exception as e:
            failure = write_failure(e)
            if failure is None:
                raise
            mine = _FAILED + json.dumps([failure.errno, failure.strerror, failure.filename])
        names = self._coord.gather(f"checkpoint/{self._turn}", mine)
        for i, name in enumerate(names):
            if name.startswith(_FAILED):
                code, strerror, filename = json.loads(name[len(_FAILED):])
                raise JobWriteFailure(code, strerror, f"{filename} (on process {i})")
        return json.dumps(names)

    def prune(self, keep: set[str]) -> Any:
        mine = {json.loads(names)[self._coord.process_id] for names in keep}
        return self._replay.prune(mine)
