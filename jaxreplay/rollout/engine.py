"""The rollout engine: a prompt prefilled once per group, rows decoded continuously in a slot pool.

The static sampler (`sampling.make_sampler`) decodes one batch in one jitted call: each of a
group's G rows prefills the same prompt, and every row decodes until the batch's longest stops.
The engine keeps S decode slots instead, each row at its own length (a per-row cache index), and
decodes in jitted chunks of K steps. Between chunks the host takes out finished groups and
prefills waiting ones into the free slots: one prefill per prompt, its K/V copied into the G
rows' slots, its last logits starting G draws with G keys. The pool's cache is allocated once.

`RolloutEngine` is the interface the actor needs (submit, step, collect, update_weights);
`JaxEngine` is the in-JAX implementation. Every decision between chunks is a function of what
was submitted and of the tokens drawn, never of the clock: the same seed gives the same run.

Keys: row j of a group draws its token t with fold_in(fold_in(group key, j), t), whatever slot
or chunk it runs in. Weights: `update_weights` takes effect at the next chunk; rows mid-sequence
continue under the new weights over the K/V the old ones wrote, and each token's log-prob is
that of the distribution it was drawn from. Each row records the version of every token.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from typing import Any, NamedTuple, Optional, Protocol, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxreplay.config import ModelConfig
from jaxreplay.models.transformer import KVCache, dtype_of, init_cache, positions_from_mask, rotation
from jaxreplay.rollout.sampling import Rollout, _prefill, choose_token


@dataclasses.dataclass(frozen=True)
class PromptGroup:
    """One prompt to complete G times. `tokens`/`mask` [P] are left-padded to the engine's
    prompt width; `key` is the group's typed PRNG key; `tag` comes back with the completions."""

    tag: Any
    tokens: np.ndarray
    mask: np.ndarray
    key: jax.Array


@dataclasses.dataclass(frozen=True)
class CompletedGroup:
    """G completions of one prompt, rows as the static sampler lays them out ([G, P + N])."""

    tag: Any
    rollout: Rollout  # numpy arrays
    token_versions: np.ndarray  # [G, N] int32: the weight version that drew each token; -1 past the row's end

    @property
    def first_version(self) -> np.ndarray:
        """[G]: the version of each row's first token (what staleness counts from)."""
        return self.token_versions[:, 0]

    @property
    def last_version(self) -> np.ndarray:
        """[G]: the version of each row's last token."""
        n = (self.token_versions >= 0).sum(axis=1)
        return self.token_versions[np.arange(len(n)), n - 1]


class RolloutEngine(Protocol):
    """What the actor needs from a rollout engine. An external engine (vLLM, SGLang) fits behind
    it if it can take a prompt group with G seeds, report each token's log-prob under the
    distribution it drew from and the weight version that drew it, and take new weights."""

    group_size: int

    def submit(self, groups: Sequence[PromptGroup]) -> None:
        """Queues prompt groups; they start, in order, as slots free up."""

    def step(self) -> None:
        """Starts queued groups in free slots, then decodes one chunk."""

    def collect(self) -> list[CompletedGroup]:
        """The groups whose every row has stopped since the last call, in the order they completed."""

    def update_weights(self, params, version: int) -> None:
        """Weights for the next chunk; rows in flight continue under them."""

    def pending(self) -> int:
        """Groups submitted and not yet collected (queued, decoding, or complete)."""


class Pool(NamedTuple):
    """The device state of S slots. A row's sequence lies as the static sampler's: its prompt
    left-padded in columns 0..P-1, completion token t in column P + t."""

    cache: KVCache  # [S, kv_heads, P + N, head_dim] per layer
    tokens: jax.Array  # [S, P + N] int32
    mask: jax.Array  # [S, P + N] bool: real tokens (the key mask)
    logprobs: jax.Array  # [S, P + N] f32: completion tokens' behaviour log-probs
    versions: jax.Array  # [S, N] int32: the version that drew each completion token, -1 elsewhere
    n_prompt: jax.Array  # [S] int32: real prompt tokens (RoPE positions continue from there)
    emitted: jax.Array  # [S] int32: completion tokens drawn so far
    done: jax.Array  # [S] bool: stopped, or free
    keys: jax.Array  # [S] typed keys: the row's key


@dataclasses.dataclass
class _Running:
    tag: Any
    slots: np.ndarray  # [G] int


@dataclasses.dataclass
class EngineStats:
    """Counters a test or benchmark reads. `prefill_rows` counts prompt rows the prefill program
    ran through the model (one per group: its rows share it); `decode_steps` counts pool steps."""

    prefill_rows: int = 0
    prefill_calls: int = 0
    chunks: int = 0
    decode_steps: int = 0


class JaxEngine:
    """The in-JAX engine: S slots, chunks of K decode steps, one prefill per prompt group.

    Settings as `sampling.make_sampler` (same draw, same model code). A group starts only when
    G slots are free; lowest free slots first, groups in submission order.
    """

    def __init__(self, graphdef, model_cfg: ModelConfig, params, *, slots: int, group_size: int, prompt_len: int,
                 max_new_tokens: int, chunk_steps: int = 8, temperature: float = 1.0, top_p: float = 1.0,
                 top_k: int = 0, greedy: bool = False, stop_ids: Sequence[int] = (), pad_id: int = 0,
                 kv_cache_dtype: Optional[str] = None, prefill_chunk_size: int = 0, version: int = 0):
        if group_size <= 0 or slots < group_size:
            raise ValueError(f"slots ({slots}) must hold at least one group of group_size ({group_size}) rows")
        if chunk_steps <= 0 or max_new_tokens <= 0:
            raise ValueError(f"chunk_steps ({chunk_steps}) and max_new_tokens ({max_new_tokens}) must be positive")
        if not greedy and temperature <= 0:
            raise ValueError(f"temperature must be positive (use greedy=True for argmax), got {temperature}")
        if prompt_len + max_new_tokens > model_cfg.max_seq_len:
            raise ValueError(f"prompt length {prompt_len} + max_new_tokens {max_new_tokens} exceeds model "
                             f"max_seq_len {model_cfg.max_seq_len}")
        self.group_size, self.slots, self.prompt_len, self.max_new_tokens = group_size, slots, prompt_len, max_new_tokens
        self.chunk_steps, self.pad_id = chunk_steps, pad_id
        self.params, self.version = params, version
        self.stats = EngineStats()
        self._prefill, self._decode = _programs(
            graphdef, model_cfg, group_size, prompt_len, max_new_tokens, chunk_steps,
            (bool(greedy), float(temperature), int(top_k), float(top_p)), tuple(int(s) for s in stop_ids), pad_id,
            kv_cache_dtype, prefill_chunk_size)
        self.pool = _empty_pool(model_cfg, slots, prompt_len, max_new_tokens, pad_id, kv_cache_dtype)
        self._queue: collections.deque[PromptGroup] = collections.deque()
        self._running: list[_Running] = []
        self._free = list(range(slots))
        self._done = np.ones(slots, bool)
        self._completed: list[CompletedGroup] = []

    # -- the protocol --------------------------------------------------------------

    def submit(self, groups: Sequence[PromptGroup]) -> None:
        for g in groups:
            if np.shape(g.tokens) != (self.prompt_len,) or np.shape(g.mask) != (self.prompt_len,):
                raise ValueError(f"a prompt group needs tokens and mask of shape ({self.prompt_len},), "
                                 f"got {np.shape(g.tokens)} and {np.shape(g.mask)}")
            self._queue.append(g)

    def step(self) -> None:
        self._start_queued()
        if (~self._done).any():
            self.pool, steps = self._decode(self.params, self.pool, jnp.int32(self.version))
            self.stats.chunks += 1
            self.stats.decode_steps += int(steps)
            self._done = np.asarray(self.pool.done)
        self._take_completed()

    def collect(self) -> list[CompletedGroup]:
        out, self._completed = self._completed, []
        return out

    def update_weights(self, params, version: int) -> None:
        self.params, self.version = params, int(version)

    def pending(self) -> int:
        return len(self._queue) + len(self._running) + len(self._completed)

    # -- between chunks --------------------------------------------------------------

    def free_slots(self) -> int:
        return len(self._free)

    def queued(self) -> int:
        return len(self._queue)

    def _start_queued(self) -> None:
        """Prefills as many queued groups as free slots hold, in calls of 2^k groups (one
        program per power of two)."""
        n = min(len(self._queue), len(self._free) // self.group_size)
        if not n:
            return
        groups = [self._queue.popleft() for _ in range(n)]
        slots = np.asarray(self._free[:n * self.group_size], np.int32).reshape(n, self.group_size)
        self._free = self._free[n * self.group_size:]
        start = 0
        for bit in reversed(range(n.bit_length())):
            size = 1 << bit
            if not n & size:
                continue
            part, part_slots = groups[start:start + size], slots[start:start + size]
            tokens = np.stack([np.asarray(g.tokens, np.int32) for g in part])
            mask = np.stack([np.asarray(g.mask, bool) for g in part])
            keys = jnp.stack([g.key for g in part])
            self.pool, prefilled = self._prefill(self.params, self.pool, tokens, mask, part_slots, keys,
                                                 jnp.int32(self.version))
            self.stats.prefill_rows += int(prefilled)
            self.stats.prefill_calls += 1
            self._running.extend(_Running(g.tag, s) for g, s in zip(part, part_slots))
            start += size
        self._done = np.asarray(self.pool.done)

    def _take_completed(self) -> None:
        finished = [r for r in self._running if self._done[r.slots].all()]
        if not finished:
            return
        rows = np.concatenate([r.slots for r in finished])
        tokens, mask, logprobs, versions = jax.device_get(_gather(self.pool, rows))
        completion = mask & (np.arange(mask.shape[1]) >= self.prompt_len)[None, :]
        g = self.group_size
        for k, r in enumerate(finished):
            part = slice(k * g, (k + 1) * g)
            self._completed.append(CompletedGroup(
                r.tag, Rollout(tokens=tokens[part], attention_mask=mask[part], completion_mask=completion[part],
                               logprobs=logprobs[part]), token_versions=versions[part]))
        done = {id(r) for r in finished}
        self._running = [r for r in self._running if id(r) not in done]
        self._free = sorted(self._free + rows.tolist())


@functools.lru_cache(maxsize=32)
def _programs(graphdef, cfg: ModelConfig, g: int, p: int, n_new: int, k_steps: int, draw: tuple, stop_ids: tuple,
              pad_id: int, kv_cache_dtype, prefill_chunk_size: int):
    """The jitted (prefill, decode chunk) of one engine shape, shared by engines of that shape
    (jit caches compiled programs per function object)."""
    greedy, temperature, top_k, top_p = draw
    choose = functools.partial(choose_token, greedy=greedy, temperature=temperature, top_k=top_k, top_p=top_p)
    stops = np.asarray(stop_ids, np.int32).reshape(-1)
    prefill = jax.jit(functools.partial(_prefill_groups, graphdef, cfg, choose, stops, g, p, n_new, pad_id,
                                        kv_cache_dtype, prefill_chunk_size), donate_argnums=1)
    decode = jax.jit(functools.partial(_decode_chunk, graphdef, cfg, choose, stops, p, n_new, k_steps),
                     donate_argnums=1)
    return prefill, decode


@jax.jit
def _gather(pool: Pool, rows: jax.Array):
    return pool.tokens[rows], pool.mask[rows], pool.logprobs[rows], pool.versions[rows]


def pool_cache_bytes(model_cfg: ModelConfig, slots: int, prompt_len: int, max_new_tokens: int,
                     kv_cache_dtype: Optional[str] = None) -> int:
    """Bytes of the pool's KV cache: every slot holds P + N columns, allocated once. The static
    sampler's cache at batch S reaches the same size only in its last decode phase."""
    itemsize = jnp.dtype(dtype_of(kv_cache_dtype or model_cfg.compute_dtype)).itemsize
    return 2 * model_cfg.n_layers * slots * model_cfg.n_kv_heads * (prompt_len + max_new_tokens) * \
        model_cfg.head_dim * itemsize


def _empty_pool(cfg: ModelConfig, slots: int, p: int, n: int, pad_id: int, kv_cache_dtype) -> Pool:
    length = p + n
    return Pool(cache=init_cache(cfg, slots, length, kv_cache_dtype),
                tokens=jnp.full((slots, length), pad_id, jnp.int32), mask=jnp.zeros((slots, length), bool),
                logprobs=jnp.zeros((slots, length), jnp.float32), versions=jnp.full((slots, n), -1, jnp.int32),
                n_prompt=jnp.zeros((slots,), jnp.int32), emitted=jnp.zeros((slots,), jnp.int32),
                done=jnp.ones((slots,), bool), keys=jax.random.split(jax.random.key(0), slots))


def _stopped(token: jax.Array, stops: np.ndarray) -> jax.Array:
    return (token[:, None] == stops[None, :]).any(axis=-1) if stops.size else jnp.zeros(token.shape, bool)


def _prefill_groups(graphdef, cfg: ModelConfig, choose, stops, g: int, p: int, n_new: int, pad_id: int,
                    kv_cache_dtype, prefill_chunk_size: int, params, pool: Pool, tokens, mask, slots, keys,
                    version) -> tuple[Pool, jax.Array]:
    """Prefills `tokens`/`mask` [n, P] once each, copies each prompt's K/V into its G `slots`
    [n, G], and draws the G rows' first tokens from its last logits with the rows' keys.
    Also returns how many prompt rows went through the model (n: what `EngineStats` counts)."""
    n = tokens.shape[0]
    model = nnx.merge(graphdef, params)
    mask = mask.astype(bool)
    cache = init_cache(cfg, n, p, kv_cache_dtype)
    h, cache = _prefill(model, tokens, positions_from_mask(mask), mask, cache, prefill_chunk_size, lambda c: c)
    logits = jnp.repeat(model.unembed(h)[:, 0], g, axis=0)  # [n * G, V]: one prefill, G draws
    row_keys = jax.vmap(lambda key: jax.vmap(lambda j: jax.random.fold_in(key, j))(jnp.arange(g)))(keys).reshape(-1)
    token, logp = choose(logits, jax.vmap(jax.random.fold_in)(row_keys, jnp.zeros(n * g, jnp.int32)))
    rows = slots.reshape(-1)
    rep = lambda x: jnp.repeat(x, g, axis=0)
    length = p + n_new
    put = lambda buf, new: buf.at[rows].set(new)
    first = jnp.zeros((n * g, length), bool).at[:, p].set(True)
    return Pool(
        cache=KVCache(*(tuple(pool_x.at[rows, :, :p].set(rep(x).astype(pool_x.dtype)) for pool_x, x in zip(a, b))
                        for a, b in ((pool.cache.k, cache.k), (pool.cache.v, cache.v)))),
        tokens=put(pool.tokens, jnp.full((n * g, length), pad_id, jnp.int32).at[:, :p].set(rep(tokens))
                   .at[:, p].set(token)),
        mask=put(pool.mask, first.at[:, :p].set(rep(mask))),
        logprobs=put(pool.logprobs, jnp.where(first, logp[:, None], 0.0)),
        versions=put(pool.versions, jnp.full((n * g, n_new), -1, jnp.int32).at[:, 0].set(version)),
        n_prompt=put(pool.n_prompt, rep(mask.sum(axis=-1).astype(jnp.int32))),
        emitted=put(pool.emitted, jnp.ones((n * g,), jnp.int32)),
        done=put(pool.done, _stopped(token, stops) | (n_new == 1)),
        keys=put(pool.keys, row_keys),
    ), jnp.int32(h.shape[0])


def _decode_chunk(graphdef, cfg: ModelConfig, choose, stops, p: int, n_new: int, k_steps: int, params, pool: Pool,
                  version) -> tuple[Pool, jax.Array]:
    """Up to `k_steps` decode steps of every live row (fewer once all have stopped): each runs
    the model on the row's last token, writes its K/V in the row's own column and draws the
    next token. Rows that stopped, and free slots, keep their contents. Returns the steps run."""
    model = nnx.merge(graphdef, params)
    rows = jnp.arange(pool.tokens.shape[0])

    def step(carry):
        k, pool = carry
        live = ~pool.done
        last = p + pool.emitted - 1  # the column of the last token drawn
        token = pool.tokens[rows, last][:, None]
        rot = rotation((pool.n_prompt + pool.emitted - 1)[:, None], cfg)
        h, cache = model.hidden(token, rot, pool.mask, pool.cache, last)
        new, logp = choose(model.unembed(h)[:, 0], jax.vmap(jax.random.fold_in)(pool.keys, pool.emitted))
        col = jnp.minimum(pool.emitted, n_new - 1)  # a live row has drawn fewer than N tokens
        keep = lambda buf, value, offset=p: buf.at[rows, offset + col].set(
            jnp.where(live, value, buf[rows, offset + col]))
        emitted = pool.emitted + live
        pool = pool._replace(
            cache=cache, tokens=keep(pool.tokens, new), mask=keep(pool.mask, live),
            logprobs=keep(pool.logprobs, logp), versions=keep(pool.versions, version, 0), emitted=emitted,
            done=pool.done | (live & (_stopped(new, stops) | (emitted >= n_new))))
        return k + 1, pool

    k, pool = jax.lax.while_loop(lambda c: (c[0] < k_steps) & ~jnp.all(c[1].done), step, (jnp.int32(0), pool))
    return pool, k
