"""Environments the multi-turn tests run, importable by name (`mt_envs:Echo`) in worker processes."""

import time

from jaxreplay.tasks.environment import Message, Step


class Echo:
    """Answers every turn with `reply` and ends after `turns` turns with reward = turns seen;
    `sleep` seconds per step, `raise_at`/`hang_at` a turn that raises or blocks for an hour."""

    def __init__(self, turns: int = 3, reply: str = "+", sleep: float = 0.0, raise_at: int = -1, hang_at: int = -1):
        self.turns, self.reply, self.sleep, self.raise_at, self.hang_at = turns, reply, sleep, raise_at, hang_at
        self.seen = 0

    def reset(self, item, seed):
        self.seen = 0
        return (Message("user", ":"),)

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
