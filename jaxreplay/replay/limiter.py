"""The limiter arithmetic, in one place: what the table admits, which move comes next,
and the window rule that keeps some move always possible.

Every placement schedules by the same rule. Colocated and multi-host runs take turns:
each turn inserts waiting rollouts while the limiter admits them, else takes a learner
step while it admits a batch, else generates the next rollouts. Disaggregated roles run
concurrently but ask the same questions (`admitted_inserts`, `LimiterState.can_sample`).
Config validation asks `window_shortfall`, so the rule that a run can never deadlock is
written once.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Literal, NamedTuple, Optional

from jaxreplay.config import Config, ConfigError, owner_check


@dataclasses.dataclass(frozen=True)
class LimiterState:
    """A snapshot of one table and its rate limiter, with Reverb's admission rules.

    `diff` = inserts * samples_per_insert - samples. Reverb admits n inserts while
    the table stays at or below `min_size_to_sample`, else while the diff after them
    stays <= max_diff; it admits n samples while size >= min_size_to_sample and
    diff - n >= min_diff (rate_limiter.cc, mirrored operation for operation).
    """

    table: str
    size: int
    max_size: int
    max_times_sampled: int
    inserts: int
    samples: int
    deletes: int
    samples_per_insert: float
    min_size_to_sample: int
    min_diff: float
    max_diff: float

    @property
    def diff(self) -> float:
        return self.inserts * self.samples_per_insert - self.samples

    @property
    def ratio(self) -> float:
        """Measured samples per insert so far (nan before the first insert)."""
        return self.samples / self.inserts if self.inserts else float("nan")

    def can_insert(self, n: int) -> bool:
        if self.inserts + n - self.deletes <= self.min_size_to_sample:
            return True
        return (n + self.inserts) * self.samples_per_insert - self.samples <= self.max_diff

    def can_sample(self, n: int) -> bool:
        if self.inserts - self.deletes < self.min_size_to_sample:
            return False
        return self.inserts * self.samples_per_insert - self.samples - n >= self.min_diff

    def can_sample_at_once(self, n: int) -> bool:
        """Whether one sampler can take all `n` without blocking midway.

        Reverb admits a batch item by item. With `max_times_sampled` set, items may
        be deleted as they are sampled, and a table that shrinks below
        `min_size_to_sample` midway blocks the rest of the batch with no timeout;
        this holds even if every one of the `n` samples deletes its item.
        """
        worst_size = self.size - (n - 1 if self.max_times_sampled > 0 else 0)
        return self.can_sample(n) and worst_size >= self.min_size_to_sample

    def after_insert(self, n: int) -> "LimiterState":
        """The state once `n` admitted inserts have landed and no other call has: the FIFO
        remover evicts the oldest item for each insert into a full table. Exact for a
        table with no other client (the colocated loop), as Reverb's table.cc counts."""
        size = min(self.size + n, self.max_size)
        return dataclasses.replace(self, size=size, inserts=self.inserts + n, deletes=self.inserts + n - size)

    def after_sample(self, n: int) -> "LimiterState":
        """The state once `n` admitted samples were taken and no other call was made, for a
        table without `max_times_sampled` (whose samples delete items)."""
        if self.max_times_sampled > 0:
            raise ValueError(f"table {self.table!r}: samples may delete items (max_times_sampled="
                             f"{self.max_times_sampled}); ask the server instead")
        return dataclasses.replace(self, samples=self.samples + n)

    def describe(self) -> str:
        return (f"table {self.table!r}: size={self.size}, inserts={self.inserts}, "
                f"samples={self.samples}, deletes={self.deletes}, "
                f"samples_per_insert={self.samples_per_insert:g}, "
                f"min_size_to_sample={self.min_size_to_sample}, "
                f"window=[{self.min_diff:g}, {self.max_diff:g}], diff={self.diff:g}")


class SchedulerStuckError(RuntimeError):
    """Neither an insert nor a sample is admitted: the limiter settings are inconsistent."""


class Move(NamedTuple):
    kind: Literal["insert", "learn", "act"]
    rows: int = 0  # for "insert": rows from each process


def _largest(admits: Callable[[int], bool], n: int) -> int:
    """Largest k <= n with admits(k), for admits monotone (true at 0, then false from some k on)."""
    if admits(n):
        return n
    lo, hi = 0, n  # admits(lo) holds (vacuously for 0); admits(hi) does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if admits(mid) else (lo, mid)
    return lo


def admitted_inserts(state: LimiterState, n: int, processes: int = 1) -> int:
    """Largest k <= n such that k rows from each of `processes` writers are admitted together."""
    return _largest(lambda k: state.can_insert(k * processes), n)


def sample_room(state: LimiterState, n: int) -> int:
    """Largest k <= n that one sampler can take now without blocking midway."""
    return _largest(state.can_sample_at_once, n)


def next_move(state: LimiterState, pending: int, can_learn: bool, processes: int = 1) -> Move:
    """The next turn's move, a pure function of the table's state, so that every process
    of a multi-host job, reading the same global view, takes the same one.
    pending: rollouts each process holds that the table has not admitted yet;
    can_learn: whether the reader can take (part of) a batch now."""
    if pending and (k := admitted_inserts(state, pending, processes)) > 0:
        return Move("insert", k)
    if can_learn:
        return Move("learn")
    if pending == 0:
        return Move("act")
    raise SchedulerStuckError(f"the limiter admits neither an insert nor a sample: {state.describe()}")


def window_shortfall(config: Config, processes: int = 1) -> Optional[str]:
    """Why the limiter window deadlocks the scheduler, or None when some move is always possible.

    With D = inserts * spi - samples, Reverb admits an insert of one row from each of
    P processes while D + P * spi <= max_diff, and a sample of B while D - B >= min_diff.
    One of the two is always admitted iff the window max_diff - min_diff = 2 * error_buffer
    holds one batch plus one insert: 2 * error_buffer >= B + P * spi.
    """
    r, b = config.replay, config.train.batch_size
    if r.mode == "on_policy":
        return None  # a queue sized from the batch (replay.tables)
    need = b + processes * r.samples_per_insert
    if 2 * config.error_buffer >= need:
        return None
    who = "one insert" if processes == 1 else f"one insert from each of the {processes} processes"
    return (f"{config.error_buffer:g} deadlocks: the limiter window 2*error_buffer={2 * config.error_buffer:g} must "
            f"hold one batch plus {who} (train.batch_size + {'' if processes == 1 else f'{processes} * '}"
            f"samples_per_insert = {need:g}); raise it to at least {need / 2:g}")


def age_shortfall(config: Config) -> Optional[str]:
    """Why evicting rollouts older than `replay.max_age` = K versions stalls the limiter, or None.

    Evictions shrink the table but leave the limiter's diff alone. Held at its ratio, the
    limiter admits B / spi inserts per learner step (B, spi: the rollout table's batch and
    ratio; their quotient is the config's), so about (K + 1) * B / spi rows are at most K
    versions old when the learner samples. Fewer than `min_size_to_sample`, and evictions
    keep the table below it: samples wait for fresh acts, which Reverb's min-size rule then
    admits past the ratio, so the run stalls each step and no longer holds samples_per_insert.
    Disaggregated, the actor's weights lag the learner's by up to weight_sync_every - 1
    versions; a smaller K evicts every rollout made while the learner waits: a deadlock.
    """
    r, t = config.replay, config.train
    if not r.max_age or r.mode != "replay":
        return None
    young = (r.max_age + 1) * t.batch_size / r.samples_per_insert
    if young < r.min_size_to_sample:
        least = math.ceil(r.min_size_to_sample * r.samples_per_insert / t.batch_size) - 1
        return (f"{r.max_age} keeps about (max_age + 1) * train.batch_size / samples_per_insert = {young:g} rollouts "
                f"young enough to sample, fewer than replay.min_size_to_sample={r.min_size_to_sample}: evictions "
                f"would hold the table below it; raise it to at least {least}")
    if config.mesh.actor_devices and r.max_age < t.weight_sync_every - 1:
        return (f"{r.max_age} is below train.weight_sync_every - 1 = {t.weight_sync_every - 1}: the actor's "
                "weights lag that many versions, and every rollout made while the learner waits would be evicted")
    return None


@owner_check
def check_age(config: Config) -> None:
    """replay.max_age: evictions must leave the table enough young rows to sample (`age_shortfall`)."""
    if (why := age_shortfall(config)) is not None:
        raise ConfigError(f"replay.max_age: {why}")


@owner_check
def check_window(config: Config) -> None:
    """replay.error_buffer: the window rule for one process (multi-host checks its own count)."""
    if (why := window_shortfall(config)) is not None:
        raise ConfigError(f"replay.error_buffer: {why}")
