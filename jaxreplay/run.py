"""One run's state and the moves every schedule makes with it: act, learn, checkpoint.

The schedules (turns.py: colocated and multi-host; roles.py: disaggregated) decide
*when* to act, insert and learn; this module is *what* each move does to the run's
state, so every placement counts, records and checkpoints alike.

A checkpoint holds everything a resume needs to continue exactly (`Run.state_tree` and
`Progress`): params and optimizer state; rollouts generated but not yet in the table;
the actor's prompt position (`Progress.actor_step`, which with the seed fixes the
prompts and the sampling key) and, where the actor has its own copy, the weights and
policy version it generates with, so a batch still being decoded at the checkpoint is
regenerated identically rather than saved half-done; and the table's own checkpoint,
named relative to the run dir.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any, Callable, Optional

import jax
import numpy as np
from tqdm import tqdm

from jaxreplay import rollouts
from jaxreplay.accounting import Accounting
from jaxreplay.actor import rollout_stats
from jaxreplay.checkpoint import Checkpointer, Progress
from jaxreplay.config import Config
from jaxreplay.guards import NonFiniteStreak, PreemptionNotice
from jaxreplay.placement import Placement
from jaxreplay.recorder import RunRecorder
from jaxreplay.scheduler import LimiterState
from jaxreplay.stack import Stack

ACTOR_STATS = ("reward_mean", "reward_std", "accuracy", "completion_length", "reward/errors")


@dataclasses.dataclass
class Run:
    config: Config
    placement: Placement
    stack: Stack
    recorder: Optional[RunRecorder]  # the leader's; other processes record nothing
    checkpointer: Checkpointer
    progress: Progress
    params: Any
    opt_state: Any
    accounting: Accounting
    start: float  # perf_counter at the run's start, earlier invocations included
    notice: PreemptionNotice
    log: Callable[[str], None]
    actor_params: Any = None  # the actor's copy, where it has one (disaggregated)
    actor_version: int = 0  # the policy version of `actor_params`
    pending: Optional[rollouts.Rows] = None  # generated rollouts the table has not admitted yet
    actor_stats: dict = dataclasses.field(default_factory=dict)
    last_saved: tuple[int, float] = (-1, 0.0)  # (learner step, perf_counter) of the latest checkpoint
    actor_lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    final_table: dict = dataclasses.field(default_factory=dict)  # `replay_record` once the schedule ends
    digest_start: str = ""  # multi-host: params_digest at this invocation's start
    checkpoints: bool = True  # False only where the tier cannot save this placement (compat.py)
    _bar: Any = None

    def __post_init__(self):
        self.nonfinite = NonFiniteStreak(self.config.train.max_nonfinite_steps)
        if self.last_saved[0] < 0:
            self.last_saved = (self.progress.learner_step, time.perf_counter())

    @property
    def bar(self) -> tqdm:
        """The progress bar, from the step the run (re)started at."""
        if self._bar is None:
            c = self.config
            self._bar = tqdm(total=c.train.steps, initial=self.progress.learner_step,
                             disable=not (c.run.progress_bar and self.placement.is_leader), desc="train",
                             unit="step", dynamic_ncols=True)
        return self._bar

    @property
    def done(self) -> bool:
        return self.progress.learner_step >= self.config.train.steps

    # -- the actor ---------------------------------------------------------------------------------

    def act(self, params: Any, version: int) -> None:
        """Generates the next batch of rollouts into `pending` (the schedule saw none waiting)."""
        self.commit(*self.generate(params, version))

    def generate(self, params: Any, version: int) -> tuple[rollouts.Rows, dict[str, Any]]:
        """Rollouts for the `actor_step`-th prompt batch with `params` at policy `version`;
        changes nothing, so a checkpoint taken meanwhile regenerates them identically."""
        return self.stack.actor.act(params, version, self.progress.actor_step)

    def commit(self, items: rollouts.Rows, stats: dict[str, Any]) -> None:
        """The generated batch becomes `pending`, and the actor moves to the next prompts.
        Counters and statistics are of every process's rollouts (multi-host: each holds its share)."""
        p, every = self.progress, self.placement.every_process(
            {**items, "reward/errors": np.array([stats["reward/errors"]])})
        stats = {**stats, **rollout_stats(every), "reward/errors": int(every.pop("reward/errors").sum())}
        p.actor_step += 1
        p.tokens_generated += stats["tokens"]
        p.time_generate_s += stats["seconds"]
        self.accounting.on_generate(every, stats["seconds"])
        self.actor_stats = {k: stats[k] for k in ACTOR_STATS}
        self.pending = items

    # -- the learner -------------------------------------------------------------------------------

    def learn(self, batch: rollouts.Rows, times_sampled: np.ndarray, table: Callable[[], LimiterState],
              replay_s: float) -> dict[str, Any]:
        """One learner step on `batch`; writes and returns the step's metrics record.
        table: the limiter's state after the step's sample (asked only for the record)."""
        c, p = self.config, self.progress
        t0 = time.perf_counter()
        self.params, self.opt_state, step_metrics = self.stack.train_step(
            self.params, self.opt_state, self.placement.learner_batch(batch), self.stack.ref_params)
        step_metrics = jax.device_get(jax.block_until_ready(step_metrics))
        seconds = time.perf_counter() - t0
        # The records describe the whole batch (multi-host: every process's rows).
        batch = self.placement.every_process({**batch, "times_sampled": np.asarray(times_sampled)})
        times_sampled = batch.pop("times_sampled")
        staleness = p.policy_version - batch["policy_version"]
        p.learner_step += 1
        p.policy_version += 1
        p.nonfinite_steps += int(step_metrics["nonfinite"])
        p.tokens_trained += int(batch["completion_mask"].sum())
        p.time_train_s += seconds
        p.time_replay_s += replay_s
        state = table()
        record = {
            **{k: float(v) for k, v in step_metrics.items()},
            **self.actor_stats,
            **self.accounting.on_train(batch, times_sampled, staleness, seconds),
            "batch/reward_mean": float(batch["reward"].mean()),
            "batch/version_min": int(batch["policy_version"].min()),
            "batch/version_max": int(batch["policy_version"].max()),
            **replay_record(state),
            "replay/times_sampled_mean": float(np.mean(times_sampled)),
            "staleness/mean": float(staleness.mean()),
            "staleness/max": int(staleness.max()),
            "policy_version": p.policy_version,
            "weights/version_at_actor": self.actor_version if self.actor_params is not None else p.policy_version,
            "train/nonfinite_steps": p.nonfinite_steps,
            "tokens/generated": p.tokens_generated,
            "tokens/trained": p.tokens_trained,
            "time/generate_s": p.time_generate_s,
            "time/train_s": p.time_train_s,
            "time/replay_s": p.time_replay_s,
        }
        step = p.learner_step
        if step % c.train.eval_every == 0 or step == c.train.steps:
            p.eval_accuracy = record["eval/accuracy"] = self.evaluate()
        if self.recorder:
            self.recorder.write(step, record)
        self.nonfinite.update(bool(step_metrics["nonfinite"]), step)  # raises before this step's checkpoint
        self.bar.update(1)
        self.bar.set_postfix(acc=f"{self.actor_stats.get('accuracy', 0):.2f}", eval=f"{p.eval_accuracy or 0:.2f}",
                             ratio=f"{state.ratio:.2f}", refresh=False)
        return record

    def evaluate(self) -> float:
        return self.stack.evaluate(self.actor_params if self.actor_params is not None else self.params)

    # -- checkpoints -------------------------------------------------------------------------------

    def checkpoint_due(self) -> bool:
        """After a learner step: every `checkpoint.every` steps, or `every_seconds` since the last."""
        c, step = self.config.checkpoint, self.progress.learner_step
        if step == self.last_saved[0] or not self.checkpoints:
            return False
        if step % c.every == 0 or self.done:
            return True
        return c.every_seconds > 0 and time.perf_counter() - self.last_saved[1] >= c.every_seconds

    def state_tree(self) -> dict[str, Any]:
        """The checkpointed arrays, with static shapes: the waiting rollouts padded to one
        actor batch (`rollouts_per_step` rows of this process; multi-host, one global array
        of every process's rows, so each process saves and restores its own)."""
        tree = checkpoint_tree(self.params, self.opt_state, self.pending, self.stack.spec, self.rows_per_act,
                               self.actor_params)
        tree["pending"] = self.placement.checkpoint_rows(tree["pending"])
        return tree

    @property
    def rows_per_act(self) -> int:
        return self.config.rollouts_per_step // self.placement.processes

    def save(self, table: Callable[[], LimiterState], replay_checkpoint: Callable[[], str],
             prune: Callable[[set[str]], Any]) -> None:
        """The table's checkpoint first, then Orbax's naming it: a kill in between leaves the
        older pair intact. The caller guarantees that no role changes the table meanwhile."""
        p = self.progress
        t0 = time.perf_counter()
        p.time_total_s = t0 - self.start
        p.actor_version = self.actor_version
        p.replay_counters = table_counters(table())
        p.replay_checkpoint = replay_checkpoint()
        p.time_replay_s += time.perf_counter() - t0
        self.checkpointer.save(p.learner_step, self.state_tree(), p)
        prune(self.checkpointer.replay_checkpoints())
        self.last_saved = (p.learner_step, time.perf_counter())

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def checkpoint_tree(params: Any, opt_state: Any, pending: Optional[rollouts.Rows], spec: rollouts.RowSpec,
                    capacity: int, actor_params: Any = None) -> dict[str, Any]:
    """The arrays of a checkpoint (the template a restore reads onto, given fresh state)."""
    tree = {"params": params, "opt_state": opt_state, "pending": rollouts.padded(pending, spec, capacity)}
    if actor_params is not None:
        tree["actor_params"] = actor_params
    return tree


def table_counters(state: LimiterState) -> dict[str, int]:
    """What a restored table must hold again: its limiter's counters and its size."""
    return {"size": state.size, "inserts": state.inserts, "samples": state.samples, "deletes": state.deletes}


def replay_record(state: LimiterState) -> dict[str, Any]:
    """The table's counters as every record and summary reports them."""
    return {"replay/size": state.size, "replay/inserts": state.inserts, "replay/samples": state.samples,
            "replay/ratio": state.ratio}
