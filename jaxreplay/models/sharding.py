"""Device meshes and the logical-axis rules: the only module that knows mesh axis names.

The model names the axes of its parameters and cache logically ("vocab", "embed",
"heads", "kv_heads", "mlp", "norm", ...); batches are "batch"-major. `RULES` maps each
logical axis to mesh axes, in one table for parameters, optimizer state, KV cache and
batches. A dimension that a mesh axis does not divide stays replicated over that axis
(GQA with fewer kv heads than tensor shards, a tiny vocabulary), so every config that
runs on one device runs on any mesh.

    mesh = make_mesh(config.mesh)                       # ("data", "fsdp", "tensor")
    params = shard_params(params, mesh)                  # NamedSharding per logical axes
    step = jax.jit(f, in_shardings=(param_shardings(mesh, params), batch_sharding(mesh)))
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence

import jax
import numpy as np
from flax import nnx
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxreplay.compat import is_variable, logical_axes, split_kv_gap, value_of, with_value
from jaxreplay.config import Config, ConfigError, MeshConfig

AXES = ("data", "fsdp", "tensor")

# Logical axis -> mesh axes it is split over (empty: replicated).
RULES: dict[str, tuple[str, ...]] = {
    "batch": ("data", "fsdp"),  # activations, batches, the cache: data parallel over both
    "embed": ("fsdp",),  # parameters: ZeRO-3 style, gathered per use
    "vocab": ("tensor",),
    "heads": ("tensor",),
    "kv_heads": ("tensor",),
    "mlp": ("tensor",),
    # a mixture of experts' expert axis: expert parallelism over the fsdp devices (each holds E / fsdp whole
    # experts; the experts' "embed" axis then stays unsplit, as a mesh axis splits one dimension only)
    "experts": ("fsdp",),
    "router": (),  # the router's per-expert logits: a [D, E] kernel, kept whole
    "head_dim": (),
    "lora_rank": (),  # LoRA adapters' rank: a few columns, kept whole
    "norm": (),
    "length": (),
}


# ----------------------------------------------------------------------------------
# Meshes


def mesh_shape(mesh_cfg: MeshConfig, n_devices: int, *, prefix: str = "mesh") -> tuple[int, int, int]:
    """(data, fsdp, tensor) for `n_devices`, resolving a -1; a ConfigError naming the key if it cannot fit."""
    sizes = {"data": mesh_cfg.data, "fsdp": mesh_cfg.fsdp, "tensor": mesh_cfg.tensor}
    fixed = math.prod(v for v in sizes.values() if v != -1)
    rest = [k for k, v in sizes.items() if v == -1]
    if rest:
        if n_devices % fixed:
            raise ConfigError(f"{prefix}.{rest[0]}: -1 cannot fill {n_devices} devices: the other sizes multiply "
                              f"to {fixed}, which does not divide {n_devices}")
        sizes[rest[0]] = n_devices // fixed
    elif fixed > n_devices:
        key = next(k for k, v in sizes.items() if v > 1)
        raise ConfigError(f"{prefix}.{key}: the mesh {sizes['data']}x{sizes['fsdp']}x{sizes['tensor']} needs {fixed} "
                          f"devices, only {n_devices} available")
    return sizes["data"], sizes["fsdp"], sizes["tensor"]


def make_mesh(mesh_cfg: MeshConfig, devices: Optional[Sequence[jax.Device]] = None) -> Mesh:
    """A ("data", "fsdp", "tensor") mesh over the first data*fsdp*tensor of `devices` (default: all).

    Raises ConfigError (naming `mesh.*`) when the shape does not fit the devices.
    """
    devices = list(jax.devices() if devices is None else devices)
    shape = mesh_shape(mesh_cfg, len(devices))
    return _mesh(shape, devices[:math.prod(shape)])


def make_role_meshes(mesh_cfg: MeshConfig, devices: Optional[Sequence[jax.Device]] = None) -> tuple[Mesh, Mesh]:
    """(actor mesh, learner mesh) on disjoint devices, for disaggregated mode.

    The actor takes the first `mesh.actor_devices` devices, `actor_tensor` tensor-parallel
    and data-parallel over the rest; the learner's mesh is `mesh.data/fsdp/tensor` over
    the remaining devices.
    """
    devices = list(jax.devices() if devices is None else devices)
    n_actor = mesh_cfg.actor_devices
    if n_actor <= 0:
        raise ConfigError("mesh.actor_devices: must be positive for disaggregated meshes")
    if n_actor >= len(devices):
        raise ConfigError(f"mesh.actor_devices: {n_actor} leaves no learner device out of {len(devices)}")
    actor = _mesh((n_actor // mesh_cfg.actor_tensor, 1, mesh_cfg.actor_tensor), devices[:n_actor])
    learner = make_mesh(mesh_cfg, devices[n_actor:])
    return actor, learner


def topology_mesh(mesh_cfg: MeshConfig, devices: Sequence[Any]) -> Mesh:
    """The mesh a run on exactly `devices` (a whole slice, e.g. a deviceless TPU topology
    from `jaxreplay.tools.topology`) would build: device order from `mesh_utils`, topology-aware."""
    devices = list(devices)
    shape = mesh_shape(mesh_cfg, len(devices))
    if math.prod(shape) != len(devices):
        return Mesh(np.asarray(devices[:math.prod(shape)], dtype=object).reshape(shape), AXES)
    return Mesh(mesh_utils.create_device_mesh(shape, devices), AXES)


def _mesh(shape: tuple[int, ...], devices: list[jax.Device]) -> Mesh:
    if len(devices) == len(jax.devices()):
        grid = mesh_utils.create_device_mesh(shape, devices)  # topology-aware on TPU
    else:  # a subset of a slice: keep the given order
        grid = np.asarray(devices, dtype=object).reshape(shape)
    return Mesh(grid, AXES)


def process_local_mesh(mesh: Mesh, local: Optional[Sequence[Any]] = None) -> Mesh:
    """This process's devices of a multi-host `mesh` (or `local`, one host's devices) as a mesh
    of their own: its tensor degree kept where the local devices allow it, fsdp over the rest.
    Weights and a slot pool laid out on it split over the process's devices, and no program on
    it crosses processes."""
    if local is None:
        local = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
    local = sorted(local, key=lambda d: d.id)
    tensor = mesh.shape["tensor"] if len(local) % mesh.shape["tensor"] == 0 else 1
    return Mesh(np.asarray(local, dtype=object).reshape(1, len(local) // tensor, tensor), AXES)


def to_process_local(params: Any, local: Mesh) -> Any:
    """Global `params` (nnx state laid out over a multi-host mesh) whole on every process, laid
    out on each process's `local` mesh (`process_local_mesh`) by their logical axes. One
    resharding program onto the processes' local meshes stacked side by side: a collective every
    process runs together; each then keeps its own devices' shards. Nothing goes through the host."""
    by_process: dict[int, list] = {}
    for d in jax.devices():
        by_process.setdefault(d.process_index, []).append(d)
    # Every process's devices in the order `process_local_mesh` lays out its own.
    rows = [sorted(by_process[p], key=lambda d: d.id) for p in sorted(by_process)]
    if [d.id for d in rows[jax.process_index()]] != [d.id for d in local.devices.flat]:
        raise ValueError("to_process_local: `local` is not this process's process_local_mesh")
    stacked = Mesh(np.asarray(rows, dtype=object).reshape(len(rows), *local.devices.shape), ("processes", *AXES))
    whole = jax.jit(_identity, out_shardings=param_shardings(stacked, params))(params)

    def mine(x: jax.Array) -> jax.Array:
        spec = x.sharding.spec
        return jax.make_array_from_single_device_arrays(
            x.shape, NamedSharding(local, spec), [shard.data for shard in x.addressable_shards])

    return jax.tree.map(mine, whole)


def _identity(tree: Any) -> Any:
    return tree


def describe(mesh: Mesh) -> str:
    """E.g. "data=2 fsdp=2 tensor=2 (8 cpu devices)"."""
    sizes = " ".join(f"{k}={v}" for k, v in mesh.shape.items())
    return f"{sizes} ({mesh.devices.size} {mesh.devices.flat[0].platform} devices)"


def data_parallelism(mesh: Mesh) -> int:
    """How many ways a "batch" axis is split: batch sizes must be multiples of it."""
    return math.prod(mesh.shape[a] for a in RULES["batch"])


def check_batch_sizes(mesh: Mesh, sizes: dict[str, int]) -> None:
    """ConfigError naming the first key whose batch size the mesh's data parallelism does not divide."""
    n = data_parallelism(mesh)
    for key, size in sizes.items():
        if size % n:
            raise ConfigError(f"{key}: {size} is not a multiple of the mesh's data parallelism "
                              f"({' x '.join(RULES['batch'])} = {n})")


# ----------------------------------------------------------------------------------
# Logical axes -> shardings


def logical_spec(mesh: Mesh, axes: Sequence[Optional[str]], shape: Sequence[int]) -> PartitionSpec:
    """The PartitionSpec for an array of `shape` whose dimensions have logical `axes`.

    A mesh axis is used for at most one dimension (the first that asks for it), and
    only where it divides that dimension; unknown logical names are an error.
    """
    if len(axes) != len(shape):
        raise ValueError(f"logical axes {tuple(axes)} do not match shape {tuple(shape)}")
    used: set[str] = set()
    spec = []
    for name, dim in zip(axes, shape):
        if name is not None and name not in RULES:
            raise ValueError(f"no sharding rule for logical axis {name!r} (known: {', '.join(RULES)})")
        mesh_axes = []
        for axis in RULES.get(name, ()) if name is not None else ():
            size = mesh.shape[axis]
            if axis in used or size == 1:
                continue
            if dim % (math.prod(mesh.shape[a] for a in mesh_axes) * size) == 0:
                mesh_axes.append(axis)
        used.update(mesh_axes)
        spec.append(tuple(mesh_axes) if len(mesh_axes) > 1 else (mesh_axes[0] if mesh_axes else None))
    return PartitionSpec(*spec)


def logical_sharding(mesh: Mesh, axes: Sequence[Optional[str]], shape: Sequence[int]) -> NamedSharding:
    return NamedSharding(mesh, logical_spec(mesh, axes, shape))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def process_rows() -> NamedSharding:
    """Rows split over the job's processes, each process's block whole on each of its devices:
    how host rows that every process holds (as many each) become one global array."""
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    grid = np.asarray(devices, dtype=object).reshape(jax.process_count(), jax.local_device_count())
    return NamedSharding(Mesh(grid, ("processes", "local")), PartitionSpec("processes"))


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Leading (batch) axis split over the data-parallel mesh axes; other axes replicated."""
    return NamedSharding(mesh, PartitionSpec(RULES["batch"]))


def microbatch_sharding(mesh: Mesh) -> NamedSharding:
    """A batch reshaped to [micro-batches, rows, ...]: each micro-batch's rows split like a batch's."""
    return NamedSharding(mesh, PartitionSpec(None, RULES["batch"]))


def param_shardings(mesh: Mesh, tree: Any) -> Any:
    """The same tree with a NamedSharding per leaf: every nnx Param by its logical axes
    (`compat.logical_axes`), every other leaf replicated. Works on params, on optimizer
    state built from them (Adam moments keep the metadata) and on abstract trees."""

    def one(x):
        if is_variable(x):
            axes = logical_axes(x)
            shape = np.shape(value_of(x))
            axes = (None,) * len(shape) if axes is None else axes
            return with_value(x, logical_sharding(mesh, axes, shape))
        return replicated(mesh)

    return jax.tree.map(one, tree, is_leaf=is_variable)


def shard_params(params: Any, mesh: Mesh) -> Any:
    """`params` (or any tree `param_shardings` accepts) placed on `mesh`.

    Multi-host, the host values among them (each process passes its own copy: a fresh init,
    a scalar of an optimizer state) are checked to be the same on every process, as
    `jax.device_put` checks them, but in one program for the whole tree, waited for on every
    local device. `jax.device_put` checks leaf by leaf (`multihost_utils.assert_equal`: one
    broadcast per leaf, waited for on the first local device only), and on CPU (jax 0.4.34) a
    device still in one leaf's broadcast then pairs its collectives with a peer's next leaf's:
    gloo aborts the job (`op.preamble.length <= op.nbytes`)."""
    shardings = param_shardings(mesh, params)
    if jax.process_count() == 1:
        return jax.device_put(params, shardings)
    leaves, treedef = jax.tree.flatten(params)
    targets = treedef.flatten_up_to(shardings)
    host = [i for i, (x, s) in enumerate(zip(leaves, targets)) if not s.is_fully_addressable and _is_host_value(x)]
    if host:  # checked before anything of the tree is placed: no program of this call runs during the check
        assert_same_on_every_process([leaves[i] for i in host], "passed to device_put")
    checked = set(host)
    rest = [i for i in range(len(leaves)) if i not in checked]
    placed = dict(zip(rest, jax.device_put([leaves[i] for i in rest], [targets[i] for i in rest])))
    if host:  # as `jax.device_put` places them once checked: no collective
        to_mesh = jax.jit(_identity, out_shardings=[targets[i] for i in host])
        placed.update(zip(host, to_mesh([leaves[i] for i in host])))
    return jax.tree.unflatten(treedef, [placed[i] for i in range(len(leaves))])


def _is_host_value(x: Any) -> bool:
    """A value each process holds whole of its own (what `jax.device_put` checks multi-host): not a
    jax.Array, or one on this process's devices that was never placed (committed) anywhere."""
    return not isinstance(x, jax.Array) or (x.is_fully_addressable and not getattr(x, "_committed", True))


def assert_same_on_every_process(values: Sequence[Any], what: str) -> None:
    """Raises AssertionError unless every process passes the same `values` (process 0's are
    broadcast to all and compared). One program for them all, waited for on every local device,
    so that no device is still in it when the caller's next collective starts (see `shard_params`)."""
    values = [np.asarray(v) for v in values]
    values = [v.astype(jax.dtypes.canonicalize_dtype(v.dtype), copy=False) for v in values]
    rows = process_rows()
    leader = jax.process_index() == 0
    stacked = [jax.make_array_from_process_local_data(rows, (v if leader else np.zeros_like(v))[None])
               for v in values]
    summed = jax.jit(lambda xs: [x.sum(axis=0, dtype=x.dtype) for x in xs],
                     out_shardings=[replicated(rows.mesh)] * len(values))(stacked)
    expected = [np.asarray(x.addressable_data(0)) for x in jax.block_until_ready(summed)]
    for mine, theirs in zip(values, expected):
        if not np.all(np.equal(mine, theirs)):
            raise AssertionError(f"{type(mine)} {what} is not the same on each process: process 0 passes "
                                 f"{theirs}; process {jax.process_index()} passes {mine}")


def cache_sharding(mesh: Mesh, axes: Sequence[str], shape: Sequence[int]) -> NamedSharding:
    """The KV cache's sharding: batch over data parallelism, kv heads over tensor."""
    return logical_sharding(mesh, axes, shape)


def mesh_for(config: Config, role: str = "learner") -> Mesh:
    """The mesh `role` ("actor" or "learner") runs on, with the config's batch sizes checked.

    Colocated (mesh.actor_devices = 0): both roles get the same mesh.
    """
    m = config.mesh
    if m.actor_devices:
        actor, learner = make_role_meshes(m)
        mesh = actor if role == "actor" else learner
    else:
        mesh = make_mesh(m)
    gap = split_kv_gap(mesh.shape["tensor"], config.model.n_kv_heads, data_parallelism(mesh))
    if gap:
        raise ConfigError(f"mesh.{'actor_tensor' if role == 'actor' and m.actor_devices else 'tensor'}: {gap}")
    sizes = {"train.batch_size": config.train.batch_size} if role == "learner" else {}
    if role == "learner" and config.train.micro_batch_size:
        sizes["train.micro_batch_size"] = config.train.micro_batch_size
    if role == "actor" or not m.actor_devices:
        sizes["train.prompts_per_step * train.group_size"] = config.rollouts_per_step
    check_batch_sizes(mesh, sizes)
    return mesh
