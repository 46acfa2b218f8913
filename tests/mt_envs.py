"""Environments the multi-turn tests run, importable by name (`mt_envs:Echo`) in worker processes."""

import time

from jaxreplay.tasks.environment import Message, Step


class Echo:
    """Says `prompt` first, answers every turn with `reply` and ends after `turns` turns with
    reward = turns seen; `sleep` seconds per step, `raise_at`/`hang_at` a turn that raises or
    blocks for an hour."""

    def __init__(self, turns: int = 3, reply: str = "+", sleep: float = 0.0, raise_at: int = -1, hang_at: int = -1,
                 prompt: str = ":"):
        self.turns, self.reply, self.sleep, self.raise_at, self.hang_at = turns, reply, sleep, raise_at, hang_at
        self.prompt, self.seen = prompt, 0

    def reset(self, item, seed):
        self.seen = 0
        return (Message("user", self.prompt),)

    def step(self, turn_text):
        self.seen += 1
        if self.seen == self.raise_at:
            raise RuntimeError("the environment broke")
        if self.seen == self.hang_at:
            time.sleep(3600)
        if self.sleep:
            time.sleep(self.sleep)
        if self.seen >= self.turns:
            return Step(reward=float(self.seen), done=True)
        return Step(observation=(Message("user", self.reply),), reward=1.0)


class SlowGuess:
    """guess_digit whose steps take a random few milliseconds (seeded by the episode), or raise
    at turn `raise_at`, or hang at turn `hang_at` of items equal to `hang_item`."""

    def __init__(self, sleep: float = 0.01, raise_at: int = -1, hang_at: int = -1, hang_item: int = -1):
        from jaxreplay.tasks.guess import GuessDigit

        self.inner, self.sleep, self.raise_at, self.hang_at, self.hang_item = GuessDigit(), sleep, raise_at, hang_at, hang_item
        self.rng = None

    def reset(self, item, seed):
        import random

        self.rng, self.item = random.Random(seed * 7919 + id(self) % 97), item
        return self.inner.reset(item, seed)

    def step(self, turn_text):
        if self.inner.turns + 1 == self.raise_at:
            raise RuntimeError("the environment broke")
        if self.inner.turns + 1 == self.hang_at and self.item == self.hang_item:
            time.sleep(3600)
        time.sleep(self.rng.random() * self.sleep)
        return self.inner.step(turn_text)


class FailingGuess:
    """guess_digit that fails on some hidden digits, the same way every time: its reset raises
    for those in `raise_on`, and for those in `unencodable` says `h` (which the demo's character
    tokenizer has no id for)."""

    def __init__(self, raise_on=(), unencodable=()):
        from jaxreplay.tasks.guess import GuessDigit

        self.inner, self.raise_on, self.unencodable = GuessDigit(), set(raise_on), set(unencodable)

    def reset(self, item, seed):
        if int(item) in self.raise_on:
            raise RuntimeError(f"no episode for digit {item}")
        first = self.inner.reset(item, seed)
        return (Message("user", "h"),) if int(item) in self.unencodable else first

    def step(self, turn_text):
        return self.inner.step(turn_text)


class EvenNumberWins:
    """Ends at the first turn, whatever it says, with reward 1 when the item's number is even."""

    def reset(self, item, seed):
        self.number = item[2]
        return (Message("user", f"{item[0]},{item[1]}:"),)

    def step(self, turn_text):
        return Step(reward=float(self.number % 2 == 0), done=True)



class EvenCharWins:
    """Ends at the first turn with reward 1 when the turn's text starts with a character of even
    code: a random policy sampled at temperature 1 wins some of an item's episodes, not all."""

    def reset(self, item, seed):
        return (Message("user", f"{item[0]},{item[1]}:"),)

    def step(self, turn_text):
        return Step(reward=float(bool(turn_text) and ord(turn_text[0]) % 2 == 0), done=True)
