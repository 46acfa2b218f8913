"""The rollout tables from a `Config`, backend-neutral (`TableDef`), and their limiter state.

`LimiterState` re-derives Reverb's rate-limiter decisions from `server_info()`
counters. That matters because the `reverb.Table` object handed to a server goes
stale once the server restores a checkpoint (Reverb swaps in a new table built from
the checkpoint), so `Table.can_sample` would answer for an empty, dead table. The
in-process backend (inprocess.py) runs on the same `LimiterState` rules.

Reverb (and TensorFlow) are imported only when a Reverb table is built or asked.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import os
import sys
import tempfile
import time
from typing import Callable, Literal, Mapping, Optional

from jaxreplay.config import Config
from jaxreplay.scheduler import LimiterState
from jaxreplay.replay.rows import ItemSpec, RowLayout  # one table row per rollout

TABLE_NAME = "rollouts"
POSITIVE_TABLE_NAME = "positives"  # positive-bias sampling: the freshest correct rollouts

ROW_FIELD = "row"  # a Reverb item's one tensor: the packed rollout row


class ReplayTimeoutError(TimeoutError):
    """A replay call waited past its timeout; the message names the table and limiter state."""


class ReplayInterrupted(Exception):
    """A replay call stopped waiting because its caller's `interrupted()` turned true (SIGTERM)."""


class TableSharedError(RuntimeError):
    """A table changed in ways its only client did not make: another client is using it."""


# The longest a replay call waits in native code (or on a lock) before it checks its deadline
# and `interrupted()`. Python runs signal handlers on the main thread only between bytecodes,
# so a wait must come back to Python this often for SIGTERM to act.
WAIT_SLICE_S = 0.1

Interrupted = Optional[Callable[[], bool]]  # true once the caller wants every wait to stop


def check_interrupted(interrupted: Interrupted, what: str) -> None:
    """Raises `ReplayInterrupted` naming `what` (the call that was waiting) if `interrupted()`."""
    if interrupted is not None and interrupted():
        raise ReplayInterrupted(what)


@dataclasses.dataclass(frozen=True)
class RateLimit:
    """Reverb's `RateLimiter` parameters; build one with the constructors below, which
    validate as Reverb's `rate_limiters` classes do."""

    samples_per_insert: float
    min_size_to_sample: int
    min_diff: float
    max_diff: float


def sample_to_insert_ratio(samples_per_insert: float, min_size_to_sample: int, error_buffer: float) -> RateLimit:
    offset = samples_per_insert * min_size_to_sample
    min_diff, max_diff = offset - error_buffer, offset + error_buffer
    if samples_per_insert <= 0:
        raise ValueError(f"samples_per_insert ({samples_per_insert}) must be > 0")
    if max_diff - min_diff < 2 * max(1.0, samples_per_insert):
        raise ValueError("The size of error_buffer must be >= max(1.0, samples_per_insert) as smaller values "
                         "could completely block samples and/or insert calls.")
    if min_diff > offset:
        raise ValueError("The range covered by error_buffer is above samples_per_insert * min_size_to_sample.")
    if min_size_to_sample < 1:
        raise ValueError(f"min_size_to_sample ({min_size_to_sample}) must be a positive integer")
    return RateLimit(samples_per_insert, min_size_to_sample, min_diff, max_diff)


def queue_limit(size: int) -> RateLimit:
    """Reverb's `Queue`: at most `size` items waiting, each sampled once."""
    return RateLimit(1.0, 1, 0.0, float(size))


def min_size_limit(min_size_to_sample: int) -> RateLimit:
    """Reverb's `MinSize`: samples wait for `min_size_to_sample` items, nothing else is limited."""
    if min_size_to_sample < 1:
        raise ValueError(f"min_size_to_sample ({min_size_to_sample}) must be a positive integer")
    return RateLimit(1.0, min_size_to_sample, -sys.float_info.max, sys.float_info.max)


Selector = Literal["uniform", "fifo", "lifo", "prioritized"]


@dataclasses.dataclass(frozen=True)
class TableDef:
    """One table, whichever backend serves it; the remover is always FIFO."""

    name: str
    selector: Selector
    max_size: int
    rate_limit: RateLimit
    max_times_sampled: int = 0  # 0: unlimited
    priority_exponent: float = 1.0  # prioritized selector only


def table_defs(config: Config) -> list[TableDef]:
    """The rollout table for `config.replay.mode`, then the positives table when positive bias is on.

    "replay": `selector` over a FIFO window of `max_size` rollouts, held to
    `samples_per_insert` by a `SampleToInsertRatio` limiter.
    "on_policy": every rollout is trained on exactly once, freshest first (a LIFO
    queue): the `Queue` limiter admits an insert only while fewer than `max_size`
    rollouts wait, so the FIFO remover never evicts an unsampled rollout.
    """
    r, t = config.replay, config.train
    split = positive_split(config)
    if r.mode == "on_policy":
        size = max(t.batch_size, config.rollouts_per_step)
        return [TableDef(TABLE_NAME, "lifo", size, queue_limit(size), max_times_sampled=1)]
    defs = [TableDef(TABLE_NAME, r.selector, split.main_size,
                     sample_to_insert_ratio(split.main_samples_per_insert, r.min_size_to_sample,
                                            config.error_buffer),
                     max_times_sampled=r.max_times_sampled, priority_exponent=r.priority_exponent)]
    if split.positive_size:
        defs.append(TableDef(POSITIVE_TABLE_NAME, "uniform", split.positive_size, min_size_limit(1)))
    return defs


@dataclasses.dataclass(frozen=True)
class PositiveSplit:
    """How positive-bias sampling (`replay.positive_fraction` = d) divides window and batch.

    The main table keeps the freshest N - round(dN) rollouts, the positives table the
    freshest round(dN) with reward > 0 (a row can sit in both; Reverb stores it once).
    Each batch of B takes round(dB) rows from the positives, the rest from the main
    table, uniformly over each window: in proportion to the windows' capacities. The
    main table's limiter runs at spi * B_main / B, so every generated rollout is still
    trained on `samples_per_insert` times on average, counting both tables.
    """

    main_size: int
    positive_size: int  # 0: positive bias off
    main_batch: int
    positive_batch: int
    main_samples_per_insert: float


def positive_split(config: Config) -> PositiveSplit:
    r, b = config.replay, config.train.batch_size
    d = r.positive_fraction if r.mode == "replay" else 0.0
    n_pos, b_pos = round(d * r.max_size), round(d * b)
    return PositiveSplit(main_size=r.max_size - n_pos, positive_size=n_pos, main_batch=b - b_pos,
                         positive_batch=b_pos, main_samples_per_insert=r.samples_per_insert * (b - b_pos) / b)


def resolve_backend(name: str) -> str:
    """"reverb" or "inprocess" for `replay.backend`; "auto" is reverb where it is installed."""
    if name != "auto":
        return name
    backend = "reverb" if importlib.util.find_spec("reverb") is not None else "inprocess"
    logging.getLogger(__name__).info("replay.backend=auto: using the %s backend", backend)
    return backend


def build_tables(config: Config, item_spec: ItemSpec, backend: str | None = None) -> list:
    """The tables of `table_defs(config)` for `backend` (default: `config.replay.backend`):
    `reverb.Table`s or `InProcessTable`s; pass them to `serve`."""
    backend = resolve_backend(backend or config.replay.backend)
    if backend == "inprocess":
        from jaxreplay.replay.inprocess import InProcessTable
        return [InProcessTable(d, item_spec) for d in table_defs(config)]
    return [reverb_table(d, item_spec) for d in table_defs(config)]


def build_table(config: Config, item_spec: ItemSpec, backend: str | None = None):
    """The rollout table alone (see `table_defs`)."""
    return build_tables(config, item_spec, backend)[0]


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


def set_tf_cpu_only() -> None:
    """Keeps TensorFlow off GPUs; a no-op once TensorFlow has initialized its devices."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # TensorFlow's INFO and WARNING lines
    import tensorflow as tf
    try:
        tf.config.set_visible_devices([], "GPU")
    except RuntimeError:
        pass  # Devices already initialized: too late to hide them, and nothing to do here.


NATIVE_LOG_ENV = "JAXREPLAY_NATIVE_LOG"  # where native logs go; "stderr" leaves them there


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
    """The `reverb` module, its native logs quieted and TensorFlow hidden from GPUs first
    (Reverb imports it)."""
    if "reverb" not in sys.modules:
        quiet_native_logs()
        set_tf_cpu_only()
    import reverb
    return reverb


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


class LimiterQueries:
    """The limiter questions both server backends answer, in terms of their `info()`."""

    def info(self) -> LimiterState:
        raise NotImplementedError

    def describe(self) -> str:
        """One line for error messages and logs: size, counters, window, diff."""
        return self.info().describe()

    def can_insert(self, n: int) -> bool:
        return self.info().can_insert(n)

    def can_sample(self, n: int) -> bool:
        return self.info().can_sample(n)

    def snapshot(self) -> Snapshot:
        """Every table's state from one query (one RPC on Reverb). It stays exact for as long
        as no one inserts or samples: a colocated loop, the table's only client, reuses it
        for every decision until its own next insert or sample."""
        raise NotImplementedError


# table name -> its state, all taken at once (`LimiterQueries.snapshot`).
Snapshot = Mapping[str, LimiterState]


def limiter_states(client, timeout_s: float, asked_for: str = "its tables",
                   interrupted: Interrupted = None) -> dict[str, LimiterState]:
    """The live state of every table on the server, from one query (bounded by `timeout_s`;
    `asked_for` names what was wanted in the timeout's message)."""
    if hasattr(client, "states"):  # the in-process server is its own client
        return client.states()
    import_reverb()
    from reverb.cc import schema_pb2
    # `reverb.Client.server_info` also decodes every table's signature into TensorFlow
    # specs, which costs more than the RPC; the limiter needs only the counters. The RPC
    # takes whole seconds: one at a time, so signal handlers run between attempts.
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            protos = client._client.ServerInfo(1)
            break
        except RuntimeError as e:
            if "Deadline Exceeded" not in str(e):
                raise
        check_interrupted(interrupted, f"waiting for the Reverb server to report {asked_for}")
        if time.monotonic() >= deadline:
            raise ReplayTimeoutError(f"the Reverb server did not report {asked_for} within {timeout_s:g}s") from None
    infos = (schema_pb2.TableInfo.FromString(p) for p in protos)
    return {info.name: limiter_state_from_info(info) for info in infos}


def table_state(states: Snapshot, table: str) -> LimiterState:
    """`states[table]`, with an error naming the tables there are."""
    if table not in states:
        raise KeyError(f"no table {table!r} on the replay server (tables: {', '.join(sorted(states))})")
    return states[table]


def limiter_state(client, table: str, timeout_s: float, interrupted: Interrupted = None) -> LimiterState:
    """The live state of `table`, asked of the server (bounded by `timeout_s`)."""
    if hasattr(client, "state"):  # the in-process server is its own client
        return client.state(table)
    return table_state(limiter_states(client, timeout_s, f"table {table!r}", interrupted), table)


def check_only_client(expected: Snapshot, actual: Snapshot) -> Snapshot:
    """`actual`, once its insert and sample counters are those of `expected`, which the
    table's only client derived from its own calls; else `TableSharedError`."""
    for name, want in expected.items():
        got = table_state(actual, name)
        if (got.inserts, got.samples) != (want.inserts, want.samples):
            raise TableSharedError(
                f"table {name!r} was changed by another client: this one made inserts={want.inserts}, "
                f"samples={want.samples}, the server counts inserts={got.inserts}, samples={got.samples}; "
                "the colocated loop must be the table's only client (is another process using replay.port?)")
    return actual
