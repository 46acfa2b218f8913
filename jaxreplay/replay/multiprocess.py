"""Replay for a multi-process (multi-host) job: one global limiter view over either layout.

`ShardedReplay` (replay.backend inprocess, which `auto` picks where Reverb is not
installed): each process keeps its own shard of the table, an in-process table
(inprocess.py) of max_size / P rows. Only counters cross hosts: every turn each process
publishes its shard's counters through JAX's coordination service (`Coordinator.gather`),
and every process sums the same numbers into the same global `LimiterState`, so all take
the decision that one central table's limiter would. Each process inserts its own
rollouts into its own shard and samples B / P rows from it, which makes the batch a
stratified uniform sample of the whole buffer. The shards' own limiters admit everything;
the global view decides. With the static actor every insert move puts equally many rows into
every shard, so the shards stay in lockstep and per-shard FIFO eviction keeps the freshest N
rows overall. A streaming actor (sampling.engine continuous) completes groups at different
chunks on each process: an insert move of k rows then puts min(k, its waiting rows) into each
shard, and the turn schedule learns only once every shard can give its B / P rows (turns.py).

What sharding means for each table setting (`check_sharded` rejects the rest):
  uniform selector                global: each draw uniform over the buffer, B / P per shard
  min_size_to_sample, ratio,      global: the limiter sees the summed counters
    error_buffer
  mode on_policy                  global: each rollout trained on once, freshest first (a
                                    lifo queue whose shards stay in lockstep)
  fifo / lifo                     rejected: each shard's oldest (freshest) row, P distinct
                                    rows per batch where one table repeats one
  prioritized                     rejected: draws in proportion within a shard, not the buffer
  max_times_sampled               rejected: with uniform, random deletions unbalance the shards;
                                    with fifo / lifo the shards delete alike (the B / m oldest
                                    rows, as one table), but the multi-host loop does not yet
                                    assemble batches row by row, so deleting samples can stall it
  positive_fraction               rejected: the freshest dN / P positives of each process are
                                    not the freshest dN overall
A shard is checkpointed on its own (`ShardedReplay.checkpoint`), each process its own; a
multi-host checkpoint names every process's.

`CentralReplay` (replay.backend reverb): one Reverb table on process 0 for every process;
the view is process 0's reading of it, taken once every process's calls have landed. Where
Reverb is not importable (the default tier) process 0's sidecar serves it and every other
process's sidecar holds only a Reverb client to its port (server.reverb_client), which costs
about what the Reverb lane's in-process clients pay (docs/benchmarks.md, replay-remote).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import NamedTuple, Optional, Protocol, Sequence

import numpy as np

from jaxreplay.config import Config, ConfigError, owner_check
from jaxreplay.replay.reader import RolloutReader
from jaxreplay.replay.server import reverb_client, serve
from jaxreplay.replay.tables import (
    ItemSpec, LimiterState, TableDef, Tables, build_tables, min_size_limit, resolve_backend, table_defs)
from jaxreplay.replay.writer import writer_for

SHARDED_WHY = "with sharded replay (replay.backend=inprocess, which auto picks without Reverb)"


class Coordinator(Protocol):
    """What the views need of `jaxreplay.train.distributed.Coordinator`."""

    process_id: int
    num_processes: int
    coordinator_host: str

    def barrier(self, name: str) -> None: ...

    def gather(self, key: str, value: str) -> list[str]: ...

    def broadcast(self, key: str, value: Optional[str]) -> str: ...


class GlobalView(NamedTuple):
    """The whole table's limiter state, and the rollouts every process has waiting (the
    fewest and the most of any), identical on every process. A streaming actor's processes
    complete groups at different chunks, so their waiting rollouts and shards differ."""

    state: LimiterState
    pending: int
    most: int = 0  # the most rollouts any process has waiting
    least_size: int = 0  # the rows of the smallest shard (one table: its size)


def check_sharded(config: Config, num_processes: Optional[int] = None) -> None:
    """ConfigError naming the key of any setting whose meaning sharding would change (see
    the module docstring); `num_processes` None checks what holds for any number."""
    r, b, p = config.replay, config.train.batch_size, num_processes
    if p:
        _require(b % p == 0, "train.batch_size", f"{b} does not split into {p} equal samples {SHARDED_WHY}")
    if r.mode == "on_policy":
        return  # a lifo queue, each row sampled once: the same on every shard (module docstring)
    if p:
        _require(r.max_size % p == 0, "replay.max_size", f"{r.max_size} does not split into {p} equal shards "
                 f"{SHARDED_WHY}")
    _require(r.positive_fraction == 0, "replay.positive_fraction",
             f"positive-bias sampling {SHARDED_WHY} would keep the freshest correct rollouts of each process, "
             "not of the whole buffer; set it to 0 or use replay.backend=reverb")
    _require(r.selector != "prioritized", "replay.selector",
             f"prioritized {SHARDED_WHY} would draw in proportion to priority within each process's shard, "
             "not over the whole buffer; use uniform or replay.backend=reverb")
    if r.selector == "uniform":
        why = "random deletions would leave the shards unequal, and B/P rows from each no longer a uniform sample"
    else:
        why = ("the shards would delete alike, but multi-host runs do not assemble batches row by row yet, which "
               "a table whose samples delete rows needs never to stall")
    _require(r.max_times_sampled == 0, "replay.max_times_sampled",
             f"{r.max_times_sampled} {SHARDED_WHY}: {why}; use 0 or replay.backend=reverb")
    _require(r.selector == "uniform", "replay.selector",
             f"{r.selector} {SHARDED_WHY} would take each shard's {'oldest' if r.selector == 'fifo' else 'freshest'} "
             "row again and again, P distinct rows per batch where one table repeats one; use uniform or "
             "replay.backend=reverb")


def check_multiprocess(config: Config, num_processes: Optional[int] = None) -> None:
    """What `open_replay` needs of `config` on the backend `replay.backend` resolves to here."""
    if resolve_backend(config.replay.backend) == "inprocess":
        check_sharded(config, num_processes)
    r = config.replay
    _require(r.positive_fraction == 0, "replay.positive_fraction",
             "positive-bias sampling is not supported multi-host yet; set it to 0")
    _require(r.fresh_fraction == 0, "replay.fresh_fraction",
             "fresh anchors are not supported multi-host yet: each process's newest rows are not the newest "
             "actor step's; set it to 0")
    _require(r.max_age == 0, "replay.max_age",
             "evictions are not supported multi-host yet: the processes' turns would have to agree on every "
             "table's evictions; set it to 0")
    _require(not r.drop_zero_advantage_groups, "replay.drop_zero_advantage_groups",
             "not supported multi-host yet: the processes would hold unequal rows, which the lockstep turns "
             "insert as equal shares; set it to false")


@owner_check
def check_distributed_replay(config: Config) -> None:
    """The replay package owns what sharding a table across processes means."""
    if config.distributed.enabled:
        check_multiprocess(config, config.distributed.num_processes or None)


def open_replay(config: Config, item_spec: ItemSpec, coordinator: Coordinator, *,
                checkpoint_root: Optional[str | os.PathLike] = None,
                restore_from: Optional[str] = None) -> "ShardedReplay | CentralReplay":
    """The view `replay.backend` asks for; every process of the job calls this together.
    restore_from: the name this process's `checkpoint` returned (relative to checkpoint_root)."""
    backend = resolve_backend(config.replay.backend)
    chosen = coordinator.gather("replay/backend", backend)  # `auto` differs where only some hosts have Reverb
    _require(len(set(chosen)) == 1, "replay.backend", "the processes use different backends: "
             f"{', '.join(f'{b} on process {i}' for i, b in enumerate(chosen))} (auto picks reverb only where it "
             "is installed); set one explicitly on all")
    where = dict(checkpoint_root=checkpoint_root, restore_from=restore_from)
    if backend == "inprocess":
        return ShardedReplay(config, item_spec, coordinator, **where)
    return CentralReplay(config, item_spec, coordinator, **where)


def shard_table(definition: TableDef, num_processes: int) -> TableDef:
    """One process's shard of `definition`: 1/P of its rows, a limiter that admits every
    call (the global view has decided), and the same selector and deletion rule."""
    return dataclasses.replace(definition, max_size=definition.max_size // num_processes,
                               rate_limit=min_size_limit(1))


def global_state(definition: TableDef, shards: Sequence[LimiterState]) -> LimiterState:
    """The limiter state of one table holding every shard's rows, under `definition`'s limiter."""
    rl = definition.rate_limit
    return LimiterState(
        table=definition.name, size=sum(s.size for s in shards), max_size=definition.max_size,
        max_times_sampled=definition.max_times_sampled, inserts=sum(s.inserts for s in shards),
        samples=sum(s.samples for s in shards), deletes=sum(s.deletes for s in shards),
        samples_per_insert=rl.samples_per_insert, min_size_to_sample=rl.min_size_to_sample,
        min_diff=rl.min_diff, max_diff=rl.max_diff)


def shard_dir(process_id: int) -> str:
    """Where process `process_id` keeps its shard's checkpoints, under the replay checkpoint root."""
    return f"shard-{process_id}"


def checkpoint_paths(backend: str, saved: Optional[str], multihost: bool) -> list[str]:
    """Where each process's replay checkpoint lies under the replay checkpoint root, given a
    step's record of them (`saved`: the one name, or multi-host a JSON list of the names
    `checkpoint` returned, in process order): each in-process shard's in its shard's directory;
    Reverb's one table's, process 0's, at the root ("" for the others: they hold none)."""
    if not saved:
        return []
    if not multihost:
        return [saved]
    names = json.loads(saved)
    return [f"{shard_dir(i)}/{name}" for i, name in enumerate(names)] if backend == "inprocess" else names


def own_checkpoint_path(backend: str, saved: Optional[str], process_id: Optional[int]) -> Optional[str]:
    """This process's path among `checkpoint_paths` (`process_id`: None on one host), or None
    where it holds none."""
    paths = checkpoint_paths(backend, saved, multihost=process_id is not None)
    return (paths[process_id or 0] or None) if paths else None


class ShardedReplay:
    """This process's shard of the rollout table, and the global limiter view over all shards."""

    def __init__(self, config: Config, item_spec: ItemSpec, coordinator: Coordinator, *,
                 checkpoint_root: Optional[str | os.PathLike] = None,
                 restore_from: Optional[str | os.PathLike] = None):
        """checkpoint_root: where `checkpoint` writes (a `shard-<id>` directory in it);
        restore_from: a name `checkpoint` returned on this process (relative to that directory)."""
        p, i = coordinator.num_processes, coordinator.process_id
        check_sharded(config, p)
        self.definition = table_defs(config)[0]
        self._coord = coordinator
        seed = int(np.random.SeedSequence([config.run.seed, i]).generate_state(1)[0])  # other draws per shard
        self.server = serve(
            Tables("inprocess", (shard_table(self.definition, p),), item_spec), timeout_s=config.replay.timeout_s,
            checkpoint_root=None if checkpoint_root is None else os.path.join(checkpoint_root, shard_dir(i)),
            restore_from=restore_from, seed=seed)
        self._writer = writer_for(self.server, config, item_spec)
        self._reader = RolloutReader(self.server, timeout_s=config.replay.timeout_s)

    def view(self, key: str, pending: int = 0) -> GlobalView:
        """Every process's counters, summed (a collective: all processes call it with the same `key`)."""
        local = self.local()
        mine = json.dumps([local.size, local.inserts, local.samples, local.deletes, pending])
        rows = [json.loads(v) for v in self._coord.gather(f"replay/{key}", mine)]
        shards = [dataclasses.replace(local, size=size, inserts=inserts, samples=samples, deletes=deletes)
                  for size, inserts, samples, deletes, _ in rows]
        return GlobalView(global_state(self.definition, shards), min(row[4] for row in rows),
                          max(row[4] for row in rows), min(row[0] for row in rows))

    def local(self) -> LimiterState:
        """This process's shard alone."""
        return self.server.states()[self.server.table]

    def insert(self, rows: dict[str, np.ndarray]) -> None:
        """Into this process's shard only (the global view has admitted them)."""
        self._writer.insert(rows)

    def sample(self, n: int) -> tuple[dict[str, np.ndarray], np.ndarray]:
        """`n` rows from this process's shard only, and how often each has been sampled."""
        rows, info = self._reader.sample(n)
        return rows, info.times_sampled

    def checkpoint(self) -> str:
        """This shard's items and counters; the name for `restore_from`."""
        return self.server.checkpoint()

    def prune(self, keep: set[str]) -> list[str]:
        """This shard's checkpoints but those named in `keep`."""
        return self.server.prune(keep)

    def stop(self) -> None:
        self.server.stop()


class CentralReplay:
    """One Reverb table served by process 0 (replay.backend reverb), shared by every process."""

    def __init__(self, config: Config, item_spec: ItemSpec, coordinator: Coordinator, *,
                 checkpoint_root: Optional[str | os.PathLike] = None, restore_from: Optional[str] = None):
        """checkpoint_root, restore_from: process 0's server's (the other processes hold clients)."""
        c, self._coord = config, coordinator
        self._server = None
        if coordinator.process_id == 0:
            self._server = serve(build_tables(c, item_spec, "reverb"), port=c.replay.port,
                                 timeout_s=c.replay.timeout_s, checkpoint_root=checkpoint_root,
                                 restore_from=restore_from, reverb_python=c.replay.reverb_python)
        self._client = self._server
        try:
            port = coordinator.broadcast("replay_port", None if self._server is None else str(self._server.port))
            if self._client is None:
                self._client = reverb_client(c, item_spec,
                                             c.distributed.replay_address or f"{coordinator.coordinator_host}:{port}")
            self._writer = writer_for(self._client, c, item_spec)
            self._reader = RolloutReader(self._client, timeout_s=c.replay.timeout_s)
        except BaseException:
            self.stop()
            raise

    def view(self, key: str, pending: int = 0) -> GlobalView:
        """Process 0's reading of the table once every process's calls have landed (a collective)."""
        self._coord.barrier(f"replay/{key}")
        state = None if self._server is None else dataclasses.asdict(self._server.states()[self._server.table])
        values = [json.loads(v) for v in self._coord.gather(f"replay/{key}", json.dumps([state, pending]))]
        state = LimiterState(**values[0][0])
        return GlobalView(state, min(v[1] for v in values), max(v[1] for v in values), state.size)

    def insert(self, rows: dict[str, np.ndarray]) -> None:
        self._writer.insert(rows)

    def sample(self, n: int) -> tuple[dict[str, np.ndarray], np.ndarray]:
        rows, info = self._reader.sample(n)
        return rows, info.times_sampled

    def checkpoint(self) -> str:
        """The table's checkpoint, taken by process 0 ("" on the others, which hold none)."""
        return "" if self._server is None else self._server.checkpoint()

    def prune(self, keep: set[str]) -> list[str]:
        return [] if self._server is None else self._server.prune(keep)

    def stop(self) -> None:
        """Stops process 0's server (others close their client); call it once no process will
        touch the table again."""
        if self._server is not None:
            self._server.stop()
        elif self._client is not None:
            self._client.close()


def _require(ok: bool, key: str, why: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: {why}")
