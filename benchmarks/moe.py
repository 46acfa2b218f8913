"""A mixture-of-experts MLP's tokens/s (forward and backward, jitted, CPU) against two baselines.

- dispatch: the MoE layer's two dropless dispatches (models/moe.py, `model.moe_dispatch`): ragged_dot
  against computing every expert on every token and masking (`dense`: E / k times the FLOPs, no sort);
- active parameters: the MoE layer against a dense SwiGLU MLP of the same *active* width (k * moe_d_ff),
  what a token's compute would cost without routing.

Each is timed alternately with the others, so load hits all alike; three repeats, median ratios,
printed with the load average. `python -m benchmarks.moe`."""

from __future__ import annotations

import dataclasses
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxreplay.config import ModelConfig
from jaxreplay.models import moe
from jaxreplay.models.transformer import MLP

CFG = ModelConfig(vocab_size=64, d_model=256, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=64, d_ff=512,
                  max_seq_len=512, n_experts=16, experts_per_token=2, moe_d_ff=256)


def _timed(fn, state, x) -> float:
    t0 = time.perf_counter()
    jax.block_until_ready(fn(state, x))
    return time.perf_counter() - t0


def run(tokens: int = 2048, steps: int = 10, repeats: int = 3, n_experts: int = CFG.n_experts,
        top_k: int = CFG.experts_per_token, moe_d_ff: int = CFG.moe_d_ff) -> dict:
    cfg = dataclasses.replace(CFG, n_experts=n_experts, experts_per_token=top_k, moe_d_ff=moe_d_ff)
    x = jnp.asarray(np.random.default_rng(0).normal(size=(tokens // 256, 256, CFG.d_model)), jnp.float32)
    f32 = dict(param_dtype=jnp.float32, compute_dtype=jnp.float32)
    variants = {
        "ragged_dot": (moe.MoE(cfg, **f32, rngs=nnx.Rngs(params=0)), lambda m, x: m(x)[0]),
        "dense_einsum": (moe.MoE(dataclasses.replace(cfg, moe_dispatch="dense"), **f32, rngs=nnx.Rngs(params=0)),
                         lambda m, x: m(x)[0]),
        "dense_active_mlp": (MLP(dataclasses.replace(cfg, d_ff=top_k * moe_d_ff), rngs=nnx.Rngs(params=0)),
                             lambda m, x: m(x)),
    }
    fns = {}
    for name, (module, call) in variants.items():
        graphdef, state = nnx.split(module)
        loss = lambda s, x, g=graphdef, c=call: jnp.sum(c(nnx.merge(g, s), x) ** 2)
        fns[name] = (jax.jit(jax.value_and_grad(loss)), state)
        _timed(fns[name][0], state, x)  # compile
    medians = []
    for _ in range(repeats):
        times = {name: [] for name in fns}
        for _ in range(steps):
            for name, (fn, state) in fns.items():
                times[name].append(_timed(fn, state, x))
        medians.append({name: float(np.median(t)) for name, t in times.items()})
    tokens_per_s = {name: tokens / float(np.median([m[name] for m in medians])) for name in fns}
    ratio = lambda a, b: float(np.median([m[b] / m[a] for m in medians]))  # a's speed over b's
    return {"tokens_per_s": tokens_per_s, "ragged_dot_over_dense_einsum": ratio("ragged_dot", "dense_einsum"),
            "moe_over_dense_active": ratio("ragged_dot", "dense_active_mlp"),
            "shape": f"{tokens} tokens, D {cfg.d_model}, E {n_experts}, k {top_k}, F {moe_d_ff}; forward + backward",
            "load_avg": os.getloadavg()}


if __name__ == "__main__":
    print(run())
    print(run(n_experts=64, top_k=4, moe_d_ff=64))  # Qwen3-30B-A3B's ratios, scaled down: many narrow experts
