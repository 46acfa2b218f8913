"""The rollout table: its Reverb definition from a `Config`, and its limiter state.

`LimiterState` re-derives Reverb's rate-limiter decisions from `server_info()`
counters. That matters because the `reverb.Table` object handed to a server goes
stale once the server restores a checkpoint (Reverb swaps in a new table built from
the checkpoint), so `Table.can_sample` would answer for an empty, dead table.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

import numpy as np
import reverb
import tensorflow as tf

from jaxreplay.config import Config

TABLE_NAME = "rollouts"
POSITIVE_TABLE_NAME = "positives"  # positive-bias sampling: the freshest correct rollouts

# name -> (per-item shape, dtype); one table row per rollout.
ItemSpec = Mapping[str, tuple[tuple[int, ...], np.dtype]]


class ReplayTimeoutError(TimeoutError):
    """A replay call waited past its timeout; the message names the table and limiter state."""


def build_table(config: Config, item_spec: ItemSpec) -> reverb.Table:
    """The Reverb table for `config.replay.mode`, with a signature matching `item_spec`.

    "replay": `selector` over a FIFO window of `max_size` rollouts, held to
    `samples_per_insert` by a `SampleToInsertRatio` limiter.
    "on_policy": every rollout is trained on exactly once, freshest first (a LIFO
    queue): the `Queue` limiter admits an insert only while fewer than `max_size`
    rollouts wait, so the FIFO remover never evicts an unsampled rollout.
    """
    r, t = config.replay, config.train
    signature = table_signature(item_spec)
    split = positive_split(config)
    if r.mode == "on_policy":
        size = max(t.batch_size, config.rollouts_per_step)
        return reverb.Table(
            name=TABLE_NAME, sampler=reverb.selectors.Lifo(), remover=reverb.selectors.Fifo(),
            max_size=size, max_times_sampled=1, rate_limiter=reverb.rate_limiters.Queue(size),
            signature=signature)
    return reverb.Table(
        name=TABLE_NAME,
        sampler=_selector(r.selector, r.priority_exponent),
        remover=reverb.selectors.Fifo(),
        max_size=split.main_size,
        max_times_sampled=r.max_times_sampled,
        rate_limiter=reverb.rate_limiters.SampleToInsertRatio(
            samples_per_insert=split.main_samples_per_insert, min_size_to_sample=r.min_size_to_sample,
            error_buffer=config.error_buffer),
        signature=signature)


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


def build_tables(config: Config, item_spec: ItemSpec) -> list[reverb.Table]:
    """The rollout table, then the positives table when positive-bias sampling is on."""
    tables = [build_table(config, item_spec)]
    split = positive_split(config)
    if split.positive_size:
        tables.append(reverb.Table(
            name=POSITIVE_TABLE_NAME, sampler=reverb.selectors.Uniform(), remover=reverb.selectors.Fifo(),
            max_size=split.positive_size, rate_limiter=reverb.rate_limiters.MinSize(1),
            signature=table_signature(item_spec)))
    return tables


def table_signature(item_spec: ItemSpec) -> dict[str, tf.TensorSpec]:
    return {name: tf.TensorSpec(tuple(shape), tf.as_dtype(np.dtype(dtype)), name=name)
            for name, (shape, dtype) in item_spec.items()}


def _selector(name: str, priority_exponent: float):
    if name == "uniform":
        return reverb.selectors.Uniform()
    if name == "fifo":
        return reverb.selectors.Fifo()
    if name == "lifo":
        return reverb.selectors.Lifo()
    if name == "prioritized":
        return reverb.selectors.Prioritized(priority_exponent)
    raise ValueError(f"replay.selector: unknown selector {name!r}")


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

    @classmethod
    def from_table_info(cls, info) -> "LimiterState":
        """From a `reverb.TableInfo`; Reverb reports the limiter's own counters as
        `completed` insert/sample calls (restored with a checkpoint), and every item
        ever inserted is either still in the table or deleted."""
        rl = info.rate_limiter_info
        inserts, samples = int(rl.insert_stats.completed), int(rl.sample_stats.completed)
        return cls(
            table=info.name, size=int(info.current_size), max_size=int(info.max_size),
            max_times_sampled=int(info.max_times_sampled), inserts=inserts, samples=samples,
            deletes=inserts - int(info.current_size), samples_per_insert=float(rl.samples_per_insert),
            min_size_to_sample=int(rl.min_size_to_sample), min_diff=float(rl.min_diff),
            max_diff=float(rl.max_diff))

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

    def describe(self) -> str:
        return (f"table {self.table!r}: size={self.size}, inserts={self.inserts}, "
                f"samples={self.samples}, deletes={self.deletes}, "
                f"samples_per_insert={self.samples_per_insert:g}, "
                f"min_size_to_sample={self.min_size_to_sample}, "
                f"window=[{self.min_diff:g}, {self.max_diff:g}], diff={self.diff:g}")


def limiter_state(client: reverb.Client, table: str, timeout_s: float) -> LimiterState:
    """The live state of `table`, asked of the server (bounded by `timeout_s`)."""
    try:
        infos = client.server_info(timeout=max(1, int(np.ceil(timeout_s))))
    except reverb.errors.DeadlineExceededError:
        raise ReplayTimeoutError(f"the Reverb server did not report table {table!r} "
                                 f"within {timeout_s:g}s") from None
    if table not in infos:
        raise KeyError(f"no table {table!r} on the Reverb server (tables: {', '.join(sorted(infos))})")
    return LimiterState.from_table_info(infos[table])
