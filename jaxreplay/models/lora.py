"""LoRA: low-rank adapters on a frozen base, as HF PEFT lays them out (the models stage's part).

Layout (`model.lora`: `targets`, `rank` r, `alpha`). Every layer's targeted `Linear` (by the
model's own names: attn.{q,k,v,o}_proj, mlp.{gate,up,down}_proj) keeps its frozen kernel
[in, out] (and bias) and gains two `Adapter` variables beside it:

    layers[i].attn.q_proj.lora_a     [in, r]    logical axes (the kernel's in axis, "lora_rank")
    layers[i].attn.q_proj.lora_b     [r, out]   logical axes ("lora_rank", the kernel's out axis)
    ... likewise k_proj, v_proj, o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj when targeted

    y = x @ kernel (+ bias) + (alpha / r) * (x @ lora_a) @ lora_b

PEFT's `lora_A.weight` is [r, in] and `lora_B.weight` [out, r]: ours are their transposes, as
every kernel here is HF's transposed. Initialised as PEFT does (`init_lora_weights=True`):
B = 0, so a fresh adapter adds exactly 0 and step 0 is the base; A ~ U(-1/sqrt(in), 1/sqrt(in)),
PEFT's kaiming_uniform(a=sqrt(5)) on a [r, in] weight. Scale alpha / r (no rsLoRA, no dropout).
Adapters are stored in `model.param_dtype`, like the base.

The adapters live in the model's own state: `transformer.split` returns one params State holding
the base (`nnx.Param`) and the adapters (`Adapter`, a subclass of `nnx.Param`, so everything that
handles params handles them: sharding by logical axes, device_put, the samplers). `split_adapters`
separates the two by variable type; `join` puts them back. With `model.lora.targets` empty there
are no `Adapter` variables and the params are exactly those of a model without LoRA.

`merge_adapters` folds the adapters into the base kernels (kernel + scale * A @ B): a params
State of the base model's structure, for export. The samplers do not merge: they apply the
adapters on the fly (docs/lora.md says why).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
from flax import nnx

from jaxreplay.compat import merge_state, split_state
from jaxreplay.config import Config, LoraConfig, ModelConfig

# The logical axis of the adapters' rank dimension (replicated: `sharding.RULES`)
RANK_AXIS = "lora_rank"


class Adapter(nnx.Param):
    """A LoRA factor: the only trainable variable of a model with `model.lora` on."""


class LoraSpec(NamedTuple):
    """What a targeted `Linear` needs: the rank and the output scale alpha / rank."""

    rank: int
    scale: float


def enabled(cfg: ModelConfig) -> bool:
    """Whether `cfg` trains adapters (some target named) rather than every weight."""
    return bool(cfg.lora.targets)


def spec_for(cfg: ModelConfig, name: str) -> Optional[LoraSpec]:
    """The adapters of the `Linear` called `name` (q_proj, ..., down_proj), or None if it has none."""
    lora = cfg.lora
    return LoraSpec(lora.rank, lora.alpha / lora.rank) if name in lora.targets else None


def base_model_config(cfg: ModelConfig) -> ModelConfig:
    """`cfg` without adapters: the frozen base's architecture (the warm start trains it; HF loads it)."""
    return dataclasses.replace(cfg, lora=LoraConfig())


def base_config(config: Config) -> Config:
    """`config` with `model.lora` off: what the warm start trains, and what its cache key is made of."""
    return dataclasses.replace(config, model=base_model_config(config.model))


def init_a(key: jax.Array, d_in: int, rank: int, dtype) -> jax.Array:
    """A [in, r], PEFT's default: U(-1/sqrt(in), 1/sqrt(in))."""
    bound = 1.0 / math.sqrt(d_in)
    return jax.random.uniform(key, (d_in, rank), jnp.float32, -bound, bound).astype(dtype)


def delta(x: jax.Array, a: jax.Array, b: jax.Array, scale: float, compute_dtype) -> jax.Array:
    """scale * (x @ A) @ B in `compute_dtype`: the adapter's addition to a projection of `x`, two thin
    matmuls (never the [in, out] product A @ B)."""
    return (x.astype(compute_dtype) @ a.astype(compute_dtype)) @ (b * scale).astype(compute_dtype)


def is_adapter(x: Any) -> bool:
    """Whether a params leaf (an nnx variable) is a LoRA factor."""
    kind = getattr(x, "type", type(x))  # Flax 0.10's VariableState carries its variable's type
    return isinstance(kind, type) and issubclass(kind, Adapter)


def split_adapters(params: nnx.State) -> tuple[nnx.State, nnx.State]:
    """(adapters, base) of a params State (or any State built from it: shardings, abstract params)."""
    adapters, base = split_state(params, Adapter, ...)
    return adapters, base


def join(adapters: nnx.State, base: nnx.State) -> nnx.State:
    """The params State `split_adapters` split."""
    return merge_state(base, adapters)


def _names(path: tuple) -> tuple[str, ...]:
    out = []
    for key in path:
        for attr in ("key", "name", "idx"):
            if hasattr(key, attr):
                out.append(str(getattr(key, attr)))
                break
        else:
            out.append(str(key))
    return tuple(out[:-1] if out and out[-1] == "value" else out)  # a variable's array, by its owner's path


def merge_adapters(params: nnx.State, cfg: ModelConfig) -> nnx.State:
    """The base's params with every adapter folded into its kernel, kernel + (alpha / r) * A @ B
    (in float32, stored in the kernel's dtype): a State of the model without LoRA (use it with
    `transformer.init_params(base_model_config(cfg))`'s graphdef). Pure: jit it or not."""
    adapters, base = split_adapters(params)
    factors = {_names(p): leaf for p, leaf in jax.tree_util.tree_flatten_with_path(adapters)[0]}
    scale = cfg.lora.alpha / cfg.lora.rank

    def one(path, kernel):
        names = _names(path)
        a = factors.get(names[:-1] + ("lora_a",)) if names[-1:] == ("kernel",) else None
        if a is None:
            return kernel
        b = factors[names[:-1] + ("lora_b",)]
        merged = kernel.astype(jnp.float32) + scale * (a.astype(jnp.float32) @ b.astype(jnp.float32))
        return merged.astype(kernel.dtype)

    return jax.tree_util.tree_map_with_path(one, base)


def count_trainable(params: nnx.State) -> int:
    """Scalars that train: the adapters' where there are any, else every parameter's."""
    adapters, _ = split_adapters(params)
    tree = adapters if jax.tree.leaves(adapters) else params
    return int(sum(x.size for x in jax.tree.leaves(tree)))
