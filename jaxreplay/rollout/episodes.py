"""Multi-turn episodes: the rollout engine's rows as conversations with an environment.

An episode is one row. Its prompt is the chat format's rendering of `reset(item, seed)`; then
the model's turns and the environment's answers alternate in the row's completion columns, the
model's ids exactly as drawn (token in, token out: they are decoded only to be handed to
`step`), the environment's rendered by the chat format and fed onto the row by the engine. The
engine trains only the model's tokens (`completion_mask`); the environment's are attended.

The G rows of a group are G instances of one environment reset with the same item and seed, so
they share a prompt and their rewards are compared with each other (advantages, frozen here as
for single-turn rows).

Rules, each written down once:
- reward `final`: the last step's reward; `sum`: the sum over the episode's steps.
- a turn limit (`environment.max_turns`): after that many model turns the environment's answer
  is read for its reward, and an episode it does not end is truncated there;
- a token limit (`sampling.max_new_tokens` for model and environment tokens together): a turn cut
  by it, or an answer with no room after it for a model token, truncates the episode;
- a truncated episode keeps the rewards it got (by the rule above) and trains like any other:
  its tokens are the policy's own choices, and the length it wasted is what its reward says;
- an environment that raises or times out ends its episode there (info error, counted);
- so does an observation the chat format cannot turn into ids (a text the tokenizer cannot encode,
  a chat template that raises) or a first observation wider than the prompt (`task.max_prompt_len`):
  `unencodable_observation`, counted, never raised to the run.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, Optional

import numpy as np

from jaxreplay.config import Config, ConfigError, owner_check
from jaxreplay.tasks.chat import ChatFormat
from jaxreplay.tasks.environment import STEP_ERRORS, EnvPool, Message, Step, resolve

# What ends an episode early, counted per kind (`env/errors/<kind>`): an environment's own error
# (Step.info["error"]), or an observation the chat format could not render or encode.
UNENCODABLE = "unencodable_observation"
EPISODE_ERRORS = (*STEP_ERRORS, UNENCODABLE)


@dataclasses.dataclass
class _Episodes:
    """The G episodes of one group."""

    envs: list[int]
    broken: list[bool]  # reset failed: the episode ends at its first turn
    turns: list[int]
    rewards: list[list[float]]
    truncated: list[bool]
    over: list[bool]
    errors: collections.Counter = dataclasses.field(default_factory=collections.Counter)


class EpisodeRunner:
    """Runs the environments of every row in the engine (its `TurnTaker`) and scores episodes."""

    def __init__(self, pool: EnvPool, chat: ChatFormat, tokenizer: Any, *, group_size: int, prompt_len: int,
                 max_turns: int, reward: str = "final"):
        if reward not in ("final", "sum"):
            raise ValueError(f"episode reward rule must be final or sum, got {reward!r}")
        self.pool, self.chat, self.tokenizer = pool, chat, tokenizer
        self.group_size, self.prompt_len, self.max_turns, self.reward_rule = group_size, prompt_len, max_turns, reward
        self._groups: dict[Any, _Episodes] = {}
        self._owner: dict[int, tuple[Any, int]] = {}  # env id -> (tag, row)
        self._ready: list[tuple[Any, int, Optional[list[int]]]] = []

    def open(self, tag: Any, item: Any, seed: int) -> tuple[np.ndarray, np.ndarray]:
        """Resets G instances with (item, seed): the group's prompt, left-padded [P] ids and mask."""
        envs = [self.pool.create() for _ in range(self.group_size)]
        first = self.pool.reset(envs, item, seed)
        ep = _Episodes(envs=envs, broken=[o is None for o in first], turns=[0] * len(envs),
                       rewards=[[] for _ in envs], truncated=[False] * len(envs), over=[False] * len(envs))
        ep.errors["exception"] += sum(ep.broken)  # a reset that raised or timed out
        observation = next((o for o in first if o is not None), ())
        ids = self._ids(self.chat.first_ids, observation)
        if ids is None or len(ids) > self.prompt_len:  # or wider than the prompt (task.max_prompt_len):
            ep.errors[UNENCODABLE] += ep.broken.count(False)  # every episode that reset ends at its first turn,
            ep.broken, ids = [True] * len(envs), []  # on an empty prompt
        tokens = np.full((self.prompt_len,), self.tokenizer.pad_id, np.int32)
        mask = np.zeros((self.prompt_len,), bool)
        if ids:
            tokens[-len(ids):], mask[-len(ids):] = ids, True
        self._groups[tag] = ep
        for j, env in enumerate(envs):
            self._owner[env] = (tag, j)
        return tokens, mask

    # -- the engine's TurnTaker ----------------------------------------------------------------

    def ended(self, tag: Any, row: int, turn_ids: np.ndarray, cut: bool) -> None:
        ep = self._groups[tag]
        if cut:
            ep.truncated[row] = not ep.over[row] or ep.truncated[row]
            self._finish(ep, row)
            return
        ep.turns[row] += 1
        if ep.broken[row]:
            self._finish(ep, row)
            self._ready.append((tag, row, None))
            return
        self.pool.step(ep.envs[row], self.tokenizer.decode([int(i) for i in turn_ids]))

    def answers(self, wait: float) -> list[tuple[Any, int, Optional[list[int]]]]:
        out, self._ready = self._ready, []
        for env, step in self.pool.results(0.0 if out else wait):
            if env not in self._owner:  # its episode was dropped (`forget`) while the step ran
                continue
            tag, row = self._owner[env]
            out.append((tag, row, self._answer(self._groups[tag], row, step)))
        return out

    def _answer(self, ep: _Episodes, row: int, step: Step) -> Optional[list[int]]:
        ep.rewards[row].append(float(step.reward))
        error = step.info.get("error") if step.info else None
        if error in STEP_ERRORS:
            ep.errors[error] += 1
        if step.done or not step.observation:
            self._finish(ep, row)
            return None
        if ep.turns[row] >= self.max_turns:
            ep.truncated[row] = True
            self._finish(ep, row)
            return None
        ids = self._ids(self.chat.next_ids, step.observation)
        if ids is None:  # the episode ends here, with the rewards it got
            ep.errors[UNENCODABLE] += 1
            self._finish(ep, row)
        return ids

    @staticmethod
    def _ids(render, observation: tuple[Message, ...]) -> Optional[list[int]]:
        """The chat format's ids for an observation, or None where rendering or encoding it raised:
        an environment's text ends its episode, never the run."""
        try:
            return [int(i) for i in render(observation)]
        except Exception:  # noqa: BLE001 - any failure of a tokenizer or template on the environment's text
            return None

    def _finish(self, ep: _Episodes, row: int) -> None:
        if not ep.over[row]:
            ep.over[row] = True
            self.pool.close(ep.envs[row])
            self._owner.pop(ep.envs[row], None)

    # -- scoring ----------------------------------------------------------------------------------

    def result(self, tag: Any) -> dict[str, Any]:
        """The group's episodes, once every row is complete: rewards [G], turns [G], truncated [G]
        and error counts; the group is forgotten."""
        ep = self._groups.pop(tag)
        rule = (lambda r: r[-1] if r else 0.0) if self.reward_rule == "final" else (lambda r: float(sum(r)))
        return {"reward": np.asarray([rule(r) for r in ep.rewards], np.float32),
                "turns": np.asarray(ep.turns, np.int32), "truncated": np.asarray(ep.truncated, bool),
                "errors": dict(ep.errors)}

    def forget(self) -> None:
        """Drops every open episode (their instances are closed): a resume or restart regenerates them."""
        for ep in self._groups.values():
            for row in range(len(ep.envs)):
                self._finish(ep, row)
        self._groups.clear()
        self._ready.clear()


@owner_check
def check_environment(c: Config) -> None:
    """`environment.*`: episodes need the engine (only it keeps a row's K/V while its environment
    answers), the environment must be found by its name, and one must build from `environment.options`
    (a bad option said here, once, not as every episode ending in an `exception` error)."""
    e = c.environment
    if not e.name:
        return
    if c.sampling.engine != "continuous":
        raise ConfigError(f"environment.name: multi-turn episodes ({e.name}) need sampling.engine: continuous "
                          f"(got {c.sampling.engine})")
    try:
        factory = resolve(e.name)
    except ValueError as err:
        raise ConfigError(f"environment.name: {err}") from None
    try:
        probe = factory(**dict(e.options))
    except (TypeError, ValueError) as err:
        raise ConfigError(f"environment.options: {e.name} does not build from {dict(e.options)}: {err}") from None
    close = getattr(probe, "close", None)
    if callable(close):
        close()
