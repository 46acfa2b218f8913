"""What trains: the trainable/frozen split of the params (the learn stage's part of LoRA).

A model with LoRA adapters (`jaxreplay.models.lora`) trains only its `Adapter` variables; the base
is frozen: no gradient is computed for it, the optimizer keeps no state for it, and the train step
hands it back untouched (the same buffers: it is donated and aliased, never copied). A model
without adapters trains every parameter, as before. The split is read from the params themselves,
so every caller of the optimizer and the train step gets it without being told.
"""

from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxreplay.models import lora


def split(params: Any) -> tuple[Any, Optional[Any]]:
    """(trainable, frozen): (adapters, base) where `params` holds adapters, else (params, None)."""
    if not isinstance(params, nnx.State):
        return params, None
    adapters, base = lora.split_adapters(params)
    if not jax.tree.leaves(adapters):
        return params, None
    return adapters, base


def join(trainable: Any, frozen: Optional[Any]) -> Any:
    """The params `split` split."""
    return trainable if frozen is None else lora.join(trainable, frozen)


def trainable_only(optimizer: optax.GradientTransformation) -> optax.GradientTransformation:
    """`optimizer` over the trainable part alone: `init(params)` keeps state for the adapters only
    (Adam's two moments of a 3B base would be 24 GB); `update` takes gradients and params of the
    trainable part (full params are cut down to it)."""

    def init(params):
        return optimizer.init(split(params)[0])

    def update(grads, state, params=None):
        return optimizer.update(grads, state, None if params is None else split(params)[0])

    return optax.GradientTransformation(init, update)


def kl_reference(params: Any, ref_params: Any) -> Any:
    """The KL reference: with adapters, the base with them off (B zeroed: no second copy of the base);
    else `ref_params`, the copy taken at the start."""
    trainable, frozen = split(params)
    if frozen is None:
        return ref_params
    return join(jax.tree.map(jnp.zeros_like, trainable), frozen)


def initial_reference(params: Any, kl_coef: float) -> Optional[Any]:
    """What the run keeps as the KL reference: a copy of the initial params, when a loss uses one
    and the params have no adapters (with adapters the base is the reference: `kl_reference`)."""
    if kl_coef <= 0 or split(params)[1] is not None:
        return None
    return jax.tree.map(jnp.copy, params)
