"""Disaggregated training: an actor mesh samples while a learner mesh trains, concurrently.

The paper's W inference / T trainer split. The devices are cut in two
(`mesh.actor_devices` for the actor, the rest for the learner); each role runs in its
own thread and the Reverb rate limiter is what couples them: the actor blocks while
the table holds enough unsampled rollouts, the learner while it holds too few. Every
`train.weight_sync_every` learner steps the learner copies its params onto the actor
mesh (in-flight updates: the actor picks them up at its next batch), and every
rollout carries the policy version that generated it.

Every wait is bounded (`replay.timeout_s`) and watches a shared stop event, so the
run ends cleanly when the learner is done, and an exception in either thread stops
the other and is re-raised in the caller naming the thread.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
import yaml
from tqdm import tqdm

from jaxreplay import rundir, sharding
from jaxreplay.actor import Actor
from jaxreplay.rollouts import row_spec
from jaxreplay.config import Config, to_dict
from jaxreplay.eval import EVAL_BATCH, evaluate
from jaxreplay.learner import make_optimizer, make_train_step
from jaxreplay.rollouts import to_device_batch
from jaxreplay.metrics import MetricsWriter
from jaxreplay.models import abstract_params, init_params
from jaxreplay.replay import ReplayServer, ReplayTimeoutError, build_tables, reader_for, serve, writer_for
from jaxreplay.sampling import make_run_samplers
from jaxreplay.scheduler import admitted_inserts
from jaxreplay.tasks import make_task
from jaxreplay.warmstart import warm_start

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
    the others and is re-raised here as `RoleError` naming it. Roles must poll `stop`
    at least every `join_timeout_s`: a role still running after that is reported too.
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


def train_disaggregated(config: Config, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Runs a disaggregated training run (`mesh.actor_devices > 0`); returns the run summary.

    Not yet resumable: it neither writes nor reads checkpoints. Holds run.dir's lock throughout.
    """
    with rundir.claim(config.run.dir) as run_dir:
        return _train_disaggregated(config, run_dir, log)


def _train_disaggregated(config: Config, run_dir: Path, log: Callable[[str], None]) -> dict[str, Any]:
    c = config
    (run_dir / "config.yaml").write_text(yaml.safe_dump(to_dict(c), sort_keys=False))
    actor_mesh, learner_mesh = sharding.make_role_meshes(c.mesh)
    sharding.check_batch_sizes(actor_mesh, {"train.prompts_per_step * train.group_size": c.rollouts_per_step,
                                            "eval batch (eval.EVAL_BATCH)": EVAL_BATCH})
    sharding.check_batch_sizes(learner_mesh, {"train.batch_size": c.train.batch_size})
    log(f"actor mesh {sharding.describe(actor_mesh)} | learner mesh {sharding.describe(learner_mesh)}")

    task = make_task(c.task)
    tok = task.tokenizer
    graphdef, params = init_params(c.model, c.run.seed)
    sample_fn, greedy_fn = make_run_samplers(graphdef, c, stop_ids=tok.eos_ids, pad_id=tok.pad_id, mesh=actor_mesh)

    start = time.perf_counter()
    params, cached = warm_start(graphdef, params, task, c, run_dir / "warmstart")
    log(f"warm start {'loaded from cache' if cached else f'trained for {c.warmstart.steps} steps'} "
        f"({time.perf_counter() - start:.1f}s)")
    params = jax.device_get(params)
    to_actor = sharding.param_shardings(actor_mesh, abstract_params(c.model))
    weights = PolicyWeights(jax.device_put(params, to_actor), version=0)
    accuracy_start = evaluate(weights.latest()[0], task, greedy_fn)
    log(f"eval/accuracy at start: {accuracy_start:.3f}")

    optimizer = make_optimizer(c.train)
    learner_params = sharding.shard_params(params, learner_mesh)
    opt_state = sharding.shard_params(optimizer.init(params), learner_mesh)
    ref_params = jax.tree.map(jnp.copy, learner_params) if c.train.kl_coef > 0 else None
    train_step = make_train_step(graphdef, c, optimizer, learner_mesh)
    actor = Actor(c, task, sample_fn)
    spec = row_spec(c, task.prompt_len)

    server = serve(build_tables(c, spec), port=c.replay.port, timeout_s=c.replay.timeout_s)
    metrics = MetricsWriter(run_dir)
    timeout = c.replay.timeout_s
    shared: dict[str, Any] = {"actor": {}, "actor_steps": 0, "generate_s": 0.0, "train_s": 0.0, "staleness": []}
    final: dict[str, Any] = {}

    def actor_role(stop: threading.Event) -> None:
        step, pending = 0, None
        while not stop.is_set():
            if pending is None:
                params, version = weights.latest()
                pending, stats = actor.act(params, version, step)
                step += 1
                shared["actor_steps"], shared["generate_s"] = step, shared["generate_s"] + stats["seconds"]
                shared["actor"] = {k: stats[k] for k in ("reward_mean", "accuracy", "completion_length")}
            rows = len(pending["reward"])
            n = wait_for(lambda: admitted_inserts(server.info(), rows), stop, timeout,
                         lambda: f"the limiter to admit rollouts (learner stalled?): {server.describe()}")
            if n is None:
                return
            writer.insert({k: v[:n] for k, v in pending.items()})
            pending = {k: v[n:] for k, v in pending.items()} if n < rows else None

    def learner_role(stop: threading.Event) -> None:
        nonlocal learner_params, opt_state
        b, k = c.train.batch_size, c.train.weight_sync_every
        bar = tqdm(total=c.train.steps, disable=not c.run.progress_bar, desc="train", unit="step", dynamic_ncols=True)
        try:
            for step in range(1, c.train.steps + 1):
                batch = None
                while batch is None:  # replay.max_times_sampled: a batch may take several samples
                    if not wait_for(lambda: reader.can_sample(b), stop, timeout,
                                    lambda: f"a batch of {b} (actor stalled?): {server.describe()}"):
                        return
                    batch, _ = reader.sample(b)
                t0 = time.perf_counter()
                learner_params, opt_state, step_metrics = train_step(
                    learner_params, opt_state, to_device_batch(batch), ref_params)
                step_metrics = jax.device_get(step_metrics)
                shared["train_s"] += time.perf_counter() - t0
                if step % k == 0 or step == c.train.steps:  # version = learner steps behind these weights
                    weights.publish(jax.device_put(learner_params, to_actor), version=step)
                staleness = (step - 1) - batch["policy_version"]
                shared["staleness"].append(float(staleness.mean()))
                table = server.info()
                metrics.write(step, {
                    **{name: float(v) for name, v in step_metrics.items()}, **shared["actor"],
                    "batch/reward_mean": float(batch["reward"].mean()),
                    "batch/version_min": int(batch["policy_version"].min()),
                    "batch/version_max": int(batch["policy_version"].max()),
                    "replay/size": table.size, "replay/inserts": table.inserts, "replay/samples": table.samples,
                    "replay/ratio": table.samples / max(table.inserts, 1),
                    "staleness/mean": float(staleness.mean()), "staleness/max": int(staleness.max()),
                    "policy_version": step, "weights/version_at_actor": weights.latest()[1],
                })
                bar.update(1)
                bar.set_postfix(acc=f"{shared['actor'].get('accuracy', 0):.2f}",
                                ratio=f"{table.samples / max(table.inserts, 1):.2f}", refresh=False)
                final["steps"] = step
        finally:
            bar.close()

    try:
        writer = writer_for(server, c, spec)
        reader = reader_for(server, c, spec)
        run_roles({"actor": actor_role, "learner": learner_role}, join_timeout_s=timeout + 30)
        table = server.info()
    finally:
        metrics.close()
        server.stop()

    accuracy_end = evaluate(weights.latest()[0], task, greedy_fn)
    summary = {
        "mode": "disaggregated",
        "actor_mesh": sharding.describe(actor_mesh),
        "learner_mesh": sharding.describe(learner_mesh),
        "steps": final.get("steps", 0),
        "seconds": round(time.perf_counter() - start, 1),
        "eval/accuracy_start": accuracy_start,
        "eval/accuracy_end": accuracy_end,
        "replay/ratio": table.samples / max(table.inserts, 1),
        "replay/samples_per_insert_target": 1.0 if c.replay.mode == "on_policy" else c.replay.samples_per_insert,
        "replay/inserts": table.inserts,
        "replay/samples": table.samples,
        "actor/steps": shared["actor_steps"],
        "weights/pushes": weights.pushes,
        "staleness/mean": float(np.mean(shared["staleness"])) if shared["staleness"] else 0.0,
        "time/generate_s": round(shared["generate_s"], 2),
        "time/train_s": round(shared["train_s"], 2),
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    log(f"done: {summary['steps']} steps in {summary['seconds']}s | eval/accuracy {accuracy_start:.3f} -> "
        f"{accuracy_end:.3f} | replay/ratio {summary['replay/ratio']:.2f} (target "
        f"{summary['replay/samples_per_insert_target']:g}) | {weights.pushes} weight pushes | {run_dir}")
    return summary
