"""Multi-turn environments: the protocol an environment answers the policy through, and the
registry a config names one from.

An episode is `reset(item, seed)` (the first observation), then one `step(turn_text)` per model
turn until a `Step` says `done`. Environments are plain Python objects: they may block (a tool, a
sandbox, a game engine), so the rollout stage runs their steps off the decode loop with a timeout.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Protocol


@dataclass(frozen=True)
class Message:
    """One message the environment says: the chat format renders it into tokens."""

    role: str  # "system" | "user" | "tool"
    content: str
    name: Optional[str] = None  # the tool's name, for role "tool"


# The values of Step.info["error"] the rollout stage counts in metrics.
STEP_ERRORS = ("exception", "timeout", "malformed_tool_call")


@dataclass(frozen=True)
class Step:
    """The environment's answer to one model turn."""

    observation: tuple[Message, ...] = ()  # what the environment says next; () when done
    reward: float = 0.0
    done: bool = False
    info: Mapping[str, Any] = field(default_factory=dict)  # info["error"] in STEP_ERRORS is counted in metrics


class Environment(Protocol):
    def reset(self, item: Any, seed: int) -> tuple[Message, ...]:
        """The episode's first observation for task item `item`; `seed` fixes any randomness."""
        ...

    def step(self, turn_text: str) -> Step:
        """The answer to the model's decoded turn (its text is for the environment only, never trained)."""
        ...


_ENVIRONMENTS: dict[str, Callable[..., Environment]] = {}


def register_environment(name: str, factory: Callable[..., Environment]) -> None:
    """Makes `name` available to configs; `factory(**options)` returns a fresh environment."""
    if name in _ENVIRONMENTS and _ENVIRONMENTS[name] is not factory:
        raise ValueError(f"environment {name!r} is already registered")
    _ENVIRONMENTS[name] = factory


def environment_names() -> tuple[str, ...]:
    return tuple(sorted(_ENVIRONMENTS))


def make_environment(name: str, options: Optional[Mapping[str, Any]] = None) -> Environment:
    """A fresh environment `name`, built with the config's options."""
    if name not in _ENVIRONMENTS:
        raise ValueError(f"unknown environment {name!r} (registered: {', '.join(environment_names()) or 'none'})")
    return _ENVIRONMENTS[name](**dict(options or {}))
