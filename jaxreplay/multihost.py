"""Multi-host SPMD training: every process runs this same loop over one global mesh.

Replay is one table seen through a global limiter view (replay/multiprocess.py): by
default each process keeps its own shard of it, in process, and the view sums every
shard's counters; with replay.backend=reverb, process 0 serves the one Reverb table.
Each turn every process reads the view, which goes through JAX's coordination service
and is identical everywhere, and takes the same move by the colocated scheduler's rule
(loop.py); the moves are SPMD:
  act:    every process generates rollouts for its own slice of the prompt batch (the
          sampler runs once, on the global batch) and keeps its own rows;
  insert: every process inserts k of its rows, P * k admitted by the limiter in total;
  learn:  every process samples B / P rows, `jax.make_array_from_process_local_data`
          assembles the global batch, and all take the same learner step.
Reading the view waits for every process, so the counters include every process's
calls. All waits on other processes have timeouts.

Not yet here: checkpoints and resume (a multi-host run starts fresh), positive-bias
sampling and ratio calibration (rejected at start).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from jaxreplay import distributed, rundir, sharding
from jaxreplay.actor import Actor
from jaxreplay.rollouts import row_spec
from jaxreplay.config import Config, ConfigError
from jaxreplay.eval import EVAL_BATCH, evaluate
from jaxreplay.learner import make_optimizer, make_train_step
from jaxreplay.rollouts import TRAINED
from jaxreplay.metrics import MetricsWriter
from jaxreplay.models import abstract_params, init_params
from jaxreplay.models.hf import load_hf_model, read_model_config
from jaxreplay.models.tokenizer import load_tokenizer
from jaxreplay.replay.multiprocess import check_multiprocess, open_replay
from jaxreplay.sampling import make_run_samplers
from jaxreplay.scheduler import next_move, window_shortfall
from jaxreplay.tasks import make_task
from jaxreplay.warmstart import supervised_warm_start


def train(config: Config, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Joins the job in `config.distributed`, trains, and returns this process's summary.

    Every process writes `run.dir/process-<id>.json` (its inserts, samples and a digest
    of the final params); process 0 also writes `metrics.jsonl` and `summary.json`.

    This owns the process, as `jax.distributed.initialize` does: on any error it writes
    the traceback to `run.dir/process-<id>.error`, prints one line and exits at once.
    A normal exit would wait in JAX's shutdown barrier for peers that are themselves
    waiting on this process; exiting drops its connections, so they fail in seconds.
    """
    distributed.initialize(config.distributed)
    try:
        # One job, one lock: process 0 holds run.dir's (rundir.py); the others share the directory.
        with rundir.claim(config.run.dir) if jax.process_index() == 0 else contextlib.nullcontext():
            return _train(config, log)
    except BaseException as e:
        pid = jax.process_index()
        with contextlib.suppress(OSError):  # run.dir itself may be what is wrong
            Path(config.run.dir).mkdir(parents=True, exist_ok=True)
            (Path(config.run.dir) / f"process-{pid}.error").write_text(traceback.format_exc())
        kind = "config error" if isinstance(e, ConfigError) else f"error: {type(e).__name__}"
        sys.stdout.flush()
        print(f"jaxreplay: process {pid}: {kind}: {str(e).splitlines()[0] if str(e) else ''}", file=sys.stderr,
              flush=True)
        os._exit(2 if isinstance(e, ConfigError) else 1)


def _train(config: Config, log: Callable[[str], None]) -> dict[str, Any]:
    c = config
    coord = distributed.Coordinator(c.distributed.timeout_s)
    pid, nproc = coord.process_id, coord.num_processes
    mesh = sharding.mesh_for(c)
    check_layout(c, mesh, nproc)
    run_dir = Path(c.run.dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    say = log if coord.is_leader else (lambda _: None)
    say(f"multi-host: {nproc} processes, mesh {sharding.describe(mesh)}")

    task = make_task(c.task, load_tokenizer(c.model.hf_path) if c.model.hf_path else None)
    tok = task.tokenizer
    if c.model.hf_path:  # released weights: every process reads its own shards from the files
        m = c.model
        model_cfg = read_model_config(m.hf_path, param_dtype=m.param_dtype, compute_dtype=m.compute_dtype,
                                      max_seq_len=m.max_seq_len)
        model_cfg, graphdef, params = load_hf_model(
            m.hf_path, param_dtype=m.param_dtype, compute_dtype=m.compute_dtype, max_seq_len=m.max_seq_len,
            shardings=sharding.param_shardings(mesh, abstract_params(model_cfg)))
        c = dataclasses.replace(c, model=model_cfg)
    else:
        graphdef, params = init_params(c.model, c.run.seed)
        params = sharding.shard_params(params, mesh)  # device_put checks that all processes agree
        if c.warmstart.steps:  # SPMD on the mesh, like the learner
            params = sharding.shard_params(supervised_warm_start(graphdef, params, task, c), mesh)
    digest_start = params_digest(params)
    ref_params = jax.tree.map(jnp.copy, params) if c.train.kl_coef > 0 else None
    optimizer = make_optimizer(c.train)
    opt_state = sharding.shard_params(optimizer.init(params), mesh)
    train_step = make_train_step(graphdef, c, optimizer, mesh)
    rows = sharding.batch_sharding(mesh)
    sample_fn, greedy_fn = make_run_samplers(graphdef, c, stop_ids=tok.eos_ids, pad_id=tok.pad_id, mesh=mesh)
    actor = Actor(c, task, _on_local_rows(sample_fn, mesh), shard=(pid, nproc))
    greedy_all = _on_all_rows(greedy_fn, mesh)

    replay = open_replay(c, row_spec(c, task.prompt_len), coord)
    metrics = MetricsWriter(run_dir) if coord.is_leader else None
    start = time.perf_counter()
    counts = {"inserted": 0, "sampled": 0, "actor_steps": 0, "learner_steps": 0}
    try:
        accuracy_start = accuracy = evaluate(params, task, greedy_all)
        say(f"eval/accuracy at start: {accuracy_start:.3f}")
        pending: Optional[dict[str, np.ndarray]] = None
        view = None  # the table now, if no move since it was read: a learn turn's serves the next turn
        turn = 0
        while counts["learner_steps"] < c.train.steps:
            turn += 1
            mine = 0 if pending is None else len(pending["reward"])
            if view is None:
                view = replay.view(f"turn/{turn}", mine)
            move = next_move(view.state, view.pending, view.state.can_sample_at_once(c.train.batch_size), nproc)
            view = None
            if move.kind == "insert":
                k = move.rows
                replay.insert({name: v[:k] for name, v in pending.items()})
                counts["inserted"] += k
                pending = {name: v[k:] for name, v in pending.items()} if k < mine else None
            elif move.kind == "learn":
                local = replay.sample(c.train.batch_size // nproc)
                counts["sampled"] += len(local["reward"])
                view = replay.view(f"sampled/{turn}", mine)
                batch = {k: _global_rows(local[k], rows) for k in TRAINED}
                # Wait for every local device, not just the one device_get reads: a device
                # that started the next computation early would pair its collectives with a
                # peer still in this step (gloo matches collectives by order; seen on CPU).
                params, opt_state, step_metrics = jax.block_until_ready(
                    train_step(params, opt_state, batch, ref_params))
                counts["learner_steps"] += 1
                step = counts["learner_steps"]
                record = {k: float(v) for k, v in jax.device_get(step_metrics).items()}
                record["batch/reward_mean"] = float(np.mean(multihost_utils.process_allgather(local["reward"])))
                if step % c.train.eval_every == 0 or step == c.train.steps:
                    accuracy = record["eval/accuracy"] = evaluate(params, task, greedy_all)
                table = view.state
                record.update({"replay/size": table.size, "replay/inserts": table.inserts,
                               "replay/samples": table.samples, "replay/ratio": table.ratio})
                if metrics is not None:
                    metrics.write(step, record)
            else:  # act
                pending, _ = actor.act(params, counts["learner_steps"], counts["actor_steps"])
                counts["actor_steps"] += 1

        digest = params_digest(params)
        table = view.state  # after the last learner step
        summary = {"process_id": pid, "num_processes": nproc, "steps": counts["learner_steps"],
                   "actor_steps": counts["actor_steps"], "rows_inserted": counts["inserted"],
                   "rows_sampled": counts["sampled"], "params_sha256_start": digest_start, "params_sha256": digest,
                   "eval/accuracy_start": accuracy_start, "eval/accuracy_end": accuracy,
                   "replay/backend": type(replay).__name__, "seconds": round(time.perf_counter() - start, 1)}
        (run_dir / f"process-{pid}.json").write_text(json.dumps(summary, indent=2) + "\n")
        coord.barrier("finished")  # no process touches the table again: process 0 may stop its server
        summary.update({"replay/inserts": table.inserts, "replay/samples": table.samples, "replay/ratio": table.ratio,
                        "replay/samples_per_insert_target": 1.0 if c.replay.mode == "on_policy"
                        else c.replay.samples_per_insert})
        if coord.is_leader:
            (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        say(f"done: {summary['steps']} steps on {nproc} processes in {summary['seconds']}s | eval/accuracy "
            f"{accuracy_start:.3f} -> {accuracy:.3f} | replay/ratio {table.ratio:.2f} "
            f"| params sha256 {digest[:12]} | {run_dir}")
        return summary
    finally:
        if metrics is not None:
            metrics.close()
        replay.stop()


def check_layout(config: Config, mesh, num_processes: int) -> None:
    """What the global mesh and batch sizes must satisfy for every process to own whole rows."""
    if mesh.devices.size != jax.device_count():
        raise ConfigError(f"mesh: covers {mesh.devices.size} of the {jax.device_count()} devices of "
                          f"{num_processes} processes; multi-host needs them all (use -1 for one size)")
    if sharding.data_parallelism(mesh) % num_processes:
        raise ConfigError(f"mesh.data: data parallelism {sharding.data_parallelism(mesh)} is not a multiple of "
                          f"the {num_processes} processes, so processes cannot own distinct batch rows")
    sharding.check_batch_sizes(mesh, {"eval batch (eval.EVAL_BATCH)": EVAL_BATCH})
    t, r = config.train, config.replay
    check_multiprocess(config, num_processes)
    if r.calibrate_steps > 0:
        raise ConfigError("replay.calibrate_steps: calibration is not supported multi-host yet; set "
                          "replay.samples_per_insert and calibrate_steps=0")
    if t.prompts_per_step % num_processes:
        raise ConfigError(f"train.prompts_per_step: {t.prompts_per_step} does not split over {num_processes} processes")
    if (why := window_shortfall(config, num_processes)) is not None:
        raise ConfigError(f"replay.error_buffer: {why}")


def _global_rows(local: np.ndarray, rows) -> jax.Array:
    """The global batch whose rows are every process's `local` rows (each process holds as many)."""
    local = np.asarray(local)
    shape = (local.shape[0] * jax.process_count(), *local.shape[1:])
    return jax.make_array_from_process_local_data(rows, local, shape)


def _on_local_rows(sample_fn, mesh):
    """`sample_fn` run on the global batch made of every process's prompts; returns this
    process's rows, as numpy. The key must be the same on every process."""
    rows = sharding.batch_sharding(mesh)
    spec = rows.spec

    def sample(params, prompts, prompt_mask, key):
        rollout = jax.block_until_ready(sample_fn(params, _global_rows(prompts, rows), _global_rows(prompt_mask, rows),
                                                  _replicated(key, mesh)))  # all devices done: see `train`
        return jax.tree.map(
            lambda x: np.asarray(multihost_utils.global_array_to_host_local_array(x, mesh, spec)), rollout)

    return sample


def _on_all_rows(sample_fn, mesh):
    """`sample_fn` on prompts every process holds in full; returns all rows, as numpy."""
    rows = sharding.batch_sharding(mesh)

    def sample(params, prompts, prompt_mask, key):
        whole = [jax.make_array_from_callback(np.shape(x), rows, lambda index, x=np.asarray(x): x[index])
                 for x in (prompts, prompt_mask)]
        rollout = jax.block_until_ready(sample_fn(params, *whole, _replicated(key, mesh)))  # see `train`
        return jax.tree.map(lambda x: np.asarray(multihost_utils.process_allgather(x, tiled=True)), rollout)

    return sample


def _replicated(x, mesh) -> jax.Array:
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, sharding.replicated(mesh), lambda index: x[index])


def params_digest(params) -> str:
    """sha256 of the full parameter values (gathered from all processes), leaves in tree order."""
    digest = hashlib.sha256()
    for leaf in jax.tree.leaves(multihost_utils.process_allgather(params, tiled=True)):
        digest.update(np.ascontiguousarray(leaf).tobytes())
    return digest.hexdigest()
