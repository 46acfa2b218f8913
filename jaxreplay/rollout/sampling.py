"""Rollouts: one jitted prefill + `lax.while_loop` decode over a KV cache that grows in phases.

`make_sampler` closes over the model structure and the sampling settings and returns
one jitted function of (params, prompts, mask, rng); new params, prompts or keys of
the same shapes reuse the compiled program. Prompts are LEFT-padded, so every row's
next token is written to the same cache slot and the cache index is a scalar.

`token_logprobs` / `token_entropy` are the learner's side of the same contract: entry
t scores tokens[t] under the distribution computed from logits[t - 1].

`live_vocab` is the number of ids the tokenizer has: an embedding padded past it (Qwen2.5:
151,936 rows for 151,665 tokens) has rows no text maps to, which the sampler must never
draw and the learner must score alike, so both take the distribution over ids below it
(`mask_padded`). 0 (or the embedding's size) means every id. It is a compile-time constant.
"""

from __future__ import annotations

import functools
import math
from typing import Callable, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jaxreplay.config import Config, ModelConfig
from jaxreplay.models import moe, sharding
from jaxreplay.models.transformer import (
    KV_CACHE_AXES, KVCache, Rotation, abstract_params, dtype_of, init_cache, positions_from_mask, rotation)

# The finite log-prob of a token the sampling filter (top-k/top-p) excludes, as
# `picked_logprobs` reports it: a ratio of ~0 with finite gradients.
LOGPROB_FLOOR = -1e4


class Rollout(NamedTuple):
    tokens: jax.Array  # [B, P+N] int32: left-padded prompt, then completion, pad after the first stop id
    attention_mask: jax.Array  # [B, P+N] bool: real prompt tokens + completion through the stop
    completion_mask: jax.Array  # [B, P+N] bool: completion tokens, the stop token included
    logprobs: jax.Array  # [B, P+N] f32: log-prob of each completion token under the
    #                      sampling distribution (after temperature/top-k/top-p); 0 elsewhere
    # [B, P+N, L_sparse, k] int16, a mixture of experts' only: the experts each sparse layer sent each token
    # to when the sampler ran it, -1 where it ran none (padding, the last token drawn); None without experts
    routes: Optional[jax.Array] = None


# ----------------------------------------------------------------------------------
# Distributions


def mask_padded(logits: jax.Array, live_vocab: int = 0) -> jax.Array:
    """`logits` [..., V] with the ids from `live_vocab` on (embedding rows past the tokenizer's
    last id) at -inf: probability 0. `live_vocab` 0 or >= V: unchanged."""
    v = logits.shape[-1]
    if not 0 < live_vocab < v:
        return logits
    return jnp.where(jnp.arange(v) < live_vocab, logits, -jnp.inf)


def filter_logits(logits: jax.Array, *, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                  live_vocab: int = 0) -> jax.Array:
    """The sampling distribution's logits: divide by temperature, drop the padded ids past
    `live_vocab` (`mask_padded`), then keep the top_k largest (0 = off), then the smallest
    set whose probability reaches top_p (1 = off). Dropped tokens get -inf, so `log_softmax`
    of the result is the renormalised log-probability. Ties at either threshold are kept.
    Settings are Python numbers: they are compile-time constants.
    """
    logits = mask_padded(logits.astype(jnp.float32) / temperature, live_vocab)
    if 0 < top_k < logits.shape[-1]:
        kth = jax.lax.top_k(logits, top_k)[0][..., -1:]
        logits = jnp.where(logits >= kth, logits, -jnp.inf)
    if top_p < 1.0:
        desc = -jnp.sort(-logits, axis=-1)
        probs = jax.nn.softmax(desc, axis=-1)
        mass_before = jnp.cumsum(probs, axis=-1) - probs  # the most likely token is always kept
        cutoff = jnp.min(jnp.where(mass_before < top_p, desc, jnp.inf), axis=-1, keepdims=True)
        logits = jnp.where(logits >= cutoff, logits, -jnp.inf)
    return logits


def argmax(x: jax.Array) -> jax.Array:
    """jnp.argmax over the last axis (first index among ties) as a max, then a min over
    the indices that reach it: XLA's CPU backend runs argmax's (value, index) reduce
    unvectorised, 5x slower on [64, 512] logits, measured. NaN rows give the last index."""
    top = jnp.max(x, axis=-1, keepdims=True)
    index = jnp.min(jnp.where(x == top, jnp.arange(x.shape[-1]), x.shape[-1] - 1), axis=-1)
    return index


def categorical(rng: jax.Array, logp: jax.Array) -> jax.Array:
    """[B] int32: one draw from each row of log-probabilities `logp` [B, V], by inverse CDF in
    two levels: a block of about sqrt(V) tokens by its probability mass, then a token within
    it, from two uniforms per row. `rng`: one key, typed keys [B] (one per row), or the
    uniforms themselves [B, 2] (`uniforms`: drawn ahead, out of a decode loop). Gumbel-max
    (jax.random.categorical) needs V random numbers and two logarithms per row. Tokens of
    probability 0 (filtered out: -inf) are never drawn."""
    b, v = logp.shape
    width = 1 << math.ceil(math.log2(v) / 2)
    n_blocks = -(-v // width)
    probs = jnp.pad(jnp.exp(logp.astype(jnp.float32)), ((0, 0), (0, n_blocks * width - v)))
    probs = probs.reshape(b, n_blocks, width)
    u = rng if jnp.issubdtype(rng.dtype, jnp.floating) else uniforms(rng, b)
    block = _inverse_cdf(probs.sum(axis=-1), u[:, :1])
    within = jnp.take_along_axis(probs, block[:, None, None], axis=1)[:, 0]
    return (block * width + _inverse_cdf(within, u[:, 1:])).astype(jnp.int32)


def uniforms(rng: jax.Array, rows: int) -> jax.Array:
    """[rows, 2] f32: the two uniforms `categorical` draws each row's token with, from one key
    or from typed keys [rows] (one per row)."""
    if jax.dtypes.issubdtype(rng.dtype, jax.dtypes.prng_key) and rng.ndim == 1:
        return jax.vmap(lambda k: jax.random.uniform(k, (2, 1)))(rng)[..., 0]
    return jnp.moveaxis(jax.random.uniform(rng, (2, rows, 1)), 0, 1)[..., 0]


def choose_token(logits: jax.Array, rng: jax.Array, *, greedy: bool, temperature: float = 1.0, top_k: int = 0,
                 top_p: float = 1.0, live_vocab: int = 0) -> tuple[jax.Array, jax.Array]:
    """[B, V] logits -> (token [B] int32, its log-prob [B] under the sampling distribution): the
    draw of every sampler. `greedy` takes the argmax and reports temperature-1 log-probs. `rng` is
    one key, one typed key per row ([B]: the rollout engine's rows draw independently), or the
    rows' uniforms [B, 2] (`uniforms`).
    `live_vocab` > 0: ids from it on (an embedding padded past the tokenizer) are never drawn."""
    if greedy:
        logits = mask_padded(logits.astype(jnp.float32), live_vocab)
        logp = jax.nn.log_softmax(logits, axis=-1)
        token = argmax(logits)
    else:
        logp = jax.nn.log_softmax(filter_logits(logits, temperature=temperature, top_k=top_k, top_p=top_p,
                                                live_vocab=live_vocab), axis=-1)
        token = categorical(rng, logp)
    return token.astype(jnp.int32), jnp.take_along_axis(logp, token[:, None], axis=-1)[:, 0]


def _inverse_cdf(weights: jax.Array, u: jax.Array) -> jax.Array:
    """[B]: per row of `weights` [B, N] (not all 0), the first index whose cumulative weight
    exceeds `u` [B, 1] (in [0, 1)) times the row's total: index i with probability
    weights[i] / total. Never an index of weight 0, whatever the rounding of the sums."""
    cdf = jnp.cumsum(weights, axis=-1)
    index = jnp.arange(weights.shape[-1])
    live = weights > 0
    last_live = jnp.max(jnp.where(live, index, 0), axis=-1, keepdims=True)
    return jnp.min(jnp.where(live & (cdf > u * cdf[:, -1:]), index, last_live), axis=-1)


def picked_logprobs(logits: jax.Array, targets: jax.Array, *, temperature: float, top_k: int = 0,
                    top_p: float = 1.0, live_vocab: int = 0) -> jax.Array:
    """[...]: log-prob of `targets` [...] under the sampling distribution of `logits` [..., V]
    (same positions, no shift). A token the filter (or `live_vocab`) excludes gets `LOGPROB_FLOOR`."""
    if top_k == 0 and top_p >= 1.0 and not 0 < live_vocab < logits.shape[-1]:
        logp = jax.nn.log_softmax(logits.astype(jnp.float32) / temperature, axis=-1)
        return jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    filtered = filter_logits(logits, temperature=temperature, top_k=top_k, top_p=top_p, live_vocab=live_vocab)
    picked = jnp.take_along_axis(jax.nn.log_softmax(filtered, axis=-1), targets[..., None], axis=-1)[..., 0]
    return jnp.maximum(picked, LOGPROB_FLOOR)


def entropy(logits: jax.Array, temperature: float = 1.0) -> jax.Array:
    """[...]: entropy of softmax(logits / temperature) over the last axis."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32) / temperature, axis=-1)
    return -jnp.sum(jnp.exp(logp) * logp, axis=-1)


def _shifted(per_position: jax.Array) -> jax.Array:
    """Entry t of a [B, T - 1] score of position t - 1 moves to t; entry 0 = 0."""
    return jnp.pad(per_position, ((0, 0), (1, 0)))


def token_logprobs(logits: jax.Array, tokens: jax.Array, temperature: float = 1.0) -> jax.Array:
    """[B, T]: entry t = log softmax(logits[t-1] / temperature)[tokens[t]]; entry 0 = 0."""
    return _shifted(picked_logprobs(logits[:, :-1], tokens[:, 1:], temperature=temperature))


def policy_logprobs(logits: jax.Array, tokens: jax.Array, *, temperature: float, top_k: int = 0,
                    top_p: float = 1.0, live_vocab: int = 0) -> jax.Array:
    """Log-probs under the sampling distribution, as the sampler reports them, so the learner's
    ratio is exactly 1 on a fresh rollout. A token the current filter excludes gets a finite
    floor (ratio ~0) instead of -inf, which keeps gradients finite."""
    return _shifted(picked_logprobs(logits[:, :-1], tokens[:, 1:], temperature=temperature, top_k=top_k,
                                    top_p=top_p, live_vocab=live_vocab))


def token_entropy(logits: jax.Array, temperature: float = 1.0) -> jax.Array:
    """[B, T]: entry t = entropy of softmax(logits[t-1] / temperature); entry 0 = 0."""
    return _shifted(entropy(logits[:, :-1], temperature))


# ----------------------------------------------------------------------------------
# Sampler


class _Decode(NamedTuple):
    """The while-loop carry. Slot P + i is the next one to fill."""

    i: jax.Array  # int32 scalar: completion tokens emitted so far
    logits: jax.Array  # [B, V] f32: next-token logits
    cache: KVCache
    tokens: jax.Array  # [B, L]
    mask: jax.Array  # [B, L] bool: real tokens (the attention mask, and the cache's key mask)
    logprobs: jax.Array  # [B, L]
    done: jax.Array  # [B] bool: the row has emitted a stop id
    rng: jax.Array
    routes: Optional[jax.Array] = None  # [B, L, L_sparse, k] int16 (`Rollout.routes`); None without experts


NO_ROUTE = -1  # `Rollout.routes` where the sampler ran no token


def _as_routes(routing) -> jax.Array:
    """A model call's stacked `moe.Routing` -> its experts [B, T, L_sparse, k] int16."""
    return jnp.moveaxis(routing.experts, 0, 2).astype(jnp.int16)


def make_sampler(
    graphdef,
    model_cfg: ModelConfig,
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    greedy: bool = False,
    stop_ids: Sequence[int],
    pad_id: int,
    mesh: Optional[Mesh] = None,
    kv_cache_dtype: Optional[str] = None,
    prefill_chunk_size: int = 0,
    live_vocab: int = 0,
) -> Callable[[nnx.State, jax.Array, jax.Array, jax.Array], Rollout]:
    """A jitted `sample(params, prompt_tokens [B, P] int32, prompt_mask [B, P] bool, rng) -> Rollout`.

    Each row emits up to `max_new_tokens`; after the first of any of `stop_ids` (the
    tokenizer's `eos_ids`; empty: never stop early) it emits `pad_id` with masks False
    and logprob 0, and the loop stops once every row is done. `greedy` takes the
    argmax and reports temperature-1 log-probs. Compiles once per (B, P) and dtypes.
    With a `mesh`, params must carry `sharding.param_shardings` (or be uncommitted),
    prompts and rollouts are split over the batch, and so is the KV cache.
    The cache is stored in `kv_cache_dtype` (None: the model's compute dtype; its size:
    `kv_cache_bytes`). `prefill_chunk_size` > 0 prefills the prompt that many tokens per
    model call, so the prefill's activations and attention scores scale with the chunk,
    not with the prompt: what lets prompts near the context limit fit. Ids from `live_vocab`
    on (the embedding's padding past the tokenizer; 0: none) are never drawn, greedy included.
    """
    if max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be positive, got {max_new_tokens}")
    if not greedy and temperature <= 0:
        raise ValueError(f"temperature must be positive (use greedy=True for argmax), got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 disables), got {top_k}")
    if prefill_chunk_size < 0:
        raise ValueError(f"prefill_chunk_size must be >= 0 (0 disables), got {prefill_chunk_size}")
    n_new = max_new_tokens
    stops = np.asarray(tuple(stop_ids), np.int32).reshape(-1)  # a constant of the program
    choose = functools.partial(choose_token, greedy=greedy, temperature=temperature, top_k=top_k, top_p=top_p,
                               live_vocab=live_vocab)

    constrain = functools.partial(constrain_cache, mesh)

    def sample(params, prompt_tokens, prompt_mask, rng) -> Rollout:
        batch, p = prompt_tokens.shape
        length = p + n_new
        if length > model_cfg.max_seq_len:
            raise ValueError(f"prompt length {p} + max_new_tokens {n_new} = {length} exceeds "
                             f"model max_seq_len {model_cfg.max_seq_len}")
        model = nnx.merge(graphdef, params)
        prompt_mask = prompt_mask.astype(bool)
        n_prompt = prompt_mask.sum(axis=-1).astype(jnp.int32)

        def emit(s: _Decode) -> _Decode:
            """Samples the token for slot P + i from s.logits; finished rows get pad."""
            rng, key = jax.random.split(s.rng)
            token, logp = choose(s.logits, key)
            live = ~s.done
            token = jnp.where(live, token, pad_id)
            slot = p + s.i
            put = lambda buf, col: jax.lax.dynamic_update_slice(buf, col[:, None].astype(buf.dtype), (0, slot))
            return s._replace(
                i=s.i + 1,
                tokens=put(s.tokens, token),
                mask=put(s.mask, live),
                logprobs=put(s.logprobs, jnp.where(live, logp, 0.0)),
                done=s.done | (live & (token[:, None] == stops[None, :]).any(axis=-1)),
                rng=rng,
            )

        # RoPE for every decode step, computed once: in the loop it is a slice, not cos and sin.
        decode_rotations = rotation(n_prompt[:, None] + jnp.arange(n_new)[None, :], model_cfg)

        def step(s: _Decode) -> _Decode:
            """Runs the model on the token in slot P + i - 1, then emits slot P + i."""
            slot = p + s.i - 1
            token = jax.lax.dynamic_slice_in_dim(s.tokens, slot, 1, axis=1)
            rot = Rotation(*(jax.lax.dynamic_slice_in_dim(x, s.i - 1, 1, axis=1) for x in decode_rotations))
            slots = s.cache.k[0].shape[2]  # this phase's cache length
            h, cache, routing = model.routed_hidden(token, rot, s.mask[:, :slots], s.cache, slot)
            routes = s.routes
            if routes is not None:  # the input token's experts, in its own column
                routes = jax.lax.dynamic_update_slice_in_dim(routes, _as_routes(routing), slot, axis=1)
            return emit(s._replace(logits=model.unembed(h)[:, 0], cache=constrain(cache), routes=routes))

        # Decode in phases whose cache grows: attention reads only the slots a phase can
        # fill (128 new tokens after 32 read 112 slots a step on average, not 160). Shapes
        # are static, so each phase is its own loop over a fixed cache length.
        ends = _phase_ends(n_new)

        # Prefill the prompt into slots 0..P-1. Left padding puts every row's last real
        # token in slot P-1, so only that slot's logits are needed.
        mask = jnp.zeros((batch, length), bool).at[:, :p].set(prompt_mask)
        cache = constrain(init_cache(model_cfg, batch, p + ends[0], kv_cache_dtype))
        routes = None
        if moe.sparse_layers(model_cfg):
            routes = jnp.full((batch, length, len(moe.sparse_layers(model_cfg)), model_cfg.experts_per_token),
                              NO_ROUTE, jnp.int16)
        h, cache, routes = _prefill(model, prompt_tokens, positions_from_mask(prompt_mask), mask, cache,
                                    prefill_chunk_size, constrain, routes)
        state = _Decode(
            i=jnp.zeros((), jnp.int32),
            logits=model.unembed(h)[:, 0],
            cache=cache,
            tokens=jnp.full((batch, length), pad_id, jnp.int32).at[:, :p].set(prompt_tokens.astype(jnp.int32)),
            mask=mask,
            logprobs=jnp.zeros((batch, length), jnp.float32),
            done=jnp.zeros((batch,), bool),
            rng=rng,
            routes=routes,
        )
        state = emit(state)
        for k, end in enumerate(ends):
            if k:
                grow = lambda x: jnp.pad(x, ((0, 0), (0, 0), (0, p + end - x.shape[2]), (0, 0)))
                state = state._replace(cache=constrain(jax.tree.map(grow, state.cache)))
            state = jax.lax.while_loop(lambda s, end=end: (s.i < end) & ~jnp.all(s.done), step, state)
        completion = state.mask & (jnp.arange(length) >= p)[None, :]
        routes = state.routes
        if routes is not None:  # padding's routes, and the last drawn token's, are none
            ran = state.mask & (jnp.arange(length) < p + state.i - 1)[None, :]
            routes = jnp.where(ran[:, :, None, None], routes, jnp.int16(NO_ROUTE))
        return Rollout(tokens=state.tokens, attention_mask=state.mask, completion_mask=completion,
                       logprobs=state.logprobs, routes=routes)

    if mesh is None:
        return jax.jit(sample)
    rows = sharding.batch_sharding(mesh)
    return jax.jit(
        sample,
        in_shardings=(sharding.param_shardings(mesh, abstract_params(model_cfg)), rows, rows,
                      sharding.replicated(mesh)),
        out_shardings=rows,
    )


def constrain_cache(mesh: Optional[Mesh], cache: KVCache) -> KVCache:
    """`cache` laid out over `mesh` (None: as it is): rows over the data-parallel axes, kv heads over tensor."""
    if mesh is None:
        return cache
    shard = sharding.cache_sharding(mesh, KV_CACHE_AXES, cache.k[0].shape)
    return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, shard), cache)


def _prefill(model, tokens, positions, mask, cache: KVCache, chunk: int, constrain,
             routes: Optional[jax.Array] = None) -> tuple[jax.Array, KVCache, Optional[jax.Array]]:
    """(hidden state of the last prompt slot [B, 1, D], the cache holding the prompt's slots, `routes`
    with the prompt's columns written: `_Decode.routes`, None without experts).

    With `chunk` > 0 the prompt goes through the model `chunk` tokens at a time, each
    chunk attending to the cache written so far: a first chunk of P mod `chunk` tokens,
    then a `fori_loop` over equal ones (one copy of the model in the program)."""
    p = tokens.shape[1]

    def record(routes, routing, start):
        if routes is None:
            return None
        return jax.lax.dynamic_update_slice_in_dim(routes, _as_routes(routing), start, axis=1)

    if chunk <= 0 or chunk >= p:
        h, cache, routing = model.routed_hidden(tokens, positions, mask, cache, 0)
        return h[:, -1:], cache, record(routes, routing, 0)
    first = p % chunk
    h = None
    if first:
        h, cache, routing = model.routed_hidden(tokens[:, :first], positions[:, :first], mask, cache, 0)
        h, routes = h[:, -1:], record(routes, routing, 0)
    take = lambda x, start: jax.lax.dynamic_slice_in_dim(x, start, chunk, axis=1)

    def one(k, carry):
        _, cache, routes = carry
        start = first + k * chunk
        h, cache, routing = model.routed_hidden(take(tokens, start), take(positions, start), mask, cache, start)
        return h[:, -1:].astype(carry[0].dtype), constrain(cache), record(routes, routing, start)

    dtype = dtype_of(model.cfg.compute_dtype)
    h0 = jnp.zeros((tokens.shape[0], 1, model.cfg.d_model), dtype) if h is None else h
    return jax.lax.fori_loop(0, p // chunk, one, (h0, cache, routes))


def kv_cache_bytes(model_cfg: ModelConfig, batch: int, prompt_len: int, max_new_tokens: int,
                   kv_cache_dtype: Optional[str] = None) -> int:
    """Bytes of the KV cache at its largest (the last decode phase: every prompt and
    completion slot) for `batch` rows, over all devices; a mesh splits it over the
    batch and kv-head axes (`sharding.cache_sharding`)."""
    itemsize = jnp.dtype(dtype_of(kv_cache_dtype or model_cfg.compute_dtype)).itemsize
    slots = prompt_len + max_new_tokens
    return 2 * model_cfg.n_layers * batch * model_cfg.n_kv_heads * slots * model_cfg.head_dim * itemsize


_DECODE_PHASES = 4  # at most: each is one more loop to compile
_MIN_PHASE_STEPS = 32


def _phase_ends(n_new: int) -> list[int]:
    """Completion tokens emitted by the end of each decode phase (the last is n_new)."""
    n = max(1, min(_DECODE_PHASES, n_new // _MIN_PHASE_STEPS))
    return [round(n_new * (k + 1) / n) for k in range(n)]


def make_run_samplers(graphdef, config: Config, *, stop_ids: Sequence[int], pad_id: int,
                      mesh: Optional[Mesh] = None, live_vocab: int = 0):
    """The two samplers every training loop needs: rollouts at the configured temperature /
    top-k / top-p, and greedy decoding for evaluation; neither draws an id from `live_vocab` on."""
    s = config.sampling
    common = dict(max_new_tokens=s.max_new_tokens, stop_ids=stop_ids, pad_id=pad_id, mesh=mesh,
                  kv_cache_dtype=s.kv_cache_dtype, prefill_chunk_size=s.prefill_chunk_size, live_vocab=live_vocab)
    rollout = make_sampler(graphdef, config.model, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, **common)
    return rollout, make_sampler(graphdef, config.model, greedy=True, **common)


def completion_ids(rollout: Rollout) -> list[np.ndarray]:
    """Each row's completion as the reward sees it: exactly the tokens its completion_mask
    covers (through the first stop id), so the reward and the learner see one completion."""
    tokens, mask = np.asarray(rollout.tokens), np.asarray(rollout.completion_mask, bool)
    return [row[keep] for row, keep in zip(tokens, mask)]
