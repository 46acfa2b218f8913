"""The embedded default task: integer arithmetic with an exact-match reward.

Generated in-process, so the demo needs no download. Problems are drawn from a
seeded stream indexed by the actor step (resuming is just remembering the step);
a fixed held-out eval set is never drawn for training.
"""

from __future__ import annotations

import dataclasses
import operator

import numpy as np

from jaxreplay.config import Config, ConfigError, TaskConfig

_OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul}
MAX_DIGITS = 9


def validate_config(c: Config) -> None:
    """The arithmetic task's part of `config.validate` (through tasks.validate_task)."""
    t = c.task

    def require(ok: bool, key: str, why: str) -> None:
        if not ok:
            raise ConfigError(f"{key}: {why}")

    require(t.reward is None, "task.reward", "must be null for the arithmetic task (it has its own exact match)")
    vocab = CharTokenizer().vocab_size
    require(c.model.vocab_size >= vocab, "model.vocab_size",
            f"{c.model.vocab_size} is smaller than the task tokenizer's vocabulary ({vocab})")
    require(t.min_digits >= 1, "task.min_digits", f"must be >= 1, got {t.min_digits}")
    require(t.max_digits >= t.min_digits, "task.max_digits", f"must be >= task.min_digits ({t.min_digits})")
    require(t.max_digits <= MAX_DIGITS, "task.max_digits", f"at most {MAX_DIGITS} digits are supported")
    require(len(t.operations) > 0, "task.operations", "needs at least one operation")
    for i, op in enumerate(t.operations):
        require(op in _OPS, f"task.operations[{i}]", f"{op[:20]!r} is not one of {', '.join(_OPS)}")
    n = problem_count(t)
    require(t.eval_size < n, "task.eval_size",
            f"{t.eval_size} held-out problems would take all {n} problems of {t.min_digits} to {t.max_digits} "
            f"digits with {', '.join(dict.fromkeys(t.operations))}, leaving none to train on: lower task.eval_size "
            f"below {n} or raise task.max_digits")


def problem_count(config: TaskConfig) -> int:
    """How many distinct problems the settings can produce (operands of min..max digits)."""
    lowest = 0 if config.min_digits == 1 else 10 ** (config.min_digits - 1)
    return len(set(config.operations)) * (10 ** config.max_digits - lowest) ** 2


def prompt_length(config: TaskConfig) -> int:
    """BOS + two zero-padded operands + operator + '='."""
    return 1 + 2 * config.max_digits + 2


class CharTokenizer:
    """Digits, operators and three specials; small enough for a 32-entry vocabulary."""

    PAD, BOS, EOS = 0, 1, 2
    _CHARS = "0123456789+-*="

    def __init__(self):
        self._to_id = {c: i + 3 for i, c in enumerate(self._CHARS)}
        self._to_char = {i: c for c, i in self._to_id.items()}

    @property
    def vocab_size(self) -> int:
        return 3 + len(self._CHARS)

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
        return [self._to_id[c] for c in text]

    def decode(self, ids) -> str:
        """Characters up to the first EOS; pads and unknown specials are dropped."""
        out = []
        for i in ids:
            i = int(i)
            if i == self.EOS:
                break
            out.append(self._to_char.get(i, ""))
        return "".join(out)


@dataclasses.dataclass(frozen=True)
class Problem:
    """`a op b`, written with operands zero-padded to `width` digits.

    With `reverse` the answer is written least significant digit first (sign last),
    the order in which carries flow: small transformers learn it far faster.
    """

    a: int
    op: str
    b: int
    width: int = 1
    reverse: bool = False

    @property
    def text(self) -> str:
        return f"{self.a:0{self.width}d}{self.op}{self.b:0{self.width}d}="

    @property
    def value(self) -> int:
        return _OPS[self.op](self.a, self.b)

    @property
    def answer(self) -> str:
        return self._write(self.value)

    @property
    def carry_free_answer(self) -> str:
        """The classic slip: every column summed mod 10, carries forgotten (addition only)."""
        if self.op != "+":
            return self.answer
        a, b, total, place = self.a, self.b, 0, 1
        while a or b:
            total += ((a % 10 + b % 10) % 10) * place
            a, b, place = a // 10, b // 10, place * 10
        return self._write(total)

    def _write(self, v: int) -> str:
        if not self.reverse:
            return str(v)
        return str(abs(v))[::-1] + ("-" if v < 0 else "")


class ArithmeticTask:
    """Prompts, rewards, supervised examples and the held-out eval set."""

    def __init__(self, config: TaskConfig):
        self.config = config
        self.tokenizer = CharTokenizer()
        self.prompt_len = prompt_length(config)
        answer_digits = 2 * config.max_digits if "*" in config.operations else config.max_digits + 1
        self.answer_len = answer_digits + ("-" in config.operations) + 1  # + sign, + EOS
        eval_rng = np.random.default_rng([config.data_seed, 0xE7A1])
        self.eval_problems = self._unique_problems(eval_rng, config.eval_size)
        self._held_out = frozenset(self.eval_problems)

    # -- problem streams ---------------------------------------------------------
    def _draw(self, rng: np.random.Generator) -> Problem:
        c = self.config
        digits = rng.integers(c.min_digits, c.max_digits + 1, size=2)
        lo = np.where(digits == 1, 0, 10 ** (digits - 1))
        a, b = (int(rng.integers(lo[i], 10 ** digits[i])) for i in range(2))
        return Problem(a, str(rng.choice(list(c.operations))), b, width=c.max_digits, reverse=c.reverse_answer)

    def _unique_problems(self, rng: np.random.Generator, n: int) -> list[Problem]:
        seen: dict[Problem, None] = {}
        for _ in range(50 * n):
            seen.setdefault(self._draw(rng), None)
            if len(seen) == n:
                break
        return list(seen)

    def train_problems(self, seed: int, index: int, n: int) -> list[Problem]:
        """The `index`-th batch of the training stream: deterministic, never an eval problem."""
        rng = np.random.default_rng([seed, index])
        out = []
        while len(out) < n:
            p = self._draw(rng)
            if p not in self._held_out:
                out.append(p)
        return out

    # -- encoding ----------------------------------------------------------------
    def encode_prompts(self, problems: list[Problem]) -> tuple[np.ndarray, np.ndarray]:
        """Left-padded prompt tokens [n, prompt_len] and their mask."""
        tokens = np.full((len(problems), self.prompt_len), self.tokenizer.PAD, np.int32)
        for i, p in enumerate(problems):
            ids = [self.tokenizer.BOS] + self.tokenizer.encode(p.text)
            tokens[i, self.prompt_len - len(ids):] = ids
        return tokens, tokens != self.tokenizer.PAD

    def reward(self, problem: Problem, completion_ids) -> float:
        """1.0 for the exact answer followed by EOS, else 0.0."""
        ids = [int(i) for i in completion_ids]
        if self.tokenizer.EOS not in ids:
            return 0.0
        return float(self.tokenizer.decode(ids) == problem.answer)

    def supervised_batch(self, seed: int, index: int, n: int, max_new_tokens: int, carry_error: float = 0.0):
        """Demonstrations: prompt + answer + EOS, with a mask over the answer tokens.

        With probability `carry_error` a demonstration forgets its carries: a sloppy
        teacher whose systematic slip the verifiable reward of RL can then correct.
        """
        problems = self.train_problems(seed, index, n)
        slips = np.random.default_rng([seed, index, 0x5119]).random(n) < carry_error
        prompts, prompt_mask = self.encode_prompts(problems)
        answers = np.full((n, max_new_tokens), self.tokenizer.PAD, np.int32)
        answer_mask = np.zeros((n, max_new_tokens), bool)
        for i, p in enumerate(problems):
            text = p.carry_free_answer if slips[i] else p.answer
            ids = (self.tokenizer.encode(text) + [self.tokenizer.EOS])[:max_new_tokens]
            answers[i, : len(ids)] = ids
            answer_mask[i, : len(ids)] = True
        tokens = np.concatenate([prompts, answers], axis=1)
        attention_mask = np.concatenate([prompt_mask, answer_mask], axis=1)
        loss_mask = np.concatenate([np.zeros_like(prompt_mask), answer_mask], axis=1)
        return tokens, attention_mask, loss_mask
