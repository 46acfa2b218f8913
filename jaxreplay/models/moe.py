"""The mixture-of-experts MLP of Qwen3-MoE: a softmax router, top-k experts per token, dropless dispatch.

A sparse layer's MLP (which layers: `is_sparse`) holds `n_experts` SwiGLU experts of width `moe_d_ff`
and a router, a linear map to one logit per expert:

    mlp.router.kernel          [D, E]        logical axes ("embed", "router")
    mlp.experts.gate_proj      [E, D, F]     ("experts", "embed", "mlp")
    mlp.experts.up_proj        [E, D, F]
    mlp.experts.down_proj      [E, F, D]     ("experts", "mlp", "embed")

Each token goes to the `experts_per_token` experts of highest router probability (softmax in
float32); its output is their outputs weighted by those probabilities, renormalised to sum to 1 with
`moe_norm_topk` (HF's `norm_topk_prob`). `jaxreplay.models.sharding` splits the "experts" axis over
a mesh axis (expert parallelism).

Dispatch is dropless: no capacity factor, so no token is ever dropped or sent to another expert. With
`moe_dispatch: ragged_dot` (the default) the N tokens' N * k (token, expert) pairs are sorted by expert
and each expert's contiguous run goes through it with `jax.lax.ragged_dot` (a grouped matmul with one
group per expert; on jax 0.4.34 too, with its gradient); the outputs are weighted and summed back per
token. Compute scales with tokens * k, not E: the choice for a model of many experts (Qwen3-30B-A3B:
128, top 8), whose every-expert intermediates [E, N, F] would not fit. `dense` runs every expert on
every token and weights the unchosen by 0: E / k times the FLOPs, yet faster on CPU at demo sizes,
where XLA's ragged_dot is slow (measured: benchmarks/moe.py, docs/hf.md).

Routing replay: given the experts a sampler chose (`routes`, [..., k] int; -1 for a token it did not
run), the layer sends each token to those experts instead of its own top k; the weights are still the
router's probabilities of those experts (renormalised the same way), so the router keeps its gradient.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
from flax import nnx

from jaxreplay.compat import param
from jaxreplay.config import ModelConfig


def is_sparse(cfg: ModelConfig, layer: int) -> bool:
    """Whether layer `layer` has the experts (HF's rule: not in `mlp_only_layers`, and (i + 1) a multiple
    of `decoder_sparse_step`)."""
    return cfg.n_experts > 0 and layer not in cfg.moe_dense_layers and (layer + 1) % cfg.moe_sparse_step == 0


def sparse_layers(cfg: ModelConfig) -> tuple[int, ...]:
    """The indices of the sparse layers, in order: the layer axis of a row's routes."""
    return tuple(i for i in range(cfg.n_layers) if is_sparse(cfg, i))


class Routing(NamedTuple):
    """One sparse layer's routing of its tokens [..., ]: the router's float32 logits [..., E] and the k
    experts each token went to [..., k] int32 (the router's top k, or the replayed routes)."""

    logits: jax.Array
    experts: jax.Array


class Experts(nnx.Module):
    """E SwiGLU experts, stored stacked: kernels [E, in, out]."""

    def __init__(self, cfg: ModelConfig, *, param_dtype, compute_dtype, rngs: nnx.Rngs):
        e, d, f = cfg.n_experts, cfg.d_model, cfg.moe_d_ff
        init = nnx.initializers.lecun_normal(in_axis=-2, out_axis=-1, batch_axis=(0,))
        self.gate_proj = param(init(rngs.params(), (e, d, f), param_dtype), ("experts", "embed", "mlp"))
        self.up_proj = param(init(rngs.params(), (e, d, f), param_dtype), ("experts", "embed", "mlp"))
        self.down_proj = param(init(rngs.params(), (e, f, d), param_dtype), ("experts", "mlp", "embed"))
        self.compute_dtype = compute_dtype
        self.dispatch = cfg.moe_dispatch

    def __call__(self, x: jax.Array, experts: jax.Array, weights: jax.Array) -> jax.Array:
        """x [N, D], experts and weights [N, k] -> sum_j weights[:, j] * expert_{experts[:, j]}(x) [N, D]."""
        n, k = experts.shape
        n_experts = self.gate_proj.shape[0]
        cd = self.compute_dtype
        if self.dispatch == "dense":  # every expert on every token, the unchosen weighted by 0
            combine = jnp.zeros((n, n_experts), cd).at[jnp.arange(n)[:, None], experts].add(weights.astype(cd))
            xc = x.astype(cd)
            gate = jnp.einsum("nd,edf->enf", xc, self.gate_proj[...].astype(cd))
            up = jnp.einsum("nd,edf->enf", xc, self.up_proj[...].astype(cd))
            out = jnp.einsum("enf,efd->end", jax.nn.silu(gate) * up, self.down_proj[...].astype(cd))
            return jnp.einsum("end,ne->nd", out, combine)
        flat = experts.reshape(-1)
        order = jnp.argsort(flat, stable=True)  # the N * k pairs, grouped by expert
        token = order // k
        sizes = jnp.bincount(flat, length=n_experts).astype(jnp.int32)
        xs = x.astype(cd)[token]
        gate = jax.lax.ragged_dot(xs, self.gate_proj[...].astype(cd), sizes)
        up = jax.lax.ragged_dot(xs, self.up_proj[...].astype(cd), sizes)
        out = jax.lax.ragged_dot(jax.nn.silu(gate) * up, self.down_proj[...].astype(cd), sizes)
        out = out * weights.reshape(-1)[order][:, None].astype(cd)
        return jnp.zeros((n, out.shape[-1]), cd).at[token].add(out)


class Router(nnx.Module):
    """The linear map to one logit per expert: kernel [D, E], no bias; logits in float32."""

    def __init__(self, d_model: int, n_experts: int, *, param_dtype, compute_dtype, rngs: nnx.Rngs):
        init = nnx.initializers.lecun_normal()
        self.kernel = param(init(rngs.params(), (d_model, n_experts), param_dtype), ("embed", "router"))
        self.compute_dtype = compute_dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        cd = self.compute_dtype
        return (x.astype(cd) @ self.kernel[...].astype(cd)).astype(jnp.float32)


class MoE(nnx.Module):
    """The sparse layer's MLP; see the module docstring."""

    def __init__(self, cfg: ModelConfig, *, param_dtype, compute_dtype, rngs: nnx.Rngs):
        self.router = Router(cfg.d_model, cfg.n_experts, param_dtype=param_dtype, compute_dtype=compute_dtype,
                             rngs=rngs)
        self.experts = Experts(cfg, param_dtype=param_dtype, compute_dtype=compute_dtype, rngs=rngs)
        self.top_k, self.norm_topk = cfg.experts_per_token, cfg.moe_norm_topk

    def __call__(self, x: jax.Array, routes: Optional[jax.Array] = None) -> tuple[jax.Array, Routing]:
        """x [..., D] -> (output [..., D], this call's Routing). `routes` [..., k]: route as these say
        (a token whose routes are -1: by the router)."""
        lead, d = x.shape[:-1], x.shape[-1]
        flat = x.reshape(-1, d)
        logits = self.router(flat)  # [N, E] float32
        probs = jax.nn.softmax(logits, axis=-1)
        _, experts = jax.lax.top_k(probs, self.top_k)
        if routes is not None:  # a token the sampler ran no route for (-1) keeps the router's own choice
            given = routes.reshape(-1, self.top_k).astype(jnp.int32)
            experts = jnp.where(given[:, :1] >= 0, given, experts)
        weights = jnp.take_along_axis(probs, experts, axis=-1)
        if self.norm_topk:
            weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
        out = self.experts(flat, experts, weights).astype(x.dtype)
        return out.reshape(*lead, d), Routing(logits.reshape(*lead, -1), experts.reshape(*lead, self.top_k))


def load_balancing_loss(logits: jax.Array, mask: jax.Array, top_k: int) -> jax.Array:
    """HF's `load_balancing_loss_func` (Switch Transformer's, eqs. 4-6): E * sum_e f_e * P_e, where f_e
    is the number of top-k assignments to expert e per token and P_e the mean router probability of e,
    both over every sparse layer's real tokens together. `logits` [L, B, T, E] float32, `mask` [B, T]."""
    n_experts = logits.shape[-1]
    probs = jax.nn.softmax(logits, axis=-1)
    _, chosen = jax.lax.top_k(probs, top_k)
    weight = jnp.broadcast_to(mask.astype(jnp.float32), logits.shape[:-1])  # [L, B, T]
    rows = jnp.maximum(jnp.sum(weight), 1.0)
    counts = jnp.sum(jax.nn.one_hot(chosen, n_experts, dtype=jnp.float32) * weight[..., None, None],
                     axis=tuple(range(chosen.ndim)))
    mean_probs = jnp.sum(probs * weight[..., None], axis=tuple(range(probs.ndim - 1)))
    return n_experts * jnp.sum(counts / rows * mean_probs / rows)


def route_disagreement(experts: jax.Array, recorded: jax.Array, mask: jax.Array) -> jax.Array:
    """Share of the real (token, sparse layer) pairs of `mask` [B, T] whose set of k experts in `experts`
    differs from the one in `recorded` (both [L, B, T, k]): 0 when the two route alike."""
    found = jnp.any(experts[..., :, None] == recorded[..., None, :], axis=-1)  # [L, B, T, k]
    differs = 1.0 - jnp.all(found, axis=-1).astype(jnp.float32)  # [L, B, T]
    weight = jnp.broadcast_to(mask.astype(jnp.float32), differs.shape)
    return jnp.sum(differs * weight) / jnp.maximum(jnp.sum(weight), 1.0)
