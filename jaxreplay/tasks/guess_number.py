"""The multi-turn testbed (issue 55): find a hidden number in a range from `+`/`-` answers.

The prompt gives the range, `lo,hi:` (its width 50 to 100, inside 0-99); the hidden number is
anywhere in it. Each model turn is a guess, one or two digits; the environment answers `+` (the
number is higher), `-` (lower), or ends the episode with reward 1 when the guess is right. After
`max_turns` (7) wrong guesses the episode ends with reward 0. Bisection always wins (a width up to
127 needs at most 7 guesses); a player that ignores the answers wins at most 7 of the width's
numbers (at most 14%). A turn that is not one or two digits ends the episode with reward 0 (info
error "malformed_tool_call"). Everything is in the demo tokenizer's alphabet (digits `,:+-`).

Unlike the demo's digit (one prompt, a decision tree of 15 nodes a policy can memorise), every
prompt here asks for interval arithmetic on what the answers left: headroom for a 2-layer model.

`GuessNumberTask` deals its items (lo, hi, number) from one seeded shuffle of all 88,400 of them
into a test split, a validation split, the warm start's own split (2000) and the RL pool, in that
order, so no split size moves another. The warm start imitates a sloppy scripted player that
bisects with probability 1 - `warmstart.teacher_carry_error` a turn and otherwise cuts only a
tenth off the range the answers left (wins in 7 turns about 41% when it always slips).
"""

from __future__ import annotations

import functools
from typing import Any, Mapping, Optional, Sequence

import numpy as np

from jaxreplay.config import Config, ConfigError, TaskConfig
from jaxreplay.tasks.arithmetic import CharTokenizer
from jaxreplay.tasks.environment import Message, Step, register_environment
from jaxreplay.tasks.latency import TAIL_Z, Latency

LOWEST, HIGHEST = 0, 99
MIN_WIDTH = 50  # the narrowest range: an answer-blind player wins at most max_turns / MIN_WIDTH
MAX_TURNS = 7
PROMPT_LEN = len("99,99:")
WARMSTART_SIZE = 2000
SLIP_CUT = 0.1  # the sloppy player's slip: it guesses a tenth of the way up the range left


def prompt(item: tuple[int, int, int]) -> str:
    lo, hi, _ = item
    return f"{lo},{hi}:"


class GuessNumber:
    """One episode's state: the range, the hidden number, the turns taken."""

    def __init__(self, max_turns: int = MAX_TURNS, latency: Optional[Mapping[str, Any]] = None):
        """`latency`: {distribution, median_s, sigma, seed} (tasks/latency.py), each step's time."""
        if not (isinstance(max_turns, int) and max_turns > 0):
            raise ValueError(f"max_turns: must be a positive integer (got {max_turns!r})")
        self.max_turns, self.latency = max_turns, Latency.from_options(latency)
        self.item, self.seed, self.turns, self.history = (0, 0, 0), 0, 0, ""

    def reset(self, item: Sequence[int], seed: int) -> tuple[Message, ...]:
        lo, hi, secret = (int(v) for v in item)
        if not LOWEST <= lo <= secret <= hi <= HIGHEST:
            raise ValueError(f"item {item!r} is not (lo, hi, number) with {LOWEST} <= lo <= number <= hi <= {HIGHEST}")
        self.item, self.seed, self.turns, self.history = (lo, hi, secret), int(seed), 0, ""
        return (Message("user", prompt(self.item)),)

    def step(self, turn_text: str) -> Step:
        if self.latency is not None:
            self.latency.wait(self.seed, self.turns, self.history)
        self.turns += 1
        self.history += turn_text + ";"
        if not (1 <= len(turn_text) <= 2 and turn_text.isdigit() and turn_text.isascii()):
            return Step(done=True, info={"error": "malformed_tool_call"})
        guess, secret = int(turn_text), self.item[2]
        if guess == secret:
            return Step(reward=1.0, done=True)
        if self.turns >= self.max_turns:
            return Step(done=True)
        return Step(observation=(Message("user", "+" if secret > guess else "-"),))


register_environment("guess_number", GuessNumber)


def play(item: tuple[int, int, int], rng: np.random.Generator, sloppy: float,
         max_turns: int = MAX_TURNS) -> list[tuple[str, str]]:
    """The scripted player's episode: [(its guess, the environment's answer)], the last answer "".
    Each turn it bisects what the answers left or, with probability `sloppy`, slips and guesses a
    tenth of the way up it."""
    low, high, secret = item
    out: list[tuple[str, str]] = []
    for _ in range(max_turns):
        guess = low + int((high - low) * SLIP_CUT) if rng.random() < sloppy else (low + high) // 2
        if guess == secret:
            out.append((str(guess), ""))
            return out
        answer = "+" if secret > guess else "-"
        low, high = (guess + 1, high) if answer == "+" else (low, guess - 1)
        out.append((str(guess), answer))
    out[-1] = (out[-1][0], "")
    return out


@functools.cache
def all_items() -> np.ndarray:
    """Every (lo, hi, number): [88400, 3] int, in a fixed order (read-only)."""
    items = np.array([(lo, hi, n) for lo in range(LOWEST, HIGHEST - MIN_WIDTH + 2)
                      for hi in range(lo + MIN_WIDTH - 1, HIGHEST + 1) for n in range(lo, hi + 1)], np.int32)
    items.flags.writeable = False
    return items


def _as_items(rows: np.ndarray) -> list[tuple[int, int, int]]:
    return [tuple(int(v) for v in row) for row in rows]


class GuessNumberTask:
    """(lo, hi, number) items for `guess_number` episodes; the reward is the environment's."""

    def __init__(self, config: TaskConfig):
        self.config = config
        self.tokenizer = CharTokenizer()
        self.prompt_len = PROMPT_LEN
        universe = all_items()
        items = universe[np.random.default_rng([config.data_seed, 0x9E55]).permutation(len(universe))]
        cuts = np.cumsum([config.eval_size, config.validation_size, WARMSTART_SIZE])
        test, validation, warm, rest = np.split(items, cuts)
        self.eval_problems, self.validation_problems = _as_items(test), _as_items(validation)
        self.warmstart_problems = _as_items(warm)
        self._pool = rest[:config.train_size] if config.train_size else rest

    def train_problems(self, seed: int, index: int, n: int) -> list[tuple[int, int, int]]:
        rows = np.random.default_rng([seed, index, 0x9E55]).integers(0, len(self._pool), n)
        return _as_items(self._pool[rows])

    def encode_prompts(self, problems: Sequence[tuple[int, int, int]]) -> tuple[np.ndarray, np.ndarray]:
        tokens = np.full((len(problems), self.prompt_len), self.tokenizer.PAD, np.int32)
        for i, item in enumerate(problems):
            ids = self.tokenizer.encode(prompt(item))
            tokens[i, self.prompt_len - len(ids):] = ids
        return tokens, tokens != self.tokenizer.PAD

    def reward(self, problem: Any, completion_ids) -> float:
        raise TypeError("guess_number is scored by its environment (environment.name), not per completion")

    def supervised_batch(self, seed: int, index: int, n: int, max_new_tokens: int, carry_error: float = 0.0):
        """The sloppy player's episodes on the warm start's own split, as rows: its tokens (guess,
        EOS) in the loss mask, the environment's answers not."""
        rng = np.random.default_rng([seed, index, 0x5119])
        items = [self.warmstart_problems[j] for j in rng.integers(0, len(self.warmstart_problems), n)]
        prompts, prompt_mask = self.encode_prompts(items)
        body = np.full((n, max_new_tokens), self.tokenizer.PAD, np.int32)
        body_mask = np.zeros((n, max_new_tokens), bool)
        loss = np.zeros((n, max_new_tokens), bool)
        for i, item in enumerate(items):
            col = 0
            for turn, answer in play(item, rng, carry_error):
                for ids, trained in ((self.tokenizer.encode(turn) + [self.tokenizer.EOS], True),
                                     (self.tokenizer.encode(answer), False)):
                    ids = ids[:max_new_tokens - col]
                    body[i, col:col + len(ids)] = ids
                    body_mask[i, col:col + len(ids)] = True
                    loss[i, col:col + len(ids)] = trained
                    col += len(ids)
        return (np.concatenate([prompts, body], axis=1), np.concatenate([prompt_mask, body_mask], axis=1),
                np.concatenate([np.zeros_like(prompt_mask), loss], axis=1))


def validate_config(c: Config) -> None:
    """`task.name: guess_number`: its environment, splits that fit, and a latency its workers can sleep."""
    if c.environment.name != "guess_number":
        raise ConfigError("task.name: guess_number is scored by its environment: set environment.name: guess_number")
    held = c.task.eval_size + c.task.validation_size + WARMSTART_SIZE
    if held + c.task.train_size > len(all_items()):
        raise ConfigError(f"task.train_size: {c.task.train_size} problems beside the {held} held out (test, validation, "
                          f"the warm start's {WARMSTART_SIZE}) do not fit the {len(all_items())} items")
    options = c.environment.options
    try:
        latency = Latency.from_options(options.get("latency"))
    except ValueError as e:
        raise ConfigError(f"environment.options.{e}") from None
    if latency is None:
        return
    if c.environment.workers == 0:
        raise ConfigError("environment.options.latency: needs environment.workers > 0 (with 0 every step would sleep in "
                          "the actor's thread, and every other row wait on it)")
    tail = latency.quantile(TAIL_Z)
    if tail >= c.environment.step_timeout_s:
        raise ConfigError(f"environment.options.latency: one step in 10,000 takes over {tail:.3g} s, past "
                          f"environment.step_timeout_s={c.environment.step_timeout_s:g}: raise the timeout")
