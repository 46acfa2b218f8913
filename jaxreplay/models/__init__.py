"""The policy model: a Llama/Qwen2/Qwen3-family decoder and its pure functional wrappers."""

from jaxreplay.models.transformer import (
    KV_CACHE_AXES,
    KVCache,
    Transformer,
    abstract_params,
    apply,
    count_params,
    dtype_of,
    forward,
    init_cache,
    init_params,
    positions_from_mask,
    split,
)

__all__ = [
    "KV_CACHE_AXES",
    "KVCache",
    "Transformer",
    "abstract_params",
    "apply",
    "count_params",
    "dtype_of",
    "forward",
    "init_cache",
    "init_params",
    "positions_from_mask",
    "split",
]
