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

from jaxreplay import error_line, storage, warn
from jaxreplay.compat import multiprocess_checkpoint_gap
from jaxreplay.config import Config, ConfigError
from jaxreplay.replay.backend import DamagedCheckpoint
from jaxreplay.replay.multiprocess import open_replay, own_checkpoint_path
from jaxreplay.replay.ports import check_port
from jaxreplay.replay.reader import reader_for
from jaxreplay.replay.server import describe_reverb, serve, verify_checkpoint
from jaxreplay.replay.tables import build_tables, resolve_backend
from jaxreplay.replay.writer import writer_for
from jaxreplay.rollout import rollouts
from jaxreplay.rollout.episodes import EPISODE_ERRORS
from jaxreplay.train import distributed, rundir
from jaxreplay.train.accounting import Accounting, param_count
from jaxreplay.train.calibrate import calibrated, measure_mu
from jaxreplay.train.checkpoint import (
    CheckpointError, Checkpointer, DamagedStep, Progress, base_digest, progress_of, restored_params, write_failure,
    write_failure_message)
from jaxreplay.train.eval import TEST_KEY, TURNS_KEY
from jaxreplay.train.guards import Preempted, PreemptionNotice
from jaxreplay.train.placement import Placement, params_digest, placement_for
from jaxreplay.train.recorder import CONFIG_FILE, RunRecorder, last_summary, resume_config, run_settings
from jaxreplay.train.roles import run_concurrent
from jaxreplay.train.run import Run, above_bars, table_counters
from jaxreplay.train.stack import build_stack, resolved_model
from jaxreplay.train.turns import GlobalTables, JobWriteFailure, LocalTables, run_turns


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
        kind, why, code = _job_error(e, config, pid)
        sys.stdout.flush()
        print(error_line(kind, f"process {pid}: {why}"), file=sys.stderr, flush=True)
        if isinstance(e, JobWriteFailure):  # every process ends now: process 0, which hosts the coordination
            _leave_last(pid)                # service, last, or a peer that outlives it is aborted (SIGABRT)
        os._exit(code)


def _leave_last(pid: int) -> None:
    """Process 0 waits until every process has said its line and is exiting."""
    with contextlib.suppress(Exception):
        coord = distributed.Coordinator(10.0)
        coord.barrier("exit/write-failure")
        if pid == 0:
            time.sleep(1.0)  # the others exit at the barrier; give their os._exit its moment


def _job_error(e: BaseException, config: Config, pid: int) -> tuple[str, str, int]:
    """(kind, why, exit status) of what ended a job process: `jaxreplay: <kind>: process N: <why>`.
    A write failure (disk full, read-only, quota) is published through the coordination service
    before the process exits, so a peer that fails because this process left says what did."""
    if isinstance(e, Preempted):
        return e.kind, one_line(str(e)), e.exit_code
    if isinstance(e, ConfigError):
        return getattr(e, "kind", "config error"), one_line(str(e)), 2
    if failure := write_failure(e):
        why = write_failure_message(failure, config.run.dir)
        with contextlib.suppress(Exception):
            distributed.publish_failure(pid, why)
        return "error", why, 2
    # this process failed because a peer left: say why the peer did
    if isinstance(e, Exception) and (peer := distributed.failure_of_a_peer(pid)):
        return "error", peer, 2
    own = type(e).__module__.split(".")[0] == "jaxreplay"  # its message is written to be read alone
    why = one_line(str(e)) if own and str(e) else f"{type(e).__name__}: {one_line(str(e))}"
    bad_input = isinstance(e, (CheckpointError, DamagedCheckpoint))  # exit 2, as the CLI's
    return "error", why, 2 if bad_input else 1


def one_line(text: str) -> str:
    return text.splitlines()[0] if text else ""


def _train(config: Config, run_dir: rundir.RunDir, log: Callable[[str], None]) -> dict[str, Any]:
    start = time.perf_counter()
    log = above_bars(log)
    placement = placement_for(config)
    coord = distributed.Coordinator(config.distributed.timeout_s) if placement.kind == "multihost" else None
    if coord is not None:  # before any wait on run.dir: a pod whose workers each have their own disk ends here
        # process 0 may still be waiting out an earlier run's lease (at most run.lease_s)
        rundir.check_shared(run_dir, distributed.Coordinator(rundir.SHARED_CHECK_S + config.run.lease_s))
    damaged: list[str] = []  # steps passed over as damaged, for the line that says none is left
    resume = _undamaged_step(run_dir, config, coord, log, damaged)
    if resume is not None and resume >= config.train.steps:
        log(f"nothing to run: no step ran, because the checkpoint in {run_dir.checkpoints()} is already at "
            f"step {resume} >= train.steps={config.train.steps}; raise train.steps to train further")
        return {**last_summary(run_dir), "steps": resume, "steps_run": 0}
    c = resolved_model(_with_backend(config, placement, log))
    if resume is None and (run_dir / "config.yaml").exists():
        log(f"no checkpoint to resume in {run_dir}: starting from step 0")
    trained_with = _trained_with(run_dir, config, resume, coord, log)
    # Refused before anything is built or written when the config changes the run; the recorder says
    # what changed as it opens, after the restore (a damaged step found there changes the step).
    checked = resume_config(run_dir, c, lambda _: None, trained_with, lambda _: None) if resume is not None else c
    recorder = None
    try:
        log(placement.describe())
        stack = build_stack(checked, placement, log)
        run = _run_state(stack, placement, run_dir, start, log)
        try:
            if resume is not None:
                step = _restore(run, run_dir, resume, coord, log, damaged)
                if step != resume:
                    resume, trained_with = step, _trained_with(run_dir, config, step, coord, log)
            # Only the leader records; metrics past the restored step are dropped.
            recorder = RunRecorder.open(run_dir, c, resume, log, trained_with) if placement.is_leader else None
            c = recorder.config if recorder else checked
            run.recorder = recorder
            run_dir.sync()
            if resume is None:
                _evaluate_at_start(run, log)
            if placement.kind == "multihost":  # every process checks it trained the same params
                run.digest_start = params_digest(run.params)
                if why := multiprocess_checkpoint_gap():
                    log(f"checkpoints off: {why}")
                    run.checkpoints = False
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
    if backend == "reverb":
        log(describe_reverb(config.replay.reverb_python))
    if backend == "reverb" and placement.kind != "multihost":
        check_port(config.replay.port)
    return dataclasses.replace(config, replay=dataclasses.replace(config.replay, backend=backend))


def _listed_steps(run_dir: rundir.RunDir, config: Config, coord: Optional[distributed.Coordinator],
                  attempt: int = 0) -> list[int]:
    """The complete checkpoint steps, latest first. Multi-host, every process lists the steps it can
    read (Orbax's manager is collective there, so all open it), process 0's list is taken, and all
    check that they can read its latest, so no process resumes from another step (their
    collectives would not match)."""
    if coord is None and not run_dir.has_checkpoints():
        return []
    checkpointer = Checkpointer(run_dir.checkpoints(), keep=config.checkpoint.keep,
                                timeout_s=coord.timeout_s if coord is not None else None)
    try:
        steps = sorted(checkpointer.all_steps(), reverse=True)
    finally:
        checkpointer.close()
    if coord is None:
        return steps
    # `attempt` (how many steps were set aside before: alike on every process) makes each key used once
    listed = json.loads(coord.broadcast(f"resume/steps/{attempt}", json.dumps(steps) if coord.is_leader else None))
    chosen = listed[0] if listed else None
    readable = chosen is None or chosen in steps
    blind = [i for i, seen in enumerate(coord.gather(f"resume/readable/{attempt}", "1" if readable else "0"))
             if seen == "0"]
    if blind:
        raise CheckpointError(f"process 0 resumes from checkpoint step {chosen} in {run_dir.url}, which processes "
                              f"{blind} cannot read: every process must see the same run.dir (a bucket or a shared "
                              "mount)")
    return listed


def _undamaged_step(run_dir: rundir.RunDir, config: Config, coord: Optional[distributed.Coordinator],
                    log: Callable[[str], None], damaged: list[str]) -> Optional[int]:
    """The step to resume from: the latest complete one whose meta reads and whose replay
    checkpoint (multi-host, each process its own shard's, or Reverb's one table's; a bucket run
    dir's fetched first) matches the hashes written with it. A damaged step is named in one
    line, set aside in `damaged/`, and the step before it taken; multi-host, a step damaged on
    any process is damaged on all. Steps were damaged and none is left: `CheckpointError`."""
    backend = resolve_backend(config.replay.backend)
    while True:
        steps = _listed_steps(run_dir, config, coord, attempt=len(damaged))
        if not steps:
            if damaged:
                raise _none_left(run_dir, damaged)
            return None
        if any(line.startswith(f"checkpoint step {steps[0]}: ") for line in damaged):  # never loop on a step
            raise CheckpointError(f"checkpoint step {steps[0]} in {run_dir.checkpoints()} is still listed after it "
                                  f"was moved to {_aside(run_dir)} as damaged ({damaged[-1]})")
        why = _agreed(coord, f"resume/damage/{steps[0]}", _damage(run_dir, config, steps[0], backend, coord))
        if why is None:
            return steps[0]
        _set_aside(run_dir, steps[0], why, steps[1:], coord, log, damaged)


def _none_left(run_dir: rundir.RunDir, damaged: list[str]) -> CheckpointError:
    return CheckpointError(f"no undamaged checkpoint left in {run_dir.checkpoints()} ({'; '.join(damaged)}; "
                           f"moved to {_aside(run_dir)}): start afresh in a new run.dir")


def _agreed(coord: Optional[distributed.Coordinator], key: str, why: Optional[str]) -> Optional[str]:
    """Multi-host: the first process's finding, on every process (a step damaged on any process is
    damaged for all)."""
    if coord is None:
        return why
    for i, found in enumerate(coord.gather(key, why or "")):
        if found:
            return f"on process {i}: {found}"
    return None


DAMAGED_DIR = "damaged"  # in the run dir: checkpoint steps passed over as damaged, kept for a look


def _aside(run_dir: rundir.RunDir, step: Optional[int] = None) -> str:
    """damaged/, or where in it step `step` goes (a name not taken yet: a step may be damaged twice)."""
    where = storage.join(run_dir.url, DAMAGED_DIR)
    if step is None:
        return where
    name, n = storage.join(where, f"step-{step}"), 0
    while storage.exists(name if n == 0 else f"{name}.{n}"):
        n += 1
    return name if n == 0 else f"{name}.{n}"


def _set_aside(run_dir: rundir.RunDir, step: int, why: str, before: list[int],
               coord: Optional[distributed.Coordinator], log: Callable[[str], None], damaged: list[str]) -> None:
    """Moves damaged step `step` out of checkpoints/ (process 0 does, multi-host) into damaged/,
    kept for a look, and says so in one line; `before`: the steps listed before it, latest first."""
    aside = _aside(run_dir, step)
    if coord is None or coord.is_leader:
        storage.move(storage.join(run_dir.url, rundir.CHECKPOINT_DIR, str(step)), aside)
    if coord is not None:
        coord.barrier(f"resume/aside/{step}")
    damaged.append(f"checkpoint step {step}: {why}")
    log(f"checkpoint step {step} is damaged, moved to {aside}: {why}; "
        + (f"resuming from step {before[0]}" if before else "no complete step is left"))


def _damage(run_dir: rundir.RunDir, config: Config, step: int, backend: str,
            coord: Optional[distributed.Coordinator]) -> Optional[str]:
    """What is damaged in step `step` (its meta, or this process's replay checkpoint), or None."""
    checkpointer = Checkpointer(run_dir.checkpoints(), keep=config.checkpoint.keep,
                                timeout_s=coord.timeout_s if coord is not None else None)
    try:
        names = checkpointer.meta(step).get("replay_checkpoint")
        own = own_checkpoint_path(backend, names, coord.process_id if coord is not None else None)
        if own:
            run_dir.pull_replay(own)  # a bucket run dir's, into the mirror the restore reads it from
            verify_checkpoint(backend, os.fspath(run_dir / rundir.REPLAY_DIR / own))
    except (CheckpointError, DamagedCheckpoint) as e:
        return str(e).replace(os.fspath(run_dir.local), run_dir.url) if run_dir.remote else str(e)  # not the mirror
    finally:
        checkpointer.close()
    return None


def _restore(run: Run, run_dir: rundir.RunDir, step: int, coord: Optional[distributed.Coordinator],
             log: Callable[[str], None], damaged: list[str]) -> int:
    """Restores the run from checkpoint `step` onto its shardings (a new mesh reshards), checked
    against the checksums saved with it before anything trains on it. A damaged step is set
    aside and the step before it taken; multi-host, every process reads its own shards, and all
    agree whether any was damaged before the (collective) check. Returns the step restored."""
    checkpointer = run.checkpointer
    while True:
        why, state, meta = None, None, None
        try:
            state, meta, _ = checkpointer.read(run.state_tree(), step)
        except DamagedStep as e:
            why = str(e)
        why = _agreed(coord, f"resume/read/{step}", why)
        if why is None:
            try:
                checkpointer.check(state, meta, step)
            except DamagedStep as e:
                why = str(e)
            why = _agreed(coord, f"resume/sums/{step}", why)
        if why is None:
            break
        state = meta = None
        _set_aside(run_dir, step, why, sorted((s for s in checkpointer.all_steps() if s < step), reverse=True),
                   coord, log, damaged)
        checkpointer.reload()
        step = _undamaged_step(run_dir, run.config, coord, log, damaged)
        if step is None:
            raise _none_left(run_dir, damaged)
    progress = progress_of(meta)
    where = storage.join(str(checkpointer.directory), str(step))
    fresh = lambda params, saved: restored_params(params, saved, progress.base_digest, run.progress.base_digest, where)
    run.params, run.opt_state = fresh(run.params, state["params"]), state["opt_state"]
    run.pending = rollouts.unpadded(run.placement.local_rows(state["pending"]))
    run.actor_params = None if run.actor_params is None else fresh(run.actor_params, state["actor_params"])
    run.actor_version = progress.actor_version
    run.progress, run.accounting = progress, accounting(run.config, run.params, progress)
    run.tokens_at_step = progress.tokens_generated
    run.start -= progress.time_total_s  # the run's seconds count every invocation
    run.last_saved = (progress.learner_step, time.perf_counter())
    log(f"resumed from step {progress.learner_step} (policy version {progress.policy_version})")
    log(f"eval/accuracy {progress.eval_accuracy:.3f} at the latest evaluation, resuming at step {progress.learner_step} "
        f"({progress.warmstart_accuracy:.3f} after the warm start)")
    return step


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
        warn(f"checkpoint step {step} in {run_dir.checkpoints()} records no settings (written before "
            f"checkpoints recorded them): the resume is checked against {CONFIG_FILE} alone")
    return settings



def accounting(c: Config, params: Any, progress: Progress) -> Accounting:
    """The run's counters, kept in `progress.accounting` (so every checkpoint carries them);
    multi-turn runs total their episode errors too."""
    return Accounting(param_count(params), progress.accounting,
                      episode_errors=EPISODE_ERRORS if c.environment.name else ())


def _run_state(stack, placement: Placement, run_dir: rundir.RunDir, start: float,
               log: Callable[[str], None]) -> Run:
    """The run, fresh; `_restore` restores a checkpoint into it, `_evaluate_at_start` starts a fresh one."""
    c = stack.config
    checkpointer = Checkpointer(run_dir.checkpoints(), keep=c.checkpoint.keep,
                                timeout_s=c.distributed.timeout_s if placement.kind == "multihost" else None,
                                settings=run_settings(c))
    progress = Progress(base_digest=base_digest(stack.params))  # its accounting dict is the one the checkpoints save
    return Run(config=c, placement=placement, stack=stack, recorder=None, checkpointer=checkpointer,
               progress=progress, params=stack.params, opt_state=stack.opt_state,
               accounting=accounting(c, stack.params, progress), start=start,
               notice=PreemptionNotice(), log=log, run_dir=run_dir,
               actor_params=stack.to_actor(stack.params) if placement.concurrent else None)


def _evaluate_at_start(run: Run, log: Callable[[str], None]) -> None:
    scores = run.eval_scores = run.evaluate()
    run.progress.warmstart_accuracy = run.progress.eval_accuracy = scores[TEST_KEY]
    if run.recorder:
        run.recorder.write(0, scores)
    log(f"eval/accuracy at start: {run.progress.warmstart_accuracy:.3f}")


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
                   port=c.replay.port, timeout_s=c.replay.timeout_s, seed=c.run.seed,
                   reverb_python=c.replay.reverb_python)
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
    if "episode/turns" in run.actor_stats:  # multi-turn: the latest actor batch's mean turns (a few episodes)
        summary["episode/turns"] = run.actor_stats["episode/turns"]
    if TURNS_KEY in run.eval_scores:  # and the latest evaluation's, over the whole test split: the done line's
        summary[TURNS_KEY] = run.eval_scores[TURNS_KEY]
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
        f"replay {summary['time/replay_s']}s | "
        + (f"turns/episode {summary[TURNS_KEY]:.2f} | " if TURNS_KEY in summary else "")
        + (f"env errors {errors} | " if (errors := _error_totals(summary)) else "") + f"{run_dir}")
    return summary


def _error_totals(summary: dict[str, Any]) -> str:
    """The run's environment-error totals that are not 0, as the done line names them."""
    prefix = "env/errors_total/"
    return ", ".join(f"{key.removeprefix(prefix)} {n}" for key, n in summary.items() if key.startswith(prefix) and n)
