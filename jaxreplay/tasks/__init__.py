"""Prompt sources and verifiable rewards."""

from typing import Optional

from jaxreplay.config import TaskConfig
from jaxreplay.tasks.arithmetic import ArithmeticTask, CharTokenizer, Problem
from jaxreplay.tasks.base import ByteTokenizer, Task, Tokenizer, score
from jaxreplay.tasks.datasets import DatasetError, DatasetTask


def make_task(config: TaskConfig, tokenizer: Optional[Tokenizer] = None, *, train: bool = True) -> Task:
    """The task `config.name` selects. Dataset tasks tokenize with `tokenizer` (the model's,
    when it comes from Hugging Face), else with bytes; arithmetic has its own. `train=False`:
    evaluation only, a dataset's training split is never read."""
    if config.name == "arithmetic":
        return ArithmeticTask(config)
    return DatasetTask(config, tokenizer if tokenizer is not None else ByteTokenizer(), train=train)


__all__ = ["ArithmeticTask", "ByteTokenizer", "CharTokenizer", "DatasetError", "DatasetTask", "Problem", "Task",
           "Tokenizer", "make_task", "score"]
