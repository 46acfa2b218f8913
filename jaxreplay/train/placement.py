"""Where the roles run, as data: the actor's mesh, the learner's mesh, and the processes.

Three placements, one driver (driver.py):
  colocated      one process; the actor and the learner share one mesh and take turns
  disaggregated  one process; disjoint actor and learner meshes (`mesh.actor_devices`),
                 each role in its own thread, concurrently (the paper's W / T split)
  multihost      every process of a JAX job runs the same turns over one global mesh
                 (SPMD); each process owns its rows of every batch

A placement also knows how host rows meet its meshes: how a batch of rollout rows
becomes the learner's global batch, and how the sampler sees the prompts.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any, Callable, Literal, Mapping

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh

from jaxreplay.config import Config, ConfigError
from jaxreplay.models import sharding
from jaxreplay.rollout.rollouts import to_device_batch, trained
from jaxreplay.train.eval import EVAL_BATCH

Kind = Literal["colocated", "disaggregated", "multihost"]


@dataclasses.dataclass(frozen=True)
class Placement:
    kind: Kind
    actor_mesh: Mesh
    learner_mesh: Mesh
    process_id: int = 0
    processes: int = 1

    @property
    def concurrent(self) -> bool:
        """Whether the roles run at once (threads), rather than in turns."""
        return self.kind == "disaggregated"

    @property
    def is_leader(self) -> bool:
        """The process that writes the run's records."""
        return self.process_id == 0

    @property
    def engine_mesh(self) -> Mesh:
        """Where the rollout engine's weights and slot pool lie: the actor's mesh, or multi-host
        this process's devices alone (`sharding.process_local_mesh`), so that each process
        decodes its own pool at its own pace with no program crossing processes."""
        return sharding.process_local_mesh(self.actor_mesh) if self.kind == "multihost" else self.actor_mesh

    def describe(self) -> str:
        if self.kind == "disaggregated":
            return (f"disaggregated: actor mesh {sharding.describe(self.actor_mesh)} | "
                    f"learner mesh {sharding.describe(self.learner_mesh)}")
        where = f"{self.processes} processes, " if self.kind == "multihost" else ""
        return f"{self.kind}: {where}mesh {sharding.describe(self.learner_mesh)}"

    def learner_batch(self, rows: Mapping[str, np.ndarray]) -> dict[str, jax.Array]:
        """This process's sampled rows as the learner's (global) batch."""
        if self.kind != "multihost":
            return to_device_batch(rows)
        spec = sharding.batch_sharding(self.learner_mesh)
        return {k: _global_rows(v, spec) for k, v in trained(rows).items()}

    def checkpoint_rows(self, rows: Mapping[str, np.ndarray]) -> Any:
        """This process's rows as a checkpoint holds them: multi-host, one global array of every
        process's rows (each process writes its own shard); else as they are."""
        if self.kind != "multihost":
            return dict(rows)
        spec = sharding.batch_sharding(self.learner_mesh)
        return {k: _global_rows(np.asarray(v), spec) for k, v in rows.items()}

    def local_rows(self, rows: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """The inverse of `checkpoint_rows`: this process's rows, as numpy."""
        if self.kind != "multihost":
            return {k: np.asarray(v) for k, v in rows.items()}
        spec = sharding.batch_sharding(self.learner_mesh).spec
        return {k: np.asarray(multihost_utils.global_array_to_host_local_array(v, self.learner_mesh, spec))
                for k, v in rows.items()}

    def every_process(self, rows: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Every process's rows, concatenated in process order (a collective multi-host), so the
        leader's records describe the whole batch, not its own share."""
        if self.kind != "multihost":
            return dict(rows)
        spread = sharding.process_rows()
        return fetched({k: _global_rows(np.atleast_1d(v), spread) for k, v in rows.items()})

    def rollout_sampler(self, sample_fn: Callable) -> Callable:
        """`sample_fn` as the actor calls it: on this process's prompts, returning its rows."""
        return _on_local_rows(sample_fn, self.actor_mesh) if self.kind == "multihost" else sample_fn

    def eval_sampler(self, sample_fn: Callable) -> Callable:
        """`sample_fn` as evaluation calls it: every process holds every prompt and every row."""
        return _on_all_rows(sample_fn, self.actor_mesh) if self.kind == "multihost" else sample_fn


def placement_for(config: Config) -> Placement:
    """The placement `config` asks for: multihost when `distributed` is set (the job must be
    initialised first), disaggregated when `mesh.actor_devices` > 0, else colocated."""
    if config.distributed.enabled:
        mesh = sharding.mesh_for(config)
        placement = Placement("multihost", mesh, mesh, jax.process_index(), jax.process_count())
        _check_multihost_layout(config, mesh, placement.processes)
        return placement
    if config.mesh.actor_devices:
        actor, learner = sharding.make_role_meshes(config.mesh)
        sharding.check_batch_sizes(actor, {"train.prompts_per_step * train.group_size": config.rollouts_per_step,
                                           "eval batch (eval.EVAL_BATCH)": EVAL_BATCH})
        sharding.check_batch_sizes(learner, {"train.batch_size": config.train.batch_size})
        return Placement("disaggregated", actor, learner)
    mesh = sharding.mesh_for(config)
    sharding.check_batch_sizes(mesh, {"eval batch (eval.EVAL_BATCH)": EVAL_BATCH})
    return Placement("colocated", mesh, mesh)


def _check_multihost_layout(config: Config, mesh: Mesh, processes: int) -> None:
    """What the global mesh and batch sizes must satisfy for every process to own whole rows."""
    if mesh.devices.size != jax.device_count():
        raise ConfigError(f"mesh: covers {mesh.devices.size} of the {jax.device_count()} devices of "
                          f"{processes} processes; multi-host needs them all (use -1 for one size)")
    if sharding.data_parallelism(mesh) % processes:
        raise ConfigError(f"mesh.data: data parallelism {sharding.data_parallelism(mesh)} is not a multiple of "
                          f"the {processes} processes, so processes cannot own distinct batch rows")
    sharding.check_batch_sizes(mesh, {"eval batch (eval.EVAL_BATCH)": EVAL_BATCH})
    if config.train.prompts_per_step % processes:
        raise ConfigError(f"train.prompts_per_step: {config.train.prompts_per_step} does not split over "
                          f"{processes} processes")


def _global_rows(local: np.ndarray, rows) -> jax.Array:
    """The global batch whose rows are every process's `local` rows (each process holds as many)."""
    shape = (local.shape[0] * jax.process_count(), *local.shape[1:])
    return jax.make_array_from_process_local_data(rows, local, shape)


def _on_local_rows(sample_fn: Callable, mesh: Mesh) -> Callable:
    """`sample_fn` run on the global batch made of every process's prompts; returns this
    process's rows, as numpy. The key must be the same on every process."""
    rows = sharding.batch_sharding(mesh)

    def sample(params, prompts, prompt_mask, key):
        # Wait for every local device, not just the one read first: a device that started the next
        # computation early would pair its collectives with a peer still in this one (gloo matches
        # collectives by order; seen on CPU).
        rollout = jax.block_until_ready(sample_fn(
            params, _global_rows(np.asarray(prompts), rows), _global_rows(np.asarray(prompt_mask), rows),
            replicated(key, mesh)))
        return jax.tree.map(
            lambda x: np.asarray(multihost_utils.global_array_to_host_local_array(x, mesh, rows.spec)), rollout)

    return sample


def _on_all_rows(sample_fn: Callable, mesh: Mesh) -> Callable:
    """`sample_fn` on prompts every process holds in full; returns all rows, as numpy."""
    rows = sharding.batch_sharding(mesh)

    def sample(params, prompts, prompt_mask, key):
        whole = [jax.make_array_from_callback(np.shape(x), rows, lambda index, x=np.asarray(x): x[index])
                 for x in (prompts, prompt_mask)]
        rollout = jax.block_until_ready(sample_fn(params, *whole, replicated(key, mesh)))
        return fetched(rollout)

    return sample


def _identity(tree: Any) -> Any:
    return tree


def fetched(tree: Any) -> Any:
    """Global arrays whole on every process, as numpy (a collective multi-host). One program for
    the whole tree, waited for on every local device: `multihost_utils.process_allgather` runs one
    per leaf and waits for the first device only, and on CPU (jax 0.4.34) a device still in one
    gather then pairs its collectives with a peer's next: gloo aborts the job."""
    whole = jax.jit(_identity, out_shardings=jax.tree.map(lambda x: sharding.replicated(x.sharding.mesh), tree))(tree)
    return jax.tree.map(lambda x: np.asarray(x.addressable_data(0)), jax.block_until_ready(whole))


def replicated(x: Any, mesh: Mesh) -> jax.Array:
    """A host value placed whole on every device of `mesh` (every process passes the same value)."""
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, sharding.replicated(mesh), lambda index: x[index])


def params_digest(params: Any) -> str:
    """sha256 of the full parameter values (gathered from all processes), leaves in tree order."""
    digest = hashlib.sha256()
    for leaf in jax.tree.leaves(fetched(params)):
        digest.update(np.ascontiguousarray(leaf).tobytes())
    return digest.hexdigest()
