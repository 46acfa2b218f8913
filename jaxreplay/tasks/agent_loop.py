"""Episodes from an outside agent loop (`environment.name: agent_loop`): the protocol a harness plays by.

A harness is the user's own agent loop (a verifiers environment's rollout, an OpenEnv harness, a
plain script): `harness(item, seed, endpoint)` plays one episode of task item `item` by calling the
model at `endpoint` (the trainer's own OpenAI-compatible server, serve/episodes.py) as often as it
likes, adding its own tokens (tool results, user turns) between calls, and returns the episode's
reward. Every call names its episode with the `X-Episode-Id` header (or an `episode_id` body
field), which `endpoint.headers` carries. Each call's prompt must extend the ids of the one before
it, the ids it got back included (token in, token out; docs/serving.md): the trainer makes one
row of the episode, the engine's draws trained, the harness's tokens attended only.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Callable, Mapping, Optional

from jaxreplay.tasks.environment import register_environment
from jaxreplay.tasks.tools import CALL_FORMATS

NAME = "agent_loop"
EPISODE_HEADER = "X-Episode-Id"  # the header a call names its episode with
EPISODE_FIELD = "episode_id"  # or this body field (openai's extra_body), where a harness cannot set headers


@dataclasses.dataclass(frozen=True)
class Endpoint:
    """Where a harness reaches the model for one episode."""

    base_url: str  # e.g. http://127.0.0.1:PORT/v1, as an OpenAI client takes it
    model: str  # the model id the server answers to
    episode_id: str
    token: Optional[str] = None  # the bearer token, where the server needs one

    @property
    def root(self) -> str:
        """The server's root, where vLLM's token-in/token-out route lies (`/inference/v1/generate`)."""
        return self.base_url[:-len("/v1")] if self.base_url.endswith("/v1") else self.base_url

    @property
    def headers(self) -> dict[str, str]:
        """The headers every call of this episode sends (openai: `default_headers=`)."""
        auth = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        return {EPISODE_HEADER: self.episode_id, **auth}


Harness = Callable[[Any, int, Endpoint], float]


def load_harness(name: str) -> Harness:
    """`package.module:function`, imported."""
    module, _, attr = name.partition(":")
    if not module or not attr:
        raise ValueError(f"harness {name!r} must be package.module:function")
    try:
        harness = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"harness {name!r}: cannot import it ({e})") from None
    if not callable(harness):
        raise ValueError(f"harness {name!r} is not callable")
    return harness


@dataclasses.dataclass(frozen=True)
class AgentLoop:
    """`environment.options` of an agent-loop run, checked once at the config's edge: the harness
    (`package.module:function`), the address the trainer's endpoint binds (loopback, any free port
    by default), `lockstep`, the tool-call format, and `harness_options`, keyword arguments each
    harness call gets."""

    harness: str = ""
    host: str = "127.0.0.1"
    port: int = 0
    # the engine decodes no chunk while a harness owes its next call: runs (and resumes) draw the same tokens
    # whatever the harnesses' latency; off, a slow harness's row resumes when its call comes (more throughput)
    lockstep: bool = False
    # the model family's tool-call format the chat route parses `tool_calls` in (tasks/tools.py CALL_FORMATS)
    call_format: str = "qwen"
    harness_options: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        if not self.harness:
            raise ValueError("environment.options.harness: give the agent loop as package.module:function")
        load_harness(self.harness)
        if not isinstance(self.port, int) or not 0 <= self.port < 65536:
            raise ValueError(f"environment.options.port must be a port number (0: any free one), got {self.port!r}")
        if self.call_format not in CALL_FORMATS:
            raise ValueError(f"environment.options.call_format: {self.call_format!r} is not one of {sorted(CALL_FORMATS)}")
        if not isinstance(self.harness_options, Mapping):
            raise ValueError("environment.options.harness_options must be a mapping")

    def bound(self) -> Callable[[Any, int, Endpoint], float]:
        """The harness with its options bound."""
        harness, options = load_harness(self.harness), dict(self.harness_options)
        return lambda item, seed, endpoint: harness(item, seed, endpoint, **options)


def is_agent_loop(environment_name: str) -> bool:
    return environment_name == NAME


register_environment(NAME, AgentLoop)
