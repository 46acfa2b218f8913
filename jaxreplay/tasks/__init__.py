"""Prompt sources and verifiable rewards."""

from jaxreplay.config import TaskConfig
from jaxreplay.tasks.arithmetic import ArithmeticTask, CharTokenizer, Problem


def make_task(config: TaskConfig) -> ArithmeticTask:
    if config.name == "arithmetic":
        return ArithmeticTask(config)
    raise ValueError(f"task.name: unknown task {config.name!r}")


__all__ = ["ArithmeticTask", "CharTokenizer", "Problem", "make_task"]
