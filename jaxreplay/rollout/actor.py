"""The actor: sample G completions per prompt, score them, freeze their advantages.

Everything the learner needs later is fixed here, at generation time: the
behaviour log-probs, the group-normalised advantage and the policy version that
made the rollout. A rollout replayed many steps later keeps all three.

Two actors, chosen by `sampling.engine`: `Actor` generates a whole prompt batch in one
static sampler call; `StreamingActor` streams prompt groups through a rollout engine's
slot pool (engine.py), one decode chunk per call, scoring each group as it completes.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Callable, Mapping, Optional, Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from jaxreplay.config import Config, ConfigError, owner_check
from jaxreplay.rollout.advantages import ADVANTAGES
from jaxreplay.rollout.engine import JaxEngine, PromptGroup, RolloutEngine
from jaxreplay.rollout.episodes import EPISODE_ERRORS, EpisodeRunner
from jaxreplay.rollout.rollouts import ROUTES, make_rows, records_routes, row_spec
from jaxreplay.rollout.sampling import Rollout, completion_ids
from jaxreplay.tasks.base import Task, score
from jaxreplay.tasks.chat import chat_format_for
from jaxreplay.tasks.environment import EnvPool, resolve

SampleFn = Callable[..., Rollout]


class Actor:
    def __init__(self, config: Config, task: Task, sample_fn: SampleFn, *, shard: tuple[int, int] = (0, 1)):
        """shard (i, n): act on the i-th of n equal slices of every prompt batch. Multi-host
        SPMD gives each process its own slice; `sample_fn` then sees only that slice."""
        self.config = config
        self.task = task
        self.sample_fn = sample_fn
        self.shard = shard
        self._base_key = jax.random.PRNGKey(config.run.seed)
        self.spec = row_spec(config, task.prompt_len)

    def act(self, params, policy_version: int, actor_step: int) -> tuple[dict[str, np.ndarray], dict[str, float]]:
        """Rollouts for the `actor_step`-th prompt batch; deterministic given params and step."""
        c = self.config
        group = c.train.group_size
        start = time.perf_counter()
        problems = self.task.train_problems(c.run.seed, actor_step, c.train.prompts_per_step)
        index, count = self.shard
        per_shard = len(problems) // count
        problems = problems[index * per_shard:(index + 1) * per_shard]
        prompts, prompt_mask = self.task.encode_prompts(problems)
        prompts, prompt_mask = np.repeat(prompts, group, axis=0), np.repeat(prompt_mask, group, axis=0)
        key = jax.random.fold_in(self._base_key, actor_step)
        rollout = jax.device_get(self.sample_fn(params, prompts, prompt_mask, key))

        rewards, reward_errors = score(self.task, problems, completion_ids(rollout), group)
        advantages = ADVANTAGES[c.train.advantage](rewards.reshape(-1, group)).reshape(-1)
        items = make_rows(
            self.spec, tokens=rollout.tokens, attention_mask=rollout.attention_mask,
            completion_mask=rollout.completion_mask, logprobs=rollout.logprobs, advantage=advantages,
            reward=rewards, policy_version=np.full(len(rewards), policy_version),
            rollout_id=rollout_ids(actor_step, index * per_shard * group, len(rewards), c.rollouts_per_step),
            **({ROUTES: rollout.routes} if ROUTES in self.spec else {}))
        return items, {**rollout_stats(items), "reward/errors": reward_errors, "seconds": time.perf_counter() - start}


def rollout_ids(actor_step: int, first_row: int, n: int, rollouts_per_step: int) -> np.ndarray:
    """Ids unique over the run and every process: the row's place in all rollouts ever generated."""
    ids = actor_step * rollouts_per_step + first_row + np.arange(n, dtype=np.int64)
    if ids[-1] >= 2**31:
        raise OverflowError(f"rollout ids past 2^31 at actor step {actor_step}: rollout_id is int32")
    return ids


def rollout_stats(rows: Mapping[str, np.ndarray]) -> dict[str, float]:
    """What a batch of rollouts says about the policy that generated it."""
    rewards, lengths = rows["reward"], rows["completion_mask"].sum(axis=1)
    return {"reward_mean": float(rewards.mean()), "reward_std": float(rewards.std()),
            "accuracy": float((rewards == 1.0).mean()), "completion_length": float(lengths.mean()),
            "tokens": int(lengths.sum())}


# -- streaming through a rollout engine --------------------------------------------------------------


@owner_check
def check_engine(c: Config) -> None:
    """`sampling.engine` and its pool: the slots hold at least one group."""
    s = c.sampling
    if s.engine != "continuous":
        return
    if s.engine_slots and s.engine_slots < c.train.group_size:
        raise ConfigError(f"sampling.engine_slots: {s.engine_slots} slots cannot hold one group of "
                          f"train.group_size={c.train.group_size} rows")


def engine_slots(c: Config, processes: int = 1) -> int:
    """The pool's slots: `sampling.engine_slots`, or one prompt batch's rows of this process."""
    return c.sampling.engine_slots or c.train.prompts_per_step // processes * c.train.group_size


def groups_in_flight(c: Config, processes: int = 1) -> int:
    """Groups the actor keeps submitted and not yet complete: enough to fill every slot, and one
    more prefilled and ready as slots free up."""
    return math.ceil(engine_slots(c, processes) / c.train.group_size) + 1


def waiting_bound(c: Config, processes: int = 1) -> int:
    """The most rollouts that wait for the table: the schedules decode a chunk only when none
    wait, and one chunk completes at most every group in flight."""
    return groups_in_flight(c, processes) * c.train.group_size


def waiting_capacity(c: Config, processes: int = 1) -> int:
    """The rollouts a checkpoint holds waiting for the table, on each process: one prompt batch's,
    or streaming, also `waiting_bound`'s."""
    per_step = c.rollouts_per_step // processes
    return max(per_step, waiting_bound(c, processes)) if c.sampling.engine == "continuous" else per_step


@dataclasses.dataclass(frozen=True)
class Position:
    """Where a streaming actor stands in its process's prompt stream: `started` groups submitted
    (group k is prompt k % n of actor step k // n, n prompts per process per step), of which
    `in_flight` (in submission order) are not complete. A checkpoint holds it; a resume submits
    the groups in flight again, from their first token, and continues at `started`."""

    started: int = 0
    in_flight: tuple[int, ...] = ()


class StreamingActor:
    """The actor over a `RolloutEngine`: each `advance` keeps `groups_in_flight` groups submitted,
    decodes one chunk under the weights it is given, and returns the rows of the groups that
    completed, scored, with their advantages frozen. Every decision is a function of the
    submissions and the tokens drawn, never of the clock.

    Row j of group k draws with the typed key fold_in(fold_in(key(seed), actor step), prompt),
    folded by the engine with j and the token's place, so a regenerated group draws the same keys.
    A row's `policy_version` is the version of its first token (staleness counts from it), its
    `last_version` that of its last."""

    def __init__(self, config: Config, task: Task, engine: RolloutEngine, *, shard: tuple[int, int] = (0, 1),
                 episodes: Optional[EpisodeRunner] = None):
        """`episodes`: multi-turn (environment.name): each group's prompt is its environments'
        first observation and its rewards are the episodes' (the engine must take its turns)."""
        self.config, self.task, self.engine, self.shard, self.episodes = config, task, engine, shard, episodes
        self.per_shard = config.train.prompts_per_step // shard[1]
        self.capacity = groups_in_flight(config, shard[1])
        self.spec = row_spec(config, task.prompt_len)
        self._base_key = jax.random.key(config.run.seed)
        self._started, self._in_flight = 0, []
        self._problems: dict[int, list] = {}  # actor step -> its prompt batch (the latest few)

    @property
    def position(self) -> Position:
        return Position(self._started, tuple(self._in_flight))

    def resume(self, position: Position) -> None:
        """Continues from a checkpoint's position: its groups in flight are submitted again first."""
        if self._started or self._in_flight:
            raise RuntimeError("resume() is for a fresh actor")
        self._started = position.started
        self._submit(list(position.in_flight))

    def restart(self) -> None:
        """What a resume from a checkpoint taken now does, without one: every group in flight is
        dropped (its episodes too) and submitted again, to draw from its first token (from
        reset(item, seed)) under the weights of the next `advance`. A run restarts its actor at
        each checkpoint, so that it goes on exactly as a run resumed there."""
        position = self.position
        self.engine.clear()
        if self.episodes is not None:
            self.episodes.forget()
        self._started, self._in_flight = 0, []
        self.resume(position)

    def close(self) -> None:
        """Ends what its episodes run beside the engine (an agent loop's endpoint and harnesses)."""
        close = getattr(self.episodes, "close", None)
        if callable(close):
            close()

    def advance(self, params, version: int) -> tuple[Optional[dict[str, np.ndarray]], dict]:
        """One chunk: refill, decode under `params` (policy `version`), score what completed.
        Returns (rows, or None when no group completed; stats with "seconds" and "position")."""
        start = time.perf_counter()
        self.engine.update_weights(params, version)
        if len(self._in_flight) < self.capacity:
            self._submit(list(range(self._started, self._started + self.capacity - len(self._in_flight))))
        self.engine.step()
        completed = self.engine.collect()
        rows, stats = self._score(completed) if completed else (None, {})
        for g in completed:
            self._in_flight.remove(g.tag)
        stats.update(seconds=time.perf_counter() - start, position=self.position, groups=len(completed))
        return rows, stats

    def _submit(self, numbers: Sequence[int]) -> None:
        if not numbers:
            return
        where = np.asarray([self._where(k) for k in numbers], np.int32)  # [n, 2]: (actor step, prompt)
        fold = lambda step, prompt: jax.random.fold_in(jax.random.fold_in(self._base_key, step), prompt)
        keys = jax.vmap(fold)(where[:, 0], where[:, 1])  # one dispatch, not two a group
        groups = []
        for k, (step, prompt), key in zip(numbers, where.tolist(), keys):
            if self.episodes is not None:  # reset(item, seed): the same for a regenerated group
                tokens, mask = self.episodes.open(k, self._batch(step)[prompt], episode_seed(self.config.run.seed, k))
                tokens, mask = tokens[None], mask[None]
            else:
                tokens, mask = self.task.encode_prompts([self._batch(step)[prompt]])
            groups.append(PromptGroup(tag=k, tokens=tokens[0], mask=mask[0], key=key))
            self._in_flight.append(k)
            self._started = max(self._started, k + 1)
        self.engine.submit(groups)

    def _where(self, k: int) -> tuple[int, int]:
        """(actor step, prompt index in that step's batch) of this process's k-th group."""
        return k // self.per_shard, self.shard[0] * self.per_shard + k % self.per_shard

    def _batch(self, step: int) -> list:
        if step not in self._problems:
            c = self.config
            self._problems[step] = self.task.train_problems(c.run.seed, step, c.train.prompts_per_step)
            for old in sorted(self._problems)[:-4]:
                del self._problems[old]
        return self._problems[step]

    def _score(self, completed) -> tuple[dict[str, np.ndarray], dict]:
        c, g = self.config, self.config.train.group_size
        problems, ids = [], []
        for group in completed:
            step, prompt = self._where(group.tag)
            problems.append(self._batch(step)[prompt])
            ids.append(rollout_ids(step, prompt * g, g, c.rollouts_per_step))
        cat = lambda name: np.concatenate([getattr(group.rollout, name) for group in completed])
        rollout = Rollout(tokens=cat("tokens"), attention_mask=cat("attention_mask"),
                          completion_mask=cat("completion_mask"), logprobs=cat("logprobs"),
                          routes=cat(ROUTES) if ROUTES in self.spec else None)
        extra = {}
        if self.episodes is not None:
            results = [self.episodes.result(group.tag) for group in completed]
            rewards, reward_errors = np.concatenate([r["reward"] for r in results]), 0
            extra = episode_stats(results)
        else:
            rewards, reward_errors = score(self.task, problems, completion_ids(rollout), g)
        advantages = ADVANTAGES[c.train.advantage](rewards.reshape(-1, g)).reshape(-1)
        items = make_rows(
            self.spec, tokens=rollout.tokens, attention_mask=rollout.attention_mask,
            completion_mask=rollout.completion_mask, logprobs=rollout.logprobs, advantage=advantages,
            reward=rewards, policy_version=np.concatenate([group.first_version for group in completed]),
            last_version=np.concatenate([group.last_version for group in completed]),
            rollout_id=np.concatenate(ids), **({ROUTES: rollout.routes} if ROUTES in self.spec else {}))
        return items, {**rollout_stats(items), "reward/errors": reward_errors, **extra}


def make_streaming_actor(graphdef, config: Config, task: Task, params, *, stop_ids: Sequence[int], pad_id: int,
                         shard: tuple[int, int] = (0, 1), live_vocab: int = 0,
                         mesh: Optional[Mesh] = None, episodes=None) -> StreamingActor:
    """A `StreamingActor` over the in-JAX engine, sampling as `sampling.make_run_samplers`' rollout
    sampler; its slot pool laid out over `mesh` (the weights it is given must lie on it). `episodes`:
    who takes the rows' turns, if not `environment.*`'s own environments (an outside agent loop's)."""
    s = config.sampling
    if episodes is None and config.environment.name:
        episodes = make_episode_runner(config, task)
    engine = JaxEngine(graphdef, config.model, params, slots=engine_slots(config, shard[1]),
                       group_size=config.train.group_size, prompt_len=task.prompt_len,
                       max_new_tokens=s.max_new_tokens, chunk_steps=s.engine_chunk_steps, temperature=s.temperature,
                       top_p=s.top_p, top_k=s.top_k, stop_ids=stop_ids, pad_id=pad_id,
                       kv_cache_dtype=s.kv_cache_dtype, prefill_chunk_size=s.prefill_chunk_size, live_vocab=live_vocab,
                       mesh=mesh, turns=episodes, record_routes=records_routes(config))
    return StreamingActor(config, task, engine, shard=shard, episodes=episodes)


def make_episode_runner(config: Config, task: Task) -> EpisodeRunner:
    """The environments of a multi-turn run (`environment.*`), this process's own instances."""
    e = config.environment
    pool = EnvPool(e.name, e.options, workers=e.workers, processes=e.processes, timeout=e.step_timeout_s)
    return EpisodeRunner(pool, chat_format_for(task.tokenizer, environment=resolve(e.name)), task.tokenizer, group_size=config.train.group_size,
                         prompt_len=task.prompt_len, max_turns=e.max_turns, reward=e.reward)


def episode_seed(run_seed: int, group: int) -> int:
    """The seed a group's environments are reset with: a function of the run's seed and the
    group's place in the prompt stream, so a resumed group restarts the same episodes."""
    return (run_seed * 1_000_003 + group) % 2**31


def episode_stats(results: Sequence[Mapping]) -> dict[str, float]:
    """Turns per episode, the truncated share and the environments' errors of scored groups."""
    turns = np.concatenate([r["turns"] for r in results])
    out = {"episode/turns": float(turns.mean()),
           "episode/truncated": float(np.concatenate([r["truncated"] for r in results]).mean())}
    for kind in EPISODE_ERRORS:
        out[f"env/errors/{kind}"] = sum(r["errors"].get(kind, 0) for r in results)
    return out
