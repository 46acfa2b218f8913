"""What the actor, the loop and evaluation need from a task and its tokenizer.

A task is a prompt source with a verifiable reward: a deterministic training
stream indexed by the actor step (resuming is remembering the step), a held-out
eval set, fixed-length left-padded prompts, and a reward per completion. The
embedded `ArithmeticTask` and the dataset-backed `DatasetTask` both satisfy it, and
so do tokenizers as different as the demo's `CharTokenizer` and a Hugging Face one.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol, Sequence

import numpy as np

log = logging.getLogger(__name__)


class Tokenizer(Protocol):
    @property
    def vocab_size(self) -> int: ...

    @property
    def pad_id(self) -> int: ...

    @property
    def eos_id(self) -> int: ...

    @property
    def eos_ids(self) -> tuple[int, ...]:
        """Every id that ends a completion: the sampler's stop ids, where `decode` ends."""
        ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str:
        """Text up to the first of `eos_ids`."""
        ...


class Task(Protocol):
    tokenizer: Tokenizer
    prompt_len: int  # every encoded prompt is left-padded to this many tokens
    eval_problems: Sequence[Any]  # the test split: held out, never drawn by `train_problems`
    validation_problems: Sequence[Any]  # held out too, disjoint from the test split; empty without one

    def train_problems(self, seed: int, index: int, n: int) -> list[Any]:
        """The `index`-th batch of n training problems: a pure function of its arguments."""
        ...

    def encode_prompts(self, problems: Sequence[Any]) -> tuple[np.ndarray, np.ndarray]:
        """Left-padded prompt tokens [n, prompt_len] int32 and their bool mask."""
        ...

    def reward(self, problem: Any, completion_ids: Sequence[int]) -> float:
        """The reward of one completion (ids after the prompt); may raise on odd input."""
        ...


class EpochPool:
    """A finite training set visited in epochs, each in its own seeded order, so that batch
    `index` is a pure function of (seed, index): resuming is remembering the step, and every
    prompt comes back once per epoch, as a dataset's do."""

    SALT = 0xDA7A

    def __init__(self, items: Sequence[Any]):
        if not items:
            raise ValueError("an epoch pool needs at least one item")
        self.items = list(items)
        self._order: tuple[Any, Any] = (None, None)  # the latest epoch's (key, permutation)

    def __len__(self) -> int:
        return len(self.items)

    def order(self, seed: int, epoch: int) -> np.ndarray:
        if self._order[0] != (seed, epoch):
            self._order = ((seed, epoch), np.random.default_rng([seed, epoch, self.SALT]).permutation(len(self.items)))
        return self._order[1]

    def batch(self, seed: int, index: int, n: int) -> list[Any]:
        out = []
        for j in range(index * n, (index + 1) * n):
            epoch, position = divmod(j, len(self.items))
            out.append(self.items[self.order(seed, epoch)[position]])
        return out


def score(task: Task, problems: Sequence[Any], completions: np.ndarray, group: int = 1) -> tuple[np.ndarray, int]:
    """Rewards of completions[i] for problems[i // group], and how many reward calls raised.

    A reward function that raises scores 0 and is counted (and logged once per call
    here) instead of ending a run hours in: one malformed completion or reference
    must not cost the whole batch.
    """
    rewards = np.zeros(len(completions), np.float32)
    errors = 0
    for i, completion in enumerate(completions):
        try:
            rewards[i] = task.reward(problems[i // group], completion)
        except Exception as e:  # noqa: BLE001 - any failure of user reward code is counted, not fatal
            if errors == 0:
                log.warning("reward function raised %s: %s (scored 0; counted in reward/errors)", type(e).__name__, e)
            errors += 1
    return rewards, errors


class ByteTokenizer:
    """UTF-8 bytes plus PAD, BOS and EOS: any text, no files, for models trained from scratch."""

    PAD, BOS, EOS = 0, 1, 2
    _OFFSET = 3

    @property
    def vocab_size(self) -> int:
        return self._OFFSET + 256

    @property
    def pad_id(self) -> int:
        return self.PAD

    @property
    def eos_id(self) -> int:
        return self.EOS

    @property
    def eos_ids(self) -> tuple[int, ...]:
        return (self.EOS,)

    def encode(self, text: str) -> list[int]:
        return [b + self._OFFSET for b in text.encode("utf-8")]

    def encode_prompt(self, text: str, *, chat: bool) -> list[int]:
        """BOS + the text's bytes; there is no chat template to apply."""
        if chat:
            raise ValueError("the byte tokenizer has no chat template (task.chat_template needs model.hf_path)")
        return [self.BOS] + self.encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        """Text up to the first EOS; specials dropped, invalid UTF-8 replaced."""
        out = bytearray()
        for i in ids:
            i = int(i)
            if i == self.EOS:
                break
            if i >= self._OFFSET:
                out.append(i - self._OFFSET)
        return out.decode("utf-8", errors="replace")
