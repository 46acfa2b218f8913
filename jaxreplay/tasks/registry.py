"""The task a config names: building it, checking its keys, and its prompt length."""

from typing import Optional

from jaxreplay.config import Config, ConfigError, TaskConfig, owner_check
from jaxreplay.tasks import arithmetic, procedural
from jaxreplay.tasks.arithmetic import ArithmeticTask
from jaxreplay.tasks.base import ByteTokenizer, Task, Tokenizer
from jaxreplay.tasks.datasets import DatasetTask, validate_task_config
from jaxreplay.tasks.procedural import ReasoningGymTask


def make_task(config: TaskConfig, tokenizer: Optional[Tokenizer] = None, *, train: bool = True) -> Task:
    """The task `config.name` selects. Dataset and reasoning_gym tasks tokenize with `tokenizer`
    (the model's, when it comes from Hugging Face), else with bytes; arithmetic has its own.
    `train=False`: evaluation only, no training problem is read or drawn."""
    if config.name == "arithmetic":
        return ArithmeticTask(config)
    if config.name == "guess_digit":
        from jaxreplay.tasks.guess import GuessDigitTask
        return GuessDigitTask(config)
    if config.name == "guess_number":
        from jaxreplay.tasks.guess_number import GuessNumberTask
        return GuessNumberTask(config)
    tokenizer = tokenizer if tokenizer is not None else ByteTokenizer()
    if config.name == "reasoning_gym":
        return ReasoningGymTask(config, tokenizer, train=train)
    return DatasetTask(config, tokenizer, train=train)


@owner_check
def validate_task(c: Config) -> None:
    """The task keys' part of `config.validate`: the source's own rules, then room in the
    model's context for its prompts plus the sampled completion."""
    if c.task.name != "reasoning_gym":
        for key, unset in (("dataset", None), ("dataset_config", {})):
            if getattr(c.task, key) != unset:
                raise ConfigError(f"task.{key}: is for task.name=reasoning_gym only (task.name is {c.task.name})")
    if c.task.name != "arithmetic" and c.task.splits != "dealt":
        raise ConfigError(f"task.splits: is for task.name=arithmetic only (task.name is {c.task.name}); other tasks "
                          "take their splits from their source")
    if c.task.name == "guess_digit":
        if not c.environment.name:
            raise ConfigError("task.name: guess_digit is scored by its environment: set environment.name: guess_digit")
    elif c.task.name == "guess_number":
        from jaxreplay.tasks import guess_number
        guess_number.validate_config(c)
    elif c.task.name == "arithmetic":
        arithmetic.validate_config(c)
    elif c.task.name == "reasoning_gym":
        procedural.validate_config(c)
    else:
        validate_task_config(c)
    m, new, p = c.model.max_seq_len, c.sampling.max_new_tokens, prompt_len(c.task)
    if m < p + new:
        raise ConfigError(f"model.max_seq_len: {m} is too short for prompts of {p} tokens plus "
                          f"sampling.max_new_tokens={new}")


def prompt_len(config: TaskConfig) -> int:
    """Tokens in every (left-padded) prompt row of the task, known from the config alone."""
    if config.name == "guess_digit":
        return 2  # GuessDigitTask.prompt_len: its first observation, `:`
    if config.name == "guess_number":
        return 6  # GuessNumberTask.prompt_len: its widest first observation, `99,99:`
    return arithmetic.prompt_length(config) if config.name == "arithmetic" else config.max_prompt_len
