"""The policy model: a Llama/Qwen2/Qwen3-family decoder and its pure functional wrappers."""

from jaxreplay.models.transformer import (
    KV_CACHE_AXES,
    KVCache,
    REMAT_POLICIES,
    Transformer,
    abstract_model,
    abstract_params,
    apply,
    count_params,
    dtype_of,
    forward,
    init_cache,
    init_params,
    positions_from_mask,
    score_hidden,
    split,
)

__all__ = [
    "KV_CACHE_AXES",
    "KVCache",
    "REMAT_POLICIES",
    "Transformer",
    "abstract_model",
    "abstract_params",
    "apply",
    "count_params",
    "dtype_of",
    "forward",
    "init_cache",
    "init_params",
    "positions_from_mask",
    "score_hidden",
    "split",
]
