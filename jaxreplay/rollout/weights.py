"""What moves to the actor's devices at a weight update (disaggregated placements).

Without LoRA, every parameter. With LoRA adapters (`jaxreplay.models.lora`) the base is frozen, so
it is placed on the actor's devices once, at the first update, and each later update moves only
the adapters: for a 3B base in bfloat16, megabytes instead of 6 GB per update. The actor then runs
base + adapters, applied on the fly as the learner does (docs/lora.md).
"""

from __future__ import annotations

from typing import Any, Callable

import jax

from jaxreplay.models import lora


def weight_sync(shardings: Any) -> Callable[[Any], Any]:
    """`to_actor(params)`: the learner's params placed by `shardings` (the actor mesh's, from
    `sharding.param_shardings`), the frozen base only the first time."""
    adapter_shardings, base_shardings = lora.split_adapters(shardings)
    placed: dict[str, Any] = {}

    def to_actor(params: Any) -> Any:
        adapters, base = lora.split_adapters(params)
        if not jax.tree.leaves(adapters):
            return jax.device_put(params, shardings)
        if "base" not in placed:  # frozen: the same arrays at every update
            placed["base"] = jax.device_put(base, base_shardings)
        return lora.join(jax.device_put(adapters, adapter_shardings), placed["base"])

    return to_actor
