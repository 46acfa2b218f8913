"""A Llama/Qwen2/Qwen3/Gemma-family decoder in Flax NNX, plus the pure functions jit uses.

One residual stream, `n_layers` pre-norm blocks (RMSNorm -> GQA attention with RoPE
-> RMSNorm -> SwiGLU MLP), a final RMSNorm and an (optionally tied) unembedding.
Parameters are stored in `param_dtype`, cast to `compute_dtype` where used; norms,
RoPE, softmax and the logits are computed in float32.

Gemma 2 and 3 are the same decoder with features switched on (`ModelConfig`): (1 + w)
RMSNorms, embeddings scaled by sqrt(D), a norm on each branch's output too (four per
block), GeGLU, `query_pre_attn_scalar` as the score scale, soft-capped scores and
logits (Gemma 2), QK-norm (Gemma 3), and local layers that attend over a sliding
window, interleaved with global ones (`is_local_layer`), each kind with its own RoPE.

Parameter names are plain so the HF importer maps them one to one; every linear
kernel is [in, out]:

    embed.embedding                          [V, D]
    layers[i].input_norm.scale               [D]
    layers[i].attn.{q,k,v}_proj.kernel       [D, heads * head_dim]   (+ .bias if attention_bias)
    layers[i].attn.{q,k}_norm.scale          [head_dim]              (if qk_norm)
    layers[i].attn.o_proj.kernel             [n_heads * head_dim, D]
    layers[i].post_attn_norm.scale           [D]                     (the MLP input's; with post_norms
                                                                      the attention output's)
    layers[i].{pre,post}_mlp_norm.scale      [D]                     (if post_norms)
    layers[i].mlp.{gate,up}_proj.kernel      [D, d_ff]
    layers[i].mlp.down_proj.kernel           [d_ff, D]
    layers[i].{attn,mlp}.<target>.lora_{a,b} [in, r], [r, out]       (if `model.lora` targets it:
                                                                      jaxreplay/models/lora.py)
    layers[i].mlp.router / .experts.*        (sparse layers of a mixture of experts: jaxreplay/models/moe.py)
    final_norm.scale                         [D]
    lm_head.kernel                           [D, V]                  (if not tie_embeddings)

Masking convention (one rule for full sequences and for the KV cache): tokens live
in *slots* 0..S-1. The query in slot q sees the key in slot s iff `s <= q` and
`key_mask[b, s]`. Without a cache the slots are the T input tokens, so `key_mask`
is [B, T]. With a cache the slots are the cache's `max_len` entries, the T new
tokens are written to slots `cache_index .. cache_index + T - 1`, and `key_mask`
is [B, max_len] (True for every slot holding a real token, the new ones included).
`cache_index` may also be one slot per row ([B] int32): the rollout engine's rows sit at
different lengths in one pool.
Left padding is just `key_mask == False` on the leading slots; RoPE uses the
explicit `positions`, so a left-padded row gets the same logits as an unpadded one.

Every parameter carries its logical axes as metadata (`jaxreplay.compat.param`) ("vocab", "embed",
"heads", "kv_heads", "mlp", "norm"; `KV_CACHE_AXES` for the cache). The model knows
only these names: `jaxreplay.models.sharding` maps them to mesh axes.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
from flax import nnx

from jaxreplay.compat import module_list, param
from jaxreplay.config import ModelConfig
from jaxreplay.models import lora as lora_lib
from jaxreplay.models import moe as moe_lib

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def dtype_of(name: str) -> jnp.dtype:
    """The jnp dtype for a config dtype string."""
    return _DTYPES[name]


# ----------------------------------------------------------------------------------
# KV cache


# Logical axes of each layer's array in KVCache.k and KVCache.v.
KV_CACHE_AXES = ("batch", "kv_heads", "length", "head_dim")


class KVCache(NamedTuple):
    """Keys and values, one [B, n_kv_heads, max_len, head_dim] array per layer.

    One array per layer (not one stacked array) so a decode step updates each in place
    and attention reads it straight after; slots are the second-minor axis, so the
    score and value contractions need no transpose. Keys are stored after RoPE (and
    q/k norm), in the cache's dtype (`compute_dtype` unless the sampler says otherwise);
    attention reads them back in `compute_dtype`. Which slots are valid is not stored
    here: it is the caller's `key_mask` (see the module doc).
    """

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype: Optional[str] = None) -> KVCache:
    """An all-zero cache for `batch` rows of up to `max_len` slots, in `dtype` (None: compute_dtype)."""
    dtype = dtype_of(dtype or cfg.compute_dtype)
    zeros = lambda: jnp.zeros((batch, cfg.n_kv_heads, max_len, cfg.head_dim), dtype)
    return KVCache(k=tuple(zeros() for _ in range(cfg.n_layers)), v=tuple(zeros() for _ in range(cfg.n_layers)))


# ----------------------------------------------------------------------------------
# Building blocks


class Linear(nnx.Module):
    """y = x @ kernel (+ bias), kernel [in, out] with logical axes `axes` = (in, out); with `lora`,
    plus its adapters' scale * (x @ lora_a) @ lora_b (`jaxreplay.models.lora`)."""

    def __init__(self, d_in: int, d_out: int, *, axes: tuple[str, str], bias: bool, param_dtype, compute_dtype,
                 rngs: nnx.Rngs, lora: Optional[lora_lib.LoraSpec] = None):
        init = nnx.initializers.lecun_normal()
        key = rngs.params()
        self.kernel = param(init(key, (d_in, d_out), param_dtype), axes)
        self.bias = param(jnp.zeros((d_out,), param_dtype), axes[1:]) if bias else None
        self.compute_dtype = compute_dtype
        if lora is None:
            self.lora_a = self.lora_b = None
            self.lora_scale = 0.0
        else:
            # from the kernel's key, not the stream: the base's init is the same with adapters or without
            a = lora_lib.init_a(jax.random.fold_in(key, 1), d_in, lora.rank, param_dtype)
            self.lora_a = param(a, (axes[0], lora_lib.RANK_AXIS), lora_lib.Adapter)
            self.lora_b = param(jnp.zeros((lora.rank, d_out), param_dtype), (lora_lib.RANK_AXIS, axes[1]),
                                lora_lib.Adapter)
            self.lora_scale = lora.scale

    def __call__(self, x: jax.Array) -> jax.Array:
        y = x.astype(self.compute_dtype) @ self.kernel[...].astype(self.compute_dtype)
        if self.bias is not None:
            y = y + self.bias[...].astype(self.compute_dtype)
        return y + self.adapted(x) if self.lora_a is not None else y

    def adapted(self, x: jax.Array) -> jax.Array:
        """The adapters' addition to this projection of `x` (applied on the fly: no merged kernel)."""
        return lora_lib.delta(x, self.lora_a[...], self.lora_b[...], self.lora_scale, self.compute_dtype)


def _plus_adapters(y: jax.Array, x: jax.Array, p: Linear) -> jax.Array:
    """A fused projection's slice for `p`, plus `p`'s adapters where it has them."""
    return y if p.lora_a is None else y + p.adapted(x)


def stacked_projection(x: jax.Array, a: Linear, b: Linear) -> tuple[jax.Array, jax.Array]:
    """(a(x), b(x)) for two Linears of the same shape, as one matmul with the kernels stacked
    [in, 2, out]: at batch 64 a decode step is dozens of small matmuls, and each call costs
    more than its FLOPs. Stacking keeps each kernel's `out` axis whole, so a tensor-sharded
    kernel stays sharded the same way. Inside the decode loop the stack is loop-invariant:
    XLA hoists it, so it is built once per sampler call, not once per step."""
    cd = a.compute_dtype
    kernel = jnp.stack([a.kernel[...], b.kernel[...]], axis=1).astype(cd)
    y = jnp.einsum("...d,dko->...ko", x.astype(cd), kernel)
    if a.bias is not None:
        y = y + jnp.stack([a.bias[...], b.bias[...]]).astype(cd)
    return _plus_adapters(y[..., 0, :], x, a), _plus_adapters(y[..., 1, :], x, b)


def grouped_qkv_projection(x: jax.Array, q: Linear, k: Linear, v: Linear,
                           n_kv_heads: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(q(x), k(x), v(x)) as one matmul, for the decode step (see `stacked_projection`): 1.03-1.05x
    tokens/s at batch 16 and 64 on CPU (benchmarks/sampler.py). The kernels are regrouped per kv
    head, [in, kv_heads, (groups + 2) * head_dim]: each kv head's query heads, key and value sit
    together, so kernels sharded over heads stay sharded over kv heads."""
    cd = q.compute_dtype
    per_kv_head = lambda a: a.reshape(*a.shape[:-1], n_kv_heads, a.shape[-1] // n_kv_heads)
    kernel = jnp.concatenate([per_kv_head(p.kernel[...]) for p in (q, k, v)], axis=-1).astype(cd)
    y = jnp.einsum("...d,dkc->...kc", x.astype(cd), kernel)
    if q.bias is not None:
        y = y + jnp.concatenate([per_kv_head(p.bias[...]) for p in (q, k, v)], axis=-1).astype(cd)
    width_q, width_kv = q.kernel.shape[1] // n_kv_heads, k.kernel.shape[1] // n_kv_heads
    flat = lambda a: a.reshape(*a.shape[:-2], -1)
    outs = flat(y[..., :width_q]), flat(y[..., width_q:width_q + width_kv]), flat(y[..., width_q + width_kv:])
    return tuple(_plus_adapters(o, x, p) for o, p in zip(outs, (q, k, v)))


class RMSNorm(nnx.Module):
    """x / rms(x) * scale over the last axis, computed in float32. With `plus_one` (Gemma) the
    factor is (1 + scale) and the scale starts at 0, as HF's checkpoints store it."""

    def __init__(self, dim: int, *, eps: float, param_dtype, plus_one: bool = False):
        self.scale = param((jnp.zeros if plus_one else jnp.ones)((dim,), param_dtype), ("norm",))
        self.eps = eps
        self.plus_one = plus_one

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        scale = self.scale[...].astype(jnp.float32)
        return (y * (1.0 + scale if self.plus_one else scale)).astype(x.dtype)


def norm(cfg: ModelConfig, dim: int) -> RMSNorm:
    """The family's RMSNorm over `dim`."""
    return RMSNorm(dim, eps=cfg.norm_eps, param_dtype=dtype_of(cfg.param_dtype), plus_one=cfg.norm_plus_one)


def is_local_layer(cfg: ModelConfig, i: int) -> bool:
    """Layer `i` attends over a sliding window of `cfg.sliding_window` tokens (Gemma's local layers)."""
    return cfg.sliding_window is not None and (i + 1) % cfg.sliding_window_pattern != 0


def softcap(x: jax.Array, cap: Optional[float]) -> jax.Array:
    """cap * tanh(x / cap) (Gemma 2's logit soft-capping); x itself without a cap."""
    return x if cap is None else jnp.tanh(x / cap) * cap


def rope_frequencies(cfg: ModelConfig, local: bool = False) -> jax.Array:
    """RoPE inverse frequencies [head_dim / 2], float32; `local`: the sliding-window layers',
    from `rope_local_theta` and never scaled (Gemma 3).

    With `rope_scaling_factor` > 1, `rope_scaling_type` "linear" divides every frequency by it;
    "llama3" is Llama 3.1's long-context scaling: wavelengths above
    original_max_len / low_freq_factor are slowed by the factor, those below
    original_max_len / high_freq_factor are kept, and those between are interpolated.
    """
    theta = (cfg.rope_local_theta or cfg.rope_theta) if local else cfg.rope_theta
    inv_freq = 1.0 / theta ** (jnp.arange(cfg.head_dim // 2, dtype=jnp.float32) * 2.0 / cfg.head_dim)
    if local or cfg.rope_scaling_factor == 1.0:
        return inv_freq
    if cfg.rope_scaling_type == "linear":
        return inv_freq / cfg.rope_scaling_factor
    factor, low, high = cfg.rope_scaling_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
    old_len = cfg.rope_original_max_len
    wavelen = 2 * math.pi / inv_freq
    scaled = jnp.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    between = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return jnp.where(between, (1 - smooth) * scaled / factor + smooth * scaled, scaled)


class Rotation(NamedTuple):
    """RoPE's cos and sin for each token, [B, T, 1, head_dim / 2] float32: computed once
    per forward pass and shared by every layer's queries and keys. `local_cos` and `local_sin`
    are the local (sliding-window) layers' (Gemma 3's own base); the same arrays where those
    layers rotate as the global ones do."""

    cos: jax.Array
    sin: jax.Array
    local_cos: jax.Array
    local_sin: jax.Array

    def of_layer(self, local: bool) -> "Rotation":
        """This rotation as a local (`local`) or global layer applies it: its cos and sin first."""
        return Rotation(self.local_cos, self.local_sin, self.local_cos, self.local_sin) if local else self


def _local_rope_differs(cfg: ModelConfig) -> bool:
    return cfg.sliding_window is not None and cfg.sliding_window_pattern > 1 and (
        cfg.rope_local_theta not in (None, cfg.rope_theta) or cfg.rope_scaling_factor != 1.0)


def rotation(positions: jax.Array, cfg: ModelConfig) -> Rotation:
    """The rotation of tokens at `positions` [B, T] (int)."""
    angles = positions.astype(jnp.float32)[..., None, None] * rope_frequencies(cfg)  # [B, T, 1, half]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    if not _local_rope_differs(cfg):
        return Rotation(cos, sin, cos, sin)
    local = positions.astype(jnp.float32)[..., None, None] * rope_frequencies(cfg, local=True)
    return Rotation(cos, sin, jnp.cos(local), jnp.sin(local))


def rope(x: jax.Array, rot: Rotation) -> jax.Array:
    """Rotary embedding of x [B, T, heads, head_dim], HF "rotate_half" layout: pairs are
    (x[i], x[i + head_dim/2])."""
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * rot.cos - x2 * rot.sin, x2 * rot.cos + x1 * rot.sin], axis=-1).astype(x.dtype)


class Attention(nnx.Module):
    """Grouped-query attention: query head h reads kv head h // (n_heads // n_kv_heads).
    A `local` layer's query sees only the `cfg.sliding_window` slots up to its own (Gemma)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, local: bool = False):
        pd, cd = dtype_of(cfg.param_dtype), dtype_of(cfg.compute_dtype)
        d, hd = cfg.d_model, cfg.head_dim
        lin = dict(param_dtype=pd, compute_dtype=cd, rngs=rngs)
        ad = lambda name: dict(lora=lora_lib.spec_for(cfg, name))
        self.q_proj = Linear(d, cfg.n_heads * hd, axes=("embed", "heads"), bias=cfg.attention_bias, **lin,
                             **ad("q_proj"))
        self.k_proj = Linear(d, cfg.n_kv_heads * hd, axes=("embed", "kv_heads"), bias=cfg.attention_bias, **lin,
                             **ad("k_proj"))
        self.v_proj = Linear(d, cfg.n_kv_heads * hd, axes=("embed", "kv_heads"), bias=cfg.attention_bias, **lin,
                             **ad("v_proj"))
        self.o_proj = Linear(cfg.n_heads * hd, d, axes=("heads", "embed"), bias=False, **lin, **ad("o_proj"))
        if cfg.qk_norm:
            self.q_norm, self.k_norm = norm(cfg, hd), norm(cfg, hd)
        else:
            self.q_norm = self.k_norm = None
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, hd
        self.local = local
        self.window = cfg.sliding_window if local else None
        self.score_dim = cfg.query_pre_attn_scalar or hd  # scores are divided by its square root
        self.logit_cap = cfg.attn_logit_softcap

    def __call__(self, x, rot: Rotation, key_mask, kv=None, cache_index=None):
        """x [B, T, D] -> ([B, T, D], this layer's updated (k, v) cache, or None without one).

        With a cache `kv` (this layer's two [B, kv_heads, max_len, head_dim] arrays), the
        T new keys and values are first written to slots cache_index .. cache_index + T - 1,
        then the queries attend over the cache: in a decode loop the write happens in place
        and nothing reads the cache as it was before it.
        """
        b, t, _ = x.shape
        if kv is None:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        else:  # decoding: one matmul for queries, keys and values
            q, k, v = grouped_qkv_projection(x, self.q_proj, self.k_proj, self.v_proj, self.n_kv_heads)
        q = q.reshape(b, t, self.n_heads, self.head_dim)
        k = k.reshape(b, t, self.n_kv_heads, self.head_dim)
        v = v.reshape(b, t, self.n_kv_heads, self.head_dim)
        if self.q_norm is not None:  # Qwen3, Gemma 3: per-head RMSNorm before RoPE
            q, k = self.q_norm(q), self.k_norm(k)
        rot = rot.of_layer(self.local)
        q, k = rope(q, rot), rope(k, rot)
        k, v = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)  # [B, kv_heads, T, head_dim]

        if kv is None:  # whole sequences: the keys are the T tokens themselves, slots 0..T-1
            keys, values, first = k, v, 0
        elif jnp.ndim(cache_index) == 1:  # one slot per row (the rollout engine's pool)
            write = jax.vmap(lambda buf, new, i: jax.lax.dynamic_update_slice(buf, new.astype(buf.dtype), (0, i, 0)))
            kv = keys, values = write(kv[0], k, cache_index), write(kv[1], v, cache_index)
            first = cache_index[:, None, None]  # [B, 1, 1]
        else:
            write = lambda buf, new: jax.lax.dynamic_update_slice(buf, new.astype(buf.dtype), (0, 0, cache_index, 0))
            kv = keys, values = write(kv[0], k), write(kv[1], v)
            first = cache_index
            if isinstance(cache_index, int):  # a static index: no slot past the new tokens is needed
                keys, values = keys[:, :, :cache_index + t], values[:, :, :cache_index + t]
        # Query j sits in slot first + j and sees slot s iff s <= first + j and key_mask[:, s];
        # in a local layer also first + j - s < window. A row's real tokens sit in consecutive
        # slots, so slot distance is token distance. The cache keeps every slot (masked, not a ring).
        n_keys = keys.shape[2]
        slot, query_slot = jnp.arange(n_keys)[None, :], first + jnp.arange(t)[:, None]
        causal = slot <= query_slot  # [T, S], or [B, T, S] per row
        if self.window is not None:
            causal = causal & (slot > query_slot - self.window)
        visible = (causal if causal.ndim == 3 else causal[None]) & key_mask[:, None, :n_keys]  # [B, T, S]

        # Query rows (token j, group g) of each kv head: [B, kv_heads, T * groups, head_dim].
        groups = self.n_heads // self.n_kv_heads
        q = jnp.swapaxes(q.reshape(b, t, self.n_kv_heads, groups, self.head_dim), 1, 2)
        q = q.reshape(b, self.n_kv_heads, t * groups, self.head_dim)
        keys, values = keys.astype(q.dtype), values.astype(q.dtype)
        # A batched dot also for one query token: as a multiply-reduce over head_dim instead,
        # a batch-64 decode step on CPU was 1.1x (jax 0.12) to 1.3x (jax 0.4.34) slower.
        scores = jnp.einsum("bkqh,bksh->bkqs", q, keys, preferred_element_type=jnp.float32)
        # A finite floor, not -inf, so a query with no visible key (a pad slot) gives a
        # harmless uniform average instead of NaN.
        visible = jnp.repeat(visible, groups, axis=1)[:, None]  # [B, 1, T * groups, S]
        scores = softcap(scores / math.sqrt(self.score_dim), self.logit_cap)
        scores = jnp.where(visible, scores, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
        out = jnp.einsum("bkqs,bksh->bkqh", probs, values).reshape(b, self.n_kv_heads, t, groups, self.head_dim)
        return self.o_proj(jnp.swapaxes(out, 1, 2).reshape(b, t, -1)), kv


# The MLP's gate activation (`model.mlp_activation`): SwiGLU's, and GeGLU's tanh-approximated GELU
# (HF's gelu_pytorch_tanh).
ACTIVATIONS = {"silu": jax.nn.silu, "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True)}


class MLP(nnx.Module):
    """Gated: down(act(gate(x)) * up(x)); SwiGLU with silu, GeGLU with gelu_tanh."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        lin = dict(bias=False, param_dtype=dtype_of(cfg.param_dtype), compute_dtype=dtype_of(cfg.compute_dtype),
                   rngs=rngs)
        ad = lambda name: dict(lora=lora_lib.spec_for(cfg, name))
        self.gate_proj = Linear(cfg.d_model, cfg.d_ff, axes=("embed", "mlp"), **lin, **ad("gate_proj"))
        self.up_proj = Linear(cfg.d_model, cfg.d_ff, axes=("embed", "mlp"), **lin, **ad("up_proj"))
        self.down_proj = Linear(cfg.d_ff, cfg.d_model, axes=("mlp", "embed"), **lin, **ad("down_proj"))
        self.activation = cfg.mlp_activation

    def __call__(self, x: jax.Array, stacked: bool = False) -> jax.Array:
        """`stacked`: gate and up in one matmul (the decode loop; see `stacked_projection`)."""
        gate, up = stacked_projection(x, self.gate_proj, self.up_proj) if stacked else (self.gate_proj(x),
                                                                                          self.up_proj(x))
        return self.down_proj(ACTIVATIONS[self.activation](gate) * up)


class Block(nnx.Module):
    """Pre-norm residual block: x + attn(norm(x)), then + mlp(norm(.)). With `post_norms`
    (Gemma) each branch's output is normed too: x + norm(attn(norm(x))), then
    + norm(mlp(norm(.))); `post_attn_norm` is then the attention output's norm (HF's
    post_attention_layernorm in both), `pre_mlp_norm` the MLP input's. The MLP is a mixture of
    experts in the layers `moe.is_sparse` names (Qwen3-MoE)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, local: bool = False, sparse: bool = False):
        self.input_norm = norm(cfg, cfg.d_model)
        self.attn = Attention(cfg, rngs=rngs, local=local)
        self.post_attn_norm = norm(cfg, cfg.d_model)
        pd, cd = dtype_of(cfg.param_dtype), dtype_of(cfg.compute_dtype)
        self.mlp = moe_lib.MoE(cfg, param_dtype=pd, compute_dtype=cd, rngs=rngs) if sparse else MLP(cfg, rngs=rngs)
        if cfg.post_norms:
            self.pre_mlp_norm, self.post_mlp_norm = norm(cfg, cfg.d_model), norm(cfg, cfg.d_model)
        else:
            self.pre_mlp_norm = self.post_mlp_norm = None

    def __call__(self, x, rot: Rotation, key_mask, kv=None, cache_index=None, routes=None):
        """(x, kv, this layer's `moe.Routing` or None for a dense MLP); `routes`: see `moe.MoE`."""
        stacked = kv is not None  # the sampler: fewer, larger matmuls per decode step
        h, kv = self.attn(self.input_norm(x), rot, key_mask, kv, cache_index)
        if self.pre_mlp_norm is not None:  # Gemma's four norms
            x = x + self.post_attn_norm(h)
            out, routing = self._mlp(self.pre_mlp_norm(x), stacked, routes)
            return x + self.post_mlp_norm(out), kv, routing
        x = x + h
        out, routing = self._mlp(self.post_attn_norm(x), stacked, routes)
        return x + out, kv, routing

    def _mlp(self, x, stacked: bool, routes):
        if isinstance(self.mlp, moe_lib.MoE):
            return self.mlp(x, routes)
        return self.mlp(x, stacked), None


class Embed(nnx.Module):
    """Token embedding table [V, D]; `attend` is the tied unembedding. With `scaled` (Gemma) the
    embeddings are multiplied by sqrt(D), rounded to the compute dtype as HF rounds it."""

    def __init__(self, vocab: int, dim: int, *, param_dtype, compute_dtype, rngs: nnx.Rngs, scaled: bool = False):
        init = nnx.initializers.normal(stddev=0.02)
        self.embedding = param(init(rngs.params(), (vocab, dim), param_dtype), ("vocab", "embed"))
        self.compute_dtype = compute_dtype
        self.multiplier = math.sqrt(dim) if scaled else None

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = jnp.take(self.embedding[...], tokens, axis=0).astype(self.compute_dtype)
        return x if self.multiplier is None else x * jnp.asarray(self.multiplier, self.compute_dtype)

    def attend(self, x: jax.Array) -> jax.Array:
        table = self.embedding[...].astype(self.compute_dtype)
        return jnp.einsum("btd,vd->btv", x, table, preferred_element_type=jnp.float32)


class Transformer(nnx.Module):
    """The decoder. See the module docstring for parameter names and the mask rule."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        if cfg.n_heads % cfg.n_kv_heads:
            raise ValueError(f"n_kv_heads={cfg.n_kv_heads} must divide n_heads={cfg.n_heads}")
        if cfg.head_dim % 2:
            raise ValueError(f"head_dim={cfg.head_dim} must be even for RoPE")
        pd, cd = dtype_of(cfg.param_dtype), dtype_of(cfg.compute_dtype)
        self.cfg = cfg
        self.embed = Embed(cfg.vocab_size, cfg.d_model, param_dtype=pd, compute_dtype=cd, rngs=rngs,
                           scaled=cfg.scale_embeddings)
        self.layers = module_list([Block(cfg, rngs=rngs, local=is_local_layer(cfg, i), sparse=moe_lib.is_sparse(cfg, i))
                                   for i in range(cfg.n_layers)])
        self.final_norm = norm(cfg, cfg.d_model)
        self.lm_head = None if cfg.tie_embeddings else Linear(
            cfg.d_model, cfg.vocab_size, axes=("embed", "vocab"), bias=False, param_dtype=pd, compute_dtype=cd,
            rngs=rngs)

    def __call__(self, tokens, positions, key_mask, cache: Optional[KVCache] = None, cache_index=None):
        """tokens, positions [B, T] int32; key_mask bool ([B, T], or [B, max_len] with a cache).

        Returns (logits [B, T, V] float32, the updated cache or None). With a cache,
        `cache_index` (an int or traced int32 scalar, or int32 [B]: one per row) is the slot
        of tokens[:, 0].
        """
        h, cache = self.hidden(tokens, positions, key_mask, cache, cache_index)
        return self.unembed(h), cache

    def hidden(self, tokens, positions, key_mask, cache: Optional[KVCache] = None, cache_index=None):
        """The final-normed residual stream [B, T, D]; split from `unembed` so callers
        that need only some positions' logits (prefill) skip the [B, T, V] product.

        `positions` may also be their `Rotation`: a decode loop computes every step's
        before the loop, which keeps cos and sin out of the loop body.
        """
        h, cache, _ = self.routed_hidden(tokens, positions, key_mask, cache, cache_index)
        return h, cache

    def routed_hidden(self, tokens, positions, key_mask, cache: Optional[KVCache] = None, cache_index=None,
                      routes=None):
        """`hidden`, and the sparse layers' `moe.Routing` stacked [L_sparse, ...] (None for a dense model).
        `routes` [L_sparse, B, T, k]: the sparse layers route as these say (routing replay)."""
        if cache is not None and cache_index is None:
            raise ValueError("a cache needs cache_index: the slot the first new token is written to")
        x = self.embed(tokens)
        rot = positions if isinstance(positions, Rotation) else rotation(positions, self.cfg)
        ks, vs, routings = [], [], []
        for i, layer in enumerate(self.layers):
            layer_routes = None if routes is None or not isinstance(layer.mlp, moe_lib.MoE) else routes[len(routings)]
            x, kv, routing = layer(x, rot, key_mask, None if cache is None else (cache.k[i], cache.v[i]), cache_index,
                                   layer_routes)
            if kv is not None:
                ks.append(kv[0])
                vs.append(kv[1])
            if routing is not None:
                routings.append(routing)
        return (self.final_norm(x), None if cache is None else KVCache(tuple(ks), tuple(vs)),
                _stacked(routings))

    def score_hidden(self, tokens, positions, key_mask, remat: str = "none", routes=None):
        """(`hidden` of whole sequences (no cache), the stacked `moe.Routing` or None), each block
        rematerialised by `REMAT_POLICIES[remat]`."""
        policy = REMAT_POLICIES[remat]
        if policy is None:
            h, _, routing = self.routed_hidden(tokens, positions, key_mask, routes=routes)
            return h, routing
        x = self.embed(tokens)
        rot = rotation(positions, self.cfg)
        routings = []
        for layer in self.layers:
            sparse = isinstance(layer.mlp, moe_lib.MoE)
            layer_routes = routes[len(routings)] if sparse and routes is not None else None
            x, routing = _rematerialised(layer, policy, x, rot, key_mask, layer_routes)
            if routing is not None:
                routings.append(routing)
        return self.final_norm(x), _stacked(routings)

    def unembed(self, h: jax.Array) -> jax.Array:
        """[B, T, D] -> float32 logits [B, T, V] (soft-capped where `final_logit_softcap` says)."""
        if self.lm_head is None:
            return softcap(self.embed.attend(h), self.cfg.final_logit_softcap)
        kernel = self.lm_head.kernel[...].astype(h.dtype)
        return softcap(jnp.einsum("btd,dv->btv", h, kernel, preferred_element_type=jnp.float32),
                       self.cfg.final_logit_softcap)


# What each decoder block keeps for the backward pass (`Transformer.score_hidden`):
# "none" keeps every activation; "full" keeps only the block's input and recomputes
# the rest; "dots" also keeps its matmul outputs without batch dimensions (the q/k/v/o
# and MLP projections), recomputing norms, RoPE, softmax and the attention products.
REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def _stacked(routings: list) -> Optional[moe_lib.Routing]:
    """The sparse layers' routings as one `moe.Routing` [L_sparse, ...], or None without any."""
    return jax.tree.map(lambda *xs: jnp.stack(xs), *routings) if routings else None


def _rematerialised(layer: Block, policy, x, rot: Rotation, key_mask, routes=None):
    """(`layer(x)`, its routing) under `jax.checkpoint(policy)`: its params enter as arguments, so
    their gradients flow, and the backward pass recomputes what `policy` does not save."""
    graphdef, state = nnx.split(layer)

    def run(state, x, rot, key_mask, routes):
        out, _, routing = nnx.merge(graphdef, state)(x, rot, key_mask, None, None, routes)
        return out, routing

    return jax.checkpoint(run, policy=policy)(state, x, rot, key_mask, routes)


# ----------------------------------------------------------------------------------
# Pure functions over (graphdef, params): what jitted code calls.


def split(model: Transformer) -> tuple[nnx.GraphDef, nnx.State]:
    """(graphdef, params): static structure and an nnx.State of every nnx.Param.

    Raises if the model holds any non-Param state, so params are the whole model.
    """
    graphdef, params = nnx.split(model, nnx.Param)
    return graphdef, params


def init_params(cfg: ModelConfig, seed: int) -> tuple[nnx.GraphDef, nnx.State]:
    """A freshly initialised model, split. The same seed gives the same params."""
    return split(Transformer(cfg, rngs=nnx.Rngs(params=seed)))


def with_adapters(cfg: ModelConfig, base_params: nnx.State, seed: int) -> tuple[nnx.GraphDef, nnx.State]:
    """(graphdef, params) of the model `cfg` describes, its base `base_params` (of the model without
    adapters: a warm start's, an HF checkpoint's) and, if `model.lora` targets any module, fresh adapters
    (`lora`'s init, from `seed`): step 0 is the base. Only the adapters are computed; the base is not
    copied. Without LoRA, the base model itself."""
    graphdef, abstract = abstract_model(cfg)
    if not lora_lib.enabled(cfg):
        return graphdef, base_params
    fresh = jax.jit(lambda: lora_lib.split_adapters(init_params(cfg, seed)[1])[0])()  # the base's init is dead code
    return graphdef, lora_lib.join(fresh, base_params)


def abstract_model(cfg: ModelConfig) -> tuple[nnx.GraphDef, nnx.State]:
    """(graphdef, params) with the params' structure, shapes, dtypes and logical axes, nothing allocated."""
    return split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(params=0))))


def abstract_params(cfg: ModelConfig) -> nnx.State:
    """The params' structure, shapes, dtypes and logical axes, without allocating them."""
    return abstract_model(cfg)[1]


def positions_from_mask(mask: jax.Array) -> jax.Array:
    """RoPE positions for a left-padded row: 0 at the first real token; pads get 0."""
    return jnp.maximum(jnp.cumsum(mask.astype(jnp.int32), axis=-1) - 1, 0)


def apply(graphdef, params, tokens, positions, key_mask, cache=None, cache_index=None):
    """Functional `Transformer.__call__`: (logits f32, new cache or None)."""
    return nnx.merge(graphdef, params)(tokens, positions, key_mask, cache, cache_index)


def forward(graphdef, params, tokens: jax.Array, attention_mask: jax.Array) -> jax.Array:
    """Scores whole sequences: logits [B, T, V] float32, logits[:, t] predicting tokens[:, t+1].

    `attention_mask` [B, T] bool marks real tokens (False on left padding and on pad
    after EOS); positions are its cumsum, so padding changes no real logit.
    """
    attention_mask = attention_mask.astype(bool)
    logits, _ = apply(graphdef, params, tokens, positions_from_mask(attention_mask), attention_mask)
    return logits


def score_hidden(graphdef, params, tokens: jax.Array, attention_mask: jax.Array, *, remat: str = "none"):
    """(final hidden states [B, T, D], the model's `unembed`) of whole sequences, as `forward`
    without the [B, T, V] product: the caller unembeds as many positions at a time as it likes."""
    h, unembed, _ = routed_score_hidden(graphdef, params, tokens, attention_mask, remat=remat)
    return h, unembed


def routed_score_hidden(graphdef, params, tokens: jax.Array, attention_mask: jax.Array, *, remat: str = "none",
                        routes=None):
    """`score_hidden`, and the sparse layers' stacked `moe.Routing` (None for a dense model);
    `routes` [L_sparse, B, T, k] replays a sampler's expert choices."""
    attention_mask = attention_mask.astype(bool)
    model = nnx.merge(graphdef, params)
    h, routing = model.score_hidden(tokens, positions_from_mask(attention_mask), attention_mask, remat, routes)
    return h, model.unembed, routing


def count_params(params) -> int:
    """Total number of scalars in a params pytree."""
    return int(sum(x.size for x in jax.tree.leaves(params)))
