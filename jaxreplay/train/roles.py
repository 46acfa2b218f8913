"""The concurrent schedule (disaggregated placement): an actor thread samples while a
learner thread trains, each on its own mesh; the rate limiter couples them.

The actor waits while the table holds enough unsampled rollouts, the learner while it
holds too few (the paper's W inference / T trainer split). Every
`train.weight_sync_every` learner steps the learner publishes its params to the actor
mesh (in-flight updates: the actor picks them up at its next batch), and every rollout
carries the policy version that generated it.

Checkpoints: the actor changes the table and its own state only while holding
`run.actor_lock` (an insert, the end of a batch, picking up new weights), and holds it
never while decoding. The learner saves under that lock, so the checkpoint sees the
table, the waiting rollouts and the actor's prompt position and weights as one state;
a batch the actor is decoding meanwhile is not in it, and a resume regenerates it
identically from that position and those weights. Exact resume does not extend to the
interleaving of the threads: which rollouts a batch samples depends on timing, so a
resumed run matches an uninterrupted one in its counts and limits, not bit for bit.

Every wait is bounded (`replay.timeout_s`) and watches a shared stop event, so the
run ends cleanly when the learner is done, and an exception in either thread stops
the other and is re-raised in the caller naming the thread.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Optional, TypeVar

from jaxreplay.replay.limiter import LimiterState, admitted_inserts
from jaxreplay.replay.tables import ReplayInterrupted, ReplayTimeoutError
from jaxreplay.rollout import rollouts
from jaxreplay.train.guards import Preempted
from jaxreplay.train.run import Run, replay_record

T = TypeVar("T")
_MAX_POLL_S = 0.02


class RoleError(RuntimeError):
    """A role's thread raised; the other roles were stopped. The cause is chained."""


class PolicyWeights:
    """The actor's copy of the policy and its version; the learner publishes, the actor reads."""

    def __init__(self, params: Any, version: int):
        self._lock = threading.Lock()
        self._params, self._version = params, version
        self.pushes = 0

    def publish(self, params: Any, version: int) -> None:
        with self._lock:
            self._params, self._version = params, version
            self.pushes += 1

    def latest(self) -> tuple[Any, int]:
        with self._lock:
            return self._params, self._version


def run_roles(roles: dict[str, Callable[[threading.Event], None]], *, join_timeout_s: float) -> None:
    """Runs each role in its own thread with a shared stop event, until the first returns or raises.

    A role returning ends the run (the others see `stop` set); a role raising stops
    the others and is re-raised here as `RoleError` naming it (`Preempted` as itself).
    Roles must poll `stop` at least every `join_timeout_s`: a role still running after
    that is reported too.
    """
    stop = threading.Event()
    errors: list[tuple[str, BaseException]] = []

    def body(name: str, role: Callable[[threading.Event], None]) -> None:
        try:
            role(stop)
        except BaseException as e:  # noqa: BLE001 - reported to the caller below
            errors.append((name, e))
        finally:
            stop.set()

    threads = [threading.Thread(target=body, args=(name, role), name=name, daemon=True)
               for name, role in roles.items()]
    for t in threads:
        t.start()
    try:
        stop.wait()
    finally:  # KeyboardInterrupt in the caller also stops the roles
        stop.set()
        deadline = time.monotonic() + join_timeout_s
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
    stuck = [t.name for t in threads if t.is_alive()]
    if errors:
        name, error = errors[0]
        if isinstance(error, Preempted):
            raise error
        raise RoleError(f"{name} thread failed: {type(error).__name__}: {error}") from error
    if stuck:
        raise RoleError(f"{', '.join(stuck)} thread(s) did not stop within {join_timeout_s:g}s")


def wait_for(probe: Callable[[], T], stop: threading.Event, timeout_s: float, what: Callable[[], str]) -> Optional[T]:
    """Polls `probe` until it returns something truthy (returned), `stop` is set (None), or
    `timeout_s` passes (ReplayTimeoutError with `what()` in the message)."""
    deadline, pause = time.monotonic() + timeout_s, 1e-3
    while not stop.is_set():
        value = probe()
        if value:
            return value
        now = time.monotonic()
        if now >= deadline:
            raise ReplayTimeoutError(f"waited {timeout_s:g}s for {what()}")
        stop.wait(min(pause, deadline - now))
        pause = min(2 * pause, _MAX_POLL_S)
    return None


def run_concurrent(run: Run, server, reader, writer) -> PolicyWeights:
    """Runs the actor and learner threads until `train.steps`; returns the weights channel."""
    c = run.config
    weights = PolicyWeights(run.actor_params, run.actor_version)
    timeout = c.replay.timeout_s

    def actor_role(stop: threading.Event) -> None:
        while not stop.is_set():
            if run.pending is None:
                with run.actor_lock:  # the weights the next batch uses are part of the checkpoint
                    run.actor_params, run.actor_version = weights.latest()
                    params, version = run.actor_params, run.actor_version
                generated = run.generate(params, version)  # decoding: the learner may checkpoint meanwhile
                with run.actor_lock:
                    run.commit(*generated)
                if run.pending is None:  # every group dropped (replay.drop_zero_advantage_groups)
                    continue
            n = wait_for(lambda: admitted_inserts(_state(server), rollouts.count(run.pending)), stop, timeout,
                         lambda: f"the limiter to admit rollouts (learner stalled?): {server.describe()}")
            if n is None:
                return
            with run.actor_lock:
                head, rest = rollouts.split(run.pending, n)
                writer.insert(head)
                run.pending = rest
                run.progress.rows_inserted += n

    def learner_role(stop: threading.Event) -> None:
        b, k = c.train.batch_size, c.train.weight_sync_every

        def can_sample() -> bool:
            run.evict_stale(server)  # replay.max_age: stale rows out before each sample
            return reader.can_sample(b)
        while not run.done:
            if signum := run.notice.signum:
                raise run.stop(signum, lambda: _save(run, server))
            t0, batch = time.perf_counter(), None
            while batch is None:  # replay.max_times_sampled: a batch may take several samples
                if not wait_for(can_sample, stop, timeout,
                                lambda: f"a batch of {b} (actor stalled?): {server.describe()}"):
                    return
                batch, info = reader.sample(b)
            run.progress.rows_sampled += b
            run.learn(batch, info.times_sampled, lambda: _state(server), time.perf_counter() - t0)
            step = run.progress.learner_step
            if step % k == 0 or run.done:  # version = learner steps behind these weights
                weights.publish(run.stack.to_actor(run.params), version=step)
            if run.checkpoint_due():
                _save(run, server)

    try:
        run_roles({"actor": actor_role, "learner": learner_role}, join_timeout_s=timeout + 30)
    except RoleError as e:  # a stop signal ended a replay wait in either role
        if isinstance(e.__cause__, ReplayInterrupted):
            raise run.interrupted_wait(str(e.__cause__)) from None
        raise
    run.final_table = {**replay_record(_state(server)), "weights/pushes": weights.pushes}
    return weights


def _state(server) -> LimiterState:
    return server.states()[server.table]


def _save(run: Run, server) -> None:
    """Under the actor's lock: the table, the waiting rollouts and the actor's position agree."""
    with run.actor_lock:
        run.save(lambda: _state(server), server.checkpoint, server.prune)
