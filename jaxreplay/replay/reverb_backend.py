"""The Reverb backend: the only module that imports Reverb or TensorFlow.

Importing it imports neither; the first server or client imports Reverb, quieting its
native logs and hiding GPUs from TensorFlow first (Reverb imports TensorFlow), so it
never takes memory JAX needs. dm-reverb is pinned: the private pybind client calls
below are measured choices, not accidents.

Rows. Each rollout row, packed into one byte tensor (rows.py), is one step of a
trajectory writer, and each item references that one step. Reverb's Python writer
costs 3x its C++ writer for the same calls, so `insert` calls the C++ one. Small rows
are stored in chunks of up to `_FLUSH_EVERY` steps (each flush closes a chunk): 1.8x
cheaper to insert than one chunk per row. A sampled item brings its whole chunk,
decompressed, so a chunk holds at most `_CHUNK_BYTES` of rows (at least one): sampling
64 rows of 512 tokens from 2,560 took 6.7 ms in 32-row chunks and 1.5-1.8 ms in 3-row
ones (benchmarks/replay.py).

Samples. Reverb's samplers have no timeout, so `sample` first waits (polling the
limiter counters with a backoff sleep) until the whole batch can be sampled without
blocking, then takes exactly `n` items through one sampler asking for all `n` in one
request: a sampler kept open would fetch ahead, spending limiter budget before the next
insert, and `reverb.Client.sample` asks for one item per request (4x slower). The
sampler blocks in C++, where no signal handler runs, and can block even when the
limiter admitted the batch (another client may take the samples first), so a worker
thread takes the samples and the caller waits in `WAIT_SLICE_S` slices, checking its
deadline, `interrupted()`, and, given `known`, whether another client took them.

Checkpoints. Reverb's checkpointer keeps only the latest checkpoint in its directory
and, on start, loads the newest one there, falling back to a given path only when the
directory is empty. The learner needs the checkpoint taken at its own step, so each
server writes into a fresh, private staging directory, every checkpoint is moved out
of it into `checkpoint_root` (where Reverb never deletes), and a restore names its
checkpoint as the fallback of the empty staging directory. The limiter state comes
from the server's counters, not the `reverb.Table` handed to it: once a server
restores a checkpoint it swaps in a new table, and the old object answers for an
empty, dead one. Each checkpoint also holds `sha256.json`, every file's hash as Reverb wrote
it (taken before the move), so `verify` names a file cut short or changed since before a
server reads it: Reverb would start empty without its `DONE`, and fail deep in C++ on a
damaged record. Checkpoints written before the hashes are checked for their `DONE` only.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import queue
import shutil
import sys
import tempfile
import threading
import time
import weakref
from concurrent.futures import Future, TimeoutError as FutureTimeout
from typing import Mapping, Optional

import numpy as np

from jaxreplay.compat import set_tf_cpu_only
from jaxreplay.replay.backend import DamagedCheckpoint, SampleInfo, checkpoint_path, prune_directories
from jaxreplay.replay.ports import PortClaim
from jaxreplay.replay.rows import ItemSpec, RowLayout
from jaxreplay.replay.tables import (
    WAIT_SLICE_S, Interrupted, LimiterState, ReplayTimeoutError, TableDef, Tables, TableSharedError,
    check_interrupted, table_state)

ROW_FIELD = "row"  # an item's one tensor: the packed rollout row
_DONE = "DONE"  # Reverb marks a complete checkpoint with this file.
_HASHES = "sha256.json"  # ours, beside Reverb's files: each file's sha256 as Reverb wrote it
_FLUSH_EVERY = 32  # rows per flush: Reverb warns past ~50 unconfirmed items
_CHUNK_BYTES = 16 * 1024  # a sampled item brings its whole chunk, decompressed
_MAX_POLL_S = 0.05
_INFO = 5  # a pybind sample: key, probability, table size, priority, times sampled, then the packed row
NATIVE_LOG_ENV = "JAXREPLAY_NATIVE_LOG"  # where native logs go; "stderr" leaves them there


# --- importing Reverb ---------------------------------------------------------------

def quiet_native_logs() -> None:
    """Sends what C++ code writes to file descriptor 2 into a log file, Python's own stderr
    (tracebacks, warnings, progress bars) staying where it was.

    Reverb's logger writes every line (one per sampler made, so one per batch) to std::clog
    with no level or variable to turn it down. Nothing happens where stderr is already
    taken over: the CLI sends it to RUN_DIR/native.log, pytest captures it, notebooks have
    their own. The file is $JAXREPLAY_NATIVE_LOG, else jaxreplay-native-UID.log in the
    temporary directory.
    """
    target = os.environ.get(NATIVE_LOG_ENV) or os.path.join(tempfile.gettempdir(),
                                                             f"jaxreplay-native-{os.getuid()}.log")
    try:
        taken = sys.stderr is not sys.__stderr__ or sys.__stderr__.fileno() != 2
    except (AttributeError, ValueError, OSError):  # no real stderr
        taken = True
    if taken or target == "stderr":
        return
    sys.stderr.flush()
    log = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    terminal = os.dup(2)
    os.dup2(log, 2)
    os.close(log)
    sys.stderr = os.fdopen(terminal, "w", buffering=1, encoding=sys.__stderr__.encoding, errors="backslashreplace")


def import_reverb():
    """The `reverb` module, its native logs quieted and TensorFlow hidden from GPUs first."""
    if "reverb" not in sys.modules:
        quiet_native_logs()
        set_tf_cpu_only()
    import reverb
    return reverb


# --- tables -------------------------------------------------------------------------

def reverb_table(d: TableDef, item_spec: ItemSpec):
    """`d` as a `reverb.Table` with a signature matching `item_spec`."""
    reverb = import_reverb()
    rl = d.rate_limit
    limiter = reverb.rate_limiters.RateLimiter(rl.samples_per_insert, rl.min_size_to_sample, rl.min_diff,
                                               rl.max_diff)
    selectors = {"uniform": reverb.selectors.Uniform, "fifo": reverb.selectors.Fifo, "lifo": reverb.selectors.Lifo,
                 "prioritized": lambda: reverb.selectors.Prioritized(d.priority_exponent)}
    if d.selector not in selectors:
        raise ValueError(f"replay.selector: unknown selector {d.selector!r}")
    return reverb.Table(name=d.name, sampler=selectors[d.selector](), remover=reverb.selectors.Fifo(),
                        max_size=d.max_size, max_times_sampled=d.max_times_sampled, rate_limiter=limiter,
                        signature=table_signature(item_spec))


def table_signature(item_spec: ItemSpec):
    """One packed-row tensor (rows.py), named by its layout so checkpoints can be checked."""
    import tensorflow as tf
    layout = RowLayout(item_spec)
    return {ROW_FIELD: tf.TensorSpec((layout.nbytes,), tf.uint8, name=layout.describe())}


def limiter_state_from_info(info) -> LimiterState:
    """From a `reverb.TableInfo` (or the `TableInfo` proto it is read from). Reverb
    reports the limiter's own counters as `completed` insert/sample calls (restored
    with a checkpoint), and every item ever inserted is either still in the table or
    deleted."""
    rl = info.rate_limiter_info
    inserts, samples = int(rl.insert_stats.completed), int(rl.sample_stats.completed)
    return LimiterState(
        table=info.name, size=int(info.current_size), max_size=int(info.max_size),
        max_times_sampled=int(info.max_times_sampled), inserts=inserts, samples=samples,
        deletes=inserts - int(info.current_size), samples_per_insert=float(rl.samples_per_insert),
        min_size_to_sample=int(rl.min_size_to_sample), min_diff=float(rl.min_diff),
        max_diff=float(rl.max_diff))


# --- the sampler thread -------------------------------------------------------------

class _SamplerThread:
    """Takes samples of one table through Reverb's pybind sampler in a worker thread.

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
            weakref.finalize(self, self._requests.put, None)  # the thread ends with its client
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


@dataclasses.dataclass(frozen=True)
class _Call:
    """One `sample` call's table, start, deadline and interruption poll."""

    table: str
    n: int
    start: float
    timeout_s: float
    interrupted: Interrupted

    @property
    def deadline(self) -> float:
        return self.start + self.timeout_s


# --- the client ---------------------------------------------------------------------

class ReverbClient:
    """The `Client` protocol (backend.py) over a Reverb server at `address`, local or not.

    Inserts go through one C++ trajectory writer (one insert at a time); samples of each
    table through one sampler thread: use one reader per table.
    """

    def __init__(self, address: str, item_spec: ItemSpec, *, timeout_s: float = 60.0):
        """timeout_s: bounds each limiter query (`states`)."""
        reverb = import_reverb()
        self.address = address
        self._client = reverb.Client(address)
        self._layout = RowLayout(item_spec)
        self._timeout_s = timeout_s
        self._samplers: dict[str, _SamplerThread] = {}
        self._writer = self._cpp = None  # opened by the first insert
        self._insert_lock = threading.Lock()

    def states(self, interrupted: Interrupted = None) -> dict[str, LimiterState]:
        from reverb.cc import schema_pb2
        # `reverb.Client.server_info` also decodes every table's signature into TensorFlow
        # specs, which costs more than the RPC; the limiter needs only the counters. The RPC
        # takes whole seconds: one at a time, so signal handlers run between attempts.
        deadline = time.monotonic() + self._timeout_s
        while True:
            try:
                protos = self._client._client.ServerInfo(1)
                break
            except RuntimeError as e:
                if "Deadline Exceeded" not in str(e):
                    raise
            check_interrupted(interrupted, "waiting for the Reverb server to report its tables")
            if time.monotonic() >= deadline:
                raise ReplayTimeoutError(f"the Reverb server did not report its tables within "
                                         f"{self._timeout_s:g}s") from None
        infos = (schema_pb2.TableInfo.FromString(p) for p in protos)
        return {info.name: limiter_state_from_info(info) for info in infos}

    def insert(self, table: str, rows: Mapping[str, np.ndarray], priorities: np.ndarray, *,
               also: Optional[Mapping[str, np.ndarray]] = None, timeout_s: float,
               interrupted: Interrupted = None) -> None:
        """As `Client.insert`; rows sent before a timeout stay queued in Reverb and land
        once the limiter admits them."""
        self.insert_packed(table, self._layout.pack(rows) if len(priorities) else None, priorities, also=also,
                           timeout_s=timeout_s, interrupted=interrupted)

    def insert_packed(self, table: str, packed: Optional[np.ndarray], priorities: np.ndarray, *,
                      also: Optional[Mapping[str, np.ndarray]] = None, timeout_s: float,
                      interrupted: Interrupted = None) -> None:
        """As `insert`, the rows already packed [n, nbytes] (rows.py), as Reverb's sidecar receives them."""
        deadline, n = time.monotonic() + timeout_s, len(priorities)
        also = {t: np.asarray(mask, bool) for t, mask in (also or {}).items()}
        while not self._insert_lock.acquire(timeout=WAIT_SLICE_S):
            check_interrupted(interrupted, f"an insert into table {table!r} was waiting for another insert")
            if time.monotonic() >= deadline:
                raise ReplayTimeoutError(f"insert of {n} rows into table {table!r} timed out after {timeout_s:g}s "
                                         "waiting for another insert on this client")
        try:
            cpp = self._stream()
            squeezed = [True]  # the item is one step's row, not a [1, nbytes] slice
            for start in range(0, n, _FLUSH_EVERY):
                for i in range(start, min(n, start + _FLUSH_EVERY)):
                    refs = [cpp.Append([packed[i]])]
                    cpp.CreateItem(table, float(priorities[i]), refs, squeezed)
                    for other, mask in also.items():
                        if mask[i]:
                            cpp.CreateItem(other, 1.0, refs, squeezed)
                self._flush(table, deadline, n, timeout_s, interrupted)
        finally:
            self._insert_lock.release()

    def sample(self, table: str, n: int, *, timeout_s: float, interrupted: Interrupted = None,
               known: Optional[LimiterState] = None) -> tuple[dict[str, np.ndarray], SampleInfo]:
        packed, info = self.sample_packed(table, n, timeout_s=timeout_s, interrupted=interrupted, known=known)
        return self._layout.unpack(packed), info

    def sample_packed(self, table: str, n: int, *, timeout_s: float, interrupted: Interrupted = None,
                      known: Optional[LimiterState] = None) -> tuple[np.ndarray, SampleInfo]:
        """As `sample`, the rows left packed [n, nbytes], as Reverb's sidecar sends them."""
        call = _Call(table, n, time.monotonic(), timeout_s, interrupted)
        if known is None or not known.can_sample_at_once(n):
            known, state = None, self._wait(call, 0)
        else:
            state = known
        if state.can_sample_at_once(n):
            rows = self._take(call, n, state, known)
        else:  # Items may be deleted as they are sampled: take them one at a time.
            rows = []
            for i in range(n):
                rows.extend(self._take(call, 1, self._wait(call, i) if i else state, None))
        packed = np.stack([r[_INFO] for r in rows])
        info = SampleInfo(
            keys=np.array([r[0] for r in rows], np.uint64),
            probabilities=np.array([r[1] for r in rows], np.float64),
            table_size=np.array([r[2] for r in rows], np.int64),
            times_sampled=np.array([r[4] for r in rows], np.int32))
        return packed, info

    def delete(self, table: str, keys: np.ndarray) -> None:
        """As `Client.delete`: Reverb's MutatePriorities with deletes (unknown keys are skipped)."""
        self._client._client.MutatePriorities(table, [], [int(k) for k in np.asarray(keys, np.uint64)])

    def close(self) -> None:
        """Releases the insert stream (rows still queued behind the limiter may be dropped)
        and the sampler threads; idempotent."""
        if self._writer is not None:
            self._writer.close()
            self._writer = self._cpp = None
        for sampler in self._samplers.values():
            sampler.abandon()

    def _state(self, table: str, interrupted: Interrupted) -> LimiterState:
        return table_state(self.states(interrupted), table)

    def _stream(self):
        """The C++ trajectory writer, and Reverb's Python one around it for `flush` and `close`."""
        if self._cpp is None:
            reverb = import_reverb()
            chunk_rows = max(1, min(_FLUSH_EVERY, _CHUNK_BYTES // self._layout.nbytes))
            self._cpp = self._client._client.NewTrajectoryWriter(
                reverb.pybind.ConstantChunkerOptions(chunk_rows, chunk_rows), False)
            self._writer = reverb.trajectory_writer.TrajectoryWriter(self._cpp)
        return self._cpp

    def _flush(self, table: str, deadline: float, n: int, timeout_s: float, interrupted: Interrupted) -> None:
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
            check_interrupted(interrupted, f"an insert of {n} rows into table {table!r} was waiting for the server")
            if time.monotonic() >= deadline:
                break
        state = self._state(table, interrupted)
        if state.can_insert(1):
            why = ("waiting for the server to confirm them, although the rate limiter admits inserts "
                   "(a slow or busy server: raise replay.timeout_s?)")
        else:
            why = "waiting for the rate limiter to admit them (no sampler draining the table?)"
        raise ReplayTimeoutError(f"insert of {n} rows timed out after {timeout_s:g}s {why}: {state.describe()}")

    def _take(self, call: _Call, n: int, admitted: LimiterState, known: Optional[LimiterState]) -> list:
        """`n` samples through one sampler that requests exactly `n` at once, which the
        limiter admitted in state `admitted`; `known`: that state, when the caller vouched
        for it as the table's only client."""
        sampler = self._samplers.setdefault(call.table, _SamplerThread(self._client._client.NewSampler, call.table))
        future, arrived = sampler.submit(n)
        had = -1  # samples that had arrived at the end of the previous slice
        while True:
            try:
                return future.result(timeout=max(0.0, min(WAIT_SLICE_S, call.deadline - time.monotonic())))
            except FutureTimeout:
                pass
            try:
                check_interrupted(call.interrupted, f"sample({call.n}) from table {call.table!r} was waiting "
                                                    f"for {n} samples")
                got = len(arrived)
                now = self._state(call.table, call.interrupted)
                # Stalled for a whole slice with fewer samples than the table counts: others took the rest.
                if known is not None and (now.inserts != known.inserts or
                                          (got == had and now.samples - known.samples > got)):
                    raise TableSharedError(
                        f"table {call.table!r} was changed by another client while this one sampled it: "
                        f"its state admitted {n} samples at inserts={known.inserts}, samples={known.samples}; "
                        f"the server now counts inserts={now.inserts}, samples={now.samples}. The colocated loop "
                        "must be the table's only client (is another process using replay.port?)")
                had = got
                if time.monotonic() >= call.deadline:
                    raise ReplayTimeoutError(
                        f"sample({call.n}) timed out after {time.monotonic() - call.start:.3g}s waiting for {n} "
                        f"samples that the rate limiter had admitted ({admitted.describe()}); another client "
                        f"sampling from table {call.table!r} may have taken them: now {now.describe()}")
            except BaseException:
                sampler.abandon()
                raise

    def _wait(self, call: _Call, done: int) -> LimiterState:
        """Polls until `call.n` samples are allowed or, once `done` > 0, one more."""
        n = 1 if done else call.n
        pause = 1e-3
        while True:
            state = self._state(call.table, call.interrupted)
            if state.can_sample(n):
                return state
            check_interrupted(call.interrupted, f"sample({call.n}) was waiting for the rate limiter: "
                                                f"{state.describe()}")
            now = time.monotonic()
            if now >= call.deadline:
                taken = f" with {done} of {call.n} items taken," if done else ""
                raise ReplayTimeoutError(
                    f"sample({call.n}) timed out after {now - call.start:.3g}s{taken} waiting for the rate "
                    f"limiter to allow {n} more samples (no actor inserting?): {state.describe()}")
            time.sleep(min(pause, call.deadline - now))
            pause = min(2 * pause, _MAX_POLL_S)


# --- the server ---------------------------------------------------------------------

class ReverbServer(ReverbClient):
    """The `Backend` protocol: a `reverb.Server` in this process hosting `tables`, and
    the client to it. Stop it explicitly (or use `with`)."""

    def __init__(self, tables: Tables, *, port: int = 0, checkpoint_root: Optional[str | os.PathLike] = None,
                 restore_from: Optional[str | os.PathLike] = None, timeout_s: float = 60.0):
        """Starts serving `tables`, or the tables saved as `restore_from`.

        port: 0 picks a free port; a pinned one is claimed first (`PortClaim`), so a port
        another run serves on is refused with `PortInUseError`. checkpoint_root: where
        `checkpoint()` puts its checkpoints (without one, `checkpoint()` is refused).
        restore_from: a name `checkpoint()` returned (backend.py); the tables are
        restored from it, items and limiter counters, and must have been saved with the
        same settings.
        """
        reverb = import_reverb()
        self.reverb_tables = [reverb_table(d, tables.item_spec) for d in tables.defs]  # as handed to the server
        self._table = tables.defs[0].name
        self._checkpoint_root = None if checkpoint_root is None else os.fspath(checkpoint_root)
        restore = None if restore_from is None else os.path.abspath(
            checkpoint_path(self._checkpoint_root, restore_from))
        if restore is not None and not os.path.exists(os.path.join(restore, _DONE)):
            raise DamagedCheckpoint(f"{restore}: no complete Reverb checkpoint (its {_DONE} is missing)")
        if self._checkpoint_root is not None:
            os.makedirs(self._checkpoint_root, exist_ok=True)
        self._claim = PortClaim(port) if port else None
        self._staging = self._server = None
        try:
            # Fresh and empty, so Reverb loads exactly `restore` (or nothing).
            self._staging = tempfile.mkdtemp(prefix=".reverb-staging-", dir=self._checkpoint_root)
            checkpointer = reverb.checkpointers.DefaultCheckpointer(self._staging, fallback_checkpoint_path=restore)
            self._server = reverb.Server(self.reverb_tables, port=port or None, checkpointer=checkpointer)
            self.port = self._server.port
            super().__init__(f"localhost:{self.port}", tables.item_spec, timeout_s=timeout_s)
            if restore is not None:
                for t in self.reverb_tables:
                    self._check_restored(t, restore)
        except BaseException:
            self.stop()
            raise

    @property
    def table(self) -> str:
        return self._table

    def describe(self) -> str:
        return self._state(self._table, None).describe()

    def evict(self, table: str, below_version: int) -> int:
        """As `Backend.evict`, which Reverb cannot serve: its writer reports no item keys, so
        finding the stale items would take sampling them (config validation refuses max_age)."""
        raise NotImplementedError("replay.max_age needs replay.backend=inprocess: Reverb reports no item keys "
                                  "at insert, so its stale items could only be found by sampling them")

    def checkpoint(self) -> str:
        """As `Backend.checkpoint`. Blocks the server while it writes; Reverb offers no
        timeout for this call."""
        if self._checkpoint_root is None:
            raise ValueError("this Reverb server was started without a checkpoint_root")
        staged = self._client.checkpoint()
        _write_hashes(staged)
        name = os.path.basename(staged)
        os.replace(staged, os.path.join(self._checkpoint_root, name))  # same filesystem: atomic, out of Reverb's reach
        return name

    def prune(self, keep: set[str]) -> list[str]:
        """As `Backend.prune`, also deleting the staging directories of servers killed
        without `stop()` (one server per root)."""
        if self._checkpoint_root is None:
            return []
        staging = os.path.abspath(self._staging)
        return prune_directories(self._checkpoint_root, keep, skip=lambda name, path: path == staging)

    def stop(self) -> None:
        if getattr(self, "_client", None) is not None:
            self.close()
        if self._server is not None:
            self._server.stop()
            self._server = None
        if self._claim is not None:
            self._claim.release()
            self._claim = None
        if self._staging is not None:
            shutil.rmtree(self._staging, ignore_errors=True)
            self._staging = None

    def __enter__(self) -> "ReverbServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _check_restored(self, table, path: str) -> None:
        """A restored table keeps the settings it was saved with, whatever `table` says."""
        want, got = table.info, self._client.server_info(timeout=max(1, round(self._timeout_s)))[table.name]
        fields = {
            "sampler": (want.sampler_options, got.sampler_options),
            "remover": (want.remover_options, got.remover_options),
            "max_size": (want.max_size, got.max_size),
            "max_times_sampled": (want.max_times_sampled, got.max_times_sampled),
            "samples_per_insert": (want.rate_limiter_info.samples_per_insert,
                                   got.rate_limiter_info.samples_per_insert),
            "min_size_to_sample": (want.rate_limiter_info.min_size_to_sample,
                                   got.rate_limiter_info.min_size_to_sample),
            "min_diff": (want.rate_limiter_info.min_diff, got.rate_limiter_info.min_diff),
            "max_diff": (want.rate_limiter_info.max_diff, got.rate_limiter_info.max_diff),
            "signature": (want.signature, got.signature),
        }
        diffs = [f"{k}: checkpoint {g!r} vs config {w!r}".replace("\n", " ")
                 for k, (w, g) in fields.items() if w != g]
        if diffs:
            raise ValueError(f"Reverb checkpoint {path} was saved with different table settings: "
                             + "; ".join(diffs))


# --- checkpoint files ----------------------------------------------------------------

def _file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def _write_hashes(path: str) -> None:
    """Records each file of the checkpoint at `path` by its sha256, in `sha256.json` beside them."""
    hashes = {name: _file_sha256(os.path.join(path, name)) for name in sorted(os.listdir(path)) if name != _HASHES}
    partial = os.path.join(path, f".{_HASHES}.partial")
    with open(partial, "w") as f:
        json.dump(hashes, f)
    os.replace(partial, os.path.join(path, _HASHES))


def verify(path: str | os.PathLike) -> None:
    """Returns once the Reverb checkpoint at `path` is complete and its files match the hashes
    written with them (a checkpoint from before the hashes: once it is complete); else
    `DamagedCheckpoint` naming the first file that is missing or does not match. Reads files
    only: Reverb need not be importable here."""
    path = os.fspath(path)
    if not os.path.isfile(os.path.join(path, _DONE)):
        raise DamagedCheckpoint(f"{os.path.join(path, _DONE)}: missing (the marker of a complete Reverb checkpoint)")
    listed = os.path.join(path, _HASHES)
    if not os.path.exists(listed):
        return
    try:
        with open(listed) as f:
            hashes = dict(json.load(f))
    except (ValueError, TypeError) as e:
        raise DamagedCheckpoint(f"{listed}: not a JSON object as written ({e})") from None
    for name, expected in hashes.items():
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            raise DamagedCheckpoint(f"{file}: missing (a file of the Reverb checkpoint)")
        if _file_sha256(file) != expected:
            raise DamagedCheckpoint(f"{file}: its sha256 is not the one written with it (cut short or changed)")
