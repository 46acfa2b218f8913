"""Colocated training: one process, one policy, and the Reverb rate limiter as the scheduler.

Each turn takes the first move the table allows:
  1. insert waiting rollouts while the limiter admits inserts;
  2. otherwise take a learner step while it admits a sample of `batch_size`;
  3. otherwise, with nothing waiting, generate the next batch of rollouts.
Nothing ever blocks on the limiter in this thread, so this cannot deadlock as long
as the limiter window fits one batch plus one insert (checked in config).

Every decision of a turn is made on one limiter snapshot (`server.snapshot()`, one
RPC). This loop is the table's only client, so a snapshot stays exact until the
loop's own next insert or sample: generating keeps it; the one after a learner step
serves both that step's metrics record and the next turn. With a single table and
no `max_times_sampled` the loop's own inserts and samples change only counters it
can add itself (`LimiterState.after_insert` / `after_sample`), so after the first
snapshot it asks the server no more; otherwise it asks again after each insert and
sample. `time/replay_s` counts every replay call the loop makes, snapshots included.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
import yaml
from tqdm import tqdm

from jaxreplay import rundir, sharding
from jaxreplay.accounting import Accounting, param_count
from jaxreplay.actor import Actor
from jaxreplay.rollouts import row_spec
from jaxreplay.calibrate import calibrated, measure_mu
from jaxreplay.checkpoint import Checkpointer, Progress
from jaxreplay.config import Config, to_dict
from jaxreplay.eval import EVAL_BATCH, evaluate
from jaxreplay.guards import NonFiniteStreak, Preempted, PreemptionNotice
from jaxreplay.learner import make_optimizer, make_train_step
from jaxreplay.rollouts import to_device_batch
from jaxreplay.metrics import MetricsWriter
from jaxreplay.models import init_params
from jaxreplay.models.hf import load_hf_model
from jaxreplay.replay import (ReplayInterrupted, ReplayServer, build_tables, check_only_client, check_port, reader_for,
                              resolve_backend, serve, writer_for)
from jaxreplay.replay.tables import LimiterState, Snapshot
from jaxreplay.sampling import make_run_samplers
from jaxreplay.scheduler import SchedulerStuckError, admitted_inserts
from jaxreplay.models.tokenizer import load_tokenizer
from jaxreplay.tasks import make_task
from jaxreplay.warmstart import warm_start


def _save_config(run_dir: Path, config: Config) -> None:
    (run_dir / "config.yaml").write_text(yaml.safe_dump(to_dict(config), sort_keys=False))


def _with_backend(config: Config, log: Callable[[str], None]) -> Config:
    """`config` with the replay backend `auto` resolved to, said and checked before any work."""
    backend = resolve_backend(config.replay.backend)
    log(f"replay backend: {backend}" + (" (replay.backend=auto)" if config.replay.backend == "auto" else ""))
    if backend == "reverb":
        check_port(config.replay.port)
    return dataclasses.replace(config, replay=dataclasses.replace(config.replay, backend=backend))


def train(config: Config, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Runs (or resumes) a colocated training run, holding run.dir's lock; returns the run summary."""
    with rundir.claim(config.run.dir) as run_dir:
        done = _steps_done(run_dir, config.checkpoint.keep)
        if done is not None and done >= config.train.steps:
            log(f"nothing to run: no step ran, because the checkpoint in {run_dir / 'checkpoints'} is already at "
                f"step {done} >= train.steps={config.train.steps}; raise train.steps to train further")
            return {**_last_summary(run_dir), "steps": done, "steps_run": 0}
        return _train(config, run_dir, log)


def _last_summary(run_dir: Path) -> dict[str, Any]:
    """The summary the run wrote when it last stopped (read, never rewritten), or {}."""
    try:
        return json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return {}


def _steps_done(run_dir: Path, keep: int) -> Optional[int]:
    """The step of the latest complete checkpoint in `run_dir`, if any."""
    if not (run_dir / "checkpoints").is_dir():
        return None
    checkpointer = Checkpointer(run_dir / "checkpoints", keep=keep)
    try:
        return checkpointer.latest_step()
    finally:
        checkpointer.close()


def _train(config: Config, run_dir: Path, log: Callable[[str], None]) -> dict[str, Any]:
    c = _with_backend(config, log)
    _save_config(run_dir, c)

    mesh = sharding.mesh_for(c)  # colocated: one mesh samples and trains
    if c.model.hf_path:  # a released model: its architecture and tokenizer, its weights straight onto the mesh
        m = c.model
        model_cfg, graphdef, params = load_hf_model(
            m.hf_path, param_dtype=m.param_dtype, compute_dtype=m.compute_dtype, max_seq_len=m.max_seq_len,
            shardings=lambda abstract: sharding.param_shardings(mesh, abstract))
        c = dataclasses.replace(c, model=model_cfg)
        task = make_task(c.task, load_tokenizer(m.hf_path, vocab_size=model_cfg.vocab_size))
        log(f"loaded {m.hf_path} ({model_cfg.n_layers} layers, width {model_cfg.d_model}); no warm start")
    else:
        graphdef, params = init_params(c.model, c.run.seed)
        task = make_task(c.task)
    tok = task.tokenizer
    sharding.check_batch_sizes(mesh, {"eval batch (eval.EVAL_BATCH)": EVAL_BATCH})
    sample_fn, greedy_fn = make_run_samplers(graphdef, c, stop_ids=tok.eos_ids, pad_id=tok.pad_id, mesh=mesh)

    start = time.perf_counter()
    if c.model.hf_path is None:  # a released model needs no warm start
        params, cached = warm_start(graphdef, params, task, c, run_dir / "warmstart")
        log(f"warm start {'loaded from cache' if cached else f'trained for {c.warmstart.steps} steps'} "
            f"({time.perf_counter() - start:.1f}s)")
    params = sharding.shard_params(params, mesh)
    ref_params = jax.tree.map(jnp.copy, params) if c.train.kl_coef > 0 else None

    optimizer = make_optimizer(c.train)
    opt_state = sharding.shard_params(optimizer.init(params), mesh)
    train_step = make_train_step(graphdef, c, optimizer, mesh)
    actor = Actor(c, task, sample_fn)
    c = calibrated(c, run_dir, lambda: measure_mu(c, actor, train_step, params, opt_state), log)
    _save_config(run_dir, c)  # with the calibrated samples_per_insert, if any

    spec = row_spec(c, task.prompt_len)
    checkpointer = Checkpointer(run_dir / "checkpoints", keep=c.checkpoint.keep)
    progress = Progress()
    pending: Optional[dict[str, np.ndarray]] = None  # generated rollouts the limiter has not admitted yet
    if checkpointer.latest_step() is not None:
        state, progress = checkpointer.restore(_state(params, opt_state, None, spec, c.rollouts_per_step))
        params, opt_state = (sharding.shard_params(state[k], mesh) for k in ("params", "opt_state"))
        pending = _unpad(state["pending"], int(state["pending_count"]))
        start -= progress.time_total_s  # the run's seconds count every invocation
        log(f"resumed from step {progress.learner_step} (policy version {progress.policy_version})")
    first_step = progress.learner_step

    accounting = Accounting(param_count(params), progress.accounting)  # counters checkpointed in progress
    server = serve(
        build_tables(c, spec), checkpoint_root=run_dir / "replay", restore_from=progress.replay_checkpoint,
        port=c.replay.port, timeout_s=c.replay.timeout_s, seed=c.run.seed,
    )
    metrics = MetricsWriter(run_dir)
    bar = None
    notice = PreemptionNotice()
    try:
        writer = writer_for(server, c, spec, interrupted=notice.is_set)
        reader = reader_for(server, c, spec, interrupted=notice.is_set)
        if progress.warmstart_accuracy is None:
            progress.warmstart_accuracy = progress.eval_accuracy = evaluate(params, task, greedy_fn)
            metrics.write(0, {"eval/accuracy": progress.warmstart_accuracy})
            log(f"eval/accuracy at start: {progress.warmstart_accuracy:.3f}")
        else:
            log(f"eval/accuracy {progress.eval_accuracy:.3f} at the latest evaluation, resuming at step "
                f"{progress.learner_step} ({progress.warmstart_accuracy:.3f} after the warm start)")

        actor_stats: dict[str, float] = {}
        last_saved = progress.learner_step
        nonfinite = NonFiniteStreak(c.train.max_nonfinite_steps)
        bar = tqdm(total=c.train.steps, initial=progress.learner_step, disable=not c.run.progress_bar,
                   desc="train", unit="step", dynamic_ncols=True)
        snapshot: Optional[Snapshot] = None  # the tables' state now; None once the loop changed them

        def take_snapshot() -> Snapshot:
            t0 = time.perf_counter()
            states = server.snapshot()
            progress.time_replay_s += time.perf_counter() - t0
            return states

        def after(states: Snapshot, move: Callable[[LimiterState], LimiterState]) -> Optional[Snapshot]:
            """`states` advanced by the loop's own move, where that is exact; else None (ask)."""
            main = states[server.table]
            return {server.table: move(main)} if len(states) == 1 and main.max_times_sampled == 0 else None

        while progress.learner_step < c.train.steps:
            if notice.is_set():  # preemption: save between turns, then stop
                if last_saved != progress.learner_step:
                    _checkpoint(checkpointer, server, _state(params, opt_state, pending, spec, c.rollouts_per_step),
                                progress, start)
                raise Preempted(f"SIGTERM: checkpoint at step {progress.learner_step} in {checkpointer.directory}; "
                                "the same command resumes")
            if snapshot is None:
                snapshot = take_snapshot()
            if pending is not None and (n := admitted_inserts(snapshot[server.table], len(pending["reward"]))) > 0:
                t0 = time.perf_counter()
                writer.insert({k: v[:n] for k, v in pending.items()})
                progress.time_replay_s += time.perf_counter() - t0
                snapshot = after(snapshot, lambda s: s.after_insert(n))
                pending = {k: v[n:] for k, v in pending.items()} if n < len(pending["reward"]) else None
            elif reader.can_sample(c.train.batch_size, snapshot):
                t0 = time.perf_counter()
                batch, info = reader.sample(c.train.batch_size, snapshot)
                snapshot = after(snapshot, lambda s: s.after_sample(c.train.batch_size)) if batch is not None else None
                if batch is None:  # replay.max_times_sampled: the batch is assembled over several turns
                    progress.time_replay_s += time.perf_counter() - t0
                    continue
                t1 = time.perf_counter()
                params, opt_state, step_metrics = train_step(params, opt_state, to_device_batch(batch), ref_params)
                step_metrics = jax.device_get(step_metrics)
                t2 = time.perf_counter()
                progress.time_replay_s += t1 - t0
                progress.time_train_s += t2 - t1
                progress.learner_step += 1
                progress.nonfinite_steps += int(step_metrics["nonfinite"])
                progress.tokens_trained += int(batch["completion_mask"].sum())
                staleness = progress.policy_version - batch["policy_version"]
                progress.policy_version += 1

                if snapshot is None:
                    snapshot = take_snapshot()  # for the record, and the next turn
                table = snapshot[server.table]
                record = {
                    **{k: float(v) for k, v in step_metrics.items()},
                    **actor_stats,
                    **accounting.on_train(batch, info.times_sampled, staleness, t2 - t1),
                    "batch/reward_mean": float(batch["reward"].mean()),
                    "replay/size": table.size,
                    "replay/inserts": table.inserts,
                    "replay/samples": table.samples,
                    "replay/ratio": table.samples / max(table.inserts, 1),
                    "replay/times_sampled_mean": float(np.mean(info.times_sampled)),
                    "staleness/mean": float(staleness.mean()),
                    "staleness/max": int(staleness.max()),
                    "policy_version": progress.policy_version,
                    "train/nonfinite_steps": progress.nonfinite_steps,
                    "tokens/generated": progress.tokens_generated,
                    "tokens/trained": progress.tokens_trained,
                    "time/generate_s": progress.time_generate_s,
                    "time/train_s": progress.time_train_s,
                    "time/replay_s": progress.time_replay_s,
                }
                step = progress.learner_step
                if step % c.train.eval_every == 0 or step == c.train.steps:
                    progress.eval_accuracy = record["eval/accuracy"] = evaluate(params, task, greedy_fn)
                metrics.write(step, record)
                nonfinite.update(bool(step_metrics["nonfinite"]), step)  # raises before this step's checkpoint
                bar.update(1)
                bar.set_postfix(acc=f"{actor_stats.get('accuracy', 0):.2f}", eval=f"{progress.eval_accuracy:.2f}",
                                ratio=f"{record['replay/ratio']:.2f}", refresh=False)
                if step % c.checkpoint.every == 0:
                    snapshot = check_only_client(snapshot, take_snapshot())  # the loop's counts vs the server's
                    _checkpoint(checkpointer, server, _state(params, opt_state, pending, spec, c.rollouts_per_step),
                                progress, start)
                    last_saved = step
            elif pending is None:
                items, stats = actor.act(params, progress.policy_version, progress.actor_step)
                progress.actor_step += 1
                progress.tokens_generated += stats["tokens"]
                progress.time_generate_s += stats["seconds"]
                accounting.on_generate(items, stats["seconds"])
                actor_stats = {k: stats[k] for k in ("reward_mean", "reward_std", "accuracy", "completion_length",
                                                     "reward/errors")}
                pending = items
            else:
                raise SchedulerStuckError("the limiter admits neither an insert nor a sample: "
                                          f"{snapshot[server.table].describe()}")
        if last_saved != progress.learner_step:
            _checkpoint(checkpointer, server, _state(params, opt_state, pending, spec, c.rollouts_per_step), progress,
                        start)
        bar.close()

        table = (snapshot if snapshot is not None else server.snapshot())[server.table]
        summary = {
            "steps": progress.learner_step,
            "seconds": round(time.perf_counter() - start, 1),
            "eval/accuracy_start": progress.warmstart_accuracy,
            "eval/accuracy_end": progress.eval_accuracy,
            "replay/ratio": table.samples / max(table.inserts, 1),
            "replay/samples_per_insert_target": 1.0 if c.replay.mode == "on_policy" else c.replay.samples_per_insert,
            "replay/inserts": table.inserts,
            "replay/samples": table.samples,
            "tokens/generated": progress.tokens_generated,
            "tokens/trained": progress.tokens_trained,
            "train/nonfinite_steps": progress.nonfinite_steps,
            "time/generate_s": round(progress.time_generate_s, 2),
            "time/train_s": round(progress.time_train_s, 2),
            "time/replay_s": round(progress.time_replay_s, 2),
            **accounting.metrics(),
        }
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        if progress.learner_step > first_step:
            log(
                f"done: {summary['steps']} steps in {summary['seconds']}s | eval/accuracy "
                f"{summary['eval/accuracy_start']:.3f} -> {summary['eval/accuracy_end']:.3f} | replay/ratio "
                f"{summary['replay/ratio']:.2f} (target {summary['replay/samples_per_insert_target']:g}) | "
                f"generate {summary['time/generate_s']}s, train {summary['time/train_s']}s, "
                f"replay {summary['time/replay_s']}s | {run_dir}"
            )
        return summary
    except ReplayInterrupted as e:  # SIGTERM within a replay call: the table may hold part of `pending`
        raise Preempted(f"SIGTERM while {e}; stopped without a checkpoint, the same command resumes from step "
                        f"{checkpointer.latest_step() or 0}") from None
    finally:
        notice.close()
        if bar is not None:
            bar.close()
        metrics.close()
        server.stop()
        checkpointer.close()


def _state(params, opt_state, pending, spec, rows: int) -> dict[str, Any]:
    """The checkpointed arrays. Rollouts still waiting for the table are saved too, padded
    to a fixed `rows` so the tree has static shapes: a resume loses no generated data."""
    count = 0 if pending is None else len(pending["reward"])
    padded = {}
    for name, (shape, dtype) in spec.items():
        padded[name] = np.zeros((rows, *shape), dtype)
        if count:
            padded[name][:count] = pending[name]
    return {"params": params, "opt_state": opt_state, "pending": padded, "pending_count": np.array(count, np.int32)}


def _unpad(padded: dict[str, Any], count: int) -> Optional[dict[str, np.ndarray]]:
    return {k: np.asarray(v)[:count] for k, v in padded.items()} if count else None


def _checkpoint(checkpointer: Checkpointer, server: ReplayServer, state: dict[str, Any], progress: Progress,
                start: float) -> None:
    """Reverb first, then Orbax naming it: a crash in between leaves the older pair intact.
    `start`: when the run began (perf_counter, earlier invocations included)."""
    t0 = time.perf_counter()
    progress.time_total_s = t0 - start
    progress.replay_checkpoint = server.checkpoint()
    progress.time_replay_s += time.perf_counter() - t0
    checkpointer.save(progress.learner_step, state, progress)
    server.prune_checkpoints(keep=checkpointer.replay_checkpoints())
