"""The one training driver: every placement (placement.py) is set up, resumed and recorded here.

    config -> placement -> stack (policy, optimizer, train step, samplers, actor)
           -> run state (fresh, or restored from the latest checkpoint) + tables
           -> schedule: turns (colocated, multi-host) or concurrent roles (disaggregated)
           -> final checkpoint, summary

A resume is refused before anything is written when the config changed a key that
changes the run (recorder.py); metrics past the restored step are dropped, so every
step is recorded once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
import time
import traceback
from typing import Any, Callable, Iterator, Optional

from jaxreplay import error_line, storage
from jaxreplay.compat import multiprocess_checkpoint_gap
from jaxreplay.config import Config, ConfigError
from jaxreplay.replay import inprocess
from jaxreplay.replay.multiprocess import open_replay
from jaxreplay.replay.ports import check_port
from jaxreplay.replay.reader import reader_for
from jaxreplay.replay.server import serve
from jaxreplay.replay.tables import build_tables, resolve_backend
from jaxreplay.replay.writer import writer_for
from jaxreplay.rollout import rollouts
from jaxreplay.train import distributed, rundir
from jaxreplay.train.accounting import Accounting, param_count
from jaxreplay.train.calibrate import calibrated, measure_mu
from jaxreplay.train.checkpoint import CheckpointError, Checkpointer, Progress
from jaxreplay.train.guards import Preempted, PreemptionNotice
from jaxreplay.train.placement import Placement, params_digest, placement_for
from jaxreplay.train.recorder import CONFIG_FILE, RunRecorder, last_summary, resume_config, run_settings
from jaxreplay.train.roles import run_concurrent
from jaxreplay.train.run import Run, above_bars, table_counters
from jaxreplay.train.stack import build_stack, resolved_model
from jaxreplay.train.turns import GlobalTables, LocalTables, run_turns


def train(config: Config, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Runs (or resumes) the run `config` describes, in its placement; returns the summary.

    Multi-host (`distributed` set), this joins the job first and owns the process (see
    `_as_job_process`); every process calls it alike.
    """
    if config.distributed.enabled:
        return _as_job_process(config, log)
    with rundir.claim(config.run.dir, config.run.lease_s) as run_dir:
        return _train(config, run_dir, log)


def _as_job_process(config: Config, log: Callable[[str], None]) -> dict[str, Any]:
    """As `jax.distributed.initialize` does, this owns the process: on any error it writes the
    traceback to `run.dir/process-<id>.error`, prints one line and exits at once. A normal
    exit would wait in JAX's shutdown barrier for peers that are themselves waiting on this
    process; exiting drops its connections, so they fail in seconds."""
    distributed.initialize(config.distributed)
    import jax

    pid = jax.process_index()
    try:
        # One job, one lock: process 0 holds run.dir's; the others share the directory.
        with rundir.claim(config.run.dir, config.run.lease_s) if pid == 0 else rundir.attach(config.run.dir) \
                as run_dir:
            return _train(config, run_dir, log if pid == 0 else (lambda _: None))
    except BaseException as e:
        if not isinstance(e, Preempted):
            with contextlib.suppress(Exception):  # run.dir itself may be what is wrong
                storage.makedirs(config.run.dir)
                storage.write_text(storage.join(config.run.dir, f"process-{pid}.error"), traceback.format_exc())
        own = type(e).__module__.split(".")[0] == "jaxreplay"  # its message is written to be read alone
        kind = getattr(e, "kind", "error") if own and isinstance(e, (ConfigError, Preempted)) else "error"
        first = str(e).splitlines()[0] if str(e) else ""
        sys.stdout.flush()
        print(error_line(kind, f"process {pid}: {first if own and first else f'{type(e).__name__}: {first}'}"),
              file=sys.stderr, flush=True)
        os._exit(2 if isinstance(e, ConfigError) else e.exit_code if isinstance(e, Preempted) else 1)


def _train(config: Config, run_dir: rundir.RunDir, log: Callable[[str], None]) -> dict[str, Any]:
    start = time.perf_counter()
    log = above_bars(log)
    placement = placement_for(config)
    coord = distributed.Coordinator(config.distributed.timeout_s) if placement.kind == "multihost" else None
    if coord is not None:  # before any wait on run.dir: a pod whose workers each have their own disk ends here
        # process 0 may still be waiting out an earlier run's lease (at most run.lease_s)
        rundir.check_shared(run_dir, distributed.Coordinator(rundir.SHARED_CHECK_S + config.run.lease_s))
    resume = _agreed_latest_step(run_dir, config, coord, log)
    if resume is not None and resume >= config.train.steps:
        log(f"nothing to run: no step ran, because the checkpoint in {run_dir.checkpoints()} is already at "
            f"step {resume} >= train.steps={config.train.steps}; raise train.steps to train further")
        return {**last_summary(run_dir), "steps": resume, "steps_run": 0}
    c = resolved_model(_with_backend(config, placement, log))
    if resume is None and (run_dir / "config.yaml").exists():
        log(f"no checkpoint to resume in {run_dir}: starting from step 0")
    trained_with = _trained_with(run_dir, config, resume, coord, log)
    # Refused before anything is written when the config changes the run; only the leader records.
    recorder = RunRecorder.open(run_dir, c, resume, log, trained_with) if placement.is_leader else None
    c = recorder.config if recorder else resume_config(run_dir, c, log, trained_with) if resume is not None else c
    run_dir.sync()
    try:
        log(placement.describe())
        stack = build_stack(c, placement, log)
        run = _run_state(stack, placement, recorder, run_dir, resume, start, log)
        if placement.kind == "multihost":  # every process checks it trained the same params
            run.digest_start = params_digest(run.params)
            if why := multiprocess_checkpoint_gap():
                log(f"checkpoints off: {why}")
                run.checkpoints = False
        try:
            run.config = c = stack.config = _calibrated(run, run_dir, coord, log)
            run.checkpointer.settings = run_settings(c)  # the calibrated ratio is what the steps train with
            if recorder:
                recorder.update_config(c)
                run_dir.sync()
            with _tables(run, placement, run_dir, coord) as schedule:
                schedule()  # a stop signal within a replay call ends it as Run.interrupted_wait says
            return _summary(run, recorder, run_dir, log)
        finally:
            run.close()
    finally:
        if recorder:
            recorder.close()


def _with_backend(config: Config, placement: Placement, log: Callable[[str], None]) -> Config:
    """`config` with the replay backend `auto` resolved, said and checked before any work."""
    backend = resolve_backend(config.replay.backend)
    log(f"replay backend: {backend}" + (" (replay.backend=auto)" if config.replay.backend == "auto" else ""))
    if backend == "reverb" and placement.kind != "multihost":
        check_port(config.replay.port)
    return dataclasses.replace(config, replay=dataclasses.replace(config.replay, backend=backend))


def _agreed_latest_step(run_dir: rundir.RunDir, config: Config, coord: Optional[distributed.Coordinator],
                        log: Callable[[str], None]) -> Optional[int]:
    """The step to resume from. Multi-host, every process lists the steps it can read (Orbax's
    manager is collective there, so all open it), process 0 chooses, and all check that they can
    read its choice, so no process resumes from another step (their collectives would not match)."""
    if coord is None:
        return latest_step(run_dir, config.checkpoint.keep, log, resolve_backend(config.replay.backend))
    checkpointer = Checkpointer(run_dir.checkpoints(), keep=config.checkpoint.keep, timeout_s=coord.timeout_s)
    try:
        steps = checkpointer.all_steps()
    finally:
        checkpointer.close()
    chosen = json.loads(coord.broadcast("resume/step", json.dumps(max(steps, default=None))
                                        if coord.is_leader else None))
    readable = chosen is None or chosen in steps
    blind = [i for i, seen in enumerate(coord.gather("resume/readable", "1" if readable else "0")) if seen == "0"]
    if blind:
        raise CheckpointError(f"process 0 resumes from checkpoint step {chosen} in {run_dir.url}, which processes "
                              f"{blind} cannot read: every process must see the same run.dir (a bucket or a shared "
                              "mount)")
    return chosen


def _trained_with(run_dir: rundir.RunDir, config: Config, step: Optional[int],
                  coord: Optional[distributed.Coordinator], log: Callable[[str], None]) -> Optional[dict]:
    """The run-changing settings checkpoint step `step` recorded, which the resume is checked
    against; None (said once) for a step written before checkpoints recorded them."""
    if step is None:
        return None
    checkpointer = Checkpointer(run_dir.checkpoints(), keep=config.checkpoint.keep,
                                timeout_s=coord.timeout_s if coord is not None else None)
    try:
        settings = checkpointer.trained_with(step)
    finally:
        checkpointer.close()
    if settings is None:
        log(f"warning: checkpoint step {step} in {run_dir.checkpoints()} records no settings (written before "
            f"checkpoints recorded them): the resume is checked against {CONFIG_FILE} alone")
    return settings


def latest_step(run_dir: rundir.RunDir, keep: int, log: Callable[[str], None] = lambda _: None,
                backend: Optional[str] = None) -> Optional[int]:
    """The step of the latest complete checkpoint in `run_dir`, if any. With the in-process
    replay backend on a local run dir, a step whose replay checkpoint is damaged (a file cut
    short or changed since it was written: its sha256) is named in one line and moved to
    `damaged/`, and the step before it is taken; none left: `CheckpointError`."""
    if not run_dir.has_checkpoints():
        return None
    checkpointer = Checkpointer(run_dir.checkpoints(), keep=keep)
    try:
        steps = sorted(checkpointer.all_steps(), reverse=True)
        if not steps or backend != "inprocess" or run_dir.remote:  # a bucket's replay files: checked on restore
            return steps[0] if steps else None
        damaged = []
        for i, step in enumerate(steps):
            why = _damage(run_dir, checkpointer, step)
            if why is None:
                return step
            damaged.append(f"checkpoint step {step}: {why}")
            aside = run_dir / DAMAGED_DIR / f"step-{step}"
            aside.parent.mkdir(exist_ok=True)
            os.replace(run_dir.local / rundir.CHECKPOINT_DIR / str(step), aside)
            log(f"checkpoint step {step} is damaged, moved to {aside}: {why}; "
                + (f"resuming from step {steps[i + 1]}" if i + 1 < len(steps) else "no complete step is left"))
        raise CheckpointError(f"no undamaged checkpoint left in {run_dir.checkpoints()} ({'; '.join(damaged)}; "
                              f"moved to {run_dir / DAMAGED_DIR}): start afresh in a new run.dir")
    finally:
        checkpointer.close()


DAMAGED_DIR = "damaged"  # in the run dir: checkpoint steps passed over as damaged, kept for a look


def _damage(run_dir: rundir.RunDir, checkpointer: Checkpointer, step: int) -> Optional[str]:
    """What is damaged in step `step` (its meta, or its in-process replay checkpoint), or None."""
    try:
        name = checkpointer.meta(step).get("replay_checkpoint")
        if name:
            inprocess.verify(run_dir / rundir.REPLAY_DIR / name)
    except (CheckpointError, inprocess.DamagedCheckpoint) as e:
        return str(e)
    return None


def _run_state(stack, placement: Placement, recorder: Optional[RunRecorder], run_dir: rundir.RunDir,
               resume: Optional[int], start: float, log: Callable[[str], None]) -> Run:
    """The run as the latest checkpoint left it (onto this placement's meshes), or fresh."""
    c = stack.config
    checkpointer = Checkpointer(run_dir.checkpoints(), keep=c.checkpoint.keep,
                                timeout_s=c.distributed.timeout_s if placement.kind == "multihost" else None,
                                settings=run_settings(c))
    progress = Progress()  # its accounting dict is the one the checkpoints save
    run = Run(config=c, placement=placement, stack=stack, recorder=recorder, checkpointer=checkpointer,
              progress=progress, params=stack.params, opt_state=stack.opt_state,
              accounting=Accounting(param_count(stack.params), progress.accounting), start=start,
              notice=PreemptionNotice(), log=log, run_dir=run_dir,
              actor_params=stack.to_actor(stack.params) if placement.concurrent else None)
    if resume is None:
        run.progress.warmstart_accuracy = run.progress.eval_accuracy = run.evaluate()
        if recorder:
            recorder.write(0, {"eval/accuracy": run.progress.warmstart_accuracy})
        log(f"eval/accuracy at start: {run.progress.warmstart_accuracy:.3f}")
        return run
    state, progress = checkpointer.restore(run.state_tree())  # onto this run's shardings: a new mesh reshards
    run.params, run.opt_state = state["params"], state["opt_state"]
    run.pending = rollouts.unpadded(placement.local_rows(state["pending"]))
    run.actor_params, run.actor_version = state.get("actor_params"), progress.actor_version
    run.progress, run.accounting = progress, Accounting(param_count(run.params), progress.accounting)
    run.tokens_at_step = progress.tokens_generated
    run.start = start - progress.time_total_s  # the run's seconds count every invocation
    run.last_saved = (progress.learner_step, time.perf_counter())
    log(f"resumed from step {progress.learner_step} (policy version {progress.policy_version})")
    log(f"eval/accuracy {progress.eval_accuracy:.3f} at the latest evaluation, resuming at step {progress.learner_step} "
        f"({progress.warmstart_accuracy:.3f} after the warm start)")
    return run


def _calibrated(run: Run, run_dir: rundir.RunDir, coord: Optional[distributed.Coordinator],
                log: Callable[[str], None]) -> Config:
    """The config with the measured replay ratio (replay.calibrate_steps), before any table exists.
    Multi-host, every process measures (the calls are collective) and all take the leader's figures."""
    actor_params = run.actor_params if run.actor_params is not None else run.params

    def measure() -> dict[str, float]:
        record = measure_mu(run.config, lambda i: run.stack.actor.act(actor_params, 0, i), run.stack.train_step,
                            run.params, run.opt_state, run.placement.learner_batch, run.placement.processes)
        if coord is None:
            return record
        return json.loads(coord.broadcast("calibration", json.dumps(record) if coord.is_leader else None))

    return calibrated(run.config, run_dir, measure, log, write=run.placement.is_leader)


@contextlib.contextmanager
def _tables(run: Run, placement: Placement, run_dir: rundir.RunDir,
            coord: Optional[distributed.Coordinator]) -> Iterator[Callable[[], None]]:
    """The placement's tables, restored from the checkpoint's, and the schedule that runs on them."""
    c, spec, progress = run.config, run.stack.spec, run.progress
    root = run_dir / rundir.REPLAY_DIR
    run_dir.pull_replay(run.own_replay_checkpoint(progress.replay_checkpoint))
    if coord is not None:
        names = json.loads(progress.replay_checkpoint) if progress.replay_checkpoint else None
        replay = open_replay(c, spec, coord, checkpoint_root=root,
                             restore_from=names[placement.process_id] if names else None)
        try:
            run.coordinator = coord  # the streaming actor gathers each chunk's statistics through it
            tables = GlobalTables(replay, coord, run)
            _check_restored(run, lambda: tables.state(0))
            yield lambda: run_turns(run, tables)
            coord.barrier("finished")  # no process touches the table again: process 0 may stop its server
        finally:
            replay.stop()
        return
    server = serve(build_tables(c, spec), checkpoint_root=root, restore_from=progress.replay_checkpoint,
                   port=c.replay.port, timeout_s=c.replay.timeout_s, seed=c.run.seed)
    try:
        _check_restored(run, lambda: server.states()[server.table])
        interrupted = run.notice.is_set
        writer = writer_for(server, c, spec, interrupted=interrupted)
        reader = reader_for(server, c, interrupted=interrupted)
        if placement.concurrent:
            yield lambda: run_concurrent(run, server, reader, writer)
        else:
            yield lambda: run_turns(run, LocalTables(server, reader, writer, run))
    finally:
        server.stop()


def _check_restored(run: Run, table: Callable[[], Any]) -> None:
    """A resumed table must hold what the checkpoint saw: else the buffer is not the one it named."""
    saved = run.progress.replay_counters
    if not saved:
        return
    restored = table_counters(table())
    if restored != saved:
        raise CheckpointError(f"the replay checkpoint {run.progress.replay_checkpoint} restored a table with {restored}, "
                              f"but step {run.progress.learner_step} was saved with {saved}")
    run.log(f"table restored as checkpointed ({', '.join(f'{k}={v}' for k, v in saved.items())})")


def _summary(run: Run, recorder: RunRecorder, run_dir: rundir.RunDir, log: Callable[[str], None]) -> dict[str, Any]:
    c, p, placement = run.config, run.progress, run.placement
    summary = {
        "placement": placement.kind,
        "replay/backend": c.replay.backend,
        "steps": p.learner_step,
        "stopped_by": "train.steps" if p.learner_step >= c.train.steps else "train.max_generated_tokens",
        "seconds": round(time.perf_counter() - run.start, 1),
        "eval/accuracy_start": p.warmstart_accuracy,
        "eval/accuracy_end": p.eval_accuracy,
        **run.final_table,
        "replay/samples_per_insert_target": 1.0 if c.replay.mode == "on_policy" else c.replay.samples_per_insert,
        "actor/steps": p.actor_step,
        "rows_inserted": p.rows_inserted,
        "rows_sampled": p.rows_sampled,
        "tokens/generated": p.tokens_generated,
        "tokens/trained": p.tokens_trained,
        "train/nonfinite_steps": p.nonfinite_steps,
        "time/generate_s": round(p.time_generate_s, 2),
        "time/train_s": round(p.time_train_s, 2),
        "time/replay_s": round(p.time_replay_s, 2),
        **run.accounting.metrics(),
    }
    if placement.kind == "multihost":  # each process's own account, beside the job's summary
        summary.update({"num_processes": placement.processes, "params_sha256_start": run.digest_start,
                        "params_sha256": params_digest(run.params)})
        (run_dir / f"process-{placement.process_id}.json").write_text(
            json.dumps({**summary, "process_id": placement.process_id}, indent=2) + "\n")
    if recorder:
        recorder.summary(summary)
    run_dir.sync()
    run.close_bar()  # its last redraw, then the summary on a line of its own
    log(f"done: {summary['steps']} steps in {summary['seconds']}s | eval/accuracy "
        f"{summary['eval/accuracy_start']:.3f} -> {summary['eval/accuracy_end']:.3f} | replay/ratio "
        f"{summary['replay/ratio']:.2f} (target {summary['replay/samples_per_insert_target']:g}) | "
        f"generate {summary['time/generate_s']}s, train {summary['time/train_s']}s, "
        f"replay {summary['time/replay_s']}s | {run_dir}")
    return summary
