"""reasoning-gym's procedural generators as a task (`task.name: reasoning_gym`, the reasoning_gym extra).

A generator draws its item i with Random(seed + i), so nearby seeds share almost every item:
the test, validation and training splits draw from seeds `SPLIT_STRIDE` apart, far more than
any split draws, and a question already in a held-out split is dropped from the later ones
(generators repeat by chance), so the three are disjoint. Each split is a fixed list; the
training pool is visited in epochs (`EpochPool`, through `DatasetTask`, whose tokenization
and batching this task shares).

The reward is 1 only for an exact answer: `score_answer(answer, entry) == 1.0`, never the
partial credit it gives an answer that merely contains the right one. The answer is the text
inside the completion's last `<answer>...</answer>` (the format reasoning-gym's own prompts
ask for), else the whole completion; either stripped of surrounding whitespace.

`import reasoning_gym` imports every one of its generators (sympy, matplotlib, ...): seconds,
paid only by a config that names this task.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import re
from typing import Any, Optional, Sequence

from jaxreplay.config import Config, ConfigError, TaskConfig, did_you_mean
from jaxreplay.tasks.base import EpochPool
from jaxreplay.tasks.datasets import DatasetError, DatasetTask, Example, PromptTokenizer, validate_text_prompts

SPLITS = ("test", "validation", "train")  # each split's seed is data_seed + its position here * SPLIT_STRIDE
SPLIT_STRIDE = 2**28  # item i of a split is drawn with seed + i: splits' items never meet below this many draws
MAX_SPLIT = 2**24  # problems a split may ask for: its draws (DRAWS_PER_PROBLEM * n + DRAWS_SLACK) stay below the stride
DRAWS_PER_PROBLEM, DRAWS_SLACK = 4, 64  # distinct questions are sought in at most this many draws
DEFAULT_TRAIN_SIZE = 2048  # task.train_size=0: a pool of this many problems (issue 40's testbed size)
OWN_KEYS = ("seed", "size")  # a generator's settings that this task sets itself
# Generators with a difficulty knob that suit a small model: what an unknown name's error suggests.
EXAMPLES = ("products", "chain_sum", "gcd", "base_conversion", "number_sorting")
ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def _gym():
    """reasoning_gym, imported when first needed: it imports every generator's dependencies (seconds)."""
    return importlib.import_module("reasoning_gym")


def extract_answer(text: str) -> str:
    """The text inside the last `<answer>...</answer>`, else the whole text; stripped."""
    found = ANSWER.findall(text)
    return (found[-1] if found else text).strip()


def validate_config(c: Config) -> None:
    """The reasoning_gym task's part of `config.validate` (through tasks.registry.validate_task).
    Whether reasoning-gym is installed is the machine's check (`config._validate_machine`): where it
    is not, the generator's name and settings are not checked here."""
    t = c.task

    def require(ok: bool, key: str, why: str) -> None:
        if not ok:
            raise ConfigError(f"{key}: {why}")

    require(t.dataset is not None, "task.dataset",
            "task.name=reasoning_gym needs a generator's name, e.g. task.dataset=products")
    for key in ("path", "data_dir", "tfds_name", "prompt_field", "answer_field", "reward"):
        require(getattr(t, key) is None, f"task.{key}",
                "must be null for reasoning_gym (its generator makes the records and scores the answers)")
    for key, split in (("eval_split", "test"), ("train_split", "train")):
        require(getattr(t, key) == split, f"task.{key}",
                f"reasoning_gym's splits are test, validation and train, drawn from task.data_seed: leave it {split}")
    for key in ("eval_size", "validation_size", "train_size"):
        require(getattr(t, key) <= MAX_SPLIT, f"task.{key}", f"at most {MAX_SPLIT} problems a split for reasoning_gym")
    for key in OWN_KEYS:
        require(key not in t.dataset_config, f"task.dataset_config.{key}",
                "is set by this task (seeds from task.data_seed, sizes from task.eval_size, "
                "task.validation_size and task.train_size): remove it")
    validate_text_prompts(c)
    if importlib.util.find_spec("reasoning_gym") is None:
        return
    datasets = _gym().factory.DATASETS
    if t.dataset not in datasets:
        guess = did_you_mean(t.dataset, datasets)
        hint = f"did you mean {guess}?" if guess else f"e.g. {', '.join(EXAMPLES)}; all {len(datasets)} in " \
            "reasoning_gym.factory.DATASETS"
        require(False, "task.dataset", f"{t.dataset!r} is not a reasoning-gym generator ({hint})")
    settings_class = datasets[t.dataset][1]
    known = [f.name for f in dataclasses.fields(settings_class) if f.name not in OWN_KEYS]
    for key in t.dataset_config:
        require(key in known, f"task.dataset_config.{key}",
                f"not a setting of {t.dataset} (its settings: {', '.join(known)})")
    try:
        settings = settings_class(**t.dataset_config)
        if hasattr(settings, "validate"):
            settings.validate()
    except Exception as e:  # noqa: BLE001 - the generator's own check: assertions, and type errors from odd values
        require(False, "task.dataset_config", f"{t.dataset} rejects these settings: {type(e).__name__}: {e}")


def split_seed(config: TaskConfig, split: str) -> int:
    return config.data_seed + SPLITS.index(split) * SPLIT_STRIDE


def draw_split(config: TaskConfig, split: str, n: int, exclude: frozenset[str] = frozenset()):
    """(generator, the first n distinct items of `split`'s seed whose question is not in `exclude`).
    Fewer than n in DRAWS_PER_PROBLEM * n + DRAWS_SLACK draws is an error: the generator's settings
    hold too few distinct questions for the split."""
    draws = DRAWS_PER_PROBLEM * n + DRAWS_SLACK
    generator = _gym().create_dataset(config.dataset, seed=split_seed(config, split), size=draws,
                                      **config.dataset_config)
    items: dict[str, dict[str, Any]] = {}
    for i in range(draws):
        if len(items) == n:
            break
        item = generator[i]
        if item["question"] not in exclude:
            items.setdefault(item["question"], item)
    if len(items) < n:
        raise DatasetError(f"reasoning_gym {config.dataset}: only {len(items)} distinct {split} questions (outside the "
                           f"held-out splits) in {draws} draws, {n} asked: lower the split's size or widen "
                           f"task.dataset_config")
    return generator, list(items.values())


class ReasoningGymTask(DatasetTask):
    """One reasoning-gym generator's test, validation and training splits as a `Task`: prompts and
    batches as `DatasetTask`'s, the reward the generator's exact score."""

    def __init__(self, config: TaskConfig, tokenizer: PromptTokenizer, *, train: bool = True):
        """`train=False`: the held-out splits alone (evaluation never draws a training problem)."""
        self.config, self.tokenizer, self.prompt_len = config, tokenizer, config.max_prompt_len
        self.skipped: dict[str, int] = {}
        self._entries: dict[str, dict[str, Any]] = {}  # question -> item; a question is in one split only
        self.generator, test = draw_split(config, "test", config.eval_size)
        self.eval_problems = self._split("test", test)
        self.validation_problems: list[Example] = []
        if config.validation_size:
            _, validation = draw_split(config, "validation", config.validation_size, frozenset(self._entries))
            self.validation_problems = self._split("validation", validation)
        self.train_examples: list[Example] = []
        if train:
            _, pool = draw_split(config, "train", config.train_size or DEFAULT_TRAIN_SIZE, frozenset(self._entries))
            self.train_examples = self._split("train", pool)
        self._pool: Optional[EpochPool] = EpochPool(self.train_examples) if self.train_examples else None

    def _split(self, split: str, items: Sequence[dict[str, Any]]) -> list[Example]:
        """The split's items as prompts: through the template, tokenized, too long ones skipped (`DatasetTask._encode`)."""
        for item in items:
            self._entries[item["question"]] = item
        return self._encode(split, [(item["question"], str(item["answer"])) for item in items])

    def reward(self, problem: Example, completion_ids: Sequence[int]) -> float:
        """1.0 when the generator scores the extracted answer exactly 1.0, else 0.0 (no partial credit)."""
        answer = extract_answer(self.tokenizer.decode(completion_ids))
        return float(self.generator.score_answer(answer, self._entries[problem.prompt]) == 1.0)
