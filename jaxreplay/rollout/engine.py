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
that of the distribution it was drawn from. Each row records the version of every token, and
(`record_routes`, a mixture of experts) the experts each sparse layer sent each token to when
it ran through the model: in its own column, -1 where none ran (padding, the row's last token).
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
from jax.sharding import Mesh

from jaxreplay.config import ModelConfig
from jaxreplay.models import moe, sharding
from jaxreplay.models.transformer import (
    KV_CACHE_AXES, KVCache, Rotation, dtype_of, init_cache, positions_from_mask, rotation)
from jaxreplay.rollout.sampling import NO_ROUTE, Rollout, _as_routes, _prefill, choose_token, constrain_cache, uniforms


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

    def clear(self) -> None:
        """Drops every group submitted and not yet collected, and frees their slots."""


class TurnTaker(Protocol):
    """What answers a row's turns (multi-turn episodes, rollout/episodes.py). A row that stops on
    a stop id has ended a turn: it keeps its slot and its K/V while the answer is computed; the
    answer's ids are put after it (`_feed_answers` prefills all but the last) and it decodes on.
    `None` ends the episode."""

    def ended(self, tag: Any, row: int, turn_ids: np.ndarray, cut: bool,
              logprobs: Optional[np.ndarray] = None) -> None:
        """Row `row` of group `tag` ended a turn with `turn_ids` (the model's ids of that turn,
        its stop id last; `logprobs` theirs, as drawn). `cut`: the token limit ended it (or left no room for the answer):
        the episode is over and truncated, no answer is expected."""

    def answers(self, wait: float) -> list[tuple[Any, int, Optional[list[int]]]]:
        """(tag, row, ids to append, or None when the episode is over) of the turns answered
        since the last call, waiting up to `wait` seconds for one when none is ready."""


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
    done: jax.Array  # [S] bool: stopped, or free (or waiting for its environment's answer)
    keys: jax.Array  # [S] typed keys: the row's key
    forced_until: jax.Array  # [S] int32: completion tokens before this index are an environment's, fed not drawn
    routes: Optional[jax.Array] = None  # [S, P + N, L_sparse, k] int16 (`Rollout.routes`); None unless recorded


class Prefixes(NamedTuple):
    """Prefilled prompts whose rows wait for slots: Q entries, each one prompt's K/V and the
    logits its rows' first tokens are drawn from."""

    cache: KVCache  # [Q, kv_heads, P, head_dim] per layer
    logits: jax.Array  # [Q, V] f32: the last prompt position's
    tokens: jax.Array  # [Q, P] int32
    mask: jax.Array  # [Q, P] bool
    version: jax.Array  # [Q] int32: the weights that prefilled it
    routes: Optional[jax.Array] = None  # [Q, P, L_sparse, k] int16: the prompt's; None unless recorded


@dataclasses.dataclass
class _Group:
    """A group on the host between submit and collect."""

    prompt: PromptGroup
    entry: int = -1  # its prefix entry while rows wait for slots
    to_place: int = 0  # the next row to put in a slot
    rows: dict = dataclasses.field(default_factory=dict)  # row j -> (tokens, mask, logprobs, versions, routes) once stopped
    env_cols: dict = dataclasses.field(default_factory=dict)  # row j -> [(start, end)] completion columns fed by its environment
    turn_start: dict = dataclasses.field(default_factory=dict)  # row j -> the completion column its current turn began at


@dataclasses.dataclass
class EngineStats:
    """Counters a test or benchmark reads. `prefill_rows` counts prompt rows the prefill program
    ran through the model (one per group: its rows share it); `entry_groups` the groups that
    waited for slots in a prefix entry (the rest went straight into theirs); `decode_steps`
    counts pool steps; `narrow_chunks` the chunks run on fewer than S slots (the pool draining);
    `cache_columns` sums, over steps, rows x window columns attended (what a step reads of the cache)."""

    prefill_rows: int = 0
    prefill_calls: int = 0
    entry_groups: int = 0
    chunks: int = 0
    decode_steps: int = 0
    narrow_chunks: int = 0
    cache_columns: int = 0
    turns: int = 0  # multi-turn: turns that ended on a stop id and went to their environment
    appended_tokens: int = 0  # environment tokens put onto rows
    answer_prefills: int = 0  # calls of the program that prefills answers (multi-token ones only)
    prefilled_tokens: int = 0  # tokens those calls ran through the model (real ones, not padding)


class JaxEngine:
    """The in-JAX engine: S slots, chunks of K decode steps, one prefill per prompt group.

    With a `mesh`, the pool's slots split over its data-parallel axes and its cache's kv heads
    over tensor (`state_shardings`); `params` (and every `update_weights`) must lie on that mesh.

    Settings as `sampling.make_sampler` (same draw, same model code; ids from `live_vocab` on,
    the embedding's padding past the tokenizer, are never drawn). Between chunks, in this
    order: queued groups start in submission order (`_start_queued`), each row in the lowest free
    slot, drawing its first token from its prompt's logits; one chunk decodes; rows that stopped
    leave their slots, and a group whose G rows have all stopped is complete. A group that only
    partly fits waits in a prefix entry, so its rows may start in different chunks; each row's
    slot is freed as soon as it stops.

    `record_routes` (a mixture of experts; a no-op for a dense model): the rows carry `routes`,
    for a learner that routes as the sampler did (`train.routing_replay`). Off by default: the
    pool then holds P + N x sparse layers x k more int16 per slot.
    """

    def __init__(self, graphdef, model_cfg: ModelConfig, params, *, slots: int, group_size: int, prompt_len: int,
                 max_new_tokens: int, chunk_steps: int = 8, temperature: float = 1.0, top_p: float = 1.0,
                 top_k: int = 0, greedy: bool = False, stop_ids: Sequence[int] = (), pad_id: int = 0,
                 kv_cache_dtype: Optional[str] = None, prefill_chunk_size: int = 0, version: int = 0,
                 live_vocab: int = 0, mesh: Optional[Mesh] = None, turns: Optional[TurnTaker] = None,
                 record_routes: bool = False):
        if group_size <= 0 or slots <= 0:
            raise ValueError(f"slots ({slots}) and group_size ({group_size}) must be positive")
        if chunk_steps <= 0 or max_new_tokens <= 0:
            raise ValueError(f"chunk_steps ({chunk_steps}) and max_new_tokens ({max_new_tokens}) must be positive")
        if not greedy and temperature <= 0:
            raise ValueError(f"temperature must be positive (use greedy=True for argmax), got {temperature}")
        if prompt_len + max_new_tokens > model_cfg.max_seq_len:
            raise ValueError(f"prompt length {prompt_len} + max_new_tokens {max_new_tokens} exceeds model "
                             f"max_seq_len {model_cfg.max_seq_len}")
        self.group_size, self.slots, self.prompt_len, self.max_new_tokens = group_size, slots, prompt_len, max_new_tokens
        self.turns, self.stop_ids = turns, frozenset(int(i) for i in stop_ids)
        self.chunk_steps, self.pad_id = chunk_steps, pad_id
        self.params, self.version = params, version
        self.stats = EngineStats()
        entries = _prefix_entries(slots, group_size)
        routes = _route_shape(model_cfg, record_routes)
        layout = _layout(mesh, model_cfg, slots, entries, prompt_len, max_new_tokens, kv_cache_dtype, routes)
        self._prefill, self._place, self._start, self._decode, self._append, self._feed = _programs(
            graphdef, model_cfg, group_size, prompt_len, max_new_tokens, chunk_steps,
            (bool(greedy), float(temperature), int(top_k), float(top_p), int(live_vocab)),
            tuple(int(s) for s in stop_ids), pad_id, kv_cache_dtype, prefill_chunk_size, layout, routes)
        self._replicated = None if mesh is None else sharding.replicated(mesh)
        self._answer_rows = answer_prefill_rows(slots, mesh)
        # Choices that change the speed, never the rows; on by default, off to measure them side
        # by side: run a draining pool's chunks on its live slots only, write one cache column for
        # all rows when they are in step, chunks of 2K steps when no group waits, and prefill a
        # group whose rows all find slots straight into them.
        self.narrow_drain = self.lockstep_writes = self.long_drain_chunks = self.start_whole_groups = True
        # Multi-turn: an answer of L ids is prefilled (its first L - 1 inputs in one call) rather
        # than fed one per decode step: the row pays 2 steps for it, not L + 1.
        self.prefill_answers = True
        self.answer_wait = 0.05  # seconds `step` waits for an environment when every row waits for one
        # Multi-turn: rows waiting for their environments leave few live at any time, and a
        # narrowed chunk would compile a program per live count; every chunk runs on all S slots.
        self.narrow_drain = turns is None
        # Made in place: a pool laid out over a mesh is never whole on one device.
        pool_sharding, prefix_sharding = layout or (None, None)
        self._empty = (jax.jit(lambda: _empty_pool(model_cfg, slots, prompt_len, max_new_tokens, pad_id, kv_cache_dtype,
                                                   routes), out_shardings=pool_sharding),
                       jax.jit(lambda: _empty_prefixes(model_cfg, entries, prompt_len, pad_id, kv_cache_dtype, routes),
                               out_shardings=prefix_sharding))
        self._entries = entries
        self.clear()

    def clear(self) -> None:
        """Empty slots and prefix entries, no group queued, open or complete: as built. A
        streaming actor's restart at a checkpoint (what a resume there does)."""
        entries, slots = self._entries, self.slots
        self.pool, self.prefixes = self._empty[0](), self._empty[1]()
        self._parked: dict[tuple[Any, int], int] = {}  # (tag, row) -> slot, while its environment answers
        self._ending: set[int] = set()  # slots whose episode ended: taken out as they are
        self._queue: collections.deque[_Group] = collections.deque()
        self._waiting: list[_Group] = []  # prefilled, some rows not placed yet, in submission order
        self._free_entries = list(range(entries))
        self._slot_row: list[Optional[tuple[_Group, int]]] = [None] * slots
        self._done = np.ones(slots, bool)
        self._emitted = np.zeros(slots, np.int32)
        self._open: list[_Group] = []  # started, not complete, in submission order
        self._completed: list[CompletedGroup] = []

    # -- the protocol --------------------------------------------------------------

    def submit(self, groups: Sequence[PromptGroup]) -> None:
        for g in groups:
            if np.shape(g.tokens) != (self.prompt_len,) or np.shape(g.mask) != (self.prompt_len,):
                raise ValueError(f"a prompt group needs tokens and mask of shape ({self.prompt_len},), "
                                 f"got {np.shape(g.tokens)} and {np.shape(g.mask)}")
            self._queue.append(_Group(g))

    def step(self) -> None:
        if self.turns is not None:
            self._take_answers(0.0)
        self._start_queued()
        if self.turns is not None and self._parked and not (~self._done).any():
            self._take_answers(self.answer_wait)  # nothing to decode: wait for an environment
        if (~self._done).any():
            slots, k = self._live_slots(), self._chunk_steps()
            width = self._width(k)
            self.pool, steps = self._decode(width, self._lockstep(), self.params, self.pool, slots, jnp.int32(k),
                                            jnp.int32(self.version))
            self._done, self._emitted, steps = jax.device_get((self.pool.done, self.pool.emitted, steps))
            self.stats.narrow_chunks += len(slots) < self.slots
            self.stats.cache_columns += int(steps) * len(slots) * width
            self.stats.chunks += 1
            self.stats.decode_steps += int(steps)
        self._take_stopped()

    def collect(self) -> list[CompletedGroup]:
        out, self._completed = self._completed, []
        return out

    def update_weights(self, params, version: int) -> None:
        self.params, self.version = params, int(version)

    def pending(self) -> int:
        return len(self._queue) + len(self._open) + len(self._completed)

    # -- for a server (serve/): rows read and ended between steps ----------------------

    def progress(self) -> dict[tuple[Any, int], tuple[np.ndarray, np.ndarray]]:
        """(tag, row) -> (completion ids drawn so far, their log-probs) of every row in a slot,
        read between steps: what a server streams, and where it sees a request's own limits
        (its max_tokens, a stop string) reached before the engine's."""
        rows = [(s, *row) for s, row in enumerate(self._slot_row) if row is not None]
        if not rows:
            return {}
        tokens, logprobs = jax.device_get((self.pool.tokens, self.pool.logprobs))
        p = self.prompt_len
        return {(g.prompt.tag, j): (tokens[s, p:p + self._emitted[s]], logprobs[s, p:p + self._emitted[s]])
                for s, g, j in rows}

    def stop(self, tags: Sequence[Any]) -> None:
        """Ends the groups of `tags` now: queued ones are dropped (never collected); their rows in
        slots stop as at the token limit, and leave their slots at the next `step` (the group
        completes with what they drew). A row still waiting in a prefix entry is placed later:
        call again. For a server whose client left, or whose request's own limit was reached."""
        tags = set(tags)
        self._queue = collections.deque(g for g in self._queue if g.prompt.tag not in tags)
        slots = [s for s, row in enumerate(self._slot_row)
                 if row is not None and row[0].prompt.tag in tags and not self._done[s]]
        if slots:
            self.pool = self.pool._replace(done=self.pool.done.at[np.asarray(slots, np.int32)].set(True))
            self._done = self._done.copy()  # the host's copy of the device's flags (read-only as fetched)
            self._done[slots] = True

    # -- between chunks --------------------------------------------------------------

    def free_slots(self) -> int:
        return sum(row is None for row in self._slot_row)

    def queued(self) -> int:
        return len(self._queue)

    def _chunk_steps(self) -> int:
        """K, or 2K when no group waits for a slot (nothing to refill at the next boundary): half
        the host round trips while the pool only drains. A function of the queue, not the clock."""
        return self.chunk_steps * (1 if self._queue or self._waiting or not self.long_drain_chunks else 2)

    def _width(self, k: int) -> int:
        """The cache columns a chunk of `k` steps attends over: the longest live row's after it
        (a row that has drawn e tokens writes columns up to P + e + k - 2), rounded up to a
        quarter of N (at most 4 chunk programs), at most P + N. With k dividing N/4 a full batch
        steps through the static sampler's phase widths exactly."""
        live = ~self._done
        if self._parked:  # a waiting row's last column stays in the window: a step's clamped write never lands
            live = live.copy()  # on its K/V (see _decode_chunk)
            live[list(self._parked.values())] = True
        need = int(self._emitted[live].max()) + k - 1 if live.any() else 1
        quarter = -(-self.max_new_tokens // 4)
        return self.prompt_len + min(self.max_new_tokens, -(-need // quarter) * quarter)

    def _live_slots(self) -> np.ndarray:
        """The slots a chunk runs on: all S while more than S/2 are live, else the live ones
        padded with stopped or free ones to the next power of two (at least S/8): at most four
        batch sizes, each its own program."""
        live = np.flatnonzero(~self._done)
        b = self.slots
        while self.narrow_drain and b // 2 >= max(len(live), 1) and b // 2 >= self.slots // 8 and b % 2 == 0:
            b //= 2
        if b == self.slots:
            return np.arange(b, dtype=np.int32)
        idle = self._done.copy()
        idle[list(self._parked.values())] = False
        rest = np.concatenate([np.flatnonzero(idle), list(self._parked.values())]).astype(np.int64)[:b - len(live)]
        return np.concatenate([live, rest]).astype(np.int32)

    def _lockstep(self) -> bool:
        """Whether every live row has drawn as many tokens as the others (then the chunk writes
        one cache column for all rows)."""
        return self.lockstep_writes and not self._parked and len(set(self._emitted[~self._done].tolist())) == 1

    def _start_queued(self) -> None:
        """Starts queued groups in free slots, in submission order: rows already waiting for
        slots first; then, while none waits, every group whose G rows all find slots, prefilled
        straight into them; then a group that only partly fits, prefilled into a prefix entry
        from which its rows are placed as slots free up."""
        placed = self._place_waiting()
        if not self._waiting and self.start_whole_groups:
            placed |= self._start_whole(min(len(self._queue), self.free_slots() // self.group_size))
        if self._prefill_queued():
            placed |= self._place_waiting()
        if placed:
            self._done, self._emitted = jax.device_get((self.pool.done, self.pool.emitted))

    def _start_whole(self, n: int) -> bool:
        """Prefills the next `n` queued groups and starts their rows in the lowest free slots,
        with no prefix entry between (calls of 2^k groups)."""
        g_size = self.group_size
        for part in _powers_of_two([self._queue.popleft() for _ in range(n)]):
            free = [s for s, row in enumerate(self._slot_row) if row is None][:len(part) * g_size]
            for i, g in enumerate(part):
                for j in range(g_size):
                    self._slot_row[free[i * g_size + j]] = (g, j)
                g.to_place = g_size
            tokens, mask = _prompts(part)
            self.pool, prefilled = self._start(self.params, self.pool, tokens, mask, np.asarray(free, np.int32),
                                               self._put(_stack(*(g.prompt.key for g in part))),
                                               jnp.int32(self.version))
            self.stats.prefill_rows += int(prefilled)
            self.stats.prefill_calls += 1
            self._open.extend(part)
        return n > 0

    def _prefill_queued(self) -> bool:
        """Prefills queued groups into free prefix entries while the rows already waiting leave
        free slots for theirs, in calls of 2^k groups (one program per power of two)."""
        waiting_rows = sum(self.group_size - g.to_place for g in self._waiting)
        room = self.free_slots() - waiting_rows
        n = min(len(self._queue), len(self._free_entries), max(0, -(-room // self.group_size)))
        for part in _powers_of_two([self._queue.popleft() for _ in range(n)]):
            entries = [self._free_entries.pop(0) for _ in part]
            tokens, mask = _prompts(part)
            self.prefixes, prefilled = self._prefill(self.params, self.prefixes, tokens, mask,
                                                     np.asarray(entries, np.int32), jnp.int32(self.version))
            self.stats.prefill_rows += int(prefilled)
            self.stats.prefill_calls += 1
            self.stats.entry_groups += len(part)
            for g, e in zip(part, entries):
                g.entry = e
            self._waiting.extend(part)
            self._open.extend(part)
        return n > 0

    def _place_waiting(self) -> bool:
        """Puts waiting rows in the lowest free slots, in one call of a fixed size S (unused
        places point past the pool and are dropped)."""
        free = [s for s, row in enumerate(self._slot_row) if row is None]
        entry, row, slot, keys = [], [], [], []
        for g in self._waiting:
            while g.to_place < self.group_size and len(slot) < len(free):
                entry.append(g.entry)
                row.append(g.to_place)
                slot.append(free[len(slot)])
                keys.append(g.prompt.key)
                self._slot_row[slot[-1]] = (g, g.to_place)
                g.to_place += 1
        if not slot:
            return False
        unused = self.slots - len(slot)
        pad = lambda xs, fill: np.asarray(xs + [fill] * unused, np.int32)
        keys = self._put(_stack(*keys, *[keys[0]] * unused))
        self.pool = self._place(self.pool, self.prefixes, pad(entry, 0), pad(row, 0), pad(slot, self.slots), keys)
        for g in [g for g in self._waiting if g.to_place == self.group_size]:
            self._free_entries.append(g.entry)
            g.entry = -1
        self._free_entries.sort()
        self._waiting = [g for g in self._waiting if g.to_place < self.group_size]
        return True

    def _put(self, keys: jax.Array) -> jax.Array:
        """Keys made on the host's default device, replicated over the engine's mesh if it has one."""
        return keys if self._replicated is None else jax.device_put(keys, self._replicated)

    def _take_answers(self, wait: float) -> None:
        """Puts the environments' answers onto their waiting rows (in one call), or lets rows
        whose episode ended be taken out. An answer that leaves no room for a model token
        before the token limit cuts the episode there. Answers of more than one id are then
        prefilled (`_feed_answers`)."""
        resume = []
        for tag, j, ids in self.turns.answers(wait if self._parked else 0.0):
            s = self._parked.pop((tag, j))
            g, _ = self._slot_row[s]
            e = int(self._emitted[s])
            if ids is not None and e + len(ids) >= self.max_new_tokens:
                self.turns.ended(tag, j, np.zeros((0,), np.int32), cut=True)
                ids = None
            if ids is None:
                self._ending.add(s)
                continue
            g.env_cols.setdefault(j, []).append((e, e + len(ids)))
            g.turn_start[j] = e + len(ids)
            resume.append((s, list(ids)))
        if not resume:
            return
        b = self.slots  # one program for any number of rows (padding slots are dropped)
        width = max(8, 1 << (max(len(ids) for _, ids in resume) - 1).bit_length())
        slots = np.full((b,), self.slots, np.int32)
        ids = np.full((b, width), self.pad_id, np.int32)
        lengths = np.zeros((b,), np.int32)
        self._done = self._done.copy()  # the host's copy of the device's flags (read-only as fetched)
        for i, (s, new) in enumerate(resume):
            slots[i], lengths[i] = s, len(new)
            ids[i, :len(new)] = new
            self._done[s] = False
            self.stats.appended_tokens += len(new)
        self.pool = self._append(self.pool, slots, ids, lengths)
        if self.prefill_answers:
            self._prefill_answers([(s, len(new) - 1) for s, new in resume if len(new) > 1])

    def _prefill_answers(self, rows: list[tuple[int, int]]) -> None:
        """Runs `count` inputs of each (slot, count) row through the model, many rows a call
        (at most `answer_prefill_rows`): its last token and its answer's ids but the last two,
        whose K/V the row lacks. The row then stands before its answer's last id, which the next
        chunk feeds as before (one step, `forced_until`) before the step that draws. Calls are R
        rows x L inputs, both powers of two (L at least 4): a few programs, each compiled once."""
        for start in range(0, len(rows), self._answer_rows):
            self._prefill_answer_rows(rows[start:start + self._answer_rows])

    def _prefill_answer_rows(self, rows: list[tuple[int, int]]) -> None:
        r, length = answer_prefill_shape(len(rows), max(c for _, c in rows))
        slots = np.full((r,), self.slots, np.int32)  # padding rows point past the pool: dropped
        counts = np.zeros((r,), np.int32)
        self._emitted = self._emitted.copy()  # the host's copy of the device's (read-only as fetched)
        for i, (s, c) in enumerate(rows):
            slots[i], counts[i] = s, c
            self._emitted[s] += c
            self.stats.prefilled_tokens += c
        self.pool = self._feed(length, self.params, self.pool, slots, counts, jnp.int32(self.version))
        self.stats.answer_prefills += 1

    def _take_stopped(self) -> None:
        """Copies every stopped row out of its slot and frees the slot; groups whose rows have
        all stopped are complete, in submission order."""
        parked = set(self._parked.values())
        stopped = [s for s, row in enumerate(self._slot_row) if row is not None and self._done[s] and s not in parked]
        if not stopped:
            return
        # Gathered in a power-of-two count of rows (the first repeated), so the program is one of
        # log2(S) + 1 rather than one per count of stopped rows, each compiled mid-run.
        padded = stopped + stopped[:1] * ((1 << (len(stopped) - 1).bit_length()) - len(stopped))
        fields = jax.device_get(_gather(self.pool, np.asarray(padded, np.int32)))
        for k, s in enumerate(stopped):
            g, j = self._slot_row[s]
            if self.turns is not None and s not in self._ending:
                e, start = int(self._emitted[s]), g.turn_start.get(j, 0)
                turn = fields[0][k][self.prompt_len + start:self.prompt_len + e]
                ended = len(turn) > 0 and int(turn[-1]) in self.stop_ids
                self.turns.ended(g.prompt.tag, j, turn, cut=not ended,
                                 logprobs=fields[2][k][self.prompt_len + start:self.prompt_len + e])
                if ended:
                    self.stats.turns += 1
                    self._parked[(g.prompt.tag, j)] = s
                    continue
            self._ending.discard(s)
            g.rows[j] = tuple(None if f is None else f[k] for f in fields)
            self._slot_row[s] = None
        g_size = self.group_size
        for g in [g for g in self._open if len(g.rows) == g_size]:
            tokens, mask, logprobs, versions, routes = (
                None if g.rows[0][i] is None else np.stack([g.rows[j][i] for j in range(g_size)]) for i in range(5))
            completion = mask & (np.arange(mask.shape[1]) >= self.prompt_len)[None, :]
            for j, spans in g.env_cols.items():  # an environment's tokens are attended, never trained
                for start, end in spans:
                    completion[j, self.prompt_len + start:self.prompt_len + end] = False
            self._completed.append(CompletedGroup(
                g.prompt.tag, Rollout(tokens=tokens, attention_mask=mask, completion_mask=completion,
                                      logprobs=logprobs, routes=routes), token_versions=versions))
        self._open = [g for g in self._open if len(g.rows) < g_size]


def _powers_of_two(items: list) -> list[list]:
    """`items` cut, in order, into runs of 2^k (largest first): at most log2(n) + 1 call sizes,
    each one compiled program."""
    parts, start = [], 0
    for bit in reversed(range(len(items).bit_length())):
        if len(items) & (1 << bit):
            parts.append(items[start:start + (1 << bit)])
            start += 1 << bit
    return parts


def _prompts(groups: list[_Group]) -> tuple[np.ndarray, np.ndarray]:
    return (np.stack([np.asarray(g.prompt.tokens, np.int32) for g in groups]),
            np.stack([np.asarray(g.prompt.mask, bool) for g in groups]))


def _prefix_entries(slots: int, group_size: int) -> int:
    """The engine's prefix entries: enough prompts to fill every slot, and one more."""
    return -(-slots // group_size) + 1


def _power_of_two_at_least(n: int) -> int:
    return 1 << (n - 1).bit_length()


def answer_prefill_shape(rows: int, longest: int) -> tuple[int, int]:
    """(R, L) of the answer-prefill call for `rows` rows of at most `longest` inputs: both
    powers of two, L at least 4, so that a run compiles a few programs, each once."""
    return _power_of_two_at_least(rows), max(4, _power_of_two_at_least(longest))


def answer_prefill_rows(slots: int, mesh: Optional[Mesh] = None) -> int:
    """The most rows one answer-prefill call takes: the pool's rows on one data-parallel device
    (all of them without a mesh), a power of two. The call gathers its rows' cache, and XLA holds
    that gather, and runs those rows, whole on every device (measured on TPU v5e: 5.3x the
    pool's per-device cache for every slot's row at once): more rows a call would cost each device
    more than its share of the pool."""
    if mesh is None:
        return _power_of_two_at_least(slots)
    per_device = max(1, slots // sharding.data_parallelism(mesh))
    return 1 << (per_device.bit_length() - 1)


def largest_answer_prefill(slots: int, max_new_tokens: int, mesh: Optional[Mesh] = None) -> Optional[tuple[int, int]]:
    """(R, L) of the largest answer-prefill call a pool of `slots` on `mesh` makes: as many rows as
    one call takes (`answer_prefill_rows`), each with the longest answer a row can take (it has
    drawn a token, and keeps room for one more), of which all ids but the last are inputs. None:
    no answer is ever prefilled."""
    longest = max_new_tokens - 3
    return answer_prefill_shape(answer_prefill_rows(slots, mesh), longest) if longest >= 1 else None


class EnginePrograms(NamedTuple):
    """The engine's jitted programs (see `programs` for their arguments)."""

    prefill: Any  # prompts into prefix entries
    place: Any  # waiting rows from prefix entries into slots
    start: Any  # prompts straight into their rows' slots
    decode: Any  # one chunk of decode steps
    append: Any  # environment tokens onto waiting rows (multi-turn)
    feed: Any  # answers' tokens prefilled onto their rows (multi-turn)


def _route_shape(cfg: ModelConfig, record_routes: bool) -> Optional[tuple[int, int]]:
    """(sparse layers, k) of the routes a row records, or None: not asked for, or no experts."""
    sparse = moe.sparse_layers(cfg)
    return (len(sparse), cfg.experts_per_token) if record_routes and sparse else None


@functools.lru_cache(maxsize=32)
def _programs(graphdef, cfg: ModelConfig, g: int, p: int, n_new: int, k_steps: int, draw: tuple, stop_ids: tuple,
              pad_id: int, kv_cache_dtype, prefill_chunk_size: int, layout: Optional[tuple] = None,
              routes: Optional[tuple[int, int]] = None):
    """The jitted programs of one engine shape, shared by engines of that shape (jit caches
    compiled programs per function object). With a `layout` (`_layout`'s), each program writes
    the pool and the prefix entries back in it, so the state keeps its layout. `routes`
    (`_route_shape`'s): the state records them, and every program that runs the model writes them."""
    greedy, temperature, top_k, top_p, live_vocab = draw
    choose = functools.partial(choose_token, greedy=greedy, temperature=temperature, top_k=top_k, top_p=top_p,
                               live_vocab=live_vocab)
    stops = np.asarray(stop_ids, np.int32).reshape(-1)
    pool_out, prefix_out = layout or (None, None)
    scalar = None if layout is None else jax.tree.leaves(prefix_out)[0]  # the prefix entries are replicated
    mesh = None if layout is None else scalar.mesh
    prefill = functools.partial(_prefill_prompts, graphdef, cfg, kv_cache_dtype, prefill_chunk_size,
                                functools.partial(constrain_cache, mesh), routes)
    place = functools.partial(_place_rows, choose, stops, p, n_new, pad_id)
    return EnginePrograms(
        prefill=jax.jit(functools.partial(_prefill_entries, prefill), donate_argnums=1,
                        out_shardings=None if layout is None else (prefix_out, scalar)),
        place=jax.jit(place, donate_argnums=0, out_shardings=pool_out),
        start=jax.jit(functools.partial(_start_groups, prefill, place, g), donate_argnums=1,
                      out_shardings=None if layout is None else (pool_out, scalar)),
        decode=jax.jit(functools.partial(_decode_chunk, graphdef, cfg, choose, stops, p, n_new, 2 * k_steps),
                       static_argnums=(0, 1), donate_argnums=3,
                       out_shardings=None if layout is None else (pool_out, scalar)),
        append=jax.jit(functools.partial(_append_tokens, p), donate_argnums=0, out_shardings=pool_out),
        feed=jax.jit(functools.partial(_feed_answers, graphdef, p, prefill_chunk_size,
                                       functools.partial(constrain_cache, mesh)), static_argnums=0,
                     donate_argnums=2, out_shardings=pool_out))


def _layout(mesh: Optional[Mesh], cfg: ModelConfig, slots: int, entries: int, p: int, n_new: int,
            kv_cache_dtype, routes: Optional[tuple[int, int]] = None) -> Optional[tuple[Pool, Prefixes]]:
    """The engine's state over `mesh` (None: no mesh), as shardings shaped like (Pool, Prefixes):
    the pool's rows split like a batch and its cache like the static sampler's (slots over the
    data-parallel axes, kv heads over tensor), so a pool S slots wide costs each device what a
    batch of S rows does; the few prefix entries replicated."""
    if mesh is None:
        return None
    return state_shardings(mesh, *_abstract(cfg, slots, entries, p, n_new, kv_cache_dtype, routes))


def state_shardings(mesh: Mesh, pool: Pool, prefixes: Prefixes) -> tuple[Pool, Prefixes]:
    """Shardings for the engine's state (`abstract_state`'s shapes) over `mesh`; see `_layout`."""
    rows = lambda x: sharding.logical_sharding(mesh, ("batch",) + (None,) * (len(x.shape) - 1), x.shape)
    cache = lambda x: sharding.cache_sharding(mesh, KV_CACHE_AXES, x.shape)
    rep = sharding.replicated(mesh)
    return (pool._replace(cache=jax.tree.map(cache, pool.cache),
                          **{f: jax.tree.map(rows, getattr(pool, f)) for f in pool._fields if f != "cache"}),
            jax.tree.map(lambda _: rep, prefixes))


def programs(graphdef, cfg: ModelConfig, *, group_size: int, prompt_len: int, max_new_tokens: int,
             chunk_steps: int = 8, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, greedy: bool = False,
             stop_ids: Sequence[int] = (), pad_id: int = 0, kv_cache_dtype: Optional[str] = None,
             prefill_chunk_size: int = 0, live_vocab: int = 0, mesh: Optional[Mesh] = None, slots: int = 0,
             record_routes: bool = False):
    """The engine's jitted programs, as `JaxEngine` runs them (with a `mesh`, laid out as an engine
    of `slots` slots on it lays out its state):
    `prefill(params, prefixes, tokens [n, P], mask [n, P], entries [n], version)`,
    `place(pool, prefixes, entries [S], rows [S], slots [S], group keys [S])`,
    `start(params, pool, tokens [n, P], mask [n, P], slots [n * G], group keys [n], version)`,
    `decode(width, lockstep, params, pool, slots [b], steps, version)` (width and lockstep static,
    steps at most 2 x chunk_steps),
    `append(pool, slots [b], ids [b, w], lengths [b])` and
    `feed(length, params, pool, slots [R], counts [R], version)` (multi-turn; length static).
    What `jaxreplay compile` lowers, with `abstract_state`'s arrays."""
    if mesh is not None and slots <= 0:
        raise ValueError("a mesh needs the engine's slots: the layout depends on them")
    routes = _route_shape(cfg, record_routes)
    return _programs(graphdef, cfg, group_size, prompt_len, max_new_tokens, chunk_steps,
                     (bool(greedy), float(temperature), int(top_k), float(top_p), int(live_vocab)),
                     tuple(int(s) for s in stop_ids), pad_id, kv_cache_dtype, prefill_chunk_size,
                     _layout(mesh, cfg, slots, _prefix_entries(slots, group_size), prompt_len, max_new_tokens,
                             kv_cache_dtype, routes), routes)


def abstract_state(cfg: ModelConfig, slots: int, group_size: int, prompt_len: int, max_new_tokens: int,
                   kv_cache_dtype: Optional[str] = None, *, record_routes: bool = False) -> tuple[Pool, Prefixes, int]:
    """The pool's and the prefix entries' shapes and dtypes (nothing allocated), and the most
    prompts one prefill call takes (the largest power of two up to the entries)."""
    entries = _prefix_entries(slots, group_size)
    pool, prefixes = _abstract(cfg, slots, entries, prompt_len, max_new_tokens, kv_cache_dtype,
                               _route_shape(cfg, record_routes))
    return pool, prefixes, 1 << (entries.bit_length() - 1)


def _abstract(cfg: ModelConfig, slots: int, entries: int, p: int, n_new: int, kv_cache_dtype,
              routes: Optional[tuple[int, int]]) -> tuple[Pool, Prefixes]:
    return jax.eval_shape(lambda: (_empty_pool(cfg, slots, p, n_new, 0, kv_cache_dtype, routes),
                                   _empty_prefixes(cfg, entries, p, 0, kv_cache_dtype, routes)))


@jax.jit
def _stack(*keys: jax.Array) -> jax.Array:
    """The groups' keys as one array: one dispatch, where `jnp.stack` makes one per key."""
    return jnp.stack(keys)


@jax.jit
def _gather(pool: Pool, rows: jax.Array):
    return (pool.tokens[rows], pool.mask[rows], pool.logprobs[rows], pool.versions[rows],
            None if pool.routes is None else pool.routes[rows])


def pool_cache_bytes(model_cfg: ModelConfig, slots: int, prompt_len: int, max_new_tokens: int,
                     kv_cache_dtype: Optional[str] = None) -> int:
    """Bytes of the pool's KV cache: every slot holds P + N columns, allocated once. The static
    sampler's cache at batch S reaches the same size only in its last decode phase."""
    itemsize = jnp.dtype(dtype_of(kv_cache_dtype or model_cfg.compute_dtype)).itemsize
    return 2 * model_cfg.n_layers * slots * model_cfg.n_kv_heads * (prompt_len + max_new_tokens) * \
        model_cfg.head_dim * itemsize


def _no_routes(shape: Optional[tuple[int, int]], *lead: int) -> Optional[jax.Array]:
    """[*lead, L_sparse, k] of `NO_ROUTE` (None where routes are not recorded)."""
    return None if shape is None else jnp.full((*lead, *shape), NO_ROUTE, jnp.int16)


def _empty_pool(cfg: ModelConfig, slots: int, p: int, n: int, pad_id: int, kv_cache_dtype,
                routes: Optional[tuple[int, int]] = None) -> Pool:
    length = p + n
    return Pool(cache=init_cache(cfg, slots, length, kv_cache_dtype),
                tokens=jnp.full((slots, length), pad_id, jnp.int32), mask=jnp.zeros((slots, length), bool),
                logprobs=jnp.zeros((slots, length), jnp.float32), versions=jnp.full((slots, n), -1, jnp.int32),
                n_prompt=jnp.zeros((slots,), jnp.int32), emitted=jnp.zeros((slots,), jnp.int32),
                done=jnp.ones((slots,), bool), keys=jax.random.split(jax.random.key(0), slots),
                forced_until=jnp.zeros((slots,), jnp.int32), routes=_no_routes(routes, slots, length))


def _stopped(token: jax.Array, stops: np.ndarray) -> jax.Array:
    return (token[:, None] == stops[None, :]).any(axis=-1) if stops.size else jnp.zeros(token.shape, bool)


def _empty_prefixes(cfg: ModelConfig, entries: int, p: int, pad_id: int, kv_cache_dtype,
                    routes: Optional[tuple[int, int]] = None) -> Prefixes:
    return Prefixes(cache=init_cache(cfg, entries, p, kv_cache_dtype),
                    logits=jnp.zeros((entries, cfg.vocab_size), jnp.float32),
                    tokens=jnp.full((entries, p), pad_id, jnp.int32), mask=jnp.zeros((entries, p), bool),
                    version=jnp.zeros((entries,), jnp.int32), routes=_no_routes(routes, entries, p))


def _prefill_prompts(graphdef, cfg: ModelConfig, kv_cache_dtype, prefill_chunk_size: int, constrain,
                     route_shape: Optional[tuple[int, int]], params, tokens, mask, version) -> Prefixes:
    """Prefills `tokens`/`mask` [n, P], one row per prompt (not per completion): n prefixes."""
    n, p = tokens.shape
    model = nnx.merge(graphdef, params)
    mask = mask.astype(bool)
    cache = constrain(init_cache(cfg, n, p, kv_cache_dtype))
    h, cache, routes = _prefill(model, tokens, positions_from_mask(mask), mask, cache, prefill_chunk_size, constrain,
                                _no_routes(route_shape, n, p))
    if routes is not None:  # the left padding ran through the model too; its routes are none
        routes = jnp.where(mask[:, :, None, None], routes, jnp.int16(NO_ROUTE))
    return Prefixes(cache=cache, logits=model.unembed(h)[:, 0], tokens=tokens.astype(jnp.int32), mask=mask,
                    version=jnp.full((n,), version, jnp.int32), routes=routes)


def _prefill_entries(prefill, params, prefixes: Prefixes, tokens, mask, entries, version) -> tuple[Prefixes, jax.Array]:
    """Prefills [n, P] prompts into prefix `entries` [n]. Also returns how many rows went through
    the model (what `EngineStats` counts)."""
    new = prefill(params, tokens, mask, version)
    return jax.tree.map(lambda buf, x: buf.at[entries].set(x.astype(buf.dtype)), prefixes, new), \
        jnp.int32(tokens.shape[0])


def _start_groups(prefill, place, g: int, params, pool: Pool, tokens, mask, slots, group_keys,
                  version) -> tuple[Pool, jax.Array]:
    """Prefills [n, P] prompts and starts row j of prompt i in `slots[i * g + j]`: what prefill
    and place do, without writing the prompts' K/V to prefix entries and copying it out again."""
    n = tokens.shape[0]
    entry = jnp.repeat(jnp.arange(n), g)
    return place(pool, prefill(params, tokens, mask, version), entry, jnp.tile(jnp.arange(g), n), slots,
                 group_keys[entry]), jnp.int32(n)


def _place_rows(choose, stops, p: int, n_new: int, pad_id: int, pool: Pool, prefixes: Prefixes, entry, row, slot,
                group_keys) -> Pool:
    """Row `row[i]` of the prompt in prefix `entry[i]` starts in pool slot `slot[i]` (slots past
    the pool are dropped): the prompt's K/V copied in, its first token drawn from the prompt's
    logits with the row's key, fold_in(fold_in(group key, row), 0)."""
    row_keys = jax.vmap(jax.random.fold_in)(group_keys, row)
    token, logp = choose(prefixes.logits[entry], jax.vmap(jax.random.fold_in)(row_keys, jnp.zeros_like(row)))
    n = slot.shape[0]
    length = p + n_new
    put = lambda buf, new: buf.at[slot].set(new.astype(buf.dtype), mode="drop")
    first = jnp.zeros((n, length), bool).at[:, p].set(True)
    return Pool(
        cache=KVCache(*(tuple(a.at[slot, :, :p].set(b[entry].astype(a.dtype), mode="drop") for a, b in zip(pa, pb))
                        for pa, pb in ((pool.cache.k, prefixes.cache.k), (pool.cache.v, prefixes.cache.v)))),
        tokens=put(pool.tokens, jnp.full((n, length), pad_id, jnp.int32).at[:, :p].set(prefixes.tokens[entry])
                   .at[:, p].set(token)),
        mask=put(pool.mask, first.at[:, :p].set(prefixes.mask[entry])),
        logprobs=put(pool.logprobs, jnp.where(first, logp[:, None], 0.0)),
        versions=put(pool.versions, jnp.full((n, n_new), -1, jnp.int32).at[:, 0].set(prefixes.version[entry])),
        n_prompt=put(pool.n_prompt, prefixes.mask[entry].sum(axis=-1)),
        emitted=put(pool.emitted, jnp.ones((n,), jnp.int32)),
        done=put(pool.done, _stopped(token, stops) | (n_new == 1)),
        keys=put(pool.keys, row_keys),
        forced_until=put(pool.forced_until, jnp.zeros((n,), jnp.int32)),
        routes=None if pool.routes is None else put(
            pool.routes, jnp.full((n, length, *pool.routes.shape[2:]), NO_ROUTE, jnp.int16).at[:, :p].set(
                prefixes.routes[entry])),
    )


def _append_tokens(p: int, pool: Pool, slots, ids, lengths) -> Pool:
    """Environment ids [b, L] (the first `lengths` [b] of each row) into the completion columns
    after each waiting row's last token; the rows decode again, feeding them first (one per
    step, `forced_until`, after `_feed_answers` ran all but the last) and drawing after.
    Slots past the pool are padding and dropped."""
    emitted = pool.emitted.at[slots].get(mode="fill", fill_value=0)
    cols = p + emitted[:, None] + jnp.arange(ids.shape[1])[None, :]
    cols = jnp.where(jnp.arange(ids.shape[1])[None, :] < lengths[:, None], cols, pool.tokens.shape[1])
    rows = jnp.broadcast_to(slots[:, None], cols.shape)
    return pool._replace(tokens=pool.tokens.at[rows, cols].set(ids, mode="drop"),
                         forced_until=pool.forced_until.at[slots].set(emitted + lengths, mode="drop"),
                         done=pool.done.at[slots].set(False, mode="drop"))


def _feed_answers(graphdef, p: int, chunk: int, constrain, length: int, params, pool: Pool, slots, counts,
                  version) -> Pool:
    """The rows in `slots` [R] (past the pool: padding, dropped) run `counts` [R] (at most
    `length`) inputs through the model at once from their last token's column on: K/V written
    in those columns, the tokens after them (the answer's, already in place) become the row's,
    as the decode steps that fed them would have made them (log-prob 0, this version). With
    `chunk` > 0, `chunk` inputs at a time. The rows' cache is gathered with `length` spare
    columns, so a write never runs past its end (where it would be moved back onto real ones),
    and laid out by `constrain` as the pool's (on 4 CPU devices, a third of the temporaries of
    XLA's own choice; on TPU no change)."""
    model = nnx.merge(graphdef, params)
    n_cols = pool.tokens.shape[1]
    if 0 < chunk < length:
        length = -(-length // chunk) * chunk
    take = jnp.minimum(slots, pool.tokens.shape[0] - 1)
    emitted, n_prompt = pool.emitted[take], pool.n_prompt[take]
    first = p + emitted - 1  # the column of the row's last token: the first input
    offsets = jnp.arange(length)[None, :]
    spare = lambda x, axis: jnp.pad(x, [(0, length if a == axis else 0) for a in range(x.ndim)])
    inputs = jnp.take_along_axis(spare(pool.tokens[take], 1), first[:, None] + offsets, axis=1)
    positions = (n_prompt + emitted - 1)[:, None] + offsets
    col = jnp.arange(n_cols + length)[None, :]
    new = (col > first[:, None]) & (col <= (first + counts)[:, None])  # the columns the inputs' steps would fill
    mask = spare(pool.mask[take], 1) | new
    cache = constrain(jax.tree.map(lambda x: spare(x[take], 2), pool.cache))
    routes = None if pool.routes is None else spare(pool.routes[take], 1)

    def record(routes, routing, start):
        """The experts of inputs `start`.. (each row's first `counts` only) into their own columns."""
        if routes is None:
            return None
        ran = _as_routes(routing)  # [R, T, L_sparse, k]
        offset = start + jnp.arange(ran.shape[1])[None, :]
        cols = jnp.where(offset < counts[:, None], first[:, None] + offset, routes.shape[1])  # past the end: dropped
        return routes.at[jnp.arange(ran.shape[0])[:, None], cols].set(ran, mode="drop")

    if 0 < chunk < length:

        def one(k, carry):
            part = lambda x: jax.lax.dynamic_slice_in_dim(x, k * chunk, chunk, axis=1)
            _, cache, routing = model.routed_hidden(part(inputs), part(positions), mask, carry[0], first + k * chunk)
            return cache, record(carry[1], routing, k * chunk)

        cache, routes = jax.lax.fori_loop(0, length // chunk, one, (cache, routes))
    else:
        _, cache, routing = model.routed_hidden(inputs, positions, mask, cache, first)
        routes = record(routes, routing, 0)
    new = new[:, :n_cols]
    put = lambda buf, value: buf.at[slots].set(value.astype(buf.dtype), mode="drop")
    return pool._replace(
        cache=jax.tree.map(lambda full, rows: put(full, rows[:, :, :n_cols]), pool.cache, cache),
        mask=put(pool.mask, mask[:, :n_cols]),
        logprobs=put(pool.logprobs, jnp.where(new, 0.0, pool.logprobs[take])),
        versions=put(pool.versions, jnp.where(new[:, p:], version, pool.versions[take])),
        emitted=put(pool.emitted, emitted + counts),
        routes=None if routes is None else put(pool.routes, routes[:, :n_cols]))


def _decode_chunk(graphdef, cfg: ModelConfig, choose, stops, p: int, n_new: int, k_max: int, width: int,
                  lockstep: bool, params, full_pool: Pool, slots, k_steps, version) -> tuple[Pool, jax.Array]:
    """Up to `k_steps` (traced, at most `k_max`) decode steps of every live row (fewer once all
    have stopped): each runs the model on the row's last token, writes its K/V in the row's own
    column and draws the next token. Rows that stopped, and free slots, keep their contents.
    Returns the steps run.

    Attention reads only the cache's first `width` columns (every live row must fit in them for
    the whole chunk): on CPU a step at 544 columns cost ~5x one at 160, measured.

    `lockstep`: every live row has drawn as many tokens as every other (the host checked), so
    they stay in step for the whole chunk and each step writes one column for all rows, as the
    static sampler does (one dynamic-update-slice, not a per-row scatter). A stopped row or a
    free slot gets that column written too, past its end: nothing reads it before a placement.

    `slots` [b] (distinct; every live row among them): the chunk runs on those b slots only, as
    a batch of b, and writes them back. Once the queue is empty and the pool drains, a few live
    rows no longer pay for a full pool's steps. b = S: every slot in order, nothing moved."""
    model = nnx.merge(graphdef, params)
    compact = slots.shape[0] < full_pool.tokens.shape[0]
    pool = jax.tree.map(lambda x: x[slots], full_pool._replace(cache=None)) if compact else full_pool
    rows = jnp.arange(pool.tokens.shape[0])
    window = jax.tree.map(lambda x: (x[slots] if compact else x)[:, :, :width], full_pool.cache)
    # Every live row draws one token a step, so step k's RoPE positions are known at the start:
    # computed once here, a slice in the loop (as the static sampler does).
    rotations = rotation((pool.n_prompt + pool.emitted - 1)[:, None] + jnp.arange(k_max)[None, :], cfg)
    # So are its keys: step k's draw uses fold_in(row key, emitted + k). Drawn here in one batch,
    # the uniforms cost a few percent less than a fold_in and a draw per row inside every step
    # (greedy decoding never reads them, and XLA drops them).
    step_keys = jax.vmap(jax.vmap(jax.random.fold_in, (None, 0)))(pool.keys, pool.emitted[:, None] + jnp.arange(k_max))
    ahead = uniforms(step_keys.reshape(-1), step_keys.size).reshape(*step_keys.shape, 2)  # [b, k_max, 2]

    def step(carry):
        k, pool, window = carry
        live = ~pool.done
        if lockstep:
            # every live row's column; all rows done cannot happen inside the loop
            col = jnp.max(jnp.where(live, pool.emitted, 0))
            last = p + col - 1
            token = jax.lax.dynamic_slice_in_dim(pool.tokens, last, 1, axis=1)
            index = jnp.minimum(last, width - 1)
        else:
            last = p + pool.emitted - 1  # the column of the last token drawn
            token = pool.tokens[rows, last][:, None]
            # A stopped or free row's write lands in a column past its end (clamped into the window):
            # nothing reads its cache again before a placement rewrites it.
            index = jnp.minimum(last, width - 1)
        rot = Rotation(*(jax.lax.dynamic_slice_in_dim(x, k, 1, axis=1) for x in rotations))
        h, window, routing = model.routed_hidden(token, rot, pool.mask[:, :width], window, index)
        routes = pool.routes
        if routes is not None:  # the input token's experts, in its own column (live rows only)
            ran = _as_routes(routing)[:, 0]
            if lockstep:
                old = jax.lax.dynamic_index_in_dim(routes, last, axis=1, keepdims=False)
                routes = jax.lax.dynamic_update_slice_in_dim(
                    routes, jnp.where(live[:, None, None], ran, old)[:, None], last, axis=1)
            else:
                routes = routes.at[rows, last].set(jnp.where(live[:, None, None], ran, routes[rows, last]))
        new, logp = choose(model.unembed(h)[:, 0], jax.lax.dynamic_index_in_dim(ahead, k, axis=1, keepdims=False))
        # An environment's token (multi-turn): fed in its column, not drawn; log-prob 0, never a stop.
        forced = pool.emitted < pool.forced_until
        if lockstep:
            col = jnp.minimum(col, n_new - 1)
            new = jnp.where(forced, jax.lax.dynamic_slice_in_dim(pool.tokens, p + col, 1, axis=1)[:, 0], new)
        else:
            new = jnp.where(forced, pool.tokens[rows, p + jnp.minimum(pool.emitted, n_new - 1)], new)
        logp = jnp.where(forced, 0.0, logp)
        if lockstep:

            def keep(buf, value, offset=p):
                old = jax.lax.dynamic_slice_in_dim(buf, offset + col, 1, axis=1)[:, 0]
                return jax.lax.dynamic_update_slice_in_dim(
                    buf, jnp.where(live, value, old).astype(buf.dtype)[:, None], offset + col, axis=1)
        else:
            col = jnp.minimum(pool.emitted, n_new - 1)  # a live row has drawn fewer than N tokens
            keep = lambda buf, value, offset=p: buf.at[rows, offset + col].set(
                jnp.where(live, value, buf[rows, offset + col]))
        emitted = pool.emitted + live
        pool = pool._replace(
            tokens=keep(pool.tokens, new), mask=keep(pool.mask, live),
            logprobs=keep(pool.logprobs, logp), versions=keep(pool.versions, version, 0), emitted=emitted,
            done=pool.done | (live & ((_stopped(new, stops) & ~forced) | (emitted >= n_new))), routes=routes)
        return k + 1, pool, window

    k, pool, window = jax.lax.while_loop(lambda c: (c[0] < k_steps) & ~jnp.all(c[1].done), step,
                                         (jnp.int32(0), pool._replace(cache=None), window))
    if compact:
        cache = jax.tree.map(lambda full, w: full.at[slots, :, :width].set(w), full_pool.cache, window)
        pool = jax.tree.map(lambda full, part: full.at[slots].set(part), full_pool._replace(cache=None), pool)
    else:
        cache = jax.tree.map(lambda full, w: full.at[:, :, :width].set(w), full_pool.cache, window)
    return pool._replace(cache=cache), k
