"""The embedded default task: integer arithmetic with an exact-match reward.

Generated in-process, so the demo needs no download. With `task.scratchpad` an addition
is worked column by column before the answer (10 tokens per digit, for a demo whose
generation is long: configs/demo_long.yaml), and a multiplication writes each partial
product and the running sum (configs/testbed_mul.yaml). Problems are drawn from a seeded
stream indexed by the actor step (resuming is just remembering the step), or with
`task.train_size` from a finite pool visited in epochs. The test split (`eval_size`) and the
validation split (`validation_size`) are fixed by `data_seed` and never drawn for training.

How the splits are made is `task.splits`. `fixed` deals every split from one seeded shuffle of a
set of distinct problems that no split size changes: test, validation, the warm start's own split
(`warmstart_size`), then the training pool, so a pool's size moves nothing else and a smaller pool
is the first problems of a larger one. `dealt`, the layout before issue 49 that the committed sweep
files pin, deals the three splits from one draw of their summed sizes (so `train_size` moves the
held-out splits), and its warm start draws from the training pool or stream.
"""

from __future__ import annotations

import dataclasses
import operator

import numpy as np

from jaxreplay.config import Config, ConfigError, TaskConfig
from jaxreplay.tasks.base import EpochPool

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
    if t.scratchpad:
        require(set(t.operations) in ({"+"}, {"*"}), "task.scratchpad",
                "works additions (columns) or multiplications (partial products), one at a time: set "
                "task.operations to [\"+\"] or [\"*\"]")
        need = completion_length(t)
        require(c.sampling.max_new_tokens >= need, "sampling.max_new_tokens",
                f"{c.sampling.max_new_tokens} cannot hold a worked {t.max_digits}-digit "
                f"{'multiplication' if '*' in t.operations else 'addition'}: task.scratchpad needs {need} tokens")
    n = problem_count(t)
    if t.splits == "fixed":
        require(t.warmstart_size > 0 or c.warmstart.steps == 0, "task.warmstart_size",
                "must be positive with task.splits=fixed and a warm start (warmstart.steps > 0): the warm start "
                "draws its demonstrations from that split")
        total = t.eval_size + t.validation_size + t.warmstart_size + t.train_size
        universe = universe_size(t)
        require(total <= universe, "task.train_size",
                f"{total} problems (task.eval_size + task.validation_size + task.warmstart_size + task.train_size) "
                f"do not fit the {universe} distinct problems task.splits=fixed deals its splits from (three "
                f"quarters of the {n} the digit settings give, at most {UNIVERSE_CAP}): lower them or raise "
                "task.max_digits")
        return
    held_out = t.eval_size + t.validation_size
    require(held_out < n, "task.eval_size",
            f"{held_out} held-out problems (task.eval_size + task.validation_size) would take all {n} problems of "
            f"{t.min_digits} to {t.max_digits} digits with {', '.join(dict.fromkeys(t.operations))}, leaving none to "
            f"train on: lower them below {n} or raise task.max_digits")
    # Distinct problems are drawn by rejection, at most 50 draws per problem wanted: plenty while they take
    # at most three quarters of the space.
    require(not (t.validation_size or t.train_size) or held_out + t.train_size <= 3 * n // 4, "task.train_size",
            f"{t.train_size} training problems beside {held_out} held-out ones need more than three quarters of the "
            f"{n} distinct problems the digit settings give: lower task.train_size or raise task.max_digits")


def problem_count(config: TaskConfig) -> int:
    """How many distinct problems the settings can produce (operands of min..max digits)."""
    lowest = 0 if config.min_digits == 1 else 10 ** (config.min_digits - 1)
    return len(set(config.operations)) * (10 ** config.max_digits - lowest) ** 2


UNIVERSE_CAP = 1 << 16


def universe_size(config: TaskConfig) -> int:
    """How many distinct problems `task.splits=fixed` deals its splits from: three quarters of all
    (distinct problems are drawn by rejection), at most `UNIVERSE_CAP`. No split size enters it, so
    that none moves another."""
    return min(3 * problem_count(config) // 4, UNIVERSE_CAP)


def completion_length(config: TaskConfig) -> int:
    """Tokens of the longest correct completion, EOS included: the (reversed) answer with its
    sign, after the scratchpad (a sum's columns of 9 tokens, a product's rows of 3w + 5)."""
    ops, width = config.operations, config.max_digits
    digits = 2 * width if "*" in ops else width + 1
    worked = 0
    if config.scratchpad:  # "d*PPPP=SSSSSS" a row for products (partial w+1 digits, sum 2w), "a+b+c=ss" for sums
        worked = width * (3 * width + 5) if "*" in ops else 9 * width
    return worked + digits + ("-" in ops) + 1


def prompt_length(config: TaskConfig) -> int:
    """BOS + two zero-padded operands + operator + '='."""
    return 1 + 2 * config.max_digits + 2


class CharTokenizer:
    """Digits, operators, the scratchpad's separators and three specials; small enough for a
    32-entry vocabulary."""

    PAD, BOS, EOS = 0, 1, 2
    _CHARS = "0123456789+-*=,:"  # appended to, never reordered: ids stay those of earlier runs

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
    the order in which carries flow: small transformers learn it far faster. With
    `scratchpad` the completion works the problem first. An addition works each column:
    456+789 writes "6+9+0=15,5+8+1=14,4+7+1=12:" before its answer. A multiplication
    writes, for each digit of b (least significant first), a times that digit and the
    running sum of the shifted partial products, both reversed and zero-padded:
    347*026 writes "6*2802=280200,2*4960=220900,0*0000=220900:" before its answer.
    """

    a: int
    op: str
    b: int
    width: int = 1
    reverse: bool = False
    scratchpad: bool = False

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
    def completion(self) -> str:
        """What a correct demonstration writes before EOS: the worked columns (with `scratchpad`), the answer."""
        return self._worked(carries=True) + self.answer

    @property
    def carry_free_completion(self) -> str:
        """The sloppy teacher's completion: every carry in written as 0, and the answer that follows."""
        return self._worked(carries=False) + self.carry_free_answer

    def final_answer(self, text: str) -> str:
        """The answer a completion's text gives: after the last ':' with `scratchpad` (none: no answer)."""
        if not self.scratchpad:
            return text
        _, colon, answer = text.rpartition(":")
        return answer if colon else ""

    def _worked(self, carries: bool) -> str:
        """The scratchpad: columns of a sum, or partial products of a product (`_rows`)."""
        if not self.scratchpad:
            return ""
        if self.op == "*":
            return self._rows(carries)[0]
        a, b, carry, columns = self.a, self.b, 0, []
        for _ in range(self.width):
            total = a % 10 + b % 10 + carry
            columns.append(f"{a % 10}+{b % 10}+{carry}={total:02d}")
            a, b, carry = a // 10, b // 10, total // 10 if carries else 0
        return ",".join(columns) + ":"

    def _rows(self, carries: bool) -> tuple[str, int]:
        """A product's rows, one per digit d of b, least significant first: `d*P=S` with P = a·d
        (every digit product's carry dropped when not `carries`) and S the running sum of the
        shifted partials, both reversed and zero-padded; and the sum they end at."""
        width, b, total, rows = self.width, self.b, 0, []
        for place in range(width):
            digit = b % 10
            partial = self.a * digit if carries else _carry_free_times(self.a, digit)
            total += partial * 10 ** place
            rows.append(f"{digit}*{_reversed(partial, width + 1)}={_reversed(total, 2 * width)}")
            b //= 10
        return ",".join(rows) + ":", total

    @property
    def carry_free_answer(self) -> str:
        """The classic slip: carries forgotten. A sum's columns are added mod 10; a product's
        partial products drop their digit products' carries (the rows still add up)."""
        if self.op == "*":
            return self._write(self._rows(carries=False)[1])
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


def _reversed(value: int, width: int) -> str:
    """`value` zero-padded to `width` digits, least significant first."""
    return f"{value:0{width}d}"[::-1]


def _carry_free_times(a: int, digit: int) -> int:
    """a · digit with every digit product's carry dropped: each digit of a becomes (a_i · digit) mod 10."""
    out, place = 0, 1
    while a:
        out += (a % 10 * digit % 10) * place
        a, place = a // 10, place * 10
    return out


class ArithmeticTask:
    """Prompts, rewards, supervised examples and the held-out eval set."""

    def __init__(self, config: TaskConfig):
        self.config = config
        self.tokenizer = CharTokenizer()
        self.prompt_len = prompt_length(config)
        self.answer_len = completion_length(config)
        warm: list[Problem] = []
        if config.splits == "fixed":
            self.eval_problems, self.validation_problems, warm, pool = self._fixed_splits()
        else:
            self.eval_problems, self.validation_problems, pool = self._splits()
        self.warmstart_problems = warm  # the warm start's own split (task.splits=fixed); empty with `dealt`
        self._held_out = frozenset(self.eval_problems) | frozenset(self.validation_problems) | frozenset(warm)
        self._pool = EpochPool(pool) if pool else None
        self._warm = EpochPool(warm) if warm else None

    def _splits(self) -> tuple[list[Problem], list[Problem], list[Problem]]:
        """(test, validation, training pool): distinct problems drawn as one set, then dealt in a
        seeded random order. Drawn one split after another, each excluding the last, a later split
        would lean towards rarer problems wherever draws are not uniform (min_digits < max_digits
        draws the digit count first); dealt, the three are exchangeable. Without a validation split
        or a pool the test split is the set drawn, as it always was."""
        c = self.config
        sizes = (c.eval_size, c.validation_size, c.train_size)
        drawn = self._unique_problems(np.random.default_rng([c.data_seed, 0xE7A1]), sum(sizes))
        if len(drawn) > c.eval_size:
            drawn = [drawn[i] for i in np.random.default_rng([c.data_seed, 0x5A1D]).permutation(len(drawn))]
        test, validation = drawn[:sizes[0]], drawn[sizes[0]:sizes[0] + sizes[1]]
        return test, validation, drawn[sizes[0] + sizes[1]:]

    def _fixed_splits(self) -> tuple[list[Problem], list[Problem], list[Problem], list[Problem]]:
        """(test, validation, warm start, training pool) for `task.splits=fixed`: `universe_size`
        distinct problems drawn with `data_seed`, shuffled, and dealt in that order. The universe
        and its order depend on neither split size, so the pool is dealt last and takes the first
        `train_size` of what is left: a pool never moves a held-out split or the warm start's, and
        a smaller pool is the first problems of a larger one, a uniform sample of it."""
        c = self.config
        keys = self._universe_keys()
        order = np.random.default_rng([c.data_seed, 0xF1ED, 1]).permutation(len(keys))
        sizes = (c.eval_size, c.validation_size, c.warmstart_size, c.train_size)
        cuts = np.cumsum((0, *sizes))
        ops, scale = list(dict.fromkeys(c.operations)), 10 ** c.max_digits
        splits = []
        for lo, hi in zip(cuts[:-1], cuts[1:]):
            split = []
            for key in keys[order[lo:hi]]:
                rest, b = divmod(int(key), scale)
                op, a = divmod(rest, scale)
                split.append(Problem(a, ops[op], b, width=c.max_digits, reverse=c.reverse_answer,
                                     scratchpad=c.scratchpad))
            splits.append(split)
        return tuple(splits)

    def _universe_keys(self) -> np.ndarray:
        """The universe's problems as integers (op · 10^2w + a · 10^w + b), in the order first drawn:
        operand digit counts, operands and operation drawn as `_draw` does, in vectorised batches."""
        c = self.config
        want, ops, scale = universe_size(c), list(dict.fromkeys(c.operations)), 10 ** c.max_digits
        rng = np.random.default_rng([c.data_seed, 0xF1ED, 0])
        keys = np.zeros(0, np.int64)
        for _ in range(64):
            digits = rng.integers(c.min_digits, c.max_digits + 1, size=(2, 1 << 14))
            lo = np.where(digits == 1, 0, 10 ** (digits - 1))
            a, b = rng.integers(lo, 10 ** digits)
            op = rng.integers(0, len(ops), size=a.shape)
            keys = np.concatenate([keys, (op * scale + a) * scale + b])
            _, first = np.unique(keys, return_index=True)
            keys = keys[np.sort(first)]
            if len(keys) >= want:
                return keys[:want]
        raise ValueError(f"drew only {len(keys)} distinct problems of the {want} wanted: raise task.max_digits")

    # -- problem streams ---------------------------------------------------------
    def _draw(self, rng: np.random.Generator) -> Problem:
        c = self.config
        digits = rng.integers(c.min_digits, c.max_digits + 1, size=2)
        lo = np.where(digits == 1, 0, 10 ** (digits - 1))
        a, b = (int(rng.integers(lo[i], 10 ** digits[i])) for i in range(2))
        return Problem(a, str(rng.choice(list(c.operations))), b, width=c.max_digits, reverse=c.reverse_answer,
                       scratchpad=c.scratchpad)

    def _unique_problems(self, rng: np.random.Generator, n: int) -> list[Problem]:
        seen: dict[Problem, None] = {}
        for _ in range(50 * n):
            seen.setdefault(self._draw(rng), None)
            if len(seen) == n:
                return list(seen)
        raise ValueError(f"drew only {len(seen)} distinct problems of the {n} wanted in {50 * n} draws: lower "
                         f"task.eval_size, task.validation_size or task.train_size, or raise task.max_digits")

    def train_problems(self, seed: int, index: int, n: int) -> list[Problem]:
        """The `index`-th batch of training problems: from the pool's epochs with `train_size`, else
        from an endless stream; deterministic, never a held-out problem."""
        if self._pool is not None:
            return self._pool.batch(seed, index, n)
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
        """1.0 for the exact answer followed by EOS, else 0.0. With a scratchpad only the answer
        after the last ':' counts: the worked columns are the policy's to get right or not."""
        ids = [int(i) for i in completion_ids]
        if self.tokenizer.EOS not in ids:
            return 0.0
        return float(problem.final_answer(self.tokenizer.decode(ids)) == problem.answer)

    def supervised_batch(self, seed: int, index: int, n: int, max_new_tokens: int, carry_error: float = 0.0):
        """Demonstrations: prompt + completion + EOS, with a mask over the completion tokens; from the
        warm start's own split with `task.splits=fixed`, else from the training problems.

        With probability `carry_error` a demonstration forgets its carries: a sloppy
        teacher whose systematic slip the verifiable reward of RL can then correct.
        """
        problems = self._warm.batch(seed, index, n) if self._warm is not None else self.train_problems(seed, index, n)
        slips = np.random.default_rng([seed, index, 0x5119]).random(n) < carry_error
        prompts, prompt_mask = self.encode_prompts(problems)
        answers = np.full((n, max_new_tokens), self.tokenizer.PAD, np.int32)
        answer_mask = np.zeros((n, max_new_tokens), bool)
        for i, p in enumerate(problems):
            text = p.carry_free_completion if slips[i] else p.completion
            ids = (self.tokenizer.encode(text) + [self.tokenizer.EOS])[:max_new_tokens]
            answers[i, : len(ids)] = ids
            answer_mask[i, : len(ids)] = True
        tokens = np.concatenate([prompts, answers], axis=1)
        attention_mask = np.concatenate([prompt_mask, answer_mask], axis=1)
        loss_mask = np.concatenate([np.zeros_like(prompt_mask), answer_mask], axis=1)
        return tokens, attention_mask, loss_mask
