"""The demo's multi-turn environment: find a hidden digit from `+`/`-` answers.

The prompt (`:`) says nothing about the digit: a policy can only win by reading the answers.
Each model turn is one digit; the environment answers `+` (the digit is higher), `-` (lower),
or ends the episode with reward 1 when the guess is right. Bisection always wins in four turns;
a guess that ignores the answers wins in four about 40% of the time. A turn that is not one
digit ends the episode with reward 0 (info error "malformed_tool_call", counted).

`GuessDigitTask` is the prompt stream (the hidden digits, one per item) with the task surface
the loop needs, and the warm start's demonstrations: a sloppy scripted player that bisects
with probability 1 - `warmstart.teacher_carry_error` and otherwise guesses at random among the
digits it has not tried.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from jaxreplay.config import TaskConfig
from jaxreplay.tasks.arithmetic import CharTokenizer
from jaxreplay.tasks.environment import Message, Step, register_environment

PROMPT = ":"


class GuessDigit:
    """One episode's state: the hidden digit and whether it was found."""

    def __init__(self, max_turns: int = 4):
        self.max_turns = max_turns
        self.secret, self.turns = -1, 0

    def reset(self, item: Any, seed: int) -> tuple[Message, ...]:
        self.secret, self.turns = int(item), 0
        return (Message("user", PROMPT),)

    def step(self, turn_text: str) -> Step:
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
    """A scripted player's episode: [(its turn, the environment's answer)], the last answer ""."""
    low, high, tried, out = 0, 9, set(), []
    for _ in range(max_turns):
        if rng.random() < sloppy:
            guess = int(rng.choice([d for d in range(10) if d not in tried]))
        else:
            guess = (low + high) // 2
        tried.add(guess)
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
        body = np.full((n, max_new_tokens), self.tokenizer.PAD, np.int32)
        body_mask = np.zeros((n, max_new_tokens), bool)
        loss = np.zeros((n, max_new_tokens), bool)
        for i, secret in enumerate(self.train_problems(seed, index, n)):
            col = 0
            for turn, answer in play(secret, rng, carry_error):
                for ids, trained in ((self.tokenizer.encode(turn) + [self.tokenizer.EOS], True),
                                     (self.tokenizer.encode(answer), False)):
                    ids = ids[:max_new_tokens - col]
                    body[i, col:col + len(ids)] = ids
                    body_mask[i, col:col + len(ids)] = True
                    loss[i, col:col + len(ids)] = trained
                    col += len(ids)
        return (np.concatenate([prompts, body], axis=1), np.concatenate([prompt_mask, body_mask], axis=1),
                np.concatenate([np.zeros_like(prompt_mask), loss], axis=1))
