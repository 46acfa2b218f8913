"""The rollout tables from a `Config`, backend-neutral (`TableDef`, `Tables`), the
limiter state readers and writers decide on, and the errors every backend raises.

`LimiterState` (jaxreplay/replay/limiter.py, re-exported here) re-derives the rate limiter's
decisions from the server's counters, the same rules on both backends.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import sys
from typing import Callable, Literal, Mapping, Optional

from jaxreplay.config import Config, ConfigError, owner_check
from jaxreplay.replay.limiter import LimiterState  # re-exported: readers and writers decide on it
from jaxreplay.replay.rows import ItemSpec  # one table row per rollout

TABLE_NAME = "rollouts"
POSITIVE_TABLE_NAME = "positives"  # positive-bias sampling: the freshest correct rollouts
FRESH_TABLE_NAME = "fresh"  # fresh anchors: the newest actor step's rollouts


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
    if split.fresh_batch:
        defs.append(TableDef(FRESH_TABLE_NAME, "uniform", split.fresh_size, min_size_limit(1)))
    return defs


@dataclasses.dataclass(frozen=True)
class PositiveSplit:
    """How positive-bias sampling (`replay.positive_fraction` = d) divides window and batch.

    The main table keeps the freshest N - round(dN) rollouts, the positives table the
    freshest round(dN) with reward > 0 (a row can sit in both; Reverb stores it once).
    Each batch of B takes round(dB) rows from the positives, the rest from the main
    table, uniformly over each window: in proportion to the windows' capacities. The
    main table's limiter runs at spi * B_main / B, so every generated rollout is still
    trained on `samples_per_insert` times on average, counting every table.

    Fresh anchors (`replay.fresh_fraction` = f) take round(fB) rows of each batch from a
    third table holding the last R rollouts inserted (R = `rollouts_per_step`: the newest
    actor step's, once all of it is in), out of the main batch: the limiter counts only
    the main table's B_main = B - round(dB) - round(fB) samples per learner step, and its
    ratio drops by the same factor, so the learner still takes spi * R / B steps per
    actor step and trains on each rollout spi times on average.
    """

    main_size: int
    positive_size: int  # 0: positive bias off
    main_batch: int
    positive_batch: int
    main_samples_per_insert: float
    fresh_size: int = 0
    fresh_batch: int = 0  # 0: fresh anchors off


def positive_split(config: Config) -> PositiveSplit:
    r, b = config.replay, config.train.batch_size
    replay = r.mode == "replay"
    d, f = (r.positive_fraction, r.fresh_fraction) if replay else (0.0, 0.0)
    n_pos, b_pos, b_fresh = round(d * r.max_size), round(d * b), round(f * b)
    main = b - b_pos - b_fresh
    return PositiveSplit(main_size=r.max_size - n_pos, positive_size=n_pos, main_batch=main,
                         positive_batch=b_pos, main_samples_per_insert=r.samples_per_insert * main / b,
                         fresh_size=config.rollouts_per_step if b_fresh else 0, fresh_batch=b_fresh)


@owner_check
def check_freshness(config: Config) -> None:
    """replay.fresh_fraction: the main table keeps at least one row of each batch; fresh anchors
    and max_age are replay-mode settings."""
    r, split = config.replay, positive_split(config)
    if r.fresh_fraction and r.mode == "replay":
        _require(split.main_batch >= 1, "replay.fresh_fraction",
                 f"{r.fresh_fraction} with replay.positive_fraction={r.positive_fraction} leaves no row of a "
                 f"batch of {config.train.batch_size} to the rollout table, whose limiter paces the run")
        _require(r.max_times_sampled == 0, "replay.fresh_fraction",
                 "cannot be combined with replay.max_times_sampled (batches assembled row by row)")
    _require(r.mode == "replay" or not (r.fresh_fraction or r.max_age), "replay.mode",
             "on_policy trains each rollout once, freshest first: replay.fresh_fraction and replay.max_age "
             "apply to replay mode only")


def _require(ok: bool, key: str, why: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: {why}")


def resolve_backend(name: str) -> str:
    """"reverb" or "inprocess" for `replay.backend`; "auto" is reverb where it is installed."""
    if name != "auto":
        return name
    backend = "reverb" if importlib.util.find_spec("reverb") is not None else "inprocess"
    logging.getLogger(__name__).info("replay.backend=auto: using the %s backend", backend)
    return backend


@dataclasses.dataclass(frozen=True)
class Tables:
    """A server's tables, backend-neutral: what `serve` starts. `backend` ("reverb" or
    "inprocess") picks the server; the first of `defs` is the rate-limited one."""

    backend: str
    defs: tuple[TableDef, ...]
    item_spec: ItemSpec


def build_tables(config: Config, item_spec: ItemSpec, backend: str | None = None) -> Tables:
    """The tables of `table_defs(config)` for `backend` (default: `config.replay.backend`);
    pass them to `serve`."""
    return Tables(resolve_backend(backend or config.replay.backend), tuple(table_defs(config)), item_spec)


# table name -> its state, all taken at once (`Client.states`).
Snapshot = Mapping[str, LimiterState]


def table_state(states: Snapshot, table: str) -> LimiterState:
    """`states[table]`, with an error naming the tables there are."""
    if table not in states:
        raise KeyError(f"no table {table!r} on the replay server (tables: {', '.join(sorted(states))})")
    return states[table]


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
