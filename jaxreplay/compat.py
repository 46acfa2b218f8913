"""The one module that knows the two dependency tiers apart.

The default tier runs current releases (jax >= 0.8, flax >= 0.12, orbax-checkpoint
>= 0.12, numpy 2); the Reverb lane runs what dm-reverb 0.14.0 pins (jax 0.4.34,
flax 0.10.4, orbax-checkpoint 0.11.5, numpy 1.26). Where their APIs differ, the rest
of the code base calls these functions and never tests a version itself.

The differences absorbed here:
- Flax 0.12 names a variable's sharding annotation `out_sharding` and, by default,
  shards a variable eagerly when it is created, which needs a mesh in context. Our
  parameters carry *logical* axis names that `jaxreplay.models.sharding` maps to a mesh
  later, so they are created with eager sharding off. Flax 0.10 calls the same
  annotation `sharding` and never shards eagerly.
- jax >= 0.5 builds an `AbstractMesh` from sizes and names; jax 0.4 from (name, size)
  pairs.
- Flax 0.12 merged `nnx.VariableState` into `nnx.Variable`, and reads a variable's
  array with `get_value()` (`.value` is deprecated); Flax 0.10 has only `.value`.
- Flax 0.12 splits and merges States with `nnx.split_state` / `nnx.merge_state` (the State
  methods are deprecated); Flax 0.10 has only the methods.
- A compiled executable's `cost_analysis()` is one dict on jax >= 0.5, a list of one
  dict per program on jax 0.4.
"""

from __future__ import annotations

import functools
import os
from typing import TYPE_CHECKING, Any, Optional, Sequence

if TYPE_CHECKING:
    import jax
    from flax import nnx

# JAX and Flax are imported by the functions that use them, not here: `jaxreplay --version`
# (`describe_tier`, from package metadata) and the CLI's help import this module without paying
# for them (seconds on a cold start).


@functools.cache
def _flax_out_sharding() -> bool:
    """Flax >= 0.12: eager variable sharding (FLIP 4844) and `out_sharding` metadata."""
    from flax import nnx

    return hasattr(nnx, "use_eager_sharding")


def _axes_key() -> str:
    return "out_sharding" if _flax_out_sharding() else "sharding"


@functools.cache
def _variable_leaf() -> type:
    from flax import nnx

    return nnx.Variable if _flax_out_sharding() else nnx.VariableState


def __getattr__(name: str) -> Any:
    """`VariableLeaf`, the type of a variable's leaf in an `nnx.State` (params, optimizer state),
    resolved on first use (it needs Flax)."""
    if name == "VariableLeaf":
        return _variable_leaf()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def param(value: Any, axes: Sequence[Optional[str]], kind: Optional[type] = None) -> nnx.Param:
    """An `nnx.Param` (or its subclass `kind`) annotated with its logical axes and placed nowhere yet."""
    from flax import nnx

    kind = kind or nnx.Param
    if _flax_out_sharding():
        return kind(value, out_sharding=tuple(axes), eager_sharding=False)
    return kind(value, sharding=tuple(axes))


def is_variable(x: Any) -> bool:
    """Whether `x` is a variable leaf of an `nnx.State` (it carries metadata)."""
    return isinstance(x, _variable_leaf())


def logical_axes(variable: Any) -> Optional[tuple[Optional[str], ...]]:
    """The logical axis names a variable was annotated with, or None."""
    axes = variable.get_metadata().get(_axes_key())
    return None if axes is None else tuple(axes)


def value_of(variable: Any) -> Any:
    """The array (or abstract array) a variable holds."""
    return variable.get_value() if _flax_out_sharding() else variable.value


def with_value(variable: Any, value: Any) -> Any:
    """A copy of `variable` holding `value`, with the same metadata."""
    return variable.replace(value)


def split_state(state: Any, *filters: Any) -> tuple:
    """`state` split by nnx filters, one State per filter (Flax 0.12 deprecates the State method)."""
    from flax import nnx

    return nnx.split_state(state, *filters) if hasattr(nnx, "split_state") else state.split(*filters)


def merge_state(*states: Any) -> Any:
    """The one State that `split_state` split."""
    from flax import nnx

    return nnx.merge_state(*states) if hasattr(nnx, "merge_state") else nnx.State.merge(*states)


def module_list(modules: list) -> Any:
    """A list of submodules as a model attribute (Flax 0.12 wants it marked as data)."""
    from flax import nnx

    return nnx.List(modules) if _flax_out_sharding() else modules


def abstract_mesh(sizes: dict[str, int]) -> jax.sharding.AbstractMesh:
    """A device-less mesh of these axis sizes, for shapes and specs without devices."""
    import jax

    try:
        return jax.sharding.AbstractMesh(tuple(sizes.values()), tuple(sizes))
    except TypeError:  # jax 0.4: one tuple of (name, size) pairs
        return jax.sharding.AbstractMesh(tuple(sizes.items()))


def flops_of(compiled: Any) -> Optional[float]:
    """The FLOPs XLA's cost analysis counts for a compiled executable, or None where it has none."""
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else None
    flops = (cost or {}).get("flops")
    return None if flops is None else float(flops)


def _version(name: str) -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


def describe_tier() -> str:
    """The versions this process runs on, in one line: what a bug report or a run log needs."""
    import platform

    names = ["jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "numpy", "dm-reverb"]
    return ", ".join([f"python {platform.python_version()}"] + [f"{n} {_version(n)}" for n in names])


def split_kv_gap(tensor: int, kv_heads: int, batch_split: int) -> Optional[str]:
    """Why this tier computes wrong logits with `tensor`-way head parallelism that does not
    divide `kv_heads` while the batch is also split `batch_split` ways, or None. jax 0.4.34 (the
    Reverb tier) does, measured on 8 CPU devices: the sampler's and the engine's log-probs off by
    0.17-0.46 at data=2 or fsdp=2 with tensor=4 over 2 kv heads; current jax matches one device."""
    import jax

    if tensor > 1 and kv_heads % tensor and batch_split > 1 and \
            tuple(int(x) for x in jax.__version__.split(".")[:2]) < (0, 5):
        return (f"jax {jax.__version__} miscomputes attention when {tensor}-way tensor parallelism does not divide "
                f"{kv_heads} kv heads and the batch is split too; use a tensor size that divides the kv heads, "
                "or the default tier")
    return None


def multiprocess_checkpoint_gap() -> Optional[str]:
    """Why Orbax cannot save one checkpoint from several processes on this tier, or None.
    orbax-checkpoint 0.11 (the Reverb tier) asks the coordination client for
    `key_value_try_get`, which jax 0.4.34's client does not have (measured: AttributeError
    in every multi-process save)."""
    import jax

    try:
        from jax._src.lib import _jax as xla_client
    except ImportError:  # jax < 0.6
        from jax._src.lib import xla_extension as xla_client
    if hasattr(xla_client.DistributedRuntimeClient, "key_value_try_get"):
        return None
    return (f"orbax-checkpoint {_version('orbax-checkpoint')} cannot save from several processes with jax "
            f"{jax.__version__} (its coordination client lacks key_value_try_get); use the default tier")


def distributed_options(options: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """(the set `options` the installed `jax.distributed.initialize` takes, the names of the set
    ones it lacks). Both tiers take `coordinator_bind_address`; the mTLS files (`mtls_*`) are
    jax 0.12's, absent from jax 0.4.34 (the Reverb tier). Unset (None) options are left out."""
    import inspect

    import jax

    accepted = inspect.signature(jax.distributed.initialize).parameters
    given = {name: value for name, value in options.items() if value is not None}
    return {k: v for k, v in given.items() if k in accepted}, [k for k in given if k not in accepted]


def heartbeat_timeout(seconds: float) -> dict[str, int]:
    """`jax.distributed.initialize`'s heartbeat timeout as keyword arguments; jax 0.4.34 (the
    Reverb tier) has no such argument, and keeps its own (about 100 s)."""
    import inspect

    import jax

    if "heartbeat_timeout_seconds" not in inspect.signature(jax.distributed.initialize).parameters:
        return {}
    return {"heartbeat_timeout_seconds": max(1, round(seconds))}


def set_tf_cpu_only() -> None:
    """Keeps TensorFlow off GPUs; a no-op once TensorFlow has initialized its devices."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # TensorFlow's INFO and WARNING lines
    import tensorflow as tf
    try:
        tf.config.set_visible_devices([], "GPU")
    except RuntimeError:
        pass  # Devices already initialized: too late to hide them, and nothing to do here.
