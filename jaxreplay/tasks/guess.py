"""The demo's multi-turn environment: find a hidden digit from `+`/`-` answers.

The prompt (`:`) says nothing about the digit: a policy can only win by reading the answers.
Each model turn is one digit; the environment answers `+` (the digit is higher), `-` (lower),
or ends the episode with reward 1 when the guess is right. Bisection always wins in four turns;
a guess that ignores the answers wins in four about 40% of the time. A turn that is not one
digit ends the episode with reward 0 (info error "malformed_tool_call", counted).

`GuessDigitTask` is the prompt stream (the hidden digits, one per item) with the task surface
the loop needs, and the warm start's demonstrations: a sloppy scripted player that bisects with
probability 1 - `warmstart.teacher_carry_error` a turn and otherwise scans up from the lowest
digit the answers left. Its greedy imitation scans (wins 40%); RL finds the bisection in it.
"""

from __future__ import annotations

import time
from typing import Any, Sequence

import numpy as np

from jaxreplay.config import TaskConfig
from jaxreplay.tasks.arithmetic import CharTokenizer
from jaxreplay.tasks.environment import Message, Step, register_environment
from jaxreplay.tasks.scripted import episode_rows

PROMPT = ":"


class GuessDigit:
    """One episode's state: the hidden digit and whether it was found."""

    def __init__(self, max_turns: int = 4, latency_s: float = 0.0):
        """`latency_s`: seconds each step sleeps, standing in for a tool's time (benchmarks)."""
        self.max_turns, self.latency_s = max_turns, latency_s
        self.secret, self.turns = -1, 0

    def reset(self, item: Any, seed: int) -> tuple[Message, ...]:
        self.secret, self.turns = int(item), 0
        return (Message("user", PROMPT),)

    def step(self, turn_text: str) -> Step:
        if self.latency_s:
            time.sleep(self.latency_s)
        self.turns += 1
        if len(turn_text) != 1 or not turn_text.isdigit():
            return Step(done=True, info={"error": "malformed_tool_call"})
        guess = int(turn_text)
        if guess == self.secret:
            return Step(reward=1.0, done=True)
        if self.turns >= self.max_turns:
            return Step(done=True)
        return Step(observation=(Message("user", "+" if self.secret > guess else "-"),))


register_environment("guess_digit", GuessDigit)


def play(secret: int, rng: np.random.Generator, sloppy: float, max_turns: int = 4) -> list[tuple[str, str]]:
    """A scripted player's episode: [(its turn, the environment's answer)], the last answer "".
    Each turn it bisects what the answers left, or with probability `sloppy` slips into a scan
    up from the lowest digit left (which wins in four turns only for 0-3)."""
    low, high, out = 0, 9, []
    for _ in range(max_turns):
        guess = low if rng.random() < sloppy else (low + high) // 2  # the slip: a linear scan up
        if guess == secret:
            out.append((str(guess), ""))
            return out
        answer = "+" if secret > guess else "-"
        low, high = (max(low, guess + 1), high) if answer == "+" else (low, min(high, guess - 1))
        out.append((str(guess), answer))
    out[-1] = (out[-1][0], "")
    return out


class GuessDigitTask:
    """Hidden digits as the items of `guess_digit` episodes; the reward is the environment's."""

    def __init__(self, config: TaskConfig):
        self.config = config
        self.tokenizer = CharTokenizer()
        self.prompt_len = 1 + len(PROMPT)  # BOS-free: the first observation, left-padded to this width
        rng = np.random.default_rng([config.data_seed, 0x6E55])
        self.eval_problems = [int(d) for d in rng.integers(0, 10, config.eval_size)]
        self.validation_problems: list[int] = []

    def train_problems(self, seed: int, index: int, n: int) -> list[int]:
        return [int(d) for d in np.random.default_rng([seed, index, 0x6E55]).integers(0, 10, n)]

    def encode_prompts(self, problems: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        tokens = np.full((len(problems), self.prompt_len), self.tokenizer.PAD, np.int32)
        ids = self.tokenizer.encode(PROMPT)
        tokens[:, self.prompt_len - len(ids):] = ids
        return tokens, tokens != self.tokenizer.PAD

    def reward(self, problem: int, completion_ids) -> float:
        raise TypeError("guess_digit is scored by its environment (environment.name), not per completion")

    def supervised_batch(self, seed: int, index: int, n: int, max_new_tokens: int, carry_error: float = 0.0):
        """Scripted episodes as rows: the player's tokens (digit, EOS) in the loss mask, the
        environment's answers not."""
        rng = np.random.default_rng([seed, index, 0x5119])
        prompts, prompt_mask = self.encode_prompts(self.train_problems(seed, index, n))
        episodes = [play(secret, rng, carry_error) for secret in self.train_problems(seed, index, n)]
        return episode_rows(self.tokenizer, prompts, prompt_mask, episodes, max_new_tokens)
